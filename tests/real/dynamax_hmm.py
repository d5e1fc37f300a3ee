"""Discrete HMM inference from dynamax: filter, smoother, Viterbi.

Source: https://github.com/probml/dynamax (commit cfb005f),
dynamax/hidden_markov_model/inference.py: _normalize, _condition_on, _predict,
hmm_filter, hmm_smoother, _compute_sum_transition_probs, hmm_posterior_mode.
License: MIT, Copyright (c) 2022 Probabilistic machine learning.
Copied with a fixed (2-D) transition matrix (no ``transition_fn``, so the
``@partial(jit, static_argnames=["transition_fn"])`` decorators are plain
``@jax.jit``); T = n time steps, K = 3 states.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .corpus import params, program

SRC = ("dynamax https://github.com/probml/dynamax/blob/cfb005f/"
       "dynamax/hidden_markov_model/inference.py")
K = 3


def _normalize(u, axis=0, eps=1e-15):
    u = jnp.where(u == 0, 0, jnp.where(u < eps, eps, u))
    c = u.sum(axis=axis)
    c = jnp.where(c == 0, 1, c)
    return u / c, c


def _condition_on(probs, ll):
    ll_max = ll.max()
    new_probs = probs * jnp.exp(ll - ll_max)
    new_probs, norm = _normalize(new_probs)
    log_norm = jnp.log(norm) + ll_max
    return new_probs, log_norm


def _predict(probs, A):
    return A.T @ probs


@jax.jit
def hmm_filter(initial_distribution, transition_matrix, log_likelihoods):
    num_timesteps, num_states = log_likelihoods.shape

    def _step(carry, t):
        log_normalizer, predicted_probs = carry
        A = transition_matrix
        ll = log_likelihoods[t]
        filtered_probs, log_norm = _condition_on(predicted_probs, ll)
        log_normalizer += log_norm
        predicted_probs_next = _predict(filtered_probs, A)
        return (log_normalizer, predicted_probs_next), (filtered_probs, predicted_probs)

    carry = (0.0, initial_distribution)
    (log_normalizer, _), (filtered_probs, predicted_probs) = lax.scan(
        _step, carry, jnp.arange(num_timesteps))
    return log_normalizer, filtered_probs, predicted_probs


def _compute_sum_transition_probs(transition_matrix, filtered, smoothed, predicted):
    def _step(carry, args):
        filtered_probs, smoothed_probs_next, predicted_probs_next, t = args
        A = transition_matrix
        relative_probs_next = jnp.where(jnp.isclose(predicted_probs_next, 0.0), 0.0,
                                        smoothed_probs_next / predicted_probs_next)
        smoothed_trans_probs = filtered_probs[:, None] * A * relative_probs_next[None, :]
        smoothed_trans_probs /= smoothed_trans_probs.sum()
        return carry + smoothed_trans_probs, None

    num_states = transition_matrix.shape[-1]
    num_timesteps = len(filtered)
    sum_transition_probs, _ = lax.scan(
        _step, jnp.zeros((num_states, num_states)),
        (filtered[:-1], smoothed[1:], predicted[1:], jnp.arange(num_timesteps - 1)))
    return sum_transition_probs


@jax.jit
def hmm_smoother(initial_distribution, transition_matrix, log_likelihoods):
    num_timesteps = log_likelihoods.shape[0]
    ll, filtered_probs, predicted_probs = hmm_filter(initial_distribution, transition_matrix,
                                                     log_likelihoods)

    def _step(carry, args):
        smoothed_probs_next = carry
        t, filtered_probs, predicted_probs_next = args
        A = transition_matrix
        relative_probs_next = jnp.where(jnp.isclose(predicted_probs_next, 0.0), 0.0,
                                        smoothed_probs_next / predicted_probs_next)
        smoothed_probs = filtered_probs * (A @ relative_probs_next)
        smoothed_probs /= smoothed_probs.sum()
        return smoothed_probs, smoothed_probs

    _, smoothed_probs = lax.scan(
        _step, filtered_probs[-1],
        (jnp.arange(num_timesteps - 1), filtered_probs[:-1], predicted_probs[1:]),
        reverse=True)
    smoothed_probs = jnp.vstack([smoothed_probs, filtered_probs[-1]])
    trans_probs = _compute_sum_transition_probs(transition_matrix, filtered_probs,
                                                smoothed_probs, predicted_probs)
    return ll, smoothed_probs, smoothed_probs[0], trans_probs


@jax.jit
def hmm_posterior_mode(initial_distribution, transition_matrix, log_likelihoods):
    num_timesteps, num_states = log_likelihoods.shape

    def _backward_pass(best_next_score, t):
        A = transition_matrix
        scores = jnp.log(A) + best_next_score + log_likelihoods[t + 1]
        best_next_state = jnp.argmax(scores, axis=1)
        best_next_score = jnp.max(scores, axis=1)
        return best_next_score, best_next_state

    num_states = log_likelihoods.shape[1]
    best_second_score, best_next_states = lax.scan(
        _backward_pass, jnp.zeros(num_states), jnp.arange(num_timesteps - 1), reverse=True)

    def _forward_pass(state, best_next_state):
        next_state = best_next_state[state]
        return next_state, next_state

    first_state = jnp.argmax(jnp.log(initial_distribution) + log_likelihoods[0]
                             + best_second_score)
    _, states = lax.scan(_forward_pass, first_state, best_next_states)
    return jnp.concatenate([jnp.array([first_state]), states])


def _hmm_params(rng):
    A = rng.random((K, K)).astype(np.float32) + 0.2
    pi = rng.random(K).astype(np.float32) + 0.2
    return pi / pi.sum(), A / A.sum(1, keepdims=True)


def _example(n, rng):
    pi, A = params(20, _hmm_params)
    return pi, A, (rng.normal(size=(n, K)) - 1.0).astype(np.float32)


SPECS = (None, None, "t, 3")
PROGRAMS = [
    program(name="dynamax_hmm_filter", source=SRC + " hmm_filter", license="MIT",
            fun=hmm_filter, in_specs=SPECS, make_example=_example, bound=8),
    program(name="dynamax_hmm_smoother", source=SRC + " hmm_smoother", license="MIT",
            fun=hmm_smoother, in_specs=SPECS, make_example=_example, bound=8),
    program(name="dynamax_hmm_smoother_t20", source=SRC + " hmm_smoother", license="MIT",
            fun=hmm_smoother, in_specs=SPECS, make_example=_example, bound=20,
            sizes=(0, 1, 11, 20), pmjit_sizes=(1, 11, 20),
            note="bound 20: more sizes than max_cases (len() in _compute_sum_transition_probs)"),
    program(name="dynamax_hmm_viterbi", source=SRC + " hmm_posterior_mode", license="MIT",
            fun=hmm_posterior_mode, in_specs=SPECS, make_example=_example, bound=8),
]
