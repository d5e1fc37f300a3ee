"""Would attention whose cost follows the examples' sum n^2 make packed MiniLM faster here?

    python benchmarks/attention_tiles.py [--rounds 3] [--texts 1400] [--out DIR]

The packed layout computes attention over a whole row (``R x R`` scores per
head, cross-example entries selected away: docs/packing.md). The work the
examples need is ``sum n_i^2``. This script measures, on the rows the packed
runner makes of the MiniLM corpus (``pack_rows`` of the real token lengths,
``row_arrays`` as the row program gets them, ``rows_per_call`` rows per call),

- tile statistics (host only): ``sum n_i^2 / (rows R^2)``, and per tile size
  ``T`` the tile pairs that share an example (pairs computed / pairs in the
  rows), per row and with each call's count bucketed (one program per bucket);
- the steady time of one pass over all calls of three attention forms on
  XLA:CPU, MiniLM's shapes (12 heads of 32, float32), random q/k/v:
  ``dense`` (today's packed form), ``pairs`` (only tile pairs that share an
  example: gathers, batched tile products, segment max/sum over the pairs of
  each query tile), ``window`` (each query tile reads one contiguous window
  of keys, as wide as the call's widest, bucketed to tiles).

Each (form, tile size) runs in its own process, order rotated per round;
figures are medians over rounds with min..max and the 1-minute load. Every
compile is counted (one per distinct bucket) and excluded from the steady
pass. Outputs are checked against ``dense`` (max abs deviation).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
H, DH, R, S, ROWS_PER_CALL = 12, 32, 256, 32, 8
CONTENDERS = ["dense", "pairs:32", "pairs:64", "window:32", "window:64"]


def corpus_rows(texts: int):
    """The packed runner's rows of the MiniLM corpus: (lengths, calls), each
    call a list of ``rows_per_call`` rows' ``seg`` arrays (spare rows empty)."""
    import numpy as np

    from polymask.cli import stdlib_docstrings
    from polymask.models import load
    from polymask.packing import pack_rows
    from polymask.packing.segments import row_arrays

    enc = load()
    lengths = [len(t) for t in enc.tokenize(stdlib_docstrings(texts))]
    packing = pack_rows(lengths, R, S)
    segs = [row_arrays(row, lengths, R, S)["seg"] for row in packing.rows]
    empty = np.full(R, S, np.int32)
    calls = []
    for b0 in range(0, len(segs), ROWS_PER_CALL):
        call = segs[b0:b0 + ROWS_PER_CALL]
        calls.append(np.stack(call + [empty] * (ROWS_PER_CALL - len(call))))
    return lengths, calls


def sharing_pairs(seg, T: int):
    """Tile pairs of one row whose tiles hold a common example (NumPy)."""
    import numpy as np

    nt = R // T
    member = np.zeros((nt, S + 1), bool)
    member[np.repeat(np.arange(nt), T), seg] = True
    member = member[:, :S]  # dead positions (id S) hold no example
    return int(((member.astype(np.int32) @ member.T.astype(np.int32)) > 0).sum())


