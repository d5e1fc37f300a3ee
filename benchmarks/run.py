"""polymask benchmark suite: every contender in a fresh process, rotating order, rounds.

    python benchmarks/run.py                       # full suite, 3 rounds -> benchmarks/results/
    python benchmarks/run.py --quick               # smoke run (small sizes, 1 round)
    python benchmarks/run.py --only attention,percall --rounds 5

Workloads (``benchmarks/README.md`` describes the contenders):

  attention  causal attention T x 64, 48 distinct T in 3..97: first pass incl. compiles
             and steady state (the same 48 calls again, several passes)
  minilm     all-MiniLM-L6-v2 on the 384 demo texts: first pass (incl. compiles), steady
  percall    polymask.jit(lambda x: jnp.sum(x*x), "n") on 100 floats (and 300,000) vs jax.jit, NumPy
             and jax.Array inputs, us per call
  process    the whole ``polymask embed FILE`` process on ~1,400 short texts vs a
             sentence-transformers script; no / cold / warm persistent compilation cache

Each (workload, contender) runs in its own process (``contenders.py``), which
counts every XLA compile of that process with JAX's monitoring events. Rounds
rotate the contender order. Every figure is reported as the median over rounds
with min..max, next to the 1-minute load average of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
WORKLOADS = ("attention", "minilm", "percall", "process")
CONTENDERS = {
    "attention": ["polymask_jit", "polymask_jit_default", "polymask_jit_numpy", "jax_jit",
                  "handwritten", "torch_eager"],
    "minilm": ["polymask", "polymask_no_reuse", "polymask_coarse", "polymask_cache",
               "polymask_packed", "polymask_padded", "polymask_bf16", "polymask_bf16_packed",
               "polymask_bf16_padded", "jax_jit_sorted",
               "sentence_transformers",
               "sentence_transformers_onnx", "sentence_transformers_openvino",
               "sentence_transformers_openvino_f32"],
    "percall": ["polymask_jit/numpy", "jax_jit/numpy", "polymask_jit/array", "jax_jit/array",
                "polymask_jit/numpy-300k", "jax_jit/numpy-300k", "polymask_jit/array-300k",
                "jax_jit/array-300k"],
}
NEEDS = {"torch_eager": "torch", "sentence_transformers": "sentence_transformers",
         "sentence_transformers_run1": "sentence_transformers",
         "sentence_transformers_onnx": "onnxruntime",
         "sentence_transformers_openvino": "openvino",
         "sentence_transformers_openvino_f32": "openvino"}
# The CLI's persistent cache is on by default (~/.cache/polymask/xla): every
# variant names its cache explicitly, or "off", so no run sees another's cache.
PM_CACHE_ENV = "POLYMASK_CACHE_DIR={cache}"
PM_NOCACHE_ENV = "POLYMASK_CACHE_DIR=off"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def version_of(python: str, module: str) -> str:
    """``module.__version__`` in interpreter ``python`` ('' when it has none)."""
    return subprocess.run([python, "-c", f"import {module}; print({module}.__version__)"],
                          capture_output=True, text=True, env=child_env()).stdout.strip()


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    # a contender's modules load from bytecode, as on a user's machine: pip
    # compiles a package's at install, and an editable checkout writes its own
    # on first import; a PYTHONDONTWRITEBYTECODE of the shell running the suite
    # (this sandbox sets it) made every polymask process compile its sources
    # while site-packages contenders had bytecode from their install (warm
    # bfloat16 `polymask embed`, `--only process --rounds 2`, 2026-12-05:
    # 3.39 s before, 3.15 s after, torch 9.31 and 9.66 s in the same runs)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra or {})
    return env


def can_import(python: str, module: str) -> bool:
    r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, env=child_env())
    return r.returncode == 0


def rotate(xs: list, r: int) -> list:
    if not xs:
        return xs
    r %= len(xs)
    return xs[r:] + xs[:r]


# ----------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------
def run_contender(python, workload, contender, args, extra=()) -> dict:
    cmd = [python, str(HERE / "contenders.py"), "--workload", workload, "--contender", contender,
           *(["--quick"] if args.quick else []), *extra]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(),
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f"timeout after {args.timeout} s", loadavg_start=load)
    wall = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("BENCH_RESULT ")]
    if p.returncode != 0 or not lines:
        return dict(error=f"rc {p.returncode}: {(p.stderr or p.stdout)[-1500:]}",
                    loadavg_start=load)
    res = json.loads(lines[-1][len("BENCH_RESULT "):])
    res["process_wall_s"] = wall
    return res


def expand_cache_pairs(contenders: list[str], tmp: pathlib.Path, r: int) -> list[tuple]:
    """``(contender, cache dir or None)`` in order; ``polymask_cache`` becomes
    ``polymask_cache_cold`` then ``polymask_cache_warm`` on one fresh directory."""
    out = []
    for c in contenders:
        if c != "polymask_cache":
            out.append((c, None))
            continue
        cache = tmp / f"minilm-cache-round{r}"
        shutil.rmtree(cache, ignore_errors=True)
        out += [("polymask_cache_cold", cache), ("polymask_cache_warm", cache)]
    return out


def run_command(cmd: list[str], env_extra: dict, timeout: float) -> dict:
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(env_extra),
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f"timeout after {timeout} s", loadavg_start=load)
    wall = time.perf_counter() - t0
    res = dict(wall_s=wall, loadavg_start=load, loadavg_end=os.getloadavg()[0],
               command=shlex.join(cmd), env={k: v for k, v in env_extra.items()})
    if p.returncode != 0:
        res["error"] = f"rc {p.returncode}: {(p.stderr or p.stdout)[-1500:]}"
    return res


def process_variants(args, tmp: pathlib.Path, text_file: pathlib.Path, have_st: bool):
    """Units of the process workload; each unit is a list of (name, thunk) run in order."""

    def pm_cmd(out, cache=None):
        words = shlex.split(args.pm_cmd.format(file=text_file, out=out))
        if cache is not None and args.pm_cache_args:
            words += shlex.split(args.pm_cache_args.format(cache=cache))
        report = str(out) + ".compiles.json"
        if words[0] == "polymask":  # count its compiles: run the entry point under the wrapper
            words = [args.python, str(HERE / "count_compiles.py"), "--report", report, "--",
                     *words]
        return words, report

    def pm(name, out, cache=None):
        def thunk():
            cmd, report = pm_cmd(out, cache)
            spec = PM_NOCACHE_ENV if cache is None else args.pm_cache_env.format(cache=cache)
            env = dict(kv.split("=", 1) for kv in shlex.split(spec))
            res = run_command(cmd, env, args.timeout)
            if os.path.exists(report):
                with open(report) as f:
                    res.update(json.load(f))
                os.remove(report)
            res["out"] = str(out)
            return res
        return name, thunk

    def st(name, out, backend="torch"):
        def thunk():
            cmd = shlex.split(args.st_cmd.format(python=args.torch_python, file=text_file,
                                                 out=out, here=HERE))
            if backend != "torch":
                cmd += ["--backend", backend]
            res = run_command(cmd, {}, args.timeout)
            res["out"] = str(out)
            return res
        return name, thunk

    def units(r):
        cache = tmp / f"jax-cache-round{r}"
        if cache.exists():
            shutil.rmtree(cache)
        us = [[pm("polymask_nocache", tmp / f"pm_nocache_{r}.npy")],
              [pm("polymask_cache_cold", tmp / f"pm_cold_{r}.npy", str(cache)),
               pm("polymask_cache_warm", tmp / f"pm_warm_{r}.npy", str(cache))]]
        if have_st:
            us.append([st("sentence_transformers_run1", tmp / f"st1_{r}.npy"),
                       st("sentence_transformers_run2", tmp / f"st2_{r}.npy")])
            for backend in ("onnx", "openvino"):  # exported before the first round
                if can_import(args.torch_python, "onnxruntime" if backend == "onnx"
                              else "openvino"):
                    us.append([st(f"sentence_transformers_{backend}",
                                  tmp / f"st_{backend}_{r}.npy", backend)])
        return us

    return units


def measure_roofline(python: str, tmp: pathlib.Path) -> dict:
    """``benchmarks/roofline.py``'s matmul rates on this machine, in its own
    process: ``{"xla": fp32, "numpy": fp32, "xla_bfloat16": bf16 operands}``."""
    out = tmp / "roofline.json"
    subprocess.run([python, str(HERE / "roofline.py"), "--texts", "64", "--json", str(out)],
                   check=True, env=child_env(), stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["gflops_per_s"]


def roofline_fraction(res: dict, peaks: dict | None):
    """Achieved exact-token GFLOP/s over the matching precision's best rate."""
    if not peaks or res.get("steady_gflops") is None:
        return None
    if res.get("precision") == "bfloat16":
        peak = peaks.get("xla_bfloat16")
    else:
        peak = max(peaks.get("xla", 0), peaks.get("numpy", 0))
    return res["steady_gflops"] / peak if peak else None


