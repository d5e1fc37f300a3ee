"""``approx_top_k`` (``lax.approx_max_k`` / ``approx_min_k``): answered exactly.

The exact top ``k`` is a valid answer of the approximate op (its recall is
1). Padding sorts last via a validity key, as in ``sorting.top_k_rule``;
ties go to the lower index. ``k`` may be a size (``min(top_k, L)``): the
output's padded size is its bound, as ``top_k``'s.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..tracing.registry import register
from .sorting import check_symbolic_k, signed_zero_key
from .util import masked_axes, valid_mask


@register(lax.approx_top_k_p)
def approx_top_k_rule(ctx, x, *, k, reduction_dimension, recall_target, is_max_k,
                      reduction_input_size_override, aggregate_to_topk):
    axis = reduction_dimension % x.ndim
    lg, bd = ctx.in_logical[0], ctx.in_bounds[0]
    kb = ctx.out_bounds[0][axis]  # (k's bound where k is a size: ColabDesign's min(k, L))
    check_symbolic_k(ctx, k, lg[axis], "approx_top_k")
    if not masked_axes(lg, bd, [axis]) and kb <= bd[axis]:
        return ctx.bind(x)
    if not aggregate_to_topk:
        raise ctx.unsupported("approx_top_k with aggregate_to_topk=False on a dynamic axis "
                              "(its output size depends on the backend); use the default "
                              "aggregate_to_topk=True")
    padding_key = (~valid_mask(lg, bd, [axis])).astype(jnp.int32)
    index = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    n = jnp.asarray(lg[axis], jnp.int32)
    if is_max_k:
        # ascending (padding last, value, -index): the top k are the last k logical
        # positions read backwards (equal values: lower index first)
        _, values, _, neg_idx = lax.sort((padding_key, x, signed_zero_key(x), -index),
                                         dimension=axis, is_stable=True, num_keys=4)
        pos = jnp.clip(n - 1 - lax.iota(jnp.int32, kb), 0, bd[axis] - 1)
        values = jnp.take(values, pos, axis=axis)
        indices = -jnp.take(neg_idx, pos, axis=axis)
    else:
        # (XLA:CPU's approx_min_k ranks -0.0 and +0.0 equal: no signed-zero key)
        _, values, idx = lax.sort((padding_key, x, index), dimension=axis,
                                  is_stable=True, num_keys=3)
        pos = jnp.clip(lax.iota(jnp.int32, kb), 0, bd[axis] - 1)
        values = jnp.take(values, pos, axis=axis)
        indices = jnp.take(idx, pos, axis=axis)
    return [values, indices.astype(ctx.out_avals[1].dtype)]
