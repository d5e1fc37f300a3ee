"""Padding inputs and unpadding outputs for the runners (nothing compiled per shape on
the host path)."""

from __future__ import annotations

import collections
import math
import sys
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat

# ----------------------------------------------------------------------------
# Padding and unpadding (nothing compiled per shape on the host path)
# ----------------------------------------------------------------------------
# XLA:CPU reads a host array in place, without a copy, when its data starts on
# a 64-byte boundary (NumPy's allocator gives 16). Finding the boundary
# (``ctypes.data``) costs more than copying a small array, and a fresh buffer's
# first writes fault its pages in, so small arrays are allocated plainly and
# large ones are aligned and reused (docs/benchmarks.md, the per-call rows).
_ALIGN = 64
LARGE_BYTES = 1 << 16


def host_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zero NumPy array of ``shape`` and ``dtype`` to hand to a compiled
    program; from ``LARGE_BYTES`` (64 KiB) up its data is 64-byte aligned, so
    that XLA:CPU uses it in place instead of copying it."""
    dtype = np.dtype(dtype)
    if math.prod(shape) * dtype.itemsize < LARGE_BYTES:
        return np.zeros(shape, dtype)
    return _aligned_zeros(shape, dtype)[1]


def _aligned_zeros(shape, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(owner, view): zeros whose view starts on a 64-byte boundary."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw, raw[start:start + nbytes].view(dtype).reshape(shape)


def _refs_when_free() -> tuple[int, int] | None:
    """The reference counts of a free pooled buffer's owner and view, as
    ``HostPadBuffers._take`` reads them; None where a count does not show one
    more reference (no reuse there)."""
    slot = [*_aligned_zeros((1,), np.dtype(np.float32)), (1,)]
    free = sys.getrefcount(slot[0]), sys.getrefcount(slot[1])
    held = slot[1]  # noqa: F841 - one more reference to the view (and one to the owner)
    if (sys.getrefcount(slot[0]), sys.getrefcount(slot[1])) != (free[0], free[1] + 1):
        return None
    view_of_owner = slot[0][:]  # noqa: F841
    if sys.getrefcount(slot[0]) != free[0] + 1:
        return None
    return free


# A pooled buffer referenced by its slot alone (its owner also by the view's
# base). A program that reads it holds a reference, to the view or to a view of
# the owner, for as long as it does: JAX keeps the NumPy array alive while
# XLA uses its memory in place or copies it asynchronously.
_FREE_REFS = _refs_when_free()
_POOL_SLOTS = 2  # buffers kept per (bound, dtype): one being read, one being filled


class HostPadBuffers:
    """Zero-padded host copies of large inputs, in buffers reused across calls.

    A fresh ``np.zeros`` of a large bucket costs more than the copy into it
    (its pages fault in on the first writes), and an unaligned one is copied
    again by XLA:CPU: ``sum(x * x)`` of 300,000 float32 went from 333 to
    167-233 us per call (``benchmarks/run.py --only percall``, fresh
    processes, 3 rounds; ``jax.jit`` 189-207 us). A buffer is reused only while nothing else
    references it (``sys.getrefcount``): a program still reading it, or an
    output that aliases it, keeps it out of the pool's hands. Where reference
    counts cannot tell (free-threaded Python), every call gets a fresh buffer.
    Thread-safe. Padded arrays under ``LARGE_BYTES`` are fresh each call.

    Memory: up to two buffers per (bucket shape, dtype), at most
    ``max_bytes`` (256 MiB) in all; the bucket shapes used least recently
    give theirs up first.
    """

    def __init__(self, max_bytes: int = 1 << 28) -> None:
        self._lock = threading.Lock()
        # (bound, dtype) -> [[owner, view, shape written], ...], least recently used first
        self._slots: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0
        self.max_bytes = max_bytes
        self._reuse = (getattr(sys, "_is_gil_enabled", lambda: True)()
                       and _FREE_REFS is not None)

    @property
    def pooled_bytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()
            self._bytes = 0

    def padder(self, bound: tuple[int, ...], dtype) -> Callable:
        """``pad(a, index)``: ``a`` (of ``dtype``) zero-padded to ``bound``, where
        ``index`` is ``a``'s box in it; pooled when the padded array is large."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(bound) * dtype.itemsize
        if not self._reuse or nbytes < LARGE_BYTES or nbytes > self.max_bytes:
            zeros = np.zeros if nbytes < LARGE_BYTES else host_zeros

            def fresh(a, index):
                out = zeros(bound, dtype)
                out[index] = a
                return out

            return fresh
        key = (bound, dtype)

        def pooled(a, index):
            out = self._take(key, nbytes, a.shape)
            out[index] = a
            return out

        return pooled

    def _take(self, key, nbytes: int, shape) -> np.ndarray:
        with self._lock:
            slots = self._slots.get(key)
            if slots is None:
                slots = self._slots[key] = []
            else:
                self._slots.move_to_end(key)
                for slot in slots:
                    if (sys.getrefcount(slot[0]), sys.getrefcount(slot[1])) == _FREE_REFS:
                        buf, written = slot[1], slot[2]
                        slot[2] = shape
                        zero_outside(buf, written, shape)
                        return buf
            raw, buf = _aligned_zeros(*key)
            if len(slots) < _POOL_SLOTS:
                slots.append([raw, buf, shape])
                self._bytes += nbytes
                self._give_up_least_recent(keep=key)
            return buf

    def _give_up_least_recent(self, keep) -> None:
        """Forget the least recently used bucket shapes' buffers until the pool
        fits ``max_bytes`` (a buffer still read keeps living with its reader)."""
        while self._bytes > self.max_bytes:
            key = next(iter(self._slots))
            if key == keep:
                break
            slots = self._slots.pop(key)
            self._bytes -= sum(slot[1].nbytes for slot in slots)