def window_need(seg, T: int) -> int:
    """The widest key window a query tile of one row needs: from the start of
    the first example it holds to the end of the last."""
    import numpy as np

    need = 0
    for t in range(R // T):
        ids = [s for s in set(seg[t * T:(t + 1) * T].tolist()) if s < S]
        if ids:
            pos = np.flatnonzero(np.isin(seg, ids))
            need = max(need, int(pos[-1] - pos[0] + 1))
    return need


def ceil_to(x: int, step: int) -> int:
    return -(-x // step) * step


def tile_statistics(lengths, calls) -> dict:
    rows = [row for call in calls for row in call if (row < S).any()]
    dense_pairs = len(rows) * R * R
    out = {"texts": len(lengths), "tokens": sum(lengths), "rows": len(rows),
           "sum_n2_over_rows_R2": sum(n * n for n in lengths) / dense_pairs}
    for T in (16, 32, 64):
        nt = R // T
        per_row = [sharing_pairs(r, T) for r in rows]
        per_call = [max(sharing_pairs(r, T) for r in call) for call in calls]
        windows = [max(window_need(r, T) for r in call) for call in calls]
        out[f"T{T}"] = {
            "pairs_computed_over_pairs_in_rows_per_row": sum(per_row) / (len(rows) * nt * nt),
            "per_call_bucketed_to_nt": sum(ROWS_PER_CALL * ceil_to(p, nt) for p in per_call)
            / (len(calls) * ROWS_PER_CALL * nt * nt),
            "window_per_call_bucketed_to_T": sum(ceil_to(w, T) for w in windows)
            / (len(calls) * R),
            "calls_needing_full_window": sum(w > R - T for w in windows),
        }
    return out


# ----------------------------------------------------------------------------
# one contender, in its own process
# ----------------------------------------------------------------------------
def attention_forms(jax, jnp):
    def dense(q, k, v, seg):
        same = (seg[:, None] == seg[None, :]) & (seg[:, None] < S)
        s = jnp.einsum("hqd,hkd->hqk", q, k) * DH ** -0.5
        m = jnp.max(jnp.where(same, s, -jnp.inf), -1, keepdims=True)
        e = jnp.where(same, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0)), 0.0)
        return jnp.einsum("hqk,hkd->hqd", e / jnp.maximum(e.sum(-1, keepdims=True), 1e-30), v)

    def pairs(q, k, v, seg, T, P):
        nt = R // T
        tseg = seg.reshape(nt, T)
        member = jax.nn.one_hot(tseg, S, dtype=jnp.float32).max(1)  # (nt, S)
        pq, pk = jnp.nonzero(member @ member.T > 0, size=P, fill_value=nt)
        qc, kc = jnp.minimum(pq, nt - 1), jnp.minimum(pk, nt - 1)
        tiles = lambda a, idx: a.reshape(H, nt, T, DH)[:, idx]  # noqa: E731
        same = ((tseg[qc][:, :, None] == tseg[kc][:, None, :])
                & (tseg[qc][:, :, None] < S) & (pq < nt)[:, None, None])
        s = jnp.einsum("hpqd,hpkd->hpqk", tiles(q, qc), tiles(k, kc)) * DH ** -0.5
        part = jnp.moveaxis(jnp.max(jnp.where(same, s, -jnp.inf), -1), 1, 0)  # (P, H, T)
        m = jax.ops.segment_max(part, pq, num_segments=nt)  # (nt, H, T)
        m = jnp.moveaxis(jnp.where(jnp.isfinite(m), m, 0), 0, 1)[:, qc]
        e = jnp.where(same, jnp.exp(s - m[..., None]), 0.0)
        den = jax.ops.segment_sum(jnp.moveaxis(e.sum(-1), 1, 0), pq, num_segments=nt)
        num = jax.ops.segment_sum(jnp.moveaxis(
            jnp.einsum("hpqk,hpkd->hpqd", e, tiles(v, kc)), 1, 0), pq, num_segments=nt)
        out = num / jnp.maximum(den, 1e-30)[..., None]  # (nt, H, T, DH)
        return jnp.moveaxis(out, 0, 1).reshape(H, R, DH)

    def window(q, k, v, seg, T, W):
        nt = R // T
        first = jnp.full((S + 1,), R, jnp.int32).at[seg].min(jnp.arange(R, dtype=jnp.int32))
        start = jnp.clip(first[seg[::T]], 0, R - W)  # (nt,): the tile's first example's start
        idx = start[:, None] + jnp.arange(W)  # (nt, W)
        same = ((seg.reshape(nt, T)[:, :, None] == seg[idx][:, None, :])
                & (seg.reshape(nt, T)[:, :, None] < S))
        s = jnp.einsum("htqd,htwd->htqw", q.reshape(H, nt, T, DH), k[:, idx]) * DH ** -0.5
        m = jnp.max(jnp.where(same, s, -jnp.inf), -1, keepdims=True)
        e = jnp.where(same, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0)), 0.0)
        w = e / jnp.maximum(e.sum(-1, keepdims=True), 1e-30)
        return jnp.einsum("htqw,htwd->htqd", w, v[:, idx]).reshape(H, R, DH)

    return dense, pairs, window


