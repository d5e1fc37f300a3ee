"""The packed-layout differential tester (tools/packed_fuzz.py): a short fixed-seed run."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import packed_fuzz  # noqa: E402

from polymask.packing import registry  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier: the packed fuzzer's fixed-seed run


def test_packed_fuzz_fixed_seed_short_run():
    res = packed_fuzz.run(seed=0, programs=None,
                          seconds=float(os.environ.get("PM_PACKED_FUZZ_SECONDS", 10)),
                          verbose=True)
    print(packed_fuzz.summary(res))
    assert res["programs"] >= 1
    msgs = "\n\n".join(f"[{i}] {kind}: {msg}" for i, kind, _, _, msg in res["failures"])
    assert not res["failures"], f"{len(res['failures'])} packed fuzz failures:\n{msgs}"


def test_packed_fuzz_catches_a_wrong_rule_and_prints_a_program():
    ops = [op for op in packed_fuzz.OPS if op.name in ("proj", "cumsum")]
    prog = packed_fuzz.Program(ops, None, 8, [0, 1, 8, 9, 3, 2, 2, 1])
    good = registry._RULES["cumsum"]

    def wrong(ctx, x, **params):
        return good(ctx, x, **params) * 1.5

    registry._RULES["cumsum"] = wrong
    try:
        out = packed_fuzz.run_one(prog, np.random.default_rng(0), checks=("values",),
                                  shrink_seen=set())
        assert out.status == "fail" and out.failures[0][0] == "value"
        msg = out.failures[0][3]
        assert "--- runnable program ---" in msg
        program = msg.split("--- runnable program ---\n", 1)[1]
        assert "x = jnp.cumsum(x, axis=0)  # cumsum" in program
        assert "pm.ragged_map(f, (\"n, 4\",), layout=\"packed\", row_size=8)" in program
        # the printed program reproduces the failure while the rule is wrong ...
        try:
            exec(compile(program, "<packed fuzz repro>", "exec"), {})
        except AssertionError as e:
            assert "differ from plain JAX" in str(e)
        else:
            raise AssertionError("the printed program did not reproduce the failure")
    finally:
        registry._RULES["cumsum"] = good
    # ... and passes with the rule restored
    exec(compile(program, "<packed fuzz repro>", "exec"), {})


def test_packed_fuzz_min_n_table_matches_plain_jax():
    assert packed_fuzz.check_min_n(verbose=True) == []
