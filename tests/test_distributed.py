"""Past one machine: two JAX processes (CPU devices, coordinator on localhost) run a
masked program on a ragged batch sharded over the global mesh; the results equal
the single-process run and the exact per-example values."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import polymask as pm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import multihost  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier: starts several JAX processes


def test_two_processes_global_mesh(tmp_path):
    out = tmp_path / "result.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "multihost.py"),
                           "--launch", "2", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = np.load(out)
    assert int(got["processes"]) == 2 and int(got["devices"]) == 4

    xs = multihost.example_data()
    batch = pm.stack(xs, bound=(multihost.BOUND, multihost.D))
    mixed, mean_sq = jax.jit(jax.vmap(pm.mask(multihost.f, "n, 4", checks=False)))(batch)
    np.testing.assert_allclose(got["mean_sq"], np.asarray(mean_sq.data), rtol=1e-6)
    ref = pm.Masked(got["mixed"], mixed.shape)
    for a, b, x in zip(ref.unpad(), mixed.unpad(), xs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(a, multihost.f(x)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["total"], float(mixed.filled(0.0).sum()), rtol=1e-5)