def _embeddings_pair(a_path, b_path):
    import numpy as np

    try:
        a, b = np.load(a_path), np.load(b_path)
    except (OSError, ValueError):
        return None
    return (a.astype(np.float64), b.astype(np.float64)) if a.shape == b.shape else None


def max_dev(a_path, b_path):
    pair = _embeddings_pair(a_path, b_path)
    return None if pair is None else float(abs(pair[0] - pair[1]).max())


def min_cosine(a_path, b_path):
    """The smallest cosine between matching rows (embeddings of one text)."""
    import numpy as np

    pair = _embeddings_pair(a_path, b_path)
    if pair is None:
        return None
    a, b = pair
    norms = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
    return float(np.min(np.sum(a * b, axis=1) / norms))


# ----------------------------------------------------------------------------
# aggregation
# ----------------------------------------------------------------------------
METRICS = {
    "attention": [("first_pass_s", "first pass [s]", "{:.3f}"),
                  ("steady_s", "steady pass [s]", "{:.4f}"),
                  ("compiles_first", "XLA compiles, first pass", "{:.0f}"),
                  ("compiles_steady", "XLA compiles, steady passes", "{:.0f}"),
                  ("compiles_total", "XLA compiles, process", "{:.0f}")],
    "minilm": [("first_texts_per_s", "first pass [texts/s]", "{:.1f}"),
               ("steady_texts_per_s", "steady [texts/s]", "{:.1f}"),
               ("setup_s", "imports + model load [s]", "{:.2f}"),
               ("compiles_first", "XLA compiles, first pass", "{:.0f}"),
               ("compiles_steady", "XLA compiles, steady", "{:.0f}"),
               ("compiles_total", "XLA compiles, process", "{:.0f}"),
               ("max_abs_dev", "max abs dev vs polymask", "{:.1e}"),
               ("min_cosine", "min cosine vs polymask", "{:.6f}"),
               ("steady_gflops", "steady GFLOP/s (exact tokens)", "{:.1f}"),
               ("roofline_fraction", "of the roofline", "{:.0%}")],
    "percall": [("us_per_call", "us per call", "{:.1f}"),
                ("compiles_total", "XLA compiles, process", "{:.0f}")],
    "process": [("wall_s", "process wall [s]", "{:.2f}"),
                ("xla_compiles", "XLA compiles", "{:.0f}"),
                # the program store's loads are not JAX cache hits: a warm process
                # that loads its packed row program from the store shows 0 here
                ("cache_hits", "JAX persistent-cache hits", "{:.0f}"),
                ("max_abs_dev", "max abs dev vs polymask_nocache", "{:.1e}")],
}


