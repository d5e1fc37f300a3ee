"""Masking rules for scan, while/fori_loop, cond/switch, and Python `if` on sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import polymask as pm
from polymask.testing import check_oracle, garbage_pad

RNG = np.random.default_rng(0)


def _vec(n, lo=-1.0, hi=1.0):
    return RNG.uniform(lo, hi, size=(n,)).astype(np.float32)


# ----------------------------------------------------------------------------
# scan
# ----------------------------------------------------------------------------
def running(x):
    return lax.scan(lambda c, v: (c + v, c * v), 0.0, x)


def test_scan_carry_and_stacked_outputs():
    check_oracle(running, [(_vec(n),) for n in (3, 1, 5, 0)], [(5,)])


def test_scan_reverse_starts_at_logical_end():
    def f(x):
        return lax.scan(lambda c, v: (c * 0.5 + v, c), 1.0, x, reverse=True)

    m = pm.mask(f)(pm.Masked(jnp.asarray(garbage_pad(np.array([1.0, 2, 4]), (6,))), (3,)))
    c, ys = m
    ref_c, ref_ys = f(jnp.array([1.0, 2, 4]))
    np.testing.assert_allclose(c.data, ref_c)
    np.testing.assert_allclose(ys.unpad(), ref_ys)
    check_oracle(f, [(_vec(n),) for n in (3, 1, 6, 0)], [(6,)])


@pytest.mark.parametrize("unroll", [2, True])
def test_scan_unroll(unroll):
    def f(x):
        return lax.scan(lambda c, v: (jnp.sin(c) + v, c + v), 0.0, x, unroll=unroll)

    check_oracle(f, [(_vec(n),) for n in (4, 7, 0)], [(7,)])


def test_scan_nan_safe_gradient_through_log():
    # Invalid steps must not feed padding into log: grad would be 0 * inf = nan.
    def f(x, w):
        return lax.scan(lambda c, v: (c + w * jnp.log(v), jnp.log(v) * c), 0.0, x)

    # (Length 0 is excluded: an empty scan feeds zero rows, and log'(0) = inf.)
    exs = [(_vec(n, 0.5, 2.0), np.float32(0.7)) for n in (3, 1, 5)]
    check_oracle(f, exs, [(5,), None], ("n", None))


def test_scan_dynamic_inner_axes():
    # Rows of a (n, m) array: the body reduces over the dynamic inner axis m.
    def f(x):
        def step(c, row):
            return c + jnp.max(row) * jnp.sum(row), row * c + jnp.cumsum(row)

        return lax.scan(step, 0.0, x)

    exs = [(RNG.normal(size=s).astype(np.float32),) for s in [(3, 2), (1, 4), (4, 1), (0, 3)]]
    check_oracle(f, exs, [(4, 4)])


def test_scan_static_length_dynamic_carry():
    # fori_loop with a static trip count: a scan of length 3 carrying an (n,) array.
    def f(x):
        return lax.fori_loop(0, 3, lambda i, c: c * 0.5 + jnp.sum(c) / c.shape[0], x)

    check_oracle(f, [(_vec(n),) for n in (3, 1, 6, 0)], [(6,)])


def test_scan_length_is_a_size():
    def f(x):
        def step(c, i):
            return c * 0.9 + i, c

        # (JAX needs a constant `length=` when there are no xs: scan over an iota.)
        return lax.scan(step, jnp.sum(x), jnp.arange(x.shape[0], dtype=jnp.float32))

    check_oracle(f, [(_vec(n),) for n in (3, 1, 6, 0)], [(6,)])


def test_scan_consts_with_dynamic_axes():
    # The body closes over a value with a dynamic axis (a const of the scan).
    def f(x, mem):
        def step(c, v):
            att = jax.nn.softmax(mem * v)
            return c + jnp.sum(att * mem), jnp.sum(att * mem)

        return lax.scan(step, 0.0, x)

    exs = [(_vec(n), _vec(m)) for n, m in [(3, 2), (1, 5), (4, 1)]]
    check_oracle(f, exs, [(4,), (5,)], ("n", "m"))


def test_scan_one_trace_across_lengths():
    traces = []

    def f(x):
        traces.append(1)
        return running(x)[0]

    m = jax.jit(pm.mask(f, "n"))
    x = jnp.array([5.0, 2, 9, 1, 4])
    got = [float(m(pm.Masked(x, (jnp.int32(n),))).data) for n in (3, 4, 1, 0, 5)]
    assert got == [16, 17, 5, 0, 21]
    assert len(traces) == 1


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 6), extra=st.integers(0, 3), reverse=st.booleans())
def test_scan_property(n, extra, reverse):
    x = RNG.normal(size=(n,)).astype(np.float32)

    def f(x):
        return lax.scan(lambda c, v: (c * 0.5 + v, c - v), 1.0, x, reverse=reverse)

    out = pm.mask(f)(pm.Masked(jnp.asarray(garbage_pad(x, (n + extra + 1,))),
                               (jnp.int32(n),)))
    ref = f(jnp.asarray(x))
    np.testing.assert_allclose(out[0].data, ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out[1].data)[:n], ref[1], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# RNNs over ragged batches: gradients equal per-sequence unpadded gradients
# ----------------------------------------------------------------------------
def gru_loss(params, xs, y):
    wz, uz, wr, ur, wh, uh = params

    def step(h, x):
        z = jax.nn.sigmoid(wz @ x + uz @ h)
        r = jax.nn.sigmoid(wr @ x + ur @ h)
        hh = jnp.tanh(wh @ x + uh @ (r * h))
        h = (1 - z) * h + z * hh
        return h, jnp.sum(h)

    h, outs = lax.scan(step, jnp.zeros(4), xs)
    return jnp.sum((h - y) ** 2) + 0.1 * jnp.sum(outs)


def lstm_loss(params, xs, y):
    w, u, b = params

    def step(carry, x):
        h, c = carry
        g = w @ x + u @ h + b
        i, f, o, gg = jnp.split(g, 4)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(gg)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    (h, _), hs = lax.scan(step, (jnp.zeros(4), jnp.zeros(4)), xs)
    return jnp.sum((h - y) ** 2) + 0.1 * jnp.sum(hs ** 2)


@pytest.mark.parametrize("loss,shapes", [
    (gru_loss, [(4, 3), (4, 4)] * 3),
    (lstm_loss, [(16, 3), (16, 4), (16,)]),
])
def test_rnn_ragged_batch_gradients(loss, shapes):
    rng = np.random.default_rng(3)
    params = [jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32) for s in shapes]
    lengths = [2, 7, 4, 0, 1]
    bound = 8
    seqs = rng.normal(size=(len(lengths), bound, 3)).astype(np.float32)
    ys = jnp.asarray(rng.normal(size=(len(lengths), 4)), jnp.float32)
    valid = np.arange(bound)[None, :, None] < np.array(lengths)[:, None, None]
    padded = jnp.asarray(np.where(valid, seqs, np.nan).astype(np.float32))
    m = pm.mask(loss, (None, "n, 3", None))

    def total(params):
        out = jax.vmap(lambda x, n, y: m(params, pm.Masked(x, (n, 3)), y))(
            padded, jnp.asarray(lengths, jnp.int32), ys)
        return jnp.sum(out.data)

    val, grads = jax.jit(jax.value_and_grad(total))(params)
    ref_val = sum(loss(params, jnp.asarray(seqs[i, :n]), ys[i]) for i, n in enumerate(lengths))
    ref = [sum(g) for g in zip(*[jax.grad(loss)(params, jnp.asarray(seqs[i, :n]), ys[i])
                                 for i, n in enumerate(lengths)])]
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for g, r in zip(grads, ref):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_rnn_gradient_wrt_padded_sequence():
    # Gradient w.r.t. the sequence itself: equal on the logical rows, 0 in padding.
    rng = np.random.default_rng(4)
    params = [jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32) for s in [(4, 3), (4, 4)] * 3]
    y = rng.normal(size=(4,)).astype(np.float32)
    exs = [(rng.normal(size=(n, 3)).astype(np.float32), y) for n in (3, 6, 1)]
    check_oracle(lambda xs, y: gru_loss(params, xs, y), exs, [(6, 3), None], ("n, 3", None),
                 rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# while_loop / fori_loop
# ----------------------------------------------------------------------------
def test_fori_loop_to_size_accumulates():
    def f(x):
        return lax.fori_loop(0, x.shape[0], lambda i, c: c + x[i] * (i + 1), 0.0)

    check_oracle(f, [(_vec(n),) for n in (3, 1, 6)], [(6,)])
    m = pm.mask(f)(pm.Masked(jnp.asarray(garbage_pad(np.array([1.0, 2, 4]), (5,))), (3,)))
    assert float(m.data) == 1 + 4 + 12
    # Plain JAX cannot trace x[i] on an empty x (IndexError): n = 0 is an error case.
    with pytest.raises(Exception, match="the function fails"):
        jax.block_until_ready(
            jax.jit(pm.mask(f))(pm.Masked(jnp.full(5, jnp.nan), (jnp.int32(0),))).data)


def test_fori_loop_bounds_from_size_expressions():
    def f(x):
        return lax.fori_loop(1, x.shape[0] - 1, lambda i, c: c * 0.5 + x[i], 0.0)

    check_oracle(f, [(_vec(n),) for n in (3, 1, 6, 2)], [(6,)])


def test_fori_loop_to_size_inside_jitted_helper():
    @jax.jit
    def accumulate(x, n):
        return lax.fori_loop(0, n, lambda i, c: c + x[i] ** 2, 0.0)

    def f(x):
        return accumulate(x, x.shape[0])

    # The exact-shape reference passes a traced n (a while loop): no reverse mode there.
    check_oracle(f, [(_vec(n),) for n in (3, 1, 6)], [(6,)], modes=("eager", "jit", "vmap"))
    # Masked, the bound is known to be a size: a scan, so grad works.
    x = _vec(4)
    g = jax.grad(lambda d: pm.mask(f)(pm.Masked(d, (jnp.int32(4),))).data)(
        jnp.asarray(garbage_pad(x, (6,))))
    np.testing.assert_allclose(g, np.concatenate([2 * x, np.zeros(2, np.float32)]), rtol=1e-6)


def test_fori_loop_over_size_with_dynamic_carry():
    def f(x):
        def body(i, c):
            return c + jnp.roll(c, 1) * 0.1 + i

        return lax.fori_loop(0, x.shape[0], body, x * 1.0)

    check_oracle(f, [(_vec(n),) for n in (3, 1, 5)], [(5,)], modes=("eager", "jit", "vmap"))


def test_while_loop_data_dependent_with_dynamic_carry():
    def f(x):
        def cond(c):
            return (jnp.sum(c[0]) < 50.0) & (c[1] < 10)

        def body(c):
            return c[0] * 2.0 + 1.0, c[1] + 1

        return lax.while_loop(cond, body, (jnp.abs(x), 0))

    check_oracle(f, [(_vec(n, 0.1, 1.0),) for n in (3, 1, 6, 0)], [(6,)],
                 modes=("eager", "jit", "vmap"))


def test_while_loop_trip_count_from_size():
    def f(x):
        def cond(c):
            return c[0] < x.shape[0] * 2

        def body(c):
            return c[0] + 1, c[1] + jnp.sum(x) * 0.5

        return lax.while_loop(cond, body, (0, 0.0))[1]

    check_oracle(f, [(_vec(n),) for n in (3, 1, 6, 0)], [(6,)], modes=("eager", "jit", "vmap"))


def test_vmap_of_a_while_loop_inside_the_function_loops_per_row():
    # jax.vmap of a while_loop: the primitive takes one predicate per row (it
    # loops while any holds); padding rows never hold, even on inf or NaN
    def halvings(v):
        return lax.while_loop(lambda c: jnp.abs(c[1]) > 1, lambda c: (c[0] + 1, c[1] / 2),
                              (0, v))[0]

    def per_column(x):  # the rows are the static axis, the loop's data the dynamic one
        return jax.vmap(lambda col: lax.while_loop(
            lambda c: c[1] > 1, lambda c: (c[0] + 1, c[1] / 2),
            (0, jnp.sum(jnp.abs(col))))[0], in_axes=1)(x)

    def per_row_trips(k, x):  # fori_loop bounds that differ per row
        return jax.vmap(lambda kk, v: lax.fori_loop(0, kk, lambda i, c: c * 0.5 + i, v))(k, x)

    vec = np.float32([5.0, -9.0, 0.5, 100.0, 0.0, 3.0])
    check_oracle(jax.vmap(halvings), [(vec[:n],) for n in (4, 1, 6, 0)], [(8,)],
                 modes=("eager", "jit", "vmap"))
    mat = np.abs(np.arange(18, dtype=np.float32).reshape(6, 3) - 7.0)
    check_oracle(per_column, [(mat[:n],) for n in (4, 1, 6, 0)], [(8, 3)],
                 modes=("eager", "jit", "vmap"))
    trips = np.int32([3, 0, 5, 1, 2, 4])
    check_oracle(per_row_trips, [(trips[:n], vec[:n]) for n in (4, 1, 6, 0)], [(8,), (8,)], ("n", "n"),
                 modes=("eager", "jit", "vmap"))
    # garbage that would loop forever (inf halves to inf) in the padding rows
    out = pm.mask(jax.vmap(halvings), "n")(
        pm.Masked(jnp.float32([5.0, 3.0, jnp.inf, jnp.nan]), (2,)))
    np.testing.assert_array_equal(out.unpad(), [3, 2])


# ----------------------------------------------------------------------------
# cond / switch
# ----------------------------------------------------------------------------
def test_cond_on_values_with_dynamic_operands():
    def f(x):
        return lax.cond(jnp.sum(x) > 0, lambda x: jnp.cumsum(x), lambda x: x * 2 - jnp.max(x), x)

    exs = [(np.array([1.0, 2, -0.5], np.float32),), (np.array([-1.0, -2], np.float32),),
           (np.array([3.0], np.float32),), (np.array([-3.0, 1, 1, -4], np.float32),)]
    check_oracle(f, exs, [(5,)])


def test_switch_on_a_size():
    def f(x):
        k = jnp.asarray(x.shape[0]) % 3
        return lax.switch(k, [lambda x: jnp.sum(x), lambda x: jnp.max(x), lambda x: jnp.mean(x)],
                          x)

    check_oracle(f, [(_vec(n),) for n in (3, 1, 5, 2)], [(6,)])


def test_cond_predicate_from_size_under_vmap():
    def f(x):
        return lax.cond(jnp.asarray(x.shape[0]) > 2, lambda x: jnp.sum(x ** 2),
                        lambda x: jnp.sum(x), x)

    check_oracle(f, [(_vec(n),) for n in (3, 1, 5, 2)], [(6,)])


# ----------------------------------------------------------------------------
# Python `if` on a size
# ----------------------------------------------------------------------------
def test_python_if_on_size_is_a_case_split():
    def f(x):
        if x.shape[0] > 2:  # the comparison the case tree must name
            return x * 2
        return x

    check_oracle(f, [(_vec(n),) for n in range(6)], [(5,)])
    tree, _ = pm.mask(f, "n").cases(pm.Masked(jnp.ones(5), (3,)))
    text = tree.summary()
    line = f.__code__.co_firstlineno + 1
    assert len(tree.cases) == 2 and f"test_control_flow.py:{line}" in text
    assert "n in {0..2}" in text and "n in {3..5}" in text


def test_python_if_on_size_with_constraint_traces():
    def f(x):
        if x.shape[0] >= 2:
            return x[1:] * 2
        return x

    m = pm.mask(f, "n", constraints=["n >= 2"])
    out = m(pm.Masked(jnp.arange(5.0), (3,)))
    np.testing.assert_array_equal(out.unpad(), [2.0, 4.0])


_LOOP_PAST_THE_END = """
import jax, jax.numpy as jnp, numpy as np, polymask as pm
from jax import lax

