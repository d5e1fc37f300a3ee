"""Entropic optimal transport between two point clouds with ott-jax's Sinkhorn.

Source: https://github.com/ott-jax/ott (commit 6aace50),
src/ott/geometry/geometry.py (Geometry._center, _softmax / apply_lse_kernel,
update_potential, marginal_from_potentials), src/ott/math/fixed_point_loop.py
(fixpoint_iter) and src/ott/solvers/linear/sinkhorn.py (lse-mode Sinkhorn
iteration, marginal error, regularised OT cost). License: Apache-2.0,
Copyright The OTT-JAX Authors / Google LLC.
Copied for a squared-Euclidean PointCloud with uniform weights; x has n
points, y has m = n + 2 points.
"""

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

from .corpus import normal, program

SRC = "ott-jax https://github.com/ott-jax/ott/blob/6aace50/src/ott/"
EPS = 0.5


def fixpoint_iter(cond_fn, body_fn, min_iterations, max_iterations, inner_iterations,
                  constants, state):
    force_scan = (min_iterations == max_iterations)
    compute_error_flags = jnp.arange(inner_iterations) == inner_iterations - 1

    def max_cond_fn(iteration_state):
        iteration, state = iteration_state
        return jnp.logical_and(iteration < max_iterations,
                               jnp.logical_or(iteration < min_iterations,
                                              cond_fn(iteration, constants, state)))

    def unrolled_body_fn(iteration_state):
        def one_iteration(iteration_state, compute_error):
            iteration, state = iteration_state
            state = body_fn(iteration, constants, state, compute_error)
            iteration += 1
            return (iteration, state), None

        iteration_state, _ = jax.lax.scan(one_iteration, iteration_state, compute_error_flags)
        return (iteration_state, None) if force_scan else iteration_state

    if force_scan:
        (_, state), _ = jax.lax.scan(lambda carry, x: unrolled_body_fn(carry), (0, state), None,
                                     length=max_iterations // inner_iterations)
    else:
        _, state = jax.lax.while_loop(max_cond_fn, unrolled_body_fn, (0, state))
    return state


def sinkhorn(x, y, min_iterations, max_iterations, threshold=1e-3, inner_iterations=5):
    cost = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    a = jnp.ones(x.shape[0]) / x.shape[0]
    b = jnp.ones(y.shape[0]) / y.shape[0]

    def center(f, g):
        return f[:, jnp.newaxis] + g[jnp.newaxis, :] - cost

    def apply_lse_kernel(f, g, eps, axis):
        return eps * logsumexp(center(f, g) / eps, axis=axis)

    def update_potential(f, g, log_marginal, axis):
        app_lse = apply_lse_kernel(f, g, EPS, axis)
        return EPS * log_marginal - jnp.where(jnp.isfinite(app_lse), app_lse, 0)

    def marginal_from_potentials(f, g, axis):
        h = f if axis == 1 else g
        z = apply_lse_kernel(f, g, EPS, axis)
        return jnp.exp((z + h) / EPS)

    def body_fn(iteration, const, state, compute_error):
        errors, f, g = state
        g = update_potential(f, g, jnp.log(b), axis=0)
        f = update_potential(f, g, jnp.log(a), axis=1)
        err = jnp.where(compute_error,
                        jnp.sum(jnp.abs(marginal_from_potentials(f, g, axis=0) - b)),
                        errors[iteration // inner_iterations - 1 + 1])
        errors = errors.at[iteration // inner_iterations].set(err)
        return errors, f, g

    def cond_fn(iteration, const, state):
        errors = state[0]
        err = errors[iteration // inner_iterations - 1]
        return jnp.logical_or(iteration == 0, err > threshold)

    errors = -jnp.ones(max_iterations // inner_iterations + 1)
    state = (errors, jnp.zeros_like(a), jnp.zeros_like(b))
    errors, f, g = fixpoint_iter(cond_fn, body_fn, min_iterations, max_iterations,
                                 inner_iterations, None, state)
    reg_ot_cost = jnp.sum(f * a) + jnp.sum(g * b)
    return reg_ot_cost, f, g


def sinkhorn_fixed(x, y):
    """50 iterations (min_iterations == max_iterations: ott's scan path)."""
    return sinkhorn(x, y, 50, 50)


def sinkhorn_converge(x, y):
    """Until the marginal error is below 1e-3 (ott's while_loop path)."""
    return sinkhorn(x, y, 0, 200)


def _example(n, rng):
    return normal(rng, n, 2), normal(rng, n + 2, 2) + 0.5


PROGRAMS = [
    program(name="ott_sinkhorn_scan", source=SRC + "solvers/linear/sinkhorn.py Sinkhorn (lse)",
            license="Apache-2.0", fun=sinkhorn_fixed, in_specs=("n, 2", "m, 2"),
            make_example=_example, bound=8),
    program(name="ott_sinkhorn_while",
            source=SRC + "math/fixed_point_loop.py fixpoint_iter (while_loop)",
            license="Apache-2.0", fun=sinkhorn_converge, in_specs=("n, 2", "m, 2"),
            make_example=_example, bound=8, modes=("eager", "jit", "vmap", "pmjit"),
            note="no grad: reverse-mode of while_loop is refused by plain JAX too"),
]
