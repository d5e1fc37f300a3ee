"""jnp.searchsorted / digitize / interp / convolve / correlate over dynamic lengths
(trace patches in rules/numeric.py): values, dtypes and logical shapes equal
plain JAX at sizes 0, 1, mid and the bound, with garbage padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import oracle

import polymask

B = 8  # bound of the dynamic axes (one bound-64 polymask.jit case below)
SIZES = (0, 1, 5, B)
rng = np.random.default_rng(0)


def sorted_bins(n, ties=True):
    a = np.sort(rng.integers(0, 6, n) if ties else rng.normal(size=n)).astype(np.float32)
    return a


def queries(k=6):
    return np.array([-1.0, 0.0, 2.0, 2.5, 5.0, 7.0][:k], np.float32)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("method", ["scan", "sort", "compare_all"])
def test_searchsorted(side, method):
    exs = [(sorted_bins(n), queries()) for n in SIZES]
    oracle(lambda a, v: jnp.searchsorted(a, v, side=side, method=method), exs,
           [(B,), None], modes=("eager", "jit", "vmap"))


def test_searchsorted_dynamic_queries_and_sorter():
    exs = [(rng.permutation(np.arange(n, dtype=np.float32) * 2), rng.normal(size=m).astype(
        np.float32) * 8) for n, m in [(0, 3), (1, 0), (5, 4), (B, B)]]
    oracle(lambda a, v: jnp.searchsorted(a, v, sorter=jnp.argsort(a)), exs, [(B,), (B,)],
           modes=("eager", "jit", "vmap"))
    ints = [(np.sort(rng.integers(0, 9, n)).astype(np.int32), np.arange(-1, 10, dtype=np.int32))
            for n in SIZES]
    oracle(lambda a, v: jnp.searchsorted(a, v, side="right"), ints, [(B,), None],
           modes=("eager", "jit", "vmap"))


@pytest.mark.parametrize("right", [False, True])
def test_digitize(right):
    exs = [(queries(), sorted_bins(n)) for n in SIZES]
    exs += [(queries(), sorted_bins(5)[::-1].copy())]  # decreasing bins
    oracle(lambda q, b: jnp.digitize(q, b, right=right), exs, [None, (B,)],
           modes=("eager", "jit", "vmap"))


def interp_examples(sizes, dynamic_q=False):
    exs = []
    for n in sizes:
        xp = np.sort(rng.uniform(0, 4, n)).astype(np.float32)
        q = np.linspace(-1, 5, 7, dtype=np.float32)
        exs.append((q[: 2 + n % 5] if dynamic_q else q, xp, np.sin(xp) * 3))
    return exs


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
@pytest.mark.parametrize("kw", [{}, {"left": -7.0, "right": 9.0},
                                {"left": "extrapolate", "right": "extrapolate"},
                                {"period": 3.0}])
def test_interp(kw):
    exs = interp_examples((1, 2, 5, B))
    oracle(lambda q, xp, fp: jnp.interp(q, xp, fp, **kw), exs, [None, (B,), (B,)],
           ["_", "n", "n"])


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_interp_dynamic_queries_grad():
    exs = interp_examples((1, 5, B), dynamic_q=True)
    oracle(lambda q, xp, fp: jnp.interp(q, xp, fp), exs, [(B,), (B,), (B,)],
           ["m", "n", "n"], n_grad=3)


def test_interp_of_repeated_and_infinite_knots_is_the_installed_jaxs():
    """Knots that repeat (queries at them) and infinite knot values: the
    installed JAX's own ``_interp`` runs (jax 0.12 returns the last repeated
    knot's value where 0.10 returned the first; a copy of 0.10's code gave
    0.10's answer on 0.12: helper B)."""
    q = np.array([-1.0, 0.0, 0.5, 1.0, 2.0, 3.0], np.float32)
    exs = [(q, np.array(xp, np.float32), np.array(fp, np.float32)) for xp, fp in (
        ([0.0, 0.0], [-0.5, 1.25]),
        ([0.0, 1.0, 1.0, 3.0], [1.0, 2.0, -2.0, 4.0]),
        ([0.0, 0.0, 0.0, 2.0, 2.0], [3.0, -1.0, 5.0, 0.5, 7.0]),
        ([0.0, 1.0, 2.0], [1.0, np.inf, 2.0]),
        ([1.0], [4.0]))]
    oracle(lambda q, xp, fp: jnp.interp(q, xp, fp), exs, [None, (B,), (B,)],
           ["_", "n", "n"], modes=("eager", "jit", "vmap"))


def test_interp_empty_raises_like_jax():
    f = polymask.mask(lambda q, xp, fp: jnp.interp(q, xp, fp), ["_", "n", "n"])
    with pytest.raises(TypeError):  # plain JAX: an out-of-range gather
        jnp.interp(jnp.ones(3), jnp.zeros(0), jnp.zeros(0))
    z = polymask.pad(jnp.zeros(0), B)
    with pytest.raises(polymask.ShapeError):
        f(jnp.ones(3), z, z)


