"""Architecture invariants of the package layout (docs/CONTRIBUTING.md's file map)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "polymask"


def test_no_import_cycles():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "import_cycles.py")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 import cycles" in r.stdout


def test_interpreter_names_no_primitive():
    from polymask import _jax_compat as compat

    text = (SRC / "tracing" / "interpreter.py").read_text()
    named = [p for p in compat.all_primitives() if f'"{p}"' in text or f"'{p}'" in text]
    assert not named, named


def test_private_jax_api_only_in_the_compat_package():
    import re

    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if "_jax_compat" not in p.parts
                 and re.search(r"^\s*(from|import)\s+jax\._src", p.read_text(), re.M)]
    assert offenders == []
