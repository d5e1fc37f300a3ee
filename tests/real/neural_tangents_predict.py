"""The NTK of a Dense-ReLU-Dense network and gradient-descent MSE prediction
from neural-tangents.

Source: https://github.com/google/neural-tangents (commit c17e770),
neural_tangents/_src/stax/elementwise.py (ABRelu's nngp_ntk_fn, _sqrt and
_arctan2 with their custom JVPs) and neural_tangents/_src/predict.py
(gradient_descent_mse for finite t (eigh) and t=None (cho_solve),
_add_diagonal_regularizer, _make_expm1_fn, _make_inv_expm1_fn).
License: Apache-2.0, Copyright 2019 Google LLC.
Copied: the kernel formulas of stax.serial(Dense, Relu, Dense) written out for
2-D inputs (``nt_dense_relu_dense_ntk``, ours); gradient_descent_mse with
trace_axes=(-1,) and a 2-D kernel, its helper functions inlined. n training
points, 4 test points.
"""

import functools

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np

from .corpus import normal, program

SRC = "neural-tangents https://github.com/google/neural-tangents/blob/c17e770/neural_tangents/_src/"


# -- _src/stax/elementwise.py ABRelu; _src/predict.py gradient_descent_mse ------------------------
@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _sqrt(x, tol=0.):
    return jnp.sqrt(jnp.maximum(x, tol))


@_sqrt.defjvp
def _sqrt_jvp(tol, primals, tangents):
    x, = primals
    x_dot, = tangents
    safe_tol = max(tol, 1e-30)
    square_root = _sqrt(x, safe_tol)
    square_root_out = _sqrt(x, tol)
    return square_root_out, jnp.where(x > safe_tol, x_dot / (2 * square_root), 0.)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _arctan2(x, y, fill_zero=None):
    if fill_zero is not None:
        return jnp.where(jnp.bitwise_and(x == 0., y == 0.), fill_zero, jnp.arctan2(x, y))
    return jnp.arctan2(x, y)


@_arctan2.defjvp
def _arctan2_jvp(fill_zero, primals, tangents):
    x, y = primals
    x_dot, y_dot = tangents
    primal_out = _arctan2(x, y, fill_zero)
    safe_tol = 1e-30
    denom = jnp.maximum(x ** 2 + y ** 2, safe_tol)
    tangent_out = x_dot * (y / denom) - y_dot * (x / denom)
    return primal_out, tangent_out


def ab_relu_nngp_ntk_fn(nngp, prod, ntk=None, a=0., b=1.):
    square_root = _sqrt(prod - nngp**2)
    angles = _arctan2(square_root, nngp, fill_zero=jnp.pi / 2)
    factor = (a - b)**2 / (2 * jnp.pi)
    dot_sigma = (a**2 + b**2) / 2 - factor * angles
    nngp = factor * square_root + dot_sigma * nngp
    if ntk is not None:
        ntk *= dot_sigma
    return nngp, ntk


def nt_dense_relu_dense_ntk(x1, x2, W_std=1.5, b_std=0.05):
    """Dense -> Relu -> Dense kernel_fn (ntk) of stax.serial, the formulas of Dense/ABRelu."""
    d = x1.shape[-1]
    cov1 = W_std**2 * jnp.sum(x1 * x1, -1) / d + b_std**2
    cov2 = W_std**2 * jnp.sum(x2 * x2, -1) / d + b_std**2
    nngp = W_std**2 * x1 @ x2.T / d + b_std**2
    ntk = nngp
    prod12 = cov1[:, None] * cov2[None, :]
    nngp, ntk = ab_relu_nngp_ntk_fn(nngp, prod12, ntk)
    # Dense
    ntk = W_std**2 * (ntk + nngp) + b_std**2
    return ntk


def _add_diagonal_regularizer(A, diag_reg, diag_reg_absolute_scale):
    dimension = A.shape[0]
    if not diag_reg_absolute_scale:
        diag_reg *= jnp.trace(A) / dimension
    return A + diag_reg * jnp.eye(dimension)


def _make_expm1_fn(normalization):
    def expm1_fn(evals, t):
        return jnp.expm1(-jnp.maximum(evals, 0.) * t / normalization)
    return expm1_fn


def _make_inv_expm1_fn(normalization):
    expm1_fn = _make_expm1_fn(normalization)

    def _inv_expm1_fn(evals, t):
        return expm1_fn(evals, t) / jnp.abs(evals)
    return _inv_expm1_fn


