"""Elementwise primitives: free in the packed layout.

Every position computes from its own position, so the row is computed as
one array; a per-segment scalar operand (``select_n``'s predicate,
``clamp``'s bounds) is first gathered at each position's segment.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ...rules.families import FAMILIES
from ..registry import register_cross_value, register_packed


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


# -- what a result holds between examples (``register_cross_value``) -----------
# Known values are the reductions' identities only (0, +inf, -inf): exact in
# every float dtype, so a result computed from them in float64 here is what
# the row's dtype holds too.
def _identity_or_none(v) -> float | None:
    v = float(v)
    return v if v == 0.0 or np.isinf(v) else None


def _both(fn, a, b) -> float | None:
    with np.errstate(all="ignore"):
        return _identity_or_none(fn(np.float64(a), np.float64(b)))


@register_cross_value("add")
def _add_cross(crosses, params):
    a, b = crosses
    if a is not None and b is not None:
        return _both(np.add, a, b)
    known = a if a is not None else b
    return known if known is not None and np.isinf(known) else None  # inf + x: inf or NaN


@register_cross_value("sub")
def _sub_cross(crosses, params):
    a, b = crosses
    if a is not None and b is not None:
        return _both(np.subtract, a, b)
    if a is not None and np.isinf(a):
        return a  # inf - x: inf or NaN
    if b is not None and np.isinf(b):
        return -b
    return None


@register_cross_value("mul")
def _mul_cross(crosses, params):
    a, b = crosses
    if a is not None and b is not None:
        return _both(np.multiply, a, b)
    return 0.0 if 0.0 in (a, b) else None  # 0 * x: 0 (either sign) or NaN


@register_cross_value("div")
def _div_cross(crosses, params):
    a, b = crosses
    if a is not None and b is not None:
        return _both(np.divide, a, b)
    if a == 0.0 or (b is not None and np.isinf(b)):
        return 0.0  # 0 / x and x / inf: 0 (either sign) or NaN
    return None


def _unary(fn):
    def cross(crosses, params):
        (c,) = crosses
        if c is None:
            return None
        with np.errstate(all="ignore"):
            return _identity_or_none(fn(np.float64(c)))
    return cross


register_cross_value("exp")(_unary(np.exp))  # exp(-inf) = 0: a softmax's weights
register_cross_value("log")(_unary(np.log))
register_cross_value("neg")(_unary(np.negative))


@register_cross_value("convert_element_type", "copy", "copy_p", "reduce_precision")
def _kept_cross(crosses, params):
    """0 and inf survive a float conversion or rounding (not one to integers)."""
    new = params.get("new_dtype")
    return crosses[0] if new is None or jnp.issubdtype(new, jnp.inexact) else None

