"""A BERT encoder in plain JAX, written for *exact, unpadded* token sequences.

There is no attention mask and no padding logic here: ``encode(params, ids)``
takes one sequence of ``n`` token ids and attends over all ``n`` positions.
``polymask.mask`` / ``polymask.jit`` / ``polymask.ragged_map`` supply the
masking, so the same function runs on padded buckets and ragged batches.

``embed`` adds sentence-transformers pooling (mean over tokens) and L2
normalisation, which is what all-MiniLM-L6-v2 ships as its modules 1 and 2.

Precision follows the parameters: with ``load_params(..., precision="bfloat16")``
the matmul weights and embedding tables are bfloat16, every matmul takes
bfloat16 operands and accumulates in float32 (``preferred_element_type``, the
hardware's bfloat16 path: AMX and AVX512-BF16 on CPUs, tensor cores, TPUs),
and everything that normalises or sums many terms (embedding sums, layer
norm, softmax, residual stream, pooling, L2 norm) stays float32 — the split
of ``torch.autocast`` and of mixed-precision training (Micikevicius et al.
2018, "Mixed Precision Training"). float32 parameters give the float32 model
unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat

__all__ = ["BertConfig", "PRECISIONS", "load_params", "encode", "embed", "mean_pool",
           "l2_normalize", "embed_padded_reference"]

#: Precisions ``load_params`` takes: the dtype of the matmul weights and operands.
PRECISIONS = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_json(cls, path) -> BertConfig:
        raw = json.loads(pathlib.Path(path).read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in raw.items() if k in names})
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        if cfg.hidden_act not in ("gelu", "gelu_new", "relu"):
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# ----------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------
def _concat_dense(parts: list[dict]) -> dict:
    """Query, key and value projections as one ``(hidden, 3 * hidden)`` matmul.

    One wide GEMM instead of three narrow ones (the fused-QKV layout of
    Megatron-LM and FlashAttention's ``Wqkv``).
    """
    return {"w": np.concatenate([p["w"] for p in parts], axis=1),
            "b": np.concatenate([p["b"] for p in parts])}


def load_params(path, cfg: BertConfig, precision: str = "float32") -> dict:
    """Read a Hugging Face ``BertModel`` ``model.safetensors`` into a params pytree.

    Args:
      path: the ``model.safetensors`` file.
      cfg: the model's configuration (layer count, ...).
      precision: ``"float32"`` (every tensor float32) or ``"bfloat16"``
        (matmul weights and embedding tables bfloat16; biases and layer-norm
        scales float32, as the computations that use them stay float32).

    Raises:
      ValueError: an unknown ``precision``.
      KeyError: a tensor the configuration needs is missing.
    """
    from safetensors.numpy import load_file

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    matmul_dtype = jnp.dtype(precision)
    raw = load_file(str(path))
    # Checkpoints are saved with or without the "bert." prefix.
    t = {k[5:] if k.startswith("bert.") else k: v for k, v in raw.items()}

    # the tensors are arranged in NumPy (ml_dtypes' bfloat16 rounds to nearest
    # even as XLA's convert does) and uploaded as they are: a transpose, cast or
    # concatenation of jax.Arrays is an XLA compile each, and so is
    # jnp.asarray of a NumPy array per shape from jax 0.12 (11 per process)
    def get(name, dtype=np.float32):
        if name not in t:
            raise KeyError(f"{path}: missing tensor '{name}'")
        return np.asarray(t[name]).astype(dtype, copy=False)

    def dense(prefix):  # torch Linear stores (out, in): transpose to x @ W
        return {"w": np.ascontiguousarray(get(prefix + ".weight").T.astype(matmul_dtype)),
                "b": get(prefix + ".bias")}

    def ln(prefix):
        return {"g": get(prefix + ".weight"), "b": get(prefix + ".bias")}

    params: dict[str, Any] = {
        "word": get("embeddings.word_embeddings.weight", matmul_dtype),
        "pos": get("embeddings.position_embeddings.weight", matmul_dtype),
        "type": get("embeddings.token_type_embeddings.weight", matmul_dtype),
        "emb_ln": ln("embeddings.LayerNorm"),
        "layers": [],
    }
    for i in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{i}."
        params["layers"].append({
            "qkv": _concat_dense([dense(p + "attention.self." + n)
                                  for n in ("query", "key", "value")]),
            "o": dense(p + "attention.output.dense"),
            "attn_ln": ln(p + "attention.output.LayerNorm"),
            "ff1": dense(p + "intermediate.dense"),
            "ff2": dense(p + "output.dense"),
            "ff_ln": ln(p + "output.LayerNorm"),
        })
    return jax.tree_util.tree_map(compat.upload, params)


# ----------------------------------------------------------------------------
# The encoder (exact shapes: ids is (n,), no masks anywhere)
# ----------------------------------------------------------------------------
def _layer_norm(x, p, eps):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * p["g"] + p["b"]


def _act(x, name):
    if name == "relu":
        return jax.nn.relu(x)
    return jax.nn.gelu(x, approximate=(name == "gelu_new"))  # HF "gelu" is the erf form


def _in_precision(product, a, b, dtype):
    """``product(a, b)`` with ``dtype`` operands; float32 accumulation and
    result when ``dtype`` is narrower (float32 operands: the plain product,
    unchanged)."""
    if dtype == jnp.float32:
        return product(a, b)
    return product(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _matmul(a, b, dtype):
    """``a @ b`` in ``dtype`` (``_in_precision``)."""
    return _in_precision(jnp.matmul, a, b, dtype)


def _matmul_nt(a, b, dtype):
    """``a @ swapaxes(b, -1, -2)`` for ``(h, n, d)`` operands in ``dtype``, as one
    ``dot_general`` contracting both last axes (no transpose of ``b``
    materialised; XLA:CPU's YNNPACK fusions take this form)."""
    dims = (((2,), (2,)), ((0,), (0,)))
    return _in_precision(lambda x, y, **kw: jax.lax.dot_general(x, y, dims, **kw),
                         a, b, dtype)


def _dense(x, p):
    return _matmul(x, p["w"], p["w"].dtype) + p["b"]


def _heads(x, p, h: int, dh: int):
    """``(n, hidden)`` -> query, key, value, each ``(h, n, dh)`` (heads leading)."""
    qkv = _dense(x, p).reshape(x.shape[0], 3, h, dh)
    qkv = jnp.transpose(qkv, (1, 2, 0, 3))
    # static slices (``qkv[i]`` is a gather when the shape has a dim var)
    return tuple(jax.lax.index_in_dim(qkv, i, keepdims=False) for i in range(3))


def _attention(q, k, v, scale: float, bias=None, dtype=jnp.float32):
    """``softmax(q k^T * scale + bias) v`` for ``(h, n, dh)`` heads -> ``(n, h * dh)``.

    Heads leading makes both products plain batched GEMMs (no transposes
    inside the dots). With this layout the benchmark suite's MiniLM steady
    state went from 48.0 to 63.2 texts/s together with ``ragged_map``'s new
    batching (README "Benchmarks"; the length-sorted ``jax.jit`` contender,
    same model code, from 70.8 to 92.0).
    """
    s = _matmul_nt(q * scale, k, dtype)
    if bias is not None:
        s = s + bias
    ctx = _matmul(jax.nn.softmax(s, axis=-1), v, dtype)
    h, n, dh = q.shape
    return jnp.swapaxes(ctx, 0, 1).reshape(n, h * dh)


def _layer(x, lp, cfg: BertConfig, bias=None):
    """One post-LN BERT encoder layer on ``(n, hidden)``."""
    q, k, v = _heads(x, lp["qkv"], cfg.num_attention_heads, cfg.head_dim)
    ctx = _attention(q, k, v, 1.0 / math.sqrt(cfg.head_dim), bias, lp["qkv"]["w"].dtype)
    x = _layer_norm(x + _dense(ctx, lp["o"]), lp["attn_ln"], cfg.layer_norm_eps)
    ff = _dense(_act(_dense(x, lp["ff1"]), cfg.hidden_act), lp["ff2"])
    return _layer_norm(x + ff, lp["ff_ln"], cfg.layer_norm_eps)


def _embeddings(params: dict, ids, positions):
    """Word + position + token-type-0 embeddings, summed in float32 (``positions``:
    an index array or a slice of the position table)."""
    def rows(table, index):
        return table[index].astype(jnp.float32)
    return rows(params["word"], ids) + rows(params["pos"], positions) + rows(params["type"], 0)


def encode(params: dict, ids, cfg: BertConfig = BertConfig()):
    """Token ids ``(n,)`` -> hidden states ``(n, hidden_size)`` (token type 0)."""
    n = ids.shape[0]
    positions = jnp.arange(n)
    x = _embeddings(params, ids, positions)
    x = _layer_norm(x, params["emb_ln"], cfg.layer_norm_eps)
    for lp in params["layers"]:
        x = _layer(x, lp, cfg)
    return x


def mean_pool(hidden):
    """sentence-transformers mean pooling over the tokens of one sequence."""
    return jnp.mean(hidden, axis=0)


def l2_normalize(v, eps: float = 1e-12):
    """``v / max(||v||, eps)`` (torch.nn.functional.normalize)."""
    return v / jnp.maximum(jnp.linalg.norm(v), eps)


def embed(params: dict, ids, cfg: BertConfig = BertConfig()):
    """Sentence embedding of one exact token sequence: encode, mean-pool, normalise."""
    return l2_normalize(mean_pool(encode(params, ids, cfg)))


# ----------------------------------------------------------------------------
# Hand-written padded-and-masked version (benchmark B2's baseline)
# ----------------------------------------------------------------------------
def embed_padded_reference(params: dict, ids, length, cfg: BertConfig = BertConfig()):
    """What one writes by hand without polymask: padded ids ``(T,)`` plus a length.

    Attention bias of ``-inf``-like values on padded keys, masked mean pooling.
    Used as the baseline of benchmark B2 (same math as ``embed``).
    """
    T = ids.shape[0]
    valid = jnp.arange(T) < length
    x = _embeddings(params, ids, slice(0, T))
    x = _layer_norm(x, params["emb_ln"], cfg.layer_norm_eps)
    bias = jnp.where(valid, 0.0, -1e9)[None, None, :]
    for lp in params["layers"]:
        x = _layer(x, lp, cfg, bias)
    pooled = jnp.sum(jnp.where(valid[:, None], x, 0.0), axis=0) / jnp.maximum(length, 1)
    return l2_normalize(pooled)


def numpy_embed(params: dict, ids: np.ndarray, cfg: BertConfig = BertConfig()) -> np.ndarray:
    """An independent float64 NumPy implementation (cross-check for tests)."""
    P = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    from math import erf

    verf = np.vectorize(erf)

    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + cfg.layer_norm_eps) * p["g"] + p["b"]

    n = len(ids)
    h, dh = cfg.num_attention_heads, cfg.head_dim
    x = ln(P["word"][ids] + P["pos"][:n] + P["type"][0], P["emb_ln"])
    for lp in P["layers"]:
        def d(z, q):
            return z @ q["w"] + q["b"]
        q, k, v = np.split(d(x, lp["qkv"]), 3, axis=-1)
        q, k, v = (t.reshape(n, h, dh) for t in (q, k, v))
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        ctx = np.einsum("hqk,khd->qhd", s, v).reshape(n, h * dh)
        x = ln(x + d(ctx, lp["o"]), lp["attn_ln"])
        u = d(x, lp["ff1"])
        x = ln(x + d(0.5 * u * (1 + verf(u / np.sqrt(2))), lp["ff2"]), lp["ff_ln"])
    m = x.mean(0)
    return m / max(np.linalg.norm(m), 1e-12)
