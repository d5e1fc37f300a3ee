"""tools/peer_suite.py: JAX's shape-polymorphism harnesses under polymask.mask.

Runs on ``tools/peer/mini_shape_poly_test.py`` (three harnesses copied from
JAX's tests/shape_poly_test.py), so no copy of the full file is needed. Set
``POLYMASK_JAX_SHAPE_POLY_TEST`` to a copy of the full file to also run two of
its harnesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("absl")
pytest.importorskip("jax._src.test_util")
pytest.importorskip("jax._src.internal_test_util.test_harnesses")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import peer_suite  # noqa: E402

from polymask.tracing import registry  # noqa: E402

MINI = os.path.join(ROOT, "tools", "peer", "mini_shape_poly_test.py")


def _env():
    env = dict(os.environ)
    src = os.path.join(ROOT, "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_peer_suite_classifies_a_fixed_subset(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "peer_suite.py"), "--jax-tests", MINI,
         "--out", str(out), "--timeout", "120"],
        capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    status = {c["fullname"]: c for c in res["cases"]}
    assert status["add_"]["status"] == "pass"
    pad = status["pad_poly_padding_config"]
    assert pad["status"] == "refused" and pad["primitive"] == "pad", pad
    assert status["squeeze_axis_None"]["status"] == "skip"
    assert res["totals"]["pass"] == 1 and res["totals"]["total"] == 3
    assert "TOTAL" in proc.stdout and "refusal reasons:" in proc.stdout


def _add_harness():
    mod = peer_suite.load_harness_module(MINI)
    (h,) = [h for h in peer_suite.flat_harnesses(mod) if h.group_name == "add"]
    return h


@pytest.mark.parametrize("kind", ["wrong", "nan", "crash"])
def test_peer_suite_catches_a_bad_rule(kind):
    h = _add_harness()
    good = registry.get_rule("add")

    def bad(ctx, *args, **params):
        if kind == "crash":
            raise RuntimeError("boom")
        out = good(ctx, *args, **params)
        return out * 1.5 if kind == "wrong" else out * float("nan")

    registry.register_rule("add", bad, override=True)
    try:
        r = peer_suite.run_case(h)
    finally:
        registry.register_rule("add", good, override=True)
    if kind == "crash":
        assert r["status"] == "crash" and "RuntimeError: boom" in r["message"], r
    else:
        assert r["status"] == "wrong", r
        assert bool(r.get("nan_leak")) == (kind == "nan"), r


@pytest.mark.skipif(not os.environ.get("POLYMASK_JAX_SHAPE_POLY_TEST"),
                    reason="POLYMASK_JAX_SHAPE_POLY_TEST (a copy of JAX's shape_poly_test.py) "
                           "not set")
def test_peer_suite_on_the_real_file(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "peer_suite.py"), "--jax-tests",
         os.environ["POLYMASK_JAX_SHAPE_POLY_TEST"], "--case", "add_", "--case",
         "arange_0_b+1", "--out", str(out)],
        capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert [c["status"] for c in res["cases"]] == ["pass", "pass"]
