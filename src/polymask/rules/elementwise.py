"""Elementwise primitives: no masking needed.

The padded result of an elementwise op is the op applied to the padded
operands; logical positions only ever read logical positions. Garbage in
padding stays in padding; ops that *combine* positions mask it.
"""

from __future__ import annotations

import jax.numpy as jnp

from .registry import register

ELEMENTWISE = (
    # unary
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bessel_i0e", "bessel_i1e",
    "cbrt", "ceil", "clz", "conj", "cos", "cosh", "digamma", "erf", "erf_inv", "erfc",
    "exp", "exp2", "expm1", "floor", "imag", "integer_pow", "is_finite", "lgamma", "log",
    "log1p", "logistic", "neg", "not", "population_count", "real", "reduce_precision",
    "round", "rsqrt", "sign", "sin", "sinh", "sqrt", "square", "tan", "tanh",
    "convert_element_type", "bitcast_convert_type", "copy", "copy_p", "stop_gradient",
    "optimization_barrier",
    # binary and n-ary
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter",
    "and", "or", "xor", "shift_left", "shift_right_arithmetic", "shift_right_logical",
    "eq", "ne", "lt", "le", "gt", "ge", "complex", "igamma", "igammac", "igamma_grad_a",
    "random_gamma_grad", "polygamma", "zeta", "regularized_incomplete_beta",
    "select_n", "clamp", "add_any", "mulhi", "zeros_like",
    # placement / annotations: the padded buffer is placed like the logical one
    "sharding_constraint", "device_put", "layout_constraint", "name", "pin", "unpin",
)


# f(0, ..., 0) == 0 exactly: zero padding in all (full-shape) operands stays zero.
_ZERO_PRESERVING = {"add", "sub", "mul", "neg", "max", "min", "convert_element_type",
                    "copy", "copy_p", "stop_gradient", "add_any", "real", "imag", "abs"}


@register(*ELEMENTWISE)
def elementwise_rule(ctx, *args, **params):
    """Bind the primitive on the padded operands unchanged."""
    out = ctx.bind(*args)
    if (ctx.primitive.name in _ZERO_PRESERVING and args
            and all(getattr(a, "shape", ()) == getattr(out, "shape", None)
                    and ctx.has_zero_padding(a) for a in args)
            and jnp.issubdtype(out.dtype, jnp.inexact)):
        ctx.mark_zero_padding(out)
    return out
