"""``jnp.trim_zeros`` inside a masked trace.

JAX's ``trim_zeros`` needs the values of its operand on the host (it slices
with Python ints read from ``argmax``), so on a traced array it raises a
``ConcretizationTypeError`` even where plain JAX runs eagerly on the exact
array. While a masked function is traced (``compat.replace_during_trace``)
it becomes ``polymask.boolean_mask`` along each trimmed axis with the run of
positions from the first to the last nonzero hyperplane: the same contiguous
slice, with a data-dependent dim var bounded by the axis' padded size (one
program for every result size; per example under ``vmap``). An operand that
is all zeros gives size 0 on every trimmed axis, as JAX's ``slice(0, 0)``.
Outside a masked trace, and for concrete operands, JAX's own runs.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .. import _jax_compat as compat
from .._jax_compat import numeric as compat_numeric
from ..rules.util import in_masked_trace
from .selection import boolean_mask

__all__ = ["trim_zeros_dynamic"]

_ORIGINAL_TRIM_ZEROS = compat_numeric.lax_numpy_module().trim_zeros


def _kept(x, axis: int, front: bool, back: bool):
    """Positions of ``axis`` between its first and last nonzero hyperplane."""
    others = tuple(a for a in range(x.ndim) if a != axis)
    nonzero = jnp.any(x != 0, axis=others) if others else x != 0
    keep = jnp.ones_like(nonzero)
    if front:
        keep &= lax.cummax(nonzero.astype(jnp.int32), axis=0) > 0
    if back:
        keep &= lax.cummax(nonzero.astype(jnp.int32), axis=0, reverse=True) > 0
    return keep & jnp.any(nonzero)


def trim_zeros_dynamic(filt, trim: str = "fb", axis=None):
    """``jnp.trim_zeros`` on a traced operand inside ``polymask.mask``.

    Returns ``filt``'s dtype, each trimmed axis of a data-dependent size.
    """
    if not in_masked_trace() or not compat.is_tracer(filt):
        return _ORIGINAL_TRIM_ZEROS(filt, trim, axis)
    filt = jnp.asarray(filt)
    axes = range(filt.ndim) if axis is None else (
        [axis] if isinstance(axis, int) else list(axis))
    axes = sorted({a % filt.ndim for a in axes})
    front, back = "f" in trim.lower(), "b" in trim.lower()
    if not axes or not (front or back):
        return filt
    keeps = [(a, _kept(filt, a, front, back)) for a in axes]
    out = filt
    for a, keep in keeps:  # every run from the operand, as JAX's slices
        out = boolean_mask(out, keep, axis=a)
    return out


compat.replace_during_trace("jnp.trim_zeros", trim_zeros_dynamic)
compat.replace_during_trace("jax._src.numpy trim_zeros", trim_zeros_dynamic)
