"""Data-dependent output sizes (issue 4): nonzero, where, boolean masks, unique,
value-sized arange and dynamic_slice; ACCEPTANCE.md case 9."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import polymask as pm
from polymask.testing import check_oracle, garbage_pad


def oracle(f, exs, bounds, *, eager=False, grad=True, n_grad=2, **kw):
    """check_oracle: jit + vmap on all examples, eager and grad on the first ``n_grad``."""
    check_oracle(f, exs, bounds, modes=("jit", "vmap"), **kw)
    if eager:
        check_oracle(f, exs[:n_grad], bounds, modes=("eager",), static_sizes=False, **kw)
    if grad:
        check_oracle(f, exs[:n_grad], bounds, modes=("grad",), **kw)


X9 = np.array([0.0, 5, 0, 6, 0, 7], np.float32)


def dyn(x, n, bound=None):
    """Masked with dynamic size n (garbage padding up to ``bound``)."""
    x = np.asarray(x)
    bound = bound or x.shape[0]
    return pm.Masked(jnp.asarray(garbage_pad(x[:n], (bound,) + x.shape[1:])),
                     (jnp.int32(n),) + tuple(x.shape[1:]))


# ----------------------------------------------------------------------------
# ACCEPTANCE.md case 9
# ----------------------------------------------------------------------------
def test_case9_nonzero():
    f = pm.mask(pm.nonzero)
    (idx,) = f(jnp.asarray(X9))  # plain (unpadded) input: the count is still dynamic
    assert idx.bound == (6,)
    assert int(idx.shape[0]) == 3
    np.testing.assert_array_equal(idx.unpad(), [1, 3, 5])
    # padded with NaN garbage: same logical result
    (idx,) = f(pm.Masked(jnp.asarray(garbage_pad(X9, (9,))), (jnp.int32(6),)))
    np.testing.assert_array_equal(idx.unpad(), [1, 3, 5])


def test_case9_gather_prod():
    f = pm.mask(lambda x: x[pm.nonzero(x)].prod())
    assert float(f(jnp.asarray(X9)).data) == 210
    assert float(f(dyn(X9, 6, 10)).data) == 210
    assert float(f(dyn(X9, 4, 10)).data) == 30


def test_case9_zeros_and_ones():
    f = pm.mask(lambda x: pm.nonzero(x)[0])
    z = f(jnp.zeros(5))
    o = f(jnp.ones(5))
    assert int(z.shape[0]) == 0 and z.unpad().shape == (0,)
    assert int(o.shape[0]) == 5
    np.testing.assert_array_equal(o.unpad(), np.arange(5))
    # the count feeds later ops: sum over an empty selection is 0
    g = pm.mask(lambda x: jnp.sum(x[pm.nonzero(x)]))
    assert float(g(jnp.zeros(5)).data) == 0
    assert float(g(jnp.ones(5)).data) == 5


def test_case9_oracle():
    exs = [(X9,), (np.zeros(6, np.float32),), (np.ones(6, np.float32),),
           (X9[:2],), (np.zeros(0, np.float32),)]
    oracle(lambda x: (x[pm.nonzero(x)].prod(), pm.nonzero(x)), exs, [(8,)], eager=True)


# ----------------------------------------------------------------------------
# the other "done when" items
# ----------------------------------------------------------------------------
def test_vmap_one_argument_where():
    rows = jnp.array([[0, 0, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0]])
    f = pm.mask(lambda r: pm.where(r)[0], "n")
    out = jax.vmap(f)(pm.Masked(rows, (jnp.full(3, 4, jnp.int32),)))
    np.testing.assert_array_equal(out.shape[0], [2, 2, 2])
    got = [np.asarray(out.data[i, :int(out.shape[0][i])]) for i in range(3)]
    want = [np.where(np.asarray(r))[0] for r in rows]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    # ragged rows: each example gets its own logical length and count
    out = jax.vmap(f)(pm.Masked(rows, (jnp.array([4, 1, 3], jnp.int32),)))
    np.testing.assert_array_equal(out.shape[0], [2, 1, 2])
    np.testing.assert_array_equal(out.data[1, :1], [0])
    np.testing.assert_array_equal(out.data[2, :2], [1, 2])


def test_boolean_mask_sum_arange10():
    f = pm.mask(lambda x: pm.boolean_mask(x, x < 5).sum())
    assert float(f(jnp.arange(10.0)).data) == 10
    assert float(f(dyn(np.arange(10.0), 10, 16)).data) == 10
    assert float(f(dyn(np.arange(10.0), 3, 16)).data) == 3
    fi = pm.mask(lambda x: pm.boolean_mask(x, x < 5).sum())
    assert int(fi(jnp.arange(10)).data) == 10


def test_unique_padded_repeated():
    x = np.array([3, 1, 3, 2, 1, 9, 9, 2], np.int32)

    def f(v):
        return pm.unique(v, return_index=True, return_inverse=True, return_counts=True)

    jf = jax.jit(pm.mask(f))
    for n in (0, 1, 5, 8):
        outs = jf(dyn(x, n, 12))
        want = np.unique(x[:n], return_index=True, return_inverse=True, return_counts=True)
        for o, w in zip(outs, want):
            np.testing.assert_array_equal(o.unpad(), w)
    check_oracle(f, [(x,), (x[:5],), (x[:1],), (x[:0],)], [(12,)], modes=("vmap",))
    floats = [(np.array([2.5, np.nan, 1, 2.5, np.nan], np.float32),),
              (np.array([1.0, 1, 1], np.float32),)]
    oracle(pm.unique, floats, [(8,)], grad=False)


def test_arange_sum_one_compile():
    traces = []

    def f(x):
        traces.append(1)
        k = jnp.sum(x > 0)
        return pm.arange(k, max_size=16).sum()

    jf = jax.jit(pm.mask(f))
    for k in (0, 1, 3, 7, 16):
        x = np.zeros(16, np.float32)
        x[:k] = 1
        assert int(jf(pm.Masked(jnp.asarray(x), (jnp.int32(16),))).data) == k * (k - 1) // 2
    assert len(traces) == 1


def test_arange_variants():
    def f(x):
        k = jnp.sum(x > 0)
        return pm.arange(2, k + 2, 3, max_size=20)

    for k in (0, 1, 4, 7):
        x = np.zeros(16, np.float32)
        x[:k] = 1
        out = pm.mask(f)(jnp.asarray(x))
        np.testing.assert_array_equal(out.unpad(), np.arange(2, k + 2, 3))
    with pytest.raises(pm.ShapeError, match="max_size"):
        pm.mask(lambda x: pm.arange(jnp.sum(x > 0)))(jnp.ones(3))
    with pytest.raises(pm.ShapeError, match="max_size=2(.|\n)*test_data_dependent.py"):
        pm.mask(lambda x: pm.arange(jnp.sum(x > 0), max_size=2))(jnp.ones(3))
    # a size-derived (symbolic) length needs no max_size
    out = pm.mask(lambda x: pm.arange(x.shape[0]) * 2)(dyn(np.ones(4), 3, 8))
    np.testing.assert_array_equal(out.unpad(), [0, 2, 4])


# ----------------------------------------------------------------------------
# oracle per op: eager, jit (one trace), vmap (ragged), grad
# ----------------------------------------------------------------------------
VECS = [(np.array([0.5, -1, 2, 0, 3, -4], np.float32),),
        (np.array([-1.0, -2], np.float32),),
        (np.array([1.0, 2, 3, 4, 5, 6, 7, 8], np.float32),),
        (np.zeros(0, np.float32),)]


def test_boolean_mask_oracle_grad():
    def f(x):
        return (pm.boolean_mask(x, x > 0) ** 2, jnp.cumsum(pm.boolean_mask(x, x > 0)),
                jnp.sum(jnp.sin(pm.boolean_mask(x, x < 1))))

    oracle(f, VECS, [(8,)], eager=True)


def test_boolean_mask_2d():
    m = np.array([[1, 0, 1], [0, 1, 1]], bool)
    x = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    out = pm.mask(lambda x: pm.boolean_mask(x, x > 1.5))(
        pm.Masked(jnp.asarray(garbage_pad(x, (4, 5))), (jnp.int32(2), jnp.int32(3))))
    np.testing.assert_array_equal(out.unpad(), x[x > 1.5])
    # rows of a matrix selected by a vector mask along axis 0 and axis 1
    check_oracle(lambda x, r: pm.boolean_mask(x, r), [(x.T, m[1]), (x.T[:1], m[1, :1])],
                 [(4, 2), (4,)], in_specs=("n, 2", "n"), modes=("jit", "grad"))
    check_oracle(lambda x, c: pm.boolean_mask(x, c, axis=1) * 3.0,
                 [(x, m[0]), (x[:, :2], m[0, :2])], [(2, 5), (5,)], in_specs=("2, n", "n"),
                 modes=("jit", "vmap"))


def test_compress_extract():
    x = np.array([1.0, 2, 3, 4, 5], np.float32)
    oracle(lambda v: (pm.compress(v > 2, v), pm.extract(v != 2, v) * 2.0),
           [(x,), (x[:2],), (x[:0],)], [(8,)])
    a = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    out = pm.mask(lambda a, c: pm.compress(c, a, axis=1), (None, None))(
        jnp.asarray(a), jnp.array([True, False, True, True]))
    np.testing.assert_array_equal(out.unpad(), np.compress([1, 0, 1, 1], a, axis=1))
    # a condition shorter than the axis (NumPy allows it)
    out = pm.mask(lambda c, v: pm.compress(c, v), ("m", "n"))(dyn([1, 0, 1], 3, 4),
                                                              dyn(x, 5, 8))
    np.testing.assert_array_equal(out.unpad(), [1.0, 3.0])
    with pytest.raises(pm.ShapeError, match="beyond the logical size"):
        pm.mask(lambda c, v: pm.compress(c, v), ("m", "n"))(dyn([0, 0, 0, 1], 4, 4),
                                                            dyn(x, 3, 8))


def test_gather_by_indices_grad():
    def f(x):
        (i,) = pm.nonzero(x > 0)
        return jnp.take(x, i) * 2.0 + jnp.cumsum(x[i])

    oracle(f, VECS, [(8,)])


def test_argwhere_flatnonzero_2d():
    a = np.array([[0, 1, 2], [3, 0, 0], [1, 1, 0]], np.float32)
    for shape in [(3, 3), (2, 3), (3, 1), (0, 2)]:
        sub = a[:shape[0], :shape[1]]
        mx = pm.Masked(jnp.asarray(garbage_pad(sub, (4, 5))),
                       (jnp.int32(shape[0]), jnp.int32(shape[1])))
        np.testing.assert_array_equal(pm.mask(pm.argwhere)(mx).unpad(), np.argwhere(sub))
        np.testing.assert_array_equal(pm.mask(pm.flatnonzero)(mx).unpad(), np.flatnonzero(sub))
        for o, w in zip(pm.mask(pm.nonzero)(mx), np.nonzero(sub)):
            np.testing.assert_array_equal(o.unpad(), w)


def test_chained_fresh_sizes():
    """A fresh size feeding another data-dependent op, reductions and masks."""
    def f(x):
        pos = pm.boolean_mask(x, x > 0)
        big = pm.boolean_mask(pos, pos > 2.0)
        return jnp.sum(big), jnp.mean(pos), pm.unique(jnp.floor(big)), big.shape[0] + 0

    check_oracle(f, VECS[:3] + [(np.array([3.0, 3, 4, 4, 1], np.float32),)], [(8,)],
                 modes=("jit", "vmap"))


def test_a_count_times_a_size_is_bounded_by_the_counts_own_bound():
    # A count (_u1 <= n) times a spec size m: JAX gives _u1*m no finite bound
    # where m is shifted (m__p1), and the cases of the split on m = 0 ask the
    # output's padded size before the count's rule binds it: a KeyError before
    def f(x):
        v = pm.boolean_mask(x[:, 0], x[:, 0] > 0)
        return jnp.outer(v, x[0]).reshape(-1) + jnp.arange(v.shape[0] * x.shape[1])

    x = np.where(np.arange(30).reshape(5, 6) % 4 == 1, 1.5, -1.0).astype(np.float32)
    exs = [(x[:a, :b],) for a, b in ((5, 6), (1, 1), (4, 2))]
    oracle(f, exs, [(5, 6)], in_specs="n, m", eager=True)


def test_a_slice_by_a_count_times_a_size_is_bounded_by_their_values():
    # JAX's procedure gives _u1*m (m shifted: _u1*m__p1 - _u1) no finite
    # bound; the gather of w[:c] said "unbounded dimension expression _u1*m"
    def f(x, z):
        v = pm.boolean_mask(x[:, 0], x[:, 0] > 0)
        w = jnp.outer(v, x[0]).reshape(-1)
        c = min(w.shape[0], z.shape[0])
        return w[:c] + z[:c]

    x = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)
    z = np.arange(7, dtype=np.float32)
    exs = [(x[:a, :b], z[:c]) for a, b, c in ((5, 6, 7), (4, 3, 5), (1, 2, 0))]
    check_oracle(f, exs, [(5, 6), (7,)], in_specs=("n, m", "k"), modes=("jit", "vmap"))


def test_dynamic_slice():
    x = np.arange(1.0, 9.0, dtype=np.float32)

    def f(v):
        k = jnp.sum(v > 3)
        return pm.dynamic_slice(v, 1, k) * 2.0

    oracle(f, [(x,), (x[:5],), (x[:2],), (x[:0],)], [(10,)], eager=True, n_grad=1)

    def g(v):  # x[:k] with k from data, bounded by max_size
        k = jnp.sum(v > 5)
        return pm.dynamic_slice(v, 0, k, max_size=4).sum()

    oracle(g, [(x[:7],), (x[:6],), (x[:1],)], [(10,)], n_grad=1)
    # static size, traced start; start clamped so the slice fits
    h = pm.mask(lambda v: pm.dynamic_slice(v, jnp.sum(v > 0), 2))
    np.testing.assert_array_equal(h(dyn(x, 5, 10)).unpad(), [4.0, 5.0])
    m2 = np.arange(20.0, dtype=np.float32).reshape(4, 5)
    out = pm.mask(lambda a: pm.dynamic_slice(a, (1, 1), (jnp.sum(a[0] > 1.5), 2)))(
        pm.Masked(jnp.asarray(garbage_pad(m2, (6, 6))), (jnp.int32(4), jnp.int32(5))))
    np.testing.assert_array_equal(out.unpad(), m2[1:4, 1:3])


# ----------------------------------------------------------------------------
# outside mask: NumPy results eagerly, clear errors under jit
# ----------------------------------------------------------------------------
def test_eager_matches_numpy():
    x = np.array([[0, 2, 0], [1, 0, 3]], np.float32)
    for o, w in zip(pm.nonzero(x), np.nonzero(x)):
        np.testing.assert_array_equal(o, w)
    np.testing.assert_array_equal(pm.argwhere(x), np.argwhere(x))
    np.testing.assert_array_equal(pm.flatnonzero(x), np.flatnonzero(x))
    np.testing.assert_array_equal(pm.where(x)[1], np.where(x)[1])
    np.testing.assert_array_equal(pm.where(x > 0, x, -1), np.where(x > 0, x, -1))
    np.testing.assert_array_equal(pm.boolean_mask(x, x > 0), x[x > 0])
    np.testing.assert_array_equal(pm.boolean_mask(x, [True, False, True], axis=1),
                                  x[:, [True, False, True]])
    np.testing.assert_array_equal(pm.compress([0, 1], x, axis=0), np.compress([0, 1], x, 0))
    np.testing.assert_array_equal(pm.extract(x > 0, x), np.extract(x > 0, x))
    for o, w in zip(pm.unique(x, True, True, True), np.unique(x, True, True, True)):
        np.testing.assert_array_equal(o, w)
    np.testing.assert_array_equal(pm.arange(5), np.arange(5))
    np.testing.assert_array_equal(pm.arange(1, 7, 2), np.arange(1, 7, 2))
    np.testing.assert_array_equal(pm.dynamic_slice(np.arange(6), 2, 3), np.arange(6)[2:5])
    g = jax.grad(lambda v: pm.boolean_mask(v, v > 0).sum())(jnp.array([1.0, -1, 2]))
    np.testing.assert_array_equal(g, [1, 0, 1])


def test_under_jit_without_mask_errors():
    x = jnp.array([0, 1, 2])
    for fn in (pm.nonzero, pm.argwhere, pm.flatnonzero, pm.where, pm.unique,
               lambda v: pm.boolean_mask(v, v > 0), lambda v: pm.compress(v > 0, v),
               lambda v: pm.arange(v[2]), lambda v: pm.dynamic_slice(v, 0, v[1])):
        with pytest.raises(pm.ShapeError, match="polymask.mask"):
            jax.jit(fn)(x)
    # size= works as in jax.numpy
    np.testing.assert_array_equal(jax.jit(lambda v: pm.nonzero(v, size=3)[0])(x), [1, 2, 0])


# ----------------------------------------------------------------------------
# item 6: jnp's data-dependent ops inside mask point to the polymask function
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("fn, suggestion", [
    (lambda x: jnp.nonzero(x)[0].sum(), "polymask.nonzero"),
    (lambda x: jnp.where(x)[0].sum(), "polymask.where"),
    (lambda x: x[x > 0].sum(), "polymask.boolean_mask"),
    (lambda x: jnp.argwhere(x).sum(), "polymask.argwhere"),
    (lambda x: jnp.flatnonzero(x).sum(), "polymask.flatnonzero"),
    (lambda x: jnp.unique(x).sum(), "polymask.unique"),
    (lambda x: jnp.compress(x > 0, x).sum(), "polymask.compress"),
    (lambda x: jnp.extract(x > 0, x).sum(), "polymask.extract"),
    (lambda x: jnp.arange(jnp.sum(x > 0)).sum(), "polymask.arange"),
    (lambda x: x[:jnp.sum(x > 0)].sum(), "polymask.dynamic_slice"),
])
def test_jnp_data_dependent_error_points_to_polymask(fn, suggestion):
    with pytest.raises(pm.ShapeError) as info:
        pm.mask(fn)(dyn(X9, 5, 8))
    msg = str(info.value)
    assert suggestion in msg
    assert "test_data_dependent.py" in msg  # the user's line


# ----------------------------------------------------------------------------
# property tests against NumPy (random masks, sizes 0..bound, NaN padding)
# ----------------------------------------------------------------------------
BOUND = 9
_nonzero_m = pm.mask(lambda x: (pm.nonzero(x)[0], pm.boolean_mask(x, x > 0),
                                pm.unique(jnp.round(x), return_counts=True)))
_nonzero_j = jax.jit(_nonzero_m)


@given(st.integers(0, BOUND), st.lists(st.sampled_from([0.0, 1.0, -2.0, 3.0]), min_size=BOUND,
                                       max_size=BOUND), st.booleans())
def test_property_vs_numpy(n, vals, use_jit):
    x = np.asarray(vals, np.float32)[:n]
    f = _nonzero_j if use_jit else _nonzero_m
    (idx, sel, (uv, uc)) = f(pm.Masked(jnp.asarray(garbage_pad(x, (BOUND,))), (jnp.int32(n),)))
    np.testing.assert_array_equal(idx.unpad(), np.nonzero(x)[0])
    np.testing.assert_array_equal(sel.unpad(), x[x > 0])
    wv, wc = np.unique(np.round(x), return_counts=True)
    np.testing.assert_array_equal(uv.unpad(), wv)
    np.testing.assert_array_equal(uc.unpad(), wc)


_ragged = jax.jit(jax.vmap(pm.mask(lambda x: pm.boolean_mask(x, x > 0) * 2.0)))


@given(st.lists(st.integers(0, BOUND), min_size=3, max_size=3), st.integers(0, 2 ** 16))
def test_property_ragged_vmap(sizes, seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 3, size=(3, BOUND)).astype(np.float32)
    padded = np.where(np.arange(BOUND)[None] < np.array(sizes)[:, None], data, np.nan)
    out = _ragged(
        pm.Masked(jnp.asarray(padded, jnp.float32), (jnp.asarray(sizes, jnp.int32),)))
    for i, n in enumerate(sizes):
        row = data[i, :n]
        k = int(out.shape[0][i])
        np.testing.assert_array_equal(np.asarray(out.data[i, :k]), row[row > 0] * 2)


def test_grad_inside_mask():
    """jax.grad in the masked function: JVP/transpose rules of the new primitives."""
    exs = [(np.array([0.5, -1, 2, 0, 3, -4], np.float32),), (np.array([-1.0, 2], np.float32),),
           (np.zeros(0, np.float32),)]

    def f(v):
        return (jnp.sum(pm.boolean_mask(v, v > 0) ** 2) + jnp.sum(v[pm.nonzero(v < 0)] ** 3)
                + jnp.sum(pm.dynamic_slice(v, 1, jnp.sum(v > 0)) * 5.0))

    check_oracle(jax.grad(f), exs, [(8,)], modes=("jit", "vmap"))
    g = jax.grad(lambda a: jnp.sum(pm.compress(jnp.array([True, False, True]), a, axis=1) ** 2))
    a = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(pm.mask(g)(jnp.asarray(a)).unpad(), g(jnp.asarray(a)))


def test_vmap_inside_mask():
    x = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    keep = jnp.array([True, False, True, True])
    out = pm.mask(lambda a: jax.vmap(lambda r: pm.boolean_mask(r, keep))(a))(jnp.asarray(x))
    np.testing.assert_array_equal(out.unpad(), x[:, [0, 2, 3]])
    out = pm.mask(lambda a: jax.vmap(lambda r: pm.dynamic_slice(r, 1, jnp.sum(a[0] > 0)))(a))(
        pm.Masked(jnp.asarray(x), (3, jnp.int32(4))))
    np.testing.assert_array_equal(out.unpad(), x[:, 1:4])
    with pytest.raises(pm.UnsupportedError, match="vmap outside"):
        pm.mask(jax.vmap(lambda r: pm.nonzero(r)))(jnp.ones((2, 3)))
    with pytest.raises(pm.UnsupportedError, match="test_data_dependent.py"):
        pm.mask(jax.vmap(lambda r: pm.boolean_mask(r, r > 0)))(jnp.ones((2, 3)))


_BOUND2 = (4, 5)


@jax.jit
def _two_d(m):
    def f(a):
        u = pm.unique(a, return_index=True, return_inverse=True, return_counts=True)
        return pm.nonzero(a), pm.argwhere(a), pm.flatnonzero(a), u, pm.extract(a > 0, a * 2.0)

    return pm.mask(f)(m)


@given(st.integers(0, 4), st.integers(0, 5), st.integers(0, 2 ** 16))
def test_property_2d_vs_numpy(r, c, seed):
    a = np.random.default_rng(seed).integers(0, 3, size=(r, c)).astype(np.float32)
    outs = _two_d(pm.Masked(jnp.asarray(garbage_pad(a, _BOUND2)), (jnp.int32(r), jnp.int32(c))))
    (nz, aw, fnz, uq, ex) = outs
    for o, w in zip(nz, np.nonzero(a)):
        np.testing.assert_array_equal(o.unpad(), w)
    np.testing.assert_array_equal(aw.unpad(), np.argwhere(a))
    np.testing.assert_array_equal(fnz.unpad(), np.flatnonzero(a))
    for o, w in zip(uq, np.unique(a, True, True, True)):
        np.testing.assert_array_equal(o.unpad(), w)
    np.testing.assert_array_equal(ex.unpad(), np.extract(a > 0, a * 2.0))


def test_sizes_from_counts_at_zero():
    """`n - count` with count 0 must fit its bound (JAX assumes dim vars >= 1)."""
    f = jax.jit(pm.mask(lambda x: jnp.ones(x.shape[0] - pm.nonzero(x)[0].shape[0]).sum(), "n"))
    for v, want in (([0.0, 0, 0], 3), ([1.0, 0, 1], 1), ([1.0, 1, 1], 0)):
        out = f(pm.Masked(jnp.asarray(garbage_pad(np.array(v, np.float32), (5,))),
                          (jnp.int32(3),)))
        assert float(out.data) == want
    formula = pm.shape_formula(lambda x: jnp.zeros(x.shape[0] - pm.nonzero(x)[0].shape[0]),
                               "n", (10,))
    assert formula.bound == (10,)


def test_polymask_jit_runner():
    f = pm.jit(lambda x: pm.boolean_mask(x, x > 0) * 2)
    for n in (3, 6):
        x = np.arange(n, dtype=np.float32) - 2
        np.testing.assert_array_equal(np.asarray(f(x)), x[x > 0] * 2)


def test_count_of_a_size_that_can_be_zero():
    """nonzero(x[m:]) with m = 0: the count's bound is the full padded size."""
    f = pm.mask(lambda x, y: pm.nonzero(x[y.shape[0]:])[0], ("n", "m"))
    out = f(pm.Masked(jnp.ones(5), (jnp.int32(5),)), pm.Masked(jnp.ones(2), (jnp.int32(0),)))
    np.testing.assert_array_equal(out.unpad(), np.arange(5))
    out = f(pm.Masked(jnp.array([1.0, 0, 1, 1, 9]), (jnp.int32(4),)),
            pm.Masked(jnp.ones(2), (jnp.int32(2),)))
    np.testing.assert_array_equal(out.unpad(), [0, 1])


