"""The exceptions of ``polymask.serving``: a full queue and a closed batcher."""

from __future__ import annotations

__all__ = ["QueueFull", "BatcherClosed"]


class QueueFull(RuntimeError):
    """The batcher's queue cannot take the submitted examples now.

    ``retry_after_s`` (seconds, an int >= 1): about how long the queue takes
    to drain at the recent throughput; an HTTP server answers 503 with it as
    ``Retry-After``. ``depth`` and ``capacity``: examples waiting, and the most
    that may wait.
    """

    def __init__(self, depth: int, capacity: int, wanted: int, retry_after_s: int):
        self.depth, self.capacity, self.wanted = depth, capacity, wanted
        self.retry_after_s = int(retry_after_s)
        super().__init__(
            f"the batcher's queue is full: {depth} of {capacity} examples waiting, "
            f"{wanted} more submitted; retry in about {self.retry_after_s} s")


class BatcherClosed(RuntimeError):
    """The batcher was closed: it takes no more examples (and, closed without
    draining, fails the examples still waiting with this)."""
