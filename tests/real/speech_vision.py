"""A speech encoder (conv front-end + self-attention) on a variable number of
frames, and two vision models on variable image height / width.

Sources:
- Whisper encoder, https://github.com/sanchit-gandhi/whisper-jax (Apache-2.0,
  Copyright The HuggingFace Team), whisper_jax/modeling_flax_whisper.py
  FlaxWhisperEncoder: conv1 (k=3, pad 1) + gelu, conv2 (k=3, stride 2, pad 1)
  + gelu, ``embed_positions[:seq_len]`` sinusoidal table, pre-LN attention layer;
  here with a CTC output head.
- ResNet, https://github.com/google/flax/blob/main/examples/imagenet/models.py
  (Apache-2.0, The Flax Authors): ResNetBlock, BatchNorm in inference mode,
  stem conv + max_pool(3, 3, stride 2, SAME), one (strided) block, global
  average pool, Dense.
- ViT, https://github.com/google-research/big_vision (Apache-2.0, Google LLC),
  big_vision/models/vit.py: patch embedding (conv, kernel = stride = patch),
  posemb_sincos_2d (``jnp.mgrid[:h, :w]``), encoder block, "gap" head.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from .corpus import flat, normal, program


def sinusoids(length, channels, max_timescale=10000):
    log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = np.exp(-log_timescale_increment * np.arange(channels // 2))
    scaled_time = np.arange(length).reshape(-1, 1) * inv_timescales.reshape(1, -1)
    return np.concatenate([np.sin(scaled_time), np.cos(scaled_time)], axis=1).astype(np.float32)


class WhisperEncoder(nn.Module):
    d: int = 8
    vocab: int = 5
    max_source_positions: int = 32

    @nn.compact
    def __call__(self, input_features):  # (1, T, n_mels)
        h = jax.nn.gelu(nn.Conv(self.d, (3,), padding=[(1, 1)], name="conv1")(input_features),
                        approximate=False)
        h = jax.nn.gelu(nn.Conv(self.d, (3,), strides=(2,), padding=[(1, 1)],
                                name="conv2")(h), approximate=False)
        embed_positions = sinusoids(self.max_source_positions, self.d)
        h = h + embed_positions[: h.shape[1]]
        r = h
        h = nn.LayerNorm(name="self_attn_layer_norm")(h)
        h = nn.MultiHeadDotProductAttention(num_heads=2, name="self_attn")(h)
        h = r + h
        r = h
        h = nn.LayerNorm(name="final_layer_norm")(h)
        h = r + nn.Dense(self.d, name="fc2")(jax.nn.gelu(nn.Dense(2 * self.d, name="fc1")(h)))
        h = nn.LayerNorm(name="layer_norm")(h)
        return jax.nn.log_softmax(nn.Dense(self.vocab, name="ctc_head")(h))


class ResNetBlock(nn.Module):
    filters: int
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x):
        norm = functools.partial(nn.BatchNorm, use_running_average=True, momentum=0.9,
                                 epsilon=1e-5)
        residual = x
        y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
        y = norm()(y)
        y = nn.relu(y)
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = nn.Conv(self.filters, (1, 1), self.strides, use_bias=False,
                               name="conv_proj")(residual)
            residual = norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    num_classes: int = 4

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3), (2, 2), padding=[(1, 1), (1, 1)], use_bias=False,
                    name="conv_init")(x)
        x = nn.BatchNorm(use_running_average=True, name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        x = ResNetBlock(8, strides=(2, 2))(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


def posemb_sincos_2d(h, w, width, temperature=10_000., dtype=jnp.float32):
    y, x = jnp.mgrid[:h, :w]
    omega = jnp.arange(width // 4) / (width // 4 - 1)
    omega = 1. / (temperature ** omega)
    y = jnp.einsum("m,d->md", y.flatten(), omega)
    x = jnp.einsum("m,d->md", x.flatten(), omega)
    pe = jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)
    return jnp.asarray(pe, dtype)[None, :, :]


class ViT(nn.Module):
    patch: int = 4
    width: int = 16
    num_classes: int = 3

    @nn.compact
    def __call__(self, image):
        x = nn.Conv(self.width, (self.patch, self.patch), strides=(self.patch, self.patch),
                    padding="VALID", name="embedding")(image)
        n, h, w, c = x.shape
        x = jnp.reshape(x, [n, h * w, c])
        x = x + posemb_sincos_2d(h, w, c)
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(y)
        y = nn.LayerNorm()(x)
        x = x + nn.Dense(c)(nn.gelu(nn.Dense(2 * c)(y)))
        x = jnp.mean(x, axis=1)  # pool_type="gap"
        return nn.Dense(self.num_classes)(nn.LayerNorm()(x))


@functools.cache
def _model(kind):
    model, shape = {"whisper": (WhisperEncoder(), (1, 5, 8)), "resnet": (ResNet(), (1, 8, 8, 3)),
                    "vit": (ViT(), (1, 8, 8, 3))}[kind]
    variables = model.init(jax.random.PRNGKey(0), jnp.ones(shape))
    leaves, rebuild = flat(variables)
    return model, leaves, rebuild


def _fun(kind):
    def fun(x, *leaves):
        model, _, rebuild = _model(kind)
        return model.apply(rebuild(leaves), x)

    fun.__name__ = f"{kind}_apply"
    return fun


def _ex(kind, shape_of_n):
    return lambda n, rng: (normal(rng, *shape_of_n(n)),) + _model(kind)[1]


def _specs(first, kind):
    return lambda: (first,) + (None,) * len(_model(kind)[1])


PROGRAMS = [
    program(name="whisper_conv_attention_ctc",
            source="whisper-jax https://github.com/sanchit-gandhi/whisper-jax/blob/main/"
                   "whisper_jax/modeling_flax_whisper.py FlaxWhisperEncoder",
            license="Apache-2.0", fun=_fun("whisper"), in_specs=_specs("1, t, 8", "whisper"),
            make_example=_ex("whisper", lambda n: (1, n, 8)), bound=12, sizes=(0, 1, 7, 12),
            pmjit_sizes=(1, 7, 11)),
    program(name="flax_resnet_variable_image",
            source="flax https://github.com/google/flax/blob/main/examples/imagenet/models.py "
                   "ResNet", license="Apache-2.0", fun=_fun("resnet"),
            in_specs=_specs("1, h, w, 3", "resnet"),
            make_example=_ex("resnet", lambda n: (1, n, n + 3, 3)), bound=7,
            sizes=(0, 1, 4, 7)),
    program(name="bigvision_vit_variable_image",
            source="big_vision https://github.com/google-research/big_vision/blob/main/"
                   "big_vision/models/vit.py ViT + posemb_sincos_2d", license="Apache-2.0",
            fun=_fun("vit"), in_specs=_specs("1, h, w, 3", "vit"),
            make_example=_ex("vit", lambda n: (1, 4 * n, 4 * n + 4, 3)), bound=3,
            sizes=(0, 1, 2, 3), pmjit_sizes=(0, 1, 2, 3)),
]
