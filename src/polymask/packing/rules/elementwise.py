"""Elementwise primitives: free in the packed layout.

Every position computes from its own position, so the row is computed as
one array; a per-segment scalar operand (``select_n``'s predicate,
``clamp``'s bounds) is first gathered at each position's segment.
"""

from __future__ import annotations

import jax.numpy as jnp

from ...rules.families import FAMILIES
from ..registry import register_packed


def elementwise_rule(ctx, *args, **params):
    aval, axes = ctx.out_avals[0], ctx.out_packed[0]
    return ctx.bind(*(ctx.lift(a, aval, axes) for a in args))


# NaN in, NaN out at the same position, whatever the other operands (XLA's
# max and min propagate NaN; ``pow(nan, 0)``, a compare or a select do not):
# a NaN check of the packed interpreter may wait for their results
_NAN_PROPAGATING = {
    "add", "sub", "mul", "div", "neg", "abs", "sign", "exp", "exp2", "log",
    "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "sin", "cos", "tan",
    "erf", "square", "floor", "ceil", "round", "stop_gradient", "reduce_precision", "copy",
    "copy_p"}
# XLA:CPU's max and min may drop a NaN (its max reductions do, even in plain
# jax.jit): a pending NaN check passes through them as an added poison term
# (``PackedRun.poisoned``), never through their own NaN
_POISONED = {"max", "min"}
_CONDITIONAL = {
    "convert_element_type": lambda params: jnp.issubdtype(params["new_dtype"], jnp.inexact),
    "integer_pow": lambda params: params["y"] != 0,
}

_elementwise = [name for name, (family, _) in FAMILIES.items() if family == "elementwise"]
register_packed(*[n for n in _elementwise if n not in _NAN_PROPAGATING
                  and n not in _CONDITIONAL and n not in _POISONED])(elementwise_rule)
register_packed(*[n for n in _elementwise if n in _POISONED],
                nan_propagating=lambda params: "poison")(elementwise_rule)
register_packed(*[n for n in _elementwise if n in _NAN_PROPAGATING],
                nan_propagating=True)(elementwise_rule)
for _name, _pred in _CONDITIONAL.items():
    if _name in _elementwise:
        register_packed(_name, nan_propagating=_pred)(elementwise_rule)
