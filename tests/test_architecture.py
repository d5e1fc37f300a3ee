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


def _import_tool():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import import_cycles
    finally:
        sys.path.pop(0)
    return import_cycles


def test_layers_import_only_downward():
    """No package imports a layer above it (function-level imports included),
    so the layers form no cycle; every package is placed in the layer table."""
    tool = _import_tool()
    graph = tool.module_graph()
    assert {tool.layer_of(m) for m in graph} == set(tool.LAYERS)
    assert tool.upward_imports(graph) == []
    assert tool.find_cycles(tool.layer_graph(graph)) == []


def test_the_layer_check_sees_function_level_imports(tmp_path):
    tool = _import_tool()
    pkg = tmp_path / "polymask"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "runners.py").write_text("X = 1\n")
    (pkg / "core" / "low.py").write_text("def f():\n    from ..runners import X\n    return X\n")
    mods = {"polymask.core.low": pkg / "core" / "low.py", "polymask.runners": pkg / "runners.py"}
    graph = {m: tool.imports(m, p, mods) for m, p in mods.items()}
    assert tool.upward_imports(graph) == [("polymask.core.low", "polymask.runners")]
    # absolute imports of polymask count too, in every form
    for text in ("def f():\n    from polymask.runners import X\n",
                 "def f():\n    import polymask.runners\n",
                 "from polymask import runners\n"):
        (pkg / "core" / "low.py").write_text(text)
        graph = {m: tool.imports(m, p, mods) for m, p in mods.items()}
        assert tool.upward_imports(graph) == [("polymask.core.low", "polymask.runners")], text


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
    # the tests too: what they need of it is _jax_compat/testing.py (the peer
    # suite runs JAX's own test harnesses, which it finds by importorskip)
    tests = pathlib.Path(__file__).parent
    offenders = [p.name for p in tests.rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+jax\._src", p.read_text(), re.M)]
    assert offenders == []


def _file_map() -> list[str]:
    """The module paths named in docs/CONTRIBUTING.md's file map (first column)."""
    import re

    text = (ROOT / "docs" / "CONTRIBUTING.md").read_text()
    section = text.split("### File map", 1)[1].split("\n### ", 1)[0]
    paths = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split(" | ", 1)[0]
            paths += re.findall(r"`([\w/]+\.py)`", first)
    return paths


def test_contributing_file_map_matches_the_tree():
    """Every module the file map names exists, and every module is named
    (package entry modules and ``__main__`` speak for themselves)."""
    named = _file_map()
    assert [p for p in named if not (SRC / p).is_file()] == []
    tree = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                  if "fixtures" not in p.parts and p.name != "__main__.py"
                  and not (p.name == "__init__.py" and p.parent != SRC and p.parent.name != "cli"))
    assert [p for p in tree if p not in named] == []


def test_every_package_says_its_job_and_what_it_may_import():
    for init in sorted(SRC.glob("*/__init__.py")):
        doc = init.read_text().lstrip()
        assert doc.startswith('"""'), init
        assert "Layer" in doc.split('"""')[1], init


def test_public_modules_import_by_their_public_names():
    """``polymask.buckets`` is public (README): importable as a module too."""
    from polymask.buckets import pow2

    import polymask

    assert polymask.buckets.pow2 is pow2 and pow2(16)(17) == 32
