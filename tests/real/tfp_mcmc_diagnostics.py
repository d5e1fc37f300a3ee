"""MCMC diagnostics and quantiles from TensorFlow Probability, as its JAX
substrate runs them.

Source: https://github.com/tensorflow/probability (main branch, 2026),
tensorflow_probability/python/stats/sample_stats.py (auto_correlation),
tensorflow_probability/python/mcmc/diagnostic.py
(_effective_sample_size_single_state with cross_chain_dims and
filter_beyond_positive_pairs, _potential_scale_reduction_single_state with
split_chains, _reduce_variance) and tensorflow_probability/python/stats/quantiles.py
(percentile, quantiles, _sort_tensor).
License: Apache-2.0, Copyright 2018 The TensorFlow Probability Authors.
Copied: ``tf.*`` calls written as the ``jnp`` calls of TFP's JAX substrate
(``tfp.substrates.jax``), ``prefer_static`` on static shapes as NumPy / Python
numbers; only the code paths these programs take (one state, axis 0). n
samples (per chain).
"""

import jax
import jax.numpy as jnp
import numpy as np

from .corpus import normal, program

SRC = "tensorflow_probability https://github.com/tensorflow/probability/blob/main/tensorflow_probability/python/"


# -- python/stats/sample_stats.py auto_correlation; python/mcmc/diagnostic.py ---------------------
def tfp_auto_correlation(x, axis=-1, max_lags=None, center=True, normalize=True):
    rank = x.ndim
    if axis < 0:
        axis = rank + axis
    shift = rank - 1 - axis
    x_rotated = jnp.moveaxis(x, axis, -1) if shift else x  # rotate_transpose
    if center:
        x_rotated = x_rotated - jnp.mean(x_rotated, axis=-1, keepdims=True)
    x_len = x_rotated.shape[-1]
    x_len_float64 = np.float64(x_len)
    target_length = np.power(np.float64(2.), np.ceil(np.log(x_len_float64 * 2) / np.log(2.)))
    pad_length = np.int32(target_length - x_len_float64)
    x_rotated_pad = jnp.pad(x_rotated, [(0, 0)] * (x_rotated.ndim - 1) + [(0, int(pad_length))])
    dtype = x.dtype
    x_rotated_pad = jax.lax.complex(x_rotated_pad, jnp.zeros_like(x_rotated_pad))
    fft_x_rotated_pad = jnp.fft.fft(x_rotated_pad)
    spectral_density = fft_x_rotated_pad * jnp.conj(fft_x_rotated_pad)
    shifted_product = jnp.fft.ifft(spectral_density)
    shifted_product = jnp.real(shifted_product).astype(dtype)
    if max_lags is None:
        max_lags = x_len - 1
    else:
        max_lags = min(x_len - 1, max_lags)
    shifted_product_chopped = shifted_product[..., :max_lags + 1]
    # tf.cast of the static ints: prefer_static keeps them Python numbers
    denominator = x_len - jnp.arange(0., max_lags + 1.)
    denominator = denominator.astype(dtype)
    shifted_product_rotated = shifted_product_chopped / denominator
    if normalize:
        shifted_product_rotated /= shifted_product_rotated[..., :1]
    return jnp.moveaxis(shifted_product_rotated, -1, axis) if shift else shifted_product_rotated


def _reduce_variance(x, axis=None, biased=True, keepdims=False):
    axis = tuple(np.atleast_1d(axis).tolist()) if axis is not None else None
    if biased:
        return jnp.var(x, axis=axis, keepdims=keepdims)
    n = np.prod([x.shape[a] for a in axis]) if axis is not None else x.size
    return jnp.var(x, axis=axis, keepdims=keepdims) * n / (n - 1.)


