"""Reductions: fill the reduced axes' padding with the reduction's identity.

Follows the old ``jax.interpreters.masking`` reduction rules and XLA's
DynamicPadder: padding becomes the identity (0, 1, -inf/+inf, or the int
dtype's min/max, never +-inf for ints) before the physical reduction.
"""

from __future__ import annotations

from ..tracing.registry import register
from .families import defreducer
from .util import fill_padding

defreducer("reduce_sum", kind="sum")
defreducer("reduce_prod", kind="prod")
defreducer("reduce_max", "argmax", kind="max")
defreducer("reduce_min", "argmin", kind="min")
defreducer("reduce_and", kind="and")
defreducer("reduce_or", kind="or")
defreducer("reduce_xor", kind="xor")


@register("reduce")
def generic_reduce_rule(ctx, *args, computation, jaxpr, dimensions):
    """``lax.reduce`` with user init values: padding becomes the init value."""
    n = len(args) // 2
    operands, inits = args[:n], args[n:]
    filled = [fill_padding(x, lg, init, dimensions)
              for x, lg, init in zip(operands, ctx.in_logical[:n], inits)]
    return ctx.bind(*filled, *inits)
