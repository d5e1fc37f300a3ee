"""ACCEPTANCE.md cases 1, 2, 3, 4, 6, 10, 12, 13 and their case-15 gradient parts."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import attention
from jax import lax

import polymask as pm
from polymask.testing import check_oracle, garbage_pad

PAD5 = jnp.array([3.0, 1, 4, 1, 5])


def test_case1_sum():
    f = pm.mask(jnp.sum, "n")
    assert float(f(pm.Masked(PAD5, (3,))).data) == 8
    assert float(f(pm.Masked(PAD5, (jnp.int32(4),))).data) == 9
    traces = []

    def g(m):
        traces.append(1)
        return f(m)

    jg = jax.jit(g)
    assert [float(jg(pm.Masked(PAD5, (jnp.int32(n),))).data) for n in (3, 4)] == [8, 9]
    assert len(traces) == 1
    check_oracle(jnp.sum, [(np.array([3.0, 1, 4]),), (np.array([3.0, 1, 4, 1]),),
                           (np.zeros(0, np.float32),), (np.arange(5.0),)], [(5,)])


def test_case2_ragged_sum():
    f = pm.mask(jnp.sum, "n")
    out = jax.vmap(f)(pm.Masked(jnp.ones((5, 10)), (jnp.arange(5),)))
    np.testing.assert_array_equal(out.data, [0, 1, 2, 3, 4])


def running_sum(x):
    return lax.scan(lambda c, v: (c + v, None), 0.0, x)[0]


def test_case3_scan():
    traces = []

    def f(x):
        traces.append(1)
        return running_sum(x)

    m = jax.jit(pm.mask(f, "n"))
    x = jnp.array([5.0, 2, 9, 1, 4])
    got = [float(m(pm.Masked(x, (jnp.int32(n),))).data) for n in (3, 4, 1)]
    assert got == [16, 17, 5]
    assert len(traces) == 1


def test_case4_ragged_rnn_gradient():
    rng = np.random.default_rng(0)
    W = jnp.asarray(rng.normal(size=(3, 3)) * 0.5, jnp.float32)
    lengths = [2, 5, 4]
    seqs = rng.normal(size=(3, 10, 3)).astype(np.float32)
    targets = jnp.asarray(rng.normal(size=(3, 3)), jnp.float32)

    def rnn_loss(W, xs, y):
        def step(h, x):
            return jnp.tanh(W @ h + W @ x), None

        h, _ = lax.scan(step, jnp.zeros(3), xs)
        return jnp.sum((h - y) ** 2)

    padded = np.where(np.arange(10)[None, :, None] < np.array(lengths)[:, None, None], seqs,
                      np.nan).astype(np.float32)
    m = pm.mask(rnn_loss, (None, "n, 3", None))

    def total(W):
        out = jax.vmap(lambda x, n, y: m(W, pm.Masked(x, (n, 3)), y))(
            jnp.asarray(padded), jnp.asarray(lengths, jnp.int32), targets)
        return jnp.sum(out.data)

    g = jax.grad(total)(W)
    ref = sum(jax.grad(rnn_loss)(W, jnp.asarray(seqs[i, :n]), targets[i])
              for i, n in enumerate(lengths))
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6)


def test_case6_mean_by_logical_length():
    f = pm.mask(lambda x: jnp.sum(x) / x.shape[0], "n")
    np.testing.assert_allclose(f(pm.Masked(PAD5, (3,))).data, 8 / 3, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(pm.Masked(PAD5, (jnp.int32(3),))).data, 8 / 3,
                               rtol=1e-6)
    x = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    check_oracle(lambda x: jnp.mean(x, 0), [(x,), (x[:2, :1],), (x[:1],)], [(5, 6)])
    check_oracle(lambda x: jnp.sum(x) / x.shape[0],
                 [(np.array([3.0, 1, 4], np.float32),), (np.array([2.0], np.float32),)], [(5,)])


def test_case10_sort_and_cumsum():
    x = jnp.array([5.0, 2, 9, 1, 4])
    m = pm.Masked(jnp.asarray(garbage_pad(np.array([5.0, 2, 9]), (5,))), (3,))
    np.testing.assert_array_equal(pm.mask(jnp.sort)(m).unpad(), [2, 5, 9])
    np.testing.assert_array_equal(pm.mask(jnp.cumsum)(m).unpad(), [5, 7, 16])
    exs = [(np.asarray(x[:n]),) for n in (3, 1, 5, 0)]
    check_oracle(jnp.sort, exs, [(5,)])
    check_oracle(jnp.cumsum, exs, [(5,)])


def test_case10_reverse_cumsum():
    m = pm.Masked(jnp.asarray(garbage_pad(np.array([5.0, 2, 9]), (5,))), (3,))
    f = pm.mask(lambda x: jnp.cumsum(x[::-1])[::-1])
    np.testing.assert_array_equal(f(m).unpad(), [16, 11, 9])


def test_case12_contraction_over_ragged_axis():
    f = pm.mask(lambda a, b: a @ b, ("7, n", "n, 7"))
    sizes = jnp.array([3, 1, 4], jnp.int32)
    a = jnp.full((3, 7, 6), jnp.nan).at[:, :, :].set(
        jnp.where(jnp.arange(6)[None, None, :] < sizes[:, None, None], 1.0, jnp.nan))
    b = jnp.swapaxes(a, 1, 2)
    out = jax.vmap(lambda a, b, n: f(pm.Masked(a, (7, n)), pm.Masked(b, (n, 7))))(a, b, sizes)
    for i, n in enumerate([3, 1, 4]):
        np.testing.assert_array_equal(out.data[i], np.full((7, 7), n))
    exs = [(np.ones((7, n), np.float32), np.ones((n, 7), np.float32)) for n in (3, 1, 4, 0)]
    check_oracle(lambda a, b: a @ b, exs, [(7, 6), (6, 7)], ("7, n", "n, 7"))



def test_case13_causal_attention():
    rng = np.random.default_rng(1)
    ws = [rng.normal(size=(64, 64)).astype(np.float32) * 0.1 for _ in range(4)]
    exs = [(rng.normal(size=(n, 64)).astype(np.float32), *ws) for n in (1, 5, 17)]
    check_oracle(attention, exs, [(32, 64), None, None, None, None],
                 ("n, 64", None, None, None, None), rtol=2e-5, atol=2e-5)