def nt_gradient_descent_mse(k_train_train, y_train, learning_rate=1., diag_reg=0.,
                            diag_reg_absolute_scale=False):
    """predict.gradient_descent_mse with trace_axes=(-1,), 2-D kernel."""
    odd, first = (1,), (0,)
    trace_axes = (-1,)
    last_t_axes = (-1,)
    non_t_axes = (-2,)
    n_non_t_axes = 1

    def get_predict_fn_inf():
        A = _add_diagonal_regularizer(k_train_train, diag_reg, diag_reg_absolute_scale)
        C = jsp.linalg.cho_factor(A, False)

        def solve(b, b_axes):
            x_shape = k_train_train.shape[1::2] + tuple(b.shape[a] for a in b_axes)
            b = jnp.moveaxis(b, b_axes, (-1,))
            b = b.reshape((A.shape[1], -1))
            x = jsp.linalg.cho_solve(C, b)
            return x.reshape(x_shape)

        def predict_fn_inf(fx_train_0, fx_test_0, k_test_train):
            fx_train_t = y_train.astype(k_train_train.dtype)
            rhs = y_train if fx_train_0 is None else y_train - fx_train_0
            dfx_test = jnp.tensordot(k_test_train, solve(rhs, trace_axes), (odd, first))
            dfx_test = jnp.moveaxis(dfx_test, last_t_axes, trace_axes)
            fx_test_t = fx_test_0 + dfx_test
            return fx_train_t, fx_test_t

        return predict_fn_inf

    def get_predict_fn_finite():
        A = _add_diagonal_regularizer(k_train_train, diag_reg, diag_reg_absolute_scale)
        evals, evecs = jnp.linalg.eigh(A)
        evals = jnp.expand_dims(evals, 0)

        def to_eigenbasis(fn):
            def new_fn(y_train, t):
                return jnp.einsum('ji,ti,ki,k...->tj...', evecs, fn(evals, t), evecs, y_train,
                                  optimize=True)
            return new_fn

        expm1_fn = to_eigenbasis(_make_expm1_fn(y_train.size))
        inv_expm1_fn = to_eigenbasis(_make_inv_expm1_fn(y_train.size))
        rhs_shape = tuple(y_train.shape[a] for a in trace_axes)

        def predict_fn_finite(t, fx_train_0, fx_test_0, k_test_train):
            t = jnp.array(t) * learning_rate
            t_shape, t_ndim = t.shape, t.ndim
            first_t_axes = tuple(range(t_ndim))
            t = t.reshape((-1, 1))
            rhs = -y_train if fx_train_0 is None else fx_train_0 - y_train
            rhs = jnp.moveaxis(rhs, trace_axes, last_t_axes).reshape((-1,) + rhs_shape)
            shape = t_shape + k_train_train.shape[1::2] + rhs_shape
            dfx_train = expm1_fn(rhs, t).reshape(shape)
            dfx_train = jnp.moveaxis(dfx_train, last_t_axes, trace_axes)
            fx_train_t = jnp.expand_dims(fx_train_0, first_t_axes) + dfx_train
            dfx_test = inv_expm1_fn(rhs, t).reshape(shape)
            dfx_test = jnp.tensordot(k_test_train, dfx_test, (odd, non_t_axes))
            dfx_test = jnp.moveaxis(dfx_test,
                                    tuple(range(n_non_t_axes, n_non_t_axes + t_ndim)) + last_t_axes,
                                    tuple(range(t_ndim)) + trace_axes)
            fx_test_t = jnp.expand_dims(fx_test_0, first_t_axes) + dfx_test
            return fx_train_t, fx_test_t

        return predict_fn_finite

    def predict_fn(t=None, fx_train_0=0., fx_test_0=None, k_test_train=None):
        if t is None:
            return get_predict_fn_inf()(fx_train_0, fx_test_0, k_test_train)
        return get_predict_fn_finite()(t, fx_train_0, fx_test_0, k_test_train)

    return predict_fn


# -- the program ----------------------------------------------------------------------------------
def predict_program(x_test, fx_test_0, x_train, y_train, fx_train_0):
    """The NTK on n training points; predictions at t = 0.5, 3 and infinity."""
    k_train_train = nt_dense_relu_dense_ntk(x_train, x_train)
    k_test_train = nt_dense_relu_dense_ntk(x_test, x_train)
    predict_fn = nt_gradient_descent_mse(k_train_train, y_train, learning_rate=1.0,
                                         diag_reg=1e-3)
    fx_train_t, fx_test_t = predict_fn(jnp.array([0.5, 3.0]), fx_train_0, fx_test_0,
                                       k_test_train)
    _, fx_test_inf = predict_fn(None, fx_train_0, fx_test_0, k_test_train)
    return fx_train_t, fx_test_t, fx_test_inf


def _predict_example(n, rng):
    return (np.random.default_rng(5).normal(size=(4, 3)).astype(np.float32),
            np.zeros((4, 2), np.float32), normal(rng, n, 3), normal(rng, n, 2),
            0.1 * normal(rng, n, 2))


PROGRAMS = [
    program(name="nt_gradient_descent_mse_ntk",
            source=SRC + "predict.py gradient_descent_mse (eigh, cho_solve), "
                         "stax/elementwise.py ABRelu kernel",
            license="Apache-2.0", fun=predict_program, in_specs=(None, None, "n, 3", "n, 2", "n, 2"),
            make_example=_predict_example, bound=8, rtol=2e-3, atol=2e-3,
            note="eigh's gradient is ill-conditioned in float32 (plain JAX's float32 gradient is "
                 "as far from float64's), hence the tolerance"),
]
