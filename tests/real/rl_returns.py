"""Reinforcement-learning returns and losses: purejaxrl's PPO, brax's GAE and
running statistics, sbx's TQC critic loss and flashbax's trajectory buffer.

Sources (each block below names its functions):

- purejaxrl https://github.com/luchris429/purejaxrl (commit 31756b1),
  purejaxrl/ppo.py: ActorCritic, Transition, _calculate_gae, _loss_fn (nested
  in make_train there; the config dict is an argument here). License:
  Apache-2.0. distrax.Categorical is inlined (log_prob / entropy of logits);
  hidden width 16 (was 64).
- brax https://github.com/google/brax (commit 0b96d05),
  brax/training/acme/running_statistics.py (update, WELFORD mode without pmap,
  the state a dict; normalize), brax/training/types.py (UInt64) and
  brax/training/agents/ppo/losses.py (compute_gae). License: Apache-2.0,
  Copyright 2026 The Brax Authors.
- sbx https://github.com/araffin/sbx (commit 9bdc9c1), sbx/tqc/tqc.py
  update_critic's target quantiles and huber_quantile_loss, as one function.
  License: MIT, Copyright (c) 2022 Antonin Raffin.
- flashbax https://github.com/instadeepai/flashbax (commit 1bda7f1),
  flashbax/buffers/trajectory_buffer.py add (state and batch as dicts) and
  flashbax/utils.py get_tree_shape_prefix. License: Apache-2.0, Copyright 2023
  InstaDeep Ltd.

T = n time steps (the sbx program: n quantiles; flashbax: n steps added).
"""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.linen.initializers import constant, orthogonal

from .corpus import flat, normal, params, program

PUREJAXRL = "purejaxrl https://github.com/luchris429/purejaxrl/blob/31756b1/purejaxrl/ppo.py"
BRAX = "brax https://github.com/google/brax/blob/0b96d05/brax/training/"
SBX = "sbx https://github.com/araffin/sbx/blob/9bdc9c1/sbx/tqc/tqc.py"
FLASHBAX = ("flashbax https://github.com/instadeepai/flashbax/blob/1bda7f1/"
            "flashbax/buffers/trajectory_buffer.py")


# -- purejaxrl/ppo.py -----------------------------------------------------------------------------
class Categorical:
    def __init__(self, logits):
        self.logits = logits

    def log_prob(self, a):
        lp = jax.nn.log_softmax(self.logits)
        return jnp.take_along_axis(lp, a[..., None], axis=-1)[..., 0]

    def entropy(self):
        lp = jax.nn.log_softmax(self.logits)
        return -jnp.sum(jnp.exp(lp) * lp, axis=-1)


