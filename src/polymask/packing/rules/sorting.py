"""Sorting along a packed axis sorts each segment in place.

The segment id is prepended as the first sort key: segments are contiguous
and numbered in row order, so sorting the row by ``(segment, keys...)``
sorts every example within its own positions (padding, id ``S``, stays
last). ``argsort``'s iota is the within-segment position (``layout.py``),
so indices come out per example.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..registry import PerSegment, register_packed


@register_packed(lax.sort_p)
def sort_rule(ctx, *operands, dimension, is_stable, num_keys):
    if any(isinstance(x, PerSegment) for x in operands):
        raise ctx.unsupported("a per-segment operand")
    if dimension not in ctx.in_packed[0]:
        return ctx.bind(*operands)
    if len(ctx.in_packed[0]) != 1:
        raise ctx.unsupported("sorting along one packed axis of several")
    shape = operands[0].shape
    ids = jnp.broadcast_to(ctx.seg.along(ctx.seg.seg, dimension, len(shape)), shape)
    out = lax.sort((ids, *operands), dimension=dimension, is_stable=is_stable,
                   num_keys=num_keys + 1)
    return list(out[1:])