class _AliasedSlot:
    """One small bucket's padded input, kept between calls: ``view``, aligned
    host memory, and ``array``, the ``jax.Array`` XLA:CPU reads it through in
    place. ``claim`` is held while a call fills it and dispatches a program on
    it; ``reader``: None, or an output of the last program that read it (the
    slot may be rewritten once that output is ready: an execution's outputs
    are defined when it ends, and it has read its inputs by then);
    ``_UNKNOWN`` where no output tells (the slot is not reused)."""

    __slots__ = ("owner", "view", "array", "written", "reader", "claim", "kept")

    def __init__(self, owner, view, array) -> None:
        self.owner, self.view, self.array = owner, view, array
        self.written = view.shape
        self.reader = None
        self.claim = threading.Lock()
        self.kept = True  # False once its owner forgets it (cleared, given up, evicted)


_UNKNOWN = object()
_ALIASED_KEYS = 256  # small bucket shapes kept (one buffer of < 64 KiB each)
_LOST_LIMIT = 4  # slots given up (reader deleted or donated) before a key stops aliasing


class AliasedPadBuffers:
    """Small padded inputs on XLA:CPU as ``jax.Array``s that alias reused host
    buffers, so that a call passes the program a device array and not a NumPy
    one.

    The compiled program takes a NumPy argument through a host-to-device
    transfer, which a ``jax.Array`` argument skips (per call of ``sum(x *
    x)`` on 100 float32 with NumPy inputs, 1.36-1.46x ``jax.jit``'s time
    before and 1.16-1.23x after, fresh processes: docs/benchmarks.md, the
    per-call rows). Here each (bucket shape, dtype) keeps one 64-byte aligned buffer with a
    ``jax.Array`` made once over its memory (the same pointer, checked: where
    the upload copies, nothing is aliased). A call writes the exact array
    into it and runs the program on its ``jax.Array`` (``run``).

    The buffer is written only when no program reads it: a call records an
    output its program made, and the next call rewrites the buffer only once
    that output is ready; while it is not (a program still running, another
    thread in ``run``), a call pads a fresh NumPy array as before. An output
    the user deleted or donated can no longer say when it was made: its
    buffer is given up (a fresh one made) and, after a few, the bucket shape
    stops aliasing. An output that is the padded input itself (JAX forwards
    an unchanged input) is copied before it is handed out. Thread-safe.
    XLA:CPU only (an accelerator's array does not alias host memory); arrays
    of ``LARGE_BYTES`` and more use ``HostPadBuffers``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (bound, dtype) -> _AliasedSlot, or None where the key does not alias
        self._slots: collections.OrderedDict = collections.OrderedDict()
        self._lost: dict = {}

    def clear(self) -> None:
        with self._lock:
            for slot in self._slots.values():
                _forget(slot)
            self._slots.clear()
            self._lost.clear()

    @staticmethod
    def applies(bound: tuple[int, ...], dtype) -> bool:
        return (host_backend() and 0 < math.prod(bound) * np.dtype(dtype).itemsize < LARGE_BYTES)

    def runner(self, bound: tuple[int, ...], dtype, shape: tuple[int, ...], pad: Callable,
               sizes) -> Callable:
        """``run(fn, a) -> fn's outputs`` for arrays ``a`` of ``shape`` padded to
        ``bound``: ``fn(padded a, sizes)`` through the key's aliased buffer
        where it is free, else through ``pad(a)`` (NumPy)."""
        key = (bound, np.dtype(dtype))
        index = tuple(slice(0, n) for n in shape)
        slot_of, made, ndarray, asarray = self._slot_of, self._made, np.ndarray, np.asarray
        held = [None]  # the key's slot found by the last call (looked up again once not kept)

        def run(fn, a):
            slot = held[0]
            if slot is None or not slot.kept:
                slot = held[0] = slot_of(key)
                if slot is None:
                    return fn(pad(a), sizes)
            if not slot.claim.acquire(False):  # another thread dispatches on it
                return fn(pad(a), sizes)
            try:
                if not slot.kept:  # forgotten since (its buffers may be released)
                    return fn(pad(a), sizes)
                reader = slot.reader
                if reader is not None and not made(key, slot, reader):
                    return fn(pad(a), sizes)
                if slot.written != shape:
                    zero_outside(slot.view, slot.written, shape)
                    slot.written = shape
                slot.view[index] = a if type(a) is ndarray else asarray(a)
                arr = slot.array
                slot.reader = _UNKNOWN  # (until fn returns: a failed run tells nothing)
                out = fn(arr, sizes)
                if len(out) == 1 and type(out[0]) is compat.ArrayImpl and out[0] is not arr:
                    slot.reader = out[0]  # the common case, without a walk
                    return out
                slot.reader, forwarded = _made_output(out, (arr, sizes), arr)
                return forwarded_copy(out, slot) if forwarded else out
            finally:
                slot.claim.release()

        return run

    def _made(self, key, slot: _AliasedSlot, reader) -> bool:
        """Whether the slot's last program has ended (its output ``reader`` is
        ready); a reader that cannot tell (deleted, donated, none) gives the
        slot up."""
        ready = None if reader is _UNKNOWN else compat.is_made(reader)
        if ready is None:
            with self._lock:
                if self._slots.get(key) is slot:  # a fresh one next call (a program
                    del self._slots[key]  # still reading this one keeps its memory)
                    _forget(slot)
                    self._lost[key] = self._lost.get(key, 0) + 1
            return False
        if ready:
            slot.reader = None
        return ready

    def _slot_of(self, key) -> _AliasedSlot | None:
        """The key's slot, made now (None where the key does not alias)."""
        with self._lock:
            if key in self._slots:
                return self._slots[key]
            if self._lost.get(key, 0) >= _LOST_LIMIT:
                self._slots[key] = None
                return None
            bound, dtype = key
            owner, view = _aligned_zeros(bound, dtype)
            array = compat.upload(view)
            slot = (_AliasedSlot(owner, view, array)
                    if compat.buffer_address(array) == view.ctypes.data else None)
            self._slots[key] = slot  # None: uploads copy here, nothing to alias
            if len(self._slots) > _ALIASED_KEYS:
                _forget(self._slots.popitem(last=False)[1])
            return slot


