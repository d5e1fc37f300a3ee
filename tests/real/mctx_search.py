"""MCTS action selection and root noise from mctx (Gumbel MuZero, MuZero).

Source: https://github.com/google-deepmind/mctx (commit b53073f),
mctx/_src/qtransforms.py (qtransform_by_parent_and_siblings,
qtransform_completed_by_mix_value, _rescale_qvalues, _complete_qvalues,
_compute_mixed_value), mctx/_src/seq_halving.py (score_considered,
get_sequence_of_considered_visits, get_table_of_considered_visits),
mctx/_src/action_selection.py (gumbel_muzero_root_action_selection,
gumbel_muzero_interior_action_selection, muzero_action_selection,
masked_argmax, _prepare_argmax_input) and mctx/_src/policies.py
(_mask_invalid_actions, _get_logits_from_probs, _add_dirichlet_noise, the
Gumbel draw of gumbel_muzero_policy).
License: Apache-2.0, Copyright 2021 DeepMind Technologies Limited.
Copied verbatim but that muzero_action_selection also returns its scores, and
``MiniTree``, ours: the fields of mctx's ``Tree`` that
the selection functions read, for one tree with one expanded node; the number
of actions is the variable-size axis.
"""

import math
from collections import namedtuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from .corpus import normal, program

SRC = "mctx https://github.com/google-deepmind/mctx/blob/b53073f/mctx/_src/"


# -- mctx/_src/qtransforms.py, seq_halving.py, action_selection.py -------------------------------
def qtransform_by_parent_and_siblings(tree, node_index, *, epsilon=1e-8):
    chex.assert_shape(node_index, ())
    qvalues = tree.qvalues(node_index)
    visit_counts = tree.children_visits[node_index]
    chex.assert_rank([qvalues, visit_counts, node_index], [1, 1, 0])
    node_value = tree.node_values[node_index]
    safe_qvalues = jnp.where(visit_counts > 0, qvalues, node_value)
    chex.assert_equal_shape([safe_qvalues, qvalues])
    min_value = jnp.minimum(node_value, jnp.min(safe_qvalues, axis=-1))
    max_value = jnp.maximum(node_value, jnp.max(safe_qvalues, axis=-1))
    completed_by_min = jnp.where(visit_counts > 0, qvalues, min_value)
    normalized = (completed_by_min - min_value) / (
        jnp.maximum(max_value - min_value, epsilon))
    chex.assert_equal_shape([normalized, qvalues])
    return normalized


def qtransform_completed_by_mix_value(tree, node_index, *, value_scale=0.1,
                                      maxvisit_init=50.0, rescale_values=True,
                                      use_mixed_value=True, epsilon=1e-8):
    chex.assert_shape(node_index, ())
    qvalues = tree.qvalues(node_index)
    visit_counts = tree.children_visits[node_index]
    raw_value = tree.raw_values[node_index]
    prior_probs = jax.nn.softmax(tree.children_prior_logits[node_index])
    if use_mixed_value:
        value = _compute_mixed_value(raw_value, qvalues=qvalues,
                                     visit_counts=visit_counts, prior_probs=prior_probs)
    else:
        value = raw_value
    completed_qvalues = _complete_qvalues(qvalues, visit_counts=visit_counts, value=value)
    if rescale_values:
        completed_qvalues = _rescale_qvalues(completed_qvalues, epsilon)
    maxvisit = jnp.max(visit_counts, axis=-1)
    visit_scale = maxvisit_init + maxvisit
    return visit_scale * value_scale * completed_qvalues


def _rescale_qvalues(qvalues, epsilon):
    min_value = jnp.min(qvalues, axis=-1, keepdims=True)
    max_value = jnp.max(qvalues, axis=-1, keepdims=True)
    return (qvalues - min_value) / jnp.maximum(max_value - min_value, epsilon)


