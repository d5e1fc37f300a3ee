"""SigLIP and contrastive losses and the MAP head from big_vision.

Source: https://github.com/google-research/big_vision (commit 0127fb6),
big_vision/trainers/proj/image_text/siglip.py (loss_fn's sigmoid loss),
big_vision/utils.py (bidirectional_contrastive_loss) and
big_vision/models/vit.py (MlpBlock, MAPHead).
License: Apache-2.0, Copyright 2024 Big Vision Authors.
Copied: the loss bodies as functions of the two embedding matrices (n image /
text pairs); MAPHead and MlpBlock verbatim (flax.linen), pooling a sequence of
n tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from .corpus import flat, normal, params, program

SRC = "big_vision https://github.com/google-research/big_vision/blob/0127fb6/big_vision/"


# -- trainers/proj/image_text/siglip.py loss_fn; utils.py bidirectional_contrastive_loss ----------
def siglip_loss(zimg, ztxt, t, b):
    logits = jnp.dot(zimg, ztxt.T)
    logits = logits * t + b
    eye = jnp.eye(zimg.shape[0])
    m1_diag1 = -jnp.ones_like(logits) + 2 * eye
    loglik = jax.nn.log_sigmoid(m1_diag1 * logits)
    nll = -jnp.sum(loglik, axis=-1)
    l = jnp.mean(nll)
    return l


def bidirectional_contrastive_loss(zimg, ztxt, t, mask=None, reduction=False):
    logits = jnp.dot(zimg, ztxt.T) * t
    if mask is not None:
        exclude = jnp.logical_not(mask)
        exclude = jnp.logical_or(exclude[:, None], exclude[None, :])
        logits = jnp.where(exclude, -jnp.inf, logits)
    l1 = -jnp.diag(jax.nn.log_softmax(logits, axis=1))
    l2 = -jnp.diag(jax.nn.log_softmax(logits, axis=0))
    l = 0.5 * (l1 + l2)
    if mask is not None:
        l = jnp.where(mask, l, 0)
    redux = jnp.mean if reduction else lambda x: x
    if reduction and mask is not None:
        redux = lambda x: jnp.sum(x * mask) / (jnp.sum(mask) + 1e-8)
    return redux(l), {
        "ncorrect": redux(jnp.argmax(logits, axis=1) == jnp.arange(len(logits))),
    }


# -- models/vit.py --------------------------------------------------------------------------------
class MlpBlock(nn.Module):
    """Transformer MLP / feed-forward block."""
    mlp_dim: int | None = None  # Defaults to 4x input dim
    dropout: float = 0.0
    dtype_mm: str = "float32"

    @nn.compact
    def __call__(self, x, deterministic=True):
        """Applies Transformer MlpBlock module."""
        inits = dict(
            kernel_init=nn.initializers.xavier_uniform(),
            bias_init=nn.initializers.normal(stddev=1e-6),
        )

        d = x.shape[-1]
        x = nn.Dense(self.mlp_dim or 4 * d, dtype=self.dtype_mm, **inits)(x)
        x = nn.with_logical_constraint(x, ("act_batch", "act_len", "act_emb"))
        x = nn.gelu(x)
        x = nn.Dropout(rate=self.dropout)(x, deterministic)
        x = nn.Dense(d, dtype=self.dtype_mm, **inits)(x)
        return x


class MAPHead(nn.Module):
    """Multihead Attention Pooling."""
    mlp_dim: int | None = None  # Defaults to 4x input dim
    num_heads: int = 12

    @nn.compact
    def __call__(self, x):
        n, l, d = x.shape  # pylint: disable=unused-variable
        probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, d), x.dtype)
        probe = jnp.tile(probe, [n, 1, 1])

        x = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            kernel_init=nn.initializers.xavier_uniform())(probe, x)

        y = nn.LayerNorm()(x)
        x = x + MlpBlock(mlp_dim=self.mlp_dim)(y)
        return x[:, 0]


# -- the programs ---------------------------------------------------------------------------------
def siglip_program(t, b, zimg, ztxt):
    """SigLIP's pairwise sigmoid loss over n image / text pairs (temperature t, bias b)."""
    return siglip_loss(zimg, ztxt, t, b)


def contrastive_program(t, zimg, ztxt, mask):
    """CLIP's bidirectional softmax loss with a mask of valid pairs, and the correct count."""
    loss, extra = bidirectional_contrastive_loss(zimg, ztxt, t, mask=mask, reduction=True)
    return loss, extra["ncorrect"]


def _pair(n, rng):
    z1, z2 = normal(rng, n, 8), normal(rng, n, 8)
    z1 /= np.linalg.norm(z1, axis=-1, keepdims=True) + 1e-6
    z2 /= np.linalg.norm(z2, axis=-1, keepdims=True) + 1e-6
    return z1.astype(np.float32), z2.astype(np.float32)


def _siglip_example(n, rng):
    return (np.float32(10.0), np.float32(-10.0)) + _pair(n, rng)


def _contrastive_example(n, rng):
    mask = (rng.random(n) < 0.75).astype(np.float32)
    if n:
        mask[0] = 1.0
    return (np.float32(5.0),) + _pair(n, rng) + (mask,)


MAP = MAPHead(mlp_dim=16, num_heads=2)


def _map_init(rng):
    return flat(MAP.init(jax.random.PRNGKey(0), jnp.zeros((1, 3, 8)))["params"])


def _map_leaves():
    return params(11, _map_init)[0]


def map_head_program(*args):
    """MAPHead pooling 2 sequences of n tokens (a probe attends over them)."""
    leaves, x = args[:-1], args[-1]
    return MAP.apply({"params": params(11, _map_init)[1](leaves)}, x)


PROGRAMS = [
    program(name="bigvision_siglip_loss",
            source=SRC + "trainers/proj/image_text/siglip.py loss_fn (sigmoid loss)",
            license="Apache-2.0", fun=siglip_program, in_specs=(None, None, "n, 8", "n, 8"),
            make_example=_siglip_example, bound=8),
    program(name="bigvision_bidirectional_contrastive_masked",
            source=SRC + "utils.py bidirectional_contrastive_loss(mask=..., reduction=True)",
            license="Apache-2.0", fun=contrastive_program, in_specs=(None, "n, 8", "n, 8", "n"),
            make_example=_contrastive_example, bound=8),
    program(name="bigvision_map_head", source=SRC + "models/vit.py MAPHead, MlpBlock",
            license="Apache-2.0", fun=map_head_program,
            in_specs=lambda: (None,) * len(_map_leaves()) + ("2, l, 8",),
            make_example=lambda n, rng: tuple(_map_leaves()) + (normal(rng, 2, n, 8),), bound=8),
]
