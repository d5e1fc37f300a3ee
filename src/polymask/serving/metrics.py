"""Prometheus metrics of ``polymask serve`` (``prometheus_client``, own registry).

| metric | type | labels | meaning |
|---|---|---|---|
| ``polymask_requests_total`` | counter | route, status | HTTP requests answered |
| ``polymask_request_errors_total`` | counter | route, status | of those, answered 4xx/5xx |
| ``polymask_request_seconds`` | histogram | route | whole request, seconds |
| ``polymask_phase_seconds`` | histogram | phase | ``queue`` (longest wait of a request's inputs), ``tokenize``, ``compute`` (its batch's run), seconds |
| ``polymask_batch_size`` | histogram | | inputs per batch |
| ``polymask_tokens_total`` | counter | kind | ``real`` tokens embedded, ``computed`` positions (packed rows, unused tails included) |
| ``polymask_compiles_total`` | counter | phase | XLA compiles: ``warmup``; ``serving`` (stays 0 after warm-up) |
| ``polymask_queue_depth`` | gauge | | inputs waiting for a batch |
| ``polymask_inflight_requests`` | gauge | | embedding requests being handled |
| ``polymask_ready`` | gauge | | 1 once warm |
| ``polymask_failed_inputs_total`` | counter | | inputs whose embedding raised (isolated from their batch) |
"""

from __future__ import annotations

from collections.abc import Callable

from .batcher import BatchReport

__all__ = ["ServerMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    """The server's metrics in a registry of their own (several servers in one
    process do not collide). ``render()`` gives the exposition text and its
    content type."""

    def __init__(self, queue_depth: Callable[[], float] = lambda: 0.0):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("polymask_requests", "HTTP requests answered, by route and "
                                "status", ["route", "status"], registry=r)
        self.errors = Counter("polymask_request_errors", "HTTP requests answered with an "
                              "error (4xx, 5xx), by route and status", ["route", "status"],
                              registry=r)
        self.latency = Histogram("polymask_request_seconds", "Request latency, seconds",
                                 ["route"], buckets=_LATENCY, registry=r)
        self.phase = Histogram("polymask_phase_seconds", "Time of a request in each phase: "
                               "queue (longest wait of its inputs), tokenize, compute (its "
                               "batch's run), seconds", ["phase"], buckets=_LATENCY,
                               registry=r)
        self.batch_size = Histogram("polymask_batch_size", "Inputs per batch", buckets=_BATCH,
                                    registry=r)
        self.tokens = Counter("polymask_tokens", "Tokens: real (embedded) and computed "
                              "(positions of the packed rows run)", ["kind"], registry=r)
        self.compiles = Counter("polymask_compiles", "XLA compiles, at warm-up and while "
                                "serving (0 after warm-up)", ["phase"], registry=r)
        self.failed_inputs = Counter("polymask_failed_inputs", "Inputs whose embedding "
                                     "raised (isolated from their batch)", registry=r)
        self.queue_depth = Gauge("polymask_queue_depth", "Inputs waiting for a batch",
                                 registry=r)
        self.queue_depth.set_function(queue_depth)
        self.inflight = Gauge("polymask_inflight_requests", "Embedding requests being "
                              "handled", registry=r)
        self.ready = Gauge("polymask_ready", "1 once the program is compiled (warm)",
                           registry=r)
        for kind in ("real", "computed"):
            self.tokens.labels(kind)
        for phase in ("warmup", "serving"):
            self.compiles.labels(phase)

    def observe_batch(self, report: BatchReport, phase: str = "serving") -> None:
        """A batch's size, tokens, compiles (counted under ``phase``:
        ``"warmup"`` before the server is ready) and failures."""
        self.batch_size.observe(report.size)
        self.tokens.labels("real").inc(report.elements)
        self.tokens.labels("computed").inc(report.computed_elements)
        if report.compiles:
            self.compiles.labels(phase).inc(report.compiles)
        if report.failed:
            self.failed_inputs.inc(report.failed)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        if status >= 400:
            self.errors.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """``(exposition text, content type)`` for ``GET /metrics``."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
