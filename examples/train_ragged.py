"""Train a small flax Transformer with optax on ragged sequences.

Each step takes a batch of sequences of different lengths and calls
``polymask.value_and_grad``: one plain scalar loss (the mean over the batch's
*logical* tokens) and the gradients. By default the sequences are *packed*
end to end into rows of 64 tokens with segment ids (``layout="packed"``):
one compiled program for the whole run and no bucket padding; attention
stays within each sequence and positions restart per sequence although the
model code is plain flax, written for one sequence: no masks, no lengths.
``--layout padded`` pads each batch to a power-of-two bucket instead (one
program per bucket).

Task: continue an arithmetic sequence mod VOCAB (``t[i+1] = t[i] + step``);
the step is only visible from the tokens, so the model must attend.

Install: pip install -e ".[examples]"   (flax, optax, matplotlib)
Run: python examples/train_ragged.py [--steps 150] [--layout packed|padded] [--out train_ragged.png]
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import polymask as pm

VOCAB, DIM, MAX_LEN = 16, 32, 24


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):  # (n,) int32 -> (n, VOCAB) logits
        x = nn.Embed(VOCAB, DIM)(tokens) + nn.Embed(MAX_LEN, DIM)(jnp.arange(tokens.shape[0]))
        mask = nn.make_causal_mask(tokens)
        for _ in range(2):
            x = x + nn.MultiHeadDotProductAttention(num_heads=4)(nn.LayerNorm()(x), mask=mask)
            x = x + nn.Dense(DIM)(nn.gelu(nn.Dense(4 * DIM)(nn.LayerNorm()(x))))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def make_batch(rng, batch_size):
    tokens, labels = [], []
    for _ in range(batch_size):
        n = int(rng.integers(2, MAX_LEN))
        seq = (rng.integers(0, VOCAB) + rng.integers(1, 4) * np.arange(n + 1)) % VOCAB
        tokens.append(seq[:-1].astype(np.int32))
        labels.append(seq[1:].astype(np.int32))
    return tokens, labels


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--layout", choices=("packed", "padded"), default="packed")
    ap.add_argument("--out", default="train_ragged.png", help="loss curve PNG ('' = none)")
    args = ap.parse_args(argv)

    model = TinyLM()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(4, jnp.int32))

    def token_loss(params, tokens, labels):  # written for one exact sequence
        logits = model.apply(params, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # (n,)

    if args.layout == "packed":  # rows of 64 tokens (MAX_LEN = 24 fits), 2 rows per call
        loss_and_grad = pm.value_and_grad(token_loss, {"tokens": "n", "labels": "n"},
                                          layout="packed", row_size=64, rows_per_call=2)
    else:
        loss_and_grad = pm.value_and_grad(token_loss, {"tokens": "n", "labels": "n"},
                                          buckets=pm.buckets.pow2(8))
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def apply_updates(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(0)
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        tokens, labels = make_batch(rng, args.batch_size)
        loss, grads = loss_and_grad(params, tokens, labels)
        params, state = apply_updates(params, state, grads)
        losses.append(float(loss))
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}  "
                  f"compiles {loss_and_grad.compiles}  {time.perf_counter() - t0:.1f}s")

    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(losses)
        ax.set_xlabel("step")
        ax.set_ylabel("mean token cross-entropy")
        n = loss_and_grad.compiles
        ax.set_title(f"ragged training ({args.layout}), {n} compiled program{'s' * (n != 1)}")
        fig.tight_layout()
        fig.savefig(args.out, dpi=100)
        print(f"loss curve: {args.out}")
    return losses


if __name__ == "__main__":
    main()
