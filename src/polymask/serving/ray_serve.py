"""``polymask serve`` on Ray Serve: replicas of the same server behind Ray's HTTP proxy.

``deployment(model_dir, num_replicas=2)`` returns a bound Serve application
(``serve.run(app)`` deploys it). Each replica loads one ``SentenceEncoder``,
builds one ``EmbeddingService`` (its ``DynamicBatcher`` over one packed
program), compiles (or loads from the persistent cache) that program in its
constructor, and answers through the Starlette app of ``polymask serve``
(``http.create_app``, the same routes, request parsing, responses and errors),
mounted with ``serve.ingress``: Ray Serve sends a request to a replica only
once it is warm. Every response names its replica (``X-Polymask-Replica``).

``run(app, ...)`` is what ``polymask serve --ray`` does: start or join a Ray
instance, start Serve's HTTP proxy on ``host:port``, deploy, wait for SIGTERM
or SIGINT, shut Serve down. Ray is imported only here, when called (the
``ray`` extra: ``pip install -e ".[ray]"``). ``docs/serving.md``, "Ray
Serve".
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
from typing import Any

__all__ = ["deployment", "run", "REPLICA_HEADER"]

REPLICA_HEADER = "X-Polymask-Replica"
_SERVICE_OPTIONS = ("max_wait_ms", "max_queue", "max_batch_size", "max_batch_tokens",
                    "rows_per_call")


def _import_serve():
    from ..core.errors import install_extra

    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ImportError("polymask.serving.ray_serve needs Ray Serve (the ray extra): "
                          f"{install_extra('ray')}; {e}") from e
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401 - the app of polymask serve
    except ImportError as e:
        raise ImportError(f"polymask.serving.ray_serve needs Starlette and prometheus_client: "
                          f"{install_extra('ray')}; {e}") from e
    return ray, serve


class EmbeddingReplica:
    """One replica: a ``SentenceEncoder`` and an ``EmbeddingService``, warm
    before the constructor returns, behind ``polymask serve``'s app.

    Ray Serve builds it (``deployment`` wraps it with ``serve.ingress``); the
    constructor's arguments are ``deployment``'s.
    """

    async def __init__(self, model_dir: str | None, precision: str, model_name: str | None,
                       max_inputs: int, max_body_bytes: int, cache_dir: str | None,
                       reuse_memory: bool, service_options: dict[str, Any]):
        self.model_name, self.max_inputs, self.max_body_bytes = \
            model_name, max_inputs, max_body_bytes
        # loading and compiling block for seconds: off the replica's event loop
        await asyncio.to_thread(self._load, model_dir, precision, cache_dir, reuse_memory,
                                service_options)

    def _load(self, model_dir, precision, cache_dir, reuse_memory, service_options) -> None:
        if reuse_memory:  # as polymask serve's own process, before JAX allocates
            from ..runners.hostmem import reuse_host_memory

            reuse_host_memory()
        if cache_dir is not None:
            from ..runners.compile_cache import enable_compilation_cache

            enable_compilation_cache(cache_dir)
        from ..models.loader import SentenceEncoder
        from .embedding import EmbeddingService, served_model_name
        from .http import server_metrics

        encoder = SentenceEncoder(model_dir, precision)
        self.model_name = self.model_name or served_model_name(encoder.model_dir)
        self.service = EmbeddingService(encoder, **service_options)
        self.metrics = server_metrics(self.service)
        compiles = self.service.warmup()
        self.metrics.compiles.labels("warmup").inc(compiles)

    def __serve_build_asgi_app__(self):
        """The app of ``polymask serve`` over this replica's (warm) service."""
        from ray import serve

        from .http import create_app

        replica = serve.get_replica_context().replica_tag
        print(f"polymask serve: replica {replica} ready ({self.service.warmup_compiles} XLA "
              f"compiles in {self.service.warmup_s:.1f} s of warm-up)", file=sys.stderr,
              flush=True)
        return create_app(self.service, model_name=self.model_name,
                          max_inputs=self.max_inputs, max_body_bytes=self.max_body_bytes,
                          metrics=self.metrics, warmup=False,
                          response_headers={REPLICA_HEADER: replica})

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a closed batcher is unhealthy
        (Serve replaces the replica)."""
        if self.service.batcher.closed:
            raise RuntimeError("the replica's batcher is closed")


def deployment(model_dir=None, *, num_replicas: int = 2, precision: str = "float32",
               model_name: str | None = None, max_inputs: int = 256,
               max_body_bytes: int = 8 << 20, max_ongoing_requests: int = 64,
               num_cpus: float = 1.0, cache_dir=None, reuse_memory: bool = True,
               name: str = "polymask", **batcher_options):
    """A Ray Serve application: ``num_replicas`` replicas of ``polymask serve``.

    Args:
      model_dir: a BERT-style model directory, as ``polymask serve --model``
        (resolved here; it must exist at that path on the replicas' nodes);
        None: the installed all-MiniLM-L6-v2 (on each replica's node).
      num_replicas: replicas, each with its encoder, batcher and compiled program.
      precision: the encoder's (``"float32"`` or ``"bfloat16"``).
      model_name: ``model`` in OpenAI responses (default as ``polymask serve``).
      max_inputs: texts per request, as ``polymask serve --max-inputs``.
      max_body_bytes: bytes per request body, as ``polymask serve --max-body-bytes``.
      max_ongoing_requests: requests Ray Serve sends one replica at once (its
        default, 5, would cap a replica's batches at 5 requests); the rest
        wait in Serve's queues.
      num_cpus: CPUs Ray reserves per replica.
      cache_dir: a persistent compilation cache directory each replica uses
        (a path on the replicas' nodes); None: none.
      reuse_memory: each replica calls ``polymask.reuse_host_memory()`` first,
        as the CLI does.
      name: the Serve deployment's name.
      **batcher_options: ``EmbeddingService``'s: ``max_wait_ms``,
        ``max_queue``, ``max_batch_size``, ``max_batch_tokens``,
        ``rows_per_call``.

    Returns:
      A bound ``ray.serve.Application``: ``serve.run(app, route_prefix="/")``.

    Raises:
      ImportError: Ray Serve (the ``ray`` extra) or Starlette is not installed.
      TypeError: an unknown batcher option.
      ValueError: ``num_replicas`` or ``max_ongoing_requests`` < 1.
    """
    unknown = sorted(set(batcher_options) - set(_SERVICE_OPTIONS))
    if unknown:
        raise TypeError(f"deployment() got unknown batcher options {unknown}; it takes "
                        f"{list(_SERVICE_OPTIONS)}")
    if int(num_replicas) < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas!r}")
    if int(max_ongoing_requests) < 1:
        raise ValueError(f"max_ongoing_requests must be >= 1, got {max_ongoing_requests!r}")
    _, serve = _import_serve()
    if model_dir is not None:
        model_dir = str(pathlib.Path(model_dir).resolve())
    if cache_dir is not None:
        cache_dir = str(pathlib.Path(cache_dir).expanduser().resolve())
    cls = serve.deployment(
        serve.ingress()(EmbeddingReplica), name=name, num_replicas=int(num_replicas),
        max_ongoing_requests=int(max_ongoing_requests),
        ray_actor_options={"num_cpus": float(num_cpus)})
    return cls.bind(model_dir, precision, model_name, int(max_inputs), int(max_body_bytes),
                    cache_dir, bool(reuse_memory), dict(batcher_options))


def run(app, *, address: str | None = None, host: str = "127.0.0.1", port: int = 8000,
        app_name: str = "polymask") -> None:
    """Deploy ``app`` (from ``deployment``) behind Ray Serve's HTTP proxy on
    ``host:port`` and serve until SIGTERM or SIGINT, then shut Serve down.

    ``address``: a Ray cluster (``"auto"``, ``"ray://host:10001"``); None
    starts a local instance (or uses the one this process initialised). Serve's
    HTTP options are cluster-wide: on a cluster where Serve already runs, its
    proxy keeps the host and port it was started with.
    """
    import signal
    import threading

    ray, serve = _import_serve()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": host, "port": int(port)})
        serve.run(app, name=app_name, route_prefix="/")
        print(f"polymask serve: http://{host}:{port} (Ray Serve, application {app_name!r}; "
              "replicas warm)", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("polymask serve: shutting Ray Serve down", file=sys.stderr, flush=True)
        serve.shutdown()