class ActorCritic(nn.Module):
    action_dim: int
    activation: str = "tanh"

    @nn.compact
    def __call__(self, x):
        activation = nn.relu if self.activation == "relu" else nn.tanh
        actor_mean = nn.Dense(16, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(x)
        actor_mean = activation(actor_mean)
        actor_mean = nn.Dense(16, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(actor_mean)
        actor_mean = activation(actor_mean)
        actor_mean = nn.Dense(self.action_dim, kernel_init=orthogonal(0.01), bias_init=constant(0.0))(actor_mean)
        pi = Categorical(logits=actor_mean)
        critic = nn.Dense(16, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(x)
        critic = activation(critic)
        critic = nn.Dense(16, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(critic)
        critic = activation(critic)
        critic = nn.Dense(1, kernel_init=orthogonal(1.0), bias_init=constant(0.0))(critic)
        return pi, jnp.squeeze(critic, axis=-1)


class Transition(NamedTuple):
    done: jnp.ndarray
    action: jnp.ndarray
    value: jnp.ndarray
    reward: jnp.ndarray
    log_prob: jnp.ndarray
    obs: jnp.ndarray


PPO_CONFIG = {"GAMMA": 0.99, "GAE_LAMBDA": 0.95, "CLIP_EPS": 0.2, "VF_COEF": 0.5, "ENT_COEF": 0.01}


def purejaxrl_calculate_gae(traj_batch, last_val, config=PPO_CONFIG):
    def _get_advantages(gae_and_next_value, transition):
        gae, next_value = gae_and_next_value
        done, value, reward = (transition.done, transition.value, transition.reward)
        delta = reward + config["GAMMA"] * next_value * (1 - done) - value
        gae = delta + config["GAMMA"] * config["GAE_LAMBDA"] * (1 - done) * gae
        return (gae, value), gae

    _, advantages = jax.lax.scan(_get_advantages, (jnp.zeros_like(last_val), last_val),
                                 traj_batch, reverse=True, unroll=16)
    return advantages, advantages + traj_batch.value


def purejaxrl_loss_fn(network, params, traj_batch, gae, targets, config=PPO_CONFIG):
    pi, value = network.apply(params, traj_batch.obs)
    log_prob = pi.log_prob(traj_batch.action)
    value_pred_clipped = traj_batch.value + (value - traj_batch.value).clip(
        -config["CLIP_EPS"], config["CLIP_EPS"])
    value_losses = jnp.square(value - targets)
    value_losses_clipped = jnp.square(value_pred_clipped - targets)
    value_loss = 0.5 * jnp.maximum(value_losses, value_losses_clipped).mean()
    ratio = jnp.exp(log_prob - traj_batch.log_prob)
    gae = (gae - gae.mean()) / (gae.std() + 1e-8)
    loss_actor1 = ratio * gae
    loss_actor2 = jnp.clip(ratio, 1.0 - config["CLIP_EPS"], 1.0 + config["CLIP_EPS"]) * gae
    loss_actor = -jnp.minimum(loss_actor1, loss_actor2)
    loss_actor = loss_actor.mean()
    entropy = pi.entropy().mean()
    total_loss = loss_actor + config["VF_COEF"] * value_loss - config["ENT_COEF"] * entropy
    return total_loss, (value_loss, loss_actor, entropy)


# -- brax/training/types.py UInt64; acme/running_statistics.py; agents/ppo/losses.py -----------
class UInt64:
    def __init__(self, hi, lo):
        if isinstance(hi, (int, np.integer, np.ndarray, jax.Array)):
            hi = jnp.uint32(hi)
        if isinstance(lo, (int, np.integer, np.ndarray, jax.Array)):
            lo = jnp.uint32(lo)
        self.hi, self.lo = hi, lo

    def __add__(self, other):
        other = _sanitize_uint64_input(other)
        return _add_uint64(self, other)


def _sanitize_uint64_input(other):
    if isinstance(other, (int, np.ndarray, jax.Array)):
        other_lo = other & jnp.array(0xFFFFFFFF, dtype=jnp.uint32)
        other_hi = other >> 32
        other = UInt64(hi=jnp.array(other_hi, dtype=jnp.uint32),
                       lo=jnp.array(other_lo, dtype=jnp.uint32))
    elif isinstance(other, UInt64):
        pass
    else:
        raise NotImplementedError(f"Cannot perform op on {type(other)} and UInt64.")
    return other


def _add_uint64(a, b):
    result_lo = a.lo + b.lo
    carry_bit_pattern = (a.lo & b.lo) | ((a.lo | b.lo) & (~result_lo))
    carry = carry_bit_pattern >> 31
    result_hi = a.hi + b.hi + carry
    return UInt64(hi=result_hi, lo=result_lo)


def brax_update(state, batch, *, weights=None, std_min_value=1e-6, std_max_value=1e6,
                validate_shapes=True):
    """running_statistics.update, WELFORD mode, no pmap; state a dict."""
    assert jax.tree_util.tree_structure(batch) == jax.tree_util.tree_structure(state["mean"])
    batch_leaves = jax.tree_util.tree_leaves(batch)
    batch_shape = batch_leaves[0].shape
    batch_dims = batch_shape[:len(batch_shape) - jax.tree_util.tree_leaves(state["mean"])[0].ndim]
    batch_axis = range(len(batch_dims))
    if weights is None:
        step_increment = jnp.prod(jnp.array(batch_dims)).astype(jnp.int32)
    else:
        step_increment = jnp.sum(weights).astype(jnp.int32)
    count = state["count"] + step_increment
    count_float = (jnp.float32(count.hi) * jnp.float32(2.0**32) + jnp.float32(count.lo))
    if validate_shapes:
        if weights is not None:
            if weights.shape != batch_dims:
                raise ValueError(f'{weights.shape} != {batch_dims}')

        def validate_node_shape(reference_sample, batch):
            expected_shape = batch_dims + reference_sample.shape
            assert batch.shape == expected_shape, f'{batch.shape} != {expected_shape}'

        jax.tree_util.tree_map(validate_node_shape, state["mean"], batch)

    def _compute_node_statistics(mean, summed_variance, batch):
        assert isinstance(mean, jnp.ndarray), type(mean)
        assert isinstance(summed_variance, jnp.ndarray), type(summed_variance)
        diff_to_old_mean = batch - mean
        if weights is not None:
            expanded_weights = jnp.reshape(weights, list(weights.shape) + [1] * (batch.ndim - weights.ndim))
            diff_to_old_mean = diff_to_old_mean * expanded_weights
        mean_update = jnp.sum(diff_to_old_mean, axis=batch_axis) / count_float
        mean = mean + mean_update
        diff_to_new_mean = batch - mean
        variance_update = diff_to_old_mean * diff_to_new_mean
        variance_update = jnp.sum(variance_update, axis=batch_axis)
        summed_variance = summed_variance + variance_update
        return mean, summed_variance

    mean, summed_variance = _compute_node_statistics(state["mean"], state["summed_variance"], batch)

    def compute_std(summed_variance, std):
        summed_variance = jnp.maximum(summed_variance, 0)
        std = jnp.sqrt(summed_variance / count_float + state["std_eps"])
        std = jnp.clip(std, std_min_value, std_max_value)
        return std

    std = compute_std(summed_variance, state["std"])
    return dict(count=count, mean=mean, summed_variance=summed_variance, std=std,
                std_eps=state["std_eps"])


def brax_normalize(batch, mean, std, max_abs_value=None):
    if not jnp.issubdtype(batch.dtype, jnp.inexact):
        return batch
    data = (batch - mean) / std
    if max_abs_value is not None:
        data = jnp.clip(data, -max_abs_value, +max_abs_value)
    return data


def brax_compute_gae(truncation, termination, rewards, values, bootstrap_value,
                     lambda_=1.0, discount=0.99):
    truncation_mask = 1 - truncation
    values_t_plus_1 = jnp.concatenate([values[1:], jnp.expand_dims(bootstrap_value, 0)], axis=0)
    deltas = rewards + discount * (1 - termination) * values_t_plus_1 - values
    deltas *= truncation_mask
    acc = jnp.zeros_like(bootstrap_value)

    def compute_vs_minus_v_xs(carry, target_t):
        lambda_, acc = carry
        truncation_mask, delta, termination = target_t
        acc = delta + discount * (1 - termination) * truncation_mask * lambda_ * acc
        return (lambda_, acc), (acc)

    (_, _), (vs_minus_v_xs) = jax.lax.scan(
        compute_vs_minus_v_xs, (lambda_, acc), (truncation_mask, deltas, termination),
        length=int(truncation_mask.shape[0]), reverse=True)
    vs = jnp.add(vs_minus_v_xs, values)
    vs_t_plus_1 = jnp.concatenate([vs[1:], jnp.expand_dims(bootstrap_value, 0)], axis=0)
    advantages = (rewards + discount * (1 - termination) * vs_t_plus_1 - values) * truncation_mask
    return jax.lax.stop_gradient(vs), jax.lax.stop_gradient(advantages)


# -- sbx/tqc/tqc.py update_critic (target quantiles, huber_quantile_loss) -------------------------
def tqc_critic_loss(current_quantiles, qf1_next_quantiles, qf2_next_quantiles, next_log_prob,
                    rewards, dones, discounts, ent_coef_value, n_target_quantiles):
    qf_next_quantiles = jnp.concatenate((qf1_next_quantiles, qf2_next_quantiles), axis=1)
    next_quantiles = jnp.sort(qf_next_quantiles)
    next_target_quantiles = next_quantiles[:, :n_target_quantiles]
    next_target_quantiles = next_target_quantiles - ent_coef_value * next_log_prob[:, None]
    target_quantiles = rewards[:, None] + (1 - dones[:, None]) * discounts[:, None] * next_target_quantiles
    target_quantiles = jnp.expand_dims(target_quantiles, axis=1)
    # huber_quantile_loss
    current_quantiles = jnp.expand_dims(current_quantiles, axis=-1)
    n_quantiles = current_quantiles.shape[1]
    cum_prob = (jnp.arange(n_quantiles, dtype=jnp.float32) + 0.5) / n_quantiles
    cum_prob = jnp.expand_dims(cum_prob, axis=(0, -1))
    pairwise_delta = target_quantiles - current_quantiles
    abs_pairwise_delta = jnp.abs(pairwise_delta)
    huber_loss = jnp.where(abs_pairwise_delta > 1, abs_pairwise_delta - 0.5, pairwise_delta**2 * 0.5)
    loss = jnp.abs(cum_prob - (pairwise_delta < 0).astype(jnp.float32)) * huber_loss
    return loss.mean()


# -- flashbax/utils.py get_tree_shape_prefix; buffers/trajectory_buffer.py add ------------------
def get_tree_shape_prefix(tree, n_axes=1):
    leaves = jax.tree_util.tree_leaves(tree)
    return leaves[0].shape[:n_axes]


def flashbax_add(state, batch):
    chex.assert_tree_shape_prefix(batch, get_tree_shape_prefix(state["experience"]))
    chex.assert_trees_all_equal_dtypes(batch, state["experience"])
    max_length_time_axis = get_tree_shape_prefix(state["experience"], n_axes=2)[1]
    chex.assert_axis_dimension_lteq(jax.tree_util.tree_leaves(batch)[0], 1, max_length_time_axis)
    seq_len = get_tree_shape_prefix(batch, n_axes=2)[1]
    indices = (jnp.arange(seq_len) + state["current_index"]) % max_length_time_axis
    new_experience = jax.tree.map(
        lambda exp_field, batch_field: exp_field.at[:, indices].set(batch_field),
        state["experience"], batch)
    new_current_index = state["current_index"] + seq_len
    new_is_full = state["is_full"] | (new_current_index >= max_length_time_axis)
    new_current_index = new_current_index % max_length_time_axis
    return dict(experience=new_experience, current_index=new_current_index, is_full=new_is_full)


# -- the programs ---------------------------------------------------------------------------------
AC = ActorCritic(action_dim=3)
ENVS = 2


def _ac_init(rng):
    return flat(AC.init(jax.random.PRNGKey(0), jnp.zeros((4,))))


def _ac_leaves():
    return params(12, _ac_init)[0]


def ppo_program(*args):
    """GAE over T steps of 2 environments (reverse scan), then PPO's clipped loss."""
    nl = len(_ac_leaves())
    network_params = params(12, _ac_init)[1](args[:nl])
    last_val, done, action, value, reward, log_prob, obs = args[nl:]
    traj = Transition(done, action, value, reward, log_prob, obs)
    advantages, targets = purejaxrl_calculate_gae(traj, last_val)
    total, (value_loss, loss_actor, entropy) = purejaxrl_loss_fn(
        AC, network_params, traj, advantages, targets)
    return total, value_loss, loss_actor, entropy, advantages


def _ppo_example(n, rng):
    return tuple(_ac_leaves()) + (
        normal(np.random.default_rng(4), ENVS), (rng.random((n, ENVS)) < 0.15).astype(np.float32),
        rng.integers(0, 3, (n, ENVS)).astype(np.int32), normal(rng, n, ENVS),
        normal(rng, n, ENVS), (np.log(1 / 3) + 0.1 * normal(rng, n, ENVS)).astype(np.float32),
        normal(rng, n, ENVS, 4))


def running_statistics_program(mean, summed_variance, std, batch):
    """Welford update of observation statistics (a UInt64 step count) by n samples, then
    normalize them."""
    state = dict(count=UInt64(hi=0, lo=100), mean=mean, summed_variance=summed_variance,
                 std=std, std_eps=0.0)
    new = brax_update(state, batch)
    return (new["count"].lo, new["count"].hi, new["mean"], new["summed_variance"], new["std"],
            brax_normalize(batch, new["mean"], new["std"], max_abs_value=5.0))


def _running_statistics_example(n, rng):
    return (0.1 * normal(np.random.default_rng(6), 5), np.full(5, 100.0, np.float32),
            np.ones(5, np.float32), normal(rng, n, 5))


def brax_gae_program(bootstrap_value, truncation, termination, rewards, values):
    """brax's PPO GAE over T steps of 3 environments (scan length=int(T))."""
    return brax_compute_gae(truncation, termination, rewards, values, bootstrap_value,
                            lambda_=0.95, discount=0.99)


def _brax_gae_example(n, rng):
    return (normal(np.random.default_rng(7), 3), (rng.random((n, 3)) < 0.1).astype(np.float32),
            (rng.random((n, 3)) < 0.1).astype(np.float32), normal(rng, n, 3), normal(rng, n, 3))


def tqc_program(current, qf1_next, qf2_next, next_log_prob, rewards, dones):
    """TQC's critic loss for 3 transitions of n quantiles per critic (2 critics, 2 dropped
    each: the sorted 2n - 4 smallest targets)."""
    n_quantiles = qf1_next.shape[1]
    n_critics, drop = 2, 2
    n_target_quantiles = n_quantiles * n_critics - drop * n_critics
    return tqc_critic_loss(current, qf1_next, qf2_next, next_log_prob, rewards, dones,
                           jnp.full(rewards.shape, 0.99), 0.1, n_target_quantiles)


def _tqc_example(n, rng):
    return (normal(rng, 3, n), normal(rng, 3, n), normal(rng, 3, n),
            normal(np.random.default_rng(8), 3), normal(np.random.default_rng(9), 3),
            np.array([0., 1., 0.], np.float32))


MAX_T = 10  # the buffer's max_length_time_axis


def flashbax_program(exp_obs, exp_rew, current_index, obs, rew):
    """Add n time steps of 2 environments to a circular trajectory buffer at index 7."""
    state = dict(experience={"obs": exp_obs, "rew": exp_rew}, current_index=current_index,
                 is_full=jnp.bool_(False))
    new = flashbax_add(state, {"obs": obs, "rew": rew})
    return new["experience"]["obs"], new["experience"]["rew"], new["current_index"], new["is_full"]


def _flashbax_example(n, rng):
    return (np.random.default_rng(10).normal(size=(2, MAX_T, 3)).astype(np.float32),
            np.random.default_rng(11).normal(size=(2, MAX_T)).astype(np.float32),
            np.int32(7), normal(rng, 2, n, 3), normal(rng, 2, n))


PROGRAMS = [
    program(name="purejaxrl_gae_ppo_loss",
            source=PUREJAXRL + " _calculate_gae (scan reverse, unroll=16), _loss_fn",
            license="Apache-2.0", fun=ppo_program,
            in_specs=lambda: (None,) * (len(_ac_leaves()) + 1) + ("t, 2",) * 5 + ("t, 2, 4",),
            make_example=_ppo_example, bound=6, rtol=2e-4, atol=2e-4),
    program(name="brax_running_statistics_update",
            source=BRAX + "acme/running_statistics.py update (welford, UInt64 count), normalize",
            license="Apache-2.0", fun=running_statistics_program,
            in_specs=(None, None, None, "n, 5"), make_example=_running_statistics_example,
            bound=8),
    program(name="brax_ppo_compute_gae", source=BRAX + "agents/ppo/losses.py compute_gae",
            license="Apache-2.0", fun=brax_gae_program, in_specs=(None,) + ("t, 3",) * 4,
            make_example=_brax_gae_example, bound=8),
    program(name="sbx_tqc_quantile_huber_loss",
            source=SBX + " update_critic (sort, [:, :n_target_quantiles], huber_quantile_loss)",
            license="MIT", fun=tqc_program, in_specs=("3, q",) * 3 + ("3",) * 3,
            make_example=_tqc_example, bound=9, sizes=(0, 1, 2, 3, 5, 9)),
    program(name="flashbax_trajectory_add",
            source=FLASHBAX + " add (indices = (arange(seq_len) + idx) % max_len; "
                              "at[:, indices].set)",
            license="Apache-2.0", fun=flashbax_program, in_specs=(None, None, None, "2, t, 3", "2, t"),
            make_example=_flashbax_example, bound=MAX_T, sizes=(0, 1, 3, 6, 10)),
]
