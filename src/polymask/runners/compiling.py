"""Counting XLA compiles (``jax.monitoring``) and running compiles in the background."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import itertools
import queue
import threading
import time

import jax

__all__ = ["compile_counter"]


# ----------------------------------------------------------------------------
# Counting compiles (jax.monitoring listeners, active per thread)
# ----------------------------------------------------------------------------
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_tls = threading.local()
_listeners_lock = threading.Lock()
_listeners_installed = False


def _on_duration(name, secs, **kw):
    if name == _COMPILE_EVENT:
        c = getattr(_tls, "counter", None)
        if c is not None:
            c[0] += 1


def _on_event(name, **kw):
    if name == _CACHE_HIT_EVENT:
        c = getattr(_tls, "counter", None)
        if c is not None:
            c[1] += 1


def install_listeners() -> None:
    global _listeners_installed
    with _listeners_lock:
        if not _listeners_installed:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _listeners_installed = True


class compile_counter:
    """Count the XLA compiles (and persistent-cache hits) this thread causes.

    ``with compile_counter() as c: ...`` then ``c.compiles``, ``c.cache_hits``
    (programs loaded from the persistent compilation cache).
    Nested counters each see the compiles of their block.
    """

    def __enter__(self):
        install_listeners()
        self._prev = getattr(_tls, "counter", None)
        self._c = _tls.counter = [0, 0]
        return self

    def __exit__(self, *exc):
        _tls.counter = self._prev
        if self._prev is not None:
            self._prev[0] += self._c[0]
            self._prev[1] += self._c[1]
        return False

    @property
    def compiles(self) -> int:
        """XLA compiles (a program loaded from the persistent cache is not one)."""
        return self._c[0] - self._c[1]

    @property
    def cache_hits(self) -> int:
        return self._c[1]

    @property
    def nested(self) -> bool:
        """Inside another counter (which also sees these compiles)."""
        return self._prev is not None


COMPILE_TICK = itertools.count()

# A deferred background compile (``submit(fn, defer=True)``: tiered buckets)
# starts once no call has needed one for YIELD_QUIET_S seconds (``note_call``),
# at the latest YIELD_MAX_S after it was submitted, and at once while a thread
# waits for compiles (``hurried``), a compile that is not deferred is queued,
# or one was urged (``urge``: a call repeats a shape that waits for it).
YIELD_QUIET_S = 0.05
YIELD_MAX_S = 1.0


class BackgroundCompiler:
    """One daemon thread per process that runs background compiles in order.

    A daemon thread (not ``concurrent.futures``' pool) so that compiles still
    queued at interpreter exit are dropped instead of delaying the exit. The
    compile *running* at exit is waited for (``atexit``): XLA aborts the process
    when the interpreter shuts down under a compile in flight.

    Deferred compiles yield to the caller: a compile holds the GIL while it
    traces and takes a core while XLA compiles, so one started in the middle
    of a burst of calls slows every call of the burst. See ``YIELD_QUIET_S``.
    """

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._running = threading.Lock()  # held while a compile runs
        self._closed = False
        self._last_call = 0.0  # time.monotonic() of the last call that wanted a compile
        self._waiters = 0  # threads in ``hurried``
        self._deferred: set = set()  # futures of queued deferred compiles
        self._prompt: set = set()  # futures of queued compiles that start without waiting
        self._wake = threading.Event()
        atexit.register(self._shutdown)

    def _shutdown(self) -> None:
        """Drop queued compiles and wait for the one in flight."""
        self._closed = True
        self._wake.set()
        with self._running:
            pass

    def note_call(self) -> None:
        """A call ran that a deferred compile serves: deferred compiles wait
        until calls pause (``YIELD_QUIET_S``)."""
        self._last_call = time.monotonic()

    @contextlib.contextmanager
    def hurried(self):
        """While inside, deferred compiles start at once (a thread waits for them)."""
        with self._lock:
            self._waiters += 1
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1

    def urge(self, fut) -> None:
        """The deferred compile of ``fut`` (if still queued) and those queued
        before it start without waiting."""
        with self._lock:
            if fut in self._deferred:
                self._deferred.discard(fut)
                self._prompt.add(fut)
        self._wake.set()

    def _hold(self, submitted: float | None) -> None:
        """Wait before a deferred compile (submitted at ``submitted``) starts."""
        if submitted is None:
            return
        while not (self._closed or self._waiters or self._prompt):
            now = time.monotonic()
            delay = min(self._last_call + YIELD_QUIET_S, submitted + YIELD_MAX_S) - now
            if delay <= 0:
                return
            self._wake.wait(delay)
            self._wake.clear()

    def submit(self, fn, defer: bool = False) -> concurrent.futures.Future:
        """Run ``fn()`` on the compile thread after the compiles submitted before
        it; ``defer``: yield to calls first (see the class doc)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        now = time.monotonic()
        with self._lock:
            if defer:  # submitted by a call (after its own foreground compile, maybe)
                self._last_call = now
                self._deferred.add(fut)
            else:
                self._prompt.add(fut)
        self._wake.set()
        self._queue.put((fn, fut, now if defer else None))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="polymask-compile",
                                                daemon=True)
                self._thread.start()
        return fut

    def _run(self):
        while True:
            fn, fut, submitted = self._queue.get()
            self._hold(submitted)
            with self._lock:
                self._deferred.discard(fut)
                self._prompt.discard(fut)
            with self._running:
                if self._closed:
                    fut.cancel()
                    continue
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn())
                except BaseException as e:  # reported by Future.result() (PolyJit.wait)
                    fut.set_exception(e)


_BACKGROUND = BackgroundCompiler()


def background_executor() -> BackgroundCompiler:
    return _BACKGROUND