def _complete_qvalues(qvalues, *, visit_counts, value):
    chex.assert_equal_shape([qvalues, visit_counts])
    chex.assert_shape(value, [])
    completed_qvalues = jnp.where(visit_counts > 0, qvalues, value)
    chex.assert_equal_shape([completed_qvalues, qvalues])
    return completed_qvalues


def _compute_mixed_value(raw_value, qvalues, visit_counts, prior_probs):
    sum_visit_counts = jnp.sum(visit_counts, axis=-1)
    prior_probs = jnp.maximum(jnp.finfo(prior_probs.dtype).tiny, prior_probs)
    sum_probs = jnp.sum(jnp.where(visit_counts > 0, prior_probs, 0.0), axis=-1)
    weighted_q = jnp.sum(jnp.where(
        visit_counts > 0,
        prior_probs * qvalues / jnp.where(visit_counts > 0, sum_probs, 1.0),
        0.0), axis=-1)
    return (raw_value + sum_visit_counts * weighted_q) / (sum_visit_counts + 1)


def score_considered(considered_visit, gumbel, logits, normalized_qvalues, visit_counts):
    low_logit = -1e9
    logits = logits - jnp.max(logits, keepdims=True, axis=-1)
    penalty = jnp.where(visit_counts == considered_visit, 0, -jnp.inf)
    chex.assert_equal_shape([gumbel, logits, normalized_qvalues, penalty])
    return jnp.maximum(low_logit, gumbel + logits + normalized_qvalues) + penalty


