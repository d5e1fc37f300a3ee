"""Padding inputs and unpadding outputs for the runners (nothing compiled per shape on
the host path)."""

from __future__ import annotations

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
# a 64-byte boundary (NumPy's allocator gives 16). Finding the boundary costs
# about 1 us and a fresh buffer's first writes fault its pages in, so small
# arrays are allocated plainly and large ones are aligned and reused.
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
    (``sum(x * x)`` of 300,000 float32 padded to 524,288 on the 2-core Xeon:
    zeros + copy 121 us, copy into a reused buffer 49 us), and an unaligned one
    is copied again by XLA:CPU. A buffer is reused only while nothing else
    references it (``sys.getrefcount``): a program still reading it, or an
    output that aliases it, keeps it out of the pool's hands. Where reference
    counts cannot tell (free-threaded Python), every call gets a fresh buffer.
    Thread-safe. Padded arrays under ``LARGE_BYTES`` are fresh each call. The
    runner keeps up to two buffers per (bucket shape, dtype) of large inputs.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict = {}  # (bound, dtype) -> [[buffer, shape written], ...]
        self._reuse = (getattr(sys, "_is_gil_enabled", lambda: True)()
                       and _FREE_REFS is not None)

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()

    def padder(self, bound: tuple[int, ...], dtype) -> Callable:
        """``pad(a, index)``: ``a`` (of ``dtype``) zero-padded to ``bound``, where
        ``index`` is ``a``'s box in it; pooled when the padded array is large."""
        dtype = np.dtype(dtype)
        if not self._reuse or math.prod(bound) * dtype.itemsize < LARGE_BYTES:
            def fresh(a, index):
                out = np.zeros(bound, dtype)
                out[index] = a
                return out

            return fresh
        with self._lock:
            slots = self._slots.setdefault((bound, dtype), [])

        def pooled(a, index):
            out = self._take(slots, bound, dtype, a.shape)
            out[index] = a
            return out

        return pooled

    def _take(self, slots: list, bound, dtype, shape) -> np.ndarray:
        with self._lock:
            for slot in slots:
                if (sys.getrefcount(slot[0]), sys.getrefcount(slot[1])) == _FREE_REFS:
                    buf, written = slot[1], slot[2]
                    slot[2] = shape
                    zero_outside(buf, written, shape)
                    return buf
            raw, buf = _aligned_zeros(bound, dtype)
            if len(slots) < _POOL_SLOTS:
                slots.append([raw, buf, shape])
            return buf


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


def unpad_output(d, shape, numpy_outputs: bool):
    """Exact output from a padded one: a NumPy slice, uploaded unless ``numpy_outputs``."""
    a = np.asarray(d)
    if a.shape != tuple(shape):
        a = slice_to(a, shape)
    if numpy_outputs:
        return a
    return compat.upload(np.array(a))


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
