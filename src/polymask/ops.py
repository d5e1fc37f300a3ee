"""Data-dependent-size ops: nonzero, argwhere, flatnonzero, where, boolean_mask,
compress, extract, unique, arange, dynamic_slice.

Outside ``polymask.mask`` with concrete inputs they return what NumPy returns
(they call ``jax.numpy`` eagerly; also under ``jax.grad``). Inside ``jax.jit``
but outside ``mask`` their output size is unknown, so they raise a
``ShapeError`` pointing to ``polymask.mask`` (or accept ``size=`` /
``fill_value=`` like ``jax.numpy``).

Inside ``polymask.mask`` each call creates a fresh dimension variable
(``_u1``, ``_u2``, ...) whose bound is known statically (the operand's padded
size, or ``max_size=``) and whose logical value is computed at run time (a
count, a length); later operations use it like any other size. See
``rules/data_dependent.py`` for the masking rules.
"""

from __future__ import annotations

import itertools
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax

from . import _jax_compat as compat
from .diagnostics import user_call_site
from .errors import ShapeError
from .rules.data_dependent import (
    arange_p,
    boolean_mask_p,
    dynamic_slice_p,
    nonzero_p,
    unique_p,
)
from .trace import current_scope

__all__ = ["nonzero", "argwhere", "flatnonzero", "where", "boolean_mask", "compress",
           "extract", "unique", "arange", "dynamic_slice"]

_COUNTER = itertools.count(1)


def _scope():
    return current_scope()


def _fresh(bound: int, at_most=None):
    """A fresh dim var ``_uK <= bound`` in the masked trace's scope.

    ``at_most``: a symbolic size it never exceeds (``_uK <= n``), so that
    shapes such as ``n - _uK`` trace as non-negative.
    """
    scope = _scope()
    name = f"_u{next(_COUNTER)}"
    d = compat.fresh_dim(name, scope)
    compat.add_constraint(scope, f"{name} <= {max(int(bound), 1)}")
    # Only when JAX's bound of `at_most` (which assumes dim vars >= 1) is its
    # true bound: `_u <= n - m` would cap _u below n when m = 0.
    if (at_most is not None and compat.is_dim_expr(at_most)
            and compat.upper_bound(at_most) >= _padded(at_most)):
        try:
            compat.add_constraint(scope, f"{name} <= {at_most}")
        except Exception:  # an expression JAX cannot use as a constraint: bound only
            pass
    return d


def _size(shape):
    """Number of elements of a (symbolic) shape, as a dimension expression or int."""
    return math.prod(shape)


def _padded(d) -> int:
    """Padded size of an operand's axis, exactly as the interpreter computes it."""
    if not compat.is_dim_expr(d):
        return int(d)
    from .shapes import DimEnv

    return DimEnv(_scope(), {}, {}).padded(d)


def _bound(shape) -> int:
    """Padded number of elements of an operand of (symbolic) ``shape``."""
    return math.prod(_padded(d) for d in shape)


_CONCRETIZATION = (jax.errors.ConcretizationTypeError, jax.errors.NonConcreteBooleanIndexError,
                   jax.errors.TracerIntegerConversionError)


def _eager(name, fn, *args, hint="", **kwargs):
    """Run the ``jax.numpy`` version; explain what to do when the size is not concrete."""
    args = [jnp.asarray(a) if isinstance(a, (list, tuple)) else a for a in args]
    try:
        return fn(*args, **kwargs)
    except _CONCRETIZATION as e:
        raise ShapeError(
            f"polymask.{name} has a data-dependent output size, which needs concrete inputs "
            f"(called at {user_call_site()}). Inside jax.jit / jax.vmap call it within "
            f"polymask.mask, where the size becomes a logical size with a known bound{hint}."
            f"\n  JAX said: {str(e).splitlines()[0]}") from None


def _masking(*args) -> bool:
    """True while a masked trace is in progress (polymask.mask's make_jaxpr)."""
    return _scope() is not None


# ----------------------------------------------------------------------------
# nonzero family
# ----------------------------------------------------------------------------
def _nonzero_bind(a, mode):
    a = jnp.asarray(a)
    if a.ndim == 0:
        raise ValueError(f"polymask.{mode} needs an array of rank >= 1 (got a scalar) "
                         f"at {user_call_site()}")
    return nonzero_p.bind(a, out_dim=_fresh(_bound(a.shape), _size(a.shape)), mode=mode)


