"""Elementwise primitives: free in the packed layout.

Every position computes from its own position, so the row is computed as
one array; a per-segment scalar operand (``select_n``'s predicate,
``clamp``'s bounds) is first gathered at each position's segment.
"""

from __future__ import annotations

from ...rules.families import FAMILIES
from ..registry import register_packed


def elementwise_rule(ctx, *args, **params):
    aval, axes = ctx.out_avals[0], ctx.out_packed[0]
    return ctx.bind(*(ctx.lift(a, aval, axes) for a in args))


register_packed(*[name for name, (family, _) in FAMILIES.items()
                  if family == "elementwise"])(elementwise_rule)
