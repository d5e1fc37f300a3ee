"""K-FAC's pi-adjusted Kronecker-factored preconditioning of a dense layer's
gradient, from kfac-jax.

Source: https://github.com/google-deepmind/kfac-jax (commit babd853),
kfac_jax/_src/utils/math.py (psd_inv, its LU path under lax.cond;
psd_matrix_norm with norm_type "avg_diag"; pi_adjusted_kronecker_factors,
the regular case; pi_adjusted_kronecker_inverse).
License: Apache-2.0, Copyright 2022 DeepMind Technologies Limited.
Copied: the functions verbatim but for the options these programs do not
take; the program (ours) forms a dense layer's factors A = x^T x / n and
G = dy^T dy / n from n examples, as kfac-jax's dense block estimator does.
"""

import jax.numpy as jnp
from jax import lax

from .corpus import normal, program

SRC = ("kfac-jax https://github.com/google-deepmind/kfac-jax/blob/babd853/"
       "kfac_jax/_src/utils/math.py")


# -- kfac_jax/_src/utils/math.py ------------------------------------------------------------------
def psd_inv(matrix):
    if matrix.shape[:1] != matrix.shape[1:]:
        raise ValueError(f"Expected square matrix, but got shape {matrix.shape}.")
    return lax.cond(
        jnp.logical_or(jnp.any(jnp.isnan(matrix)), jnp.any(jnp.isinf(matrix))),
        lambda: jnp.full(matrix.shape, jnp.nan, dtype=matrix.dtype),
        lambda: jnp.linalg.inv(matrix))


def psd_matrix_norm_avg_diag(matrix):
    if matrix.ndim == 0:
        return matrix
    elif matrix.ndim == 1:
        return jnp.sum(matrix) / matrix.shape[0]
    elif matrix.ndim == 2 and matrix.shape[0] == matrix.shape[1]:
        return jnp.trace(matrix) / matrix.shape[0]
    raise ValueError(f"Unsupported shape for factor array: {matrix.shape}")


def pi_adjusted_kronecker_factors(*factors, damping):
    norms = jnp.array([psd_matrix_norm_avg_diag(f) for f in factors])
    k = len(factors)
    num_non_scalars = sum(1 if f.size != 1 else 0 for f in factors)
    us = [fi / ni for fi, ni in zip(factors, norms)]
    c_k = jnp.exp(jnp.mean(jnp.log(norms)))
    d_k = jnp.power(damping, 1.0 / k) / c_k
    if k > num_non_scalars:
        c_non_scalar = c_k ** (float(k) / num_non_scalars)
        d_hat = jnp.power(damping, 1.0 / num_non_scalars) / c_non_scalar
    else:
        d_hat = d_k
    u_hats = []
    for u in us:
        if u.size == 1:
            u_hat = jnp.ones_like(u)
        elif u.ndim == 2:
            u_hat = u + d_hat * jnp.eye(u.shape[0], dtype=u.dtype)
        else:
            assert u.ndim == 1
            u_hat = u + d_hat
        u_hats.append(u_hat * c_k)
    return tuple(u_hats)


def pi_adjusted_kronecker_inverse(*arrays, damping):
    return tuple(psd_inv(a) if a.ndim == 2 else 1.0 / a
                 for a in pi_adjusted_kronecker_factors(*arrays, damping=damping))


# -- the program ----------------------------------------------------------------------------------
def precondition_program(x, dy):
    """The K-FAC preconditioned gradient A^-1 grad G^-1 of a 4 -> 3 dense layer over n examples."""
    n = x.shape[0]
    x1 = jnp.concatenate([x, jnp.ones((n, 1), x.dtype)], axis=1)   # homogeneous coordinate
    a = x1.T @ x1 / n
    g = dy.T @ dy / n
    grad_w = x1.T @ dy / n
    a_inv, g_inv = pi_adjusted_kronecker_inverse(a, g, damping=1e-3)
    return a_inv @ grad_w @ g_inv, a, g


PROGRAMS = [
    program(name="kfac_dense_pi_adjusted_precondition",
            source=SRC + " pi_adjusted_kronecker_inverse, psd_inv (lax.cond), "
                         "psd_matrix_norm(avg_diag)",
            license="Apache-2.0", fun=precondition_program, in_specs=("n, 4", "n, 3"),
            make_example=lambda n, rng: (normal(rng, n, 4), normal(rng, n, 3)),
            bound=8, rtol=1e-3, atol=1e-3),
]