def nonzero(a, *, size=None, fill_value=None):
    """Indices of the non-zero elements, as in ``np.nonzero``: a tuple of ``a.ndim`` arrays.

    Inside ``polymask.mask`` the result has a *data-dependent size*: each index
    array has shape ``(count,)`` where ``count`` is a fresh dim var whose bound
    is the padded size of ``a`` (its number of elements) and whose logical
    value is the number of non-zeros of the logical region, computed at run
    time (``jax.jit`` compiles once for every count; under ``jax.vmap`` each
    example has its own count). Later ops use it like any other size, e.g.
    ``x[polymask.nonzero(x)].prod()``. Padding of the result is unspecified.

    Outside ``mask`` (concrete input) this is ``jnp.nonzero``: the values of
    ``np.nonzero`` as int32 ``jax.Array``s. With ``size=``/``fill_value=`` it is
    ``jnp.nonzero`` with a fixed size, anywhere.

    Args:
      a: array of any dtype and rank >= 1 (non-zero = ``a != 0``).

    Raises:
      ShapeError: called under ``jax.jit`` outside ``mask`` without ``size=``
        (the output size would depend on the data).

    Follows the seed proposal's data-dependent sizes (unbacked sizes in
    torch, unconstrained NumberProxies in Thunder); see docs/data_dependent.md.
    """
    if size is not None or not _masking():
        return _eager("nonzero", jnp.nonzero, a, size=size, fill_value=fill_value,
                      hint=" (or pass size=)")
    return tuple(_nonzero_bind(a, "nonzero"))


def argwhere(a, *, size=None, fill_value=None):
    """``np.argwhere``: the non-zero indices as one array.

    Args:
      a: array of any dtype and rank >= 1.

    Returns:
      int32 array of shape ``(count, a.ndim)``; inside ``polymask.mask``
      ``count`` is a data-dependent dim var bounded by ``a``'s padded size
      (see ``nonzero``). Outside ``mask``: ``jnp.argwhere``'s values.

    Raises:
      ShapeError: under ``jax.jit`` outside ``mask`` without ``size=``.
    """
    if size is not None or not _masking():
        return _eager("argwhere", jnp.argwhere, a, size=size, fill_value=fill_value,
                      hint=" (or pass size=)")
    return _nonzero_bind(a, "argwhere")[0]


def flatnonzero(a, *, size=None, fill_value=None):
    """``np.flatnonzero``: indices of the non-zeros of the flattened logical array.

    Args:
      a: array of any dtype.

    Returns:
      int32 array of shape ``(count,)``, row-major indices into the *logical*
      (unpadded) array; inside ``polymask.mask`` ``count`` is a data-dependent
      dim var (see ``nonzero``).

    Raises:
      ShapeError: under ``jax.jit`` outside ``mask`` without ``size=``.
    """
    if size is not None or not _masking():
        return _eager("flatnonzero", jnp.flatnonzero, a, size=size, fill_value=fill_value,
                      hint=" (or pass size=)")
    return _nonzero_bind(a, "flat")[0]


def where(condition, x=None, y=None, *, size=None, fill_value=None):
    """``np.where``: one argument returns ``nonzero(condition)``; three = ``jnp.where``.

    With one argument inside ``polymask.mask`` the result is a tuple of index
    arrays of a data-dependent size (see ``nonzero``); with three it is the
    elementwise ``jnp.where(condition, x, y)`` (no size change).

    Raises:
      ValueError: exactly one of ``x``/``y`` given.
      ShapeError: one argument under ``jax.jit`` outside ``mask`` without ``size=``.
    """
    if x is None and y is None:
        return nonzero(condition, size=size, fill_value=fill_value)
    if x is None or y is None:
        raise ValueError("polymask.where takes one or three positional arguments")
    return jnp.where(condition, x, y)


# ----------------------------------------------------------------------------
# boolean masks
# ----------------------------------------------------------------------------
def _same_dims(a, b) -> bool:
    try:
        return len(a) == len(b) and all(bool(x == y) for x, y in zip(a, b))
    except compat.InconclusiveDimensionOperation:
        return False


def _bool_mask_bind(x, m, axis, check_extra=False):
    out_dim = _fresh(_bound(m.shape), _size(m.shape))
    return boolean_mask_p.bind(x, m, axis=axis, out_dim=out_dim, check_extra=check_extra)


