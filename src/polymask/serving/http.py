"""The HTTP server of ``polymask serve``: a Starlette app over an ``EmbeddingService``.

Routes (``docs/serving.md`` has curl examples):

- ``POST /v1/embeddings``: OpenAI's request and response (``input``,
  ``encoding_format`` float or base64, ``model``, ``usage``); texts longer
  than the model's limit are truncated.
- ``POST /embed``: text-embeddings-inference's (``inputs``, ``normalize``,
  ``truncate``; a text over the limit without ``truncate`` is a 413).
- ``GET /health``: 503 while warming up (the packed program compiling or
  loading), 200 once warm.
- ``GET /metrics``: Prometheus text (``metrics.py``).

Every refused request is a JSON error naming the field (TEI's ``{"error",
"error_type"}`` plus ``"field"`` on ``/embed`` and paths under it, OpenAI's
``{"error": {"message", "type", "param", "code"}}`` on every other path; no
slash redirects: ``/embed/`` is a 404), 4xx for the client's fault, 503 with
``Retry-After`` when warming up or shutting down (``service_unavailable``,
``Unhealthy``) or when the batcher's queue is full (``server_overloaded``,
``Overloaded``); a failure of the server's own is a JSON 500 without a
traceback (logged). Only a request HTTP cannot parse gets uvicorn's plain-text
400.
``listen`` opens the port before any work (a port in use or a host that does
not resolve is an ``OSError`` at once); uvicorn runs the app on it (``run``):
SIGTERM stops accepting connections, lets the requests in flight finish (for
at most ``shutdown_timeout`` seconds; a client stuck sending its body would
hold the server forever), then the lifespan's shutdown drains the batcher and
waits for a warm-up compile still running (the interpreter exiting under XLA
crashes the process), and the process exits.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable

import numpy as np

from .batcher import BatchReport
from .embedding import EmbeddingService, l2_normalize
from .errors import BatcherClosed, QueueFull
from .metrics import ServerMetrics
from .requests import EmbeddingRequest, RequestError, openai_request, parse_json, tei_request

__all__ = ["create_app", "server_metrics", "listen", "run"]

log = logging.getLogger("polymask.serve")


class _Unavailable(Exception):
    """503: not warm yet, or the queue is full (``retry_after`` seconds)."""

    def __init__(self, message: str, retry_after: int, kind: str):
        super().__init__(message)
        self.message, self.retry_after, self.kind = message, max(1, int(retry_after)), kind


def _cancel(gathered: asyncio.Future) -> None:
    """Cancel ``gathered`` (an ``asyncio.gather``) and retrieve its outcome
    (asyncio logs "exception was never retrieved" for a gather whose
    children were cancelled)."""
    gathered.cancel()
    gathered.add_done_callback(lambda f: None if f.cancelled() else f.exception())


class _ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def _client_gone(request) -> None:
    """Return once the client of ``request`` (its body read) has closed its
    connection: the next ASGI message is then ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_body(style: str, status: int, message: str, field: str | None, kind: str) -> dict:
    """``kind`` of a 503: TEI's ``Unhealthy`` (warming up, shutting down) or
    ``Overloaded`` (the queue is full); OpenAI's types are named after it."""
    if style == "tei":
        error_type = (kind if status == 503 else "Validation" if 400 <= status < 500
                      else "Backend")
        return {"error": message, "error_type": error_type, "field": field}
    typ = ("invalid_request_error" if 400 <= status < 500 else
           ("server_overloaded" if kind == "Overloaded" else "service_unavailable")
           if status == 503 else "server_error")
    return {"error": {"message": message, "type": typ, "param": field, "code": None}}


def _route_style(path: str) -> str:
    """The error shape of a path: TEI's under ``/embed``, else OpenAI's."""
    return "tei" if path == "/embed" or path.startswith("/embed/") else "openai"


class _ResponseHeaders:
    """ASGI middleware: the same extra headers on every HTTP response."""

    def __init__(self, app, headers: dict[str, str]):
        self.app = app
        self.headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                        for k, v in headers.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), *self.headers])
            await send(message)

        await self.app(scope, receive, send_with_headers)


