"""Where MiniLM's packed steady state goes (issue #28): one configuration per process.

    python benchmarks/packed_profile.py CONFIG [--texts N] [--precision bfloat16]

CONFIG (the stdlib-docstring corpus of ``benchmarks/run.py --only minilm``):
  packed:R:B          ``ragged_map(layout="packed")``, rows of R, B rows per call
  padded              length buckets, refined programs compiled for run speed
                      (``SentenceEncoder``'s padded layout), background compiles awaited
  hand:R:B            hand-written packed encoder (segment-id attention bias,
                      segment mean pooling), same rows: what the derived program costs
  noattn:R:B          ``hand`` with attention replaced by its values: the time
                      attention (scores, softmax, weighted sum) takes in a row of R
  classes:R1:R2:...   row classes: each text in the smallest row size that holds
                      it, one packed program per class

Prints one JSON line: steady seconds per pass (median of 3 after a first pass),
texts/s, compiles. ``--fusions`` (``packed``, ``hand``, ``noattn``): where one
call of the row program goes, per XLA:CPU fusion (thunk trace events of
``jax.profiler``, grouped by fusion kind, result shape and the JAX primitive
it came from), printed as a table before the JSON line. ``drive`` order and
rounds are the caller's (results of session 27:
``benchmarks/results/packed_profile.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _timeit(run, passes=3):
    run()  # the first pass compiles
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), times


def _ragged(enc, R, B):
    from polymask.runners.ragged import RaggedMap

    return RaggedMap(enc.embed_fn(True), ("n",), batch_size=32, numpy_outputs=True,
                     layout="packed", row_size=R, rows_per_call=B,
                     compiler_options=enc.run_speed_options())


def _hand_row(enc, R, S, attention: bool):
    import jax
    import jax.numpy as jnp

    from polymask.models.bert import _act, _dense, _heads, _layer, _layer_norm

    cfg = enc.config

    def row(params, tokens, seg, pos):
        x = params["word"][tokens] + params["pos"][pos] + params["type"][0]
        x = _layer_norm(x, params["emb_ln"], cfg.layer_norm_eps)
        bias = jnp.where(seg[:, None] == seg[None, :], 0.0, -1e9)[None]
        for lp in params["layers"]:
            if attention:
                x = _layer(x, lp, cfg, bias)
                continue
            _, _, v = _heads(x, lp["qkv"], cfg.num_attention_heads, cfg.head_dim)
            ctx = jnp.swapaxes(v, 0, 1).reshape(R, -1)
            x = _layer_norm(x + _dense(ctx, lp["o"]), lp["attn_ln"], cfg.layer_norm_eps)
            ff = _dense(_act(_dense(x, lp["ff1"]), cfg.hidden_act), lp["ff2"])
            x = _layer_norm(x + ff, lp["ff_ln"], cfg.layer_norm_eps)
        sums = jax.ops.segment_sum(x, seg, num_segments=S + 1)[:S]
        cnt = jax.ops.segment_sum(jnp.ones(R), seg, num_segments=S + 1)[:S]
        pooled = sums / jnp.maximum(cnt, 1)[:, None]
        return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)

    return row


def _hand(enc, ids, R, B, attention: bool):
    import jax

    from polymask.packing import pack_rows

    S = 64
    f = jax.jit(jax.vmap(_hand_row(enc, R, S, attention), in_axes=(None, 0, 0, 0)),
                compiler_options=enc.run_speed_options())
    lengths = [len(x) for x in ids]
    rows = pack_rows(lengths, R, S).rows

    last: dict = {}

    def run():
        out = np.zeros((len(ids), enc.config.hidden_size), np.float32)
        for b0 in range(0, len(rows), B):
            rr = rows[b0:b0 + B]
            rr = rr + [rr[0]] * (B - len(rr))
            tokens = np.zeros((B, R), np.int32)
            seg = np.full((B, R), S, np.int32)
            pos = np.zeros((B, R), np.int32)
            for bi, row in enumerate(rr):
                for s, (i, st) in enumerate(row):
                    n = lengths[i]
                    tokens[bi, st:st + n] = ids[i]
                    seg[bi, st:st + n] = s
                    pos[bi, st:st + n] = np.arange(n)
            o = np.asarray(f(enc.params, tokens, seg, pos))
            last["call"] = (f, [enc.params, tokens, seg, pos])
            for bi, row in enumerate(rows[b0:b0 + B]):
                for s, (i, _) in enumerate(row):
                    out[i] = o[bi, s]
        return out

    return run, {"rows": len(rows), "last_call": lambda: last["call"]}


def _capture_packed_call(r) -> dict:
    """The packed row program and the arguments of its next call (for
    ``--fusions``), by wrapping the runner's call (benchmark-only)."""
    pr, seen = r._packed, {}
    call = pr._call

    def capture(fn, bcast, inputs):
        seen.setdefault("call", (fn, [*bcast, *inputs]))
        return call(fn, bcast, inputs)

    pr._call = capture
    return seen


