"""tools/coverage.py: the coverage table lists every registered primitive as covered.

Other rule families keep registering primitives, so the table is regenerated
here rather than compared with the committed docs/coverage.md.
"""

import importlib.util
from pathlib import Path

import pytest

from polymask import _jax_compat as compat
from polymask.rules import registered_primitives

TOOL = Path(__file__).resolve().parent.parent / "tools" / "coverage.py"


@pytest.fixture(scope="module")
def coverage():
    spec = importlib.util.spec_from_file_location("polymask_coverage_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rows(coverage):
    return coverage.table()


def test_all_primitives_finds_lax_and_control_flow():
    prims = compat.all_primitives()
    for name in ("add", "dot_general", "gather", "scan", "while", "cond", "jit",
                 "custom_jvp_call", "custom_vjp_call", "dim_as_value", "lu", "cholesky",
                 "triangular_solve", "custom_linear_solve", "fft", "sort", "conv_general_dilated",
                 "reduce_window_sum", "remat2", "random_bits"):
        assert name in prims, name
    assert len(prims) > 200


def test_every_registered_primitive_is_listed_as_covered(rows):
    status = {r["primitive"]: r["status"] for r in rows}
    for name in registered_primitives():
        assert status.get(name) == "covered", name


def test_uncovered_rows_have_reasons(rows):
    covered = set(registered_primitives())
    names = [r["primitive"] for r in rows]
    assert len(names) == len(set(names))
    for r in rows:
        assert (r["status"] == "covered") == (r["primitive"] in covered), r
        if r["status"] != "covered":
            assert r["note"], r


def test_generated_markdown(coverage, rows):
    text = coverage.generate()
    assert text.startswith("# Primitive coverage")
    table_lines = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert len(table_lines) == len(rows)
    assert "| `triangular_solve` |" in text
