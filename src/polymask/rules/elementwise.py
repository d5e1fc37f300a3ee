"""Elementwise primitives: no masking needed.

The padded result of an elementwise op is the op applied to the padded
operands; logical positions only ever read logical positions. Garbage in
padding stays in padding; ops that *combine* positions mask it.
"""

from __future__ import annotations

from .families import defelementwise

# f(0, ..., 0) == 0 exactly: zero padding in all (full-shape) operands stays zero.
defelementwise("add", "sub", "mul", "neg", "max", "min", "convert_element_type", "copy",
               "stop_gradient", "add_any", "real", "imag", "abs", zero_preserving=True)
# unary
defelementwise(
    "acos", "acosh", "asin", "asinh", "atan", "atanh", "bessel_i0e", "bessel_i1e",
    "cbrt", "ceil", "clz", "conj", "cos", "cosh", "digamma", "erf", "erf_inv", "erfc",
    "exp", "exp2", "expm1", "floor", "integer_pow", "is_finite", "lgamma", "log",
    "log1p", "logistic", "not", "population_count", "reduce_precision",
    "round", "rsqrt", "sign", "sin", "sinh", "sqrt", "square", "tan", "tanh",
    "bitcast_convert_type", "optimization_barrier",
    "log2", "one_minus_square")  # jax >= 0.11 (jnp.log2; tanh's derivative 1 - x^2)
# binary and n-ary
defelementwise(
    "div", "rem", "pow", "atan2", "nextafter",
    "and", "or", "xor", "shift_left", "shift_right_arithmetic", "shift_right_logical",
    "eq", "ne", "lt", "le", "gt", "ge", "complex", "igamma", "igammac", "igamma_grad_a",
    "polygamma", "zeta", "regularized_incomplete_beta",
    "select_n", "clamp", "mulhi", "zeros_like",
    "polynomial")  # jax >= 0.12: Horner's rule in x and broadcast coefficients
# placement / annotations: the padded buffer is placed like the logical one
defelementwise("sharding_constraint", "device_put", "layout_constraint", "name", "pin",
               "unpin")
