"""Slicing rules: slice, rev, pad, concatenate, split, stack, tile (issue 3, items 1-2).

ACCEPTANCE.md cases 5 (concatenate) and 8 (strided and reversed slices), with
their case-15 gradient parts, one trace under jit and vmap ragged batches.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import oracle
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import polymask as pm
from polymask.testing import check_oracle, garbage_pad

X7 = np.arange(1, 8, dtype=np.float32)
RNG = np.random.default_rng(0)
X = RNG.normal(size=(5, 6)).astype(np.float32)
SEQ = [(X7,), (X7[:4],), (X7[:1],), (X7[:0],)]
MAT = [(X,), (X[:3, :2],), (X[:1, :4],), (X[:0, :3],)]




def masked(x, bound, n=None):
    n = len(x) if n is None else n
    return pm.Masked(jnp.asarray(garbage_pad(np.asarray(x, np.float32), bound)), (jnp.int32(n),))


# ----------------------------------------------------------------------------
# ACCEPTANCE case 5: concatenate
# ----------------------------------------------------------------------------
def test_case5_concatenate():
    f = pm.mask(lambda x, y, z: jnp.concatenate([x, y, z]), ("n", "m", "n"))
    x, y, z = jnp.array([1.0, 9]), jnp.array([2.0, 4, 9]), jnp.array([3.0, 9])
    out = f(pm.Masked(x, (1,)), pm.Masked(y, (2,)), pm.Masked(z, (1,)))
    np.testing.assert_array_equal(out.unpad(), [1, 2, 4, 3])
    assert int(out.shape[0]) == 4
    traces = []

    def g(n, m):
        traces.append(1)
        return f(pm.Masked(x, (n,)), pm.Masked(y, (m,)), pm.Masked(z, (n,)))

    jg = jax.jit(g)
    got = [jg(jnp.int32(n), jnp.int32(m)) for n, m in ((1, 2), (2, 3), (0, 1), (0, 0))]
    assert len(traces) == 1
    np.testing.assert_array_equal(got[0].unpad(), [1, 2, 4, 3])
    np.testing.assert_array_equal(got[1].unpad(), [1, 9, 2, 4, 9, 3, 9])
    np.testing.assert_array_equal(got[2].unpad(), [2])
    assert int(got[3].shape[0]) == 0
    # oracle: eager/jit/vmap/grad with NaN padding (case 15), sizes 0 included
    exs = [(np.array([1.0]), np.array([2.0, 4]), np.array([3.0])),
           (np.array([1.0, 5]), np.array([2.0, 4, 6]), np.array([3.0, 7])),
           (np.zeros(0), np.array([2.0]), np.zeros(0)),
           (np.zeros(0), np.zeros(0), np.zeros(0))]
    exs = [tuple(a.astype(np.float32) for a in ex) for ex in exs]
    check_oracle(lambda x, y, z: jnp.concatenate([x, y, z]), exs, [(2,), (3,), (2,)],
                 ("n", "m", "n"))


def test_chained_slices_of_concatenations_share_one_program():
    # Each step's size nests the last one's in a min / max: three steps are
    # ~20 nested mins, decided by their values, not JAX's procedure
    def f(x, y):
        v = jnp.outer(x.reshape(-1), y).reshape(-1)
        for _ in range(3):
            v = jnp.concatenate([v[1:], jnp.arange(x.shape[0]) * 1.0])[2:]
        return v * 2.0

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 7)).astype(np.float32), rng.normal(size=5).astype(np.float32)
    exs = [(x[:a, :b], y[:c]) for a, b, c in ((6, 7, 5), (1, 1, 1), (3, 2, 4), (2, 3, 0))]
    check_oracle(f, exs, [(6, 7), (5,)], in_specs=("n, m", "k"))


def _one_trace_matches_plain(f, specs, bounds, sizes):
    """``jax.jit(mask(f))`` traced once (sizes traced) against plain ``jax.jit``
    on the exact arrays at each size tuple."""
    traces = []
    mf = pm.mask(f, specs)

    @jax.jit
    def run(datas, ns):
        traces.append(1)
        return mf(*[pm.Masked(d, (n,)) for d, n in zip(datas, ns)])

    rng = np.random.default_rng(1)
    full = [rng.normal(size=b).astype(np.float32) for b in bounds]
    for ns in sizes:
        exact = [a[:n] for a, n in zip(full, ns)]
        datas = [jnp.asarray(garbage_pad(e, b)) for e, b in zip(exact, bounds)]
        try:
            (want,) = jax.jit(f)(*exact)
        except ValueError:  # (convolve of an empty array) a ShapeError as it runs
            with pytest.raises(Exception, match="(ShapeError|TooManyCases): (?s:.*)"
                                                "convolve: inputs cannot be empty"):
                jax.block_until_ready(run(datas, [jnp.int32(n) for n in ns]))
            continue
        (got,) = run(datas, [jnp.int32(n) for n in ns])
        np.testing.assert_allclose(got.unpad(), want, rtol=1e-5, atol=1e-5, err_msg=str(ns))
    assert len(traces) == 1


def _outer_halves_mod(x, y):
    t1 = jnp.outer(y, x).reshape(-1)[: y.shape[0] + x.shape[0] + 2]
    t3 = jnp.arange(t1.shape[0] * x.shape[0] % 5 + t1.shape[0] // 2) * 1.0
    t4 = jnp.arange(t3.shape[0] * t1.shape[0] % 5 + t3.shape[0] // 2) * 1.0
    return (jnp.convolve(t4, jnp.array([1.0, -0.5]), mode="full") * 2.0,)


def test_a_case_no_size_meets_is_left_untraced():
    # Sizes nest a mod of a min of a product: a case's conditions can
    # contradict where JAX's procedure cannot tell (no size meets them). Such a
    # case is an empty leaf, not traced, and comparisons the case's exact values
    # leave open split at once. Asserted: values at each size, one trace.
    _one_trace_matches_plain(_outer_halves_mod, ("n", "m"), [(7,), (6,)],
                             [(4, 3), (0, 0), (1, 1), (7, 6), (2, 5), (6, 1), (3, 0)])


def _min_slice_of_concatenation(x, y, z):
    t4 = jnp.concatenate([y[1:], z])[2:]
    t5 = t4[:min(t4.shape[0], x.shape[0])] * x[:min(t4.shape[0], x.shape[0])]
    return (jnp.convolve(t5, jnp.array([1.0, -0.5]), mode="full") * 2.0,)


def test_sizes_with_mins_under_conditions_with_mins_are_decided_by_their_values():
    # A size with 3 mins under a case's conditions with more mins is decided
    # by its values, not JAX's procedure. The values apply conditions that
    # link other dim vars (a case's n - m - k + min(m + k, 2) <= -1 bounds a
    # size of m and k): without them JAX's procedure decided, or at some hash
    # seeds failed to ("cannot decide ... even for one outcome of it").
    _one_trace_matches_plain(_min_slice_of_concatenation, ("n", "m", "k"),
                             [(5,), (7,), (7,)],
                             [(5, 7, 7), (1, 1, 1), (3, 2, 4), (2, 0, 5), (5, 4, 0), (4, 7, 3)])


@pytest.mark.slow  # ~15 s each on 2 cores: the slow tier
@pytest.mark.parametrize("f, specs, bounds, sizes", [
    (_outer_halves_mod, ("n", "m"), [(7,), (6,)], [(4, 3), (1, 1), (7, 6), (2, 5)]),
    (_min_slice_of_concatenation, ("n", "m", "k"), [(5,), (7,), (7,)],
     [(5, 7, 7), (1, 0, 3), (3, 2, 4), (4, 7, 3)]),
])
def test_programs_with_contradicting_cases_match_the_oracle(f, specs, bounds, sizes):
    rng = np.random.default_rng(2)
    full = [rng.normal(size=b).astype(np.float32) for b in bounds]
    check_oracle(f, [tuple(a[:n] for a, n in zip(full, ns)) for ns in sizes], bounds,
                 in_specs=specs)


def test_concatenate_many_and_2d():
    a = RNG.normal(size=(4, 3)).astype(np.float32)
    exs = [(a, a[:2] * 2, a[:3] + 1, a[:1]), (a[:1], a[:0], a[:4], a[:2]),
           (a[:0], a[:3], a[:0], a[:0])]
    f = lambda *xs: jnp.concatenate(xs, axis=0) * 1.5  # noqa: E731
    oracle(f, exs, [(5, 3)] * 4, ("a, 3", "b, 3", "c, 3", "d, 3"))
    # along a static axis, with the other axis dynamic
    exs2 = [(X, X * 2), (X[:2], X[:2] + 1), (X[:0], X[:0])]
    oracle(lambda x, y: jnp.concatenate([x, y], axis=1), exs2, [(7, 6), (7, 6)],
                 ("n, 6", "n, 6"))
    # along a dynamic axis of a 2-D operand whose other axis is dynamic too
    exs3 = [(X, X[:, :2]), (X[:3, :2], X[:3, :1]), (X[:2, :0], X[:2, :3])]
    oracle(lambda x, y: jnp.concatenate([x, y], axis=1), exs3, [(7, 8), (7, 8)],
                 ("n, m", "n, k"))


def test_stack_and_unstack():
    oracle(lambda x: jnp.stack([x, 2 * x], 1), SEQ, [(12,)])
    oracle(lambda x, y: jnp.stack([x, y]), [(X, X * 2), (X[:2, :1], X[:2, :1])],
                 [(7, 8), (7, 8)], ("n, m", "n, m"))
    oracle(lambda x: list(jnp.stack([x, 2 * x])), SEQ[:2], [(12,)], modes=("eager", "jit"))


# ----------------------------------------------------------------------------
# ACCEPTANCE case 8: strided and reversed slices
# ----------------------------------------------------------------------------
CASE8 = {
    "x[::2]": (lambda x: x[::2], [1, 3, 5, 7]),
    "x[1::2]": (lambda x: x[1::2], [2, 4, 6]),
    "x[::-2]": (lambda x: x[::-2], [7, 5, 3, 1]),
    "x[-3:]": (lambda x: x[-3:], [5, 6, 7]),
    "x[1:]": (lambda x: x[1:], [2, 3, 4, 5, 6, 7]),
    "x[:-1]": (lambda x: x[:-1], [1, 2, 3, 4, 5, 6]),
    "x[::-1]": (lambda x: x[::-1], [7, 6, 5, 4, 3, 2, 1]),
    "x[:0:-1]": (lambda x: x[:0:-1], [7, 6, 5, 4, 3, 2]),
    "x[1::3]": (lambda x: x[1::3], [2, 5]),
}


@pytest.mark.parametrize("name", list(CASE8))
def test_case8_strided_and_reversed_slices(name):
    fn, want = CASE8[name]
    f = pm.mask(fn, "n")
    buf = jnp.asarray(garbage_pad(X7, (12,)))
    out = f(pm.Masked(buf, (7,)))
    np.testing.assert_array_equal(out.unpad(), want)
    traces = []

    def g(n):
        traces.append(1)
        return f(pm.Masked(buf, (n,)))

    jg = jax.jit(g)
    for n in (7, 4, 1, 0, 12):
        got = jg(jnp.int32(n))
        ref = fn(jnp.arange(1, n + 1, dtype=jnp.float32)) if n <= 7 else None
        if ref is not None:
            np.testing.assert_array_equal(got.unpad(), ref)
    assert len(traces) == 1
    exs = SEQ if name not in ("x[1:]", "x[:-1]", "x[:0:-1]") else SEQ[:3]
    # eager, jit (one trace), vmap (ragged batch) and NaN-padding grad (case 15)
    check_oracle(fn, exs, [(12,)], "n")


def test_reverse_2d_and_reverse_cumsum():
    oracle(lambda x: x[::-1, ::-1], MAT, [(7, 8)])
    oracle(lambda x: jnp.cumsum(x[::-1])[::-1], SEQ, [(12,)])
    oracle(lambda x: lax.cumsum(x, reverse=True) - jnp.cumsum(x[::-1])[::-1], SEQ,
                 [(12,)])


def test_multi_axis_slices():
    oracle(lambda x: x[1:, ::-2][:, -2:], [(X,), (X[:3, :3],), (X[:2, :2],)],
                 [(7, 8)], "n, m", constraints=("n >= 2", "m >= 2"))
    oracle(lambda x: x[:, 1::2] + x[:, ::2][:, :x.shape[1] // 2], MAT[:3], [(7, 8)])


def test_static_slice_of_padded_axis():
    # constant bounds on a dynamic axis: x[2:5] needs n >= 5 to be a plain slice
    oracle(lambda x: x[2:5], [(X7,), (X7[:5],)], [(12,)], "n", constraints=("n >= 5",))
    oracle(lambda x: x[:2], [(X7,), (X7[:2],)], [(12,)], "n", constraints=("n >= 2",))


def _ref_slice(x, s):
    return np.asarray(x)[s]


@given(start=st.one_of(st.none(), st.integers(-9, 9)),
       stop=st.one_of(st.none(), st.integers(-9, 9)),
       step=st.one_of(st.none(), st.integers(-4, 4).filter(lambda v: v != 0)),
       data=st.data())
def test_slice_property(start, stop, step, data):
    """Random start/stop/step; logical sizes 0..bound under one jit trace.

    JAX traces with dim vars >= 1, so a slice whose symbolic length does not
    mention ``n`` (``x[:1]`` has length 1) is only compared for ``n >= 1``.
    """
    bound = 9
    s = slice(start, stop, step)

    def fn(x):
        return x[s]

    try:
        f = pm.mask(fn, "n")
        f(masked(np.arange(bound), (bound,)))  # trace once
    except pm.ShapeError:
        return  # inconclusive size comparison for this slice: a documented limitation
    sym = jax.ShapeDtypeStruct(jax.export.symbolic_shape("n"), jnp.float32)
    symbolic = "n" in str(jax.eval_shape(fn, sym).shape)
    traces = []

    def g(buf, n):
        traces.append(1)
        return f(pm.Masked(buf, (n,)))

    jg = jax.jit(g)
    sizes = sorted(set([0, 1, bound] + data.draw(st.lists(st.integers(0, bound), max_size=3))))
    for n in sizes:
        if n == 0 and not symbolic:
            continue
        x = np.arange(1, n + 1, dtype=np.float32)
        buf = jnp.asarray(garbage_pad(x, (bound,)))
        out = jg(buf, jnp.int32(n))
        np.testing.assert_array_equal(out.unpad(), _ref_slice(x, s), err_msg=f"{s} n={n}")
    assert len(traces) == 1


@pytest.mark.parametrize("s", [slice(None, None, -3), slice(-2, None, -1), slice(1, -1, 2),
                               slice(-4, -1), slice(None, -2, -2)])
def test_slice_grad_nan_padding(s):
    oracle(lambda x: x[s] * 2.0, SEQ[:3], [(12,)], "n", constraints=("n >= 1",),
                 modes=("grad",))


# ----------------------------------------------------------------------------
# pad, roll, tile, repeat, split
# ----------------------------------------------------------------------------
def test_pad_constant():
    oracle(lambda x: jnp.pad(x, (2, 3)), SEQ, [(12,)])
    oracle(lambda x: jnp.pad(x, ((1, 0), (2, 1)), constant_values=-1.0), MAT, [(7, 8)])


def test_pad_value_gradient():
    # (n >= 1: JAX's symbolic shape 2n + 2 assumes n >= 1; at n = 0 lax.pad gives 3)
    exs = [(X7, np.float32(2.0)), (X7[:3], np.float32(-1.0)), (X7[:1], np.float32(3.0))]
    oracle(lambda x, c: lax.pad(x, c, [(1, 2, 1)]), exs, [(12,), None], ("n", None),
                 modes=("eager", "jit", "grad"))


@pytest.mark.parametrize("cfg", [(1, -2, 2), (-1, 2, 1), (0, 0, 3), (-2, -1, 0), (3, 0, 0)])
def test_lax_pad_interior_negative(cfg):
    oracle(lambda x: lax.pad(x, 0.5, [cfg]), [(X7[:4],), (X7,), (X7[:3],)], [(12,)], "n",
           constraints=("n >= 3",), n_grad=1)


def test_pad_dynamic_low_padding():
    # low padding that depends on the size: n - 1 zeros in front
    def f(x):
        return lax.pad(x, 0.0, [(x.shape[0] - 1, 1, 0)])

    oracle(f, SEQ[:3], [(12,)])


@pytest.mark.parametrize("mode", ["edge", "reflect", "symmetric"])
def test_pad_modes(mode):
    oracle(lambda x: jnp.pad(x, (2, 2), mode=mode), [(X7,), (X7[:4],), (X7[:3],)],
                 [(12,)], "n", constraints=("n >= 3",))


@pytest.mark.parametrize("mode", ["wrap", "reflect", "symmetric"])
def test_pad_modes_wider_than_the_size_and_of_a_size_width(mode):
    """JAX pads these modes in a Python loop over divmod(width, n) (wrap) or
    as many reflections as the width needs, and refuses a width it cannot
    prove at most the size: past the per-size limit (bound 40) they were
    refused. One gather of the periodic extension now, widths larger than
    the size and a width that is another input's size included; size 0
    raises as plain JAX does."""
    f = lambda x: jnp.sin(jnp.pad(x, ((5, 2), (0, 1)), mode=mode))  # noqa: E731
    rng = np.random.default_rng(0)
    exs = [(rng.normal(size=(n, 3)).astype(np.float32),) for n in (1, 2, 3, 8)]
    check_oracle(f, exs, [(40, 3)], "n, 3", modes=("eager", "jit", "vmap", "grad"))
    with pytest.raises(pm.ShapeError, match=f"Cannot apply '{mode}' padding to empty axis"):
        pm.mask(f, "n, 3")(pm.Masked(jnp.ones((40, 3)), (0, 3)))
    g = lambda x, w: jnp.pad(x, (w.shape[0], 1), mode=mode)  # noqa: E731
    exs = [(rng.normal(size=n).astype(np.float32), np.ones(m, np.float32))
           for n, m in ((1, 0), (1, 3), (4, 9), (9, 2))]
    check_oracle(g, exs, [(40,), (40,)], ("n", "m"), modes=("eager", "jit"))
    # an empty axis padded by a width of 0 is plain JAX's [] (refused once: helper D)
    h = pm.mask(lambda x, w: jnp.pad(x, (w.shape[0], 0), mode=mode), ("n", "m"))
    z = jnp.ones(40)
    out = jax.jit(h)(pm.Masked(z, (jnp.int32(0),)), pm.Masked(z, (jnp.int32(0),)))
    assert out.unpad().shape == (0,)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_roll_tile_repeat():
    oracle(lambda x: jnp.roll(x, 2), SEQ, [(12,)])
    oracle(lambda x: jnp.roll(x, -3), SEQ[:3], [(12,)])
    oracle(lambda x: jnp.tile(x, 3), SEQ, [(12,)])
    oracle(lambda x: jnp.tile(x, (2, 3)), MAT, [(7, 8)])
    oracle(lambda x: jnp.repeat(x, 2), SEQ, [(12,)])
    oracle(lambda x: jnp.repeat(x, 2, axis=1), MAT, [(7, 8)])
    r = np.array([1, 0, 2, 1, 3, 0, 1], np.int32)
    oracle(lambda x, r: jnp.repeat(x, r, total_repeat_length=8),
           [(X7, r), (X7[:3], r[:3]), (X7[:1], r[:1])], [(12,), (12,)], ("n", "n"), n_grad=1)
    oracle(jnp.diff, SEQ[:3], [(12,)])


def test_tile_with_a_symbolic_repeat_count():
    # jnp.resize tiles ceil(k / n) times (a repeat count that is a size
    # expression); jnp.tile by a size tiles a static axis n times
    oracle(lambda x: jnp.resize(x, 6), SEQ + [(X7[:5],)], [(9,)], n_grad=3)
    oracle(lambda x: jnp.resize(x, (2, 3)), SEQ[:3], [(9,)], n_grad=1)
    with warnings.catch_warnings(record=True) as seen:  # no divide-by-zero at size 0
        warnings.simplefilter("always")
        got = pm.mask(lambda x: jnp.resize(x, 7), "n")(masked(X7[:3], (9,)))
    assert not [w for w in seen if "divide by zero" in str(w.message)]
    np.testing.assert_array_equal(got.unpad(), np.resize(X7[:3], 7))
    w = np.arange(1.0, 4.0, dtype=np.float32)
    oracle(lambda x, w: jnp.tile(w, x.shape[0]) * jnp.repeat(x, 3),
           [(X7[:4], w), (X7[:1], w), (X7[:0], w)], [(6,), None], ("n", None), n_grad=1)


def test_split():
    oracle(lambda x: jnp.split(x, [2], axis=0), SEQ[:2] + [(X7[:2],)], [(12,)], "n",
                 constraints=("n >= 2",))
    oracle(lambda x: jnp.split(x, [1, 3], axis=1), [(X,), (X[:2, :3],)], [(7, 8)],
                 "n, m", constraints=("m >= 3",))


@pytest.mark.parametrize("name,h", [
    ("x[::2]", lambda y: y[::2]),
    ("x[::-1]*iota", lambda y: y[::-1] * jnp.arange(y.shape[0])),
    ("x[:-1]", lambda y: y[:-1]),
    ("concat+pad", lambda y: jnp.pad(jnp.concatenate([y, 2 * y[::-1]]), (2, 1))),
])
def test_grad_inside_mask(name, h):
    # the transposes (pad, scatter-add, dynamic_update_slice, ...) are masked too
    def f(x):
        return jax.grad(lambda y: jnp.sum(jnp.sin(h(y))))(x)

    oracle(f, SEQ[:3], [(12,)], modes=("jit", "vmap"))


@pytest.mark.parametrize("f", [
    lambda x: jnp.sum(jnp.diff(x) * jnp.roll(x, 1)[1:]),
    lambda x: jnp.sum(lax.concatenate([x[:1], x[1:1]], 0)[1:] * 2.0) + jnp.sum(x[1:] * x[:-1]),
], ids=["diff_times_roll", "concat_with_empty_tail"])
def test_jit_of_grad_with_checks_compiles_where_a_case_concatenates_an_empty_operand(f):
    """In a case pinned at n = 1, ``jnp.roll(x, 1)`` concatenates ``x[0:1]`` and
    an empty ``x[0:0]``, and ``[1:]`` slices empty at its end. XLA's MLIR
    converter fails on that slice ("SmallVector unable to grow"), and in
    ``jax.jit(jax.grad(...))`` with run-time checks dropped the check
    callback's config instead: "No registered implementation for untyped
    custom call to xla_ffi_python_cpu_callback". Empty operands are dropped."""
    loss = lambda d, n: pm.mask(f, "n")(pm.Masked(d, (n,))).data  # noqa: E731
    g = jax.jit(jax.grad(loss))
    data = np.arange(1, 9, dtype=np.float32)
    for n in range(9):
        want = jax.grad(f)(jnp.asarray(data[:n]))
        got = g(jnp.asarray(garbage_pad(data[:n], (8,))), n)
        np.testing.assert_allclose(got[:n], want, rtol=1e-6)
        assert not np.any(got[n:])
