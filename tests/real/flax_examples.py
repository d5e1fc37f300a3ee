"""flax examples: the LSTM seq2seq model + its masked loss, an SST-2 style
bidirectional LSTM classifier and an nnx Transformer block.

Sources (Apache-2.0, Copyright The Flax Authors):
- https://github.com/google/flax/blob/main/examples/seq2seq/models.py (Seq2seq,
  DecoderLSTMCell) and examples/seq2seq/train.py as of 2022
  (get_sequence_lengths, mask_sequences, cross_entropy_loss).
- https://github.com/google/flax/blob/main/examples/sst2/models.py (TextClassifier:
  Embed, bidirectional LSTM, pooled MLP head; here with flax's nn.Bidirectional).
- https://github.com/google/flax/blob/main/examples/nnx_toy_examples and the nnx
  Transformer docs (LayerNorm, MultiHeadAttention with a causal mask, MLP).
The models use the installed flax; parameters are flattened to a tuple of
arrays so that each program is a function of arrays.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from .corpus import flat, normal, params, program

SRC = "flax https://github.com/google/flax/blob/main/examples/"
V = 6  # seq2seq vocabulary; eos_id = 1


# -- seq2seq (examples/seq2seq/models.py) ----------------------------------------------------------
class DecoderLSTMCell(nn.RNNCellBase):
    features: int
    teacher_force: bool
    vocab_size: int

    @nn.compact
    def __call__(self, carry, x):
        lstm_state, last_prediction = carry
        if not self.teacher_force:
            x = last_prediction
        lstm_state, y = nn.LSTMCell(self.features)(lstm_state, x)
        logits = nn.Dense(features=self.vocab_size)(y)
        categorical_rng = self.make_rng("lstm")
        predicted_token = jax.random.categorical(categorical_rng, logits)
        prediction = jax.nn.one_hot(predicted_token, self.vocab_size, dtype=jnp.float32)
        return (lstm_state, prediction), (logits, prediction)

    @property
    def num_feature_axes(self) -> int:
        return 1


class Seq2seq(nn.Module):
    teacher_force: bool
    hidden_size: int
    vocab_size: int
    eos_id: int = 1

    @nn.compact
    def __call__(self, encoder_inputs, decoder_inputs):
        encoder = nn.RNN(nn.LSTMCell(self.hidden_size), return_carry=True, name="encoder")
        decoder = nn.RNN(DecoderLSTMCell(decoder_inputs.shape[-1], self.teacher_force,
                                         self.vocab_size),
                         split_rngs={"params": False, "lstm": True}, name="decoder")
        seq_lengths = self.get_seq_lengths(encoder_inputs)
        encoder_state, _ = encoder(encoder_inputs, seq_lengths=seq_lengths)
        logits, predictions = decoder(decoder_inputs[:, :-1],
                                      initial_carry=(encoder_state, decoder_inputs[:, 0]))
        return logits, predictions

    def get_seq_lengths(self, inputs):
        inputs = jnp.argmax(inputs, axis=-1)
        seq_lengths = jnp.argmax(inputs == self.eos_id, axis=-1)
        return seq_lengths


# examples/seq2seq/train.py (2022)
def get_sequence_lengths(sequence_batch, eos_id=1):
    eos_row = sequence_batch[:, :, eos_id]
    eos_idx = jnp.argmax(eos_row, axis=-1)
    return jnp.where(eos_row[jnp.arange(eos_row.shape[0]), eos_idx], eos_idx + 1,
                     sequence_batch.shape[1])


def mask_sequences(sequence_batch, lengths):
    return sequence_batch * (lengths[:, np.newaxis] > np.arange(sequence_batch.shape[1]))


def cross_entropy_loss(logits, labels, lengths):
    xe = jnp.sum(nn.log_softmax(logits) * labels, axis=-1)
    masked_xe = jnp.mean(mask_sequences(xe, lengths))
    return -masked_xe


SEQ2SEQ = Seq2seq(teacher_force=True, hidden_size=8, vocab_size=V)


def _one_hot_seq(rng, n, eos_at=None):
    tok = rng.integers(2, V, n)
    if eos_at is not None and 0 <= eos_at < n:
        tok[eos_at] = 1
    return np.eye(V, dtype=np.float32)[tok][None]


def _seq2seq_init(rng):
    ps = SEQ2SEQ.init({"params": jax.random.PRNGKey(0), "lstm": jax.random.PRNGKey(1)},
                      jnp.zeros((1, 3, V)), jnp.zeros((1, 3, V)))["params"]
    return flat(ps)


def seq2seq_loss(query, answer, key, *leaves):
    """The train step's loss: teacher-forced Seq2seq logits against answer[:, 1:]."""
    ps = params(10, _seq2seq_init)[1](leaves)
    logits, _ = SEQ2SEQ.apply({"params": ps}, query, answer, rngs={"lstm": key})
    labels = answer[:, 1:]
    return cross_entropy_loss(logits, labels, get_sequence_lengths(labels))


