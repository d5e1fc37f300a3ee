"""The real-program corpus (tests/real, issue #27) through polymask, one test per
program and mode.

Each program runs in a worker subprocess (tests/real/harness.py) with a hang
guard, so a hang fails its test instead of the suite (no mode's time is
asserted). A mode that passes
today must keep passing; a mode that fails today is listed in
tests/real/expected.py and marked ``xfail(strict=True)`` with the failure as
the reason, so a fix shows up as an XPASS (then regenerate expected.py:
``python tools/real_report.py --quick --write-expected tests/real/expected.py``).
The tests run the harness's quick profile (grad on two sizes, eager on one).

Every test here carries the ``real`` marker: ``pytest -m "not real" tests``
skips the corpus (about 12 minutes with ``-n 2`` on 2 cores), CI runs it on
each end of the supported JAX range, half of its tests on each (.ci/run, POLYMASK_TEST_SHARD).
"""

import pytest
from real import corpus, harness
from real.expected import FAILURES, NOT_APPLICABLE

pytestmark = [pytest.mark.real, pytest.mark.slow]  # the slow tier: the real-program corpus: minutes of compiles

# Every mode is stopped only as a hang, never for being slow: no time is
# asserted (speed lives in benchmarks/). The slowest mode takes ~40 s alone on
# 2 cores; the programs' own limits (120 s, 40 s, for the harness's reports)
# tripped when another job shared the cores (session 55: dynamax's grad at 120 s).
HANG_GUARD = 600.0


def _cases():
    for p in corpus.all_programs():
        for m in p.modes:
            if (p.name, m) in NOT_APPLICABLE:
                continue
            marks = ()
            if (p.name, m) in FAILURES:
                status, message = FAILURES[(p.name, m)]
                marks = pytest.mark.xfail(strict=True, raises=AssertionError,
                                          reason=f"{status}: {message}")
            yield pytest.param(p.name, m, marks=marks, id=f"{p.name}-{m}")


@pytest.fixture(scope="module")
def worker():
    w = harness.Worker()
    yield w
    w.close()


def test_corpus_size():
    progs = corpus.all_programs()
    assert len(progs) >= 80
    assert len(corpus.sources()) >= 30
    for p in progs:
        assert p.source and p.license, p.name


@pytest.mark.parametrize("name, mode", list(_cases()))
def test_real_program(worker, name, mode):
    prog = corpus.get(name)
    r = worker.run(name, mode, max(prog.timeout, HANG_GUARD), quick=True)
    assert r["status"] == "pass", f"{r['status']}: {r['detail']}"
    if mode == "pmjit":  # no more programs than jax.jit's, and a bucket each where they share
        assert r["compiles"] + r["exact_compiles"] <= max(r["buckets"], r["distinct_shapes"])
        assert (r["exact_compiles"] or r["static_axes"]
                or r["compiles"] <= r["buckets"]), r["detail"]


def test_not_applicable_modes_stay_so(worker):
    """grad of a program without float output (or whose plain gradient fails)."""
    for name, mode in sorted(NOT_APPLICABLE):
        r = worker.run(name, mode, max(corpus.get(name).timeout, HANG_GUARD), quick=True)
        assert r["status"] == "n/a", (name, mode, r)