def get_sequence_of_considered_visits(max_num_considered_actions, num_simulations):
    if max_num_considered_actions <= 1:
        return tuple(range(num_simulations))
    log2max = int(math.ceil(math.log2(max_num_considered_actions)))
    sequence = []
    visits = [0] * max_num_considered_actions
    num_considered = max_num_considered_actions
    while len(sequence) < num_simulations:
        num_extra_visits = max(1, int(num_simulations / (log2max * num_considered)))
        for _ in range(num_extra_visits):
            sequence.extend(visits[:num_considered])
            for i in range(num_considered):
                visits[i] += 1
        num_considered = max(2, num_considered // 2)
    return tuple(sequence[:num_simulations])


def get_table_of_considered_visits(max_num_considered_actions, num_simulations):
    return tuple(get_sequence_of_considered_visits(m, num_simulations)
                 for m in range(max_num_considered_actions + 1))


def gumbel_muzero_root_action_selection(rng_key, tree, node_index, *, num_simulations,
                                        max_num_considered_actions,
                                        qtransform=qtransform_completed_by_mix_value):
    del rng_key
    chex.assert_shape([node_index], ())
    visit_counts = tree.children_visits[node_index]
    prior_logits = tree.children_prior_logits[node_index]
    chex.assert_equal_shape([visit_counts, prior_logits])
    completed_qvalues = qtransform(tree, node_index)
    table = jnp.array(get_table_of_considered_visits(max_num_considered_actions,
                                                     num_simulations))
    num_valid_actions = jnp.sum(1 - tree.root_invalid_actions, axis=-1).astype(jnp.int32)
    num_considered = jnp.minimum(max_num_considered_actions, num_valid_actions)
    chex.assert_shape(num_considered, ())
    simulation_index = jnp.sum(visit_counts, -1)
    chex.assert_shape(simulation_index, ())
    considered_visit = table[num_considered, simulation_index]
    chex.assert_shape(considered_visit, ())
    gumbel = tree.extra_data.root_gumbel
    to_argmax = score_considered(considered_visit, gumbel, prior_logits, completed_qvalues,
                                 visit_counts)
    return masked_argmax(to_argmax, tree.root_invalid_actions)


def gumbel_muzero_interior_action_selection(rng_key, tree, node_index, depth, *,
                                            qtransform=qtransform_completed_by_mix_value):
    del rng_key, depth
    chex.assert_shape([node_index], ())
    visit_counts = tree.children_visits[node_index]
    prior_logits = tree.children_prior_logits[node_index]
    chex.assert_equal_shape([visit_counts, prior_logits])
    completed_qvalues = qtransform(tree, node_index)
    to_argmax = _prepare_argmax_input(probs=jax.nn.softmax(prior_logits + completed_qvalues),
                                      visit_counts=visit_counts)
    chex.assert_rank(to_argmax, 1)
    return jnp.argmax(to_argmax, axis=-1).astype(jnp.int32)


def muzero_action_selection(rng_key, tree, node_index, depth, *, pb_c_init=1.25,
                            pb_c_base=19652.0, qtransform=qtransform_by_parent_and_siblings):
    visit_counts = tree.children_visits[node_index]
    node_visit = tree.node_visits[node_index]
    pb_c = pb_c_init + jnp.log((node_visit + pb_c_base + 1.) / pb_c_base)
    prior_logits = tree.children_prior_logits[node_index]
    prior_probs = jax.nn.softmax(prior_logits)
    policy_score = jnp.sqrt(node_visit) * pb_c * prior_probs / (visit_counts + 1)
    chex.assert_shape([node_index, node_visit], ())
    chex.assert_equal_shape([prior_probs, visit_counts, policy_score])
    value_score = qtransform(tree, node_index)
    node_noise_score = 1e-7 * jax.random.uniform(rng_key, (tree.num_actions,))
    to_argmax = value_score + policy_score + node_noise_score
    # Masking the invalid actions at the root.
    return masked_argmax(to_argmax, tree.root_invalid_actions * (depth == 0)), to_argmax  # (ours: + the scores)


def masked_argmax(to_argmax, invalid_actions):
    if invalid_actions is not None:
        chex.assert_equal_shape([to_argmax, invalid_actions])
        to_argmax = jnp.where(invalid_actions, -jnp.inf, to_argmax)
    return jnp.argmax(to_argmax, axis=-1).astype(jnp.int32)


def _prepare_argmax_input(probs, visit_counts):
    chex.assert_equal_shape([probs, visit_counts])
    return probs - visit_counts / (1 + jnp.sum(visit_counts, keepdims=True, axis=-1))


# -- ours -----------------------------------------------------------------------------------------
class MiniTree:
    """The fields of mctx's Tree that the selection functions read (one tree, 1 node)."""

    def __init__(self, visits, prior_logits, qvalues, raw_value, node_value, node_visit,
                 invalid, gumbel):
        self.children_visits = visits[None]
        self.children_prior_logits = prior_logits[None]
        self._q = qvalues[None]
        self.raw_values = raw_value[None]
        self.node_values = node_value[None]
        self.node_visits = node_visit[None]
        self.root_invalid_actions = invalid
        self.extra_data = namedtuple("E", "root_gumbel")(gumbel)

    @property
    def num_actions(self):
        return self.children_prior_logits.shape[-1]

    def qvalues(self, node_index):
        return self._q[node_index]


# -- mctx/_src/policies.py ------------------------------------------------------------------------
def _mask_invalid_actions(logits, invalid_actions):
    if invalid_actions is None:
        return logits
    chex.assert_equal_shape([logits, invalid_actions])
    logits = logits - jnp.max(logits, axis=-1, keepdims=True)
    min_logit = jnp.finfo(logits.dtype).min
    return jnp.where(invalid_actions, min_logit, logits)


def _get_logits_from_probs(probs):
    tiny = jnp.finfo(probs.dtype).tiny
    return jnp.log(jnp.maximum(probs, tiny))


def _add_dirichlet_noise(rng_key, probs, *, dirichlet_alpha, dirichlet_fraction):
    chex.assert_rank(probs, 2)
    chex.assert_type([dirichlet_alpha, dirichlet_fraction], float)
    batch_size, num_actions = probs.shape
    noise = jax.random.dirichlet(
        rng_key, alpha=jnp.full([num_actions], fill_value=dirichlet_alpha), shape=(batch_size,))
    noisy_probs = (1 - dirichlet_fraction) * probs + dirichlet_fraction * noise
    return noisy_probs


# -- the programs ---------------------------------------------------------------------------------
NSIM = 8  # num_simulations


def _mctx_example(n, rng):
    visits = np.zeros(n, np.int32)
    if n:
        k = int(rng.integers(0, NSIM))  # simulation index < num_simulations
        for _ in range(k):
            visits[int(rng.integers(0, n))] += 1
    invalid = (rng.random(n) < 0.2).astype(np.float32)
    if n:
        invalid[int(rng.integers(0, n))] = 0.0
    return (visits, normal(rng, n), normal(rng, n), invalid,
            rng.gumbel(size=n).astype(np.float32))


def _tree(visits, prior_logits, qvalues, invalid, gumbel):
    return MiniTree(visits, prior_logits, qvalues, jnp.float32(0.3), jnp.float32(0.1),
                    jnp.sum(visits) + 1, invalid, gumbel)


def gumbel_select_program(visits, prior_logits, qvalues, invalid, gumbel):
    """Gumbel MuZero's root (sequential halving) and interior selection over n actions."""
    tree = _tree(visits, prior_logits, qvalues, invalid, gumbel)
    root = gumbel_muzero_root_action_selection(
        None, tree, jnp.int32(0), num_simulations=NSIM, max_num_considered_actions=4)
    interior = gumbel_muzero_interior_action_selection(None, tree, jnp.int32(0), 1)
    completed = qtransform_completed_by_mix_value(tree, jnp.int32(0))
    return root, interior, completed


def muzero_select_program(visits, prior_logits, qvalues, invalid, gumbel):
    """MuZero's PUCT selection over n actions (random tie-break noise of shape (n,))."""
    tree = _tree(visits, prior_logits, qvalues, invalid, gumbel)
    return muzero_action_selection(jax.random.PRNGKey(0), tree, jnp.int32(0), jnp.int32(0))


def root_noise_program(prior_logits, invalid):
    """gumbel_muzero_policy's root: Dirichlet noise, masked logits and a Gumbel draw."""
    rng_key = jax.random.PRNGKey(42)
    rng_key, dirichlet_rng = jax.random.split(rng_key)
    probs = jax.nn.softmax(prior_logits)
    noisy = _add_dirichlet_noise(dirichlet_rng, probs, dirichlet_alpha=0.3,
                                 dirichlet_fraction=0.25)
    logits = _mask_invalid_actions(_get_logits_from_probs(noisy), invalid)
    rng_key, gumbel_rng = jax.random.split(rng_key)
    gumbel = 1.0 * jax.random.gumbel(gumbel_rng, shape=logits.shape, dtype=logits.dtype)
    return logits, gumbel, jnp.argmax(logits + gumbel, axis=-1)


def _noise_example(n, rng):
    invalid = rng.random((1, n)) < 0.2
    if n:
        invalid[:, 0] = False
    return normal(rng, 1, n), invalid


PROGRAMS = [
    program(name="mctx_gumbel_action_selection",
            source=SRC + "action_selection.py gumbel_muzero_root/interior_action_selection, "
                         "qtransforms.py, seq_halving.py",
            license="Apache-2.0", fun=gumbel_select_program, in_specs=("a",) * 5,
            make_example=_mctx_example, bound=9),
    program(name="mctx_muzero_action_selection",
            source=SRC + "action_selection.py muzero_action_selection, "
                         "qtransform_by_parent_and_siblings",
            license="Apache-2.0", fun=muzero_select_program, in_specs=("a",) * 5,
            make_example=_mctx_example, bound=9),
    program(name="mctx_root_dirichlet_gumbel_noise",
            source=SRC + "policies.py _add_dirichlet_noise, _mask_invalid_actions, Gumbel draw",
            license="Apache-2.0", fun=root_noise_program, in_specs=("1, a", "1, a"),
            make_example=_noise_example, bound=5,
            note="batch 1 and 5 actions at most: jax.random.dirichlet's gamma sampler "
                 "compiles slowly"),
]