def _forget(slot: _AliasedSlot | None) -> None:
    """Mark a slot its owner no longer keeps (runners holding it look it up
    again) and release its buffers and last reader, unless a call holds it now
    (that call sees ``kept`` False next time): a runner's reference to a
    forgotten slot keeps no memory alive."""
    if slot is None:
        return
    slot.kept = False
    if slot.claim.acquire(False):
        try:
            slot.owner = slot.view = slot.array = slot.reader = None
        finally:
            slot.claim.release()


def _made_output(out, args, array) -> tuple:
    """(the first array in ``out`` that is none of ``args`` (``_UNKNOWN`` where
    there is none), whether ``array`` is in ``out``): JAX returns an unchanged
    input as it is, ready before the execution ends."""
    made, forwarded = _UNKNOWN, False
    for o in out:
        if isinstance(o, (list, tuple)):
            m, f = _made_output(o, args, array)
            forwarded |= f
            if made is _UNKNOWN:
                made = m
        elif o is array:
            forwarded = True
        elif made is _UNKNOWN and isinstance(o, jax.Array) and not any(o is a for a in args):
            made = o
    return made, forwarded


def forwarded_copy(out, slot: _AliasedSlot):
    """``out`` with ``slot.array`` (which later calls overwrite) replaced by a
    copy of its memory wherever the program returns it as it is (never read
    through the array: its cached host value would go stale)."""
    if isinstance(out, (list, tuple)):
        return type(out)(forwarded_copy(o, slot) for o in out)
    return compat.upload(slot.view.copy()) if out is slot.array else out


