"""Programs from levanter and ColabDesign that outside testing (session 60)
found refused or crashing: an FFT convolution with lengths computed from the
sequence length, ProteinMPNN's nearest-neighbour featuriser with k a size,
and a sequence-entropy loss slicing by a negative size before a scatter.

Sources (bodies verbatim; haliax named axes written as jnp axes):
- levanter https://github.com/stanford-crfm/levanter (commit 9263f81)
  src/levanter/models/hyena.py fft_conv. License: Apache-2.0, Copyright
  the Board of Trustees of the Leland Stanford Junior University.
- ColabDesign https://github.com/sokrypton/ColabDesign mpnn/modules.py
  ProteinFeatures._get_edge_idx (top_k of the distance matrix, k = min(top_k,
  L)), af/loss.py get_seq_ent_loss with opt["fix_pos"]. License: MIT,
  Copyright (c) 2022 Sergey Ovchinnikov.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .corpus import normal, program

LEVANTER = "levanter https://github.com/stanford-crfm/levanter/blob/9263f81/src/levanter/models/"
COLAB = "ColabDesign https://github.com/sokrypton/ColabDesign/blob/main/colabdesign/"


def fft_conv(u, k):
    """JAX implementation of FFT convolution (levanter's Hyena operator)."""
    seqlen = u.shape[-2]
    fft_size = 2 * seqlen
    u_f = jnp.fft.rfft(jnp.astype(u, jnp.float32), n=fft_size, axis=-2)
    k_f = jnp.fft.rfft(jnp.astype(k, jnp.float32), n=fft_size, axis=-2) / fft_size
    y_f = u_f * k_f
    y = jnp.fft.irfft(y_f, n=fft_size, axis=-2)[..., :seqlen, :]
    return jnp.astype(y, u.dtype)


def _fft_conv_example(n, rng):
    return normal(rng, n, 3), normal(rng, n, 3)


def get_edge_idx(X, mask, top_k=6, eps=1e-6):
    """ProteinMPNN's k nearest residues (CA coordinates X (L, 3)): distances
    with masked pairs pushed past the maximum, then the k smallest."""
    mask_2D = mask[..., None, :] * mask[..., :, None]
    dX = X[..., None, :, :] - X[..., :, None, :]
    D = jnp.sqrt(jnp.square(dX).sum(-1) + eps)
    D_masked = jnp.where(mask_2D, D, D.max(-1, keepdims=True))
    k = min(top_k, X.shape[-2])
    return jax.lax.approx_min_k(D_masked, k, reduction_dimension=-1)[1]


def _edge_example(n, rng):
    return normal(rng, n, 3, scale=3.0), (rng.random(n) < 0.9).astype(np.float32)


def get_seq_ent_loss(logits, seq_mask):
    """Sequence entropy of the designed positions, fixed positions 0 and 5 left out."""
    x = logits
    ent = -(jax.nn.softmax(x) * jax.nn.log_softmax(x)).sum(-1)
    mask = seq_mask[-x.shape[1]:]
    mask = mask.at[jnp.array([0, 5])].set(0)
    return ((ent * mask).sum() / (mask.sum() + 1e-8)).mean()


def _seq_ent_example(n, rng):
    return normal(rng, 1, n, 20), np.ones(n, np.float32)


PROGRAMS = [
    program(name="levanter_hyena_fft_conv", source=LEVANTER + "hyena.py fft_conv",
            license="Apache-2.0", fun=fft_conv, in_specs=("t, 3", "t, 3"),
            make_example=_fft_conv_example, bound=40, sizes=(1, 2, 7, 40),
            note="rfft(u, n=2 * T): a length computed from the size (T = 0: plain "
                 "JAX's Shape should be positive)"),
    program(name="colabdesign_mpnn_edge_idx", source=COLAB + "mpnn/modules.py _get_edge_idx",
            license="MIT", fun=get_edge_idx, in_specs=("l, 3", "l"),
            make_example=_edge_example, bound=10, modes=("eager", "jit", "vmap", "pmjit"),
            note="approx_min_k with k = min(6, L); integer output (no gradient)"),
    program(name="colabdesign_seq_ent_loss", source=COLAB + "af/loss.py get_seq_ent_loss",
            license="MIT", fun=get_seq_ent_loss, in_specs=("1, l, 20", "l"),
            make_example=_seq_ent_example, bound=8, sizes=(1, 3, 8),
            note="seq_mask[-L:] then .at[fix_pos].set(0): jax.grad under jit"),
]