def boolean_mask(x, m, axis: int = 0):
    """``x[m]`` along ``axis``: NumPy boolean indexing.

    Args:
      x: array of shape ``(*pre, *M, *post)`` with ``M = m.shape`` at ``axis``.
      m: boolean (or 0/1) array of shape ``M``.
      axis: where ``m``'s axes start in ``x``.

    Returns:
      Array of shape ``(*pre, count, *post)``, ``x``'s dtype; the selected
      elements in row-major order. Inside ``polymask.mask`` ``count`` is a
      data-dependent dim var bounded by the padded size of ``M`` (one compile
      for every count, a count per example under ``vmap``). Differentiable
      w.r.t. ``x``.

    Raises:
      ValueError: ``m`` is a scalar or does not fit ``x`` at ``axis``.
      ShapeError: ``m.shape`` differs from ``x.shape[axis:axis + m.ndim]``, or
        called under ``jax.jit`` outside ``mask``.
    """
    x = jnp.asarray(x)
    m = jnp.asarray(m).astype(bool)
    axis = operator.index(axis)
    if axis < 0:
        axis += x.ndim
    if m.ndim == 0 or not 0 <= axis <= x.ndim - m.ndim:
        raise ValueError(f"polymask.boolean_mask: mask of rank {m.ndim} does not fit x of "
                         f"rank {x.ndim} at axis {axis}")
    if not _same_dims(m.shape, x.shape[axis:axis + m.ndim]):
        raise ShapeError(f"polymask.boolean_mask: mask shape {m.shape} does not match "
                         f"x.shape[{axis}:{axis + m.ndim}] = {x.shape[axis:axis + m.ndim]} "
                         f"at {user_call_site()}")
    if not _masking():
        index = (slice(None),) * axis + (m,)
        return _eager("boolean_mask", lambda v: v[index], x)
    return _bool_mask_bind(x, m, axis)


def compress(condition, a, axis=None, *, size=None, fill_value=0):
    """``np.compress``: the slices of ``a`` along ``axis`` where ``condition`` is true.

    Args:
      condition: 1-D array (non-zero = keep); may be shorter than the axis.
      a: array; flattened first when ``axis`` is None.

    Returns:
      ``a``'s dtype, with ``axis`` replaced by a data-dependent size inside
      ``polymask.mask`` (see ``boolean_mask``); ``jnp.compress`` outside.

    Raises:
      ValueError: ``condition`` is not 1-D.
      ShapeError: ``condition`` selects past the axis (at run time), or called
        under ``jax.jit`` outside ``mask`` without ``size=``.
    """
    if size is not None or not _masking():
        return _eager("compress", jnp.compress, condition, a, axis, size=size,
                      fill_value=fill_value, hint=" (or pass size=)")
    cond = jnp.asarray(condition)
    if cond.ndim != 1:
        raise ValueError("polymask.compress: condition must be a 1-D array")
    a = jnp.asarray(a)
    if axis is None:
        a = a.reshape(-1)
        axis = 0
    axis = operator.index(axis)
    if axis < 0:
        axis += a.ndim
    cond = cond != 0
    check_extra = not _same_dims(cond.shape, a.shape[axis:axis + 1])
    return _bool_mask_bind(a, cond, axis, check_extra=check_extra)


def extract(condition, arr, *, size=None, fill_value=0):
    """``np.extract``: the elements of ``arr`` (flattened) where ``condition`` is true.

    Returns:
      1-D array of ``arr``'s dtype; its length is data-dependent inside
      ``polymask.mask`` (see ``compress``).

    Raises:
      ShapeError: under ``jax.jit`` outside ``mask`` without ``size=``.
    """
    if size is not None or not _masking():
        return _eager("extract", jnp.extract, condition, arr, size=size,
                      fill_value=fill_value, hint=" (or pass size=)")
    cond = jnp.asarray(condition)
    arr = jnp.asarray(arr)
    if arr.ndim >= 1 and _same_dims(cond.shape, arr.shape):
        # x[cond] with a full-rank mask walks the logical elements row-major.
        return _bool_mask_bind(arr, cond != 0, 0)
    return compress(cond.reshape(-1), arr.reshape(-1))


# ----------------------------------------------------------------------------
# unique
# ----------------------------------------------------------------------------
def unique(ar, return_index=False, return_inverse=False, return_counts=False, axis=None,
           *, equal_nan=True, size=None, fill_value=None):
    """``np.unique`` (flattened; ``axis`` only outside ``mask``).

    Args:
      ar: array of any dtype (NaNs count as one value when ``equal_nan``).
      return_index, return_inverse, return_counts: as in NumPy.

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
      start, stop, step: as in NumPy; Python numbers or integer scalars
        computed from data (e.g. ``k = jnp.sum(x > 0)``).
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
    return arange_p.bind(*as_arr, out_dim=_fresh(int(max_size)), dtype=dtype)


def _as_list(v, name):
    if isinstance(v, (list, tuple)):
        return list(v)
    if hasattr(v, "ndim") and getattr(v, "ndim", 0) == 1 and not compat.is_dim_expr(v):
        return [v[i] for i in range(v.shape[0])]
    return [v]


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
    ``len(start)`` axes). A size larger than the axis is clamped to it, then
    ``start`` is clamped so the slice fits (as ``lax.dynamic_slice``). Inside
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
            out_shape.append(d)
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
