"""nanoGPT: the GPT forward pass and its training loss on a sequence of n tokens.

Source: https://github.com/karpathy/nanoGPT (MIT, Copyright (c) 2022 Andrej
Karpathy), model.py: CausalSelfAttention (slow path: ``att.masked_fill(
self.bias[:, :, :T, :T] == 0, -inf)``, softmax, ``y = att @ v``), MLP (GELU),
Block (pre-LN), GPT.forward (``pos = arange(0, t)``, wte + wpe, ln_f, lm_head
tied to wte, cross entropy over the targets). Written in JAX with a
parameter dict (as the nanoGPT JAX ports do); one sequence, no batch axis.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .corpus import flat, params, program

SRC = "nanoGPT https://github.com/karpathy/nanoGPT/blob/master/model.py"
V, C, H, BLOCK = 11, 16, 2, 16


def layer_norm(x, w, b, eps=1e-5):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.var(x, -1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * w + b


def causal_self_attention(x, p):
    T, Cx = x.shape
    q, k, v = jnp.split(x @ p["c_attn_w"] + p["c_attn_b"], 3, axis=1)
    k = k.reshape(T, H, Cx // H).transpose(1, 0, 2)
    q = q.reshape(T, H, Cx // H).transpose(1, 0, 2)
    v = v.reshape(T, H, Cx // H).transpose(1, 0, 2)
    att = (q @ k.transpose(0, 2, 1)) * (1.0 / np.sqrt(k.shape[-1]))
    bias = jnp.tril(jnp.ones((BLOCK, BLOCK)))[None]
    att = jnp.where(bias[:, :T, :T] == 0, -jnp.inf, att)
    att = jax.nn.softmax(att, axis=-1)
    y = att @ v
    y = y.transpose(1, 0, 2).reshape(T, Cx)
    return y @ p["c_proj_w"] + p["c_proj_b"]


def block(x, p):
    x = x + causal_self_attention(layer_norm(x, p["ln_1_w"], p["ln_1_b"]), p)
    h = jax.nn.gelu(layer_norm(x, p["ln_2_w"], p["ln_2_b"]) @ p["fc_w"] + p["fc_b"],
                    approximate=False)
    return x + h @ p["mlp_proj_w"] + p["mlp_proj_b"]


def gpt_loss(idx, targets, *leaves):
    p = params(80, _init)[1](leaves)
    t = idx.shape[0]
    assert t <= BLOCK, f"Cannot forward sequence of length {t}, block size is only {BLOCK}"
    pos = jnp.arange(0, t, dtype=jnp.int32)
    tok_emb = p["wte"][idx]
    pos_emb = p["wpe"][pos]
    x = tok_emb + pos_emb
    for bp in p["blocks"]:
        x = block(x, bp)
    x = layer_norm(x, p["ln_f_w"], p["ln_f_b"])
    logits = x @ p["wte"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    loss = -jnp.mean(jnp.take_along_axis(logp, targets[:, None], axis=-1))
    return logits, loss


def _init(rng):
    def lin(i, o):
        return (rng.normal(size=(i, o)) * 0.02).astype(np.float32), np.zeros(o, np.float32)

    def blk():
        aw, ab = lin(C, 3 * C)
        pw, pb = lin(C, C)
        fw, fb = lin(C, 4 * C)
        mw, mb = lin(4 * C, C)
        one, zero = np.ones(C, np.float32), np.zeros(C, np.float32)
        return dict(ln_1_w=one, ln_1_b=zero, c_attn_w=aw, c_attn_b=ab, c_proj_w=pw,
                    c_proj_b=pb, ln_2_w=one, ln_2_b=zero, fc_w=fw, fc_b=fb, mlp_proj_w=mw,
                    mlp_proj_b=mb)

    tree = dict(wte=(rng.normal(size=(V, C)) * 0.02).astype(np.float32),
                wpe=(rng.normal(size=(BLOCK, C)) * 0.02).astype(np.float32),
                blocks=[blk(), blk()], ln_f_w=np.ones(C, np.float32),
                ln_f_b=np.zeros(C, np.float32))
    return flat(tree)


def _example(n, rng):
    tokens = rng.integers(0, V, n + 1).astype(np.int32)
    return (tokens[:-1], tokens[1:]) + params(80, _init)[0]


PROGRAMS = [
    program(name="nanogpt_forward_loss", source=SRC + " GPT.forward", license="MIT",
            fun=gpt_loss, in_specs=lambda: ("t", "t") + (None,) * len(params(80, _init)[0]),
            make_example=_example, bound=16, sizes=(0, 1, 9, 16)),
]
