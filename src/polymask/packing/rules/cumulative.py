"""Cumulative scans along a packed axis restart at every segment start.

A segmented scan (Blelloch 1990, "Prefix sums and their applications":
the scan of ``(value, segment)`` pairs whose operator keeps the right value
when the segments differ) with ``lax.associative_scan``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ...rules.families import FAMILIES
from ..registry import PerSegment, register_packed

_COMBINE = {"cumsum": lax.add, "cumprod": lax.mul, "cummax": lax.max, "cummin": lax.min,
            "cumlogsumexp": jnp.logaddexp}


def cumulative_rule(ctx, x, *, axis, reverse):
    if isinstance(x, PerSegment):
        raise ctx.unsupported("a per-segment operand")
    if axis not in ctx.in_packed[0]:
        return ctx.bind(x)
    seg = ctx.axis_segments(ctx.in_avals[0], axis)
    return seg.segmented_scan(x, _COMBINE[ctx.primitive.name], axis, reverse)


register_packed(*[name for name, (family, _) in FAMILIES.items()
                  if family == "cumulative"])(cumulative_rule)
