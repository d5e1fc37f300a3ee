"""Windowed ops: conv_general_dilated, reduce_window*, select_and_{scatter,gather}_add.

ACCEPTANCE.md case 7 (strided convolution) and its case-15 gradient part, plus
oracle sweeps over strides, dilations, padding modes and logical sizes 0..bound.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import oracle
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import polymask as pm
from polymask.testing import check_oracle, garbage_pad

RNG = np.random.default_rng(0)


def _vec(n):
    return RNG.normal(size=(n,)).astype(np.float32)


def conv1d(x, k, stride=1, padding="VALID", rhs_dilation=1, lhs_dilation=1):
    """1-D convolution of a vector (no gather/reshape: expand_dims/squeeze only)."""
    out = lax.conv_general_dilated(lax.expand_dims(x, (0, 1)), lax.expand_dims(k, (0, 1)),
                                   (stride,), padding, lhs_dilation=(lhs_dilation,),
                                   rhs_dilation=(rhs_dilation,))
    return lax.squeeze(out, (0, 1))


# ----------------------------------------------------------------------------
# ACCEPTANCE case 7 (+ case 15 gradient part)
# ----------------------------------------------------------------------------
X7 = np.arange(1, 8, dtype=np.float32)


def _pad7(n=7):
    return jnp.asarray(garbage_pad(X7[:n], (10,)))


@pytest.mark.parametrize("dynamic", [False, True])
def test_case7_values(dynamic):
    def size(n):
        return jnp.int32(n) if dynamic else n

    valid = pm.mask(lambda x: conv1d(x, jnp.ones(3), 2, "VALID"), "n")
    same = pm.mask(lambda x: conv1d(x, jnp.ones(3), 2, "SAME"), "n")
    out = valid(pm.Masked(_pad7(), (size(7),)))
    np.testing.assert_array_equal(out.unpad(), [6, 12, 18])
    assert int(out.shape[0]) == (7 - 3) // 2 + 1
    out = same(pm.Masked(_pad7(), (size(7),)))
    np.testing.assert_array_equal(out.unpad(), [3, 9, 15, 13])
    assert int(out.shape[0]) == 4  # ceil(7 / 2)
    big = pm.mask(lambda x: conv1d(x, jnp.ones(8), 2, "VALID"), "n")
    out = big(pm.Masked(_pad7(4), (size(4),)))
    assert int(out.shape[0]) == 0
    assert out.unpad().shape == (0,)


def test_case7_one_trace_and_ragged_batch():
    traces = []

    def f(x):
        return conv1d(x, jnp.ones(3), 2, "VALID"), conv1d(x, jnp.ones(3), 2, "SAME")

    def counted(x):
        traces.append(1)
        return f(x)

    m = jax.jit(pm.mask(counted, "n"))
    ns = [7, 4, 3, 1, 0, 10]
    for n in ns:
        xs = np.arange(1, n + 1, dtype=np.float32)
        v, s = m(pm.Masked(jnp.asarray(garbage_pad(xs, (10,))), (jnp.int32(n),)))
        rv, rs = f(jnp.asarray(xs))
        np.testing.assert_array_equal(v.unpad(), rv)
        np.testing.assert_array_equal(s.unpad(), rs)
    assert len(traces) == 1
    # ragged batch
    data = jnp.stack([jnp.asarray(garbage_pad(np.arange(1, n + 1, dtype=np.float32), (10,)))
                      for n in ns])
    v, s = jax.vmap(pm.mask(f, "n"))(pm.Masked(data, (jnp.asarray(ns, jnp.int32),)))
    for i, n in enumerate(ns):
        rv, rs = f(jnp.arange(1, n + 1, dtype=jnp.float32))
        assert int(v.shape[0][i]) == rv.shape[0] and int(s.shape[0][i]) == rs.shape[0]
        np.testing.assert_array_equal(v.data[i, :rv.shape[0]], rv)
        np.testing.assert_array_equal(s.data[i, :rs.shape[0]], rs)


def test_case7_oracle_with_gradients():
    """Case 15 for case 7: grad finite, 0 in padding, equal on the logical region."""
    k = np.array([1.0, -2.0, 0.5], np.float32)
    exs = [(X7[:n], k) for n in (7, 4, 3, 0, 2)]

    @jax.jit
    def f(x, k):
        return conv1d(x, k, 2, "VALID"), conv1d(x, k, 2, "SAME")

    check_oracle(f, exs, [(10,), None], ("n", None), modes=("eager", "jit", "vmap"))
    check_oracle(f, exs[:2], [(10,), None], ("n", None), modes=("grad",))
    check_oracle(lambda x: conv1d(x, jnp.ones(8), 2, "VALID"), [(X7[:4],), (X7,)], [(10,)])


# ----------------------------------------------------------------------------
# Sweeps: strides 1-3, dilations 1-2, padding modes, logical sizes 0..bound
# ----------------------------------------------------------------------------
BOUND = 7
PADS = ["VALID", "SAME", "SAME_LOWER", [(1, 2)], [(-1, 1)]]


def _conv_sweep_fn(stride):
    k3 = jnp.array([1.0, 2.0, -1.0])
    k2 = jnp.array([0.5, -1.5])

    def f(x):
        outs = []
        for pad in PADS:
            for k, rd in ((k3, 1), (k3, 2), (k2, 1)):
                outs.append(conv1d(x, k, stride, pad, rhs_dilation=rd))
        return outs

    return jax.jit(f)  # jit: the unpadded references compile once per size


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_conv1d_sweep(stride):
    f = _conv_sweep_fn(stride)
    exs = [(_vec(n),) for n in range(BOUND + 1)]
    check_oracle(f, exs, [(BOUND,)], modes=("jit", "vmap"))
    check_oracle(f, [exs[5]], [(BOUND,)], modes=("eager",))  # dynamic and static sizes
    check_oracle(f, [exs[4]], [(BOUND,)], modes=("grad",))


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_conv1d_lhs_dilation_sweep():
    """Transposed-conv style lhs dilation, strides 1-3 (sizes >= 1: JAX's symbolic
    shape of a dilated axis assumes size >= 1, see the module docstring of windows.py)."""
    k3 = jnp.array([1.0, 2.0, -1.0])

    @jax.jit
    def f(x):
        return [conv1d(x, k3, stride, pad, rhs_dilation=rd, lhs_dilation=2)
                for stride in (1, 2, 3) for pad in ([(0, 0)], [(1, 1)], [(2, 1)], [(0, -1)])
                for rd in (1, 2)]

    exs = [(_vec(n),) for n in range(1, BOUND + 1)]
    check_oracle(f, exs, [(BOUND,)], modes=("jit", "vmap"))
    check_oracle(f, [exs[3]], [(BOUND,)], modes=("grad",))


def _rw_sweep_fn(stride, base_dilation, for_grad=False):
    """for_grad: JAX has no VJP for max pooling with window dilation or pad < 0."""
    def f(x):
        outs = []
        for pad in PADS[:-1] if for_grad else PADS:  # JAX's own VJP rejects pad < 0
            for wd in (1, 2):
                kw = dict(window_dilation=(wd,), base_dilation=(base_dilation,))
                if wd == 1 or not for_grad:
                    outs.append(lax.reduce_window(x, -jnp.inf, lax.max, (3,), (stride,), pad,
                                                  **kw))
                if wd == 1:
                    outs.append(lax.reduce_window(x, 0.0, lax.add, (2,), (stride,), pad, **kw))
        if base_dilation == 1:
            outs.append(lax.reduce_window(x, jnp.inf, lax.min, (3,), (stride,), "SAME"))
        return outs

    return jax.jit(f)


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_reduce_window_sweep(stride):
    f = _rw_sweep_fn(stride, 1)
    exs = [(_vec(n),) for n in range(BOUND + 1)]
    check_oracle(f, exs, [(BOUND,)], modes=("jit", "vmap"))
    check_oracle(f, [exs[5]], [(BOUND,)], modes=("eager",))  # dynamic and static sizes
    check_oracle(_rw_sweep_fn(stride, 1, True), [exs[3]], [(BOUND,)], modes=("grad",))


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_reduce_window_base_dilation_sweep():
    """Base dilation 2, strides 1-3, sizes >= 1 (see test_conv1d_lhs_dilation_sweep)."""
    fs = [_rw_sweep_fn(stride, 2) for stride in (1, 2, 3)]
    gs = [_rw_sweep_fn(stride, 2, True) for stride in (1, 2, 3)]
    f = jax.jit(lambda x: [g(x) for g in fs])
    exs = [(_vec(n),) for n in range(1, BOUND + 1)]
    check_oracle(f, exs, [(BOUND,)], modes=("jit", "vmap"))
    check_oracle(jax.jit(lambda x: [g(x) for g in gs]), [exs[3]], [(BOUND,)], modes=("grad",))


# ----------------------------------------------------------------------------
# 2-D / 3-D convolutions, dynamic batch / spatial / feature axes, groups
# ----------------------------------------------------------------------------
def _rand(*shape):
    return RNG.normal(size=shape).astype(np.float32)


def _check(f, exs, bounds, specs=None, **kw):
    """All sizes under jit (one trace) and vmap; eager and grad on the first example."""
    check_oracle(f, exs, bounds, specs, modes=("jit", "vmap"), **kw)
    check_oracle(f, exs[:1], bounds, specs, modes=("eager", "grad"), **kw)


def test_conv2d_nhwc_dynamic_batch_and_spatial_and_transpose():
    k = _rand(3, 2, 3, 4)  # HWIO

    dn = ("NHWC", "HWIO", "NHWC")

    @jax.jit
    def f(x, k):
        return [*(lax.conv_general_dilated(x, k, (2, 1), pad, rhs_dilation=(1, 2),
                                           dimension_numbers=dn)
                  for pad in ("SAME", "VALID", [(1, 0), (2, 1)])),
                lax.conv_transpose(x, k, (2, 2), "SAME", dimension_numbers=dn),
                lax.conv_transpose(x, k, (1, 2), "VALID", dimension_numbers=dn)]

    exs = [(_rand(b, h, w, 3), k) for b, h, w in ((2, 5, 4), (1, 3, 6), (2, 1, 2), (1, 6, 3))]
    _check(f, exs, [(2, 6, 6, 3), None], ("b, h, w, 3", None))


def test_conv2d_same_lower_strided_and_lhs_dilated():
    k = _rand(2, 1, 3, 2)  # OIHW

    @jax.jit
    def f(x, k):
        return [lax.conv_general_dilated(x, k, (3, 2), "SAME_LOWER"),
                lax.conv_general_dilated(x, k, (1, 2), [(1, 2), (0, 1)], lhs_dilation=(2, 1))]

    exs = [(_rand(1, 1, h, w), k) for h, w in ((5, 4), (2, 6), (7, 1))]
    _check(f, exs, [(1, 1, 7, 6), None], ("1, 1, h, w", None))


def test_conv_dynamic_input_features_and_kernel():
    """Contracted feature axis dynamic on both operands (same dim var)."""
    @jax.jit
    def f(x, k):
        return lax.conv_general_dilated(x, k, (1, 2), "SAME")

    exs = [(_rand(b, c, h, 5), _rand(4, c, 3, 3)) for b, c, h in ((2, 3, 6), (1, 1, 4), (2, 4, 2))]
    _check(f, exs, [(2, 4, 6, 5), (4, 4, 3, 3)], ("b, c, h, 5", "4, c, 3, 3"))


def test_conv_dynamic_output_features():
    @jax.jit
    def f(x, k):
        return lax.conv_general_dilated(x, k, (2,), "SAME")

    exs = [(_rand(1, 2, n), _rand(o, 2, 3)) for n, o in ((5, 3), (2, 1), (6, 4))]
    _check(f, exs, [(1, 2, 6), (4, 2, 3)], ("1, 2, n", "o, 2, 3"))


def test_conv_feature_and_batch_groups():
    kf = _rand(6, 2, 3)   # feature_group_count=2: C=4 -> 2 per group, O=6
    kb = _rand(4, 2, 2)   # batch_group_count=2: N=4 -> out batch 2, O=4

    @jax.jit
    def f(x, kf, kb):
        return (lax.conv_general_dilated(x, kf, (2,), "SAME", feature_group_count=2),
                lax.conv_general_dilated(x[:, :2], kb, (1,), [(1, 1)], rhs_dilation=(2,),
                                         batch_group_count=2))

    exs = [(_rand(4, 4, n), kf, kb) for n in (5, 1, 7, 3)]
    _check(f, exs, [(4, 4, 7), None, None], ("4, 4, n", None, None))


def test_conv3d():
    k = _rand(3, 2, 2, 2, 2)

    @jax.jit
    def f(x, k):
        return lax.conv_general_dilated(x, k, (1, 2, 1), "SAME", rhs_dilation=(1, 1, 2))

    exs = [(_rand(1, 2, d, h, w), k) for d, h, w in ((4, 3, 2), (2, 4, 1), (1, 1, 4))]
    _check(f, exs, [(1, 2, 4, 4, 4), None], ("1, 2, d, h, w", None))


def test_conv_dynamic_kernel_size():
    """Both operands dynamic (a cross-correlation of two signals); the kernel's zeroed
    padding contributes nothing, the padding depends on both sizes."""
    @jax.jit
    def f(x, k):  # (explicit padding must be ints: jax rejects [(m - 1, m - 1)])
        return [conv1d(x, k, 1, "VALID"), conv1d(x, k, 2, "SAME"),
                conv1d(x, k, 3, "SAME_LOWER"), conv1d(x, k, 1, "SAME", rhs_dilation=2)]

    exs = [(_vec(n), _vec(m)) for n, m in ((6, 3), (5, 1), (7, 4), (4, 4), (3, 2))]
    _check(f, exs, [(7,), (4,)], ("n", "m"), constraints=("n >= m",))


# ----------------------------------------------------------------------------
# jnp.convolve / jnp.correlate: their lowering, on lax forms
# ----------------------------------------------------------------------------
def test_jnp_convolve_at_any_bound():
    """jnp.convolve/correlate call len(x): a trace patch (rules/numeric.py) reads
    it as a size, so any bound works; a JAX function that still needs a Python
    int (jnp.polyder) is a ShapeError that points to the lax form."""
    f = pm.mask(lambda x: jnp.convolve(x, jnp.ones(3)), "n")
    for bound in (6, 40):
        np.testing.assert_allclose(f(pm.Masked(jnp.ones(bound), (5,))).unpad(),
                                   np.convolve(np.ones(5), np.ones(3)))
    g = pm.mask(jnp.polyder, "n")
    with pytest.raises(pm.ShapeError, match=r"(?s)cannot be interpreted as an integer.*lax"):
        g(pm.Masked(jnp.ones(40), (5,)))  # more sizes than max_cases


@pytest.mark.parametrize("op", ["convolve", "correlate"])
def test_jnp_convolve_lowering_forms(op):
    """What jnp.convolve/correlate(x, v, mode) lower to for len(x) >= len(v)."""
    v = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    m = len(v)
    pads = {"full": [(m - 1, m - 1)], "same": [(m // 2, m - m // 2 - 1)], "valid": [(0, 0)]}

    @jax.jit
    def f(x, v):
        k = v[::-1] if op == "convolve" else v
        return [conv1d(x, k, 1, pads[mode]) for mode in ("full", "same", "valid")]

    exs = [(_vec(n), v) for n in (4, 7, 5, 8)]
    for x, _ in exs:
        for got, mode in zip(f(x, v), ("full", "same", "valid")):
            np.testing.assert_allclose(got, getattr(jnp, op)(x, v, mode=mode), rtol=1e-5,
                                       atol=1e-5)
    _check(f, exs, [(8,), None], ("n", None), constraints=("n >= 4",))


# ----------------------------------------------------------------------------
# Pooling: max / avg (stax and flax forms), min, generic, and their gradients
# ----------------------------------------------------------------------------
def flax_avg_pool(x, window, strides, padding, count_include_pad=True):
    """flax.linen.avg_pool, inlined (flax is not a dependency)."""
    full = padding if isinstance(padding, str) else [(0, 0), *padding, (0, 0)]
    y = lax.reduce_window(x, 0.0, lax.add, (1, *window, 1), (1, *strides, 1), full)
    if count_include_pad:
        return y / np.prod(window)
    ones = jnp.ones(x.shape[1:-1], x.dtype)
    div = lax.reduce_window(ones, 0.0, lax.add, window, strides, padding)
    return y / lax.expand_dims(div, (0, div.ndim + 1))


def test_pooling_forms():
    from jax.example_libraries import stax

    _, max_pool = stax.MaxPool((2, 3), (2, 2), "SAME")
    _, avg_pool = stax.AvgPool((3, 2), (1, 2), "SAME")
    _, sum_pool = stax.SumPool((2, 2), (2, 1), "VALID")

    @jax.jit
    def f(x):
        return (max_pool((), x), avg_pool((), x), sum_pool((), x),
                flax_avg_pool(x, (3, 3), (2, 2), "SAME", True),
                flax_avg_pool(x, (3, 3), (2, 2), "SAME", False),
                flax_avg_pool(x, (2, 2), (2, 2), [(1, 0), (0, 1)], False))

    exs = [(_rand(b, h, w, 2),) for b, h, w in ((2, 5, 6), (1, 1, 3), (2, 4, 1))]
    _check(f, exs, [(2, 6, 6, 2)], ("b, h, w, 2",))


def test_avg_pool_divisor_counts_logical_elements():
    """count_include_pad=False divides by the number of *logical* elements per window."""
    x = np.arange(1, 6, dtype=np.float32)[None, :, None]
    f = pm.mask(lambda x: flax_avg_pool(x, (2,), (2,), "SAME", False), "1, n, 1")
    out = f(pm.Masked(jnp.asarray(garbage_pad(x, (1, 8, 1))), (1, jnp.int32(5), 1)))
    np.testing.assert_allclose(out.unpad()[0, :, 0], [1.5, 3.5, 5.0])


def test_reduce_window_min_int_and_generic():
    @jax.jit
    def f(x):
        return (lax.reduce_window(x, jnp.iinfo(jnp.int32).max, lax.min, (3,), (2,), "SAME"),
                lax.reduce_window(x, jnp.iinfo(jnp.int32).min, lax.max, (2,), (1,), "VALID"),
                lax.reduce_window(x, 0, lax.add, (2,), (3,), [(2, 1)]),
                lax.reduce_window(x, 1, lax.mul, (3,), (2,), "SAME"))

    exs = [(RNG.integers(-5, 5, size=n).astype(np.int32),) for n in (6, 0, 1, 3, 8)]
    _check(f, exs, [(8,)])


def test_reduce_window_generic_float_and_variadic():
    def argmax_pool(x):
        idx = lax.broadcasted_iota(jnp.int32, x.shape, 0)

        def comb(a, b):
            (av, ai), (bv, bi) = a, b
            take_a = av >= bv
            return jnp.where(take_a, av, bv), jnp.where(take_a, ai, bi)

        return lax.reduce_window((x, idx), (-jnp.inf, jnp.int32(-1)), comb, (3,), (2,), "SAME")

    @jax.jit
    def f(x):
        return (lax.reduce_window(x, 1.0, lax.mul, (2,), (2,), "SAME"), *argmax_pool(x))

    exs = [(_vec(n),) for n in (7, 0, 2, 5)]
    check_oracle(f, exs, [(7,)], modes=("eager", "jit", "vmap"))


def _max_pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (3,), (2,), "SAME")


def test_max_pool_grad_inside_mask_uses_select_and_scatter_add():
    g = jax.grad(lambda x, w: jnp.sum(_max_pool(x) * w))
    jaxpr = jax.make_jaxpr(g)(jnp.ones(7), jnp.ones(4))
    assert "select_and_scatter_add" in str(jaxpr)

    def pools(x):
        return (_max_pool(x), lax.reduce_window(x, -jnp.inf, lax.max, (3,), (2,), "VALID"),
                lax.reduce_window(x, jnp.inf, lax.min, (2,), (1,), "SAME"))

    @jax.jit
    def f(x):
        return jax.grad(lambda x: sum(jnp.sum(jnp.sin(p)) for p in pools(x)))(x)

    exs = [(_vec(n),) for n in (7, 1, 4, 0, 8)]
    check_oracle(f, exs, [(8,)], modes=("eager", "jit", "vmap"))


def test_max_pool_jvp_inside_mask_uses_select_and_gather_add():
    def f(x, t):
        return jax.jvp(_max_pool, (x,), (t,))

    jaxpr = jax.make_jaxpr(f)(jnp.ones(7), jnp.ones(7))
    assert "select_and_gather_add" in str(jaxpr)
    exs = [(_vec(n), _vec(n)) for n in (7, 1, 4, 0, 8)]
    check_oracle(jax.jit(f), exs, [(8,), (8,)], ("n", "n"), modes=("eager", "jit", "vmap"))


def test_max_pool_grad_nan_padding():
    """Case 15 for pooling: grad finite, 0 in padding, equal on the logical region."""
    exs = [(_vec(n),) for n in (7, 2, 5)]
    check_oracle(jax.jit(lambda x: (_max_pool(x),
                                    lax.reduce_window(x, 0.0, lax.add, (3,), (2,), "SAME") / 3)),
                 exs, [(8,)], modes=("grad",))


# ----------------------------------------------------------------------------
# Window sizes given by a dimension expression (JAX's shape_poly_test harnesses
# reduce_window/*_window_size=dynamic)
# ----------------------------------------------------------------------------
def _rw_dynamic_window(x):
    """x: f32[b, 8]; the window over the static axis 1 has size b."""
    w = (2, x.shape[0])
    return (lax.reduce_window(x, np.float32(1.0), lax.min, w, (1, 1), "VALID"),  # generic
            lax.reduce_window(x, np.float32(1.0), lax.min, w, (1, 1), "VALID")
            + lax.reduce_window(x, np.float32(1.0), lax.max, w, (1, 1), "VALID"),
            lax.reduce_window(x, np.float32(0.0), lax.add, w, (1, 1), "VALID"),  # monoid
            lax.reduce_window(x, -jnp.inf, lax.max, w, (1, 2), "SAME"),
            lax.reduce_window(x, jnp.inf, lax.min, w, (2, 3), [(1, 0), (2, 1)]))


def test_reduce_window_dynamic_window_size():
    exs = [(_rand(b, 8),) for b in (3, 1, 2, 6)]
    check_oracle(_rw_dynamic_window, exs, [(6, 8)], "b, ...", modes=("eager", "jit", "vmap"))


def test_reduce_window_dynamic_window_size_repro():
    f = lambda x: lax.reduce_window(x, np.float32(1.), lax.min, (2, x.shape[0]), (1, 1),
                                    "VALID")
    x = np.full((6, 8), np.nan, np.float32)
    x[:3] = RNG.random((3, 8))
    for g in (pm.mask(f, "b, ..."), jax.jit(pm.mask(f, "b, ..."))):
        out = g(pm.Masked(jnp.asarray(x), (np.int32(3), 8)))
        np.testing.assert_array_equal(out.unpad(), f(jnp.asarray(x[:3])))
        assert out.unpad().shape == (2, 6)


def test_reduce_window_dynamic_window_variadic_and_grad():
    def f(x, y):  # the variadic generic harness (a non-associative reducer)
        return lax.reduce_window((x, y), (np.float32(1.0), np.int32(2)),
                                 lambda a, b: (lax.add(a[0], b[0]), lax.sub(a[1], b[1])),
                                 (2, x.shape[0]), (1, 1), "VALID")

    exs = [(_rand(b, 8), RNG.integers(-9, 9, size=(b, 8)).astype(np.int32))
           for b in (3, 1, 5)]
    check_oracle(f, exs, [(6, 8), (6, 8)], ("b, ...", "b, ..."),
                 modes=("eager", "jit", "vmap"))
    # Monoid reductions are differentiable (through lax.switch); a whole-axis
    # window of a dynamic axis is its reduction.
    g = lambda x: (lax.reduce_window(x, 0.0, lax.add, (2, x.shape[0]), (1, 1), "VALID"),
                   lax.reduce_window(x, -jnp.inf, lax.max, (x.shape[0], 1), (1, 1), "VALID"))
    check_oracle(g, [(_rand(b, 8),) for b in (3, 1, 6)], [(6, 8)], "b, ...")


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_max_pool_dynamic_window_grad_and_jvp_inside_mask():
    pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (x.shape[0] // 2 + 1,), (2,),
                                       "SAME")
    f = lambda x: (jax.grad(lambda x: jnp.sum(jnp.sin(pool(x))))(x),
                   jax.jvp(pool, (x,), (jnp.cos(x),)))
    exs = [(_vec(n),) for n in (7, 1, 4, 8)]
    check_oracle(f, exs, [(8,)], "n", modes=("eager", "jit", "vmap"))


def test_reduce_window_dynamic_window_size_zero_raises():
    """Plain JAX rejects a window size 0 (b = 0); so does the masked function."""
    f = lambda x: lax.reduce_window(x, 0.0, lax.add, (1, x.shape[0]), (1, 1), "VALID")
    with pytest.raises(TypeError, match="strictly positive"):
        f(jnp.zeros((0, 8)))
    m = pm.mask(f, "b, ...")
    arg = pm.Masked(jnp.full((6, 8), np.nan, jnp.float32), (np.int32(0), 8))
    with pytest.raises(pm.ShapeError, match="(?s)b in {0}.*strictly positive"):
        m(arg)
    with pytest.raises(Exception, match=r"(?s)ShapeError\[TypeError\]: for these sizes .b in {0}"):
        jax.block_until_ready(jax.jit(m)(arg))


def test_reduce_window_dynamic_window_size_too_many_values():
    f = lambda x: lax.reduce_window(x, 0.0, lax.add, (x.shape[0],), (1,), "SAME")
    with pytest.raises(pm.UnsupportedError,
                       match=r"(?s)reduce_window_sum.*depends on a dynamic size.*jnp.min"):
        pm.mask(f, "n")(pm.Masked(jnp.ones(100), (jnp.int32(50),)))
    # Static logical sizes need no dispatch.
    out = pm.mask(f, "n")(pm.Masked(jnp.ones(100), (50,)))
    np.testing.assert_allclose(out.unpad(), f(jnp.ones(50)))


def test_global_pooling_window_spans_axis_at_any_bound():
    """A window equal to the whole axis (PointNet's ``nn.max_pool(x, (num_points, 1))``,
    global average pooling) is one reduction: no branch per window size, so a
    bound of 100 (more window sizes than the switch allows) works, gradients too."""
    def f(x):
        w = (x.shape[0], 1)
        return (lax.reduce_window(x, -jnp.inf, lax.max, w, (1, 1), "VALID"),
                lax.reduce_window(x, 0.0, lax.add, w, (2, 1), "VALID") / x.shape[0],
                lax.reduce_window(x, 0.0, lax.add, (x.shape[0] + 2, 1), (1, 1),
                                  [(1, 1), (0, 0)]))

    def generic(x):  # not differentiable in plain JAX
        return lax.reduce_window(x, np.float32(0.0), _add, (x.shape[0], 1), (1, 1), "VALID")

    exs = [(_rand(b, 3),) for b in (100, 1, 37, 64, 65)]
    check_oracle(f, exs, [(100, 3)], "b, ...")
    check_oracle(generic, exs, [(100, 3)], "b, ...", modes=("eager", "jit", "vmap"))
    g = pm.mask(f, "b, ...")
    with pytest.raises(pm.ShapeError, match="strictly positive"):
        g(pm.Masked(jnp.full((100, 3), np.nan, jnp.float32), (np.int32(0), 3)))


# ----------------------------------------------------------------------------
# Generic reduce_window whose init value is not an identity of its reducer
# (JAX's shape_poly_test harness reduce_window/add_generic_window_size=static).
# XLA skips padding positions and base-dilation holes (each window is init
# combined with its in-bounds elements only), so positions past the logical
# size must contribute nothing: no fill value does that for every reducer.
# ----------------------------------------------------------------------------
def _add(a, b):  # not lax.add: JAX must not recognise the monoid
    return a + b


def _halve_add(a, b):  # non-associative: the order of the reducer calls matters
    return a * 0.5 + b


def test_reduce_window_generic_init_harness_repro():
    """add with init 1 (generic path), window 4, stride 2, SAME over ``16*b``."""
    def f(x):
        return lax.reduce_window(jnp.reshape(x, (1, -1, 1)), np.float32(1.), lax.add,
                                 (1, 4, 1), (1, 2, 1), "SAME")

    assert "reduce_window[" in str(jax.make_jaxpr(f)(np.ones((1, 4, 2), np.float32)))
    x = np.full((1, 8, 2), np.nan, np.float32)
    x[:, :5] = RNG.random((1, 5, 2))
    for g in (pm.mask(f, "_, b, ..."), jax.jit(pm.mask(f, "_, b, ..."))):
        out = g(pm.Masked(jnp.asarray(x), (1, jnp.int32(5), 2)))
        np.testing.assert_allclose(out.unpad(), f(jnp.asarray(x[:, :5])), rtol=1e-6)
    exs = [(_rand(1, b, 2),) for b in range(9)]
    check_oracle(f, exs, [(1, 8, 2)], "_, b, ...", modes=("eager", "jit", "vmap"))


def _rw_generic_sweep_fn(stride, base_dilation):
    pads = [*PADS, [(0, 3)], [(2, -1)], [(3, 3)]]

    def f(x):
        return [lax.reduce_window(x, np.float32(init), red, (3,), (stride,), pad,
                                  base_dilation=(base_dilation,), window_dilation=(wd,))
                for red, init in ((_add, 1.0), (_halve_add, 0.0))
                for pad in pads for wd in (1, 2)]

    return jax.jit(f)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
@pytest.mark.parametrize("stride", [1, 3])
def test_reduce_window_generic_non_identity_init_sweep(stride):
    """Every logical size 0..bound; VALID/SAME/SAME_LOWER/explicit (negative too)
    padding, window dilation; base dilation 2 from size 1 (module docstring)."""
    exs = [(_vec(n),) for n in range(BOUND + 1)]
    check_oracle(_rw_generic_sweep_fn(stride, 1), exs, [(BOUND,)], modes=("jit", "vmap"))
    check_oracle(_rw_generic_sweep_fn(stride, 1), exs[4:5], [(BOUND,)], modes=("eager",))
    check_oracle(_rw_generic_sweep_fn(stride, 2), exs[1:], [(BOUND,)], modes=("jit",))


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_reduce_window_generic_non_identity_init_2d_dynamic_window_variadic():
    def f2(x):  # two masked axes
        return (lax.reduce_window(x, np.float32(1.), _add, (2, 3), (2, 1), "SAME"),
                lax.reduce_window(x, np.float32(1.), _add, (3, 2), (1, 2), [(1, 2), (2, 0)],
                                  base_dilation=(1, 2)),
                lax.reduce_window(x, np.float32(2.), lax.mul, (2, 2), (1, 1), "VALID"))

    exs = [(_rand(a, b),) for a, b in ((4, 5), (1, 1), (0, 3), (2, 1), (3, 4))]
    check_oracle(jax.jit(f2), exs, [(4, 5)], "a, b", modes=("jit", "vmap"))
    check_oracle(jax.jit(f2), exs[:1], [(4, 5)], "a, b", modes=("eager",))

    def fdyn(x):  # window size b over the static axis
        w = (2, x.shape[0])
        return (lax.reduce_window(x, np.float32(1.), _add, w, (1, 2), "SAME"),
                lax.reduce_window(x, np.float32(1.), _halve_add, w, (2, 1), [(1, 1), (0, 2)]))

    exs = [(_rand(b, 8),) for b in (3, 1, 2, 6)]
    check_oracle(fdyn, exs, [(6, 8)], "b, ...", modes=("eager", "jit", "vmap"))

    def fvar(x, y):  # variadic, an int operand, init 2 for the subtraction
        return lax.reduce_window((x, y), (np.float32(1.), np.int32(2)),
                                 lambda a, b: (a[0] + b[0], a[1] - b[1]), (3,), (2,), "SAME")

    exs = [(_vec(n), RNG.integers(-9, 9, size=n).astype(np.int32)) for n in range(8)]
    check_oracle(fvar, exs, [(7,), (7,)], ("n", "n"), modes=("eager", "jit", "vmap"))


def test_reduce_window_generic_non_identity_init_jvp():
    """Forward mode (JAX's generic reduce_window has a JVP, no transpose)."""
    fs = (lambda x: lax.reduce_window(x, np.float32(1.), _add, (4,), (2,), "SAME"),
          lambda x: lax.reduce_window(x, np.float32(0.), _halve_add, (3,), (1,), [(2, 1)]))
    for fn in fs:
        m = pm.mask(fn, "n")

        @jax.jit
        def jvp(x, t, n, m=m):
            return jax.jvp(lambda d: m(pm.Masked(d, (n,))).data, (x,), (t,))

        for n in range(9):
            x, t = _vec(8), _vec(8)
            p, tp = jvp(x, t, jnp.int32(n))
            p0, tp0 = jax.jvp(fn, (x[:n],), (t[:n],))
            k = p0.shape[0]
            np.testing.assert_allclose(p[:k], p0, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(tp[:k], tp0, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_conv_groups_with_dynamic_grouped_axes():
    """feature/batch groups whose grouped axis is dynamic (spec "2*k")."""
    @jax.jit
    def fgc_in(x, k):  # dynamic input features, 2 feature groups
        return lax.conv_general_dilated(x, k, (2,), "SAME", feature_group_count=2)

    exs = [(_rand(1, 2 * c, n), _rand(6, c, 3)) for c, n in ((2, 5), (1, 3), (3, 6))]
    _check(fgc_in, exs, [(1, 6, 6), (6, 3, 3)], ("1, 2*c, n", "6, c, 3"))

    @jax.jit
    def fgc_out(x, k):  # dynamic output features, 2 feature groups
        return lax.conv_general_dilated(x, k, (1,), "SAME", feature_group_count=2)

    exs = [(_rand(2, 4, n), _rand(2 * q, 2, 3)) for q, n in ((2, 5), (1, 3), (3, 6))]
    _check(fgc_out, exs, [(2, 4, 6), (6, 2, 3)], ("2, 4, n", "2*q, 2, 3"))

    @jax.jit
    def bgc(x, k):  # dynamic batch, 2 batch groups; and dynamic output features
        return lax.conv_general_dilated(x, k, (1,), "VALID", batch_group_count=2)

    exs = [(_rand(2 * m, 3, n), _rand(2 * q, 3, 2)) for m, q, n in ((2, 1, 5), (1, 2, 3),
                                                                     (3, 2, 6))]
    _check(bgc, exs, [(6, 3, 6), (4, 3, 2)], ("2*m, 3, n", "2*q, 3, 2"))


def test_output_bound_zero():
    """The window never fits the padded input: the output has bound 0."""
    f = pm.mask(lambda x: (conv1d(x, jnp.ones(8), 1, "VALID"),
                           lax.reduce_window(x, 0.0, lax.add, (8,), (1,), "VALID")), "n")
    for n in (0, 3, 4):
        a, b = f(pm.Masked(jnp.asarray(garbage_pad(np.ones(n, np.float32), (4,))),
                           (jnp.int32(n),)))
        assert a.data.shape == (0,) and b.data.shape == (0,)
        assert int(a.shape[0]) == 0 and int(b.shape[0]) == 0


@settings(max_examples=8)
@given(h=st.sampled_from([0, 1, 3, 5]), w=st.sampled_from([1, 2, 5]),
       stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       rd=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       pad=st.sampled_from(["VALID", "SAME", "SAME_LOWER", ((1, 0), (0, 2))]),
       kshape=st.tuples(st.integers(1, 3), st.integers(1, 3)))
def test_conv2d_property(h, w, stride, rd, pad, kshape):
    """Random 2-D conv / max pool parameters, sizes 0, 1 and the bound (eager)."""
    k = _rand(2, 2, *kshape)
    rw_pad = pad if isinstance(pad, str) else ((0, 0), (0, 0), *pad)

    def f(x):
        return (lax.conv_general_dilated(x, k, stride, pad, rhs_dilation=rd),
                lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, *kshape), (1, 1, *stride),
                                  rw_pad, window_dilation=(1, 1, *rd)))

    check_oracle(f, [(_rand(1, 2, h, w),)], [(1, 2, 5, 5)], ("1, 2, h, w",), modes=("eager",),
                 static_sizes=False)


def test_vmap_of_conv_with_a_kernel_per_example():
    # jax.vmap of a convolution whose kernel is batched too: JAX's batching rule
    # makes the batch the group count (feature_group_count = b, a dim var), and
    # reshapes with `dimensions` (a transpose first); its gradient uses
    # batch_group_count = b. Both were refused before.
    conv = lambda l, r: lax.conv_general_dilated(l, r, (1, 2), "SAME")
    f = lambda lhs, rhs: jax.vmap(conv)(lhs, rhs)
    rng = np.random.default_rng(5)
    lhs = rng.normal(size=(4, 2, 3, 7, 8)).astype(np.float32)
    rhs = rng.normal(size=(4, 5, 3, 3, 2)).astype(np.float32)
    exs = [(lhs[:b], rhs[:b]) for b in (0, 1, 3, 4)]
    bounds = [(4, 2, 3, 7, 8), (4, 5, 3, 3, 2)]
    check_oracle(f, exs, bounds, ("b, 2, 3, 7, 8", "b, 5, 3, 3, 2"))


def test_conv_with_an_empty_kernel_axis_raises_as_plain_jax():
    # plain JAX rejects a kernel axis of length 0; the masked conv returned zeros
    f = lambda x, w: lax.conv_general_dilated(x[None, None], w[None, None], (1,), "VALID")[0, 0]
    with pytest.raises(ValueError, match="positive value"):
        f(jnp.ones(3), jnp.ones(0))
    mf = pm.mask(f, ("n", "m"))
    for n in (3, 0):
        args = (pm.Masked(jnp.full(8, jnp.nan), (np.int32(n),)),
                pm.Masked(jnp.full(6, jnp.nan), (np.int32(0),)))
        with pytest.raises(ValueError, match=r"expects window to have positive value for 0-th "
                                             r"window dimension, but got 0") as e:
            mf(*args)
        assert isinstance(e.value, pm.ShapeError)
        with pytest.raises(Exception, match="positive value"):
            jax.jit(mf)(*args)
    x = pm.Masked(jnp.asarray([1.0, 2.0, 3.0, 0.0]), (np.int32(3),))
    np.testing.assert_array_equal(mf(x, pm.Masked(jnp.ones(6), (np.int32(2),))).unpad(), [3, 5])


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_kernel_gradient_of_a_conv_over_an_empty_axis_is_zero_as_plain_jax(padding):
    # JAX's kernel transpose returns zeros for an empty cotangent (`if
    # np.size(g) == 0`) instead of a convolution with an empty window: that
    # test splits the trace at n = 0
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(3, 2, 4)), jnp.float32)

    def kernel_grad(w, x):
        def loss(w):
            y = lax.conv_general_dilated(x[None], w, (1,), padding,
                                         dimension_numbers=("NWC", "WIO", "NWC"))
            return jnp.sum(y ** 2)
        return jax.grad(loss)(w)

    lengths = (0, 1, 2, 3, 5, 8) if padding == "SAME" else (3, 4, 8)
    examples = [(w, rng.normal(size=(n, 2)).astype(np.float32)) for n in lengths]
    check_oracle(kernel_grad, examples, [None, (8, 2)], (None, "n, 2"), modes=("eager", "jit", "vmap"),
                 rtol=1e-4, atol=1e-4)


