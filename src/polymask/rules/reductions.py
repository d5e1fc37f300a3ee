"""Reductions: fill the reduced axes' padding with the reduction's identity.

Follows the old ``jax.interpreters.masking`` reduction rules and XLA's
DynamicPadder: padding becomes the identity (0, 1, -inf/+inf, or the int
dtype's min/max, never +-inf for ints) before the physical reduction.
"""

from __future__ import annotations

from .registry import register
from .util import fill_padding, identity_of

_KIND = {
    "reduce_sum": "sum", "reduce_prod": "prod", "reduce_max": "max", "reduce_min": "min",
    "reduce_and": "and", "reduce_or": "or", "reduce_xor": "xor",
}


@register(*_KIND)
def monoid_reduction_rule(ctx, x, *, axes, **params):
    kind = _KIND[ctx.primitive.name]
    if not (kind in ("sum", "or", "xor") and ctx.has_zero_padding(x)):  # 0 is the identity
        x = fill_padding(x, ctx.in_logical[0], identity_of(x.dtype, kind), axes)
    return ctx.bind(x)


@register("argmax", "argmin")
def arg_reduction_rule(ctx, x, *, axes, index_dtype):
    """Padding gets the worst value so the first logical extremum wins."""
    kind = "max" if ctx.primitive.name == "argmax" else "min"
    x = fill_padding(x, ctx.in_logical[0], identity_of(x.dtype, kind), axes)
    return ctx.bind(x)


@register("reduce")
def generic_reduce_rule(ctx, *args, computation, jaxpr, dimensions):
    """``lax.reduce`` with user init values: padding becomes the init value."""
    n = len(args) // 2
    operands, inits = args[:n], args[n:]
    filled = [fill_padding(x, lg, init, dimensions)
              for x, lg, init in zip(operands, ctx.in_logical[:n], inits)]
    return ctx.bind(*filled, *inits)