def test_grad_through_unique_values_gets_a_symbolic_zero_tangent():
    """unique's values have no derivative: its JVP returns symbolic zeros (the
    JVP once used ``Zero.from_primal_value``, which jax 0.10 no longer has)."""
    def f(x):
        return jnp.sum(pm.unique(x) * 0.0) + jnp.sum(x)

    g = pm.mask(jax.grad(f), "n")(pm.Masked(jnp.array([1.0, 2.0, 2.0, 0.0]), (3,)))
    np.testing.assert_array_equal(np.asarray(g.data)[:3], [1.0, 1.0, 1.0])


# ----------------------------------------------------------------------------
# jnp.trim_zeros (JAX's needs concrete values; inside mask: a data-dependent size)
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("trim", ["fb", "f", "b"])
def test_jnp_trim_zeros_on_a_dynamic_length(trim):
    base = np.array([0.0, 0, 3, 0, 4, 0, 0, 0], np.float32)
    exs = [(base,), (base[:5],), (base[:3],), (base[:2],), (base[:1],), (base[:0],),
           (np.array([2.0, 0, 1], np.float32),)]
    f = lambda x: jnp.trim_zeros(x, trim) * 2.0
    oracle(f, exs, [(8,)], in_specs=["n"], eager=True, n_grad=3)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_jnp_trim_zeros_2d_per_axis_and_all_axes():
    m = np.zeros((5, 4), np.float32)
    m[1, 2], m[3, 1] = 1.0, 2.0
    exs = [(m,), (m[:2],), (m[:1],), (m[:0],), (m[:4, :2],)]
    for axis in (None, 0, 1):
        f = lambda x, axis=axis: jnp.trim_zeros(x, axis=axis) + 1.0
        oracle(f, exs, [(6, 4)], in_specs=["n, m"], n_grad=2)


