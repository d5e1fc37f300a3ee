"""Sorting: padding sorts last, using validity as the leading sort key."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .registry import register
from .util import masked_axes, valid_mask


@register("sort")
def sort_rule(ctx, *operands, dimension, is_stable, num_keys):
    lg, bd = ctx.in_logical[0], ctx.in_bounds[0]
    if not masked_axes(lg, bd, [dimension]):
        return ctx.bind(*operands)
    padding_key = (~valid_mask(lg, bd, [dimension])).astype(jnp.int32)
    outs = lax.sort((padding_key, *operands), dimension=dimension, is_stable=is_stable,
                    num_keys=num_keys + 1)
    return list(outs[1:])
