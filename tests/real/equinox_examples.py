"""equinox examples: the GRU sequence classifier, a BERT-style attention block
and a 1-D CNN, built from the installed equinox.

Sources (Apache-2.0, Copyright Patrick Kidger):
- https://github.com/patrick-kidger/equinox/blob/main/docs/examples/train_rnn.ipynb
  (RNN: GRUCell scanned over the sequence, Linear head, sigmoid).
- https://github.com/patrick-kidger/equinox/blob/main/docs/examples/bert.ipynb
  (AttentionBlock: MultiheadAttention with make_self_attention_mask, LayerNorm, Dropout off).
- equinox.nn.Conv1d / MaxPool1d (https://docs.kidger.site/equinox/api/nn/conv/).
Each model's array leaves are flattened to a tuple (``eqx.partition``), so a
program is a function of arrays.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from .corpus import flat, normal, program

SRC = "equinox https://github.com/patrick-kidger/equinox/blob/main/"


class RNN(eqx.Module):
    hidden_size: int
    cell: eqx.Module
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, in_size, out_size, hidden_size, *, key):
        ckey, lkey = jax.random.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
        self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
        self.bias = jnp.zeros(out_size)

    def __call__(self, input):
        hidden = jnp.zeros((self.hidden_size,))

        def f(carry, inp):
            return self.cell(inp, carry), None

        out, _ = lax.scan(f, hidden, input)
        return jax.nn.sigmoid(self.linear(out) + self.bias)


class AttentionBlock(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    layernorm: eqx.nn.LayerNorm
    num_heads: int = eqx.field(static=True)

    def __init__(self, hidden_size, num_heads, key):
        self.num_heads = num_heads
        self.attention = eqx.nn.MultiheadAttention(num_heads=num_heads, query_size=hidden_size,
                                                   use_query_bias=True, use_key_bias=True,
                                                   use_value_bias=True, use_output_bias=True,
                                                   key=key)
        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)

    def __call__(self, inputs, mask=None):
        if mask is not None:
            mask = self.make_self_attention_mask(mask)
        attention_output = self.attention(query=inputs, key_=inputs, value=inputs, mask=mask)
        result = attention_output + inputs
        return jax.vmap(self.layernorm)(result)

    def make_self_attention_mask(self, mask):
        mask = jnp.multiply(jnp.expand_dims(mask, axis=-1), jnp.expand_dims(mask, axis=-2))
        mask = jnp.expand_dims(mask, axis=-3)
        mask = jnp.repeat(mask, repeats=self.num_heads, axis=-3)
        return mask.astype(jnp.float32)


class CNN1d(eqx.Module):
    conv: eqx.nn.Conv1d
    pool: eqx.nn.MaxPool1d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv1d(3, 8, kernel_size=3, padding=1, key=k1)
        self.pool = eqx.nn.MaxPool1d(kernel_size=2, stride=2)
        self.head = eqx.nn.Linear(8, 2, key=k2)

    def __call__(self, x):  # x: (3, length)
        h = self.pool(jax.nn.relu(self.conv(x)))
        return self.head(jnp.mean(h, axis=-1))


@functools.cache
def _split(kind):
    key = jax.random.PRNGKey(0)
    model = {"rnn": lambda: RNN(2, 1, 8, key=key),
             "attn": lambda: AttentionBlock(8, 2, key),
             "cnn": lambda: CNN1d(key)}[kind]()
    arrays, static = eqx.partition(model, eqx.is_array)
    leaves, rebuild = flat(arrays)
    return leaves, lambda ls: eqx.combine(rebuild(ls), static)


def rnn_program(x, *leaves):
    return _split("rnn")[1](leaves)(x)


def attention_program(x, mask, *leaves):
    return _split("attn")[1](leaves)(x, mask)


def cnn_program(x, *leaves):
    return _split("cnn")[1](leaves)(x)


def _ex(kind, make):
    return lambda n, rng: make(n, rng) + _split(kind)[0]


def _specs(first, kind):
    return lambda: first + (None,) * len(_split(kind)[0])


PROGRAMS = [
    program(name="equinox_gru_rnn", source=SRC + "docs/examples/train_rnn.ipynb RNN",
            license="Apache-2.0", fun=rnn_program, in_specs=_specs(("n, 2",), "rnn"),
            make_example=_ex("rnn", lambda n, rng: (normal(rng, n, 2),)), bound=8),
    program(name="equinox_bert_attention_block",
            source=SRC + "docs/examples/bert.ipynb AttentionBlock", license="Apache-2.0",
            fun=attention_program, in_specs=_specs(("n, 8", "n"), "attn"),
            make_example=_ex("attn", lambda n, rng: (normal(rng, n, 8),
                                                     (rng.random(n) < 0.8).astype("int32"))),
            bound=8),
    program(name="equinox_conv1d_maxpool", source=SRC + "equinox/nn/_conv.py, _pool.py",
            license="Apache-2.0", fun=cnn_program, in_specs=_specs(("3, n",), "cnn"),
            make_example=_ex("cnn", lambda n, rng: (normal(rng, 3, n),)), bound=9,
            sizes=(0, 1, 2, 5, 9)),
]