def derive(workload: str, res: dict) -> dict:
    """Flatten the phase compile counts of a contender result into scalar metrics."""
    comp = res.get("compiles")
    if isinstance(comp, dict):
        res["compiles_first"] = comp.get("first", {}).get("xla_compiles")
        res["compiles_steady"] = sum(v["xla_compiles"] for k, v in comp.items()
                                     if k.startswith("steady"))
        res["compiles_setup"] = comp.get("setup", {}).get("xla_compiles")
    return res


def summarize(values: list) -> dict | None:
    vals = [float(v) for v in values if isinstance(v, (int, float))]
    if not vals:
        return None
    return dict(median=statistics.median(vals), min=min(vals), max=max(vals), n=len(vals))


def aggregate(runs: list[dict]) -> dict:
    agg: dict = {}
    for w in WORKLOADS:
        for c in dict.fromkeys(r["contender"] for r in runs if r["workload"] == w):
            rs = [r for r in runs if r["workload"] == w and r["contender"] == c]
            ok = [r for r in rs if "error" not in r]
            entry = dict(rounds=len(rs), failed=len(rs) - len(ok),
                         errors=[r["error"] for r in rs if "error" in r][:2],
                         loadavg=summarize([r.get("loadavg_start") for r in rs]))
            for key, _, _ in METRICS[w]:
                entry[key] = summarize([r.get(key) for r in ok])
            if w == "attention" and ok:
                cums = [r["cumulative_s"] for r in ok]
                entry["cumulative_s_median"] = [statistics.median(v) for v in zip(*cums)]
                entry["lengths"] = ok[0]["lengths"]
            pst = [r["polymask_stats"] for r in ok if "polymask_stats" in r]
            if pst:
                entry["polymask_stats"] = pst[-1]
            names = [r["compile_names"] for r in ok if "compile_names" in r]
            if names:
                entry["compile_names_last_round"] = names[-1]
            agg.setdefault(w, {})[c] = entry
    return agg


