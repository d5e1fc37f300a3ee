"""``DynamicBatcher``: concurrent one-example calls gathered into ``ragged_map`` calls.

Callers (threads: ``submit``, ``__call__``, ``map``; asyncio: ``acall``,
``amap``) put examples on one bounded queue. One worker thread takes the
oldest example, waits until ``max_wait_ms`` after it arrived or until a
budget (``max_batch_size`` examples, ``max_batch_elements`` elements) is
full, and runs what it took as one call of a ``polymask.ragged_map`` of the
function: packed rows of one compiled program when the function packs (see
``docs/packing.md``), length buckets otherwise. Each caller's future gets its
own example's result, in the layout the function returns for one example.

A batch that raises is split in halves and each half run again, down to
single examples: an example that fails alone fails only its own caller (its
future gets the exception), and the others get their results (``O(k log N)``
extra calls for ``k`` bad examples in a batch of ``N``).

A full queue raises ``QueueFull`` at submission (nothing is queued); the
worker never blocks a caller's thread or event loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..core.diagnostics import for_one_callers_example, user_call_site
from ..runners.compiling import compile_counter
from ..runners.ragged import RaggedMap
from .errors import BatcherClosed, QueueFull

__all__ = ["DynamicBatcher", "BatchReport", "Timing", "element_count"]


def element_count(example: Any) -> int:
    """Elements of an example: the summed sizes of its array leaves (a token-id
    array of shape ``(n,)`` counts ``n``). The default ``size_of``."""
    return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(example)))


@dataclasses.dataclass(frozen=True)
class Timing:
    """Where one example's time went, in seconds: ``queue_s`` from submission
    to the start of its batch, ``compute_s`` the batch's run (the whole
    ``ragged_map`` call, host packing included); ``batch_size``: examples in
    the batch. Set as ``future.timing`` before the result."""

    queue_s: float
    compute_s: float
    batch_size: int


@dataclasses.dataclass(frozen=True)
class BatchReport:
    """One batch, as passed to ``on_batch`` after it ran.

    Attributes:
      size: examples in the batch.
      elements: their elements (``size_of`` summed: tokens for token ids).
      computed_elements: elements the runner computed for them (packed rows
        or padded buckets, unused tails included; ``stats()`` of the
        ``ragged_map``: ``padded_elements``).
      queue_s: each example's wait, seconds.
      compute_s: the run, seconds (isolating retries included).
      compiles: XLA compiles the run caused on the worker thread (0 once warm).
      failed: examples whose callers got an exception.
      isolated: the batch raised and was split to isolate the failing examples.
    """

    size: int
    elements: int
    computed_elements: int
    queue_s: tuple[float, ...]
    compute_s: float
    compiles: int
    failed: int
    isolated: bool


@dataclasses.dataclass
class _Item:
    example: Any
    size: int
    future: concurrent.futures.Future
    enqueued: float
    site: str  # the submitting caller's line, for its example's errors


def _callers_error(e: BaseException, site: str) -> BaseException:
    """The exception a caller gets for its example (``for_one_callers_example``);
    ``e`` itself if rewording fails: a worker that raises here would leave
    every waiting caller without an answer."""
    try:
        return for_one_callers_example(e, site)
    except Exception:  # noqa: BLE001
        return e


class DynamicBatcher:
    """Serve a one-example function to concurrent callers in ragged batches.

    ``DynamicBatcher(fun, in_specs, broadcast=(params,))``: ``batcher(example)``
    returns ``fun(*broadcast, *example)`` (an example that is not a tuple is
    one argument), as ``ragged_map(fun, in_specs)([example], *broadcast)[0]``
    does, computed in a batch with the examples of other concurrent callers.

    Args:
      fun: a function written for one exact example, or a ``RaggedMap``
        (``polymask.ragged_map(...)``) to use as it is (then ``in_specs`` and
        ``ragged_map_options`` must be left out).
      in_specs: the example arguments' specs, as for ``polymask.ragged_map``.
      broadcast: arguments passed to every call before the example's (model
        parameters), unbatched.
      max_wait_ms: how long the worker waits for more examples after the
        oldest waiting one arrived (milliseconds, >= 0). A batch runs when
        that time has passed or the budget is full.
      max_batch_size: most examples in one batch (>= 1).
      max_batch_elements: most elements (``size_of`` summed, e.g. tokens) in
        one batch; None: no element budget. An example larger than the budget
        runs alone.
      max_queue: most examples waiting (>= 1); a submission that would exceed
        it raises ``QueueFull``.
      size_of: ``example -> int`` elements of an example (default
        ``element_count``: the sizes of its array leaves summed).
      on_batch: called on the worker thread with a ``BatchReport`` after each
        batch (metrics); its exceptions are ignored.
      name: the worker thread's name.
      **ragged_map_options: passed to ``polymask.ragged_map`` (``layout``,
        ``row_size``, ``rows_per_call``, ``buckets``, ...); ``numpy_outputs``
        defaults to True here (results are host arrays).

    Raises:
      ValueError: a budget, the wait or the queue size out of range, or
        ``in_specs``/options given with a ``RaggedMap``.
    """

    def __init__(self, fun: Callable | RaggedMap, in_specs=None, *, broadcast: Sequence = (),
                 max_wait_ms: float = 5.0, max_batch_size: int = 256,
                 max_batch_elements: int | None = None, max_queue: int = 4096,
                 size_of: Callable[[Any], int] | None = None,
                 on_batch: Callable[[BatchReport], None] | None = None,
                 name: str = "polymask-batcher", **ragged_map_options):
        if isinstance(fun, RaggedMap):
            if in_specs is not None or ragged_map_options:
                raise ValueError("DynamicBatcher(RaggedMap): in_specs and ragged_map "
                                 "options belong to the RaggedMap")
            self.runner = fun
        else:
            ragged_map_options.setdefault("numpy_outputs", True)
            self.runner = RaggedMap(fun, in_specs, **ragged_map_options)
        if not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        if int(max_batch_size) < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
        if max_batch_elements is not None and int(max_batch_elements) < 1:
            raise ValueError(f"max_batch_elements must be >= 1, got {max_batch_elements!r}")
        if int(max_queue) < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue!r}")
        self.broadcast = tuple(broadcast)
        self.max_wait_s = float(max_wait_ms) / 1000.0
        self.max_batch_size = int(max_batch_size)
        self.max_batch_elements = None if max_batch_elements is None else int(max_batch_elements)
        self.max_queue = int(max_queue)
        self.size_of = size_of or element_count
        self.on_batch = on_batch
        self._queue: collections.deque[_Item] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._drain = True
        self._rate = 0.0  # examples per second, moving average (Retry-After)
        self._stats = {"batches": 0, "examples": 0, "failed": 0, "isolated_batches": 0,
                       "rejected": 0, "largest_batch": 0}
        self._worker = threading.Thread(target=self._loop, name=name, daemon=True)
        self._worker.start()

    # -- submitting ----------------------------------------------------------------
    def submit(self, example: Any) -> concurrent.futures.Future:
        """Queue one example; its future gets the result (or the exception the
        example raised alone) and a ``timing`` attribute (``Timing``).

        Raises:
          QueueFull: ``max_queue`` examples are waiting.
          BatcherClosed: ``close`` was called.
        """
        return self.submit_many([example])[0]

    def submit_many(self, examples: Sequence[Any]) -> list[concurrent.futures.Future]:
        """Queue several examples at once (all or none: one request's inputs);
        one future per example, in order.

        Raises:
          QueueFull: they do not all fit in the queue now (none is queued).
          BatcherClosed: ``close`` was called.
        """
        sizes = [int(self.size_of(ex)) for ex in examples]
        site = user_call_site()
        now = time.perf_counter()
        with self._cond:
            if self._closed:
                raise BatcherClosed("the batcher is closed")
            depth = len(self._queue)
            if depth + len(sizes) > self.max_queue:
                self._stats["rejected"] += len(sizes)
                raise QueueFull(depth, self.max_queue, len(sizes), self._retry_after(depth))
            futures = []
            for ex, n in zip(examples, sizes):
                f: concurrent.futures.Future = concurrent.futures.Future()
                f.timing = None  # type: ignore[attr-defined]
                self._queue.append(_Item(ex, n, f, now, site))
                futures.append(f)
            self._cond.notify()
        return futures

    def __call__(self, example: Any, timeout: float | None = None) -> Any:
        """The result of one example (blocks this thread; ``timeout`` seconds).

        Raises:
          QueueFull, BatcherClosed: as ``submit``; the example's own exception;
          TimeoutError: no result within ``timeout``.
        """
        return self.submit(example).result(timeout)

    def map(self, examples: Sequence[Any], timeout: float | None = None) -> list:
        """Results of several examples (queued together; blocks this thread).

        Raises:
          QueueFull, BatcherClosed: as ``submit_many``; the first failing
            example's exception.
        """
        return [f.result(timeout) for f in self.submit_many(list(examples))]

    async def acall(self, example: Any) -> Any:
        """``await batcher.acall(example)``: the result, without blocking the
        event loop (cancelling the task drops the example if it has not run).

        Raises:
          QueueFull, BatcherClosed: as ``submit``; the example's own exception.
        """
        return await asyncio.wrap_future(self.submit(example))

    async def amap(self, examples: Sequence[Any]) -> list:
        """``await batcher.amap(examples)``: results of several examples.

        Raises:
          QueueFull, BatcherClosed: as ``submit_many``; the first failing
            example's exception.
        """
        futures = self.submit_many(list(examples))
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    # -- state -----------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Examples waiting (submitted, not yet taken into a batch)."""
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict:
        """``batches``, ``examples`` (run), ``failed`` (callers given an
        exception), ``isolated_batches`` (batches split to isolate a failure),
        ``rejected`` (examples refused with ``QueueFull``), ``largest_batch``,
        ``queue_depth``, and the ``ragged_map``'s ``stats()`` as ``runner``."""
        with self._cond:
            out = dict(self._stats, queue_depth=len(self._queue))
        out["runner"] = self.runner.stats()
        return out

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no more examples; ``drain=True`` (default) runs those waiting,
        else they fail with ``BatcherClosed``. Waits for the worker
        (``timeout`` seconds, None: until it ends). Idempotent."""
        with self._cond:
            self._closed = True
            self._drain = self._drain and drain
            self._cond.notify_all()
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout)

    def __enter__(self) -> DynamicBatcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _retry_after(self, depth: int) -> int:
        """Seconds for ``depth`` waiting examples to drain at the recent rate."""
        rate = self._rate
        if rate <= 0:
            return 1
        return max(1, math.ceil(depth / rate))

    # -- the worker ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            items = self._gather()
            if items is None:
                return
            if items:
                self._run(items)

    def _gather(self) -> list[_Item] | None:
        """The next batch: waits for an example, then until ``max_wait_s``
        after the oldest arrived or the budget is full. None: closed and
        drained."""
        items: list[_Item] = []
        elements = 0
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            if self._closed and not self._drain:
                while self._queue:
                    it = self._queue.popleft()
                    if it.future.set_running_or_notify_cancel():
                        it.future.set_exception(BatcherClosed(
                            "the batcher was closed before this example ran"))
                return []
            deadline = self._queue[0].enqueued + self.max_wait_s
            while True:
                full = False
                while self._queue:
                    it = self._queue[0]
                    if len(items) >= self.max_batch_size or (
                            items and self.max_batch_elements is not None
                            and elements + it.size > self.max_batch_elements):
                        full = True
                        break
                    self._queue.popleft()
                    if not it.future.set_running_or_notify_cancel():
                        continue  # its caller gave up (a cancelled asyncio task)
                    items.append(it)
                    elements += it.size
                if full or len(items) >= self.max_batch_size or (
                        self.max_batch_elements is not None
                        and elements >= self.max_batch_elements):
                    break
                left = deadline - time.perf_counter()
                if left <= 0 or self._closed:
                    break
                self._cond.wait(left)
        return items

    def _run(self, items: list[_Item]) -> None:
        start = time.perf_counter()
        before = self._computed()
        with compile_counter() as cc:
            try:
                outcomes = [(True, r) for r in self._call([it.example for it in items])]
                isolated = False
            except Exception as e:  # noqa: BLE001 - isolate the failing examples
                isolated = len(items) > 1
                outcomes = self._isolate(items) if isolated else [(False, e)]
        compute = time.perf_counter() - start
        queue_s = tuple(start - it.enqueued for it in items)
        failed = sum(not ok for ok, _ in outcomes)
        for it, q, (ok, value) in zip(items, queue_s, outcomes):
            it.future.timing = Timing(q, compute, len(items))  # type: ignore[attr-defined]
            if ok:
                it.future.set_result(value)
            else:
                it.future.set_exception(_callers_error(value, it.site))
        with self._cond:
            st = self._stats
            st["batches"] += 1
            st["examples"] += len(items)
            st["failed"] += failed
            st["isolated_batches"] += isolated
            st["largest_batch"] = max(st["largest_batch"], len(items))
            rate = len(items) / max(compute, 1e-6)
            self._rate = rate if self._rate == 0 else 0.8 * self._rate + 0.2 * rate
        if self.on_batch is not None:
            report = BatchReport(len(items), sum(it.size for it in items),
                                 self._computed() - before, queue_s, compute, cc.compiles,
                                 failed, isolated)
            try:
                self.on_batch(report)
            except Exception:  # noqa: BLE001 - metrics never stop the worker
                pass

    def _call(self, examples: list) -> list:
        return self.runner(examples, *self.broadcast, refine=False)

    def _isolate(self, items: list[_Item]) -> list[tuple[bool, Any]]:
        """``(ok, result or exception)`` per item: ``items`` run in halves,
        down to single examples, so an example's exception is its own."""
        half = len(items) // 2
        out: list[tuple[bool, Any]] = []
        for part in (items[:half], items[half:]):
            if not part:
                continue
            try:
                out += [(True, r) for r in self._call([it.example for it in part])]
            except Exception as e:  # noqa: BLE001 - split again, or the caller's own error
                out += [(False, e)] if len(part) == 1 else self._isolate(part)
        return out

    def _computed(self) -> int:
        """Elements the runner has computed so far (both layouts)."""
        padded = int(self.runner.cache.stats().get("padded_elements", 0))
        packed = self.runner.layouts.runner  # the packed layout's runner, once it ran
        return padded + (0 if packed is None else int(packed.stats["padded_elements"]))
