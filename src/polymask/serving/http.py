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
uvicorn runs the app (``run``): SIGTERM stops accepting connections, lets the
requests in flight finish (the lifespan's shutdown then drains the batcher),
and exits.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
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

__all__ = ["create_app", "server_metrics", "run"]

log = logging.getLogger("polymask.serve")


class _Unavailable(Exception):
    """503: not warm yet, or the queue is full (``retry_after`` seconds)."""

    def __init__(self, message: str, retry_after: int, kind: str):
        super().__init__(message)
        self.message, self.retry_after, self.kind = message, max(1, int(retry_after)), kind


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
      ``accepted`` into the batcher, and ``finished``: their inputs ran).
    """
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    metrics = metrics or ServerMetrics(lambda: service.batcher.queue_depth)
    max_inputs = max(1, min(int(max_inputs), service.batcher.max_queue))
    counts = {"accepted": 0, "finished": 0}

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
            try:
                results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures),
                                               return_exceptions=True)
            finally:
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

    def warm() -> None:
        try:
            compiles = service.warmup()
        except Exception:  # noqa: BLE001 - stays unhealthy; the log says why
            log.exception("polymask serve: warm-up failed")
            return
        metrics.compiles.labels("warmup").inc(compiles)
        metrics.ready.set(1)
        print(f"polymask serve: ready ({compiles} XLA compile{'s' * (compiles != 1)} in "
              f"{service.warmup_s:.1f} s of warm-up)", file=sys.stderr, flush=True)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warmup:
            threading.Thread(target=warm, name="polymask-warmup", daemon=True).start()
        elif service.ready:
            metrics.ready.set(1)
        yield
        # uvicorn has finished the requests in flight: drain what is left and stop
        metrics.ready.set(0)
        await run_in_threadpool(service.close, True)
        print(f"polymask serve: stopped; {counts['finished']} of {counts['accepted']} "
              "accepted embedding requests finished", file=sys.stderr, flush=True)

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
    return app


def run(service: EmbeddingService, *, model_name: str, host: str = "127.0.0.1",
        port: int = 8000, max_inputs: int = 256, max_body_bytes: int = 8 << 20,
        log_level: str = "warning") -> None:
    """Serve ``service`` with uvicorn until SIGTERM or SIGINT (graceful: the
    requests in flight finish, new connections are refused)."""
    import uvicorn

    metrics = server_metrics(service)
    app = create_app(service, model_name=model_name, max_inputs=max_inputs,
                     max_body_bytes=max_body_bytes, metrics=metrics)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            access_log=False, lifespan="on", timeout_graceful_shutdown=None)
    server = uvicorn.Server(config)
    print(f"polymask serve: http://{host}:{port} ({model_name}; warming up, /health is "
          f"503 until ready)", file=sys.stderr, flush=True)
    server.run()

