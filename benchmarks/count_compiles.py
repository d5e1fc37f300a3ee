"""Run a command-line entry point with every XLA compile of the process counted.

    python benchmarks/count_compiles.py --report R.json -- polymask embed FILE --out F.npy

The first word after ``--`` names the entry point: ``polymask`` (``polymask.cli:main``)
or ``module:function``. The counts (``common.CompileCounter``) are written to
``--report`` when the command returns; its exit status is passed through.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

ENTRIES = {"polymask": "polymask.cli:main"}


def main() -> int:
    argv = sys.argv[1:]
    if len(argv) < 4 or argv[0] != "--report" or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    report, cmd = argv[1], argv[3:]
    t0 = time.perf_counter()
    counter = common.CompileCounter().install()
    mod, _, fn = ENTRIES.get(cmd[0], cmd[0]).partition(":")
    rc = 1
    try:
        rc = int(getattr(importlib.import_module(mod), fn or "main")(cmd[1:]) or 0)
    finally:
        snap = counter.snapshot()
        snap["wrapped_s"] = time.perf_counter() - t0
        snap["rc"] = rc
        with open(report, "w") as f:
            json.dump(snap, f)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
