"""sentence-transformers behind the ASGI stack of ``polymask serve`` (Starlette + uvicorn),
with a length-sorting micro-batcher: the baseline "what a user would write" of
``serve_load.py --server st``.

Each text of a request goes to one queue. A worker thread takes the first
waiting text, waits up to ``--max-wait-ms`` (5 ms) for more or until
``--batch-size`` (32) are waiting, then takes every text waiting (at most
``--max-pending``), sorts them by length and encodes them in chunks of
``--batch-size`` (``SentenceTransformer.encode``, L2-normalised); each chunk's
callers get their vectors as soon as the chunk is done. Routes: ``POST
/v1/embeddings`` (OpenAI's shapes: ``input`` a string or an array of strings;
float vectors) and ``GET /health`` (200 once the model is loaded and has
encoded one batch). Binds loopback only.

    python benchmarks/st_server.py --model DIR --port 8001 --threads 2

Needs torch, sentence-transformers, starlette and uvicorn (a separate
environment: ``serve_load.py --alt-python``). Not a test or CI dependency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import queue
import threading
import time

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class MicroBatcher:
    """Gathers texts from concurrent requests into length-sorted batches, one
    worker thread (the model runs on it; torch's own threads do the math)."""

    def __init__(self, model, batch_size: int = 32, max_wait_ms: float = 5.0,
                 max_pending: int = 256):
        self.model, self.batch_size = model, batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.max_pending = max(max_pending, batch_size)
        self.queue: queue.Queue = queue.Queue()
        self.batches = 0
        self.thread = threading.Thread(target=self._work, name="st-batcher", daemon=True)
        self.thread.start()

    def encode(self, texts: list[str]):
        return self.model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True,
                                 normalize_embeddings=True, show_progress_bar=False)

    async def embed(self, texts: list[str]) -> list:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in texts]
        for text, fut in zip(texts, futures):
            self.queue.put((text, fut, loop))
        return await asyncio.gather(*futures)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(30)

    def _gather(self, first) -> list:
        pending = [first]
        deadline = time.monotonic() + self.max_wait
        while len(pending) < self.batch_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                item = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if item is None:
                self.queue.put(None)
                break
            pending.append(item)
        while len(pending) < self.max_pending:  # everything already waiting
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self.queue.put(None)
                break
            pending.append(item)
        return sorted(pending, key=lambda it: len(it[0]))

    def _work(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
                return
            pending = self._gather(first)
            for i in range(0, len(pending), self.batch_size):
                chunk = pending[i:i + self.batch_size]
                try:
                    vecs = self.encode([t for t, _, _ in chunk])
                    outs = [(fut, loop, v, None) for (_, fut, loop), v in zip(chunk, vecs)]
                except Exception as e:  # noqa: BLE001 - the callers get it
                    outs = [(fut, loop, None, e) for _, fut, loop in chunk]
                self.batches += 1
                for fut, loop, v, e in outs:
                    loop.call_soon_threadsafe(_settle, fut, v, e)


def _settle(fut, value, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def create_app(batcher: MicroBatcher, model_name: str):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def error(status: int, message: str, param: str | None = None):
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                       "param": param, "code": None}}, status)

    async def embeddings(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not JSON", "body")
        inp = body.get("input") if isinstance(body, dict) else None
        if isinstance(inp, str):
            inp = [inp]
        if not isinstance(inp, list) or not inp or not all(isinstance(t, str) for t in inp):
            return error(400, "input must be a string or a non-empty array of strings",
                         "input")
        vecs = await batcher.embed(inp)
        return JSONResponse({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                     for i, v in enumerate(vecs)],
            "model": model_name,
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        })

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": model_name, "batches": batcher.batches})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        batcher.close()

    return Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"]),
                             Route("/health", health, methods=["GET"])],
                     lifespan=lifespan)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a sentence-transformers model directory")
    p.add_argument("--host", default="127.0.0.1", help="loopback only (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--max-pending", type=int, default=256)
    p.add_argument("--model-name", default="sentence-transformers/all-MiniLM-L6-v2")
    args = p.parse_args(argv)
    if args.host not in LOOPBACK:
        p.error("--host: loopback addresses only")

    import torch
    import uvicorn
    from sentence_transformers import SentenceTransformer

    if args.threads:
        torch.set_num_threads(args.threads)
    model = SentenceTransformer(args.model, device="cpu")
    batcher = MicroBatcher(model, args.batch_size, args.max_wait_ms, args.max_pending)
    batcher.encode(["warm-up text"] * 4 + ["a longer warm-up text " * 40])
    print(f"st_server: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"http://{args.host}:{args.port}", flush=True)
    uvicorn.run(create_app(batcher, args.model_name), host=args.host, port=args.port,
                log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