def _seq2seq_example(n, rng):
    key = np.asarray(jax.random.PRNGKey(3))
    return (_one_hot_seq(rng, n, eos_at=n - 2), _one_hot_seq(rng, n + 1, eos_at=n - 1), key) \
        + params(10, _seq2seq_init)[0]


# -- SST-2 classifier (examples/sst2/models.py, TextClassifier) -----------------------------------
class TextClassifier(nn.Module):
    vocab_size: int = 20
    embedding_size: int = 8
    hidden_size: int = 6
    output_size: int = 2

    @nn.compact
    def __call__(self, token_ids):
        embedded = nn.Embed(self.vocab_size, self.embedding_size)(token_ids)[None]
        lengths = jnp.full((1,), token_ids.shape[0])
        encoded = nn.Bidirectional(nn.RNN(nn.LSTMCell(self.hidden_size)),
                                   nn.RNN(nn.LSTMCell(self.hidden_size)))(
            embedded, seq_lengths=lengths)
        pooled = jnp.mean(encoded, axis=1)
        hidden = nn.tanh(nn.Dense(self.hidden_size)(pooled))
        return nn.Dense(self.output_size)(hidden)[0]


SST2 = TextClassifier()


@functools.cache
def _sst2_params():
    return flat(SST2.init(jax.random.PRNGKey(0), jnp.zeros(3, jnp.int32))["params"])


def sst2_program(token_ids, *leaves):
    return SST2.apply({"params": _sst2_params()[1](leaves)}, token_ids)


def _sst2_example(n, rng):
    return (rng.integers(0, 20, n).astype(np.int32),) + _sst2_params()[0]


# -- nnx Transformer block ------------------------------------------------------------------------
class Block(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False,
                                           rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
        self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(x[:, 0])
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


@functools.cache
def _nnx_block():
    graphdef, state = nnx.split(Block(8, 2, nnx.Rngs(0)))
    leaves, rebuild = flat(state)
    return graphdef, leaves, rebuild


def nnx_block_program(x, *leaves):
    graphdef, _, rebuild = _nnx_block()
    return nnx.merge(graphdef, rebuild(leaves))(x)


def _nnx_example(n, rng):
    return (normal(rng, n, 8),) + _nnx_block()[1]


PROGRAMS = [
    program(name="flax_seq2seq_lstm_loss",
            source=SRC + "seq2seq/models.py Seq2seq + train.py cross_entropy_loss",
            license="Apache-2.0", fun=seq2seq_loss,
            in_specs=lambda: ("1, n, 6", "1, m, 6", None)
            + (None,) * len(params(10, _seq2seq_init)[0]),
            make_example=_seq2seq_example, bound=6),
    program(name="flax_sst2_bilstm", source=SRC + "sst2/models.py TextClassifier",
            license="Apache-2.0", fun=sst2_program,
            in_specs=lambda: ("n",) + (None,) * len(_sst2_params()[0]),
            make_example=_sst2_example, bound=8),
    program(name="flax_nnx_transformer_block",
            source=SRC + "nnx_toy_examples (nnx.MultiHeadAttention block)",
            license="Apache-2.0", fun=nnx_block_program,
            in_specs=lambda: ("n, 8",) + (None,) * len(_nnx_block()[1]),
            make_example=_nnx_example, bound=8),
]