def test_jnp_trim_zeros_passed_itself_or_imported():
    import functools

    from jax.numpy import trim_zeros  # bound before any trace: JAX's own function

    x = np.array([0, 0, 1, 2, 0, 3, 0], np.float32)
    np.testing.assert_array_equal(pm.jit(jnp.trim_zeros, "n")(x), [1, 2, 0, 3])
    f = pm.mask(functools.partial(jnp.trim_zeros, trim="f"), "n")
    np.testing.assert_array_equal(f(dyn(x, 5, 8)).unpad(), [1, 2, 0])
    outs = pm.ragged_map(jnp.trim_zeros, ("n",))([x, x[:3], x[:2]])
    for got, want in zip(outs, ([1, 2, 0, 3], [1], [])):
        np.testing.assert_array_equal(got, np.asarray(want, np.float32))
    with pytest.raises(pm.ShapeError, match="looked up on jax.numpy when called"):
        pm.jit(lambda x: trim_zeros(x), "n")(x)


# A data-dependent size is created mid-trace, where JAX assumes every size >= 1:
# jnp.max / argmax / x[0] of a selection trace their nonempty path. At a count
# of 0 plain JAX raises there, and so must the program; empty-array fast paths
# of jnp (jnp.take: indices.size == 0) give the general path's result. A
# user's own branch on such a size cannot be followed at 0 by the one program:
# an error there, never the other branch's value.
_RAISES, _VALUE, _POLYMASK_RAISES = "raises", "value", "polymask raises"
_AS_PLAIN = "as plain JAX"  # its value or its error, as this JAX version has it
_SELECTIONS = {
    "max": (lambda s: s.max(), _RAISES),
    "min": (lambda s: jnp.min(s), _RAISES),
    "argmax": (lambda s: jnp.argmax(s), _RAISES),
    "first": (lambda s: s[0], _RAISES),
    # the count's emptiness decides it: both cases traced, the count chooses
    "user_branch": (lambda s: -1.0 if s.shape[0] == 0 else s.sum(), _VALUE),
    "len_at_least_one": (lambda s: s.sum() / max(s.shape[0], 1), _VALUE),
    "sum": (lambda s: s.sum(), _VALUE),
    "mean": (lambda s: jnp.mean(s), _VALUE),
    "sort": (lambda s: jnp.sort(s), _VALUE),
    "take": (lambda s: jnp.take(s, jnp.arange(s.shape[0]) // 2), _VALUE),
    # a read of one entry of an empty selection: plain JAX's IndexError / TypeError
    "take_one": (lambda s: jnp.take(s, 0), _RAISES),
    "index_array": (lambda s: s[jnp.array([0])], _RAISES),
    "dynamic_index": (lambda s: jax.lax.dynamic_index_in_dim(s, 0, keepdims=False), _RAISES),
    "percentile": (lambda s: jnp.percentile(s, 50.0), _RAISES),
    "searchsorted": (lambda s: jnp.searchsorted(s, 25.0), _VALUE),
    # a gather from the count's axis splits on its emptiness: jnp's own path
    # for no entries, traced at a count of 0 (NaN on jax 0.12, IndexError on 0.10)
    "nanmedian": (lambda s: jnp.nanmedian(s), _AS_PLAIN),
    "nanpercentile": (lambda s: jnp.nanpercentile(s, 30.0), _AS_PLAIN),
    # lax's own checks (k <= size, a non-empty axis) and Python's division by
    # the count (found from outside)
    "lax_top_k": (lambda s: jax.lax.top_k(s, 1)[0], _RAISES),
    "lax_argmax": (lambda s: jax.lax.argmax(s, 0, jnp.int32), _RAISES),
    "one_over_count": (lambda s: s.sum() + 1.0 / s.shape[0], _RAISES),
    # lax's shape rules build their message before the raise (found from outside)
    "lax_slice": (lambda s: jax.lax.slice(s, (0,), (1,)), _RAISES),
    "update_slice": (lambda s: jax.lax.dynamic_update_slice(s, jnp.array([7.0]), (0,)),
                     _RAISES),
    "index_in_dim": (lambda s: jax.lax.index_in_dim(s, 0, keepdims=False), _RAISES),
    "pad_edge": (lambda s: jnp.pad(s, (1, 2), mode="edge"), _RAISES),
    # jnp.cov's own result for no samples (NaN): its path, traced at a count of 0
    "cov": (lambda s: jnp.cov(s), _VALUE),
    # a slice past the start: lax checks the size it derives (``_u1 - 1``) is
    # non-negative, which it is not at 0 only symbolically (sizes clamp at 0)
    "drop_first": (lambda s: s[1:] * 2.0, _VALUE),
    "diff": (lambda s: jnp.diff(s), _VALUE),
}


@pytest.mark.parametrize("name", sorted(_SELECTIONS))
def test_an_empty_selection_raises_where_plain_jax_does(name):
    op, at_zero = _SELECTIONS[name]

    def f(x):
        return op(pm.boolean_mask(x, x > 10))

    m = pm.mask(f, "n")
    jm = jax.jit(m)
    x = np.array([3.0, 20, 50, 0, 30, np.nan], np.float32)  # NaN in the padding
    if at_zero == _AS_PLAIN:  # (this JAX's own answer at 0: a value or an error)
        try:
            op(jnp.zeros((0,), jnp.float32))
            at_zero = _VALUE
        except (ValueError, IndexError, TypeError):
            at_zero = _RAISES
    for n in (5, 4, 2, 1, 0):  # the selection is empty at n = 1 and n = 0
        sub = jnp.asarray(x[:n])
        # (at n = 0 the count is the constant 0: plain JAX's own path, value or error)
        if (n == 1 and at_zero != _VALUE) or (n == 0 and at_zero == _RAISES):
            if at_zero == _RAISES:
                with pytest.raises((ValueError, IndexError, TypeError, ZeroDivisionError)):
                    op(sub[sub > 10])
            said = ("fails here in plain JAX|the size of this result is 0|logical size 0|"
                    "longer than its operand|as it does on the exact arrays")
            with pytest.raises(pm.ShapeError, match=said):
                m(pm.Masked(x, (n,)))
            with pytest.raises(Exception, match=said):
                jax.block_until_ready(jm(pm.Masked(x, (jnp.int32(n),))))
            continue
        want = op(sub[sub > 10])
        for got in (m(pm.Masked(x, (n,))), jm(pm.Masked(x, (jnp.int32(n),)))):
            np.testing.assert_allclose(got.unpad(), want, rtol=1e-6)  # (NaN: equal too)


@pytest.mark.parametrize("name", ["max", "first", "one_over_n", "branch_at_0", "argmin"])
def test_a_selection_of_an_input_keeps_its_size_0_checks(name):
    """A selection of ``x`` added the constraint ``count <= n``, which with JAX's
    assumption ``count >= 1`` told the trace ``n >= 1``: at ``n = 0``,
    ``x.max()``, ``x[0]``, ``argmin`` and ``1 / n`` returned values where
    plain JAX raises, and ``x.shape[0] == 0`` took the other branch. The
    trace now splits on ``n >= 1`` at the selection; at ``n = 0`` the count
    is the constant 0, as in plain JAX (found from outside)."""
    ops = {"max": lambda x: x.max(), "first": lambda x: x[0],
           "one_over_n": lambda x: 1.0 / x.shape[0], "argmin": lambda x: jnp.argmin(x),
           "branch_at_0": lambda x: jnp.float32(-5.0) if x.shape[0] == 0 else x[0]}
    op = ops[name]

    def f(x):
        return pm.boolean_mask(x, x > 0).sum(), op(x)

    m = pm.mask(f, "n")
    x = np.array([2.0, -1.0, 3.0, np.nan], np.float32)
    for n in (0, 1, 3):
        try:
            want = f(jnp.asarray(x[:n]))
        except (ValueError, IndexError, ZeroDivisionError):
            assert n == 0 and name != "branch_at_0"
            with pytest.raises(pm.ShapeError):
                m(pm.Masked(x, (n,)))
            with pytest.raises(Exception, match="as it does on the exact arrays"):
                jax.block_until_ready(jax.jit(m)(pm.Masked(x, (jnp.int32(n),))))
            continue
        for got in (m(pm.Masked(x, (n,))), jax.jit(m)(pm.Masked(x, (jnp.int32(n),)))):
            for g, w in zip(got, want):
                np.testing.assert_allclose(g.unpad(), w, rtol=1e-6)
    if name == "branch_at_0":  # a ragged batch, n = 0 beside n = 3
        batch = pm.Masked(jnp.asarray(np.stack([x, x])), (jnp.array([0, 3], jnp.int32),))
        total, value = jax.vmap(m)(batch)
        np.testing.assert_allclose(np.asarray(value.data), [-5.0, 2.0])
        np.testing.assert_allclose(np.asarray(total.data), [0.0, 5.0])


def _count_guard(s):
    if s.shape[0] > 3:
        raise ValueError("too many entries")
    return s * 2.0


def _count_pinned(s):
    if s.shape[0] >= 2:
        raise ValueError("one entry at most")
    return s + jnp.ones(3)  # broadcasts one entry; plain JAX raises for none


def _is_masked(v) -> bool:
    return isinstance(v, pm.Masked)


# (function of a selection, the counts where plain JAX raises, counts polymask
# refuses where plain JAX gives a value: a count of 0 traced as 1, where n >= 1;
# at n = 0 the count is the constant 0, and the trace plain JAX's)
_COUNT_CHECKED = {
    "top_k_2": (lambda s: jax.lax.top_k(s, 2), {0, 1}, set()),
    "top_k_3_values": (lambda s: jax.lax.top_k(s, 3)[0] * 2.0, {0, 1, 2}, set()),
    "split_even": (lambda s: jnp.split(s, 2)[1], {1, 3, 5, 7}, set()),
    "user_guard": (_count_guard, {4, 5, 6, 7}, set()),
    "pinned_to_one": (_count_pinned, {0, 2, 3, 4, 5, 6, 7}, set()),
    # two shapes JAX proves equal only for counts >= 2: split there, both
    # sides run (a count of 0 too: its own case)
    "diff_twice": (lambda s: jnp.diff(s, n=2) * 3.0, set(), set()),
}


@pytest.mark.parametrize("name", sorted(_COUNT_CHECKED))
def test_a_comparison_of_a_count_whose_other_outcome_fails_runs_checked(name):
    """A comparison of a data-dependent size that JAX cannot decide
    (``lax.top_k(sel, 2)``'s ``k <= sel.shape[0]``) stopped the trace for
    every count. Each outcome is now traced; where one fails in plain JAX, the
    other runs, and the count is checked while the program runs: plain JAX's
    values at the other counts, a ShapeError naming plain JAX's error at
    these, eagerly, under jit and under vmap."""
    op, raises, refused = _COUNT_CHECKED[name]

    def f(x):
        return op(pm.boolean_mask(x, x > 10))

    m = pm.mask(f, "n")
    jm = jax.jit(m)
    x = np.array([3.0, 20, 50, 40, 0, 30, 70, 60, 90, np.nan], np.float32)  # NaN: padding
    seen = set()
    for n in range(10):  # counts 0, 0, 1, 2, 3, 3, 4, 5, 6, 7
        sub = jnp.asarray(x[:n])
        count = int(np.sum(x[:n] > 10))
        seen.add(count)
        if count in raises:
            with pytest.raises((ValueError, TypeError)):  # (shapes that do not broadcast)
                op(sub[sub > 10])
        if count in raises or (count in refused and n > 0):
            with pytest.raises(pm.ShapeError) as e:
                m(pm.Masked(x, (n,)))
            if count in raises and count > 0:
                assert "fails here in plain JAX" in str(e.value)
            said = ("plain JAX|size of this result is 0|as it does on the exact arrays|"
                    "polymask cannot trace")
            with pytest.raises(Exception, match=said):
                jax.block_until_ready(jm(pm.Masked(x, (jnp.int32(n),))))
            continue
        want = op(sub[sub > 10])
        for got in (m(pm.Masked(x, (n,))), jm(pm.Masked(x, (jnp.int32(n),)))):
            for g, w in zip(jax.tree_util.tree_leaves(got, is_leaf=_is_masked),
                            jax.tree_util.tree_leaves(want)):
                np.testing.assert_allclose(g.unpad(), w, rtol=1e-6)
    assert seen == set(range(8))
    ok = [n for n in range(10) if int(np.sum(x[:n] > 10)) not in raises | refused]
    batch = pm.Masked(jnp.asarray(np.stack([x] * len(ok))), (jnp.asarray(ok, jnp.int32),))
    got = jax.vmap(m)(batch)
    for i, n in enumerate(ok):
        sub = jnp.asarray(x[:n])
        for g, w in zip(jax.tree_util.tree_leaves(got, is_leaf=_is_masked),
                        jax.tree_util.tree_leaves(op(sub[sub > 10]))):
            row = pm.Masked(g.data[i], tuple(int(d[i]) if np.ndim(d) else int(d)
                                             for d in g.shape))
            np.testing.assert_allclose(row.unpad(), w, rtol=1e-6)


def _branch_eq(s):
    if s.shape[0] == 2:
        return jnp.sqrt(s).sum() * 100.0
    return jnp.sqrt(s).sum()


def _branch_gt(s):
    return jnp.sqrt(s[:3]).sum() * 2.0 if s.shape[0] > 2 else -jnp.sqrt(s).sum()


def _branch_shapes(s):
    # the sides' outputs have different sizes: padded to the larger bound
    return s[:2] * 3.0 if s.shape[0] >= 2 else jnp.concatenate([s, s, s])


@pytest.mark.parametrize("body", [_branch_eq, _branch_gt, _branch_shapes],
                         ids=["eq", "gt", "shapes"])
def test_a_branch_on_a_count_runs_the_side_the_count_chooses(body):
    """``if sel.shape[0] == 2:`` with both paths plain JAX's: JAX answers
    ``==`` of a data-dependent size False (a wrong value at a count of 2),
    then polymask refused the branch at every count. Both sides are traced;
    the count, computed first, chooses one while the program runs: plain
    JAX's values and gradients at every count, eagerly, under jit, vmap,
    grad, polymask.jit and ragged_map, with NaN in the padding."""

    def f(x):
        return body(pm.boolean_mask(x, x > 10))

    def plain(x):
        return body(x[x > 10])

    m = pm.mask(f, "n")
    x = np.array([3.0, 20, 50, 40, 0, 30, 70, 60, 90, np.nan], np.float32)  # NaN: padding
    B = 9
    ns = range(B + 1)  # counts 0, 0, 1, 2, 3, 3, 4, 5, 6, 7
    wants = [np.asarray(plain(jnp.asarray(x[:n]))) for n in ns]
    jm = jax.jit(m)
    for n, want in zip(ns, wants):
        arg = pm.Masked(jnp.asarray(x), (n,))
        np.testing.assert_allclose(m(arg).unpad(), want, rtol=1e-6)
        np.testing.assert_allclose(jm(arg).unpad(), want, rtol=1e-6)
    got = jax.vmap(lambda n: m(pm.Masked(jnp.asarray(x), (n,))))(jnp.arange(B + 1))
    for i, want in enumerate(wants):
        row = pm.Masked(got.data[i], tuple(int(d[i]) for d in got.shape))
        np.testing.assert_allclose(row.unpad(), want, rtol=1e-6)

    def loss(d, n):
        return jnp.sum(m(pm.Masked(d, (n,))).data)

    grads = jax.vmap(jax.grad(loss), (None, 0))(jnp.asarray(x), jnp.arange(B + 1))
    for n in ns:
        want = np.asarray(jax.grad(lambda v: jnp.sum(plain(v)))(jnp.asarray(x[:n])))
        for g in (grads[n], jax.jit(jax.grad(loss))(jnp.asarray(x), n)):
            np.testing.assert_allclose(g[:n], want, rtol=1e-6)
            assert np.all(np.asarray(g[n:]) == 0)
    pj = pm.jit(f)
    for n, want in zip(ns, wants):
        np.testing.assert_allclose(pj(x[:n]), want, rtol=1e-6)
    assert pj.stats()["exact_compiles"] == 0
    for got, want in zip(pm.ragged_map(f)([x[:n] for n in ns]), wants):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_branch_on_a_count_keeps_an_error_of_one_side_to_its_counts():
    """One side of a branch on a count fails in plain JAX at some sizes
    (``jnp.zeros(n - 5)`` where the count is above 2 and n below 5): those
    calls raise a ShapeError of plain JAX's TypeError, under jit and
    polymask.jit too (checked in the program: the host cannot know the
    count); the other sizes and counts run."""

    def f(x):
        s = pm.boolean_mask(x, x > 10)
        return jnp.zeros(x.shape[0] - 5) + s.sum() if s.shape[0] > 2 else s[:1] * 2.0

    def plain(x):
        s = x[x > 10]
        return jnp.zeros(x.shape[0] - 5) + s.sum() if s.shape[0] > 2 else s[:1] * 2.0

    m = pm.mask(f, "n")
    pj = pm.jit(f)
    for data in ([20.0, 50, 40, 30, 70, 60, 80, np.nan], [20.0, 5, 4, 3, 7, 6, 8, np.nan]):
        x = np.array(data, np.float32)
        for n in range(8):
            arg = pm.Masked(jnp.asarray(x), (n,))
            try:
                want = plain(jnp.asarray(x[:n]))
            except TypeError:
                for run in (m, jax.jit(m)):
                    with pytest.raises((pm.ShapeError, jax.errors.JaxRuntimeError),
                                       match="nonnegative"):
                        jax.block_until_ready(run(arg))
                with pytest.raises(pm.ShapeError, match="nonnegative"):
                    pj(x[:n])
                continue
            np.testing.assert_allclose(m(arg).unpad(), want)
            np.testing.assert_allclose(jax.jit(m)(arg).unpad(), want)
            np.testing.assert_allclose(pj(x[:n]), want)
    text = pm.explain(f, "n", jnp.zeros(8), print_output=False)
    assert "_u1 <= 2" in text and "a data-dependent size computed first" in text


def test_a_use_that_needs_a_selections_count_says_so():
    """jnp.split's ``rest is mod(_u1, 2)`` was said to fail "for every logical
    size, as it does on the exact arrays", and jnp.pad(mode="reflect")
    suggested a constraint on the internal ``_u`` name, which specs cannot
    name. Both compare the count: the split of an even count runs and the
    other raises plain JAX's error; the pad runs at every count (one entry
    too: a gather since session 60, where one entry was polymask's limit)."""
    x = jnp.array([1.0, 2.0, 3.0, 4.0, 0.0, 0.0])
    split = pm.mask(lambda x: jnp.split(pm.boolean_mask(x, x != 0), 2)[0], "n")
    np.testing.assert_array_equal(split(pm.Masked(x, (4,))).unpad(), [1.0, 2.0])
    with pytest.raises(pm.ShapeError, match="fails here in plain JAX: ValueError: array split"):
        split(pm.Masked(x, (3,)))
    op = lambda s: jnp.pad(s, 1, mode="reflect")  # noqa: E731
    pad = pm.mask(lambda x: op(pm.boolean_mask(x, x != 0)), "n")
    for n in (1, 2, 3, 4):
        np.testing.assert_array_equal(pad(pm.Masked(x, (n,))).unpad(), op(x[:n]))


def test_convolve_of_an_empty_selection_raises_where_plain_jax_does():
    """jnp.convolve's "inputs cannot be empty" is checked in polymask's rewrite
    of it, which counted as polymask's own code: a selection of 0 returned a
    value. (Past one element, convolve compares the selection's size with the
    kernel's, which the trace cannot decide: docs/data_dependent.md.)"""
    f = lambda x: jnp.convolve(pm.boolean_mask(x, x > 10), jnp.array([1.0, 2.0]))  # noqa: E731
    m = pm.mask(f, "n")
    with pytest.raises(ValueError, match="cannot be empty"):
        f(jnp.array([3.0]))
    for data in ([3.0], [30.0]):
        x = np.array(data, np.float32)
        if data[0] > 10:
            np.testing.assert_allclose(m(pm.Masked(x, (1,))).unpad(), f(jnp.asarray(x)))
            continue
        with pytest.raises(pm.ShapeError, match="fails here in plain JAX: ValueError: convolve"):
            m(pm.Masked(x, (1,)))


@pytest.mark.parametrize("start, size", [(-2, 2), (-7, 2), (1, 3), (0, 3), (-1, 1), (2, 9)])
def test_dynamic_slice_wraps_a_negative_start_and_clamps_a_size_as_lax(start, size):
    # on the exact arrays lax.dynamic_slice counts a negative start from the
    # end and the size is clamped to the axis; the masked rule does the same
    rng = np.random.default_rng(4)
    check_oracle(lambda v: jnp.cumsum(pm.dynamic_slice(v, start, size)) * 2.0,
                 [(rng.normal(size=n).astype(np.float32),) for n in (0, 1, 3, 5, 8)],
                 [(8,)], ("n",))


def test_messages_of_selections_traced_one_size_at_a_time():
    """Found from outside: at sizes traced one by one, ``x[m]`` of a traced mask
    was said to fail "as it does on the exact arrays" (eager JAX runs it), and
    two selections' counts stacked raised TooManyCases, whose remedy (a larger
    max_cases) cannot help; a count comparison whose other way fails on a
    traced value (``jnp.array_split``) was said to fail "in plain JAX"."""
    x = pm.pad(np.array([1.0, -2.0, 3.0, 2.0], np.float32), 6)
    with pytest.raises(pm.ShapeError, match="x.m. has a data-dependent size") as e:
        pm.mask(lambda x: x[jnp.isin(x, jnp.array([1.0, 2.0]))], "n")(x)
    assert "polymask.boolean_mask(x, m)" in str(e.value)
    assert "as it does on the exact arrays" not in str(e.value)  # (eager JAX runs it)
    sel = lambda x: pm.boolean_mask(x, x > 0)  # noqa: E731
    with pytest.raises(pm.ShapeError, match="with data-dependent sizes") as e:
        pm.mask(lambda x: jnp.stack([sel(x), sel(x)]), "n")(x)
    assert not isinstance(e.value, pm.TooManyCases) and "max_cases" not in str(e.value)
    assert "Compute the result once and reuse it" in str(e.value)
    with pytest.raises(pm.ShapeError, match="polymask cannot trace the function for these"):
        pm.mask(lambda x: jnp.array_split(sel(x), 2)[0], "n")(x)


def test_a_run_time_count_check_names_the_call_and_plain_jaxs_exception_type():
    """Found from outside: a count check failing while the program ran named
    the line that defines the function (or the first call, whose compiled
    program is reused) as the masked call, and raised a ShapeError that
    ``except ValueError`` (top_k's own) missed."""

    def top2(x):
        return jax.lax.top_k(pm.boolean_mask(x, x > 0), 2)[0]

    x = np.array([5.0, -1.0, -2.0, -3.0], np.float32)
    m = pm.mask(top2)
    for _ in range(2):  # (the second call reuses the first one's program)
        with pytest.raises(ValueError, match="k argument to top_k") as e:
            call_line = sys._getframe().f_lineno + 1
            m(pm.Masked(jnp.asarray(x), (4,)))
        assert isinstance(e.value, pm.ShapeError)
        assert f"in the masked call at {__file__}:{call_line}" in str(e.value)
    jitted = pm.jit(top2, "n")
    np.testing.assert_array_equal(jitted(np.array([5.0, 6.0], np.float32)), [6.0, 5.0])
    with pytest.raises(pm.ShapeError) as e:
        call_line = sys._getframe().f_lineno + 1
        jitted(x)
    assert f"in the masked call at {__file__}:{call_line}" in str(e.value)


@pytest.mark.parametrize("op, at_zero", [
    (lambda s: jnp.arange(s.shape[0]) * s, _VALUE),
    (lambda s: s + jnp.ones(3), _RAISES),  # (shapes (0,) and (3,) do not broadcast)
    (lambda s: s.sum() * 2.0, _VALUE),
    # plain JAX broadcasts (0,) with (2, 1); the decision "is it 1?" stops it here
    (lambda s: s * jnp.ones((2, 1)), _POLYMASK_RAISES),
], ids=["arange_times", "broadcast", "sum", "outer_broadcast"])
def test_a_selection_of_one_element_at_most_is_not_one_at_a_count_of_0(op, at_zero):
    """A selection from one element: JAX, which takes every size to be >= 1,
    makes its count the constant 1, and its own broadcasting decided on
    that (``s + ones(3)`` broadcast at a count of 0, where plain JAX raises;
    found from outside). A decision on such a count that differs at 0 makes
    the count of 0 a ShapeError, never a value; a sum of no entries keeps
    plain JAX's value."""
    f = lambda x: op(pm.boolean_mask(x, x > 0))  # noqa: E731
    m = pm.mask(f, "n")
    for value in (2.0, -1.0):
        x = np.array([value], np.float32)
        if value < 0 and at_zero != _VALUE:
            if at_zero == _RAISES:
                with pytest.raises(TypeError):
                    op(jnp.asarray(x[x > 0]))
            with pytest.raises(pm.ShapeError):
                m(pm.Masked(x, (1,)))
            continue
        want = op(jnp.asarray(x[x > 0]))
        got = m(pm.Masked(x, (1,))).unpad()
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want)


def test_a_comparison_of_two_counts_keeps_every_entry_of_each():
    """``a.shape[0] + b.shape[0] > 4``: the case of ``<= 4`` was traced on
    JAX's assumption that ``b`` is not empty, which bounds ``a``'s count by 3:
    four entries of ``a`` beside an empty ``b`` lost one (-6 for -10, eagerly
    and under jit; found from outside). The trace now splits on each count's
    emptiness first."""
    def body(a, b):
        return a.sum() if a.shape[0] + b.shape[0] > 4 else b.sum() - a.sum()

    def f(x, select):
        return body(select(x, x > 0.5), select(x, x < -1.0))

    m = pm.mask(lambda x: f(x, pm.boolean_mask), "n")
    for data in ([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, -2.0, 3.0, 4.0, 5.0], [-3.0, -2.0, 0.0, 4.0, 5.0]):
        x = jnp.asarray(data)
        for n in range(6):
            want = f(x[:n], lambda v, m: v[m])
            arg = pm.Masked(x, (n,))
            np.testing.assert_allclose(m(arg).data, want)
            np.testing.assert_allclose(jax.jit(m)(pm.Masked(x, (jnp.int32(n),))).data, want)


def test_a_branch_on_the_length_of_an_arange_counts_past_its_case_bound():
    """``pm.arange(c, max_size=8)`` then ``if a.shape[0] > 2``: the length was
    cut to the bound of the case ``<= 2`` while the count chose the case, and
    raised "larger than max_size=2" (found from outside)."""
    def body(a):
        return a.sum() if a.shape[0] > 2 else -a.shape[0]

    m = pm.mask(lambda x: body(pm.arange(jnp.sum(x > 0.5), max_size=8)), "n")
    x = jnp.array([1.0, 2.0, 3.0, -1.0, 5.0])
    for n in range(6):
        want = body(jnp.arange(int(jnp.sum(x[:n] > 0.5))))
        assert int(m(pm.Masked(x, (n,))).data) == int(want)
        assert int(jax.jit(m)(pm.Masked(x, (jnp.int32(n),))).data) == int(want)
    with pytest.raises(pm.ShapeError, match="max_size=8"):
        pm.mask(lambda x: pm.arange(jnp.sum(x > 0.5) * 9, max_size=8).sum(), "n")(
            pm.Masked(x, (5,)))


def test_a_lookup_by_a_count_is_refused_not_missed():
    """``{0: s.sum(), 3: s.prod()}.get(s.shape[0], 1.5)``: the symbolic count
    hashed as itself and always missed (the default at every count, found
    from outside): now a ShapeError that says the count is needed as a value.
    Sides of a branch on a count with different dtypes name the counts that
    choose each and say how to make them agree."""
    body = lambda s: {0: s.sum(), 3: s.prod()}.get(s.shape[0], jnp.float32(1.5))  # noqa: E731
    x = jnp.array([2.0, 3.0, 4.0, -1.0])
    assert float(body(x[x > 0.5])) == 24.0
    with pytest.raises(pm.ShapeError, match="data-dependent size") as e:
        pm.mask(lambda x: body(pm.boolean_mask(x, x > 0.5)), "n")(pm.Masked(x, (4,)))
    assert "as it does on the exact arrays" not in str(e.value)
    assert "(n >= 1)" in str(e.value)  # every size but 0, not the size called (n == 4)
    sides = lambda s: s.sum() if s.shape[0] > 2 else s.shape[0]  # noqa: E731
    with pytest.raises(pm.ShapeError, match="same structure, dtype and rank") as e:
        pm.mask(lambda x: sides(pm.boolean_mask(x, x > 0.5)), "n")(pm.Masked(x, (4,)))
    assert "_u1 <= 2" in str(e.value) or "_u1 >= 3" in str(e.value)
    # polymask.jit leads with that, not with its per-shape fallback's failure
    # (plain jax.jit cannot run polymask.boolean_mask at all)
    with pytest.raises(pm.ShapeError, match="its masked trace stopped") as e:
        pm.jit(lambda x: sides(pm.boolean_mask(x, x > 0.5)))(np.asarray(x))
    assert str(e.value).index("same structure") < str(e.value).index("needs concrete inputs")


def test_a_count_read_as_a_value_where_jax_needs_a_constant_is_a_shape_error():
    """``jnp.choose(jnp.asarray(s.shape[0] % 2), ...)`` (mode 'raise' needs a
    concrete index) of a selection's count escaped as JAX's raw
    ConcretizationTypeError (helper B); it is a ShapeError saying a
    data-dependent size's value was needed, with no max_cases remedy."""
    def f(x):
        s = pm.boolean_mask(x, x > 0)
        return jnp.choose(jnp.asarray(s.shape[0] % 2), [s.sum(), s.prod()])

    with pytest.raises(pm.ShapeError) as info:
        pm.mask(f)(jnp.array([1.0, -2.0, 3.0, 4.0]))
    assert "JAX needs the value of a data-dependent size" in str(info.value)
    assert not isinstance(info.value, pm.TooManyCases) and "max_cases" not in str(info.value)
