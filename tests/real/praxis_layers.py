"""Paddings-aware group normalization and attention masks from praxis (Pax).

Source: https://github.com/google/praxis (commit feeaff1),
praxis/layers/normalizations.py (compute_moments; GroupNorm.__call__ and
_normalize as the function ``group_norm``, cumulative mode, 3-D inputs) and
praxis/layers/attentions.py (causal_mask, segment_mask, merge_masks,
causal_segment_mask, convert_paddings_to_mask, limited_context_mask) with
py_utils.get_large_negative_number.
License: Apache-2.0, Copyright 2022 The Pax Authors.
Copied: the functions verbatim; GroupNorm's parameters (gamma, beta) are
arguments instead of praxis's layer variables. T = n time steps.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .corpus import normal, program

SRC = "praxis https://github.com/google/praxis/blob/feeaff1/praxis/layers/"


# -- praxis/py_utils.py, layers/normalizations.py, layers/attentions.py ---------------------------
def get_large_negative_number(dtype):
    dtype = jnp.asarray(0, dtype=dtype).dtype
    dtype_max = jnp.finfo(dtype).max
    return jnp.asarray(-0.7 * dtype_max, dtype=dtype)


def compute_moments(inputs, padding, reduce_over_dims, cumulative_axis=None, keepdims=False):
    assert inputs.ndim == padding.ndim
    mask = 1.0 - padding
    sum_v = jnp.sum(inputs * mask, axis=reduce_over_dims, keepdims=keepdims)
    count_v = jnp.sum(jnp.ones_like(inputs) * mask, axis=reduce_over_dims, keepdims=keepdims)
    if cumulative_axis is not None:
        sum_v = jnp.cumsum(sum_v, axis=cumulative_axis)
        count_v = jnp.cumsum(count_v, axis=cumulative_axis)
    count_v = jnp.maximum(count_v, 1.0)
    mean = sum_v / count_v
    sum_vv = jnp.sum((inputs - mean) * (inputs - mean) * mask, axis=reduce_over_dims,
                     keepdims=keepdims)
    if cumulative_axis is not None:
        sum_vv = jnp.cumsum(sum_vv, axis=cumulative_axis)
    variance = sum_vv / count_v
    return mean, variance


def group_norm(gamma, beta, inputs, paddings, *, num_groups=2, dim=8, cumulative=True,
               input_rank=3, epsilon=0.001, set_padded_output_to_zero=True):
    group_size = max(dim // num_groups, 1)
    n_groups = dim // group_size
    x = jnp.reshape(inputs, list(inputs.shape[:-1]) + [n_groups, group_size])
    expanded_rank = input_rank + 1
    all_dims = list(range(expanded_rank))
    if paddings is None or not cumulative:
        reduce_over_dims = all_dims[1:-2] + all_dims[-1:]
    else:
        reduce_over_dims = all_dims[2:-2] + all_dims[-1:]
    expanded_paddings = jnp.reshape(paddings, list(inputs.shape[:2]) + [1] * (expanded_rank - 2))
    group_mean, group_variance = compute_moments(
        x, expanded_paddings, reduce_over_dims,
        cumulative_axis=1 if cumulative else None, keepdims=True)
    # _normalize
    group_stddev_inv = jax.lax.rsqrt(group_variance + epsilon)
    grouped_inputs = (x - group_mean) * group_stddev_inv
    grouped_inputs = jnp.reshape(grouped_inputs, list(grouped_inputs.shape[:-2]) + [-1])
    outputs = grouped_inputs
    outputs *= (1 + gamma)
    outputs += beta
    gn_output = outputs
    if set_padded_output_to_zero and paddings is not None:
        expanded_paddings = jnp.reshape(paddings, list(inputs.shape[:2]) + [1] * (expanded_rank - 3))
        gn_output *= 1.0 - expanded_paddings
    return gn_output


def limited_context_mask(left_context, right_context, time_size, dtype=jnp.float32,
                         column_time_size=None):
    large_negative_number = get_large_negative_number(dtype)
    if column_time_size is None:
        column_time_size = time_size
    if right_context is None:
        right_context = max(time_size, column_time_size)
    if left_context is None:
        left_context = max(time_size, column_time_size)
    col_idx = jnp.arange(column_time_size)[jnp.newaxis, :]
    row_idx = jnp.arange(time_size)[:, jnp.newaxis]
    return ((col_idx + left_context <= row_idx) | (row_idx < col_idx - right_context)
            ).astype(dtype) * large_negative_number


def causal_mask(input_t):
    assert jnp.issubdtype(input_t.dtype, jnp.floating), input_t.dtype
    large_negative_number = get_large_negative_number(input_t.dtype)
    t = input_t.shape[1]
    col_idx = jnp.tile(jnp.arange(t)[jnp.newaxis, :], [t, 1])
    row_idx = jnp.tile(jnp.arange(t)[:, jnp.newaxis], [1, t])
    mask = (row_idx < col_idx).astype(input_t.dtype) * large_negative_number
    return mask[jnp.newaxis, jnp.newaxis, :, :]


def segment_mask(segment_ids, source_segment_ids=None, dtype=jnp.float32):
    segment_ids_1 = jnp.expand_dims(segment_ids, axis=-1)
    if source_segment_ids is not None:
        segment_ids_2 = jnp.expand_dims(source_segment_ids, axis=1)
    else:
        segment_ids_2 = jnp.expand_dims(segment_ids, axis=1)
    mask = jnp.not_equal(segment_ids_1, segment_ids_2).astype(dtype)
    mask = jnp.expand_dims(mask, 1)
    mask *= get_large_negative_number(dtype)
    return mask


def merge_masks(a, b):
    def expand_t(key_mask):
        query_mask = jnp.transpose(key_mask, [0, 1, 3, 2])
        return jnp.minimum(query_mask, key_mask)

    if a.shape[2] != b.shape[2]:
        if a.shape[2] == 1:
            a = expand_t(a)
        else:
            assert b.shape[2] == 1
            b = expand_t(b)
    assert a.shape[1:] == b.shape[1:], f'a.shape={a.shape}, b.shape={b.shape}.'
    return jnp.minimum(a, b)


def causal_segment_mask(segment_ids, dtype=jnp.float32, causal_attention_mask=None):
    segment_mask_t = segment_mask(segment_ids, dtype=dtype)
    b, t = segment_ids.shape
    causal_mask_t = causal_mask(jnp.zeros([b, t, 1], dtype=dtype))
    if causal_attention_mask is not None:
        causal_mask_t *= causal_attention_mask[:, jnp.newaxis, jnp.newaxis, :]
    return merge_masks(segment_mask_t, causal_mask_t)


def convert_paddings_to_mask(paddings, dtype=jnp.float32):
    attention_mask = paddings[:, jnp.newaxis, jnp.newaxis, :]
    attention_mask *= get_large_negative_number(dtype)
    return attention_mask


# -- the programs ---------------------------------------------------------------------------------
def group_norm_program(gamma, beta, inputs, paddings):
    """Cumulative GroupNorm (streaming statistics along time) of (1, T, 8) with paddings."""
    return group_norm(gamma, beta, inputs, paddings)


def _group_norm_example(n, rng):
    pad = np.zeros((1, n), np.float32)
    if n > 2:
        pad[0, -2:] = 1.0
    r0 = np.random.default_rng(3)
    return (0.1 * normal(r0, 1, 1, 8), 0.1 * normal(r0, 1, 1, 8), normal(rng, 1, n, 8), pad)


def attention_program(q, k, v, segment_ids, paddings):
    """Dot-product attention under a causal + segment + paddings + limited-context mask."""
    t = q.shape[1]
    mask = causal_segment_mask(segment_ids, jnp.float32)
    mask = jnp.minimum(mask, convert_paddings_to_mask(paddings, jnp.float32))
    mask = jnp.minimum(mask, limited_context_mask(3, None, t)[None, None])
    logits = jnp.einsum("btd,bsd->bts", q, k)[:, None] / np.sqrt(q.shape[-1])
    probs = jax.nn.softmax((logits + mask).astype(jnp.float32), axis=-1)
    return jnp.einsum("bhts,bsd->bhtd", probs, v)


def _attention_example(n, rng):
    seg = np.zeros((1, n), np.int32)
    i, s = 0, 1
    while i < n:
        length = int(rng.integers(1, 4))
        seg[0, i:i + length] = s
        i, s = i + length, s + 1
    pad = np.zeros((1, n), np.float32)
    if n > 3:
        pad[0, -1] = 1.0
    return (normal(rng, 1, n, 4), normal(rng, 1, n, 4), normal(rng, 1, n, 4), seg, pad)


PROGRAMS = [
    program(name="praxis_groupnorm_cumulative",
            source=SRC + "normalizations.py GroupNorm(cumulative=True), compute_moments",
            license="Apache-2.0", fun=group_norm_program, in_specs=(None, None, "1, t, 8", "1, t"),
            make_example=_group_norm_example, bound=8),
    program(name="praxis_segment_causal_limited_attention",
            source=SRC + "attentions.py causal_segment_mask, convert_paddings_to_mask, "
                         "limited_context_mask",
            license="Apache-2.0", fun=attention_program, in_specs=("1, t, 4",) * 3 + ("1, t",) * 2,
            make_example=_attention_example, bound=8),
]
