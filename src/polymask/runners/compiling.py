"""Counting XLA compiles (``jax.monitoring``) and running compiles in the background."""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import queue
import threading

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


class _BackgroundCompiler:
    """One daemon thread per process that runs background compiles in order.

    A daemon thread (not ``concurrent.futures``' pool) so that compiles still
    queued at interpreter exit are dropped instead of delaying the exit. The
    compile *running* at exit is waited for (``atexit``): XLA aborts the process
    when the interpreter shuts down under a compile in flight.
    """

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._running = threading.Lock()  # held while a compile runs
        self._closed = False
        atexit.register(self._shutdown)

    def _shutdown(self) -> None:
        """Drop queued compiles and wait for the one in flight."""
        self._closed = True
        with self._running:
            pass

    def submit(self, fn) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fn, fut))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="polymask-compile",
                                                daemon=True)
                self._thread.start()
        return fut

    def _run(self):
        while True:
            fn, fut = self._queue.get()
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


_BACKGROUND = _BackgroundCompiler()


def background_executor() -> _BackgroundCompiler:
    return _BACKGROUND