def tfp_effective_sample_size_single_state(states, filter_beyond_lag=None, filter_threshold=0.,
                                           filter_beyond_positive_pairs=True,
                                           cross_chain_dims=1):
    dt = states.dtype
    auto_cov = tfp_auto_correlation(states, axis=0, max_lags=filter_beyond_lag, normalize=False)
    n = states.shape[0]
    if cross_chain_dims is not None:
        num_chains = states.shape[cross_chain_dims]
        if num_chains < 2:
            raise ValueError('When `cross_chain_dims` is not `None`, there must be > 1 chain.')
        cross_chain_dims = np.array(cross_chain_dims)
        between_chain_variance_div_n = _reduce_variance(
            jnp.mean(states, axis=0), biased=False, axis=cross_chain_dims - 1)
        biased_within_chain_variance = jnp.mean(auto_cov[0], int(cross_chain_dims - 1))
        approx_variance = biased_within_chain_variance + between_chain_variance_div_n
        mean_auto_cov = jnp.mean(auto_cov, int(cross_chain_dims))
        auto_corr = 1. - (biased_within_chain_variance - mean_auto_cov) / approx_variance
    else:
        auto_corr = auto_cov / auto_cov[:1]
        num_chains = 1
    k = jnp.arange(0., auto_corr.shape[0])
    nk_factor = (n - k) / n
    new_shape = [-1] + [1] * (auto_corr.ndim - 1)
    nk_factor = jnp.reshape(nk_factor, new_shape)
    weighted_auto_corr = nk_factor * auto_corr
    if filter_beyond_positive_pairs:
        def _sum_pairs(x):
            x_len = x.shape[0]
            x = x[:x_len - x_len % 2]
            new_shape = [x_len // 2, 2] + list(x.shape[1:])
            return jnp.sum(jnp.reshape(x, new_shape), 1)

        mask = _sum_pairs(auto_corr) < 0.
        mask = mask.astype(dt)
        mask = jnp.cumsum(mask, axis=0)
        mask = jnp.maximum(1. - mask, 0.)
        weighted_auto_corr = _sum_pairs(weighted_auto_corr) * mask
    return num_chains * n / (-1 + 2 * jnp.sum(weighted_auto_corr, axis=0))


def tfp_potential_scale_reduction_single_state(state, independent_chain_ndims=1,
                                               split_chains=True):
    n_samples_ = state.shape[0]
    if n_samples_ is not None:
        if split_chains and n_samples_ < 4:
            raise ValueError('Must provide at least 4 samples when splitting chains. '
                             f'Found {n_samples_}')
        if not split_chains and n_samples_ < 2:
            raise ValueError(f'Must provide at least 2 samples.  Found {n_samples_}')
    sample_ndims = 1
    if split_chains:
        state_shape = state.shape
        n_samples = state_shape[0]
        state = state[:n_samples - n_samples % 2]
        state = jnp.reshape(state, [2, n_samples // 2] + list(state_shape[1:]))
        state = jnp.transpose(state, [1, 0] + list(range(2, state.ndim)))
        independent_chain_ndims += 1
    sample_axis = np.arange(0, sample_ndims)
    chain_axis = np.arange(sample_ndims, sample_ndims + independent_chain_ndims)
    sample_and_chain_axis = np.arange(0, sample_ndims + independent_chain_ndims)
    n = np.prod([state.shape[a] for a in sample_axis])    # _axis_size
    m = np.prod([state.shape[a] for a in chain_axis])
    b_div_n = _reduce_variance(jnp.mean(state, axis=tuple(sample_axis), keepdims=True),
                               sample_and_chain_axis, biased=False)
    w = jnp.mean(_reduce_variance(state, sample_axis, keepdims=True, biased=False),
                 axis=tuple(sample_and_chain_axis))
    sigma_2_plus = ((n - 1) / n) * w + b_div_n
    return ((m + 1.) / m) * sigma_2_plus / w - (n - 1.) / (m * n)


# -- python/stats/quantiles.py ---------------------------------------------------------------------
def _sort_tensor(tensor):
    sorted_, _ = jax.lax.top_k(tensor, k=tensor.shape[-1])
    return sorted_


def tfp_percentile(x, q, axis, interpolation="nearest", preserve_gradients=True):
    q = jnp.asarray(q, jnp.float64)
    y = jnp.moveaxis(x, axis, -1)                         # _move_dims_to_flat_end, 1 axis
    frac_at_q_or_above = 1. - q / 100.
    sorted_y = _sort_tensor(y)
    d = jnp.asarray(y.shape[-1], jnp.float64)

    def _get_indices(interp_type):
        if interp_type == 'lower':
            indices = jnp.ceil((d - 1) * frac_at_q_or_above)
        elif interp_type == 'higher':
            indices = jnp.floor((d - 1) * frac_at_q_or_above)
        elif interp_type == 'nearest':
            indices = jnp.round((d - 1) * frac_at_q_or_above)
        return jnp.clip(indices.astype(jnp.int32), 0, y.shape[-1] - 1)

    if interpolation in ['nearest', 'lower', 'higher']:
        gathered_y = jnp.take(sorted_y, _get_indices(interpolation), axis=-1)
    elif interpolation == 'midpoint':
        gathered_y = 0.5 * (jnp.take(sorted_y, _get_indices('lower'), axis=-1) +
                            jnp.take(sorted_y, _get_indices('higher'), axis=-1))
    elif interpolation == 'linear':
        larger_y_idx = _get_indices('lower')
        exact_idx = (d - 1) * frac_at_q_or_above
        if preserve_gradients:
            smaller_y_idx = jnp.maximum(larger_y_idx - 1, 0)
            larger_y_idx = jnp.minimum(smaller_y_idx + 1, y.shape[-1] - 1)
            fraction = larger_y_idx.astype(jnp.float64) - exact_idx
        else:
            smaller_y_idx = _get_indices('higher')
            fraction = jnp.ceil((d - 1) * frac_at_q_or_above) - exact_idx
        fraction = fraction.astype(y.dtype)
        gathered_y = (jnp.take(sorted_y, larger_y_idx, axis=-1) * (1 - fraction) +
                      jnp.take(sorted_y, smaller_y_idx, axis=-1) * fraction)
    nan_batch_members = jnp.any(jnp.isnan(x), axis=axis)
    nan_batch_members = jnp.reshape(nan_batch_members, nan_batch_members.shape + (1,) * q.ndim)
    gathered_y = jnp.where(jnp.broadcast_to(nan_batch_members, gathered_y.shape),
                           jnp.full(gathered_y.shape, np.nan, gathered_y.dtype), gathered_y)
    return jnp.moveaxis(gathered_y, -1, 0) if q.ndim else gathered_y   # rotate_transpose


def tfp_quantiles(x, num_quantiles, axis=None, interpolation=None):
    return tfp_percentile(x, q=jnp.linspace(jnp.asarray(0, jnp.float64), jnp.asarray(100, jnp.float64),
                                            num=num_quantiles + 1),
                          axis=axis, interpolation=interpolation, preserve_gradients=False)


# -- the programs ---------------------------------------------------------------------------------
def _chains_example(chains):
    def example(n, rng):
        x = np.zeros((n, chains), np.float32)
        for i in range(n):  # AR(1) chains
            x[i] = (0.7 * x[i - 1] if i else 0) + rng.normal(size=chains)
        return (x.astype(np.float32),)
    return example


def ess_program(states):
    """Cross-chain effective sample size of n samples of 3 chains (FFT autocorrelation)."""
    return tfp_effective_sample_size_single_state(states)


def rhat_program(states):
    """Split-chain potential scale reduction (R-hat) of n samples of 4 chains."""
    return tfp_potential_scale_reduction_single_state(states)


def quantiles_program(x):
    """Quartiles (linear and nearest) and the 30th percentile (midpoint) of n samples."""
    return (tfp_quantiles(x, 4, axis=0, interpolation="linear"),
            tfp_quantiles(x, 4, axis=0, interpolation="nearest"),
            tfp_percentile(x, 30., axis=0, interpolation="midpoint"))


PROGRAMS = [
    program(name="tfp_effective_sample_size_cross_chain",
            source=SRC + "mcmc/diagnostic.py effective_sample_size(cross_chain_dims=1, "
                         "filter_beyond_positive_pairs=True), stats/sample_stats.py "
                         "auto_correlation",
            license="Apache-2.0", fun=ess_program, in_specs=("n, 3",),
            make_example=_chains_example(3), bound=12, sizes=(0, 1, 2, 5, 7, 12),
            rtol=1e-3, atol=1e-3),
    program(name="tfp_potential_scale_reduction_split",
            source=SRC + "mcmc/diagnostic.py potential_scale_reduction(split_chains=True)",
            license="Apache-2.0", fun=rhat_program, in_specs=("n, 4",),
            make_example=_chains_example(4), bound=11, sizes=(0, 1, 3, 4, 5, 8, 11)),
    program(name="tfp_quantiles_top_k",
            source=SRC + "stats/quantiles.py quantiles, percentile (top_k(y, k=shape[-1]))",
            license="Apache-2.0", fun=quantiles_program, in_specs=("n, 3",),
            make_example=lambda n, rng: (normal(rng, n, 3),), bound=8),
]
