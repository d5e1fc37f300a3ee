"""Host time of one ``ragged_map`` call over many small examples, by layout.

    python benchmarks/host_time.py [--rounds 2] [--examples 5000,20000] [--src DIR ...]

The time a call spends on the host (planning, packing rows, padding, slicing
outputs) grows with the number of examples; its device work here is tiny
(``x.mean(0)`` of ``(n, 8)`` float32, ``n`` in 1..5, rows of 64). Each
(source tree, layout, examples) runs in its own process after a warm-up call
on 50 examples, order rotated per round; figures are medians over rounds
with min..max and the 1-minute load when each process started. ``--src``
compares polymask source trees (a checkout before a change and after it).
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
import json, sys, time
import numpy as np, polymask as pm
layout, n = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(15)
xs = [rng.normal(size=(int(k), 8)).astype(np.float32) for k in rng.integers(1, 6, n)]
run = pm.ragged_map(lambda x: x.mean(0), ("n, 8",), layout=layout, row_size=64)
run(xs[:50])
t = time.perf_counter()
out = run(xs)
dt = time.perf_counter() - t
assert len(out) == n and all(np.allclose(o, x.mean(0), atol=1e-6) for o, x in zip(out, xs))
print("BENCH_RESULT " + json.dumps({"seconds": dt}))
"""


def run_one(src: str, layout: str, n: int) -> dict:
    env = dict(os.environ, PYTHONPATH=src, JAX_PLATFORMS="cpu")
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, layout, str(n)], env=env, check=True,
                         capture_output=True, text=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("BENCH_RESULT "))
    return dict(json.loads(line[len("BENCH_RESULT "):]), load=load)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--examples", default="5000,20000")
    ap.add_argument("--layouts", default="packed,padded")
    ap.add_argument("--src", nargs="*", default=[os.path.join(os.path.dirname(__file__),
                                                              "..", "src")])
    args = ap.parse_args(argv)
    jobs = [(src, layout, int(n)) for src in args.src for layout in args.layouts.split(",")
            for n in args.examples.split(",")]
    results: dict = {job: [] for job in jobs}
    for r in range(args.rounds):
        for job in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
            results[job].append(run_one(*job))
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.rounds} rounds")
    print("| source | layout | examples | seconds, median (min..max) | us per example | load |")
    print("|---|---|---|---|---|---|")
    for (src, layout, n), runs in results.items():
        secs = [x["seconds"] for x in runs]
        loads = [x["load"] for x in runs]
        med = statistics.median(secs)
        print(f"| {src} | {layout} | {n} | {med:.2f} ({min(secs):.2f}..{max(secs):.2f}) | "
              f"{med / n * 1e6:.0f} | {min(loads):.1f}-{max(loads):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