def fmt(s: dict | None, f: str) -> str:
    if s is None:
        return "-"
    if s["n"] == 1 or s["min"] == s["max"]:
        return f.format(s["median"])
    return f"{f.format(s['median'])} ({f.format(s['min'])}..{f.format(s['max'])})"


def markdown(agg: dict, env: dict) -> str:
    lines = [f"Measured {env['date']} on {env['machine']} ({env['cpus']} CPUs), python "
             f"{env['python']}, jax {env['jax']}, numpy {env.get('numpy', '?')} (sentence-transformers' "
             f"interpreter: numpy {env.get('numpy_torch', '?')}), `{env['command']}`: {env['rounds']} round(s), "
             "each contender in a fresh process, order rotated per round. Figures: median "
             "over rounds (min..max); load = 1-minute load average when each process started.",
             ""]
    titles = {"attention": "attention: causal attention T x 64, distinct T "
                           f"{env.get('attention_lengths', '')}",
              "minilm": f"minilm: all-MiniLM-L6-v2 on {env.get('minilm_texts', '?')} demo texts",
              "percall": "percall: `jnp.sum(x*x)` on 100 float32 (`-300k`: 300,000), steady state",
              "process": f"process: `polymask embed FILE` on {env.get('process_texts', '?')} short "
                         "texts vs sentence-transformers, whole process wall time"}
    for w, per in agg.items():
        lines += [f"### {titles[w]}", ""]
        cols = METRICS[w]
        lines.append("| contender | " + " | ".join(c[1] for c in cols) + " | load |")
        lines.append("|---" * (len(cols) + 2) + "|")
        for c, e in per.items():
            cells = [fmt(e.get(k), f) for k, _, f in cols]
            note = f" ({e['failed']} failed)" if e["failed"] else ""
            lines.append(f"| {c}{note} | " + " | ".join(cells) + f" | {fmt(e['loadavg'], '{:.1f}')} |")
        for c, e in per.items():
            if e.get("polymask_stats"):
                st = e["polymask_stats"]
                lines.append("")
                lines.append(f"{c}: polymask stats (last round) " + ", ".join(
                    f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in st.items()))
            if e.get("compile_names_last_round"):
                flat = {}
                for ph in e["compile_names_last_round"].values():
                    for k, v in ph.items():
                        flat[k] = flat.get(k, 0) + v
                if flat:
                    lines.append("")
                    lines.append(f"{c}: XLA compiles by program (last round, whole process) "
                                 + ", ".join(f"`{k}` {v}" for k, v in sorted(flat.items())))
            if e["errors"]:
                lines.append("")
                lines.append(f"{c}: error: `{e['errors'][0][-300:].strip()}`")
        lines.append("")
    return "\n".join(lines)


