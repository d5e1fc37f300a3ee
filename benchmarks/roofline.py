"""How fast could any fp32 (or bfloat16) MiniLM pass over the process workload's texts be here?

The ``process`` workload's warm target (``polymask embed`` on ~1,400 short
texts in <= 0.35x sentence-transformers' wall time) is bounded below by the
model's arithmetic: this script counts the matmul FLOPs of all-MiniLM-L6-v2
over those texts for three paddings (polymask's length buckets; sentence-
transformers' pad-to-longest of length-sorted batches; no padding at all),
measures this machine's fp32 matmul throughput on the model's own matmul
shapes (XLA through ``jax.jit``, and NumPy's BLAS) and XLA's bfloat16 rate
(bfloat16 operands, float32 accumulation: ``--precision bfloat16``), and prints
the time the matmuls alone need at those rates.

    python benchmarks/roofline.py [--texts 1400] [--batch-size 32] [--json OUT]

Only dense matmuls and attention products are counted (2 FLOPs per
multiply-add); embeddings, layer norms, GELU and softmax are left out, so the
bound is optimistic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import numpy as np  # noqa: E402


def matmul_flops_per_token(cfg, length: int) -> float:
    """Matmul FLOPs of one token in a sequence of ``length`` (all layers)."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    dense = 4 * d * d + 2 * d * ff  # Q, K, V, output projections; FFN in and out
    attention = 2 * length * d  # QK^T and attention-weights x V
    return 2.0 * cfg.num_hidden_layers * (dense + attention)


def padded_batches(lengths, batch: int, pad_to) -> list[tuple[int, int]]:
    """``(rows, padded length)`` of length-sorted batches of ``batch`` texts."""
    order = sorted(lengths, reverse=True)
    return [(len(chunk), pad_to(max(chunk))) for chunk in
            (order[i:i + batch] for i in range(0, len(order), batch))]


def batches_flops(cfg, batches, full_rows: int | None) -> float:
    return sum((full_rows or rows) * t * matmul_flops_per_token(cfg, t) for rows, t in batches)


def throughput(fn, m: int, k: int, n: int, reps: int = 20, dtype=np.float32) -> float:
    """Best GFLOP/s of ``fn(a, b)`` for an ``m x k`` by ``k x n`` product of ``dtype``."""
    rng = np.random.default_rng(0)
    a, b = rng.random((m, k), np.float32).astype(dtype), rng.random((k, n), np.float32).astype(dtype)
    fn(a, b)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(a, b)
        np.asarray(out)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2.0 * m * k * n / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=1400)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax

    from polymask.core.plan import bucket_bound
    from polymask.models import load
    from polymask.models.loader import length_buckets

    enc = load(common.model_dir())
    cfg = enc.config
    lengths = [len(ids) for ids in enc.tokenize(common.short_texts(args.texts))]
    policy = length_buckets()
    paddings = {
        "polymask length buckets": (padded_batches(lengths, args.batch_size,
                                                   lambda t: bucket_bound(policy, t)),
                                    args.batch_size),
        "sentence-transformers (pad to longest)": (
            padded_batches(lengths, args.batch_size, lambda t: t), None),
        "no padding": ([(1, t) for t in lengths], None),
    }
    d, ff, rows = cfg.hidden_size, cfg.intermediate_size, args.batch_size * 16
    xla = jax.jit(lambda a, b: a @ b)
    # bfloat16 operands, float32 accumulation: the bfloat16 encoder's matmuls
    xla_bf16 = jax.jit(lambda a, b: jax.numpy.matmul(a, b, preferred_element_type=np.float32))
    shapes = [(rows, d, 3 * d), (rows, d, ff), (rows, ff, d)]
    peak = {"xla": max(throughput(xla, *s) for s in shapes),
            "numpy": max(throughput(np.matmul, *s) for s in shapes),
            "xla_bfloat16": max(throughput(xla_bf16, *s, dtype=jax.numpy.bfloat16)
                                for s in shapes)}
    out = {"texts": len(lengths), "tokens": int(sum(lengths)),
           "gflops_per_s": {k: round(v, 1) for k, v in peak.items()},
           "matmul_shapes": shapes, "paddings": {}}
    best = max(peak["xla"], peak["numpy"])
    print(f"{len(lengths)} texts, {sum(lengths)} tokens; matmul throughput on {shapes}: "
          f"fp32 XLA {peak['xla']:.0f}, NumPy {peak['numpy']:.0f} GFLOP/s; bfloat16 "
          f"(float32 accumulation) XLA {peak['xla_bfloat16']:.0f} GFLOP/s")
    for name, (batches, full) in paddings.items():
        flops = batches_flops(cfg, batches, full)
        tokens = sum((full or r) * t for r, t in batches)
        out["paddings"][name] = {"padded_tokens": tokens, "gflop": round(flops / 1e9, 1),
                                 "seconds_at_best": round(flops / 1e9 / best, 2),
                                 "seconds_at_bfloat16": round(flops / 1e9 / peak["xla_bfloat16"],
                                                              2)}
        print(f"  {name:40s} {tokens:6d} padded tokens, {flops / 1e9:6.0f} GFLOP, "
              f"matmuls alone >= {flops / 1e9 / best:.2f} s at {best:.0f} GFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
