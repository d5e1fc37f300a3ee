"""Mask builders shared by the rule families.

Padding is neutralised with ``select`` (``lax.select``/``jnp.where``), never by
multiplying with 0 (``0 * nan = nan``). ``select`` also fixes the backward
pass: its transpose routes cotangents only to the selected side, so a
cotangent that is NaN in padding cannot leak into the logical region.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from ..core.shapes import needs_mask


def masked_axes(logical: Sequence, padded: Sequence[int], axes=None) -> list[int]:
    """Axes (of ``axes``, default all) whose logical size may differ from the bound."""
    cand = range(len(padded)) if axes is None else axes
    return [a for a in cand if needs_mask(logical[a], padded[a])]


# Validity masks built during one masked run, shared by every rule that needs
# the same one (CSE): key (current JAX trace, padded shape, (axis, size object)).
_MASKS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("polymask_masks",
                                                                    default=None)


@contextlib.contextmanager
def shared_masks() -> Iterator[None]:
    """Within the block, ``valid_mask`` builds each distinct mask once per trace."""
    token = _MASKS.set({})
    try:
        yield
    finally:
        _MASKS.reset(token)


def _current_trace():
    return compat.current_trace()  # None: no sharing


def valid_mask(logical: Sequence, padded: Sequence[int], axes=None):
    """Boolean array of shape ``padded``, True on the logical corner of ``axes``.

    Returns None when no axis needs a mask (static fast path). Inside
    ``shared_masks()`` (each masked run) an equal mask is built once per trace:
    the cache keeps the size objects and the trace alive so their ids stay unique.
    """
    axes = masked_axes(logical, padded, axes)
    if not axes:
        return None
    padded = tuple(int(p) for p in padded)
    cache = _MASKS.get()
    trace = _current_trace() if cache is not None else None
    key = None
    if trace is not None:
        key = (id(trace), padded, tuple((a, id(logical[a])) for a in axes))
        hit = cache.get(key)
        if hit is not None:
            return hit[0]
    ok = None
    for a in axes:
        m = lax.broadcasted_iota(jnp.int32, padded, a) < jnp.asarray(logical[a], jnp.int32)
        ok = m if ok is None else (ok & m)
    if key is not None:
        cache[key] = (ok, trace, [logical[a] for a in axes])
    return ok


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


def identity_of(dtype, kind: str):
    """Identity element of a reduction for ``dtype``: ints use dtype min/max, not inf."""
    dtype = np.dtype(dtype)
    if kind == "sum" or kind == "or" or kind == "xor":
        return np.zeros((), dtype)[()] if dtype != np.bool_ else False
    if kind == "prod" or kind == "and":
        return np.ones((), dtype)[()] if dtype != np.bool_ else True
    if kind == "max":
        if dtype == np.bool_:
            return False
        if jnp.issubdtype(dtype, jnp.inexact):
            return -np.inf
        return jnp.iinfo(dtype).min
    if kind == "min":
        if dtype == np.bool_:
            return True
        if jnp.issubdtype(dtype, jnp.inexact):
            return np.inf
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
    (``registry.register_trace_patch``) fall back to JAX's own function
    outside one."""
    from ..tracing.symbolic import current_scope

    return current_scope() is not None


def has_symbolic_shape(*arrays) -> bool:
    """Whether any of ``arrays`` has a symbolic size."""
    return any(compat.is_dim_expr(d) for a in arrays for d in np.shape(a))