def zero_outside(buf: np.ndarray, written: tuple[int, ...], shape: tuple[int, ...]) -> None:
    """Zero the entries of ``buf``'s box ``written`` that lie outside the box
    ``shape`` (both anchored at the origin): per axis where ``written`` is
    longer, the slab past ``shape``."""
    for k, (w, s) in enumerate(zip(written, shape)):
        if w > s:
            buf[tuple(slice(s, w) if j == k else slice(0, wj)
                      for j, wj in enumerate(written))] = 0


def slice_to(a, shape):
    return a[tuple(slice(0, int(n)) for n in shape)]


def output_kind(d) -> tuple[bool, object]:
    """What of a program output (a ``jax.Array``) its host copy loses and the
    user's exact output keeps, as ``jax.jit``'s would: ``(weak_type, key
    implementation or None)``. A weakly typed output (``mask * 2``, a size
    returned as a number) promotes as a Python scalar does; a typed PRNG key
    array has no NumPy form (its key data travels instead)."""
    if _is_key(d.dtype):
        return False, jax.random.key_impl(d)
    return bool(getattr(d, "weak_type", False)), None


def _is_key(dtype) -> bool:
    # (NumPy dtypes first: the per-call path meets them almost always)
    return not isinstance(dtype, np.dtype) and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def as_numpy_output(d):
    """An exact output as ``numpy_outputs`` hands it back: NumPy, but a key
    array stays one (NumPy has no key dtype), as ``handed_back`` keeps it."""
    return d if _is_key(d.dtype) else np.asarray(d)


def host_view(d) -> np.ndarray:
    """A program output on the host (a key array's key data)."""
    if _is_key(d.dtype):
        d = jax.random.key_data(d)
    return np.asarray(d)


def handed_back(a: np.ndarray, kind: tuple[bool, object], numpy_outputs: bool):
    """An exact output as the user gets it from its host copy ``a`` (``kind``:
    ``output_kind`` of the program's output): a NumPy array with
    ``numpy_outputs``, else uploaded, keeping the weak type; keys are always
    key arrays (NumPy has no key dtype)."""
    weak, impl = kind
    if impl is not None:
        return jax.random.wrap_key_data(compat.upload(np.array(a)), impl=impl)
    if numpy_outputs:
        return a
    return compat.upload(np.array(a), weak)


def unpad_output(d, shape, numpy_outputs: bool):
    """Exact output from a padded one (or an exact one, as NumPy): a NumPy
    slice, uploaded unless ``numpy_outputs`` (``handed_back``)."""
    a = host_view(d)
    if a.shape[:len(shape)] != tuple(shape):  # (a key's data has trailing axes)
        a = slice_to(a, shape)
    return handed_back(a, output_kind(d), numpy_outputs)


FAST_TYPES = (np.ndarray, compat.ArrayImpl)  # no array is made at import (jax.distributed)
PAD_DEVICE_PROGRAMS: dict = {}


def host_backend() -> bool:
    return jax.default_backend() == "cpu"


def device_pad_fn(shape, bound, dtype):
    """A jitted zero-pad for one (exact shape, bound) on an accelerator (counted)."""
    key = (shape, bound, dtype)
    fn = PAD_DEVICE_PROGRAMS.get(key)
    if fn is None:
        widths = [(0, b - s, 0) for s, b in zip(shape, bound)]
        fn = PAD_DEVICE_PROGRAMS[key] = jax.jit(
            lambda x: jax.lax.pad(x, jnp.zeros((), x.dtype), widths))
    return fn