def server_metrics(service: EmbeddingService) -> ServerMetrics:
    """A ``ServerMetrics`` fed by ``service``: its queue depth, and its
    batcher's batches (``on_batch``; compiles counted under ``warmup`` until
    the service is ready, ``serving`` after)."""
    metrics = ServerMetrics(lambda: service.batcher.queue_depth)

    def on_batch(report: BatchReport) -> None:
        metrics.observe_batch(report, "serving" if service.ready else "warmup")

    service.batcher.on_batch = on_batch
    return metrics


def create_app(service: EmbeddingService, *, model_name: str, max_inputs: int = 256,
               max_body_bytes: int = 8 << 20, metrics: ServerMetrics | None = None,
               warmup: bool = True, response_headers: dict[str, str] | None = None):
    """The Starlette app of ``polymask serve`` over ``service``.

    Args:
      service: the ``EmbeddingService`` (its batcher's ``on_batch`` should feed
        ``metrics.observe_batch``: ``server_metrics(service)`` wires it).
      model_name: the model's name in OpenAI responses.
      max_inputs: most texts in one request (413 over it; at most the
        batcher's ``max_queue``).
      max_body_bytes: most bytes in a request body (413 over it).
      metrics: a ``ServerMetrics`` (default: a new one).
      warmup: warm the service on a background thread at startup (the app
        answers ``/health`` with 503 meanwhile); False: the caller warms it.
      response_headers: extra headers on every response (the Ray Serve
        deployment names its replica with them).

    Returns:
      A ``starlette.applications.Starlette``; ``app.state.service``,
      ``app.state.metrics``, ``app.state.counts`` (embedding requests
      ``accepted`` into the batcher, ``finished``: their inputs ran, and
      ``cancelled``: their task was cancelled first, by uvicorn's graceful
      shutdown timeout), ``app.state.stop(drain, report=True)`` (what the
      lifespan's shutdown runs: close the service, draining it or not, wait
      for the warm-up thread, ``report``: say how many requests finished;
      idempotent, for a caller whose server skipped the lifespan's shutdown
      or never started).
    """
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    metrics = metrics or ServerMetrics(lambda: service.batcher.queue_depth)
    max_inputs = max(1, min(int(max_inputs), service.batcher.max_queue))
    # (force_quit: 1 once a second Ctrl-C stopped the server at once; _uvicorn_server)
    counts = {"accepted": 0, "finished": 0, "cancelled": 0, "disconnected": 0, "force_quit": 0}

    def error(style, status, message, field=None, kind="", headers=None) -> Response:
        return JSONResponse(_error_body(style, status, message, field, kind), status,
                            headers=headers)

    def instrumented(route: str, style: str,
                     handler: Callable[[Request], Awaitable[Response]]):
        async def endpoint(request: Request) -> Response:
            start = time.perf_counter()
            try:
                response = await handler(request)
            except RequestError as e:
                response = error(style, e.status, e.message, e.field)
            except _Unavailable as e:
                response = error(style, 503, e.message, None, e.kind,
                                 {"Retry-After": str(e.retry_after)})
            except (_ClientGone, ClientDisconnect):
                # the client closed its connection (before its answer, or while
                # sending its body): not a failure of the server's (no 500, no
                # traceback); counted as nginx's 499 "client closed request"
                response = Response(status_code=499)
            except asyncio.CancelledError:
                # uvicorn's graceful-shutdown timeout (its one cancel of a request's
                # task): answer it, where re-raising drops the connection silently
                # and has uvicorn log a traceback per request
                task = asyncio.current_task()
                if task is not None and hasattr(task, "uncancel"):  # (Python 3.11+)
                    task.uncancel()
                why = ("was stopped at once (a second Ctrl-C)" if counts["force_quit"]
                       else "did not finish within its shutdown timeout")
                response = error(style, 503, "the server is shutting down and this request "
                                 f"{why}", None, "Unhealthy", {"Retry-After": "1"})
            except Exception:  # noqa: BLE001 - a JSON 500, the traceback to the log only
                log.exception("polymask serve: %s failed", route)
                response = error(style, 500, "internal error (see the server's log)")
            metrics.observe_request(route, response.status_code, time.perf_counter() - start)
            return response

        return endpoint

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            raise RequestError(413, "body", f"the request body has {length} bytes; this "
                                            f"server takes at most {max_body_bytes}")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > max_body_bytes:
                raise RequestError(413, "body", "the request body is larger than "
                                                f"{max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def embed(request: Request, parse: Callable[[dict], EmbeddingRequest]):
        """``(request, vectors (N, hidden) float32, tokens)`` of an embedding request."""
        if not service.ready:
            raise _Unavailable("the model is warming up (compiling its program); retry "
                               "shortly", 1, "Unhealthy")
        req = parse(parse_json(await read_body(request)))
        metrics.inflight.inc()
        try:
            tok = await run_in_threadpool(service.tokenize, req.texts)
            metrics.phase.labels("tokenize").observe(tok.seconds)
            if not req.truncate:
                for i, cut in enumerate(tok.truncated):
                    if cut:
                        field = req.input_field if req.single else f"{req.input_field}[{i}]"
                        raise RequestError(413, field, f"'{field}' has more than "
                                                       f"{service.max_tokens} tokens (the "
                                                       "model's limit); send \"truncate\": "
                                                       "true to cut it")
            try:
                futures = service.submit(tok.ids)
            except QueueFull as e:
                raise _Unavailable(f"the server is overloaded: {e}", e.retry_after_s,
                                   "Overloaded") from None
            except BatcherClosed:
                raise _Unavailable("the server is shutting down", 1, "Unhealthy") from None
            counts["accepted"] += 1  # queued: it will be answered, shutdown or not
            # (cancelling it cancels the texts not yet in a batch: the batcher skips them)
            gathered = asyncio.ensure_future(asyncio.gather(
                *(asyncio.wrap_future(f) for f in futures), return_exceptions=True))
            gone = asyncio.ensure_future(_client_gone(request))
            try:
                await asyncio.wait((gathered, gone), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the shutdown timeout: answered 503 (instrumented)
                _cancel(gathered)
                counts["cancelled"] += 1
                raise
            finally:
                gone.cancel()
            if not gathered.done():  # its client left: its texts not yet computed are dropped
                _cancel(gathered)
                counts["disconnected"] += 1
                raise _ClientGone()
            results = gathered.result()
            counts["finished"] += 1
            for i, r in enumerate(results):
                if isinstance(r, BaseException):
                    log.error("polymask serve: %s[%d] failed: %s: %s", req.input_field, i,
                              type(r).__name__, r)
                    raise RuntimeError(f"{req.input_field}[{i}] failed")
            timings = [f.timing for f in futures if f.timing is not None]
            if timings:
                metrics.phase.labels("queue").observe(max(t.queue_s for t in timings))
                metrics.phase.labels("compute").observe(max(t.compute_s for t in timings))
            vectors = np.stack(results).astype(np.float32)
            if req.normalize:
                vectors = l2_normalize(vectors)
            return req, vectors, tok.tokens
        finally:
            metrics.inflight.dec()

    async def openai_embeddings(request: Request) -> Response:
        req, vectors, tokens = await embed(request, lambda obj: openai_request(
            obj, max_inputs=max_inputs, hidden_size=service.hidden_size))
        if req.encoding_format == "base64":
            embs = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                    for v in vectors]
        else:
            embs = vectors.tolist()
        return JSONResponse({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e}
                     for i, e in enumerate(embs)],
            "model": model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def tei_embed(request: Request) -> Response:
        _, vectors, _ = await embed(request, lambda obj: tei_request(obj,
                                                                     max_inputs=max_inputs))
        return JSONResponse(vectors.tolist())

    async def health(request: Request) -> Response:
        if not service.ready:
            raise _Unavailable("warming up: compiling the model's program", 1, "Unhealthy")
        return JSONResponse({"status": "ok", "model": model_name,
                             "warmup_compiles": service.warmup_compiles,
                             "warmup_s": round(service.warmup_s, 3)})

    async def metrics_route(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        detail = getattr(exc, "detail", "error")
        message = {404: f"no route {request.url.path} (routes: POST /v1/embeddings, POST "
                        "/embed, GET /health, GET /metrics)",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            status, str(detail))
        metrics.observe_request("other", status, 0.0)
        headers = getattr(exc, "headers", None)
        return error(_route_style(request.url.path), status, message,
                     "path" if status == 404 else "method", headers=headers)

    stopping = threading.Event()
    warm_thread: list[threading.Thread] = []

    def warm() -> None:
        try:
            compiles = service.warmup()
        except Exception as e:  # noqa: BLE001 - stays unhealthy; the log says why
            if not (stopping.is_set() and isinstance(e, BatcherClosed)):  # else: stopped
                log.exception("polymask serve: warm-up failed")
            return
        metrics.compiles.labels("warmup").inc(compiles)
        if stopping.is_set():
            return
        metrics.ready.set(1)
        print(f"polymask serve: ready ({compiles} XLA compile{'s' * (compiles != 1)} in "
              f"{service.warmup_s:.1f} s of warm-up)", file=sys.stderr, flush=True)

    stop_lock = threading.Lock()

    def stop(drain: bool = True, report: bool = True) -> None:
        with stop_lock:
            if stopping.is_set():
                return
            stopping.set()
        metrics.ready.set(0)
        # the batcher's worker (its last batch) and the warm-up (its compile) end
        # before the interpreter does: exiting under a thread inside XLA crashes it
        service.close(drain)
        for t in warm_thread:
            if t.is_alive():
                print("polymask serve: waiting for the warm-up compile to finish (XLA "
                      "cannot be interrupted)", file=sys.stderr, flush=True)
                t.join()
        if not report:
            return
        by = "a second Ctrl-C" if counts["force_quit"] else "the shutdown timeout"
        cancelled = (f"; {counts['cancelled']} cancelled by {by}" if counts["cancelled"]
                     else "")
        if counts["disconnected"]:
            cancelled += (f"; {counts['disconnected']} dropped, their client gone before "
                          "the answer")
        print(f"polymask serve: stopped; {counts['finished']} of {counts['accepted']} "
              f"accepted embedding requests finished{cancelled}", file=sys.stderr,
              flush=True)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warmup:
            # not a daemon: the interpreter waits for it at exit whatever ends the server
            warm_thread.append(threading.Thread(target=warm, name="polymask-warmup"))
            warm_thread[0].start()
        elif service.ready:
            metrics.ready.set(1)
        yield
        # uvicorn has finished the requests in flight: drain what is left and stop
        await run_in_threadpool(stop, True)

    routes = [
        Route("/v1/embeddings", instrumented("/v1/embeddings", "openai", openai_embeddings),
              methods=["POST"]),
        Route("/embed", instrumented("/embed", "tei", tei_embed), methods=["POST"]),
        Route("/health", instrumented("/health", "openai", health), methods=["GET"]),
        Route("/metrics", instrumented("/metrics", "openai", metrics_route), methods=["GET"]),
    ]
    middleware = ([Middleware(_ResponseHeaders, headers=dict(response_headers))]
                  if response_headers else [])
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: http_error})
    # /embed/ is no route: a JSON 404, not Starlette's 307 to /embed (clients
    # that follow it would resend the POST; the others got an empty body)
    app.router.redirect_slashes = False
    app.state.service, app.state.metrics, app.state.counts = service, metrics, counts
    app.state.stop = stop
    return app


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(e: OSError) -> str:
    text = e.strerror or str(e)
    return text[:1].lower() + text[1:]