CONV_PAIRS = [(1, 1), (1, 3), (2, 5), (5, 2), (5, 5), (B, 3), (3, B), (B, B)]


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
@pytest.mark.parametrize("op", ["convolve", "correlate"])
@pytest.mark.parametrize("mode", ["full", "same", "valid"])
def test_convolve_both_dynamic(op, mode):
    fn = getattr(jnp, op)
    exs = [(rng.normal(size=n).astype(np.float32), rng.normal(size=m).astype(np.float32))
           for n, m in CONV_PAIRS]
    oracle(lambda a, v: fn(a, v, mode=mode), exs, [(B,), (B,)], n_grad=3)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
@pytest.mark.parametrize("op", ["convolve", "correlate"])
def test_convolve_static_kernel_ints(op):
    fn = getattr(jnp, op)
    exs = [(np.arange(n, dtype=np.int32) - 2, np.array([1, -2, 3], np.int32)) for n in (1, 2, 5, B)]
    oracle(lambda a, v: fn(a, v, mode="same"), exs, [(B,), None], modes=("eager", "jit", "vmap"))
    oracle(lambda a, v: fn(a, v, mode="full", preferred_element_type=jnp.int32), exs,
           [(B,), None], modes=("eager", "jit", "vmap"))


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("mode", ["full", "same"])
def test_convolve_of_a_signal_shorter_than_the_kernel_keeps_its_inf_as_plain_jax(mode, layout):
    """Below the kernel's length the data is ``_conv``'s kernel; JAX's symbolic
    padding of the constant operand is an explicit ``lax.pad`` whose zeros
    met the data's inf (``0 * inf``: NaN in every output where plain JAX has
    ``inf``, ``-inf`` and finite values). The data is padded instead."""
    k = jnp.array([1.0, -0.5, 0.25])
    f = lambda x: jnp.convolve(x, k, mode=mode)
    examples = [np.array([np.inf], np.float32), np.array([np.inf, 2.0], np.float32),
                np.array([0.5, -1.0, 2.0, 4.0], np.float32)]
    if layout == "padded":
        g = jax.jit(polymask.mask(f, "n"))
        got = []
        for x in examples:
            out = g(polymask.Masked(jnp.asarray(np.pad(x, (0, 6 - len(x)))),
                                    (jnp.int32(len(x)),)))
            got.append(np.asarray(out.data)[: len(f(jnp.asarray(x)))])
    else:
        got = polymask.ragged_map(f, ("n",), layout="packed", row_size=16)(examples)
    for x, g_ in zip(examples, got):
        np.testing.assert_array_equal(np.asarray(g_), np.asarray(f(jnp.asarray(x))))


def test_convolve_empty_raises_shape_error():
    f = polymask.mask(lambda a, v: jnp.convolve(a, v))
    with pytest.raises(ValueError):
        jnp.convolve(jnp.zeros(0), jnp.ones(3))
    with pytest.raises(polymask.ShapeError):
        f(polymask.pad(jnp.zeros(0), B), jnp.ones(3))
    out = f(polymask.pad(jnp.ones(4), B), jnp.ones(3))  # the other sizes still run
    np.testing.assert_allclose(out.unpad(), jnp.convolve(jnp.ones(4), jnp.ones(3)))


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_polymask_jit_bound_64_one_compile():
    def f(bins, q, sig, ker):
        return (jnp.searchsorted(bins, q), jnp.digitize(q, bins, right=True),
                jnp.interp(q, bins, bins * 2.0 + 1.0), jnp.convolve(sig, ker, mode="same"))

    pf = polymask.jit(f, ("n", "m", "s", "_"), buckets=polymask.buckets.fixed(64))
    ker = np.array([0.25, 0.5, 0.25], np.float32)
    for n, m, s in [(50, 20, 40), (33, 64, 17), (64, 1, 60)]:
        bins = np.sort(rng.uniform(0, 10, n)).astype(np.float32)
        q = rng.uniform(-1, 11, m).astype(np.float32)
        sig = rng.normal(size=s).astype(np.float32)
        got, want = pf(bins, q, sig, ker), f(*map(jnp.asarray, (bins, q, sig, ker)))
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert pf.stats()["compiles"] == 1


def test_outside_masked_trace_unchanged():
    a = jnp.array([1.0, 2.0, 3.0])
    assert jnp.searchsorted(a, 2.0).dtype == jnp.int32
    n, = jax.export.symbolic_shape("n")
    with pytest.raises(TypeError):  # plain JAX's own error: no patch outside a masked trace
        jax.make_jaxpr(jnp.convolve)(jax.ShapeDtypeStruct((n,), jnp.float32), a)


def test_compat_numeric():
    from polymask._jax_compat import numeric as compat_numeric

    mod = compat_numeric.lax_numpy_module()
    assert all(callable(getattr(mod, n)) for n in ("searchsorted", "_interp", "_conv"))
    assert set(compat_numeric.searchsorted_methods()) >= {"scan", "sort", "compare_all"}
    a, b = compat_numeric.promote_dtypes_inexact(jnp.arange(3), 1.0)
    assert a.dtype == b.dtype == jnp.float32
