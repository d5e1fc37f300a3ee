"""Linear solves with lineax: LU on a square system, QR least squares on N
observations, CG on a positive definite system.

Source: https://github.com/patrick-kidger/lineax (lineax 0.1.1, as installed):
``lx.linear_solve(lx.MatrixLinearOperator(A), b, solver=lx.LU())`` as in its
README and docs (docs/examples/least_squares.ipynb for QR on a tall matrix,
docs/api/solvers.md for CG with ``lx.positive_semidefinite_tag``).
License: Apache-2.0, Copyright 2023 Google LLC.
The programs call lineax itself (an installed dependency of the real extra);
only the wrappers that turn one problem into arrays with a variable-size axis
are ours.
"""

import jax.numpy as jnp
import lineax as lx
import numpy as np

from .corpus import program

SRC = "lineax https://github.com/patrick-kidger/lineax/blob/v0.1.1/lineax/"


def lu_solve(A, b):
    """An n x n system A x = b."""
    operator = lx.MatrixLinearOperator(A)
    return lx.linear_solve(operator, b, solver=lx.LU()).value


def _lu_example(n, rng):
    A = (rng.normal(size=(n, n)) + 3 * np.eye(n)).astype(np.float32)
    return A, rng.normal(size=n).astype(np.float32)


def qr_lstsq(X, y):
    """Linear regression of n observations on 3 features: QR least squares."""
    operator = lx.MatrixLinearOperator(X)
    return lx.linear_solve(operator, y, solver=lx.QR()).value


def _qr_example(n, rng):
    X = np.concatenate([np.ones((n, 1)), rng.normal(size=(n, 2))], 1).astype(np.float32)
    return X, (X @ np.array([0.5, -1.0, 2.0]) + 0.1 * rng.normal(size=n)).astype(np.float32)


def cg_solve(X, y):
    """Ridge regression's dual: (X X^T + I) a = y on n observations, with CG."""
    K = X @ X.T + jnp.eye(X.shape[0])
    operator = lx.MatrixLinearOperator(K, lx.positive_semidefinite_tag)
    solver = lx.CG(rtol=1e-6, atol=1e-6, max_steps=200)
    return lx.linear_solve(operator, y, solver=solver).value


PROGRAMS = [
    program(name="lineax_lu_solve", source=SRC + "_solver/lu.py LU", license="Apache-2.0",
            fun=lu_solve, in_specs=("n, n", "n"), make_example=_lu_example, bound=10),
    program(name="lineax_qr_least_squares", source=SRC + "_solver/qr.py QR",
            license="Apache-2.0", fun=qr_lstsq, in_specs=("n, 3", "n"),
            make_example=_qr_example, bound=12, sizes=(3, 4, 8, 12),
            pmjit_sizes=(3, 4, 7, 11, 12), constraints=("n >= 3",),
            note="a tall (n >= 3) design matrix"),
    program(name="lineax_cg_ridge_dual", source=SRC + "_solver/cg.py CG",
            license="Apache-2.0", fun=cg_solve, in_specs=("n, 3", "n"),
            make_example=_qr_example, bound=12, rtol=1e-3, atol=1e-3),
]
