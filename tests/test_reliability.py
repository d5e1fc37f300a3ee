"""Issue 14: input validation, tests that can fail, JAX spec syntax, errors."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import polymask as pm
from polymask import buckets as B
from polymask.testing import check_oracle, garbage_pad, garbage_value

X5 = np.arange(5.0, dtype=np.float32)


# ----------------------------------------------------------------------------
# 1. Inputs validated
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("size,words", [((-2,), "negative"), ((9,), "outside [0, 5]")])
def test_unpad_rejects_sizes_outside_bound(size, words):
    with pytest.raises(pm.ShapeError, match=r"shape\[0\]") as info:
        pm.Masked(X5, size).unpad()
    assert words in str(info.value)


def test_unpad_rejects_wrong_rank_and_float_size():
    with pytest.raises(pm.ShapeError, match="rank 2"):
        pm.Masked(np.zeros((2, 3)), (1, 2, 3)).unpad()
    # Fewer sizes than axes is a batch (leading axes), as vmap returns it.
    got = pm.Masked(np.arange(6.0).reshape(2, 3), (1,)).unpad()
    np.testing.assert_array_equal(np.stack(got), [[0.0], [3.0]])
    with pytest.raises(TypeError, match="must be an integer"):
        pm.Masked(X5, (2.5,)).unpad()
    with pytest.raises(TypeError, match="must be an integer"):
        pm.Masked(X5, (True,)).unpad()
    np.testing.assert_array_equal(pm.Masked(X5, (np.int32(5),)).unpad(), X5)
    np.testing.assert_array_equal(pm.Masked(X5, (0,)).unpad(), X5[:0])


@pytest.mark.parametrize("bound,exc,words", [
    (3.7, TypeError, "got 3.7"),
    ((4.9,), TypeError, "got 4.9"),
    (-3, pm.ShapeError, "got -3"),
    (True, TypeError, "got True"),
    ((7, 2), pm.ShapeError, "rank 2"),
])
def test_pad_rejects_bad_bounds(bound, exc, words):
    with pytest.raises(exc, match="bound") as info:
        pm.pad(X5, bound)
    assert words in str(info.value)


def test_pad_scalar_and_fill():
    with pytest.raises(pm.ShapeError, match="0-d"):
        pm.pad(np.float32(1.0), 4)
    m = pm.pad(np.float32(1.0), ())
    assert m.shape == () and float(m.unpad()) == 1.0
    with pytest.raises(TypeError, match="fill=nan.*int"):
        pm.pad(np.arange(3), 4, fill=np.nan)
    with pytest.raises(TypeError, match="out of range"):
        pm.pad(np.arange(3, dtype=np.int8), 4, fill=1000)
    with pytest.raises(TypeError, match="fill"):
        pm.pad(np.ones(3, bool), 4, fill=2)
    m = pm.pad(np.arange(3, dtype=np.int32), 4, fill=-1)
    assert m.data.dtype == np.int32 and m.data.tolist() == [0, 1, 2, -1]
    m = pm.pad(jnp.arange(3.0), 4, fill=np.inf)
    assert np.isinf(m.data[3])


def test_stack_validation_and_dtypes():
    a, b = np.ones(2, np.int32), np.ones(3, np.int32)
    with pytest.raises(pm.ShapeError, match="rank 2"):
        pm.stack([a, b], bound=(4, 4))
    with pytest.raises(pm.ShapeError, match="got -1"):
        pm.stack([a, b], bound=(-1,))
    with pytest.raises(TypeError, match="got 4.5"):
        pm.stack([a, b], bound=(4.5,))
    with pytest.raises(TypeError, match=r"arrays\[1\] has dtype float32.*int32"):
        pm.stack([a, np.ones(3, np.float32)])
    with pytest.raises(TypeError, match="fill=nan"):
        pm.stack([a, b], fill=np.nan)
    s = pm.stack([a, b], bound=(4,))
    assert s.data.dtype == np.int32 and s.data.shape == (2, 4)
    s = pm.stack([np.ones(2, np.float32), np.ones(3, np.float64)])
    assert s.data.dtype == np.float32  # the dtype of arrays[0]
    assert [u.tolist() for u in s.unpad()] == [[1, 1], [1, 1, 1]]


def test_bucket_policies_reject_non_ints():
    with pytest.raises(TypeError, match="minimum"):
        B.pow2(3.5)
    with pytest.raises(TypeError, match="size must be an int"):
        B.pow2()(3.7)
    with pytest.raises(TypeError, match="each bound"):
        B.explicit([4.5])
    with pytest.raises(ValueError, match="k must be >= 1"):
        B.multiple(0)
    assert B.pow2()(np.int32(9)) == 16


# ----------------------------------------------------------------------------
# 2. Tests that cannot fail
# ----------------------------------------------------------------------------
def test_check_oracle_vmap_runs_with_one_example_and_catches_a_bug():
    calls = []

    def f(x):
        calls.append(1)
        return jnp.sum(x)

    check_oracle(f, [(np.arange(3.0),)], [(5,)], "n", modes=("vmap",))
    assert calls  # the vmap mode ran (it used to be skipped for one example)


def test_check_oracle_vmap_batches_differing_plain_args():
    # plain arguments that differ between examples are batched, not skipped
    ex = [(np.arange(3.0), np.float32(2.0)), (np.arange(4.0), np.float32(3.0))]
    check_oracle(lambda x, s: jnp.sum(x) * s, ex, [(5,), None], ("n", None),
                 modes=("vmap",))
    with pytest.raises(ValueError, match="different shapes"):
        check_oracle(lambda x, s: jnp.sum(x) * jnp.sum(s),
                     [(np.arange(3.0), np.ones(2)), (np.arange(4.0), np.ones(3))],
                     [(5,), None], ("n", None), modes=("vmap",))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2,
                                   jnp.float16, np.float32])
def test_garbage_pad_low_precision_floats_get_nan(dtype):
    # bfloat16 / float8 are not np.inexact: they used to reach np.iinfo and fail
    out = garbage_pad(np.ones(3, dtype), (6,))
    assert out.dtype == np.dtype(dtype) and out.shape == (6,)
    np.testing.assert_array_equal(out[:3].astype(np.float32), [1.0, 1.0, 1.0])
    assert np.isnan(out[3:].astype(np.float32)).all()


def test_garbage_pad_other_dtypes():
    # (a fuzz repro exec'd by test_fuzz once replaced garbage_value for the rest
    # of its pytest worker: this test then saw NaN fills, int32 -> INT_MIN)
    out = garbage_pad(np.ones((1, 2), jnp.float4_e2m1fn), (2, 2))  # no NaN: largest finite
    assert out.view(np.uint8).tolist() == [[2, 2], [7, 7]]  # 1.0 and 6.0, bit for bit
    np.testing.assert_array_equal(out.astype(np.float32), [[1, 1], [6, 6]])
    for dtype, largest in ((jnp.float6_e2m3fn, 7.5), (jnp.float6_e3m2fn, 28.0)):
        out = garbage_pad(np.ones(1, dtype), (3,))
        np.testing.assert_array_equal(out.astype(np.float32), [1.0, largest, largest])
    np.testing.assert_array_equal(garbage_pad(np.ones(1, jnp.int4), (2,)).astype(np.int32),
                                  [1, 7])
    np.testing.assert_array_equal(garbage_pad(np.ones(1, jnp.uint4), (2,)).astype(np.int32),
                                  [1, 14])
    np.testing.assert_array_equal(garbage_pad(np.ones(1, np.int32), (2,)), [1, 2**30 + 6])
    np.testing.assert_array_equal(garbage_pad(np.zeros(1, bool), (2,)), [False, True])
    assert np.isnan(garbage_value(np.float16)) and np.isnan(garbage_value(jnp.bfloat16))


def test_check_oracle_bfloat16():
    x = np.linspace(-1, 1, 5).astype(jnp.bfloat16)
    check_oracle(lambda x: jnp.cumsum(x * 2), [(x,), (x[:2],)], [(8,)], "n",
                 rtol=2e-2, atol=2e-2)


def test_check_grad_continues_past_int_only_example():
    # example 0 has no float argument; example 1 must still be grad-checked
    seen = []

    def f(x):
        seen.append(x.dtype)
        return jnp.sum(x * x)

    check_oracle(f, [(np.arange(3, dtype=np.int32),), (np.arange(4.0, dtype=np.float32),)],
                 [(5,)], "n", modes=("grad",))
    assert any(jnp.issubdtype(d, jnp.floating) for d in seen)


# ----------------------------------------------------------------------------
# 3. JAX's spec syntax
# ----------------------------------------------------------------------------
def test_spec_ellipsis_is_the_remaining_static_axes():
    x = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)
    f = pm.mask(lambda x: jnp.sum(x, axis=0), "b, ...")
    out = f(pm.Masked(x, (np.int32(2), 5, 6)))
    np.testing.assert_allclose(out.unpad(), x[:2].sum(0))
    assert out.shape == (5, 6)
    with pytest.raises(pm.ShapeError, match="only be the last axis"):
        pm.mask(jnp.sum, "n, ..., 6")(pm.Masked(x, (np.int32(2), 5, 6)))
    with pytest.raises(pm.ShapeError, match="remaining axes"):
        pm.mask(jnp.sum, "a, b, c, d, ...")(pm.Masked(x, (np.int32(2), 5, 6)))


def test_equality_constraints():
    f = pm.mask(lambda x, y: jnp.sum(x) + jnp.sum(y), ("n", "m"), constraints=["m == 2*n"])
    assert float(f(pm.pad(np.ones(3), 5), pm.pad(np.ones(6), 10)).data) == 9.0
    with pytest.raises(pm.ShapeError, match=r"args\[1\].shape\[0\].*2\*n"):
        f(pm.pad(np.ones(3), 5), pm.pad(np.ones(5), 10))
    g = pm.mask(jnp.sum, "n", constraints=["n == 3"])
    with pytest.raises(pm.ShapeError, match="fix to the constant 3") as info:
        g(pm.pad(np.ones(3), 5))
    assert "pad that axis to exactly 3" in str(info.value)
    assert float(g(pm.pad(np.ones(3), 3)).data) == 3.0


# ----------------------------------------------------------------------------
# 4. Every error on a user's path is a polymask error
# ----------------------------------------------------------------------------
def _line(marker: str) -> str:
    import inspect
    src, start = inspect.getsourcelines(inspect.currentframe().f_back.f_code)
    for i, text in enumerate(src):
        if marker in text:
            return f"{__file__}:{start + i}"
    raise AssertionError(marker)


XP = pm.pad(np.array([0.5, 2.2, 1.0, 3.7, 0.1], np.float32), 8)
# more sizes than max_cases: a trace that fails symbolically is not retried per size
XP40 = pm.pad(np.array([0.5, 2.2, 1.0, 3.7, 0.1], np.float32), 40)


def _raises(fun, spec, *args, constraints=(), exc=pm.ShapeError):
    with pytest.raises(exc) as info:
        pm.mask(fun, spec, constraints=constraints)(*args)
    return str(info.value)


def test_pad_reflect_and_wrap_at_every_size():
    # JAX branches on the size in Python for these modes: case splits (and, for
    # 'wrap', one trace per size) give plain JAX's value at every size, and its
    # error where it fails (size 0).
    for mode in ("reflect", "wrap"):
        def f(x, mode=mode):
            return jnp.pad(x, 1, mode=mode)  # LINE-pad

        m = pm.mask(f, "n")
        for n in range(7):
            x = np.arange(1.0, n + 1, dtype=np.float32)
            if n == 0:
                with pytest.raises(pm.ShapeError, match="as it does on the exact arrays"):
                    m(pm.pad(x, 6))
                continue
            np.testing.assert_allclose(m(pm.pad(x, 6)).unpad(), np.pad(x, 1, mode=mode))

    # (past the per-size limit, mode="wrap" was refused with a rewrite to
    # slices; it is one gather now: test_slicing.py)
    x = np.arange(1.0, 21.0, dtype=np.float32)
    out = pm.mask(lambda x: jnp.pad(x, 1, mode="wrap"), "n")(pm.pad(x, 40))
    np.testing.assert_allclose(out.unpad(), np.pad(x, 1, mode="wrap"))


def test_float_arange_and_reduce_window_and_size_index_errors():
    def f(x):
        return jnp.arange(1., x.shape[0] + 1)  # LINE-arange

    np.testing.assert_allclose(pm.mask(f, "n")(XP).unpad(), np.arange(1.0, 6.0))  # per size
    msg = _raises(f, "n", XP40)
    assert "jnp.arange(n) + 1.0" in msg and _line("LINE-arange") in msg
    out = pm.mask(lambda x: jnp.arange(x.shape[0]) + 1.0, "n")(XP)
    np.testing.assert_allclose(out.unpad(), np.arange(1.0, 6.0))

    def g(x):
        return jax.lax.reduce_window(x, 0., jax.lax.add, (x.shape[0] // 2,), (1,), "VALID")

    # a window size from a size: one branch per window size; 0 fails as in plain JAX
    for n in range(6):
        xn = pm.pad(np.arange(1.0, n + 1, dtype=np.float32), 8)
        if n < 2:
            with pytest.raises(pm.ShapeError, match="strictly positive"):
                pm.mask(g, "n")(xn)
            continue
        np.testing.assert_allclose(pm.mask(g, "n")(xn).unpad(), g(jnp.asarray(xn.unpad())))

    def h(x):
        return x[x.shape[0] // 2]

    assert float(pm.mask(h, "n")(XP).data) == XP.unpad()[2]
    # a size as an index: a traced int, one program past the per-size limit too
    # (the bound of 40 used to raise with the jnp.asarray remedy)
    assert float(pm.mask(h, "n")(XP40).data) == XP40.unpad()[XP40.unpad().shape[0] // 2]
    out = pm.mask(lambda x: x[jnp.asarray(x.shape[0] // 2)], "n")(XP)
    assert float(out.data) == XP.unpad()[2]


def test_conv_with_dynamic_kernel_channels_names_the_axes():
    x = pm.pad(np.ones((1, 1, 6, 6), np.float32), (1, 1, 8, 8))
    k = pm.pad(np.ones((1, 1, 3, 3), np.float32), (1, 1, 4, 4))

    def f(x, k):
        return jax.lax.conv(x, k, (1, 1), "VALID")  # LINE-conv

    msg = _raises(f, None, x, k)
    assert "args[1].shape[1]" in msg and "args[0].shape[1]" in msg
    assert "static size with '_'" in msg and _line("LINE-conv") in msg


def test_searchsorted_digitize_histogram():
    bins = jnp.array([0., 1., 2., 3.], jnp.float32)
    q = XP.unpad()
    out = pm.mask(lambda x: jnp.searchsorted(bins, x), "n")(XP)
    np.testing.assert_array_equal(out.unpad(), np.searchsorted(np.asarray(bins), q))
    out = pm.mask(lambda x: jnp.searchsorted(bins, x, side="right"), "n")(XP)
    np.testing.assert_array_equal(out.unpad(), np.searchsorted(np.asarray(bins), q, "right"))
    out = pm.mask(lambda x: jnp.digitize(x, bins), "n")(XP)
    np.testing.assert_array_equal(out.unpad(), np.digitize(q, np.asarray(bins)))
    out = pm.mask(lambda x: jnp.histogram(x, bins)[0], "n")(XP)
    np.testing.assert_allclose(out.unpad(), np.histogram(q, np.asarray(bins))[0])
    check_oracle(lambda x: jnp.searchsorted(bins, x), [(q,), (q[:2],), (q[:0],)], [(8,)],
                 "n", modes=("eager", "jit", "vmap"))

    b = pm.pad(np.asarray(bins), 8)
    v = jnp.array([1.5, 2.5, 9.], jnp.float32)

    def f(b):
        return jnp.searchsorted(b, v)

    # dynamic bins: a binary search with the logical length (rules/numeric.py)
    for bound in (8, 40):
        np.testing.assert_array_equal(pm.mask(f, "n")(pm.pad(np.asarray(bins), bound)).unpad(),
                                      np.searchsorted(np.asarray(bins), v))

    def h(b):
        return jnp.histogram(v, b)[0]  # LINE-ss

    msg = _raises(h, "n", pm.pad(np.asarray(bins), 40))  # more sizes than max_cases
    assert "static size ('_'" in msg and "jnp.sum(a[:, None] < v" in msg
    assert _line("LINE-ss") in msg and "constraints=['n >= 3']" not in msg
    out = pm.mask(lambda b: jnp.sum(b[:, None] < v, axis=0), "n")(b)
    np.testing.assert_array_equal(out.unpad(), np.searchsorted(np.asarray(bins), v))


def test_two_data_dependent_calls_and_single_var_hint():
    x = pm.pad(np.array([0., 2., 0., 3.], np.float32), 6)

    def f(x):
        return x[pm.flatnonzero(x)] * pm.flatnonzero(x)  # LINE-fnz

    msg = _raises(f, "n", x)
    assert "Compute the result once and reuse it" in msg and _line("LINE-fnz") in msg
    assert "give them the same name in in_specs" not in msg

    def g(x):
        i = pm.flatnonzero(x)
        return x[i] * i

    np.testing.assert_allclose(pm.mask(g, "n")(x).unpad(), [2.0, 9.0])

    def h(x):
        return jnp.diff(x[1:])  # one dim var: JAX's two shapes agree at every size

    for n in range(6):
        xn = pm.pad(np.arange(n, dtype=np.float32) ** 2, 8)
        np.testing.assert_allclose(pm.mask(h, "n")(xn).unpad(), np.diff(xn.unpad()[1:]))

    def k(x, y):
        return x + y  # LINE-xy

    msg = _raises(k, ("n", "m"), XP, XP)
    assert "Axes named by different dim vars" in msg and _line("LINE-xy") in msg


# ----------------------------------------------------------------------------
# 5. associative_scan over a dynamic axis; approx_top_k
# ----------------------------------------------------------------------------
def _affine_compose(a, b):
    return a[0] * b[0], a[1] * b[0] + b[1]


@pytest.mark.parametrize("name,fn", [
    ("add", lambda x: jax.lax.associative_scan(jnp.add, x)),
    ("max reverse", lambda x: jax.lax.associative_scan(jnp.maximum, x, reverse=True)),
    ("affine pytree", lambda x: jax.lax.associative_scan(_affine_compose, (x, 2 * x))[1]),
    ("mul reverse", lambda x: jax.lax.associative_scan(jnp.multiply, x, reverse=True)),
])
def test_associative_scan_dynamic_axis(name, fn):
    rng = np.random.default_rng(1)
    ex = [(rng.normal(size=n).astype(np.float32),) for n in (0, 1, 5, 8)]
    check_oracle(fn, ex, [(8,)], "n")


def test_associative_scan_values_noncommutative_and_axis():
    x = pm.pad(np.arange(1., 6., dtype=np.float32), 8, fill=np.nan)
    out = pm.mask(lambda x: jax.lax.associative_scan(jnp.add, x, reverse=True), "n")(x)
    np.testing.assert_allclose(out.unpad(), [15., 14., 12., 9., 5.])
    rng = np.random.default_rng(2)
    ex = [(rng.normal(size=(n, 2, 2)).astype(np.float32),) for n in (1, 3, 6)]
    check_oracle(lambda x: jax.lax.associative_scan(lambda a, b: b @ a, x), ex,
                 [(6, 2, 2)], "n, 2, 2")
    check_oracle(lambda x: jax.lax.associative_scan(lambda a, b: b @ a, x, reverse=True), ex,
                 [(6, 2, 2)], "n, 2, 2", modes=("eager", "jit"))
    ex = [(rng.normal(size=(3, n)).astype(np.float32),) for n in (1, 3, 6)]
    check_oracle(lambda x: jax.lax.associative_scan(jnp.add, x, axis=1, reverse=True), ex,
                 [(3, 6)], "3, n")


def test_approx_max_min_k_exact():
    rng = np.random.default_rng(3)
    ex = [(rng.normal(size=(2, n)).astype(np.float32),) for n in (3, 5, 8)]
    check_oracle(lambda x: jax.lax.approx_max_k(x, 3), ex, [(2, 8)], "2, n",
                 constraints=["n >= 3"])
    check_oracle(lambda x: jax.lax.approx_min_k(x, 3), ex, [(2, 8)], "2, n",
                 constraints=["n >= 3"])
    x = pm.pad(np.array([1., 5., 3.], np.float32), 6, fill=np.nan)
    vals, idx = pm.mask(lambda x: jax.lax.approx_max_k(x, 2), "n", constraints=["n >= 2"])(x)
    assert vals.unpad().tolist() == [5.0, 3.0] and idx.unpad().tolist() == [1, 2]
    # k a size (ColabDesign's ProteinMPNN: k = min(top_k, L) neighbours of L
    # residues): the output's padded size is k's bound (the rule gave the
    # symbolic k as a padded size: an internal error, helper C)
    ex = [(rng.normal(size=(n, n)).astype(np.float32),) for n in (1, 4, 8)]
    for op in (jax.lax.approx_max_k, jax.lax.approx_min_k):
        check_oracle(lambda x, op=op: op(x, min(6, x.shape[-1])), ex, [(8, 8)], "n, n",
                     modes=("eager", "jit", "vmap"))


# ----------------------------------------------------------------------------
# 6. Nested masks (jax.mask's nesting test)
# ----------------------------------------------------------------------------
def test_nested_mask_inside_vmap_inside_mask():
    inner = pm.mask(jnp.sum, "n")

    def fun(x, ns):
        return jax.vmap(inner)(pm.Masked(x, (ns,))).data.sum()

    outer = pm.mask(fun, ("m, _", "m"))
    x = jnp.array([[3, 1, 4, 1], [5, 9, 2, 6], [5, 3, 5, 8]])
    ns = jnp.array([2, 3, 99], jnp.int32)  # row 2 is padding: its garbage size is ignored
    args = (pm.Masked(x, (jnp.int32(2), 4)), pm.Masked(ns, (jnp.int32(2),)))
    assert int(outer(*args).data) == 3 + 1 + 5 + 9 + 2
    assert int(jax.jit(outer)(*args).data) == 3 + 1 + 5 + 9 + 2
    args3 = (pm.Masked(x, (jnp.int32(3), 4)), pm.Masked(jnp.array([2, 3, 1]), (jnp.int32(3),)))
    assert int(jax.jit(outer)(*args3).data) == 3 + 1 + 5 + 9 + 2 + 5
    bad = (pm.Masked(x, (jnp.int32(2), 4)), pm.Masked(jnp.array([2, 7, 0]), (jnp.int32(2),)))
    with pytest.raises(Exception, match="outside") as info:
        jax.block_until_ready(jax.jit(outer)(*bad))
    assert "ShapeError" in str(info.value) or isinstance(info.value, pm.ShapeError)


def test_underscore_spec_still_static():
    x = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    out = pm.mask(lambda x: jnp.sum(x, axis=0), "m, _")(pm.Masked(x, (np.int32(2), 4)))
    np.testing.assert_allclose(out.unpad(), x[:2].sum(0))
    assert out.shape == (4,)


# ----------------------------------------------------------------------------
# 7. Size checks survive jax.export (checks="functional")
# ----------------------------------------------------------------------------
def test_functional_checks_of_a_case_split_and_a_loop_export_and_run():
    """A check traced inside one case of a case split (x[0]: n = 0 is a case of
    its own) is a value of that branch: it leaves the switch as the branch's
    output, so jax.jit and jax.export of checks="functional" run, and an
    empty selection read inside the program poisons the outputs."""
    first = pm.mask(lambda x: x[0], "n", checks="functional")
    assert float(jax.jit(first)(pm.Masked(jnp.arange(6.0), (jnp.int32(3),))).unpad()) == 0.0
    f = lambda x: lax.fori_loop(0, x.shape[0], lambda i, c: c + x[i] * i, 0.0)  # noqa: E731
    spec = pm.Masked(jax.ShapeDtypeStruct((6,), jnp.float32),
                     (jax.ShapeDtypeStruct((), jnp.int32),))
    exp = jax.export.export(jax.jit(pm.mask(f, "n", checks="functional")))(spec)
    for n in (1, 3, 6):
        out = exp.call(pm.Masked(jnp.arange(6.0), (jnp.int32(n),)))
        np.testing.assert_allclose(out.unpad(), f(jnp.arange(float(n))))
    with pytest.raises(IndexError):  # x[i] of an empty x: plain JAX raises, the program poisons
        f(jnp.arange(0.0))
    assert np.isnan(float(exp.call(pm.Masked(jnp.arange(6.0), (jnp.int32(0),))).data))
    pick = pm.mask(lambda x: jnp.take(pm.boolean_mask(x, x > 2), 0), "n", checks="functional")
    empty = jax.jit(pick)(pm.Masked(jnp.array([1.0, 2.0, 0.0, 9.0]), (jnp.int32(3),)))
    assert np.isnan(float(empty.data))  # poisoned: plain JAX raises there


def test_exported_masked_program_rejects_size_above_bound():
    g = pm.mask(jnp.cumsum, "n", checks="functional")
    spec = pm.Masked(jax.ShapeDtypeStruct((5,), jnp.float32),
                     (jax.ShapeDtypeStruct((), jnp.int32),))
    exp = jax.export.deserialize(jax.export.export(jax.jit(g))(spec).serialize())
    ok = exp.call(pm.Masked(jnp.arange(5.0), (jnp.int32(3),)))
    np.testing.assert_allclose(ok.unpad(), [0.0, 1.0, 3.0])
    bad = exp.call(pm.Masked(jnp.arange(5.0), (jnp.int32(9),)))
    assert int(bad.shape[0]) == -1 and np.all(np.isnan(np.asarray(bad.data)))
    with pytest.raises(pm.ShapeError, match="size check failed"):
        bad.unpad()
    # the poisoned result is rejected by the next masked call too
    with pytest.raises(pm.ShapeError, match="outside"):
        pm.mask(jnp.sum, "n")(bad)
    # without jax.export: same behaviour under jit, and eager checks still raise
    assert int(jax.jit(g)(pm.Masked(jnp.arange(5.0), (jnp.int32(9),))).shape[0]) == -1
    with pytest.raises(pm.ShapeError, match="outside"):
        g(pm.Masked(jnp.arange(5.0), (np.int32(9),)))


def test_check_grad_skips_examples_without_float_outputs():
    # float input, int output: nothing to differentiate, not a crash
    check_oracle(lambda x: jnp.sum(x > 0), [(np.array([1.0, -1.0], np.float32),)], [(4,)], "n",
                 modes=("grad",))


def test_max_gradient_differs_under_jit_in_plain_jax_too():
    """Fuzz seed 13 #929: jit(grad) of this chain differs from grad, in plain JAX
    on the exact array as well (max's JVP compares ``operand == max`` and XLA
    computes the operand differently in two fusions): not a polymask error.
    The fuzzer drops the grad mode where plain JAX itself disagrees."""
    def f(x):
        y = x * x - jnp.mean(x * x)
        return jnp.max(jnp.outer(y, y), axis=1)

    x = np.array([-0.364, -1.474, -1.309, 0.488, 0.054], np.float32)
    loss = lambda v: jnp.sum(f(v))  # noqa: E731
    ref = jax.grad(loss)(jnp.asarray(x))
    # the difference comes from XLA's fusions: with its default compile options (CI's
    # jax 0.11 leg, users), not always with the suite's cheap-compile flags
    if os.environ.get("POLYMASK_TEST_FULL_COMPILE", "") not in ("", "0"):
        assert not np.allclose(jax.jit(jax.grad(loss))(jnp.asarray(x)), ref, atol=1e-3)
    xp = np.zeros(8, np.float32)
    xp[:5] = x
    m = pm.mask(f, "n")

    def mloss(d):
        return jnp.sum(jnp.where(jnp.arange(8) < 5, m(pm.Masked(d, (5,))).data, 0.0))

    # an eager polymask gradient differentiates its compiled program (sizes traced),
    # so it is its jit gradient, and one of the answers plain JAX itself gives (NaN
    # from both jits on jaxlib 0.10 with the cheap-compile flags)
    eager = np.asarray(jax.grad(mloss)(jnp.asarray(xp)))
    jitted = jax.jit(jax.grad(lambda d, n: jnp.sum(jnp.where(
        jnp.arange(8) < n, m(pm.Masked(d, (n,))).data, 0.0))))(jnp.asarray(xp), jnp.int32(5))
    np.testing.assert_array_equal(eager, jitted)
    np.testing.assert_array_equal(eager[5:], 0.0)
    plain = [ref, jax.jit(jax.grad(loss))(jnp.asarray(x))]
    assert any(np.allclose(eager[:5], p, rtol=1e-4, atol=1e-5, equal_nan=True) for p in plain), \
        (eager, plain)