def listen(host: str, port: int, backlog: int = 2048) -> list[socket.socket]:
    """Listening TCP sockets on ``host``:``port``, one per address ``host``
    resolves to (as uvicorn binds them), for ``run``. Called before the model
    loads, so a port in use fails at once and holds no compile up (the port
    is held from then on; connections wait in the backlog until ``run``).
    ``port`` 0: the system picks a free port (``sockets[0].getsockname()``).

    Raises:
      OSError: ``"cannot listen on HOST:PORT: reason"`` (a host that does not
        resolve, a port in use, an address this machine does not have, a
        port below 1024 without the privilege).
    """
    where = _address(host, port)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as e:
        raise OSError(f"cannot listen on {where}: {_reason(e)}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio: "::" is not also 0.0.0.0
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # every address on the one port picked
                addr = (addr[0], sockets[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
            sock.listen(backlog)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise OSError(f"cannot listen on {where}: {_reason(e)}") from None
    return sockets


class _ForcedStopTraceback(logging.Filter):
    """Drops uvicorn's traceback of the ``KeyboardInterrupt`` / cancellation
    a second Ctrl-C raises into the running server: the stop was asked for,
    and said (``polymask serve: SIGINT again: ...``)."""

    def __init__(self, counts: dict):
        super().__init__()
        self.counts = counts

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.counts.get("force_quit"):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (KeyboardInterrupt, asyncio.CancelledError)):
            return False
        # (starlette's lifespan sends its traceback as text: uvicorn logs that)
        text = str(record.msg).rstrip()
        return not (text.startswith("Traceback") and text.endswith(
            ("KeyboardInterrupt", "CancelledError")))


def _uvicorn_server(config, shutdown_timeout: float | None, counts: dict):
    """A ``uvicorn.Server`` that says what a stop signal does (uvicorn's
    ``handle_exit``: the first starts the graceful shutdown, a second SIGINT
    stops waiting for the connections, a second SIGTERM changes nothing);
    ``counts["force_quit"]`` (the app's) is set by that second SIGINT."""
    import uvicorn

    class Server(uvicorn.Server):
        interrupted = False  # a SIGINT came (run raises KeyboardInterrupt after it)

        def handle_exit(self, sig, frame) -> None:
            again = self.should_exit
            self.interrupted |= sig == signal.SIGINT
            super().handle_exit(sig, frame)
            name = signal.Signals(sig).name
            bound = ("until the requests in flight finish" if shutdown_timeout is None else
                     f"for at most {shutdown_timeout:g} s for the requests in flight")
            if not again:
                text = f"stopping ({name}): new connections refused; waiting {bound}"
            elif self.force_exit:
                counts["force_quit"] = 1
                text = (f"{name} again: not waiting for the connections; the queue is "
                        "not drained")
            else:
                text = f"{name} again: already stopping, waiting {bound}"
            # not print: the handler may run while the main thread is inside a print
            os.write(2, f"polymask serve: {text}\n".encode())

    return Server(config)


def run(service: EmbeddingService, *, model_name: str, host: str = "127.0.0.1",
        port: int = 8000, sockets: list[socket.socket] | None = None, max_inputs: int = 256,
        max_body_bytes: int = 8 << 20, log_level: str = "warning",
        shutdown_timeout: float | None = 30.0) -> None:
    """Serve ``service`` with uvicorn until SIGTERM or SIGINT (graceful: new
    connections are refused, the requests in flight finish, then the batcher
    drains).

    Args:
      sockets: listening sockets from ``listen(host, port)`` (default: those,
        opened here); ``host`` and ``port`` then only name the address.
      shutdown_timeout: most seconds the graceful shutdown waits for the
        requests in flight (uvicorn's ``timeout_graceful_shutdown``); those
        still running are cancelled (a client stuck sending its body would
        hold the server forever). None: no limit.

    Raises:
      OSError: cannot listen on ``host``:``port`` (``listen``'s message).
      KeyboardInterrupt: after SIGINT's shutdown (uvicorn raises the signal
        again once stopped; SIGTERM's ends the process with SIGTERM).
    """
    import uvicorn

    sockets = sockets or listen(host, port)
    metrics = server_metrics(service)
    app = create_app(service, model_name=model_name, max_inputs=max_inputs,
                     max_body_bytes=max_body_bytes, metrics=metrics)
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout)
    server = _uvicorn_server(config, shutdown_timeout, app.state.counts)
    quiet = _ForcedStopTraceback(app.state.counts)
    for name in ("uvicorn.error", "uvicorn"):
        logging.getLogger(name).addFilter(quiet)
    where = _address(host, sockets[0].getsockname()[1])  # the port picked for port 0
    print(f"polymask serve: http://{where} ({model_name}; warming up, /health is "
          f"503 until ready)", file=sys.stderr, flush=True)
    try:
        server.run(sockets=sockets)
        if server.interrupted:
            # uvicorn raises a captured SIGINT again once stopped; in asyncio's
            # own SIGINT window that raise can be lost (seen under load: exit 0)
            raise KeyboardInterrupt
    except OSError as e:
        if server.started:
            raise
        app.state.stop(drain=False, report=False)  # it never served: nothing to report
        raise OSError(f"cannot listen on {where}: {_reason(e)}") from None
    finally:
        # a second SIGINT skips the lifespan's shutdown: no thread in XLA at exit
        app.state.stop(drain=False)