def plots(agg: dict, out: pathlib.Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []

    def bars(ax, per, key, scale=1.0):
        names, med, lo, hi = [], [], [], []
        for c, e in per.items():
            s = e.get(key)
            if s:
                names.append(c)
                med.append(s["median"] * scale)
                lo.append((s["median"] - s["min"]) * scale)
                hi.append((s["max"] - s["median"]) * scale)
        ax.bar(names, med, yerr=[lo, hi], capsize=4)
        ax.tick_params(axis="x", rotation=25)
        return names

    if "attention" in agg:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for c, e in agg["attention"].items():
            cum = e.get("cumulative_s_median")
            if cum:
                comp = e.get("compiles_first")
                note = f"{comp['median']:.0f} XLA compiles" if comp else "no XLA"
                ax.plot(range(1, len(cum) + 1), cum, label=f"{c} ({note})")
        ax.set_xlabel("call index (each a new T)")
        ax.set_ylabel("cumulative wall time [s] (median over rounds)")
        ax.set_yscale("log")
        ax.set_title("attention: first pass over distinct lengths, incl. compiles")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "attention_first_pass.png", dpi=110)
        plt.close(fig)
        files.append("attention_first_pass.png")
    if "minilm" in agg:
        fig, axs = plt.subplots(1, 2, figsize=(9, 4))
        bars(axs[0], agg["minilm"], "first_texts_per_s")
        axs[0].set_title("first pass (incl. compiles)")
        axs[0].set_ylabel("texts/s (median, min..max)")
        bars(axs[1], agg["minilm"], "steady_texts_per_s")
        axs[1].set_title("steady state")
        fig.suptitle("minilm: all-MiniLM-L6-v2 on the demo texts")
        fig.tight_layout()
        fig.savefig(out / "minilm_texts_per_s.png", dpi=110)
        plt.close(fig)
        files.append("minilm_texts_per_s.png")
    for w, key, ylabel, title in (("percall", "us_per_call", "us per call", "percall: sum(x*x), 100 / 300,000 floats"),
                                  ("process", "wall_s", "process wall time [s]", "process: embed a file")):
        if w in agg:
            fig, ax = plt.subplots(figsize=(7, 4))
            bars(ax, agg[w], key)
            ax.set_ylabel(ylabel)
            ax.set_title(title)
            fig.tight_layout()
            fig.savefig(out / f"{w}.png", dpi=110)
            plt.close(fig)
            files.append(f"{w}.png")
    return files


