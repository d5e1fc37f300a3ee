"""Cumulative ops (``cumsum``, ``cumprod``, ``cummax``, ``cummin``, ``cumlogsumexp``).

Forward scans are prefix-safe: position ``i`` reads positions ``<= i``. Their
transpose is a reverse scan that reads the padding's cotangent, so float
results get their padding selected to 0 (which zeroes those cotangents).
Reverse scans read the padding, so it is filled with the identity first.
"""

from __future__ import annotations

from .registry import register
from .util import clean, fill_padding, identity_of, is_inexact, masked_axes

_KIND = {"cumsum": "sum", "cumprod": "prod", "cummax": "max", "cummin": "min",
         "cumlogsumexp": "max"}


@register(*_KIND)
def cumulative_rule(ctx, x, *, axis, reverse):
    lg = ctx.in_logical[0]
    if not masked_axes(lg, ctx.in_bounds[0], [axis]):
        return ctx.bind(x)
    if reverse:
        return ctx.bind(fill_padding(x, lg, identity_of(x.dtype, _KIND[ctx.primitive.name]),
                                     [axis]))
    out = ctx.bind(x)
    if not is_inexact(out.dtype):
        return out
    out = clean(out, lg, [axis])
    if ctx.has_zero_padding(x) and ctx.primitive.name == "cumsum":
        ctx.mark_zero_padding(out)  # other axes' padding: cumsum of zeros is 0
    return out
