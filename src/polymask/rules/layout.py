"""Layout primitives: broadcast, squeeze, transpose, iota, reshape, size queries."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from .registry import register
from .util import clean, is_inexact, masked_axes


@register("dim_as_value")
def dim_as_value_rule(ctx, *, dim):
    """A size used as a number is its *logical* size (Thunder's ``prims.shape``)."""
    dtype = ctx.out_avals[0].dtype
    return jnp.asarray(ctx.logical(dim), dtype)


@register("broadcast_in_dim")
def broadcast_in_dim_rule(ctx, x, *dyn, shape, broadcast_dimensions, sharding):
    """Broadcast at the bound; for float results, zero the padding of new dynamic axes.

    The transpose of a broadcast sums the cotangent over the new axes; zeroing
    that axis's padding (a ``select``) keeps NaN cotangents from padding out
    of the logical gradient.
    """
    if dyn:
        raise ctx.unsupported("dynamic-shape broadcast operands")
    out = ctx.bind(x)
    if not is_inexact(out.dtype):
        return out
    zero_in = ctx.has_zero_padding(x)
    in_shape = ctx.in_avals[0].shape
    new_axes = [ax for ax in range(len(shape))
                if ax not in broadcast_dimensions
                or in_shape[broadcast_dimensions.index(ax)] != shape[ax]]
    axes = masked_axes(ctx.out_logical[0], ctx.out_bounds[0], new_axes)
    out = clean(out, ctx.out_logical[0], axes) if axes else out
    return ctx.mark_zero_padding(out) if zero_in else out


@register("squeeze", "transpose", "iota", "expand_dims", "rev_static")
def relayout_rule(ctx, *args, **params):
    """Ops that keep the logical corner a corner: bind with padded-size params."""
    out = ctx.bind(*args)
    if args and ctx.has_zero_padding(args[0]):
        ctx.mark_zero_padding(out)  # padding moves with the corner
    return out


def _groups(in_shape, out_shape):
    """Split a reshape into groups of axes with equal symbolic size products."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [i], [j]
        pi = in_shape[i] if i < len(in_shape) else 1
        pj = out_shape[j] if j < len(out_shape) else 1
        i, j = i + 1, j + 1
        for _ in range(64):
            try:
                if pi == pj and (not (i < len(in_shape) and _is_one(in_shape[i])) and
                                 not (j < len(out_shape) and _is_one(out_shape[j]))):
                    break
            except compat.InconclusiveDimensionOperation:
                pass
            if (i < len(in_shape)) and (j >= len(out_shape) or _smaller(pi, pj)):
                pi = pi * in_shape[i]
                gi.append(i)
                i += 1
            elif j < len(out_shape):
                pj = pj * out_shape[j]
                gj.append(j)
                j += 1
            else:
                return None
        else:
            return None
        groups.append(([a for a in gi if a < len(in_shape)], [b for b in gj if b < len(out_shape)]))
    return groups


def _is_one(d) -> bool:
    return not compat.is_dim_expr(d) and int(d) == 1


def _smaller(a, b) -> bool:
    try:
        return bool(a < b) if not (compat.is_dim_expr(a) or compat.is_dim_expr(b)) else \
            compat.upper_bound(a) < compat.upper_bound(b) or (
                compat.upper_bound(a) == compat.upper_bound(b) and a != b and
                len(str(a)) < len(str(b)))
    except compat.InconclusiveDimensionOperation:
        return True


def is_prefix_reshape(ctx) -> bool:
    """True when the logical data stays a row-major prefix in every axis group.

    That holds when, in each group of axes with equal size products, only the
    group's first axis may be padded, on both sides, and the padded products
    agree. Such reshapes are free (one ``reshape`` at the bound).
    """
    in_shape = ctx.in_avals[0].shape
    out_shape = ctx.out_avals[0].shape
    groups = _groups(in_shape, out_shape)
    if groups is None:
        return False
    in_l, in_b = ctx.in_logical[0], ctx.in_bounds[0]
    out_l, out_b = ctx.out_logical[0], ctx.out_bounds[0]
    for gi, gj in groups:
        if any(a in masked_axes(in_l, in_b) for a in gi[1:]):
            return False
        if any(b in masked_axes(out_l, out_b) for b in gj[1:]):
            return False
        if int(np.prod([in_b[a] for a in gi])) != int(np.prod([out_b[b] for b in gj])):
            return False
    return True


@register("reshape")
def reshape_rule(ctx, x, *dyn, new_sizes, dimensions, sharding):
    """Prefix-preserving reshapes are free; fragmenting ones re-lay out the data.

    A fragmenting reshape (the logical elements are not a row-major prefix in
    some axis group, e.g. ``(a, b) -> (a*b,)`` with ``b`` padded) is handled by
    ``reshape_relayout`` when available.
    """
    if dyn or dimensions is not None:
        raise ctx.unsupported("reshape with dynamic operands or `dimensions`")
    if is_prefix_reshape(ctx):
        out = lax.reshape(x, tuple(ctx.out_bounds[0]))
        return ctx.mark_zero_padding(out) if ctx.has_zero_padding(x) else out
    relayout = _RELAYOUT.get("reshape")
    if relayout is None:
        raise ctx.unsupported(
            f"fragmenting reshape {ctx.in_avals[0].shape} -> {ctx.out_avals[0].shape}")
    return relayout(ctx, x)


# The general (gather-based) reshape lives with the fragmenting-reshape work;
# it registers itself here so this module keeps the fast path.
_RELAYOUT: dict = {}
