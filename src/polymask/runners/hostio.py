"""Padding inputs and unpadding outputs for the runners (nothing compiled per shape on
the host path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat


# ----------------------------------------------------------------------------
# Padding and unpadding (nothing compiled per shape on the host path)
# ----------------------------------------------------------------------------
def pad_host(x, bound: tuple[int, ...]):
    """Pad ``x`` to ``bound`` with zeros on the host (NumPy: compiles nothing)."""
    shape = np.shape(x)
    if tuple(shape) == bound:
        return x  # nothing to pad: pass the array through unchanged
    a = np.asarray(x)
    out = np.zeros(bound, dtype=a.dtype)
    out[tuple(slice(0, s) for s in shape)] = a
    return out


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
