"""Mask builders shared by the rule families.

Padding is neutralised with ``select`` (``lax.select``/``jnp.where``), never by
multiplying with 0 (``0 * nan = nan``). ``select`` also fixes the backward
pass: its transpose routes cotangents only to the selected side, so a
cotangent that is NaN in padding cannot leak into the logical region.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from ..core.masks import masked_axes, shared_masks, valid_mask  # noqa: F401  (rules import them from here)
from ..core.shapes import is_static
from ..core.trace_state import current_scope
from ..tracing.state import GUARD


def fill_padding(x, logical: Sequence, fill, axes=None):
    """``where(valid, x, fill)`` over ``axes``; ``x`` unchanged when nothing is padded."""
    m = valid_mask(logical, x.shape, axes)
    if m is None:
        return x
    return lax.select(m, x, lax.full_like(x, fill))


def clean(x, logical: Sequence, axes=None):
    """Zero the padding (``select``, NaN-safe) on ``axes``."""
    return fill_padding(x, logical, 0, axes)


def _gradient_gate(valid, x):
    # select(v, x, x) in value (XLA folds it); the tangent is select(v, tx, 0).
    # (A custom_jvp identity would be cheaper under vmap, but JAX batches its
    # tangent and not its primal when only `valid` is batched.)
    return lax.select(jnp.broadcast_to(valid, jnp.shape(x)), x, lax.stop_gradient(x))


def gate_gradients(valid, xs: Sequence) -> list:
    """``xs`` unchanged; their tangents (and so cotangents) zeroed where ``valid``
    is False (a ``select``, NaN-safe).

    For a computation whose result is discarded where ``valid`` is False (a
    loop step past the logical trip count, a padding position): its backward
    pass there multiplies a zero cotangent by its local derivatives, which
    are infinite where the discarded forward divides by 0 or takes ``log(0)``
    (``0 * inf = nan``), and that NaN would reach the gradient of every input
    it read, parameters included. The gate stops it at the inputs. ``valid``
    is a bool array broadcastable to each ``x`` (or None: no gate).
    """
    if valid is None:
        return list(xs)
    return [_gradient_gate(valid, x) if is_inexact(jnp.result_type(x)) else x for x in xs]


def clean_float(x, logical: Sequence, axes=None):
    """Zero the padding of a float result on ``axes`` (default all); ints unchanged.

    Rules call this on results whose padding may hold values read from
    logical positions: the transpose would route those positions' padding
    cotangents (possibly NaN) into the logical gradient. Integer results
    have no cotangents, so they skip the ``select``.
    """
    if not is_inexact(x.dtype):
        return x
    return clean(x, logical, axes)


def keep_nan(out, x, reduce_sum):
    """``out``, a max or min reduction of ``x``, made NaN wherever the
    entries it reduced hold a NaN: ``reduce_sum`` (the same reduction as a
    sum: same axes or windows) of ``x``'s NaNs, selected in where it is NaN.

    Why: XLA:CPU's ``reduce_max``/``reduce_min`` and its max/min windows may
    drop a NaN (openxla/xla#21461): over a row of 64 with one NaN they return
    a number, in plain ``jax.jit`` too, while 3 wide they return NaN
    (``jnp.max`` follows NumPy: NaN). A masked reduction runs at the bound's
    width, so without this a size whose exact ``jax.jit`` program gives NaN
    would get a number. A sum never drops a NaN. Finite data: ``out``
    unchanged (a select). Integer and bool ``x``: ``out`` as is."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return out
    nans = reduce_sum(lax.select(jnp.isnan(x), x, jnp.zeros_like(x)))
    return lax.select(jnp.isnan(nans), nans.astype(out.dtype), out)


def keep_last_complex_nan(out, x, logical, axes):
    """``out``, a max or min reduction of complex ``x`` over ``axes``, as plain
    JAX's: its complex max/min is a select on a lexicographic comparison, so
    a NaN is kept only where it is the last element reduced (each later
    element replaces it: ``max([nan + 1j, 2])`` is 2, ``max([2, nan + 1j])``
    NaN). A masked reduction reduces the padding after the last logical
    element, which replaced such a NaN by the fill: that element is taken
    back. Other dtypes: ``out`` as is."""
    if not jnp.issubdtype(x.dtype, jnp.complexfloating):
        return out
    last = x
    for a in sorted(axes, reverse=True):  # (row-major: the last along each axis)
        last = lax.dynamic_index_in_dim(last, jnp.maximum(logical[a] - 1, 0), a,
                                        keepdims=False)
    nan = jnp.isnan(last.real) | jnp.isnan(last.imag)
    return lax.select(nan, last.astype(out.dtype), out)


def _has_inf(dtype) -> bool:
    """Whether a float type has an infinity (float8_e4m3fn and the fnuz types
    have none: -inf becomes NaN there, and a max filled with it was NaN)."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return True
    with np.errstate(all="ignore"):
        return bool(np.isinf(np.array(np.inf, np.float32).astype(dtype)))


def identity_of(dtype, kind: str):
    """Identity element of a reduction for ``dtype``: ints use dtype min/max, not
    inf (complex: ``-inf + 0j``, the init value of JAX's own complex max)."""
    dtype = np.dtype(dtype)
    if kind == "sum" or kind == "or" or kind == "xor":
        return np.zeros((), dtype)[()] if dtype != np.bool_ else False
    if kind == "prod":
        return np.ones((), dtype)[()] if dtype != np.bool_ else True
    if kind == "and":  # every bit set (1 cleared all but bit 0 of an integer AND)
        return True if dtype == np.bool_ else np.array(-1).astype(dtype)[()]
    if kind == "max":
        if dtype == np.bool_:
            return False
        if jnp.issubdtype(dtype, jnp.inexact):
            return -np.inf if _has_inf(dtype) else jnp.finfo(dtype).min
        return jnp.iinfo(dtype).min
    if kind == "min":
        if dtype == np.bool_:
            return True
        if jnp.issubdtype(dtype, jnp.inexact):
            return np.inf if _has_inf(dtype) else jnp.finfo(dtype).max
        return jnp.iinfo(dtype).max
    raise ValueError(kind)


def is_inexact(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def same_dim(a, b) -> bool:
    """True when two (symbolic) sizes are provably equal; False when unknown."""
    try:
        return bool(a == b)
    except compat.InconclusiveDimensionOperation:
        return False


def in_masked_trace() -> bool:
    """Whether a masked trace runs in this thread: the trace patches
    (``compat.replace_during_trace``) fall back to JAX's own function
    outside one."""
    return current_scope() is not None


def has_symbolic_shape(*arrays) -> bool:
    """Whether any of ``arrays`` has a symbolic size."""
    return any(compat.is_dim_expr(d) for a in arrays for d in np.shape(a))


def dynamic_sizes(state):
    """The traced sizes (and the case guard, see ``RunState.with_sizes``) that
    functions JAX traces again (custom derivatives, ``sequential_vmap``) take as
    explicit arguments: ``(names, int32 sizes)``."""
    dims = state.dims
    names = [v for v, x in dims.logical_values.items() if not is_static(x)]
    sizes = [jnp.asarray(dims.logical_values[v], jnp.int32) for v in names]
    if state.guard is not None:
        names.append(GUARD)
        sizes.append(jnp.asarray(state.guard, jnp.int32))
    return names, sizes

