"""Runs every script in examples/ as a user would (a fresh process), each with
the install line its docstring names (``Install:``) satisfied by the test extra.

examples/multihost.py starts several processes; tests/test_distributed.py runs
it as its docstring says (``--launch 2``) and compares with one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# short runs of each script: (arguments, modules it needs beyond polymask)
RUNS = {
    "quickstart.py": ([], ()),
    "train_ragged.py": (["--steps", "20", "--out", "{tmp}/train_ragged.png"],
                        ("flax", "optax", "matplotlib")),
}
ELSEWHERE = {"multihost.py": "tests/test_distributed.py runs it with --launch 2"}


def test_every_example_is_run_or_says_where():
    names = {p.name for p in EXAMPLES}
    assert names == set(RUNS) | set(ELSEWHERE), names


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_docstring_names_its_install_line(example):
    import ast

    doc = ast.get_docstring(ast.parse(example.read_text()))
    assert doc and "Install:" in doc and "pip install" in doc, example.name


@pytest.mark.parametrize("name", [
    "quickstart.py",                                        # ~8 s
    pytest.param("train_ragged.py", marks=pytest.mark.slow),  # ~25 s (flax compiles)
])
def test_example_runs(name, tmp_path):
    args, needs = RUNS[name]
    for module in needs:
        pytest.importorskip(module)
    env = {k: v for k, v in os.environ.items() if k != "POLYMASK_TIERED"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name),
                           *(a.format(tmp=tmp_path) for a in args)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    if name == "train_ragged.py":
        assert "compiles 1" in proc.stdout and (tmp_path / "train_ragged.png").is_file()
