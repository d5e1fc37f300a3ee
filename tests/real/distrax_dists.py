"""distrax log-densities over n samples: MultivariateNormalTri, MixtureSameFamily
of diagonal Gaussians, and a Tanh-transformed Normal (the SAC policy).

Source: https://github.com/google-deepmind/distrax (Apache-2.0, Copyright 2021
DeepMind Technologies Limited): distrax/_src/distributions/mvn_tri.py
(log_prob via triangular solve), mvn_diag.py, mixture_same_family.py
(log_prob = logsumexp(component log_prob + mixture logits)),
distrax/_src/bijectors/tanh.py (forward_log_det_jacobian = 2 (log 2 - x -
softplus(-2x))) and transformed.py.
Copied: the log_prob formulas, for a batch of n samples.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from .corpus import normal, params, program

SRC = "distrax https://github.com/google-deepmind/distrax/blob/master/distrax/_src/"
D = 3


def mvn_tri_log_prob(x, loc, scale_tri):
    """MultivariateNormalTri(loc, scale_tri).log_prob(x) for x of shape (n, D)."""
    scale_tri = jnp.tril(scale_tri)
    z = solve_triangular(scale_tri, (x - loc).T, lower=True).T
    log_det = jnp.sum(jnp.log(jnp.abs(jnp.diag(scale_tri))))
    return -0.5 * jnp.sum(z ** 2, -1) - log_det - 0.5 * D * jnp.log(2 * jnp.pi)


def mixture_log_prob(x, logits, locs, log_scales):
    """MixtureSameFamily(Categorical(logits), MultivariateNormalDiag(locs, scales)), mean NLL."""
    scales = jnp.exp(log_scales)
    z = (x[:, None, :] - locs[None]) / scales[None]
    comp = (-0.5 * jnp.sum(z ** 2, -1) - jnp.sum(log_scales, -1)[None]
            - 0.5 * D * jnp.log(2 * jnp.pi))
    lp = jax.scipy.special.logsumexp(comp + jax.nn.log_softmax(logits)[None], axis=-1)
    return -jnp.mean(lp)


def tanh_normal_log_prob(actions_pre_tanh, loc, log_scale):
    """Transformed(Normal(loc, scale), Tanh()).log_prob(tanh(u)) summed over action dims."""
    u = actions_pre_tanh
    base = -0.5 * ((u - loc) / jnp.exp(log_scale)) ** 2 - log_scale - 0.5 * jnp.log(2 * jnp.pi)
    fldj = 2.0 * (np.log(2.0) - u - jax.nn.softplus(-2.0 * u))
    return jnp.sum(base - fldj, axis=-1)


def _mvn_params(rng):
    return normal(rng, D), (np.tril(rng.normal(size=(D, D))) * 0.3 + np.eye(D)).astype(np.float32)


def _mix_params(rng):
    return normal(rng, 4), normal(rng, 4, D), normal(rng, 4, D, scale=0.2)


PROGRAMS = [
    program(name="distrax_mvn_tri_log_prob", source=SRC + "distributions/mvn_tri.py log_prob",
            license="Apache-2.0", fun=mvn_tri_log_prob, in_specs=("n, 3", None, None),
            make_example=lambda n, rng: (normal(rng, n, D),) + params(50, _mvn_params),
            bound=8),
    program(name="distrax_mixture_nll",
            source=SRC + "distributions/mixture_same_family.py log_prob", license="Apache-2.0",
            fun=mixture_log_prob, in_specs=("n, 3", None, None, None),
            make_example=lambda n, rng: (normal(rng, n, D),) + params(51, _mix_params),
            bound=8),
    program(name="distrax_tanh_normal", source=SRC + "bijectors/tanh.py + transformed.py",
            license="Apache-2.0", fun=tanh_normal_log_prob, in_specs=("n, 2", None, None),
            make_example=lambda n, rng: (normal(rng, n, 2),)
            + params(52, lambda r: (normal(r, 2), normal(r, 2, scale=0.1))), bound=8),
]
