"""Elementwise primitives: no masking needed.

The padded result of an elementwise op is the op applied to the padded
operands; logical positions only ever read logical positions. Garbage in
padding stays in padding; ops that *combine* positions mask it.
"""

from __future__ import annotations

from jax import lax

from .families import defelementwise

# f(0, ..., 0) == 0 exactly: zero padding in all (full-shape) operands stays zero.
defelementwise(
    lax.add_p, lax.sub_p, lax.mul_p, lax.neg_p, lax.max_p, lax.min_p,
    lax.convert_element_type_p, lax.copy_p, lax.stop_gradient_p, "add_any", lax.real_p,
    lax.imag_p, lax.abs_p, zero_preserving=True, module=__name__)
# unary
defelementwise(
    lax.acos_p, lax.acosh_p, lax.asin_p, lax.asinh_p, lax.atan_p, lax.atanh_p,
    lax.bessel_i0e_p, lax.bessel_i1e_p, lax.cbrt_p, lax.ceil_p, lax.clz_p, lax.conj_p,
    lax.cos_p, lax.cosh_p, lax.digamma_p, lax.erf_p, lax.erf_inv_p, lax.erfc_p, lax.exp_p,
    lax.exp2_p, lax.expm1_p, lax.floor_p, lax.integer_pow_p, lax.is_finite_p, lax.lgamma_p,
    lax.log_p, lax.log1p_p, lax.logistic_p, lax.not_p, lax.population_count_p,
    lax.reduce_precision_p, lax.round_p, lax.rsqrt_p, lax.sign_p, lax.sin_p, lax.sinh_p,
    lax.sqrt_p, lax.square_p, lax.tan_p, lax.tanh_p, lax.bitcast_convert_type_p,
    lax.optimization_barrier_p,
    "log2", "one_minus_square",  # jax >= 0.11 (jnp.log2; tanh's derivative 1 - x^2)
    # jax >= 0.12.1: sin(pi x) and kin (jax.scipy.special's reflection formulas)
    "sinpi", "cospi", "tanpi", "asinpi", "acospi", "atanpi", "exp2m1", "log2p1",
    module=__name__)
# binary and n-ary
defelementwise(
    lax.div_p, lax.rem_p, lax.pow_p, lax.atan2_p, lax.nextafter_p, lax.and_p, lax.or_p,
    lax.xor_p, lax.shift_left_p, lax.shift_right_arithmetic_p, lax.shift_right_logical_p,
    lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p, lax.complex_p, lax.igamma_p,
    lax.igammac_p, lax.igamma_grad_a_p, lax.polygamma_p, lax.zeta_p,
    lax.regularized_incomplete_beta_p, lax.select_n_p, lax.clamp_p, lax.mulhi_p, "zeros_like",
    "polynomial",  # jax >= 0.12: Horner's rule in x and broadcast coefficients
    "atan2pi", "fma", "fmuladd",  # jax >= 0.12.1
    module=__name__)
# placement / annotations: the padded buffer is placed like the logical one
defelementwise(lax.sharding_constraint_p, lax.device_put_p, "layout_constraint", "name", "pin",
               "unpin", module=__name__)
