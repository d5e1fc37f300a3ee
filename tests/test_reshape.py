"""Reshapes in every form (prefix-preserving and fragmenting) and splits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import oracle
from hypothesis import given, settings
from hypothesis import strategies as st

import polymask as pm
from polymask.testing import check_oracle, garbage_pad

RNG = np.random.default_rng(0)


def _arr(*shape):
    return RNG.normal(size=shape).astype(np.float32)


def test_case11_fragmenting_reshape():
    x = jnp.arange(12.0).reshape(3, 4)
    f = pm.mask(lambda x: x.reshape(-1))
    np.testing.assert_array_equal(f(pm.Masked(x, (2, 3))).unpad(), [0, 1, 2, 4, 5, 6])
    traces = []

    def g(m):
        traces.append(1)
        return f(m)

    jg = jax.jit(g)
    out = jg(pm.Masked(x, (jnp.int32(2), jnp.int32(3))))
    np.testing.assert_array_equal(out.unpad(), [0, 1, 2, 4, 5, 6])
    out = jg(pm.Masked(x, (jnp.int32(3), jnp.int32(1))))
    np.testing.assert_array_equal(out.unpad(), [0, 4, 8])
    assert len(traces) == 1
    check_oracle(lambda x: x.reshape(-1), [(_arr(a, b),) for a, b in [(2, 3), (3, 4), (0, 2)]],
                 [(3, 4)])


def test_case14_view_with_products_of_sizes():
    def f(a):
        return a.reshape(a.shape[0] * a.shape[1], a.shape[2] * a.shape[3])

    exs = [(_arr(*s),) for s in [(2, 3, 1, 4), (3, 2, 2, 3), (1, 1, 1, 1), (0, 2, 1, 2)]]
    check_oracle(f, exs, [(3, 3, 2, 4)])


def test_merge_padded_static_pairs():
    # (2, n) -> (2n,): the padded axis is inner.
    check_oracle(lambda x: x.reshape(-1), [(_arr(2, n),) for n in (1, 3, 5, 0)], [(2, 5)],
                 "2, n")
    # (n, 3) -> (3n,): padded outer axis merged with static inner axes stays free.
    check_oracle(lambda x: x.reshape(-1), [(_arr(n, 3),) for n in (1, 4, 0)], [(4, 3)], "n, 3")


def test_split_axis_into_padded_inner_axis():
    # (n, 2*k) -> (n, k, 2) and (n, 2, k): splitting a dynamic axis.
    exs = [(_arr(n, 2 * k),) for n, k in [(2, 1), (3, 3), (1, 2)]]
    check_oracle(lambda x: x.reshape(x.shape[0], -1, 2), exs, [(3, 6)], "n, 2*k")
    check_oracle(lambda x: x.reshape(x.shape[0], 2, -1), exs, [(3, 6)], "n, 2*k")


def test_split_with_divisibility_in_spec():
    check_oracle(lambda x: x.reshape(-1, 2), [(_arr(s),) for s in (2, 4, 6, 0)], [(8,)], "2*k")


def test_split_with_divisibility_constraint():
    exs = [(_arr(s),) for s in (2, 4, 6, 0)]
    check_oracle(lambda x: x.reshape(x.shape[0] // 2, 2), exs, [(7,)], "n",
                 constraints=["mod(n, 2) == 0"])
    with pytest.raises(pm.ShapeError, match="constraint"):
        pm.mask(lambda x: x.reshape(x.shape[0] // 2, 2), "n",
                constraints=["mod(n, 2) == 0"])(pm.Masked(jnp.ones(7), (5,)))


def test_reshape_changing_element_count_is_an_error():
    f = pm.mask(lambda x: x.reshape(x.shape[0] // 2, 2), "n")
    np.testing.assert_array_equal(f(pm.Masked(jnp.arange(7.0), (4,))).unpad(), [[0, 1], [2, 3]])
    with pytest.raises(pm.ShapeError, match="number of logical elements"):
        f(pm.Masked(jnp.arange(7.0), (5,)))


def test_merge_two_dynamic_axes_then_split_back():
    def f(x):
        a, b = x.shape
        return (x.reshape(a * b) * 2).reshape(a, b)

    check_oracle(f, [(_arr(a, b),) for a, b in [(2, 3), (3, 1), (1, 4), (0, 2)]], [(3, 4)])


def test_reshape_int_and_bool():
    f = pm.mask(lambda x: x.reshape(-1))
    x = jnp.asarray(garbage_pad(np.arange(6, dtype=np.int32).reshape(2, 3), (3, 4)))
    np.testing.assert_array_equal(f(pm.Masked(x, (2, 3))).unpad(), np.arange(6))
    b = pm.Masked(x % 2 == 0, (jnp.int32(2), jnp.int32(3)))
    out = jax.jit(f)(b)
    np.testing.assert_array_equal(np.asarray(out.data)[:6], np.arange(6) % 2 == 0)


def test_attention_head_reshapes_stay_free():
    # (n, 64) -> (n, 4, 16) -> ... -> (n, 64) is prefix-preserving: no gather.
    f = pm.mask(lambda x: x.reshape(x.shape[0], 4, 16).reshape(x.shape[0], 64), "n, 64")
    text = str(jax.make_jaxpr(f)(pm.Masked(jnp.ones((8, 64)), (jnp.int32(5), 64))))
    assert "gather" not in text


_MERGE_OUTER = jax.jit(pm.mask(lambda x: x.reshape(x.shape[0] * x.shape[1], x.shape[2]),
                               "a, b, _"))
_FLATTEN = jax.jit(pm.mask(lambda x: x.reshape(-1), "a, b, _"))


@settings(max_examples=10, deadline=None)
@given(a=st.integers(0, 4), b=st.integers(0, 4), c=st.integers(1, 2),
       pa=st.integers(0, 1), pb=st.integers(0, 1))
def test_reshape_property(a, b, c, pa, pb):
    x = RNG.normal(size=(a, b, c)).astype(np.float32)
    bound = (a + pa + 1, b + pb + 1, c)
    m = pm.Masked(jnp.asarray(garbage_pad(x, bound)), (jnp.int32(a), jnp.int32(b), c))
    np.testing.assert_array_equal(_MERGE_OUTER(m).unpad(), x.reshape(a * b, c))
    np.testing.assert_array_equal(_FLATTEN(m).unpad(), x.reshape(-1))


# ----------------------------------------------------------------------------
# split
# ----------------------------------------------------------------------------
def test_split_even_sections():
    check_oracle(lambda x: jnp.split(x, 2), [(_arr(s),) for s in (2, 4, 6, 0)], [(8,)], "2*k")
    check_oracle(lambda x: jnp.split(x, 3, axis=1),
                 [(_arr(n, 3 * k),) for n, k in [(2, 1), (3, 2), (1, 0)]], [(3, 6)], "n, 3*k")


def test_split_size_derived_sections():
    def f(x):
        k = x.shape[0] // 3
        return jnp.split(x, [k, 2 * k])

    check_oracle(f, [(_arr(s),) for s in (2, 4, 7, 0)], [(8,)])


def test_split_static_sections_of_dynamic_axis():
    check_oracle(lambda x: jnp.split(x, [1, 3]), [(_arr(s),) for s in (3, 5, 4)], [(6,)],
                 constraints=["s0 >= 3"])


def test_split_static_axis_with_dynamic_other_axis():
    check_oracle(lambda x: jnp.split(x, 2, axis=1), [(_arr(n, 4),) for n in (1, 3, 0)],
                 [(4, 4)], "n, 4")


def test_chunks_by_size():
    # chunk-like: two halves of an even-length sequence, then recombine.
    def f(x):
        a, b = jnp.split(x, 2)
        return a * b

    check_oracle(f, [(_arr(s),) for s in (2, 6, 0)], [(8,)], "2*k")


def test_reshape_with_minus_one_and_a_zero_size_other_axis_raises_as_jax_does():
    # plain JAX computes size % prod(other sizes): ZeroDivisionError when they
    # multiply to 0; the symbolic quotient a*b // b cancelled to a and polymask
    # returned a value there
    h = lambda x: x.reshape(-1, x.shape[1]) * 2
    f = pm.jit(h, "a, b")
    np.testing.assert_array_equal(f(np.ones((3, 2), np.float32)), h(jnp.ones((3, 2))))
    np.testing.assert_array_equal(f(np.ones((0, 2), np.float32)), h(jnp.ones((0, 2))))
    for size in [(3, 0), (0, 0)]:
        with pytest.raises(ZeroDivisionError):
            h(jnp.ones(size))
        with pytest.raises(pm.ShapeError, match="ZeroDivisionError"):
            f(np.ones(size, np.float32))
    check_oracle(lambda x: x.reshape(-1), [(np.ones((3, 2), np.float32),),
                                           (np.ones((3, 0), np.float32),)], [(4, 4)], ("a, b",))


def _critic(x):
    """A value head written the common way: ``(x @ w).squeeze()`` is ``(n,)`` for
    n != 1 and ``()`` for n == 1 in plain JAX."""
    return jnp.tanh(x @ jnp.linspace(-1.0, 1.0, 4).reshape(4, 1)).squeeze()


def test_squeeze_without_axis_splits_on_each_size_being_one():
    """``x.squeeze()`` with a symbolic size was refused by JAX (the rank depends on
    which sizes are 1), so polymask traced it once per size and refused bounds
    past the per-size limit (every size of a bound of 64). Each size's ``== 1``
    now splits: one program for every size but n = 1, whose rank-0 output a
    padded rank-1 output cannot hold (mask raises there; plain JAX runs it)."""
    exs = [(_arr(n, 4),) for n in (0, 2, 5, 64)]
    oracle(_critic, exs, [(64, 4)], "n, 4", modes=("eager", "jit", "vmap", "grad"))
    masked = pm.mask(_critic, "n, 4")
    with pytest.raises(pm.ShapeError, match=r"n in \{1\}\) the function returns different "
                                            r"outputs: output 0 is float32\[rank 0\]"):
        masked(pm.pad(_arr(1, 4), (64, 4)))
    # a fixed axis of 1 is squeezed as in plain JAX, beside the symbolic one
    fixed = pm.mask(lambda x: x.squeeze() * 2.0, "n, 1")
    x = _arr(3, 1)
    np.testing.assert_allclose(fixed(pm.pad(x, (8, 1), fill=np.nan)).unpad(), x.squeeze() * 2.0)


def test_runners_run_only_the_sizes_whose_output_rank_differs_per_shape():
    """polymask.jit and ragged_map share one program for the sizes of the kept
    rank and run the others per exact shape (plain jax.jit), saying which sizes."""
    runner = pm.jit(_critic, "n, 4", tiered=False)
    with pytest.warns(pm.FallbackWarning, match=r"the sizes n in \{1\} \(of n <= 8\)"):
        for n in (3, 1, 0, 5, 8, 1):
            x = _arr(n, 4)
            got, want = runner(x), jax.jit(_critic)(x)
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-6)
    s = runner.stats()
    assert (s["compiles"], s["exact_compiles"]) == (1, 1)
    assert list(runner.fallbacks()) == ["n in {1} (of n <= 8)"]
    xs = [_arr(n, 4) for n in (5, 1, 0, 7, 1, 2)]
    with pytest.warns(pm.FallbackWarning, match=r"n in \{1\}"):
        outs = pm.ragged_map(_critic, "n, 4", layout="padded")(xs)
    for got, x in zip(outs, xs):
        assert got.shape == _critic(x).shape
        np.testing.assert_allclose(got, _critic(x), rtol=1e-6)


def test_a_size_whose_output_rank_differs_stays_per_shape_after_its_bucket_compiles():
    """Tiered (the default): the first n = 1 call ran in the covering bucket,
    took its error case to plain jax.jit, but was not marked: once its own
    bucket had compiled in the background, n = 1 ran in it and returned the
    other sizes' rank with size 0 (``[]`` for 2.0; helper C). Such sizes are
    per shape now, and their own bucket is not compiled for them."""
    f = lambda x: (x * 2.0).squeeze()
    runner = pm.jit(f, "n", tiered=True)
    with pytest.warns(pm.FallbackWarning, match=r"n in \{1\}"):
        assert runner(np.ones(1, np.float32)).shape == ()
    runner.wait()
    for n in (1, 3, 1, 5, 1):
        got = runner(np.ones(n, np.float32))
        runner.wait()
        assert got.shape == f(np.ones(n, np.float32)).shape
        np.testing.assert_array_equal(got, f(np.ones(n, np.float32)))
    # a per-size bucket's background compile is no failure: wait() returns
    mode = pm.jit(lambda x: jax.scipy.stats.mode(x), "n", tiered=True)
    with pytest.warns(pm.FallbackWarning):
        for n in (0, 3):
            np.testing.assert_array_equal(mode(np.ones(n, np.float32)).count,
                                          jax.scipy.stats.mode(np.ones(n, np.float32)).count)
        mode.wait()


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["s, s", "n, m"])
def test_a_flattened_board_meets_an_arange_of_its_size(spec):
    # pgx's Go: x.reshape(-1) beside jnp.arange(size ** 2). The arange's size is
    # max(0, n*m) to JAX, the flattened axis n*m: equal sizes, so both get the
    # one padded size (both bounded over the faces of the box of sizes)
    def board(x):
        idx = jnp.arange(x.shape[0] * x.shape[1])
        flat = x.reshape(-1)
        return flat + idx, jnp.where(flat > 0, idx, -1), jnp.arange(x.size) * flat

    sizes = [(0, 0), (1, 1), (2, 2), (3, 3), (6, 6)] + ([(2, 5), (6, 0)] if spec == "n, m" else [])
    check_oracle(board, [(_arr(a, b),) for a, b in sizes], [(6, 6)], in_specs=spec)
    run = pm.jit(board, spec, buckets=[6], tiered=False)
    for a, b in sizes:
        x = _arr(a, b)
        for got, want in zip(run(x), board(x)):
            np.testing.assert_allclose(got, want, rtol=1e-6)
    assert (run.stats()["compiles"], run.stats()["exact_compiles"]) == (1, 0)
