"""Slices and gathers along a packed axis: indices are the example's own.

An index along a packed axis counts from the example's start, and its
bounds are the example's: ``x[0]`` (the [CLS] token), ``x[-1]`` and
``x[i]`` read each example's own element (one value per segment), a gather
of per-position indices (a permutation within each example) reads within
the owner's segment. ``lax``'s index modes keep their meaning per example:
``clip``/``promise_in_bounds`` clamp into the example, ``fill`` fills what
falls outside it. A slice that keeps a whole packed axis is free; a shared
array sliced to the ragged size (``table[:n]``) is read at each position's
index within its example.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ... import _jax_compat as compat
from ..registry import PerSegment, register_packed
from ..segments import shift_along


def _only_packed_axis(ctx, x):
    if isinstance(x, PerSegment):
        raise ctx.unsupported("a per-segment operand")
    packed = ctx.in_packed[0]
    if len(packed) != 1:
        raise ctx.unsupported("an index into one packed axis of several")
    return packed[0]


@register_packed(lax.slice_p)
def slice_rule(ctx, x, *, start_indices, limit_indices, strides):
    """``x[s:n + c]`` along a packed axis keeps it packed: each example's
    values move ``s`` positions towards its start (``x[1:]``, ``x[:-1]``,
    ``jnp.diff``); a slice of constant length (``x[0]``, ``x[-3:]``) is one
    value per example."""
    if isinstance(x, PerSegment):
        raise ctx.unsupported("a per-segment operand")
    in_aval, out_aval = ctx.in_avals[0], ctx.out_avals[0]
    strides = strides or (1,) * len(in_aval.shape)
    if not ctx.in_packed[0] and ctx.out_packed[0]:
        return _slice_to_positions(ctx, x, start_indices, limit_indices, strides)
    kept = [a for a in ctx.in_packed[0] if ctx.run.is_packed(out_aval.shape[a])]
    taken = [a for a in ctx.in_packed[0] if a not in kept]
    start_indices = list(start_indices)
    for a in kept:
        s = start_indices[a]
        if compat.is_dim_expr(s):  # mod(1, n) of jnp.roll: 1 where the program runs packed
            s = ctx.run.sizes.constant(s)
        if s is None or strides[a] != 1:
            raise ctx.unsupported(
                f"a slice from {ctx.run.prog.display(str(start_indices[a]))} with stride "
                f"{strides[a]} along the ragged axis (each example would start elsewhere)")
        start_indices[a] = s
    if taken:
        return _slice_per_segment(ctx, x, start_indices, limit_indices, strides)
    starts = [0 if i in kept else ctx.run.size(s) for i, s in enumerate(start_indices)]
    limits = [x.shape[i] if i in kept else ctx.run.size(s) for i, s in enumerate(limit_indices)]
    st = [1 if i in kept else s for i, s in enumerate(strides)]
    if (starts, limits, st) != ([0] * x.ndim, list(x.shape), [1] * x.ndim):
        x = lax.slice(x, tuple(starts), tuple(limits), tuple(st))
    for a in kept:
        x = shift_along(x, int(start_indices[a]), a)
    return x


def _slice_per_segment(ctx, x, start_indices, limit_indices, strides):
    """A slice of constant length along the packed axis: one value per segment."""
    a = _only_packed_axis(ctx, x)
    # the other axes first (static), then each segment's window along a
    starts = [0 if i == a else ctx.run.size(s) for i, s in enumerate(start_indices)]
    limits = [ctx.seg.R if i == a else ctx.run.size(s) for i, s in enumerate(limit_indices)]
    st = [1 if i == a else s for i, s in enumerate(strides)]
    x = lax.slice(x, tuple(starts), tuple(limits), tuple(st))
    out_len = ctx.run.size(ctx.out_avals[0].shape[a])
    first = ctx.segment_size(start_indices[a]) + ctx.seg.starts  # (S,)
    idx = first[:, None] + strides[a] * jnp.arange(out_len)[None, :]  # (S, k)
    idx = jnp.clip(idx, 0, ctx.seg.R - 1)
    taken_x = jnp.take(x, idx.reshape(-1), axis=a)  # a: S*k
    shape = list(x.shape)
    shape[a:a + 1] = [ctx.seg.S, out_len]
    return PerSegment(jnp.moveaxis(taken_x.reshape(shape), a, 0))


def _slice_to_positions(ctx, x, start_indices, limit_indices, strides):
    """A shared array sliced to the ragged size (``wpe[:n]``, nanoGPT's causal
    mask ``bias[:T, :T]``): each position reads the entry of its position
    within its own example, ``x[start + stride * pos]`` (not of its position in
    the row). Padding positions read a clamped entry (discarded)."""
    out_axes = ctx.out_packed[0]
    starts = [ctx.run.size(s) for s in start_indices]
    lo = [0 if i in out_axes else s for i, s in enumerate(starts)]
    hi = [x.shape[i] if i in out_axes else ctx.run.size(s)
          for i, s in enumerate(limit_indices)]
    st = [1 if i in out_axes else s for i, s in enumerate(strides)]
    x = lax.slice(x, tuple(lo), tuple(hi), tuple(st))
    for a in out_axes:
        x = jnp.take(x, starts[a] + strides[a] * ctx.seg.pos, axis=a, mode="clip")
    return x


@register_packed(lax.dynamic_slice_p)
def dynamic_slice_rule(ctx, x, *starts, slice_sizes):
    a = _only_packed_axis(ctx, x)
    if ctx.run.is_packed(slice_sizes[a]):  # a window of size n + c: stays packed
        if any(isinstance(s, PerSegment) for s in starts):
            raise ctx.unsupported("per-segment start indices with the packed axis kept whole")
        starts = list(starts)
        i = starts[a]
        starts[a] = jnp.zeros_like(i)  # the whole axis, then each example's window
        out = ctx.bind(x, *starts)
        room = ctx.offset(ctx.in_avals[0].shape[a]) - ctx.offset(slice_sizes[a])
        return _window_of_ragged_size(ctx, out, i, room, a)
    k = ctx.run.size(slice_sizes[a])
    seg = ctx.seg
    sizes = tuple(ctx.run.size(s) for s in slice_sizes)
    axes = [0 if isinstance(s, PerSegment) else None for s in starts]
    datas = [s.data if isinstance(s, PerSegment) else s for s in starts]

    def one(length, first, *idx):
        idx = list(idx)
        idx[a] = jnp.clip(idx[a], 0, jnp.maximum(length - k, 0)) + first
        return lax.dynamic_slice(x, idx, sizes)

    out = jax.vmap(one, in_axes=(0, 0, *axes))(seg.lengths, seg.starts, *datas)
    return PerSegment(out)


def _window_of_ragged_size(ctx, x, i, room: int, axis: int):
    """Each example's window of size ``n + c`` starting ``i`` into it: every
    example is ``room`` (a constant) longer than its window, so ``lax``'s
    clamp of the start is ``clip(i, 0, room)``; the row moves by that many
    positions (a slice of the row extended by its edge), or, for a start per
    example (``min(1, n)`` of ``x[1:]``), each position by its example's."""
    if room <= 0:
        return x
    if isinstance(i, PerSegment):
        s = jnp.clip(i.data.astype(jnp.int32).reshape(-1), 0, room)  # (S,)
        R = x.shape[axis]
        idx = jnp.clip(jnp.arange(R) + s[ctx.seg.slot], 0, R - 1)
        return jnp.take(x, idx, axis=axis, mode="clip")
    s = jnp.clip(jnp.asarray(i, jnp.int32), 0, room)
    edge = lax.slice_in_dim(x, x.shape[axis] - 1, x.shape[axis], axis=axis)
    ext = lax.concatenate([x, jnp.repeat(edge, room, axis=axis)], axis)
    return lax.dynamic_slice_in_dim(ext, s, x.shape[axis], axis=axis)


