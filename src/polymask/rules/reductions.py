"""Reductions: fill the reduced axes' padding with the reduction's identity.

Follows the old ``jax.interpreters.masking`` reduction rules and XLA's
DynamicPadder: padding becomes the identity (0, 1, -inf/+inf, or the int
dtype's min/max, never +-inf for ints) before the physical reduction.
"""

from __future__ import annotations

from jax import lax

from ..tracing.registry import register
from .families import defreducer
from .util import fill_padding

defreducer(lax.reduce_sum_p, kind="sum", module=__name__)
defreducer(lax.reduce_prod_p, kind="prod", module=__name__)
defreducer(lax.reduce_max_p, lax.argmax_p, kind="max", module=__name__)
defreducer(lax.reduce_min_p, lax.argmin_p, kind="min", module=__name__)
defreducer(lax.reduce_and_p, kind="and", module=__name__)
defreducer(lax.reduce_or_p, kind="or", module=__name__)
defreducer(lax.reduce_xor_p, kind="xor", module=__name__)


@register(lax.reduce_p)
def generic_reduce_rule(ctx, *args, computation, jaxpr, dimensions):
    """``lax.reduce`` with user init values: padding becomes the init value."""
    n = len(args) // 2
    operands, inits = args[:n], args[n:]
    filled = [fill_padding(x, lg, init, dimensions)
              for x, lg, init in zip(operands, ctx.in_logical[:n], inits)]
    return ctx.bind(*filled, *inits)
