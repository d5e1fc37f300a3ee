"""polymask.jit on code that needs a size as a Python int, against jax.jit.

    python benchmarks/per_size_buckets.py [--rounds 2] [--src DIR ...]

The function loops over the rows in Python (``for i in range(x.shape[0])``)
on ``(n, 8)`` float32 inputs, so every size is a trace of its own. Each
contender (``jax.jit``; ``polymask.jit(f, "n, 8")`` of each ``--src`` tree;
the same with ``max_cases=16``, which keeps one program per bucket) runs in
its own process, order rotated per round, over sizes 1..32 in a fixed random
order: the first call, the other 31 first calls, and the steady time of one
call (n = 6, 200 calls after the pass, each blocked on). Values are checked
against ``jax.jit`` (max deviation printed). Figures are medians over rounds
with min..max and the 1-minute load when each process started.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = """
import json, sys, time, warnings
import jax, jax.numpy as jnp, numpy as np
warnings.simplefilter("ignore")
import polymask as pm
def f(x):
    acc = jnp.zeros(x.shape[1:])
    for i in range(x.shape[0]):
        acc = acc * 0.9 + jnp.tanh(x[i] @ jnp.ones((8, 8)))
    return acc
rng = np.random.default_rng(0)
sizes = [int(s) for s in rng.permutation(np.arange(1, 33))]
xs = [rng.random((n, 8), np.float32) for n in sizes]
kind = sys.argv[1]
r = {"jax": lambda: jax.jit(f), "pm": lambda: pm.jit(f, "n, 8"),
     "pm_one_program": lambda: pm.jit(f, "n, 8", max_cases=16)}[kind]()
t = time.perf_counter(); first = r(xs[0]).block_until_ready(); t_first = time.perf_counter() - t
t = time.perf_counter(); outs = [first] + [r(x).block_until_ready() for x in xs[1:]]
t_rest = time.perf_counter() - t
x = xs[5]
t = time.perf_counter()
for _ in range(200):
    r(x).block_until_ready()
steady = (time.perf_counter() - t) / 200
dev = max(float(jnp.abs(o - jax.jit(f)(x)).max()) for o, x in zip(outs, xs))
s = r.stats() if hasattr(r, "stats") else {}
print("BENCH_RESULT " + json.dumps({"first": t_first, "rest": t_rest, "steady_us": steady * 1e6,
      "deviation": dev, "compiles": s.get("compiles"), "exact": s.get("exact_compiles")}))
"""


def run_one(src: str, kind: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src, JAX_PLATFORMS="cpu")
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, kind], env=env, check=True,
                         capture_output=True, text=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("BENCH_RESULT "))
    return dict(json.loads(line[len("BENCH_RESULT "):]), load=load)


def _cell(values, fmt) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}.." \
           f"{fmt.format(max(values))})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--src", nargs="*", default=[os.path.join(os.path.dirname(__file__),
                                                              "..", "src")])
    args = ap.parse_args(argv)
    jobs = [(args.src[0], "jax")] + [(src, k) for src in args.src
                                     for k in ("pm", "pm_one_program")]
    results: dict = {job: [] for job in jobs}
    for r in range(args.rounds):
        for job in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
            results[job].append(run_one(*job))
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.rounds} rounds, float32")
    print("| source | contender | first call s | other 31 sizes s | steady us | "
          "compiles / exact | max deviation | load |")
    print("|---|---|---|---|---|---|---|---|")
    for (src, kind), runs in results.items():
        pick = lambda k: [x[k] for x in runs]  # noqa: E731
        loads = pick("load")
        print(f"| {src if kind != 'jax' else '-'} | {kind} | {_cell(pick('first'), '{:.2f}')} | "
              f"{_cell(pick('rest'), '{:.2f}')} | {_cell(pick('steady_us'), '{:.0f}')} | "
              f"{runs[0]['compiles']} / {runs[0]['exact']} | {max(pick('deviation')):.1e} | "
              f"{min(loads):.1f}-{max(loads):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