def fusion_profile(fn, args, calls: int = 3) -> list[dict]:
    """Milliseconds per call in each group of fusions of the compiled ``fn``
    (same kind, result shape and primitive), from the thunk trace events of
    ``jax.profiler`` (XLA:CPU with ``--xla_cpu_enable_xprof_traceme``)."""
    import collections
    import glob
    import gzip
    import re
    import tempfile

    import jax

    hlo = fn.lower(*args).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    info = {m.group(1): (m.group(2), m.group(3).split("/")[-1]) for m in re.finditer(
        r'^\s+%(\S+) = (\S+?\[[0-9,]*\])\S* \w+\(.*?op_name="([^"]*)"', entry, re.M)}
    jax.block_until_ready(fn(*args))
    walls = []
    for _ in range(5):  # the call's wall time, outside the profiler
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append((time.perf_counter() - t0) * 1e3)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        trace = json.load(gzip.open(glob.glob(d + "/**/*.trace.json.gz", recursive=True)[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ms, count = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("args", {}).get("hlo_op")
        if e.get("ph") == "X" and name in info:
            shape, prim = info[name]
            key = (re.sub(r"\.[0-9]+$", "", name), shape, prim)
            ms[key] += e["dur"] / 1e3 / calls
            count[key] += 1
    rows = [dict(fusion=k[0], shape=k[1], primitive=k[2], ms=round(t, 3),
                 count=count[k] // calls) for k, t in ms.most_common()]
    return {"wall_ms": round(float(np.median(walls)), 2), "fusions": rows}


def _print_fusions(profile: dict, top: int = 25) -> None:
    rows = profile["fusions"]
    total = sum(r["ms"] for r in rows)
    print(f"# row program: {profile['wall_ms']:.1f} ms per call (median of 5), {total:.1f} ms "
          f"in fusions; the {top} largest groups")
    for r in rows[:top]:
        print(f"# {r['ms']:8.2f} ms  x{r['count']:3d}  {r['fusion']:28s} {r['shape']:22s} "
              f"{r['primitive']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--texts", type=int, default=1400)
    ap.add_argument("--precision", default="float32", help="float32 (default) or bfloat16")
    ap.add_argument("--fusions", action="store_true",
                    help="packed, hand, noattn: also print the row program's time per fusion")
    args = ap.parse_args(argv)
    if args.fusions and args.config.split(":")[0] not in ("packed", "hand", "noattn"):
        ap.error(f"--fusions profiles one row program: configs packed, hand or noattn, "
                 f"not {args.config!r}")
    if args.fusions:  # XLA:CPU's thunk trace events: set before JAX starts
        import os

        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_cpu_enable_xprof_traceme=true").strip()
    from polymask.cli import stdlib_docstrings
    from polymask.models import load

    enc = load(precision=args.precision)
    ids = enc.tokenize(stdlib_docstrings(args.texts))
    kind, *rest = args.config.split(":")
    res: dict = {"config": args.config, "precision": args.precision, "texts": len(ids), "tokens": sum(map(len, ids))}
    if kind == "packed":
        r = _ragged(enc, int(rest[0]), int(rest[1]))
        med, times = _timeit(lambda: r(ids, enc.params, refine=False))
        st = r.stats()
        res.update(compiles=st["xla_compiles"], layout=st["layout"],
                   calls=st["packed"]["calls"], exact_reruns=st["packed"]["exact_reruns"])
        if args.fusions:
            seen = _capture_packed_call(r)
            r(ids[:64], enc.params, refine=False)
            res["fusions"] = fusion_profile(*seen["call"])
    elif kind == "padded":
        r = enc.runner(None, 32, layout="padded")
        r(ids, enc.params, refine=True)
        r.wait()  # the refined programs, compiled in the background
        med, times = _timeit(lambda: r(ids, enc.params, refine=True))
        res.update(compiles=r.stats()["xla_compiles"])
    elif kind in ("hand", "noattn"):
        run, extra = _hand(enc, ids, int(rest[0]), int(rest[1]), kind == "hand")
        med, times = _timeit(run)
        last_call = extra.pop("last_call")
        if args.fusions:
            res["fusions"] = fusion_profile(*last_call())
        res.update(extra)
    elif kind == "classes":
        sizes = sorted(int(v) for v in rest)
        groups: dict[int, list] = {R: [] for R in sizes}
        for x in ids:
            groups[next(R for R in sizes if len(x) <= R)].append(x)
        runners = {R: _ragged(enc, R, max(1, 2048 // R)) for R in sizes}

        def run():
            for R in sizes:
                if groups[R]:
                    runners[R](groups[R], enc.params, refine=False)

        med, times = _timeit(run)
        res.update(compiles=sum(r.stats()["xla_compiles"] for r in runners.values()),
                   texts_per_class={R: len(g) for R, g in groups.items()})
    else:
        raise SystemExit(f"unknown config {args.config!r}")
    res.update(steady_s=med, texts_per_s=len(ids) / med, times=times)
    if args.fusions:
        _print_fusions(res["fusions"])
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
