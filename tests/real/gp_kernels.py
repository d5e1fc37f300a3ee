"""Gaussian-process marginal likelihood (tinygp) and posterior prediction (gpjax).

Sources:
- tinygp, https://github.com/dfm/tinygp (MIT, Copyright 2021 Dan Foreman-Mackey):
  tinygp/kernels/stationary.py (ExpSquared, Matern32 on scaled distances),
  tinygp/solvers/direct.py (DirectSolver: cholesky, normalization) and
  tinygp/gp.py (GaussianProcess.log_probability).
- GPJax, https://github.com/JaxGaussianProcesses/GPJax (Apache-2.0):
  gpjax/gps.py ConjugatePosterior.predict (RBF gram, jitter on the diagonal,
  Cholesky solves), written with ``K.at[jnp.diag_indices(n)].add(...)`` as in
  the GPJax regression notebooks' hand-written versions.
n training points in 2-D; 5 fixed test points; hyper-parameters are unpadded
(log-scale) arrays, so ``grad`` checks hyper-parameter gradients.
"""

import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from .corpus import normal, params, program

SRC_T = "tinygp https://github.com/dfm/tinygp/blob/main/src/tinygp/"
SRC_G = "gpjax https://github.com/JaxGaussianProcesses/GPJax/blob/main/gpjax/gps.py"


def _scaled_sqdist(x1, x2, scale):
    d = (x1[:, None, :] - x2[None, :, :]) / scale
    return jnp.sum(d ** 2, axis=-1)


def exp_squared(x1, x2, scale):
    return jnp.exp(-0.5 * _scaled_sqdist(x1, x2, scale))


def matern32(x1, x2, scale):
    r = jnp.sqrt(jnp.maximum(_scaled_sqdist(x1, x2, scale), 1e-12))
    arg = np.sqrt(3.0) * r
    return (1.0 + arg) * jnp.exp(-arg)


def tinygp_log_probability(x, y, log_params):
    """GaussianProcess(amp * (ExpSquared + Matern32), X, diag=noise).log_probability(y)."""
    amp, scale, noise = jnp.exp(log_params[0]), jnp.exp(log_params[1]), jnp.exp(log_params[2])
    cov = amp * (exp_squared(x, x, scale) + matern32(x, x, scale))
    cov = cov + noise * jnp.eye(x.shape[0])
    scale_tril = jnp.linalg.cholesky(cov)
    alpha = solve_triangular(scale_tril, y, lower=True)
    normalization = jnp.sum(jnp.log(jnp.diag(scale_tril))) + 0.5 * scale_tril.shape[0] * np.log(
        2 * np.pi)
    return -0.5 * jnp.sum(jnp.square(alpha)) - normalization


def gpjax_predict(x, y, xtest, log_params):
    """Posterior mean and variance at xtest of an RBF GP with Gaussian noise."""
    n = x.shape[0]
    amp, scale, noise = jnp.exp(log_params[0]), jnp.exp(log_params[1]), jnp.exp(log_params[2])
    Kxx = amp * exp_squared(x, x, scale)
    Kxx = Kxx.at[jnp.diag_indices(n)].add(1e-6 + noise)
    Kxt = amp * exp_squared(x, xtest, scale)
    Ktt = amp * exp_squared(xtest, xtest, scale)
    L = jnp.linalg.cholesky(Kxx)
    Lx_inv_Kxt = solve_triangular(L, Kxt, lower=True)
    w = solve_triangular(L, y - jnp.mean(y), lower=True)
    mean = jnp.mean(y) + Lx_inv_Kxt.T @ w
    covariance = Ktt - Lx_inv_Kxt.T @ Lx_inv_Kxt
    return mean, jnp.diag(covariance)


def _hyper(rng):
    return np.log(np.array([1.0, 0.7, 0.1], np.float32))


def _tinygp_example(n, rng):
    x = normal(rng, n, 2)
    return x, np.sin(x[:, 0]) + 0.1 * normal(rng, n), params(40, _hyper)


def _gpjax_example(n, rng):
    x = normal(rng, n, 2)
    xt = params(41, lambda r: normal(r, 5, 2))
    return x, np.sin(x[:, 0]) + 0.1 * normal(rng, n), xt, params(40, _hyper)


PROGRAMS = [
    program(name="tinygp_log_probability",
            source=SRC_T + "gp.py GaussianProcess.log_probability (ExpSquared + Matern32)",
            license="MIT", fun=tinygp_log_probability, in_specs=("n, 2", "n", None),
            make_example=_tinygp_example, bound=8),
    program(name="gpjax_posterior_predict_diag_indices", source=SRC_G + " ConjugatePosterior.predict",
            license="Apache-2.0", fun=gpjax_predict, in_specs=("n, 2", "n", None, None),
            make_example=_gpjax_example, bound=16, sizes=(0, 1, 9, 16),
            pmjit_sizes=(1, 3, 9, 16)),
]
