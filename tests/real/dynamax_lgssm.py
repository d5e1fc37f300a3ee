"""Kalman filter and RTS smoother from dynamax (linear Gaussian SSM).

Source: https://github.com/probml/dynamax (commit cfb005f),
dynamax/linear_gaussian_ssm/inference.py (_predict, _condition_on with a full
emission covariance, lgssm_filter, lgssm_smoother) and dynamax/utils/utils.py
(psd_solve, symmetrize). License: MIT, Copyright (c) 2022 Probabilistic machine learning.
Copied with time-invariant parameters (``_get_params`` returns the same
matrices at every t), no inputs (``inputs = jnp.zeros((T, 0))`` as dynamax
does), and tfp's ``MultivariateNormalFullCovariance.log_prob`` written out
with a Cholesky factor. T = n time steps, state and emission dimension 2.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.linalg import cho_factor, cho_solve, solve_triangular

from .corpus import params, program

SRC = "dynamax https://github.com/probml/dynamax/blob/cfb005f/dynamax/linear_gaussian_ssm/inference.py"


def symmetrize(A):
    return 0.5 * (A + jnp.swapaxes(A, -1, -2))


def psd_solve(A, b, diagonal_boost=1e-9):
    A = symmetrize(A) + diagonal_boost * jnp.eye(A.shape[-1])
    L, lower = cho_factor(A, lower=True)
    return cho_solve((L, lower), b)


def mvn_log_prob(m, S, y):
    L = jnp.linalg.cholesky(S)
    z = solve_triangular(L, y - m, lower=True)
    return (-0.5 * jnp.sum(z ** 2) - jnp.sum(jnp.log(jnp.diag(L)))
            - 0.5 * y.shape[-1] * jnp.log(2 * jnp.pi))


def _predict(prior_mean, prior_cov, F, B, b, Q, u):
    mu_pred = F @ prior_mean + B @ u + b
    Sigma_pred = F @ prior_cov @ F.T + Q
    return mu_pred, Sigma_pred


def _condition_on(prior_mean, prior_cov, H, D, d, R, u, y):
    S = R + H @ prior_cov @ H.T
    K = psd_solve(S, H @ prior_cov).T
    residual = y - D @ u - d - H @ prior_mean
    mu_cond = prior_mean + K @ residual
    Sigma_cond = prior_cov - K @ S @ K.T
    return mu_cond, symmetrize(Sigma_cond)


def lgssm_filter(m0, P0, F, Q, H, R, emissions):
    num_timesteps = len(emissions)
    inputs = jnp.zeros((num_timesteps, 0))
    B, b = jnp.zeros((F.shape[0], 0)), jnp.zeros(F.shape[0])
    D, d = jnp.zeros((H.shape[0], 0)), jnp.zeros(H.shape[0])

    def _log_likelihood(pred_mean, pred_cov, H, D, d, R, u, y):
        m = H @ pred_mean + D @ u + d
        S = R + H @ pred_cov @ H.T
        return mvn_log_prob(m, S, y)

    def _step(carry, t):
        ll, pred_mean, pred_cov = carry
        u = inputs[t]
        y = emissions[t]
        ll += _log_likelihood(pred_mean, pred_cov, H, D, d, R, u, y)
        filtered_mean, filtered_cov = _condition_on(pred_mean, pred_cov, H, D, d, R, u, y)
        pred_mean, pred_cov = _predict(filtered_mean, filtered_cov, F, B, b, Q, u)
        return (ll, pred_mean, pred_cov), (filtered_mean, filtered_cov)

    carry = (0.0, m0, P0)
    (ll, _, _), (filtered_means, filtered_covs) = lax.scan(_step, carry,
                                                           jnp.arange(num_timesteps))
    return ll, filtered_means, filtered_covs


def lgssm_smoother(m0, P0, F, Q, H, R, emissions):
    num_timesteps = len(emissions)
    inputs = jnp.zeros((num_timesteps, 0))
    B, b = jnp.zeros((F.shape[0], 0)), jnp.zeros(F.shape[0])
    ll, filtered_means, filtered_covs = lgssm_filter(m0, P0, F, Q, H, R, emissions)

    def _step(carry, args):
        smoothed_mean_next, smoothed_cov_next = carry
        t, filtered_mean, filtered_cov = args
        u = inputs[t]
        G = psd_solve(Q + F @ filtered_cov @ F.T, F @ filtered_cov).T
        smoothed_mean = filtered_mean + G @ (smoothed_mean_next - F @ filtered_mean - B @ u - b)
        smoothed_cov = filtered_cov + G @ (smoothed_cov_next - F @ filtered_cov @ F.T - Q) @ G.T
        smoothed_cross = G @ smoothed_cov_next + jnp.outer(smoothed_mean, smoothed_mean_next)
        return (smoothed_mean, smoothed_cov), (smoothed_mean, smoothed_cov, smoothed_cross)

    _, (smoothed_means, smoothed_covs, smoothed_cross) = lax.scan(
        _step, (filtered_means[-1], filtered_covs[-1]),
        (jnp.arange(num_timesteps - 1), filtered_means[:-1], filtered_covs[:-1]),
        reverse=True)
    smoothed_means = jnp.vstack((smoothed_means, filtered_means[-1][None, ...]))
    smoothed_covs = jnp.vstack((smoothed_covs, filtered_covs[-1][None, ...]))
    return ll, smoothed_means, smoothed_covs, smoothed_cross


def _ssm_params(rng):
    th = 0.3
    F = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]], np.float32) * 0.95
    return (np.zeros(2, np.float32), np.eye(2, dtype=np.float32), F,
            0.1 * np.eye(2, dtype=np.float32), np.array([[1.0, 0.0], [0.5, 1.0]], np.float32),
            0.2 * np.eye(2, dtype=np.float32))


def _example(n, rng):
    return params(30, _ssm_params) + (rng.normal(size=(n, 2)).astype(np.float32),)


SPECS = (None,) * 6 + ("t, 2",)
PROGRAMS = [
    program(name="dynamax_kalman_filter", source=SRC + " lgssm_filter", license="MIT",
            fun=lgssm_filter, in_specs=SPECS, make_example=_example, bound=8),
    program(name="dynamax_kalman_smoother", source=SRC + " lgssm_smoother", license="MIT",
            fun=lgssm_smoother, in_specs=SPECS, make_example=_example, bound=8),
    program(name="dynamax_kalman_smoother_t_ge_1", source=SRC + " lgssm_smoother",
            license="MIT", fun=lgssm_smoother, in_specs=SPECS, make_example=_example, bound=8,
            sizes=(1, 2, 5, 8), pmjit_sizes=(1, 2, 5, 7, 8), constraints=("t >= 1",),
            note="the user's constraints=['T >= 1'] (no size 0)"),
]
