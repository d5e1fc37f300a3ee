"""Sorting along a packed axis sorts each segment in place.

The region id is prepended as the first sort key: regions are contiguous
and numbered in row order, so sorting the row by ``(region, keys...)``
sorts every example within its own positions (padding, id ``S``, stays
last). With a gap (``segments.py``) the dead positions of each region come
second: ``(region, dead, keys...)`` keeps them after the segment. ``argsort``'s iota is the within-segment position (``layout.py``),
so indices come out per example.

``top_k`` along the packed axis is that sort too: the row sorted by
``(region, dead, NaN sign, value, ±0, -index)`` holds each example's values ascending in
its own positions, so its top ``k`` are its last ``k`` live positions read
backwards (ties to the lower index, as ``lax.top_k``; the padded rule's
order, ``rules/sorting.py``). One value per example.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ...rules.sorting import nan_sign_key, signed_zero_key
from ..registry import PerSegment, register_packed


@register_packed(lax.sort_p)
def sort_rule(ctx, *operands, dimension, is_stable, num_keys):
    if any(isinstance(x, PerSegment) for x in operands):
        raise ctx.unsupported("a per-segment operand")
    if dimension not in ctx.in_packed[0]:
        return ctx.bind(*operands)
    if len(ctx.in_packed[0]) != 1:
        raise ctx.unsupported("sorting along one packed axis of several")
    seg = ctx.axis_segments(ctx.in_avals[0], dimension)
    shape = operands[0].shape
    # dead positions (a gap, or a size n - c) sort after the segment in its region
    has_dead = seg.gap or seg.offset
    keys = [seg.region] + ([(~seg.live).astype(jnp.int32)] if has_dead else [])
    keys = [jnp.broadcast_to(seg.along(k, dimension, len(shape)), shape) for k in keys]
    out = lax.sort((*keys, *operands), dimension=dimension, is_stable=is_stable,
                   num_keys=num_keys + len(keys))
    return list(out[len(keys):])


@register_packed(lax.top_k_p)
def top_k_rule(ctx, x, *, k, **params):
    if isinstance(x, PerSegment):
        raise ctx.unsupported("a per-segment operand")
    axis = params.get("axis", -1) % x.ndim
    if axis not in ctx.in_packed[0]:
        return ctx.bind(x)
    if len(ctx.in_packed[0]) != 1 or ctx.run.is_packed(k):
        raise ctx.unsupported("top_k with k of the ragged size or over one packed axis of "
                              "several")
    k = ctx.run.size(k)
    seg = ctx.axis_segments(ctx.in_avals[0], axis)
    keys = [seg.region, (~seg.live).astype(jnp.int32)]
    keys = [jnp.broadcast_to(seg.along(t, axis, x.ndim), x.shape) for t in keys]
    neg_index = jnp.broadcast_to(seg.along(-seg.rpos, axis, x.ndim), x.shape)
    *_, values, _, neg_idx = lax.sort((*keys, nan_sign_key(x), x, signed_zero_key(x),
                                       neg_index), dimension=axis, is_stable=True, num_keys=6)
    # example s's i-th largest sits at start + length - 1 - i
    at = seg.starts[:, None] + seg.lengths[:, None] - 1 - jnp.arange(k)[None, :]  # (S, k)
    at = jnp.clip(at, 0, seg.R - 1).reshape(-1)

    def per_example(v):
        v = jnp.take(v, at, axis=axis)  # the axis now holds S * k
        shape = list(v.shape)
        shape[axis:axis + 1] = [seg.S, k]
        return jnp.moveaxis(v.reshape(shape), axis, 0)  # (S, ..., k, ...)

    idx = (-per_example(neg_idx)).astype(ctx.out_avals[1].dtype)
    return [PerSegment(per_example(values)), PerSegment(idx)]
