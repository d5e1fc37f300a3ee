"""Host callbacks inside mask see the logical arrays (never the padding).

``jax.debug.callback`` / ``jax.debug.print`` receive the exact arrays; a
``pure_callback`` / ``io_callback`` runs on the exact arrays and its results
with dim vars in their shapes are padded back to their bound. Eagerly, under
``jax.jit`` (one trace for every size), under ``jax.vmap`` (each ragged row by
its own sizes) and under ``jax.grad``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import io_callback

import polymask as pm
from polymask.testing import garbage_pad
from tests.helpers import oracle

BOUND = 4
SIZES = (0, 1, BOUND)
X = np.arange(1.0, 13.0, dtype=np.float32).reshape(BOUND, 3)


def _recorder():
    seen = []
    return seen, lambda *a: seen.append(tuple(np.asarray(v) for v in a))


def _nan_padded(n):
    return jnp.asarray(garbage_pad(X[:n], (BOUND, 3)))


def _assert_seen(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def _masked_with_callback(cb):
    def f(x):
        jax.debug.callback(cb, x, jnp.sum(x, axis=0))
        return x * 2.0

    return pm.mask(f, "n, 3")


# ----------------------------------------------------------------------------
# jax.debug.callback / jax.debug.print
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("dynamic", [True, False])
def test_debug_callback_sees_exact_arrays_eager(dynamic):
    seen, cb = _recorder()
    m = _masked_with_callback(cb)
    for n in SIZES:
        size = jnp.int32(n) if dynamic else n
        out = m(pm.Masked(_nan_padded(n), (size, 3)))
        np.testing.assert_array_equal(out.unpad(), X[:n] * 2.0)
        _assert_seen(seen[-1], (X[:n], X[:n].sum(0)))
    assert len(seen) == len(SIZES)


def test_debug_callback_sees_exact_arrays_under_jit_one_trace():
    seen, cb = _recorder()
    m = _masked_with_callback(cb)
    traces = []
    jm = jax.jit(lambda x: (traces.append(1), m(x))[1])
    for n in SIZES:
        jax.block_until_ready(jm(pm.Masked(_nan_padded(n), (jnp.int32(n), 3))))
        jax.effects_barrier()
        _assert_seen(seen[-1], (X[:n], X[:n].sum(0)))
    assert len(traces) == 1 and len(seen) == len(SIZES)


@pytest.mark.parametrize("jit", [False, True])
def test_debug_callback_under_vmap_sees_each_row_by_its_sizes(jit):
    seen, cb = _recorder()
    m = _masked_with_callback(cb)
    batch = pm.Masked(jnp.stack([_nan_padded(n) for n in SIZES]),
                      (jnp.array(SIZES, jnp.int32), 3))
    vm = jax.vmap(m)
    out = (jax.jit(vm) if jit else vm)(batch)
    jax.effects_barrier()
    for i, n in enumerate(SIZES):
        np.testing.assert_array_equal(np.asarray(out.data[i])[:n], X[:n] * 2.0)
    got = sorted(seen, key=lambda s: s[0].shape[0])
    for g, n in zip(got, SIZES):
        _assert_seen(g, (X[:n], X[:n].sum(0)))
    assert len(seen) == len(SIZES)


def test_debug_callback_two_dynamic_axes():
    seen, cb = _recorder()
    m = pm.mask(lambda x: (jax.debug.callback(cb, x), x)[1], "n, m")
    full = np.arange(20.0, dtype=np.float32).reshape(4, 5)
    for n, k in [(0, 3), (2, 0), (3, 5), (4, 1)]:
        data = jnp.asarray(garbage_pad(full[:n, :k], (4, 5)))
        jax.jit(m)(pm.Masked(data, (jnp.int32(n), jnp.int32(k))))
        jax.effects_barrier()
        _assert_seen(seen[-1], (full[:n, :k],))


def test_debug_callback_under_grad():
    seen, cb = _recorder()

    def f(x):
        jax.debug.callback(cb, x)
        return jnp.sum(x ** 2)

    m = pm.mask(f, "n, 3")
    for n in SIZES:
        g = jax.jit(jax.grad(lambda d, s: m(pm.Masked(d, (s, 3))).data))(
            _nan_padded(n), jnp.int32(n))
        jax.effects_barrier()
        _assert_seen(seen[-1], (X[:n],))
        np.testing.assert_array_equal(np.asarray(g)[:n], 2.0 * X[:n])
        assert not np.asarray(g)[n:].any()


def test_debug_print_shows_exact_arrays(capsys):
    def f(x):
        jax.debug.print("x={x} total={t}", x=x, t=jnp.sum(x))
        return x

    m = pm.mask(f, "n")
    data = jnp.asarray(garbage_pad(np.array([1.0, 2.0], np.float32), (4,)))
    m(pm.Masked(data, (jnp.int32(2),)))
    jax.jit(m)(pm.Masked(data, (jnp.int32(1),)))
    jax.effects_barrier()
    assert capsys.readouterr().out.splitlines() == ["x=[1. 2.] total=3.0", "x=[1.] total=1.0"]
    batch = pm.Masked(jnp.stack([data, data]), (jnp.array([0, 2], jnp.int32),))
    jax.jit(jax.vmap(m))(batch)
    jax.effects_barrier()
    assert sorted(capsys.readouterr().out.splitlines()) == ["x=[1. 2.] total=3.0",
                                                           "x=[] total=0.0"]


def test_debug_print_positional_static_and_ordered(capsys):
    def f(x):
        jax.debug.print("{} {} {}", "tag", x, 7)
        jax.debug.print("a {}", x[0], ordered=True)
        jax.debug.print("b {}", x, ordered=True)
        return x

    m = pm.mask(f, "n")
    m(pm.Masked(jnp.array([5, 6, 99], jnp.int32), (jnp.int32(2),)))
    jax.jit(m)(pm.Masked(jnp.array([5, 6, 99], jnp.int32), (jnp.int32(1),)))
    jax.effects_barrier()
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == sorted(["tag [5 6] 7", "a 5", "b [5 6]", "tag [5] 7", "a 5", "b [5]"])
    assert [s for s in lines if s[0] in "ab"] == ["a 5", "b [5 6]", "a 5", "b [5]"]  # ordered


def _if_size_is_one(cb, x):
    if x.shape[0] == 1:  # a case split: under vmap every case runs for every row
        jax.debug.callback(cb, "one", x)
        return x * 100.0
    jax.debug.callback(cb, "other", x)
    return x + 1.0


def test_debug_callback_in_a_case_split_runs_only_in_the_rows_case():
    seen = []
    cb = lambda tag, x: seen.append((tag, np.asarray(x).tolist()))  # noqa: E731
    m = pm.mask(functools.partial(_if_size_is_one, cb), "n")
    batch = pm.Masked(jnp.array([[1.0, np.nan, np.nan], [1.0, 2.0, 3.0]], jnp.float32),
                      (jnp.array([1, 3], jnp.int32),))
    out = jax.jit(jax.vmap(m))(batch)
    jax.effects_barrier()
    assert sorted(seen) == [("one", [1.0]), ("other", [1.0, 2.0, 3.0])]
    np.testing.assert_array_equal(np.asarray(out.data)[0, :1], [100.0])


def test_partitioned_debug_callback_on_a_dynamic_operand_is_refused():
    m = pm.mask(lambda x: (jax.debug.callback(print, x, partitioned=True), x)[1], "n")
    with pytest.raises(pm.UnsupportedError, match="partitioned=True"):
        m(pm.Masked(jnp.ones(4), (jnp.int32(2),)))


def test_static_sizes_at_bound_bind_unchanged():
    seen, cb = _recorder()
    m = _masked_with_callback(cb)
    m(jnp.asarray(X))  # unpadded: the static fast path
    _assert_seen(seen[-1], (X, X.sum(0)))


# ----------------------------------------------------------------------------
# pure_callback
# ----------------------------------------------------------------------------
VMAP_METHODS = ("sequential", "expand_dims", "broadcast_all", "legacy_vectorized")


def _vec(n, seed=0):
    return (np.random.default_rng(seed + n).normal(size=(n,)).astype(np.float32),)


def _pure(fn, shape_dtype, *args, vmap_method):
    return jax.pure_callback(fn, shape_dtype, *args, vmap_method=vmap_method)


@pytest.mark.parametrize("vmap_method", VMAP_METHODS)
def test_pure_callback_dim_var_results(vmap_method):
    def f(x):
        like = jax.ShapeDtypeStruct(x.shape, x.dtype)
        s = _pure(lambda a: np.sort(a, axis=-1), like, x, vmap_method=vmap_method)
        c = _pure(lambda a: np.cumsum(a, axis=-1, dtype=a.dtype), like, x,
                  vmap_method=vmap_method)
        return s, c

    oracle(f, [_vec(n) for n in (0, 1, 3, 5)], [(5,)], "n", modes=("eager", "jit", "vmap"))


@pytest.mark.parametrize("vmap_method", ("sequential", "expand_dims"))
def test_pure_callback_result_shorter_than_operand(vmap_method):
    def f(x):
        out = jax.ShapeDtypeStruct((x.shape[0] - 1,), x.dtype)
        return _pure(lambda a: np.diff(a, axis=-1), out, x, vmap_method=vmap_method) * 2.0

    oracle(f, [_vec(n) for n in (1, 2, 5)], [(5,)], "n", constraints=["n >= 1"],
           modes=("eager", "jit", "vmap"))


@pytest.mark.parametrize("vmap_method", ("sequential", "broadcast_all"))
def test_pure_callback_static_and_several_results(vmap_method):
    def host(a):
        return (np.sum(a, axis=-1).astype(a.dtype), np.argsort(a, axis=-1).astype(np.int32),
                np.asarray(a.shape[-1], np.int32) + np.zeros(a.shape[:-1], np.int32))

    def f(x):
        shapes = (jax.ShapeDtypeStruct((), x.dtype), jax.ShapeDtypeStruct(x.shape, jnp.int32),
                  jax.ShapeDtypeStruct((), jnp.int32))
        total, order, n = _pure(host, shapes, x, vmap_method=vmap_method)
        return total, order, n

    oracle(f, [_vec(n) for n in (0, 1, 4)], [(4,)], "n", modes=("eager", "jit", "vmap"))


def test_pure_callback_scipy_filter_sees_the_logical_end():
    ndimage = pytest.importorskip("scipy.ndimage")

    def f(x):  # reflect mode reads past the logical end: padding must not be there
        return jax.pure_callback(lambda a: ndimage.uniform_filter1d(a, 3, axis=-1),
                                 jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                                 vmap_method="sequential")

    oracle(f, [_vec(n) for n in (1, 2, 6)], [(6,)], "n", modes=("eager", "jit", "vmap"))


def test_pure_callback_2d_with_an_unpadded_operand():
    def f(x, w):
        return jax.pure_callback(lambda a, b: np.sort(a @ b, axis=-2),
                                 jax.ShapeDtypeStruct((x.shape[0], 2), x.dtype), x, w,
                                 vmap_method="expand_dims")

    rng = np.random.default_rng(1)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    exs = [(rng.normal(size=(n, 3)).astype(np.float32), w) for n in (0, 2, 4)]
    oracle(f, exs, [(4, 3), None], ("n, 3", None), modes=("eager", "jit", "vmap"))


@pytest.mark.parametrize("vmap_method", ("expand_dims", "broadcast_all"))
def test_pure_callback_batched_methods_call_once_for_equal_sizes(vmap_method):
    calls = []

    def host(a):
        calls.append(a.shape)
        return np.sort(a, axis=-1)

    m = pm.mask(lambda x: jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                                            vmap_method=vmap_method), "n")
    data = jnp.asarray([[3.0, 1.0, 2.0, np.nan], [9.0, 8.0, 7.0, np.nan]], jnp.float32)
    out = jax.vmap(m)(pm.Masked(data, (jnp.array([3, 3], jnp.int32),)))
    assert calls == [(2, 3)]
    np.testing.assert_array_equal(np.asarray(out.data)[:, :3], [[1, 2, 3], [7, 8, 9]])
    calls.clear()  # ragged: one call per row, each a batch of one
    out = jax.vmap(m)(pm.Masked(data, (jnp.array([1, 3], jnp.int32),)))
    assert calls == [(1, 1), (1, 3)]
    np.testing.assert_array_equal(np.asarray(out.data)[1, :3], [7, 8, 9])
    calls.clear()  # only the sizes are batched (the data broadcast)
    out = jax.vmap(lambda s: m(pm.Masked(data[1], (s,))).data)(jnp.array([2, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out)[0, :2], [8, 9])
    np.testing.assert_array_equal(np.asarray(out)[1, :3], [7, 8, 9])


def test_pure_callback_wrong_result_shape_is_an_error_not_a_wrong_result():
    m = pm.mask(lambda x: jax.pure_callback(lambda a: a[:1], jax.ShapeDtypeStruct(
        x.shape, x.dtype), x, vmap_method="sequential"), "n")
    with pytest.raises(Exception, match="result_shape_dtypes give"):
        jax.block_until_ready(jax.jit(m)(pm.Masked(jnp.ones(4), (jnp.int32(3),))))


def test_pure_callback_unpadded_input_static_fast_path():
    m = pm.mask(lambda x: jax.pure_callback(np.sort, jax.ShapeDtypeStruct(x.shape, x.dtype), x),
                "n")
    np.testing.assert_array_equal(m(jnp.array([3.0, 1.0, 2.0])).unpad(), [1.0, 2.0, 3.0])


# ----------------------------------------------------------------------------
# io_callback
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("ordered", [False, True])
def test_io_callback_sees_exact_arrays(ordered):
    seen = []

    def host(a):
        seen.append(np.asarray(a))
        return np.cumsum(a, dtype=a.dtype)

    m = pm.mask(lambda x: io_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                                      ordered=ordered), "n")
    for n in SIZES:
        data = jnp.asarray(garbage_pad(X[:n, 0], (BOUND,)))
        for g in (m, jax.jit(m)):
            out = g(pm.Masked(data, (jnp.int32(n),)))
            np.testing.assert_array_equal(out.unpad(), np.cumsum(X[:n, 0]))
            np.testing.assert_array_equal(seen[-1], X[:n, 0])
    if not ordered:  # JAX cannot vmap an ordered io_callback (plain JAX neither)
        seen.clear()
        batch = pm.Masked(jnp.stack([jnp.asarray(garbage_pad(X[:n, 0], (BOUND,)))
                                     for n in SIZES]), (jnp.array(SIZES, jnp.int32),))
        out = jax.jit(jax.vmap(m))(batch)
        for i, n in enumerate(SIZES):
            np.testing.assert_array_equal(np.asarray(out.data)[i, :n], np.cumsum(X[:n, 0]))
        assert sorted(len(s) for s in seen) == list(SIZES)


# ----------------------------------------------------------------------------
# Callbacks in loops over a dynamic length: the masked loop runs to the bound,
# the callbacks only on the logical steps (as many calls, same values, as on
# exact arrays)
# ----------------------------------------------------------------------------
def _call_debug(rec, *vals):
    jax.debug.callback(rec, *vals)
    return jnp.float32(1.0)


def _call_pure(rec, *vals):  # the result is used: JAX drops an unused pure_callback
    return jax.pure_callback(lambda *a: (rec(*a), np.float32(1.0))[1],
                             jax.ShapeDtypeStruct((), jnp.float32), *vals,
                             vmap_method="sequential")


def _call_io(rec, *vals):
    return io_callback(lambda *a: (rec(*a), np.float32(1.0))[1],
                       jax.ShapeDtypeStruct((), jnp.float32), *vals)


CALLS = {"debug": _call_debug, "pure": _call_pure, "io": _call_io}


def _row(x, i):
    """``x[i]``, also traceable at 0 rows (where plain JAX refuses ``x[i]``)."""
    return jnp.sum(jnp.where((jnp.arange(x.shape[0]) == i)[:, None], x, 0.0), axis=0)


def _scan_loop(call, reverse=False):
    def f(x):
        def step(c, row):
            one = call(c, row)
            return c + row * one, c * row
        return lax.scan(step, jnp.zeros(3, x.dtype), x, reverse=reverse)
    return f


def _fori_loop(call):
    def f(x):
        def body(i, c):
            row = _row(x, i)
            return c + row * call(i, c, row)
        return lax.fori_loop(0, x.shape[0], body, jnp.zeros(3, x.dtype))
    return f


def _while_loop(call):
    def f(x):
        def body(s):
            i, c = s
            row = _row(x, i)
            return i + 1, c + row * call(i, c, row)
        return lax.while_loop(lambda s: s[0] < x.shape[0], body, (jnp.int32(0), jnp.zeros(3)))
    return f


LOOPS = {"scan": _scan_loop, "scan_reverse": functools.partial(_scan_loop, reverse=True),
         "fori": _fori_loop, "while": _while_loop}


def _loop_recorder():
    calls = []
    return calls, lambda *a: calls.append(tuple(np.asarray(v).tolist() for v in a))


def _plain_calls(loop, kind, n):
    calls, rec = _loop_recorder()
    out = LOOPS[loop](functools.partial(CALLS[kind], rec))(jnp.asarray(X[:n]))
    jax.effects_barrier()
    return calls, out


def _is_masked(o):
    return isinstance(o, pm.Masked)


def _assert_out(got, want):
    got = jax.tree_util.tree_leaves(got, is_leaf=_is_masked)
    want = jax.tree_util.tree_leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.unpad(), np.asarray(w))


@pytest.mark.parametrize("kind", sorted(CALLS))
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_callbacks_in_loops_run_only_on_logical_steps(loop, kind):
    calls, rec = _loop_recorder()
    m = pm.mask(LOOPS[loop](functools.partial(CALLS[kind], rec)), "n, 3")
    traces = []
    jm = jax.jit(lambda x: (traces.append(1), m(x))[1])
    for n in SIZES:
        want, want_out = _plain_calls(loop, kind, n)
        assert len(want) == n
        for g in (m, jm):
            calls.clear()
            out = g(pm.Masked(_nan_padded(n), (jnp.int32(n), 3)))
            jax.effects_barrier()
            assert calls == want, (g, n)
            _assert_out(out, want_out)
    assert len(traces) == 1
    # A ragged batch: per row the calls of that row (rows interleave).
    batch = pm.Masked(jnp.stack([_nan_padded(n) for n in SIZES]),
                      (jnp.array(SIZES, jnp.int32), 3))
    want = [c for n in SIZES for c in _plain_calls(loop, kind, n)[0]]
    if (loop, kind) == ("while", "io"):  # as in plain JAX (a batched predicate)
        with pytest.raises(Exception, match="IO effects not supported in while_loop"):
            jax.vmap(m)(batch)
        return
    for vm in (jax.vmap(m), jax.jit(jax.vmap(m))):
        calls.clear()
        out = vm(batch)
        jax.effects_barrier()
        assert sorted(calls, key=repr) == sorted(want, key=repr)
        for i, n in enumerate(SIZES):
            row = jax.tree_util.tree_map(lambda o, i=i: pm.Masked(o.data[i], tuple(
                s if isinstance(s, int) else s[i] for s in o.shape)), out,
                is_leaf=_is_masked)
            _assert_out(row, _plain_calls(loop, kind, n)[1])


def test_debug_print_in_loops_prints_only_logical_steps(capsys):
    def fn(x):
        def step(c, row):
            jax.debug.print("scan c={c} row={r}", c=c, r=row)
            return c + row, None

        def body(i, c):
            jax.debug.print("fori {i} {r}", i=i, r=_row(x, i))
            return c + 1.0

        c = lax.scan(step, jnp.zeros(3), x)[0]
        return lax.fori_loop(0, x.shape[0], body, c)

    def plain(n):
        fn(jnp.asarray(X[:n]))
        jax.effects_barrier()
        return capsys.readouterr().out.splitlines()

    m = pm.mask(fn, "n, 3")
    for n in SIZES:
        want = plain(n)
        assert len(want) == 2 * n
        for g in (m, jax.jit(m)):
            g(pm.Masked(_nan_padded(n), (jnp.int32(n), 3)))
            jax.effects_barrier()
            assert capsys.readouterr().out.splitlines() == want
    want = sorted(line for n in SIZES for line in plain(n))
    batch = pm.Masked(jnp.stack([_nan_padded(n) for n in SIZES]),
                      (jnp.array(SIZES, jnp.int32), 3))
    jax.jit(jax.vmap(m))(batch)
    jax.effects_barrier()
    assert sorted(capsys.readouterr().out.splitlines()) == want


def test_ordered_io_callback_in_a_scan_over_a_dynamic_length():
    seen = []

    def host(i):
        seen.append(int(i))
        return np.float32(i)

    def f(x):
        def step(c, i):
            return c + io_callback(host, jax.ShapeDtypeStruct((), jnp.float32), i,
                                   ordered=True), None
        return lax.scan(step, jnp.float32(0), jnp.arange(x.shape[0]))[0]

    m = pm.mask(f, "n")
    for n in SIZES:
        for g in (m, jax.jit(m)):
            seen.clear()
            out = g(pm.Masked(jnp.full((BOUND,), np.nan, jnp.float32), (jnp.int32(n),)))
            jax.effects_barrier()
            assert seen == list(range(n))
            assert float(out.unpad()) == sum(range(n))


# ----------------------------------------------------------------------------
# What the host function is handed: jax.Array, as from plain JAX
# ----------------------------------------------------------------------------
def _callback_types(f, x, seen):
    seen.clear()
    jax.block_until_ready(f(x))
    jax.effects_barrier()
    return sorted((name, type(a).__name__, a.shape) for name, a in seen)


@pytest.mark.parametrize("n", [0, 2])
def test_host_functions_get_the_same_array_types_as_plain_jax(n):
    seen = []

    def rec(name):
        def host(a):
            seen.append((name, a))
            return np.asarray(a) * 2 if name != "debug" else None
        return host

    def f(x):
        jax.debug.callback(rec("debug"), x)
        y = jax.pure_callback(rec("pure"), jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        z = io_callback(rec("io"), jax.ShapeDtypeStruct(x.shape, x.dtype), y)
        return z + 1.0

    exact = X[:n, 0]
    want = _callback_types(f, jnp.asarray(exact), seen)
    # (plain JAX skips a pure_callback whose results are empty: two calls at 0)
    assert len(want) == (3 if n else 2) and {t for _, t, _ in want} == {"ArrayImpl"}
    m = pm.mask(f, "n")
    padded = pm.Masked(jnp.asarray(garbage_pad(exact, (BOUND,))), (jnp.int32(n),))
    for g in (m, jax.jit(m)):
        assert _callback_types(g, padded, seen) == want
        np.testing.assert_array_equal(g(padded).unpad(), exact * 4 + 1.0)


@pytest.mark.parametrize("batch_size", [2, 4])
def test_ragged_map_spare_rows_of_a_partial_batch_call_no_host_function(batch_size):
    # a partial batch runs in a bigger program whose spare rows are zeros:
    # plain JAX never sees them, so neither does the user's callback
    seen = []

    def f(x):
        io_callback(lambda a: seen.append(np.asarray(a).tolist()), None, x)
        step = lambda i, c: (jax.debug.callback(lambda v: seen.append(float(v)), x[i]), c + x[i])[1]
        return lax.fori_loop(0, x.shape[0], step, 0.0)

    xs = [np.arange(1.0, n + 1, dtype=np.float32) for n in (2, 3, 1)]
    # (n >= 1: x[i] would split the trace at n = 0, and JAX cannot vmap an
    # io_callback inside the resulting switch)
    out = pm.ragged_map(f, ("n",), batch_size=batch_size, constraints=("n >= 1",))(xs)
    jax.effects_barrier()
    np.testing.assert_array_equal(out, [3.0, 6.0, 1.0])
    for x in xs:
        f(jnp.asarray(x))
    jax.effects_barrier()
    want, seen[:] = list(seen[len(seen) // 2:]), seen[:len(seen) // 2]
    key = lambda v: (isinstance(v, list), v)
    assert sorted(seen, key=key) == sorted(want, key=key)


def test_io_callback_with_a_case_split_under_vmap_runs_per_example_and_says_why():
    # JAX cannot vmap an IO effect inside a switch ("vmap-of-cond"): the
    # examples run one by one under jax.jit, and the warning names the split
    # and the constraint that removes it
    def f(x):
        io_callback(lambda a: None, None, x)
        return x[0]  # x[0] raises at n = 0: a case split

    xs = [np.ones(2, np.float32), np.ones(3, np.float32)]
    with pytest.warns(pm.FallbackWarning, match=r"2 cases.*constraints=\['n >= 1'\]"):
        np.testing.assert_array_equal(pm.ragged_map(f, ("n",))(xs), [1, 1])
    with pytest.raises(pm.UnsupportedError, match=r"2 cases.*constraints=\['n >= 1'\]"):
        pm.ragged_map(f, ("n",), fallback=False)(xs)
    np.testing.assert_array_equal(pm.ragged_map(f, ("n",), constraints=("n >= 1",))(xs), [1, 1])


def test_ragged_map_calls_a_pure_callback_without_vmap_method_per_example():
    # ragged_map stands for a loop over examples: JAX's refusal to vmap a
    # pure_callback without vmap_method does not apply (a user's own
    # jax.vmap still refuses it, as plain JAX does)
    f = lambda x: jax.pure_callback(lambda a: np.cumsum(a), jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    x).sum()
    g = lambda x: lax.scan(lambda c, a: (c + jax.pure_callback(
        lambda v: v * 2, jax.ShapeDtypeStruct((), x.dtype), a), None), 0.0, x)[0]
    xs = [np.arange(1.0, n + 1, dtype=np.float32) for n in (3, 1, 5, 0)]
    for fun in (f, g):
        np.testing.assert_array_equal(pm.ragged_map(fun, ("n",), batch_size=2)(xs),
                                      [fun(jnp.asarray(x)) for x in xs])
    # any vmap_method: the host function sees one example's arrays, as fun(x) gives it
    for method in ("sequential", "expand_dims", "broadcast_all", "legacy_vectorized"):
        seen = []

        def h(x, method=method):
            def host(a):
                seen.append(np.shape(a))
                return np.cumsum(a)
            return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                                     vmap_method=method).sum()

        np.testing.assert_array_equal(pm.ragged_map(h, ("n",), batch_size=2)(xs),
                                      [f(jnp.asarray(x)) for x in xs])
        assert sorted(seen) == sorted(np.shape(x) for x in xs if len(x))
    with pytest.raises(NotImplementedError, match="vmap_method"):
        jax.vmap(pm.mask(f, "n"))(pm.Masked(jnp.ones((2, 4)), (jnp.array([1, 2]),)))


def test_a_tiered_runners_background_compiles_never_fire_its_callbacks():
    # the background compile of a bucket lowers its program for a call's
    # padded arguments: run, it would replay that call's callbacks later
    written = []

    def step(x):
        io_callback(lambda v: written.append(float(v)), None, x.sum(), ordered=True)
        jax.debug.callback(lambda v: written.append(-float(v)), x.shape[0])
        return x * 2

    f = pm.jit(step, tiered=True)
    sizes = (3, 20, 40, 3, 20)
    for n in sizes:
        f(np.ones(n, np.float32))
    f.wait()
    for n in sizes[:3]:
        f(np.ones(n, np.float32))
    f.wait()
    assert f.stats()["background_compiles"] >= 1
    calls = [float(n) for n in sizes + sizes[:3]]  # (the two kinds are not ordered together)
    assert [v for v in written if v > 0] == calls
    assert sorted(-v for v in written if v < 0) == sorted(calls)