def _gather_ragged_window(ctx, operand, indices, dn, slice_sizes, mode, a):
    """A gather of a window of size ``n + c`` along packed axis ``a``: how
    ``jnp`` stages ``x[1:]``, ``x[:-1]`` and ``jnp.diff`` on a symbolic size.
    The other axes gather as written; along ``a`` each example's window."""
    data = indices.data if isinstance(indices, PerSegment) else indices
    if ctx.in_packed[1] or jnp.ndim(data) != 1 + isinstance(indices, PerSegment) \
            or dn.operand_batching_dims:
        raise ctx.unsupported("a window of the ragged size with batched starts")
    if lax.GatherScatterMode.from_any(mode) == lax.GatherScatterMode.FILL_OR_DROP:
        raise ctx.unsupported("a window of the ragged size in 'fill' mode")
    comp = list(dn.start_index_map).index(a)
    kept = [k for k in range(operand.ndim) if k not in dn.collapsed_slice_dims]
    out_axis = dn.offset_dims[kept.index(a)]  # the packed axis in the output
    if isinstance(indices, PerSegment):
        i = PerSegment(data[:, comp])
        # the whole axis (n + c is R) gathered at each example's starts along the
        # other axes (x[1:, 1]: JAX stages the 1 per example too); each row keeps
        # its own example's gather (one at a time: memory of two gathers, not S)
        starts = data.at[:, comp].set(0)
        first = ctx.bind(operand, starts[0])
        rows = ctx.seg.slot.reshape((1,) * out_axis + (-1,) + (1,) * (first.ndim - 1 - out_axis))

        def keep_segment(s, out):
            return jnp.where(rows == s, ctx.bind(operand, starts[s]), out)

        out = lax.fori_loop(1, ctx.seg.S, keep_segment, first)
    else:
        i = data[comp]
        out = ctx.bind(operand, data.at[comp].set(0))  # the whole axis (n + c is R)
    room = ctx.offset(ctx.in_avals[0].shape[a]) - ctx.offset(slice_sizes[a])
    return _window_of_ragged_size(ctx, out, i, room, out_axis)


