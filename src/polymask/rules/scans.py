"""``lax.associative_scan`` over a dynamic axis.

``lax.associative_scan`` is not a primitive: JAX's implementation recurses on
the axis length in Python and refuses a symbolic one. While a masked function
is traced, calls over a symbolic axis are routed to
``associative_scan_symbolic`` (``compat.replace_during_trace``),
which computes the same scan with ops that trace at a symbolic length: a
Hillis-Steele doubling scan with ``ceil(log2(bound))`` steps, the bound being
the axis's upper bound in the trace's scope. Step ``d`` combines each
position ``i >= d`` with the running prefix at ``i - d``:
``y[i] = fn(y[i - d], y[i])``. Position ``i`` only ever reads positions
``<= i``, so the logical prefix never reads padding, and ``fn`` is only
applied to values of the scan (never a made-up identity), so any associative
``fn`` works and gradients stay finite. ``reverse=True`` reverses the logical
prefix (``lax.rev`` is masked), scans and reverses back, as JAX does.
Gradients follow from the ops (pad, select, iota, rev) having masking rules.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_compat as compat

__all__ = ["associative_scan_symbolic", "is_symbolic_scan"]

_ORIGINAL = lax.associative_scan


def is_symbolic_scan(elems, axis) -> bool:
    leaves = jax.tree_util.tree_leaves(elems)
    if not leaves:
        return False
    a = leaves[0]
    ax = axis % max(jnp.ndim(a), 1)
    return compat.is_dim_expr(jnp.shape(a)[ax])


def _shift(y, d: int, axis: int):
    """``y`` shifted by ``d`` along ``axis`` (toward higher indices), the first
    ``d`` positions filled with ``y``'s own values (never read as results)."""
    cfg = [(0, 0, 0)] * y.ndim
    cfg[axis] = (d, -d, 0)
    zero = jnp.zeros((), y.dtype)
    shifted = lax.pad(y, zero, cfg)
    idx = lax.broadcasted_iota(jnp.int32, y.shape, axis)
    return jnp.where(idx >= d, shifted, y)


def associative_scan_symbolic(fn, elems, reverse: bool = False, axis: int = 0):
    """``lax.associative_scan(fn, elems, reverse, axis)`` for a symbolic axis length."""
    if not is_symbolic_scan(elems, axis):
        return _ORIGINAL(fn, elems, reverse=reverse, axis=axis)
    flat, tree = jax.tree_util.tree_flatten(elems)
    axis = axis % flat[0].ndim
    n = flat[0].shape[axis]
    for e in flat[1:]:
        if e.shape[axis] is not n and not (e.shape[axis] == n):
            raise ValueError("Array inputs to associative_scan must have the same first "
                             f"dimension. (saw: {[x.shape for x in flat]})")
    bound = compat.upper_bound(n)
    if not math.isfinite(bound):
        return _ORIGINAL(fn, elems, reverse=reverse, axis=axis)  # JAX's own error
    if reverse:
        flat = [lax.rev(e, (axis,)) for e in flat]
    d = 1
    while d < int(bound):
        prev = [_shift(e, d, axis) for e in flat]
        comb = jax.tree_util.tree_leaves(
            fn(jax.tree_util.tree_unflatten(tree, prev), jax.tree_util.tree_unflatten(tree, flat)))
        flat = [jnp.where(lax.broadcasted_iota(jnp.int32, e.shape, axis) >= d, c, e)
                for c, e in zip(comb, flat)]
        d *= 2
    if reverse:
        flat = [lax.rev(e, (axis,)) for e in flat]
    return jax.tree_util.tree_unflatten(tree, flat)


compat.replace_during_trace("lax.associative_scan", associative_scan_symbolic)