def f(xs):
    def step(c, x):
        # counts an even x down to 0 by 2: never ends from an odd x (the padding holds -1)
        k = lax.while_loop(lambda k: k != 0, lambda k: k - 2, x)
        return c + k + x, None
    return lax.scan(step, jnp.int32(0), xs)[0]

data = jnp.array([4, 2, 6, -1, -1], jnp.int32)
m = pm.mask(f, "n")
for n in (0, 1, 3):
    assert int(m(pm.Masked(data, (n,))).data) == int(f(data[:n])), n
    assert int(jax.jit(m)(pm.Masked(data, (jnp.int32(n),))).data) == int(f(data[:n])), n
out = jax.vmap(m)(pm.Masked(jnp.stack([data] * 3), (jnp.array([0, 1, 3]),)))
assert out.data.tolist() == [0, 4, 12], out.data
print("ok")
"""


def test_while_loop_in_a_scan_step_past_the_end_runs_no_iteration():
    """A scan step past the logical end is discarded: a while loop inside runs no
    iteration there (its carry is not data plain JAX loops on; optax's
    hungarian_algorithm never ended on a padded cost matrix)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", _LOOP_PAST_THE_END], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("bound, batch", [(6, 2), (6, 3), (9, 3)])
def test_lax_map_in_batches_at_every_size_with_sizes_known_to_the_trace(bound, batch):
    # lax.map(..., batch_size=k) concatenates a scan's n // k * k rows and the
    # remainder's: at sizes known to the trace (Python ints under the caller's
    # jit) both are static and sum to n, below the bound (an internal error)
    def f(x):
        return lax.map(lambda r: r * 2.0 + 1.0, x, batch_size=batch)

    mf = pm.mask(f, "n")
    x = np.arange(bound, dtype=np.float32) - 2.0
    for n in range(bound + 1):
        want = f(jnp.asarray(x[:n]))
        for run in (lambda d, n=n: mf(pm.Masked(d, (n,))),
                    jax.jit(lambda d, n=n: mf(pm.Masked(d, (n,))))):
            np.testing.assert_array_equal(run(jnp.asarray(x)).unpad(), want)
