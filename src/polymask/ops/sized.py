"""unique, value-sized arange, dynamic_slice with traced sizes."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from ..core.buckets import int_arg
from ..core.diagnostics import user_call_site
from ..core.errors import ShapeError
from ..rules.data_dependent import (
    arange_p,
    dynamic_slice_p,
    unique_p,
)
from ._common import _bound, _eager, _fresh, _masking, _padded, _size


# ----------------------------------------------------------------------------
# unique
# ----------------------------------------------------------------------------
def unique(ar, return_index=False, return_inverse=False, return_counts=False, axis=None,
           *, equal_nan=True, size=None, fill_value=None):
    """``np.unique`` (flattened; ``axis`` only outside ``mask``).

    Args:
      ar: array of any dtype (NaNs count as one value when ``equal_nan``).
      return_index: as in NumPy.
      return_inverse: as in NumPy.
      return_counts: as in NumPy.

    Returns:
      The sorted unique values (``ar``'s dtype, length ``count``), plus the
      first indices (int32, ``(count,)``), the inverse (int32, shape of
      ``ar``) and the counts (int32, ``(count,)``) when asked. Inside
      ``polymask.mask`` ``count`` is a data-dependent dim var bounded by
      ``ar``'s padded size.

    Raises:
      NotImplementedError: ``axis=`` inside ``mask``.
      ShapeError: under ``jax.jit`` outside ``mask`` without ``size=``.
    """
    if size is not None or not _masking():
        return _eager("unique", jnp.unique, ar, return_index, return_inverse, return_counts,
                      axis=axis, equal_nan=equal_nan, size=size, fill_value=fill_value,
                      hint=" (or pass size=)")
    if axis is not None:
        raise NotImplementedError("polymask.unique: axis= is not supported inside mask")
    ar = jnp.asarray(ar)
    if ar.ndim == 0:
        ar = ar.reshape(1)
    outs = unique_p.bind(ar, out_dim=_fresh(_bound(ar.shape), _size(ar.shape)),
                         return_index=bool(return_index),
                         return_inverse=bool(return_inverse),
                         return_counts=bool(return_counts), equal_nan=bool(equal_nan))
    if not (return_index or return_inverse or return_counts):
        return outs[0]
    return tuple(outs)


# ----------------------------------------------------------------------------
# value-sized arange and dynamic_slice
# ----------------------------------------------------------------------------
def _traced(v) -> bool:
    return compat.is_tracer(v)


def arange(start, stop=None, step=None, dtype=None, *, max_size=None):
    """``np.arange`` whose length may be a traced integer (inside ``mask``).

    Args:
      start: as in NumPy; a Python number or an integer scalar computed
        from data (e.g. ``k = jnp.sum(x > 0)``); so are ``stop`` and ``step``.
      stop: as in NumPy.
      step: as in NumPy.
      dtype: result dtype (default: inferred as ``jnp.arange`` does).
      max_size: int bound on the length, required when an argument is traced.

    Returns:
      1-D array of length ``ceil((stop - start) / step)`` (clamped at 0); with
      traced arguments inside ``polymask.mask`` the length is a fresh dim var
      bounded by ``max_size``.

    Raises:
      ShapeError: traced arguments without ``max_size``, a length above
        ``max_size`` (at run time), or traced arguments under ``jax.jit``
        outside ``mask``.
    """
    args = [v for v in (start, stop, step) if v is not None]
    if not any(_traced(v) for v in args) or not _masking():
        call = [start] + ([stop] if stop is not None else []) + \
            ([step] if step is not None else [])
        if stop is None and step is not None:
            call = [0, start, step]
        return _eager("arange", jnp.arange, *call, dtype=dtype,
                      hint=", with max_size= bounding the length")
    if max_size is None:
        raise ShapeError(
            "polymask.arange with a traced length needs max_size= (an int bound on the "
            f"length) at {user_call_site()}")
    if stop is None:
        start, stop = 0, start
    if step is None:
        step = 1
    if dtype is None:
        dtype = jnp.result_type(start, stop, step)
    dtype = jnp.dtype(dtype)
    as_arr = [jnp.asarray(v) for v in (start, stop, step)]
    return arange_p.bind(*as_arr, out_dim=_fresh(int_arg(max_size, "max_size", 0)), dtype=dtype)


def _as_list(v, name):
    if isinstance(v, (list, tuple)):
        return list(v)
    if hasattr(v, "ndim") and getattr(v, "ndim", 0) == 1 and not compat.is_dim_expr(v):
        return [v[i] for i in range(v.shape[0])]
    return [v]


def _check_integer(v, what: str) -> None:
    """``TypeError`` for a start or size that is not an integer (``2.5``, a
    float array), which would be truncated; ``lax.dynamic_slice`` refuses it."""
    if compat.is_dim_expr(v) or isinstance(v, (bool, np.bool_)):
        return
    dtype = getattr(v, "dtype", None)
    kind = np.dtype(dtype).kind if dtype is not None else (
        "i" if isinstance(v, int) else "f" if isinstance(v, float) else None)
    if kind is not None and kind not in "iu":
        raise TypeError(f"polymask.dynamic_slice: {what} must be an integer, got {v!r} "
                        f"(called at {user_call_site()})")


def _concrete_int(v):
    if compat.is_dim_expr(v):
        return None
    try:
        return operator.index(v)
    except TypeError:
        pass
    if _traced(v):
        try:
            return int(v)
        except (TypeError, jax.errors.ConcretizationTypeError):
            return None
    return int(v)


def dynamic_slice(x, start, sizes, *, max_size=None):
    """``x[start:start + size]`` on the leading axes with (possibly traced) sizes.

    ``start`` and ``sizes`` are scalars (axis 0) or sequences (the leading
    ``len(start)`` axes). A size larger than the axis is clamped to it, a
    negative ``start`` counts from the end, then ``start`` is clamped so the
    slice fits (as ``lax.dynamic_slice``). Inside
    ``mask`` a traced size gets a fresh dim var bounded by ``max_size`` (an int,
    or one per axis) or by the axis' padded size.

    Returns:
      ``x``'s dtype, shape ``(*sizes, *x.shape[len(sizes):])`` (clamped).

    Raises:
      ValueError: ``start`` and ``sizes`` lengths differ or exceed ``x.ndim``.
      ShapeError: a size above ``max_size`` (at run time), or traced sizes
        under ``jax.jit`` outside ``mask``.
    """
    x = jnp.asarray(x)
    starts, szs = _as_list(start, "start"), _as_list(sizes, "sizes")
    if len(starts) != len(szs) or len(starts) > x.ndim:
        raise ValueError("polymask.dynamic_slice: start and sizes need one entry per "
                         "leading axis")
    k = len(starts)
    for what, vs in (("start", starts), ("a size", szs)):
        for v in vs:
            _check_integer(v, what)
    if max_size is not None:
        for m in (max_size if isinstance(max_size, (list, tuple)) else [max_size]):
            if m is not None:
                int_arg(m, "polymask.dynamic_slice: max_size", 0)
    static = [_concrete_int(s) for s in szs]
    symbolic = compat.is_symbolic_shape(x.shape)
    if not _masking() or (not symbolic and all(s is not None for s in static)):
        if any(s is None for s in static):
            raise ShapeError(
                "polymask.dynamic_slice with traced sizes has a data-dependent output size "
                f"(called at {user_call_site()}); inside jax.jit / jax.vmap call it within "
                "polymask.mask (with max_size= to bound the size)")
        lens = [max(0, min(s, x.shape[a])) for a, s in enumerate(static)]
        return lax.dynamic_slice(x, [jnp.asarray(s, jnp.int32) for s in starts] +
                                 [0] * (x.ndim - k), lens + list(x.shape[k:]))
    maxes = max_size if isinstance(max_size, (list, tuple)) else [max_size] * k
    out_shape, fresh, size_ops = [], [], []
    for a in range(x.ndim):
        if a >= k:
            out_shape.append(x.shape[a])
            fresh.append(False)
            continue
        s = szs[a]
        if static[a] is not None or compat.is_dim_expr(s):
            d = s if compat.is_dim_expr(s) else static[a]
            d = compat.min_dim(max(d, 0) if not compat.is_dim_expr(d) else d, x.shape[a])
            out_shape.append(d)  # clamped to the axis, as on the exact arrays
            fresh.append(False)
            size_ops.append(jnp.asarray(s, jnp.int32))
            continue
        bound = _padded(x.shape[a])
        if maxes[a] is not None:
            bound = min(bound, int(maxes[a]))
        out_shape.append(_fresh(bound, x.shape[a]))
        fresh.append(True)
        size_ops.append(jnp.asarray(s, jnp.int32))
    start_ops = [jnp.asarray(s, jnp.int32) for s in starts]
    return dynamic_slice_p.bind(x, *start_ops, *size_ops, out_shape=tuple(out_shape),
                                fresh=tuple(fresh))
