"""Contractions: ``dot_general``.

Contracted padding is zeroed on *both* operands with ``select`` (old JAX
``mask`` rule / XLA DynamicPadder). For the backward pass (JAX differentiates
the padded program): the VJP w.r.t. one operand contracts the output
cotangent with the other operand over the *free* axes, so for float dtypes we
also zero the free-axis padding of the operands and select the output's
padding, making both factors of every backward product finite there.
"""

from __future__ import annotations

from jax import lax

from ..tracing.registry import register
from .util import clean, is_inexact, masked_axes


@register(lax.dot_general_p)
def dot_general_rule(ctx, lhs, rhs, *, dimension_numbers, **params):
    (lc, rc), _ = dimension_numbers
    if ctx.state.forward_only:
        # Never differentiated (``polymask.jit``/``ragged_map``): zeroing the
        # contracted padding is enough; free-axis padding stays garbage.
        zl, zr = ctx.has_zero_padding(lhs), ctx.has_zero_padding(rhs)
        if not zl:
            lhs = clean(lhs, ctx.in_logical[0], lc)
        if not zr:
            rhs = clean(rhs, ctx.in_logical[1], rc)
        out = ctx.bind(lhs, rhs)
        return ctx.mark_zero_padding(out) if zl and zr else out
    inexact = is_inexact(ctx.out_avals[0].dtype)
    l_axes = None if inexact else lc
    r_axes = None if inexact else rc
    # An operand whose padding is already exactly 0 (e.g. an entry-masked
    # input, or another contraction's output) needs no second select.
    if not ctx.has_zero_padding(lhs):
        lhs = clean(lhs, ctx.in_logical[0], l_axes)
    if not ctx.has_zero_padding(rhs):
        rhs = clean(rhs, ctx.in_logical[1], r_axes)
    out = ctx.bind(lhs, rhs)
    if inexact and masked_axes(ctx.out_logical[0], ctx.out_bounds[0]):
        out = ctx.mark_zero_padding(clean(out, ctx.out_logical[0]))
    return out