# ----------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--quick", action="store_true", help="smoke run: small sizes, 1 round")
    ap.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads")
    ap.add_argument("--contenders", default=None,
                    help="comma-separated contender names to keep (default: all available)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --quick 1)")
    ap.add_argument("--out", default=None,
                    help="output directory (default benchmarks/results, "
                         "--quick: benchmarks/results/quick, not committed)")
    ap.add_argument("--python", default=sys.executable, help="interpreter of the JAX contenders")
    ap.add_argument("--torch-python", default=None,
                    help="interpreter of the torch / sentence-transformers contenders "
                         "(default --python); skipped when it cannot import them")
    ap.add_argument("--timeout", type=float, default=3600, help="per process [s]")
    ap.add_argument("--process-texts", type=int, default=None, help="default 1400 (--quick 200)")
    ap.add_argument("--minilm-texts", type=int, default=None,
                    help="minilm workload: stdlib docstrings (default 384; --quick 64)")
    ap.add_argument("--pm-cmd", default="polymask embed {file} --out {out}",
                    help="polymask command line of the process workload ({file}, {out}); "
                         "a leading 'polymask' runs polymask.cli:main under count_compiles.py")
    ap.add_argument("--pm-cache-args", default="",
                    help="appended to --pm-cmd for the cache variants ({cache}), "
                         "e.g. '--cache-dir {cache}'")
    ap.add_argument("--pm-cache-env", default=PM_CACHE_ENV,
                    help="NAME=VALUE words set for the cache variants ({cache}); '' for none")
    ap.add_argument("--pm-cache-dir", default=None,
                    help="where the cache variants' cache directories go (default: a temp dir)")
    ap.add_argument("--st-cmd", default="{python} {here}/st_embed.py {file} --out {out}",
                    help="sentence-transformers command of the process workload")
    args = ap.parse_args(argv)
    args.torch_python = args.torch_python or args.python
    rounds = args.rounds or (1 if args.quick else 3)
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    bad = [w for w in only if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown workload(s) {bad}; choose from {', '.join(WORKLOADS)}")
    keep = set(args.contenders.split(",")) if args.contenders else None
    out = pathlib.Path(args.out or HERE / "results" / ("quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)

    have = {m: can_import(args.torch_python, m) for m in set(NEEDS.values())}
    skipped = {}
    lists = {}
    for w in only:
        if w == "process":
            continue
        cs = []
        for c in CONTENDERS[w]:
            if keep is not None and c not in keep:
                continue
            need = NEEDS.get(c)
            if need and not have[need]:
                skipped[f"{w}/{c}"] = f"`import {need}` fails in {args.torch_python}"
                continue
            cs.append(c)
        lists[w] = cs
    if "process" in only and not have["sentence_transformers"]:
        skipped["process/sentence_transformers"] = (
            f"`import sentence_transformers` fails in {args.torch_python}")
    for k, v in skipped.items():
        log(f"skip {k}: {v}")

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="polymask-bench-",
                                        dir=args.pm_cache_dir or None))
    env = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               machine=f"{platform.machine()} {platform.system()} {platform.node()}",
               cpus=os.cpu_count(), python=sys.version.split()[0], rounds=rounds,
               jax=version_of(args.python, "jax"), numpy=version_of(args.python, "numpy"),
               # numpy 2.4 with ml_dtypes 0.7 makes `import jax` 0.6 s slower than
               # numpy 2.5 (benchmarks/README.md): each interpreter's is recorded
               numpy_torch=version_of(args.torch_python or args.python, "numpy"),
               loadavg_at_start=os.getloadavg(), command=shlex.join(
                   ["python", "benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])]),
               skipped=skipped, python_jax=args.python, python_torch=args.torch_python)
    if "attention" in only:
        n = 12 if args.quick else 48
        env["attention_lengths"] = f"({n} in 3..97)"
    env["minilm_texts"] = args.minilm_texts or (64 if args.quick else 384)
    if "minilm" in only:  # the matmul rates the achieved GFLOP/s are a fraction of
        env["roofline_gflops_per_s"] = measure_roofline(args.python, tmp)
        log(f"roofline (GFLOP/s): {env['roofline_gflops_per_s']}")
    runs: list[dict] = []
    t_start = time.perf_counter()
    units = None
    # bytecode for polymask's modules before the first timed process (child_env)
    subprocess.run([args.python, "-c", "import polymask.cli, polymask.models"], check=True,
                   env=child_env(), stdout=subprocess.DEVNULL)
    if "process" in only:
        text_file = tmp / "texts.txt"
        n_texts = args.process_texts or (200 if args.quick else 1400)
        subprocess.run([args.python, str(HERE / "contenders.py"), "--make-texts", str(n_texts),
                        "--out", str(text_file)], check=True, env=child_env(),
                       stdout=subprocess.DEVNULL)
        env["process_texts"] = sum(1 for _ in open(text_file, encoding="utf-8"))
        env["pm_cmd"], env["pm_cache_args"], env["pm_cache_env"] = (
            args.pm_cmd, args.pm_cache_args, args.pm_cache_env)
        units = process_variants(args, tmp, text_file, have["sentence_transformers"]
                                 and (keep is None or any("sentence" in k for k in keep)))
    try:
        for r in range(rounds):
            for w in only:
                if w == "process":
                    ref = None
                    for unit in rotate(units(r), r):
                        for name, thunk in unit:
                            if keep is not None and name not in keep and not any(
                                    name.startswith(k) for k in keep):
                                continue
                            log(f"[round {r + 1}/{rounds}] process {name} ...")
                            res = thunk()
                            res.update(workload=w, contender=name, round=r)
                            runs.append(res)
                            log(f"    {res.get('wall_s', float('nan')):.1f} s"
                                f"{'  ERROR ' + res['error'][-300:] if 'error' in res else ''}")
                    outs = {x["contender"]: x["out"] for x in runs
                            if x["workload"] == w and x["round"] == r and "error" not in x}
                    ref = outs.get("polymask_nocache")
                    for x in runs:
                        if x["workload"] == w and x["round"] == r and ref and "error" not in x:
                            x["max_abs_dev"] = max_dev(ref, x["out"])
                    continue
                ref = None
                # polymask_cache: a cold-cache process fills a fresh cache directory,
                # then a warm-cache process (the "first pass with a warm cache")
                for c, cache in expand_cache_pairs(rotate(lists[w], r), tmp, r):
                    log(f"[round {r + 1}/{rounds}] {w} {c} ...")
                    extra = [] if cache is None else ["--cache-dir", str(cache)]
                    if w == "minilm":
                        extra += ["--emb-out", str(tmp / f"minilm_{c}_{r}.npy")]
                        if args.minilm_texts:
                            extra += ["--texts", str(args.minilm_texts)]
                    res = derive(w, run_contender(
                        args.torch_python if c in NEEDS else args.python, w, c, args, extra))
                    res.update(workload=w, contender=c, round=r)
                    runs.append(res)
                    if "error" in res:
                        log(f"    ERROR {res['error'][-500:]}")
                    else:
                        log(f"    done in {res['process_wall_s']:.1f} s (load "
                            f"{res['loadavg_start']:.1f})")
                if w == "minilm":
                    ref = tmp / f"minilm_polymask_{r}.npy"
                    ref_sha = next((x.get("texts_sha256") for x in runs
                                    if x["workload"] == w and x["round"] == r
                                    and x["contender"] == "polymask"), None)
                    for x in runs:
                        if x["workload"] == w and x["round"] == r and "error" not in x:
                            if ref_sha and x.get("texts_sha256") != ref_sha:  # other stdlib
                                log(f"    {x['contender']}: not compared, it embedded other "
                                    "texts than polymask (the corpus is the interpreter's "
                                    "stdlib docstrings: give --python and --torch-python "
                                    "one Python version)")
                                x["max_abs_dev"] = x["min_cosine"] = None
                            else:
                                mine = tmp / f"minilm_{x['contender']}_{r}.npy"
                                x["max_abs_dev"] = max_dev(ref, mine)
                                x["min_cosine"] = min_cosine(ref, mine)
                            x["roofline_fraction"] = roofline_fraction(
                                x, env.get("roofline_gflops_per_s"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    env["total_s"] = time.perf_counter() - t_start
    env["loadavg_at_end"] = os.getloadavg()
    agg = aggregate(runs)
    md = markdown(agg, env)
    if skipped:
        md += "\nSkipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + "\n"
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps(dict(env=env, aggregate=agg, runs=runs),
                                                 indent=1, default=str))
    try:
        pngs = plots(agg, out)
    except ImportError:
        pngs = []
        log("matplotlib not installed (pip install 'polymask[bench]'): no plots")
    print(md)
    log(f"wrote {out / 'results.json'}, {out / 'results.md'}"
        + "".join(f", {out / p}" for p in pngs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
