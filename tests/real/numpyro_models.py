"""Probabilistic models' densities, called from the installed numpyro.

Source: https://github.com/pyro-ppl/numpyro (numpyro 0.22.0, as installed):
``numpyro.infer.util.potential_energy`` of the eight-schools hierarchical model
(non-centred, as in numpyro's README), ``dist.MultivariateNormal(covariance_matrix=K)
.log_prob`` for a GP marginal likelihood, ``numpyro.infer.util.log_density`` of an
AR(2) model written with ``numpyro.contrib.control_flow.scan``, and
``dist.GaussianRandomWalk(num_steps=T).log_prob``.
License: Apache-2.0, Copyright Contributors to the Pyro project.
The programs call numpyro itself (an installed dependency of the real extra);
only the wrappers that turn one data set into arrays with a variable-size axis
(schools, observations, time steps) are ours.
"""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.contrib.control_flow import scan
from numpyro.infer.util import log_density, potential_energy

from .corpus import normal, program

SRC = "numpyro https://github.com/pyro-ppl/numpyro/blob/0.22.0/numpyro/"


def _eight_schools(sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("J", sigma.shape[0]):
        theta_raw = numpyro.sample("theta_raw", dist.Normal(0.0, 1.0))
        theta = mu + tau * theta_raw
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def schools_potential(y, sigma, theta_raw, mu, log_tau):
    """Potential energy (negative log joint, unconstrained) of n schools."""
    params = {"mu": mu, "tau": log_tau, "theta_raw": theta_raw}
    return potential_energy(_eight_schools, (sigma,), {"y": y}, params)


def _schools_example(n, rng):
    return (normal(rng, n, scale=10.0), (5.0 + 10.0 * rng.random(n)).astype(np.float32),
            normal(rng, n), np.float32(1.5), np.float32(0.7))


def gp_marginal(x, y, log_amp, log_len, log_noise):
    """GP regression's log marginal likelihood of n observations (RBF kernel)."""
    d2 = (x[:, None] - x[None, :]) ** 2
    K = jnp.exp(2 * log_amp) * jnp.exp(-0.5 * d2 / jnp.exp(2 * log_len))
    K = K + (jnp.exp(2 * log_noise) + 1e-4) * jnp.eye(x.shape[0])
    return dist.MultivariateNormal(jnp.zeros(x.shape[0]), covariance_matrix=K).log_prob(y)


def _gp_example(n, rng):
    x = np.sort(rng.uniform(-3, 3, n)).astype(np.float32)
    return (x, (np.sin(x) + 0.1 * rng.normal(size=n)).astype(np.float32),
            np.float32(0.1), np.float32(-0.2), np.float32(-1.5))


def _ar2(y):
    alpha_1 = numpyro.sample("alpha_1", dist.Normal(0.0, 1.0))
    alpha_2 = numpyro.sample("alpha_2", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))

    def transition(carry, y_t):
        y_1, y_2 = carry
        m_t = alpha_1 * y_1 + alpha_2 * y_2
        y_t = numpyro.sample("y", dist.Normal(m_t, sigma), obs=y_t)
        return (y_t, y_1), m_t

    scan(transition, (y[1], y[0]), y[2:])


def ar2_log_density(y, alpha_1, alpha_2, sigma):
    """Log joint of an AR(2) model on a series of t + 2 values (scan over t steps)."""
    params = {"alpha_1": alpha_1, "alpha_2": alpha_2, "sigma": sigma}
    return log_density(_ar2, (y,), {}, params)[0]


def _ar2_example(t, rng):
    y = np.zeros(t + 2, np.float32)
    e = rng.normal(size=t + 2) * 0.5
    for i in range(t + 2):
        y[i] = e[i] + (0.6 * y[i - 1] - 0.2 * y[i - 2] if i >= 2 else 0.0)
    return y, np.float32(0.5), np.float32(-0.1), np.float32(0.7)


def random_walk(x, scale):
    """Gaussian random walk prior of a length-t path."""
    return dist.GaussianRandomWalk(scale, num_steps=x.shape[0]).log_prob(x)


def _walk_example(t, rng):
    return np.cumsum(rng.normal(size=t)).astype(np.float32), np.float32(1.3)


PROGRAMS = [
    program(name="numpyro_eight_schools_potential",
            source=SRC + "infer/util.py potential_energy", license="Apache-2.0",
            fun=schools_potential, in_specs=("n", "n", "n", None, None),
            make_example=_schools_example, bound=10),
    program(name="numpyro_gp_marginal_likelihood",
            source=SRC + "distributions/continuous.py MultivariateNormal",
            license="Apache-2.0", fun=gp_marginal, in_specs=("n", "n", None, None, None),
            make_example=_gp_example, bound=10, rtol=1e-3, atol=1e-3),
    program(name="numpyro_ar2_scan", source=SRC + "contrib/control_flow/scan.py scan",
            license="Apache-2.0", fun=ar2_log_density, in_specs=("t + 2", None, None, None),
            make_example=_ar2_example, bound=10, note="a series of t + 2 values"),
    program(name="numpyro_gaussian_random_walk",
            source=SRC + "distributions/continuous.py GaussianRandomWalk",
            license="Apache-2.0", fun=random_walk, in_specs=("t", None),
            make_example=_walk_example, bound=12, sizes=(1, 2, 7, 12),
            pmjit_sizes=(1, 2, 7, 11, 12), constraints=("t >= 1",),
            note="num_steps >= 1 (numpyro requires a positive num_steps)"),
]
