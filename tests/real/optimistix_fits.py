"""Nonlinear least squares and minimisation with optimistix on N samples.

Source: https://github.com/patrick-kidger/optimistix (optimistix 0.1.0, as
installed): ``optx.least_squares(fn, optx.LevenbergMarquardt(rtol, atol), y0,
args)`` and ``optx.minimise(fn, optx.BFGS(rtol, atol), y0, args)`` as in its
README and docs (docs/api/least_squares.md, docs/api/minimise.md).
License: Apache-2.0, Copyright 2023 Google LLC.
The programs call optimistix itself (an installed dependency of the real
extra); only the residual / loss functions and the wrappers that turn one
data set of N points into arrays are ours.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx

from .corpus import program

SRC = "optimistix https://github.com/patrick-kidger/optimistix/blob/v0.1.0/optimistix/"


def _residuals(params, args):
    t, y = args
    a, k = params
    return a * jnp.exp(-k * t) - y


def lm_fit(t, y):
    """Fit y = a exp(-k t) to N points with Levenberg-Marquardt (N residuals)."""
    solver = optx.LevenbergMarquardt(rtol=1e-6, atol=1e-6)
    y0 = jnp.array([1.0, 0.5])
    return optx.least_squares(_residuals, solver, y0, args=(t, y), max_steps=64).value


def _lm_example(n, rng):
    t = np.linspace(0, 3, n).astype(np.float32)
    return t, (2.0 * np.exp(-1.3 * t) + 0.01 * rng.normal(size=n)).astype(np.float32)


def gauss_newton_fit(t, y):
    solver = optx.GaussNewton(rtol=1e-6, atol=1e-6)
    y0 = jnp.array([1.0, 0.5])
    return optx.least_squares(_residuals, solver, y0, args=(t, y), max_steps=64).value


def _logistic_loss(w, args):
    X, labels = args
    logits = X @ w
    return jnp.mean(jax.nn.softplus(logits) - labels * logits) + 0.05 * jnp.sum(w ** 2)


def bfgs_logistic(X, labels):
    """L2-regularised logistic regression on N samples with BFGS."""
    solver = optx.BFGS(rtol=1e-5, atol=1e-5)
    return optx.minimise(_logistic_loss, solver, jnp.zeros(X.shape[1]), args=(X, labels),
                         max_steps=100).value


def _logistic_example(n, rng):
    X = rng.normal(size=(n, 3)).astype(np.float32)
    return X, (X @ np.array([1.0, -2.0, 0.5]) + rng.normal(size=n) > 0).astype(np.float32)


PROGRAMS = [
    program(name="optimistix_levenberg_marquardt", source=SRC
            + "_solver/levenberg_marquardt.py LevenbergMarquardt", license="Apache-2.0",
            fun=lm_fit, in_specs=("n", "n"), make_example=_lm_example, bound=12,
            sizes=(3, 4, 8, 12), pmjit_sizes=(3, 4, 7, 11, 12), constraints=("n >= 3",),
            rtol=1e-3, atol=1e-3, note="at least as many residuals as parameters"),
    program(name="optimistix_gauss_newton", source=SRC + "_solver/gauss_newton.py GaussNewton",
            license="Apache-2.0", fun=gauss_newton_fit, in_specs=("n", "n"),
            make_example=_lm_example, bound=12, sizes=(3, 4, 8, 12),
            pmjit_sizes=(3, 4, 7, 11, 12), constraints=("n >= 3",), rtol=1e-3, atol=1e-3),
    program(name="optimistix_bfgs_logistic", source=SRC + "_solver/bfgs.py BFGS",
            license="Apache-2.0", fun=bfgs_logistic, in_specs=("n, 3", "n"),
            make_example=_logistic_example, bound=12, rtol=1e-3, atol=1e-3,
            sizes=(1, 2, 7, 12), pmjit_sizes=(1, 2, 7, 11, 12), constraints=("n >= 1",),
            note="no samples: the mean is NaN and BFGS raises (max_steps)"),
]