def _tf_same_conv(x, k, stride, lhs_dilation=1):
    """TensorFlow-style SAME padding computed by hand from the length (audio
    front ends: algoperf's Conformer subsampling pads ``ceil(t/s)*s - t``)."""
    n, size = x.shape[0], k.shape[0]
    total = max((-(-n // stride) - 1) * stride + size - n, 0)
    lo = total // 2
    return conv1d(x, k, stride, [(lo, total - lo)], lhs_dilation=lhs_dilation)


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_explicit_padding_computed_from_the_size(stride):
    """JAX's conv takes explicit padding as int pairs only, so a pad computed
    from a symbolic size was a raw ValueError past the per-size limit (and a
    program of one copy per size within it). It pads the input with lax.pad
    now: one program for every size, at a bound beyond the per-size limit."""
    k = jnp.asarray(RNG.normal(size=(3,)).astype(np.float32))
    fun = lambda x: _tf_same_conv(x, k, stride)  # noqa: E731
    exs = [(_vec(n),) for n in (7, 0, 1, 2, 40)]
    oracle(fun, exs, [(40,)], "n")
    traced = []

    def counted(x):
        traced.append(1)
        return fun(x)

    pm.mask(counted, "n")(pm.Masked(jnp.asarray(garbage_pad(_vec(5), (40,))), (5,)))
    assert len(traced) <= 4  # cases of the max and floor divisions, not one per size


def test_explicit_size_padding_with_lhs_dilation_and_negative_amounts():
    """lax.pad applies lhs dilation as interior padding and crops on negative
    amounts, as XLA's conv does with its padding."""
    k = jnp.asarray(RNG.normal(size=(2,)).astype(np.float32))

    def fun(x):
        n = x.shape[0]
        return conv1d(x, k, 2, [(n % 3, -(n % 2))], lhs_dilation=2)

    oracle(fun, [(_vec(n),) for n in (9, 1, 2, 4, 40)], [(40,)], "n")


def test_explicit_size_padding_through_jaxs_own_conv_wrappers():
    """lax.conv_with_general_padding calls JAX's internal conv_general_dilated:
    the same replacement serves it."""
    k = jnp.asarray(RNG.normal(size=(1, 1, 3)).astype(np.float32))

    def fun(x):
        n = x.shape[0]
        pad = -(-n // 2) * 2 - n
        return lax.conv_with_general_padding(x[None, None], k, (2,), [(0, pad + 1)],
                                             None, None)[0, 0]

    oracle(fun, [(_vec(n),) for n in (5, 1, 2, 40)], [(40,)], "n")
