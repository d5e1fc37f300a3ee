"""nonzero, argwhere, flatnonzero, one-argument where, boolean_mask, compress, extract."""

from __future__ import annotations

import operator

import jax.numpy as jnp

from .. import _jax_compat as compat
from ..core.diagnostics import user_call_site
from ..core.errors import ShapeError
from ..rules.data_dependent import (
    boolean_mask_p,
    nonzero_p,
)
from ._common import _bound, _eager, _fresh, _masking, _size


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
