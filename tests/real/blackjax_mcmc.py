"""MCMC kernels in the style of blackjax: one HMC transition for a Bayesian
logistic regression on n data points, and a MALA chain over T annealing steps.

Source: https://github.com/blackjax-devs/blackjax (Apache-2.0, Copyright 2020-
The Blackjax Authors): blackjax/mcmc/integrators.py (velocity_verlet),
blackjax/mcmc/hmc.py (build_kernel: momentum draw, integration, energy,
Metropolis acceptance), blackjax/mcmc/mala.py (MALA proposal and its
transition-energy correction) and blackjax/util.py (run_inference_algorithm:
``keys = jax.random.split(rng_key, num_steps)`` scanned).
Copied: the kernels' arithmetic on flat position arrays, Euclidean metric.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .corpus import normal, params, program

SRC = "blackjax https://github.com/blackjax-devs/blackjax/blob/main/blackjax/mcmc/"


def velocity_verlet(logdensity_fn, kinetic_energy_fn):
    a1, b1 = 0.0, 0.5
    a2 = 1 - 2 * a1

    def one_step(state, step_size):
        position, momentum, _, logdensity_grad = state
        momentum = momentum + b1 * step_size * logdensity_grad
        kinetic_grad = jax.grad(kinetic_energy_fn)(momentum)
        position = position + a2 * step_size * kinetic_grad
        logdensity, logdensity_grad = jax.value_and_grad(logdensity_fn)(position)
        momentum = momentum + b1 * step_size * logdensity_grad
        return position, momentum, logdensity, logdensity_grad

    return one_step


def hmc_step(X, y, key, position, step_size=0.05, num_integration_steps=5):
    """One HMC transition targeting the logistic-regression posterior of (X, y)."""
    def logdensity_fn(w):
        logits = X @ w
        return jnp.sum(y * jax.nn.log_sigmoid(logits) + (1 - y) * jax.nn.log_sigmoid(-logits)) \
            - 0.5 * jnp.sum(w ** 2)

    kinetic_energy_fn = lambda p: 0.5 * jnp.sum(p ** 2)
    integrator = velocity_verlet(logdensity_fn, kinetic_energy_fn)
    key_momentum, key_accept = jax.random.split(key)
    momentum = jax.random.normal(key_momentum, position.shape)
    logdensity, logdensity_grad = jax.value_and_grad(logdensity_fn)(position)
    state = (position, momentum, logdensity, logdensity_grad)
    end = lax.fori_loop(0, num_integration_steps, lambda i, s: integrator(s, step_size), state)
    energy0 = -logdensity + kinetic_energy_fn(momentum)
    energy1 = -end[2] + kinetic_energy_fn(end[1])
    log_p_accept = jnp.minimum(0.0, energy0 - energy1)
    accept = jnp.log(jax.random.uniform(key_accept)) < log_p_accept
    return jnp.where(accept, end[0], position), jnp.exp(log_p_accept)


def mala_chain(betas, key, position, data, step_size=0.1):
    """Annealed MALA: step t targets beta_t * loglik + logprior; T = len(betas)."""
    def logdensity(x, beta):
        return -0.5 * jnp.sum(x ** 2) - beta * 0.5 * jnp.sum((data - x[None]) ** 2)

    def transition_energy(state, new_state, step_size, beta):
        theta = jnp.sum((state[0] - new_state[0] - step_size * new_state[1]) ** 2)
        return -logdensity(new_state[0], beta) + 0.25 * (1.0 / step_size) * theta

    def one_step(state, inp):
        k, beta = inp
        x, g = state[0], jax.grad(logdensity)(state[0], beta)
        k1, k2 = jax.random.split(k)
        noise = jax.random.normal(k1, x.shape)
        xn = x + step_size * g + jnp.sqrt(2 * step_size) * noise
        new = (xn, jax.grad(logdensity)(xn, beta))
        old = (x, g)
        log_p = -transition_energy(old, new, step_size, beta) + transition_energy(
            new, old, step_size, beta)
        accept = jnp.log(jax.random.uniform(k2)) < log_p
        x = jnp.where(accept, xn, x)
        return (x,), accept.astype(jnp.float32)

    keys = jax.random.split(key, betas.shape[0])
    (x,), accepted = lax.scan(one_step, (position,), (keys, betas))
    return x, jnp.mean(accepted)


def _key():
    return np.asarray(jax.random.PRNGKey(7))


def _hmc_example(n, rng):
    X = normal(rng, n, 3)
    y = (rng.random(n) < 0.5).astype(np.float32)
    return X, y, _key(), params(70, lambda r: normal(r, 3, scale=0.1))


def _mala_example(n, rng):
    betas = np.linspace(0.1, 1.0, n).astype(np.float32)
    return betas, _key(), params(71, lambda r: normal(r, 2)), params(72, lambda r: normal(r, 5, 2))


PROGRAMS = [
    program(name="blackjax_hmc_logistic", source=SRC + "hmc.py build_kernel + integrators.py",
            license="Apache-2.0", fun=hmc_step, in_specs=("n, 3", "n", None, None),
            make_example=_hmc_example, bound=8),
    program(name="blackjax_mala_annealed_chain", source=SRC + "mala.py + ../util.py",
            license="Apache-2.0", fun=mala_chain, in_specs=("t", None, None, None),
            make_example=_mala_example, bound=8),
]
