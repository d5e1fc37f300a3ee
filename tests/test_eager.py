"""Eager calls of mask run as one compiled program (tracing/eager.py), with the
interpreter's values, sizes and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm
from polymask.core.errors import UnsupportedError
from polymask.tracing import eager


def attention_sum(x):
    s = x @ x.T / jnp.sqrt(x.shape[1])
    return jnp.sum(jax.nn.softmax(s, axis=-1) @ x, axis=0)


def _states(mf):
    return [s for p in mf.programs for s in p.eager_states.values()]


def test_eager_calls_share_one_compiled_program_for_every_size():
    mf = pm.mask(attention_sum, "n, 16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 16)).astype(np.float32)
    padded = np.full((12, 16), np.nan, np.float32)
    outs = {}
    with pm.compile_counter() as warm:
        for n in (12, 1):  # the first call compiles
            padded[:n] = x[:n]
            outs[n] = mf(pm.Masked(padded.copy(), (n, 16)))
    (state,) = _states(mf)
    assert state.compiled is not None and not state.interpreted_only
    with pm.compile_counter() as later:
        for n in (0, 5, 11):
            padded[:] = np.nan
            padded[:n] = x[:n]
            outs[n] = mf(pm.Masked(padded.copy(), (n, 16)))
    assert later.compiles == 0, (warm.compiles, later.compiles)
    assert state.calls == 5
    for n, out in outs.items():
        assert out.shape == (16,)
        want = attention_sum(jnp.asarray(x[:n]))  # NaN at n = 0, as plain JAX
        np.testing.assert_allclose(out.data, want, rtol=2e-5, atol=1e-6)


def test_eager_outputs_keep_the_types_of_their_sizes():
    # a static size stays a Python int, an array size an array, a count the program's
    f = pm.mask(lambda x: jnp.cumsum(x), "n")
    g = pm.mask(lambda x: pm.nonzero(x > 1)[0], "n")
    x = jnp.arange(6.0)
    for _ in range(3):
        assert f(pm.Masked(x, (3,))).shape == (3,)
        assert type(f(pm.Masked(x, (3,))).shape[0]) is int
        out = f(pm.Masked(x, (jnp.int32(4),)))
        assert isinstance(out.shape[0], jax.Array) and int(out.shape[0]) == 4
        np.testing.assert_allclose(out.data[:4], [0, 1, 3, 6])
        nz = g(pm.Masked(x, (5,)))
        assert int(nz.shape[0]) == 3
        np.testing.assert_array_equal(nz.data[:3], [2, 3, 4])
    assert all(s.compiled is not None for s in _states(f) + _states(g))


def test_eager_vmap_runs_the_compiled_program_batched():
    mf = pm.mask(attention_sum, "n, 16")
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(4, 10, 16)).astype(np.float32)
    for ns in ([0, 3, 10, 7], [1, 2, 5, 9], [10, 10, 4, 0]):
        ns = np.asarray(ns, np.int32)
        out = jax.vmap(mf)(pm.Masked(jnp.asarray(xs), (ns, 16)))
        for b, n in enumerate(ns):
            np.testing.assert_allclose(out.data[b], attention_sum(jnp.asarray(xs[b, :n])),
                                       rtol=2e-5, atol=1e-6)
    (state,) = _states(mf)
    assert state.calls == 3 and state.compiled is not None


def test_a_size_check_failing_in_the_compiled_program_raises_its_shape_error():
    f = pm.mask(lambda x: pm.arange(jnp.sum(x).astype(jnp.int32), max_size=4) * 2, "n")
    x = jnp.ones(8)
    for n in (2, 3):
        np.testing.assert_array_equal(f(pm.Masked(x, (n,))).data[:n], np.arange(n) * 2)
    assert _states(f)[0].compiled is not None
    for _ in range(2):
        with pytest.raises(pm.ShapeError, match="larger than max_size=4"):
            f(pm.Masked(x, (6,)))
    np.testing.assert_array_equal(f(pm.Masked(x, (4,))).data, [0, 2, 4, 6])


def test_a_program_the_compiled_path_cannot_trace_stays_interpreted(monkeypatch):
    def untraceable(prog, zero_padded, forward_only, masked):
        def program(datas, values):
            raise UnsupportedError("needs a concrete value")
        return program

    monkeypatch.setattr(eager, "_flat_program", untraceable)
    f = pm.mask(lambda x: jnp.sum(x * x), "n")
    x = jnp.arange(5.0)
    for n in (5, 3, 0, 2):
        assert float(f(pm.Masked(x, (n,))).data) == float(np.sum(np.arange(n) ** 2))
    (state,) = _states(f)
    assert state.interpreted_only and state.calls == 4


def test_calls_under_jit_are_not_eager():
    f = pm.mask(lambda x: jnp.sum(x * x), "n")
    x = jnp.arange(5.0)
    for _ in range(3):
        assert float(jax.jit(f)(pm.Masked(x, (jnp.int32(3),))).data) == 5.0
        g = jax.jit(jax.grad(lambda d, n: f(pm.Masked(d, (n,))).data))(x, jnp.int32(3))
        np.testing.assert_array_equal(g, [0, 2, 4, 0, 0])
    assert _states(f) == []


def test_eager_derivatives_run_the_compiled_program_for_every_size():
    # jax.grad / jax.jvp of an eager call differentiate its one compiled program
    # (sizes traced), as jax.grad of jax.jit would: no interpretation per call
    mf = pm.mask(lambda x: attention_sum(x), "n, 16")  # a program of its own
    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, 16)).astype(np.float32)
    t = rng.normal(size=(12, 16)).astype(np.float32)

    def masked_grad(n):
        padded = np.full((12, 16), np.nan, np.float32)
        padded[:n] = x[:n]
        loss = lambda d: jnp.sum(jnp.sin(mf(pm.Masked(d, (n, 16))).data))  # noqa: E731
        out, tangent = jax.jvp(lambda d: mf(pm.Masked(d, (n, 16))).data,
                               (jnp.asarray(padded),), (jnp.asarray(t),))
        return jax.grad(loss)(jnp.asarray(padded)), out, tangent

    with pm.compile_counter():
        for n in (12, 1):  # the first calls compile
            masked_grad(n)
    with pm.compile_counter() as later:
        got = {n: masked_grad(n) for n in (0, 5, 11, 12)}
    assert later.compiles == 0
    (state,) = _states(mf)
    assert state.compiled is not None and not state.interpreted_only
    for n, (g, out, tangent) in got.items():
        exact = jnp.asarray(x[:n])
        want = jax.grad(lambda d: jnp.sum(jnp.sin(attention_sum(d))))(exact)
        want_out, want_t = jax.jvp(attention_sum, (exact,), (jnp.asarray(t[:n]),))
        np.testing.assert_allclose(g[:n], want, rtol=2e-5, atol=1e-5)
        np.testing.assert_array_equal(g[n:], 0.0)  # NaN padding stays out
        np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(tangent, want_t, rtol=2e-5, atol=1e-5)


def test_eager_vmap_of_a_case_split_compiles_the_switch_once():
    # each example picks its case; the switch is one compiled program, batched once
    mf = pm.mask(lambda v: v.sum() if v.shape[0] > 5 else v.prod(), "n")
    xs = jnp.asarray(np.random.default_rng(2).uniform(0.5, 1.5, size=(4, 12)).astype(np.float32))
    for i, ns in enumerate(([3, 7, 0, 12], [6, 5, 1, 9], [12, 12, 4, 2])):
        ns = np.asarray(ns, np.int32)
        with pm.compile_counter() as cc:
            out = jax.vmap(mf)(pm.Masked(xs, (ns,)))
        for b, n in enumerate(ns):
            v = xs[b, :n]
            np.testing.assert_allclose(out.data[b], v.sum() if n > 5 else v.prod(), rtol=1e-5)
        if i:
            assert cc.compiles == 0
    (tree,) = mf._meta.cache.values()
    (state,) = tree.eager_states.values()
    assert state.calls == 3 and state.compiled is not None


def test_a_function_masked_afresh_per_call_reuses_its_trace_and_program():
    def twice_cumsum(v):
        return jnp.cumsum(v) * 2

    x = jnp.arange(10.0)
    first = pm.mask(twice_cumsum, "n")(pm.Masked(x, (3,)))
    with pm.compile_counter() as cc:
        again = [pm.mask(twice_cumsum, "n")(pm.Masked(x, (n,))) for n in (0, 4, 10)]
    assert cc.compiles == 0
    np.testing.assert_array_equal(first.data[:3], [0, 2, 6])
    for n, out in zip((0, 4, 10), again):
        np.testing.assert_array_equal(out.data[:n], np.cumsum(np.arange(n)) * 2)

    class Unhashable:  # a callee that does not hash is traced per mask() instead
        __hash__ = None

        def __call__(self, v):
            return v * 3

    for n in (2, 5):
        out = pm.mask(Unhashable(), "n")(pm.Masked(x, (n,)))
        np.testing.assert_array_equal(out.data[:n], np.arange(n) * 3)


def test_eager_vmap_of_a_case_split_compiles_once_for_every_call_line():
    def f(x):
        if x.shape[0] > 2:
            return jnp.sum(x.reshape(-1, 2) ** 2)
        return jnp.sum(x) + 100.0

    g = jax.vmap(pm.mask(f, "n"))
    xs = jnp.ones((5, 8))
    ok = jnp.array([0, 1, 4, 8, 6], jnp.int32)
    g(pm.Masked(xs, (ok,)))
    with pm.compile_counter() as cc:
        np.testing.assert_array_equal(g(pm.Masked(xs, (ok,))).data, [100, 101, 4, 8, 6])
        np.testing.assert_array_equal(g(pm.Masked(xs, (ok,))).data, [100, 101, 4, 8, 6])
    assert cc.compiles == 0
    bad = jnp.array([0, 1, 4, 7, 6], jnp.int32)  # odd n = 7 cannot reshape to pairs
    lines = []
    for _ in range(2):
        with pytest.raises(pm.ShapeError, match=r"batch element 3") as e:
            g(pm.Masked(xs, (bad,)))
        lines.append(str(e.value).rsplit("test_eager.py:", 1)[1])
    assert lines[0] == lines[1]  # the same line in the loop...
    with pytest.raises(pm.ShapeError) as e:
        g(pm.Masked(xs, (bad,)))  # ...and this one named here
    assert str(e.value).rsplit("test_eager.py:", 1)[1] != lines[0]


def test_a_masked_callee_is_not_kept_alive():
    import gc
    import weakref

    class Scaled:
        def __init__(self):
            self.w = jnp.ones(3)

        def __call__(self, x):
            return jnp.sum(x) * self.w[0]

    refs = []
    for n in (2, 3):
        fun = Scaled()
        refs.append(weakref.ref(fun))
        assert float(pm.mask(fun, "n")(pm.Masked(jnp.ones(6), (n,))).data) == n
        del fun
    gc.collect()
    assert all(r() is None for r in refs)


def test_an_objects_call_and_its_methods_are_different_callees():
    # a bound method's weak reference equals one to its object: the trace
    # shared across masked functions must still tell them apart
    class Model:
        def encode(self, x):
            return x + 100.0

        def decode(self, x):
            return x - 1.0

        def __call__(self, x):
            return x * 2.0

    model = Model()
    x = np.arange(3, dtype=np.float32)
    masked = pm.Masked(jnp.arange(4.0), (3,))
    for fun, want in ((model.encode, x + 100), (model, x * 2), (model.decode, x - 1),
                      (model.encode, x + 100)):
        np.testing.assert_array_equal(pm.jit(fun)(x), want)
        np.testing.assert_array_equal(pm.mask(fun, "n")(masked).data[:3], want)
