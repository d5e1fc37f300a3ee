"""bfloat16: the encoder's precision option, and mixed precision through both layouts.

Oracle: plain JAX per example in the same precision (values within bfloat16's
rounding, NaN/inf isolation bitwise), and the float32 model (cosine).
The packed layout's per-family bfloat16 isolation is in test_packed_invariant.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm

BF16 = jnp.bfloat16
SIZES = [3, 5, 2, 4, 1, 0]


def _examples(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n, 8)).astype(BF16) for n in SIZES]


def _mixed_attention(w, x):
    """bfloat16 operands, float32 accumulation and softmax (the encoder's recipe)."""
    q = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    s = jnp.matmul(q.astype(BF16), x.T, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(s / 8.0, axis=-1)
    ctx = jnp.matmul(p.astype(BF16), x, preferred_element_type=jnp.float32)
    return jnp.mean(ctx, axis=0), jnp.sum(x.astype(jnp.float32), axis=0)


def _f64(a):
    return np.asarray(a).astype(np.float64)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_mixed_precision_attention_matches_plain_per_example_and_isolates_nan(layout):
    w = jnp.asarray(np.random.default_rng(1).normal(size=(8, 8)), BF16)
    clean = _examples()
    dirty = [a.copy() for a in clean]
    dirty[1][2, 3] = np.nan
    dirty[3][0, 0] = np.inf
    rm = pm.ragged_map(_mixed_attention, ("n, 8",), layout=layout, row_size=16,
                       buckets=pm.buckets.pow2(4) if layout == "padded" else None)
    got_clean, got_dirty = rm(clean, w), rm(dirty, w)
    for i, ex in enumerate(clean):
        want = _mixed_attention(w, jnp.asarray(ex))
        for u, v in zip(got_clean[i], want):
            assert u.dtype == v.dtype == jnp.float32
            np.testing.assert_allclose(_f64(u), _f64(v), rtol=2e-2, atol=2e-2,
                                       err_msg=f"example {i}")
        if i in (1, 3):  # the corrupted ones: non-finite where plain JAX is
            with np.errstate(invalid="ignore"):
                plain = _mixed_attention(w, jnp.asarray(dirty[i]))
            for u, v in zip(got_dirty[i], plain):
                np.testing.assert_array_equal(np.isfinite(_f64(u)), np.isfinite(_f64(v)))
            continue
        for u, v in zip(got_dirty[i], got_clean[i]):  # bitwise: the neighbour changed nothing
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=f"example {i}")


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_bfloat16_masks_and_segment_sums_ignore_the_padding(layout):
    """Masked mean, max and softmax over the logical rows only, in bfloat16 itself."""
    def f(x):
        return jnp.mean(x, 0), jnp.max(x, 0), jax.nn.softmax(x[:, 0]), x.shape[0] * x[-1:]

    xs = [a for a in _examples(2) if len(a)]
    rm = pm.ragged_map(f, ("n, 8",), layout=layout, row_size=16)
    for i, (got, ex) in enumerate(zip(rm(xs), xs)):
        for u, v in zip(got, f(jnp.asarray(ex))):
            assert u.dtype == v.dtype == BF16
            np.testing.assert_allclose(_f64(u), _f64(v), rtol=1e-2, atol=1e-2,
                                       err_msg=f"example {i}")


def test_masked_padding_garbage_in_bfloat16_never_reaches_the_result():
    f = pm.mask(lambda x: (jnp.sum(x, 0), jnp.cumsum(x, 0)), "n, 4")
    x = np.random.default_rng(3).normal(size=(6, 4)).astype(BF16)
    for n in range(7):
        padded = x.copy()
        padded[n:] = np.nan
        total, cum = f(pm.Masked(jnp.asarray(padded), (n, 4)))
        np.testing.assert_array_equal(np.asarray(total.data), np.asarray(jnp.sum(x[:n], 0)))
        np.testing.assert_array_equal(np.asarray(cum.data)[:n], np.asarray(jnp.cumsum(x[:n], 0)))


@pytest.mark.parametrize("native", [True, False])
def test_layout_cost_weighs_bfloat16_dots_by_the_backends_rate(monkeypatch, native):
    """Where bfloat16 is native (AMX: ~4x float32's dot rate) a bfloat16 dot
    weighs a quarter of a float32 one in the layout cost, so elementwise work
    (a packed row's R^2 softmax) decides more; emulated, three times more."""
    from polymask import _jax_compat as compat
    from polymask.packing import cost
    from polymask.tracing.symbolic import trace

    monkeypatch.setattr(compat, "native_bfloat16", lambda: native)
    w = jnp.ones((64, 64))

    def f(x, w):
        return jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32)

    costs = {}
    for dt in (jnp.float32, jnp.bfloat16):
        prog, _ = trace(f, (jax.ShapeDtypeStruct((32, 64), jnp.float32), w.astype(dt)),
                        ("n, 64", None))
        costs[dt] = cost.program_cost(prog, "n", 32)
    dot = 2.0 * 32 * 64 * 64
    elems = costs[jnp.float32] - dot
    weight = cost.BF16_DOT_WEIGHT_NATIVE if native else cost.BF16_DOT_WEIGHT_EMULATED
    assert costs[jnp.bfloat16] == pytest.approx(elems + 32 * 64 + weight * dot)  # + the convert


def test_bfloat16_encoder_keeps_xlas_library_fusions_for_its_refined_programs(tmp_path):
    """XLA:CPU's YNNPACK fusions are what run bfloat16 dots on AMX: the
    run-speed options (fusions off) apply to float32 encoders only, and only
    where they exist (jax 0.10: ``compat.xla_cpu_run_speed_options``)."""
    pytest.importorskip("safetensors")
    from test_bert import _tiny_model_dir

    from polymask.models.loader import SentenceEncoder

    d = str(tmp_path)
    _tiny_model_dir(tmp_path)
    opts = {p: SentenceEncoder(d, precision=p).runner().refinement.refined_options
            for p in ("float32", "bfloat16")}
    assert opts["bfloat16"] in ({}, None)
    from polymask import _jax_compat as compat

    assert opts["float32"] in ({}, None, compat.xla_cpu_run_speed_options())
    if jax.default_backend() == "cpu" and compat.JAX_VERSION < (0, 11):
        assert opts["float32"] == {"xla_cpu_experimental_ynn_fusion_type": ""}
