"""Run ONE contender of ONE workload in this process and print one JSON line.

    python benchmarks/contenders.py --workload attention --contender polymask_jit [--quick]
    python benchmarks/contenders.py --list

The line starts with ``BENCH_RESULT `` (``run.py`` reads it). Every XLA compile
of the process is counted (``common.CompileCounter``, JAX's monitoring events),
split by phase: ``setup`` (imports, parameters, model load), ``first`` (first
pass) and ``steady`` (all steady-state passes together).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import common  # noqa: E402

T_PROCESS0 = time.perf_counter()


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
class Phases:
    """Compile snapshots between phases of a JAX contender."""

    def __init__(self, counter):
        self.counter = counter
        self.last = counter.snapshot()
        self.out: dict = {}

    def mark(self, name: str) -> None:
        s = self.counter.snapshot()
        self.out[name] = common.CompileCounter.delta(self.last, s)
        self.last = s

    def result(self) -> dict:
        total = self.counter.snapshot()
        return dict(compiles={k: {kk: vv for kk, vv in v.items() if kk != "names"}
                              for k, v in self.out.items()},
                    compiles_total=total["xla_compiles"], cache_hits_total=total["cache_hits"],
                    compile_s_total=total["compile_s"],
                    compile_names={k: v["names"] for k, v in self.out.items()})


def start_jax():
    import jax

    counter = common.CompileCounter().install()
    return jax, counter


def passes(call, xs, block):
    """Cumulative wall time after each call of one pass over ``xs``."""
    cum, t0 = [], time.perf_counter()
    for x in xs:
        block(call(x))
        cum.append(time.perf_counter() - t0)
    return cum


def background_wait(f) -> dict:
    """Wait for polymask's background (tiered-bucket) compiles after the first pass.

    Steady state is the state after warm-up: passes timed while tight buckets
    still compile on the 2 cores measure the compiles, not the calls. The wait
    is reported (``background_wait_s``); the first pass never includes it.
    """
    if not hasattr(f, "wait"):
        return {}
    t0 = time.perf_counter()
    f.wait()
    return {"background_wait_s": time.perf_counter() - t0}


def steady_summary(times: list[float]) -> dict:
    import statistics

    return dict(steady_s=statistics.median(times), steady_min_s=min(times),
                steady_max_s=max(times), steady_passes=times)


# ----------------------------------------------------------------------------
# workload 1: causal attention, 48 distinct T
# ----------------------------------------------------------------------------
def make_attention(jnp, jax):
    """The attention of ``run.make_attention`` (exact shapes)."""
    import math

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


def make_attention_padded(jnp, jax):
    """Hand-written one-bucket version: x padded to (128, 64) plus the length."""
    import math

    def attn(p, x, length):
        n, d = x.shape
        h = 4
        q = (x @ p["q"]).reshape(n, h, d // h).transpose(1, 0, 2)
        k = (x @ p["k"]).reshape(n, h, d // h).transpose(1, 0, 2)
        v = (x @ p["v"]).reshape(n, h, d // h).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d // h)
        row = jnp.arange(n)[:, None]
        col = jnp.arange(n)[None, :]
        s = jnp.where((col <= row) & (col < length), s, -1e30)
        a = jax.nn.softmax(s, axis=-1) @ v
        return jnp.tanh(a.transpose(1, 0, 2).reshape(n, d) @ p["o"]) + x

    return attn


def attention(name: str, quick: bool, steady_passes: int) -> dict:
    import numpy as np

    params_np, xs = common.attention_inputs(quick)
    res: dict = {}
    if name == "torch_eager":
        import torch

        t0 = time.perf_counter()
        p = {k: torch.from_numpy(v) for k, v in params_np.items()}

        def attn(x):
            n, d = x.shape
            h = 4
            q = (x @ p["q"]).reshape(n, h, d // h).transpose(0, 1)
            k = (x @ p["k"]).reshape(n, h, d // h).transpose(0, 1)
            v = (x @ p["v"]).reshape(n, h, d // h).transpose(0, 1)
            s = q @ k.transpose(1, 2) / (d // h) ** 0.5
            causal = torch.tril(torch.ones((n, n), dtype=torch.bool))
            s = torch.where(causal, s, torch.tensor(-1e30))
            a = torch.softmax(s, dim=-1) @ v
            return torch.tanh(a.transpose(0, 1).reshape(n, d) @ p["o"]) + x

        def call(x):
            with torch.no_grad():
                return attn(torch.from_numpy(x)).numpy()

        res["setup_s"] = time.perf_counter() - t0
        cum = passes(call, xs, lambda r: r)
        steady = [passes(call, xs, lambda r: r)[-1] for _ in range(steady_passes)]
        outs = [call(x) for x in xs[:4]]
        res.update(torch_threads=torch.get_num_threads(), torch=torch.__version__)
        phases = None
    else:
        jax, counter = start_jax()
        import jax.numpy as jnp

        phases = Phases(counter)
        t0 = time.perf_counter()
        p = {k: jnp.asarray(v) for k, v in params_np.items()}
        block = jax.block_until_ready
        if name in ("polymask_jit", "polymask_jit_numpy"):
            import polymask as pm

            # the largest bucket is the hand-written version's pad length
            f = pm.jit(make_attention(jnp, jax), (None, "n, 64"),
                       buckets=pm.buckets.pow2(16, maximum=common.ATT_PAD),
                       numpy_outputs=(name == "polymask_jit_numpy"))
            call = lambda x: f(p, x)
        elif name == "polymask_jit_default":
            import polymask as pm

            # what a user who writes no bucket policy gets
            f = pm.jit(make_attention(jnp, jax), (None, "n, 64"))
            call = lambda x: f(p, x)
        elif name == "jax_jit":
            f = jax.jit(make_attention(jnp, jax))
            call = lambda x: f(p, x)
        elif name == "handwritten":
            f = jax.jit(make_attention_padded(jnp, jax))

            def call(x):
                t = x.shape[0]
                xp = np.zeros((common.ATT_PAD, common.ATT_D), np.float32)
                xp[:t] = x
                return np.asarray(f(p, xp, np.int32(t)))[:t]
        else:
            raise SystemExit(f"unknown attention contender {name!r}")
        res["setup_s"] = time.perf_counter() - t0
        phases.mark("setup")
        cum = passes(call, xs, block)
        phases.mark("first")
        res.update(background_wait(f))
        phases.mark("background_wait")
        steady = []
        for i in range(steady_passes):
            steady.append(passes(call, xs, block)[-1])
            phases.mark(f"steady{i + 1}")
        outs = [np.asarray(call(x)) for x in xs[:4]]
        phases.mark("check")
        if hasattr(f, "stats"):
            res["polymask_stats"] = f.stats()
    dev = max(float(np.abs(o - common.attention_numpy(params_np, x)).max())
              for o, x in zip(outs, xs[:4]))
    res.update(first_pass_s=cum[-1], cumulative_s=cum, max_abs_dev_vs_numpy=dev,
               lengths=[x.shape[0] for x in xs], **steady_summary(steady))
    if phases is not None:
        res.update(phases.result())
    return res


# ----------------------------------------------------------------------------
# workload 2: MiniLM on the demo texts
# ----------------------------------------------------------------------------
def batched_bert(jnp, jax, cfg):
    """What a JAX user writes: a (B, T) batch padded to its longest text + attention mask.

    The same hand-written padded model as the hand-written baseline
    (``bert.embed_padded_reference``: additive key mask, masked mean pooling),
    vmapped over the batch, so the comparison isolates bucketing and masking
    from the model's formulation.
    """
    from polymask.models import bert

    per_text = lambda params, ids, length: bert.embed_padded_reference(params, ids, length, cfg)

    def f(params, ids, mask):
        return jax.vmap(per_text, in_axes=(None, 0, 0))(params, ids, jnp.sum(mask, axis=1))

    return jax.jit(f)


POLYMASK_MINILM = ("polymask", "polymask_no_reuse", "polymask_coarse", "polymask_cache_cold",
                   "polymask_cache_warm", "polymask_packed", "polymask_padded", "polymask_bf16",
                   "polymask_bf16_packed", "polymask_bf16_padded")
# the encoder's precision per contender (polymask: float32)
MINILM_PRECISION = {"polymask_bf16": "bfloat16", "polymask_bf16_packed": "bfloat16",
                    "polymask_bf16_padded": "bfloat16"}
# the encoder's layout per contender (polymask: its default, "auto")
MINILM_LAYOUT = {"polymask_packed": "packed", "polymask_padded": "padded",
                 "polymask_bf16_packed": "packed", "polymask_bf16_padded": "padded"}
ST_BACKENDS = {"sentence_transformers": "torch", "sentence_transformers_onnx": "onnx",
               "sentence_transformers_openvino": "openvino",
               "sentence_transformers_openvino_f32": "openvino"}
# OpenVINO's CPU plugin runs bfloat16 by default where the CPU has AMX; its
# float32 hint is the like-for-like baseline of polymask's float32
ST_OV_CONFIG = {"sentence_transformers_openvino_f32": {"INFERENCE_PRECISION_HINT": "f32"}}


st_model = common.st_model


def minilm(name: str, quick: bool, steady_passes: int, emb_out: str | None,
           cache_dir: str | None = None, n_texts: int | None = None) -> dict:
    import numpy as np

    res: dict = {}
    phases = None
    t0 = time.perf_counter()
    if name in ST_BACKENDS:
        import torch

        texts = common_texts(quick, n_texts)
        model = st_model(ST_BACKENDS[name], ov_config=ST_OV_CONFIG.get(name))
        run = lambda: model.encode(texts, batch_size=32, convert_to_numpy=True)
        res.update(torch_threads=torch.get_num_threads(), torch=torch.__version__,
                   backend=ST_BACKENDS[name])
    else:
        if name in POLYMASK_MINILM and name != "polymask_no_reuse":  # as the CLI does
            from polymask import reuse_host_memory

            res["reuse_host_memory"] = reuse_host_memory()
        if name.startswith("polymask_cache"):  # persistent cache + program store
            from polymask import enable_compilation_cache

            enable_compilation_cache(cache_dir)
        jax, counter = start_jax()
        import jax.numpy as jnp

        from polymask.models import load

        phases = Phases(counter)
        enc = load(precision=MINILM_PRECISION.get(name, "float32"))
        res["precision"] = enc.precision
        texts = common_texts(quick, n_texts)
        layout = MINILM_LAYOUT.get(name, "auto")
        if name in POLYMASK_MINILM:  # polymask_coarse: no refined buckets (refining.py)
            run = lambda: enc.embed(texts, refine=name != "polymask_coarse", layout=layout)
        elif name == "jax_jit_sorted":
            f = batched_bert(jnp, jax, enc.config)

            def run(batch_size=32):
                ids = enc.tokenize(texts)
                order = np.argsort([len(x) for x in ids], kind="stable")
                out = np.zeros((len(ids), enc.config.hidden_size), np.float32)
                for s in range(0, len(ids), batch_size):
                    sel = order[s:s + batch_size]
                    t = max(len(ids[i]) for i in sel)
                    b = np.zeros((len(sel), t), np.int32)
                    m = np.zeros((len(sel), t), bool)
                    for j, i in enumerate(sel):
                        b[j, :len(ids[i])] = ids[i]
                        m[j, :len(ids[i])] = True
                    out[sel] = np.asarray(f(enc.params, b, m))
                return out
        else:
            raise SystemExit(f"unknown minilm contender {name!r}")
        phases.mark("setup")
    res["setup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    emb = np.asarray(run())
    first = time.perf_counter() - t0
    if phases:
        phases.mark("first")
    if name in POLYMASK_MINILM:
        res.update(background_wait(enc.runner(None, 32, layout=layout)))
        phases.mark("background_wait")
    steady = []
    for i in range(steady_passes):
        t0 = time.perf_counter()
        run()
        steady.append(time.perf_counter() - t0)
        if phases:
            phases.mark(f"steady{i + 1}")
    if emb_out:
        np.save(emb_out, emb.astype(np.float32))
    n = len(texts)
    # the corpus is the interpreter's stdlib docstrings: run.py compares
    # embeddings only between processes that embedded the same texts
    res["texts_sha256"] = hashlib.sha256("\x00".join(texts).encode()).hexdigest()
    res.update(texts=n, first_pass_s=first, first_texts_per_s=n / first,
               steady_texts_per_s=n / float(np.median(steady)),
               steady_texts_per_s_min=n / max(steady), steady_texts_per_s_max=n / min(steady),
               **steady_summary(steady))
    # the exact tokens' matmul work over the median steady pass: the achieved rate
    # that run.py puts next to the matching roofline (benchmarks/roofline.py)
    res["exact_gflop"] = common.minilm_exact_gflop(texts)
    res["steady_gflops"] = res["exact_gflop"] / float(np.median(steady))
    res.setdefault("precision", "float32")
    if name in POLYMASK_MINILM:
        st = enc.runner(None, 32, layout=layout).stats()
        res["polymask_stats"] = st
        # computed tokens per real token: bucket padding and packed rows' tails
        res["computed_over_real_tokens"] = 1.0 / max(1e-9, 1.0 - st["padding_fraction"])
    if phases:
        res.update(phases.result())
    return res


def common_texts(quick, n: int | None = None):
    if n:
        from polymask.cli import stdlib_docstrings

        return stdlib_docstrings(n)
    return common.minilm_texts(quick)


# ----------------------------------------------------------------------------
# workload 3: per-call time of a tiny function
# ----------------------------------------------------------------------------
def percall(name: str, quick: bool) -> dict:
    import statistics

    import numpy as np

    jax, counter = start_jax()
    import jax.numpy as jnp

    phases = Phases(counter)
    kind, inp = name.rsplit("/", 1)
    fun = lambda x: jnp.sum(x * x)
    if kind == "polymask_jit":
        import polymask as pm

        f = pm.jit(fun, "n")
    elif kind == "jax_jit":
        f = jax.jit(fun)
    else:
        raise SystemExit(f"unknown percall contender {name!r}")
    # "numpy" / "array": 100 floats (the per-call overhead); a "-300k" suffix:
    # 300,000 floats, where copying the padded input dominates
    kind_in, _, size = inp.partition("-")
    n = {"": 100, "300k": 300_000}.get(size)
    if kind_in not in ("numpy", "array") or n is None:
        raise SystemExit(f"input kind must be numpy or array[-300k], not {inp!r}")
    x = np.random.default_rng(3).normal(size=n).astype(np.float32)
    if kind_in == "array":
        x = jnp.asarray(x)
    phases.mark("setup")
    r = f(x)
    for _ in range(200):
        r = f(x)
    jax.block_until_ready(r)
    phases.mark("first")
    blocks, inner = (5, 300) if quick else (21, 2000)
    if n > 100:
        inner //= 20
    per = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(inner):
            r = f(x)
        jax.block_until_ready(r)
        per.append((time.perf_counter() - t0) / inner * 1e6)
    phases.mark("steady")
    np.testing.assert_allclose(float(r), float(np.sum(np.asarray(x, np.float64) ** 2)), rtol=1e-4)
    q = statistics.quantiles(per, n=4)
    res = dict(us_per_call=statistics.median(per), us_per_call_q1=q[0], us_per_call_q3=q[2],
               us_per_call_min=min(per), us_per_call_max=max(per), calls_per_block=inner,
               blocks=blocks, **phases.result())
    if hasattr(f, "stats"):
        res["polymask_stats"] = f.stats()
    return res


# ----------------------------------------------------------------------------
CONTENDERS = {
    "attention": ["polymask_jit", "polymask_jit_default", "polymask_jit_numpy", "jax_jit",
                  "handwritten", "torch_eager"],
    "minilm": ["polymask", "polymask_no_reuse", "polymask_coarse", "polymask_cache_cold",
               "polymask_cache_warm", "polymask_packed", "polymask_padded", "polymask_bf16",
               "polymask_bf16_packed", "polymask_bf16_padded", "jax_jit_sorted",
               "sentence_transformers", "sentence_transformers_onnx",
               "sentence_transformers_openvino", "sentence_transformers_openvino_f32"],
    "percall": ["polymask_jit/numpy", "jax_jit/numpy", "polymask_jit/array", "jax_jit/array",
                "polymask_jit/numpy-300k", "jax_jit/numpy-300k", "polymask_jit/array-300k",
                "jax_jit/array-300k"],
}
OPTIONAL = {"torch_eager": "torch", "sentence_transformers": "sentence_transformers",
            "sentence_transformers_onnx": "onnxruntime",
            "sentence_transformers_openvino": "openvino",
            "sentence_transformers_openvino_f32": "openvino"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(CONTENDERS))
    ap.add_argument("--contender")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steady-passes", type=int, default=None)
    ap.add_argument("--emb-out", default=None, help="minilm: save the embeddings (.npy)")
    ap.add_argument("--cache-dir", default=None,
                    help="minilm polymask_cache_*: the persistent cache directory")
    ap.add_argument("--texts", type=int, default=None,
                    help="minilm: stdlib docstrings to embed (default 384; 64 with --quick)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--make-texts", type=int, default=None, metavar="N",
                    help="write ~N short stdlib texts, one a line, to --out and exit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.make_texts:
        texts = common.short_texts(args.make_texts)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(texts) + "\n")
        print(f"{len(texts)} texts -> {args.out}")
        return 0
    if args.list:
        for w, cs in CONTENDERS.items():
            print(w, " ".join(cs))
        return 0
    load0 = os.getloadavg()[0]
    # >= 3 steady passes: polymask.jit compiles an output slice for a shape seen 4 times
    sp = args.steady_passes or (3 if args.quick else 5)
    if args.workload == "attention":
        res = attention(args.contender, args.quick, sp)
    elif args.workload == "minilm":
        res = minilm(args.contender, args.quick, 1 if args.quick else 3, args.emb_out,
                     args.cache_dir, args.texts)
    else:
        res = percall(args.contender, args.quick)
    res.update(workload=args.workload, contender=args.contender, quick=args.quick,
               loadavg_start=load0, process_s=time.perf_counter() - T_PROCESS0,
               python=sys.version.split()[0])
    try:
        import jax

        res["jax"] = jax.__version__
    except ImportError:
        pass
    common.emit(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