def run_contender(name: str, texts: int, passes: int) -> dict:
    import numpy as np

    sys.path.insert(0, str(HERE))
    import common

    counter = common.CompileCounter().install()
    import jax
    import jax.numpy as jnp

    lengths, calls = corpus_rows(texts)
    dense, pairs, window = attention_forms(jax, jnp)
    kind, _, tile = name.partition(":")
    T = int(tile or 0)
    rng = np.random.default_rng(0)
    qkv = [jnp.asarray(rng.normal(size=(ROWS_PER_CALL, H, R, DH)).astype(np.float32))
           for _ in range(3)]
    programs: dict = {}

    def program(call):
        if kind == "dense":
            key = 0
        elif kind == "pairs":
            key = ceil_to(max(sharing_pairs(r, T) for r in call), R // T)
        else:
            key = min(R, ceil_to(max(window_need(r, T) for r in call), T))
        if key not in programs:
            form = {"dense": lambda q, k, v, s: dense(q, k, v, s),
                    "pairs": lambda q, k, v, s: pairs(q, k, v, s, T, key),
                    "window": lambda q, k, v, s: window(q, k, v, s, T, key)}[kind]
            programs[key] = jax.jit(jax.vmap(form))
        return programs[key]

    ref = jax.jit(jax.vmap(dense))
    dev = 0.0
    for call in calls:  # first pass: compiles, and every output checked against dense
        out = program(call)(*qkv, jnp.asarray(call))
        live = np.asarray(call < S)[:, None, :, None]
        diff = np.abs(np.asarray(out) - np.asarray(ref(*qkv, jnp.asarray(call))))
        dev = max(dev, float(np.max(np.where(live, diff, 0))))
    compiles = counter.snapshot()["xla_compiles"]
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for call in calls:
            jax.block_until_ready(program(call)(*qkv, jnp.asarray(call)))
        times.append(time.perf_counter() - t0)
    assert counter.snapshot()["xla_compiles"] == compiles, "a steady pass compiled"
    return {"contender": name, "steady_s": statistics.median(times), "programs": len(programs),
            "xla_compiles": compiles, "max_abs_dev_vs_dense": dev, "calls": len(calls),
            "jax": jax.__version__}


# ----------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Packed attention over a row (dense) against tile pairs and key windows "
        "that follow the examples' sum n^2, on the packed runner's rows of the MiniLM "
        "corpus; one attention layer (12 heads of 32, random q/k/v) per call, XLA:CPU. "
        "Needs the models extra and the default model (benchmarks/README.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds; each runs every form in a fresh process, order rotated")
    ap.add_argument("--texts", type=int, default=1400,
                    help="stdlib docstrings tokenized and packed into rows of 256")
    ap.add_argument("--passes", type=int, default=5,
                    help="steady passes over all calls per process (median reported)")
    ap.add_argument("--out", default=str(HERE / "results" / "attention_tiles"),
                    help="directory for results.json and results.md")
    ap.add_argument("--contender", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.contender:
        print("RESULT " + json.dumps(run_contender(args.contender, args.texts, args.passes)))
        return 0
    lengths, calls = corpus_rows(args.texts)
    stats = tile_statistics(lengths, calls)
    print(json.dumps(stats, indent=1))
    results: dict = {c: [] for c in CONTENDERS}
    for r in range(args.rounds):
        order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
        for c in order:
            load = os.getloadavg()[0]
            p = subprocess.run([sys.executable, __file__, "--contender", c, "--texts",
                                str(args.texts), "--passes", str(args.passes)],
                               capture_output=True, text=True, check=True,
                               env={**os.environ, "JAX_PLATFORMS": "cpu"})
            line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
            res = json.loads(line[len("RESULT "):])
            res["load"] = load
            results[c].append(res)
            print(f"[round {r + 1}] {c}: {res['steady_s']:.3f} s (load {load:.1f})",
                  file=sys.stderr)
    dense = statistics.median(x["steady_s"] for x in results["dense"])
    lines = ["| form | steady pass [s] | vs dense | programs | max abs dev vs dense | load |",
             "|---|---|---|---|---|---|"]
    for c, rs in results.items():
        t = [x["steady_s"] for x in rs]
        lines.append(f"| {c} | {statistics.median(t):.3f} ({min(t):.3f}..{max(t):.3f}) | "
                     f"{statistics.median(t) / dense:.2f}x | {rs[-1]['programs']} | "
                     f"{max(x['max_abs_dev_vs_dense'] for x in rs):.1e} | "
                     f"{statistics.median(x['load'] for x in rs):.1f} |")
    table = "\n".join(lines)
    print(table)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"tile_statistics": stats,
                                                  "results": results}, indent=1))
    (out / "results.md").write_text(
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs, `python benchmarks/attention_tiles.py --rounds {args.rounds}`"
        f"\n\n```\n{json.dumps(stats, indent=1)}\n```\n\n{table}\n")
    print(f"wrote {out}/results.json, results.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