def _gather_to_positions(ctx, operand, indices, dn, slice_sizes, mode, grown):
    """A gather whose slices have the ragged size along axes ``grown`` of an
    operand without a packed axis there: how a symbolic slice of a shared
    array is staged (``wpe[:t]``, nanoGPT's ``bias[:, :T, :T]``, ``table[2:n + 2]``).
    Position ``p`` reads ``start + pos(p)`` (its index within its example, the
    start clamped into the operand as ``lax.gather`` clamps it for that
    example's length), not ``start + p``: the whole axis is gathered from 0,
    then each position takes its own entry."""
    if ctx.in_packed[1] or jnp.ndim(indices) != 1 or dn.operand_batching_dims:
        raise ctx.unsupported("a slice of the ragged size with batched or per-position starts")
    if lax.GatherScatterMode.from_any(mode) == lax.GatherScatterMode.FILL_OR_DROP:
        raise ctx.unsupported("a slice of the ragged size in 'fill' mode")
    seg, smap = ctx.seg, list(dn.start_index_map)
    sizes = [operand.shape[a] if a in grown else ctx.run.size(s)
             for a, s in enumerate(slice_sizes)]
    zero = [smap.index(a) for a in grown if a in smap]
    starts = indices.at[jnp.asarray(zero, jnp.int32)].set(0) if zero else indices
    out = ctx.primitive.bind(operand, starts, **ctx.params(slice_sizes=tuple(sizes)))
    kept = [a for a in range(operand.ndim) if a not in dn.collapsed_slice_dims]
    length = seg.lengths[seg.slot]  # (R,) each position's example length
    for a in grown:
        d = operand.shape[a]
        s = indices[smap.index(a)].astype(jnp.int32) if a in smap else jnp.int32(0)
        first = jnp.clip(s, 0, jnp.maximum(d - length, 0))
        idx = jnp.clip(first + seg.pos, 0, d - 1)
        out = jnp.take(out, idx, axis=dn.offset_dims[kept.index(a)])
    return out


@register_packed(lax.gather_p)
def gather_rule(ctx, operand, indices, *, dimension_numbers, slice_sizes, mode, fill_value,
                **params):
    dn = dimension_numbers
    if isinstance(operand, PerSegment):
        raise ctx.unsupported("a per-segment operand")
    packed = ctx.in_packed[0]
    indexed = [a for a in packed if a in dn.start_index_map]
    if not indexed:  # the packed axes are kept whole (or are batch dims)
        if isinstance(indices, PerSegment):
            raise ctx.unsupported("per-segment indices into a packed operand")
        grown = [a for a, s in enumerate(slice_sizes)
                 if a not in packed and ctx.run.is_packed(s)]
        if grown:
            return _gather_to_positions(ctx, operand, indices, dn, slice_sizes, mode, grown)
        return ctx.bind(operand, indices)
    if len(packed) != 1:
        raise ctx.unsupported("an index into one packed axis of several")
    (a,) = indexed
    if ctx.run.is_packed(slice_sizes[a]):
        return _gather_ragged_window(ctx, operand, indices, dn, slice_sizes, mode, a)
    k = ctx.run.size(slice_sizes[a])
    comp = list(dn.start_index_map).index(a)
    seg = ctx.seg
    mode = lax.GatherScatterMode.from_any(mode)
    fill = mode == lax.GatherScatterMode.FILL_OR_DROP

    def shifted(idx, length, first):
        i = idx[..., comp]
        if fill:
            ok = (i >= 0) & (i <= length - k)
            j = jnp.where(ok, i + first, seg.R)  # out of the row too: lax fills it
        else:
            j = jnp.clip(i, 0, jnp.maximum(length - k, 0)) + first
        return idx.at[..., comp].set(j.astype(idx.dtype))

    row_params = ctx.params(dimension_numbers=dn, slice_sizes=slice_sizes, mode=mode,
                            fill_value=fill_value)
    idx_packed = ctx.in_packed[1]
    if idx_packed:  # per-position indices: each reads within its own segment
        b = idx_packed[0]
        lengths = seg.along(seg.lengths[seg.slot], b, indices.ndim)
        first = seg.along(seg.starts[seg.slot], b, indices.ndim)
        return ctx.primitive.bind(operand, shifted(indices, lengths[..., 0], first[..., 0]),
                                  **row_params)
    idx_data = indices.data if isinstance(indices, PerSegment) else indices

    def one(idx, length, first):
        return ctx.primitive.bind(operand, shifted(idx, length, first), **row_params)

    in_axes = (0 if isinstance(indices, PerSegment) else None, 0, 0)
    return PerSegment(jax.vmap(one, in_axes=in_axes)(idx_data, seg.lengths, seg.starts))
