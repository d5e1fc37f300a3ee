"""``custom_vmap_call``: a ``jax.custom_batching.custom_vmap`` function.

By the time the masked program runs, any ``jax.vmap`` inside the user's
function has been traced, so only the function itself is left to evaluate:
the rule evaluates its jaxpr with masking. (This is how a ``polymask.mask``
nested inside ``jax.vmap`` inside another mask works: the inner mask's staged
size checks are a ``custom_vmap`` function.)
"""

from __future__ import annotations

from ..tracing.registry import register


@register("custom_vmap_call")
def custom_vmap_call_rule(ctx, *args, call, **_):
    return ctx.eval_jaxpr(call, *args)
