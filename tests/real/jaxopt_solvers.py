"""Fits on N samples with jaxopt's solvers, called from the installed jaxopt.

Source: https://github.com/google/jaxopt (jaxopt 0.8.5, as installed):
``jaxopt.GradientDescent(fun=..., maxiter=...).run(w0, X=X, y=y)`` on a ridge
least-squares loss, ``jaxopt.LBFGS`` on an L2-regularised logistic loss (both
wrap their loop in ``lax.custom_root`` for implicit differentiation), and
``jaxopt.linear_solve.solve_cg`` on ridge regression's normal equations, as in
jaxopt's documentation (docs/unconstrained.rst, docs/linear_system_solvers.rst).
License: Apache-2.0, Copyright 2021 Google LLC.
The programs call jaxopt itself (an installed dependency of the real extra);
only the wrappers that turn one data set into arrays with a variable number of
samples are ours.
"""

import jax
import jax.numpy as jnp
import jaxopt
import numpy as np

from .corpus import program

SRC = "jaxopt https://github.com/google/jaxopt/blob/jaxopt-v0.8.5/jaxopt/_src/"
D = 3  # features


def _ridge_loss(w, X, y):
    return 0.5 * jnp.sum((X @ w - y) ** 2) + 0.5 * jnp.sum(w ** 2)


def gd_least_squares(X, y):
    """Ridge least squares on n samples by (accelerated) gradient descent."""
    solver = jaxopt.GradientDescent(fun=_ridge_loss, maxiter=60, tol=1e-5)
    return solver.run(jnp.zeros(D), X=X, y=y).params


def _logistic_loss(w, X, y):
    logits = X @ w
    return jnp.sum(jax.nn.softplus(logits) - y * logits) + 0.5 * jnp.sum(w ** 2)


def lbfgs_logistic(X, y):
    """L2-regularised logistic regression on n samples with L-BFGS."""
    solver = jaxopt.LBFGS(fun=_logistic_loss, maxiter=30, tol=1e-5)
    return solver.run(jnp.zeros(D), X=X, y=y).params


def cg_ridge(X, y):
    """Ridge normal equations (X^T X + I) w = X^T y with conjugate gradient; the
    matvec contracts the n samples."""
    def matvec(w):
        return X.T @ (X @ w)

    return jaxopt.linear_solve.solve_cg(matvec, X.T @ y, ridge=1.0, tol=1e-6, maxiter=50)


def _regression_example(n, rng):
    X = rng.normal(size=(n, D)).astype(np.float32)
    return X, (X @ np.array([0.5, -1.0, 2.0]) + 0.1 * rng.normal(size=n)).astype(np.float32)


def _classification_example(n, rng):
    X = rng.normal(size=(n, D)).astype(np.float32)
    return X, (X @ np.array([1.0, -2.0, 0.5]) + rng.normal(size=n) > 0).astype(np.float32)


PROGRAMS = [
    program(name="jaxopt_gradient_descent_ridge", source=SRC + "gradient_descent.py GradientDescent",
            license="Apache-2.0", fun=gd_least_squares, in_specs=("n, 3", "n"),
            make_example=_regression_example, bound=12, rtol=1e-3, atol=1e-3),
    program(name="jaxopt_lbfgs_logistic", source=SRC + "lbfgs.py LBFGS",
            license="Apache-2.0", fun=lbfgs_logistic, in_specs=("n, 3", "n"),
            make_example=_classification_example, bound=12, rtol=1e-3, atol=1e-3),
    program(name="jaxopt_solve_cg_ridge", source=SRC + "linear_solve.py solve_cg",
            license="Apache-2.0", fun=cg_ridge, in_specs=("n, 3", "n"),
            make_example=_regression_example, bound=12, rtol=1e-3, atol=1e-3),
]
