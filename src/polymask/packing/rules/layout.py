"""Layout primitives: broadcasts, reshapes, transposes, positions, sizes.

- ``empty`` is zeros at the packed shape (its contents are unspecified).
- ``iota`` along a packed axis is each position's index *within its
  segment* (``Segments.pos``): positions restart at every example, so
  ``jnp.arange(n)`` position embeddings read the example's own positions.
- a size used as a number (``dim_as_value``: ``x.shape[0]``, the ``n`` of a
  mean) is one value per segment: the example's own length.
- ``broadcast_in_dim`` of a per-segment value onto a packed axis gathers it
  at each position's segment (the mean broadcast back over the tokens).
- ``reshape`` keeps each packed axis whole (merging or splitting only the
  other axes); ``rev`` reverses each segment in place; ``split`` along
  another axis keeps the packed axis whole.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..registry import PerSegment, broadcast_with_new_axis, register_packed


@register_packed("dim_as_value")
def dim_as_value_rule(ctx, *, dim):
    return PerSegment(ctx.segment_size(dim, as_value=True).astype(ctx.out_avals[0].dtype))


@register_packed(lax.iota_p)
def iota_rule(ctx, *, dtype, shape, dimension, sharding):
    out_shape = ctx.shape(ctx.out_avals[0])
    if dimension in ctx.out_packed[0]:
        pos = ctx.axis_segments(ctx.out_avals[0], dimension).pos
        return lax.broadcast_in_dim(pos.astype(dtype), out_shape, (dimension,))
    return lax.broadcasted_iota(dtype, out_shape, dimension)


@register_packed("empty")  # jnp.empty binds it from jax 0.11 (a broadcast of 0 before)
def empty_rule(ctx, **params):
    """An array of unspecified contents (``jnp.empty``, ``jax.scipy.stats.rankdata``'s
    buffer) at the packed shape: zeros, as jnp.empty's are on XLA."""
    aval = ctx.out_avals[0]
    return jnp.zeros(ctx.shape(aval), aval.dtype)


@register_packed(lax.broadcast_in_dim_p, nan_propagating=True)
def broadcast_in_dim_rule(ctx, x, *dyn, shape, broadcast_dimensions, sharding):
    if dyn:
        raise ctx.unsupported("dynamic-shape broadcast operands")
    out_shape = ctx.shape(ctx.out_avals[0])
    if isinstance(x, PerSegment) and not ctx.out_packed[0]:
        # a per-example value broadcast to a per-example value (jnp.repeat of
        # x[0:1] along the ragged axis): per example (PackedContext.bind)
        return ctx.bind(x)
    if isinstance(x, PerSegment):  # every packed axis of the result is new
        g = ctx.seg.to_positions(x.data)
        return broadcast_with_new_axis(g, ctx.out_packed[0][0], broadcast_dimensions, out_shape)
    return lax.broadcast_in_dim(x, out_shape, tuple(broadcast_dimensions))


@register_packed("tile")
def tile_rule(ctx, x, *, reps):
    """``jnp.tile`` along other axes keeps the packed axis; a per-example
    value of size 1 tiled ``n`` times along the ragged axis (PointNet's global
    feature next to every point) is that value at each of its positions."""
    out_aval = ctx.out_avals[0]
    packed_reps = [a for a, r in enumerate(reps) if ctx.run.is_packed(r)]
    if not packed_reps:
        if isinstance(x, PerSegment):
            raise ctx.unsupported("a per-segment operand")
        return ctx.bind(x)
    if (len(packed_reps) != 1 or ctx.in_packed[0]
            or ctx.run.offset(reps[packed_reps[0]]) != ctx.offset(out_aval.shape[packed_reps[0]])):
        raise ctx.unsupported("tiling along the ragged axis")
    (a,) = packed_reps
    rest = tuple(1 if i == a else ctx.run.size(r) for i, r in enumerate(reps))
    if isinstance(x, PerSegment):  # (S, ..., 1 at a, ...): tile the rest, then gather
        data = jnp.tile(x.data, (1, *rest))
        g = ctx.axis_segments(out_aval, a).to_positions(data)  # (R, ..., 1 at a, ...)
        return jnp.moveaxis(jnp.squeeze(g, a + 1), 0, a)
    shape = ctx.shape(out_aval)
    return jnp.broadcast_to(jnp.tile(x, rest), shape)


@register_packed(lax.transpose_p, lax.squeeze_p, nan_propagating=True)
def relayout_rule(ctx, x, **params):
    if isinstance(x, PerSegment):
        raise ctx.unsupported("a per-segment operand")
    return ctx.bind(x)


@register_packed("stack", "unstack")
def stack_rule(ctx, *xs, axis):
    """``jnp.stack`` of packed values (a new axis of constant size) and
    ``unstack`` along another axis than the ragged one: free."""
    if any(isinstance(x, PerSegment) for x in xs):
        raise ctx.unsupported("a per-segment operand beside a packed one")
    if ctx.primitive.name == "unstack" and axis in ctx.in_packed[0]:
        raise ctx.unsupported("unstacking along the ragged axis")
    return ctx.bind(*xs)


@register_packed("split")
def split_rule(ctx, x, *, sizes, axis):
    """``jnp.split`` along another axis than the ragged one (q, k, v of a fused
    projection): every piece keeps the packed axis whole."""
    if isinstance(x, PerSegment):
        raise ctx.unsupported("a per-segment operand")
    if axis in ctx.in_packed[0]:
        raise ctx.unsupported("a split along the ragged axis")
    return ctx.bind(x)


def _runs(shape, run):
    """Constant sizes between packed axes: ``[[...], [...], ...]`` (one more
    run than packed axes)."""
    runs = [[]]
    for d in shape:
        if run.is_packed(d):
            runs.append([])
        else:
            runs[-1].append(run.size(d))
    return runs


@register_packed(lax.reshape_p)
def reshape_rule(ctx, x, *dyn, new_sizes, dimensions, **params):
    if dyn or dimensions is not None:
        raise ctx.unsupported("a dynamic or permuting reshape")
    a, b = ctx.in_avals[0].shape, ctx.out_avals[0].shape
    run = ctx.run
    ra, rb = _runs(a, run), _runs(b, run)
    same_sizes = ([run.offset(d) for d in a if run.is_packed(d)]
                  == [run.offset(d) for d in b if run.is_packed(d)])
    if (len(ra) != len(rb) or not same_sizes
            or any(_prod(p) != _prod(q) for p, q in zip(ra, rb))):
        raise ctx.unsupported(
            f"a reshape from {tuple(map(str, a))} to {tuple(map(str, b))} merges or splits "
            "the ragged axis (the packed layout keeps it whole)")
    return ctx.bind(x)


def _prod(xs):
    out = 1
    for v in xs:
        out *= v
    return out


@register_packed(lax.rev_p)
def rev_rule(ctx, x, *, dimensions):
    packed = [d for d in dimensions if d in ctx.in_packed[0]]
    rest = tuple(d for d in dimensions if d not in packed)
    if rest:
        x = lax.rev(x, rest)
    for d in packed:
        seg = ctx.axis_segments(ctx.in_avals[0], d)
        # position start + len - 1 - pos of its own segment; dead positions stay put
        idx = seg.starts[seg.slot] + seg.lengths[seg.slot] - 1 - seg.pos
        idx = jnp.where(seg.live, idx, jnp.arange(seg.R))
        x = jnp.take(x, idx, axis=d)
    return x
