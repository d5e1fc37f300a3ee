"""The packed layout on sizes ``n + c`` along the ragged axis.

Slices and shifts (``x[1:]``, ``jnp.diff``), ``pad``, ``concatenate``,
convolutions and pooling windows along the packed axis, and ``top_k``: no
value crosses from one example into another, rows leave a gap after each
example when a size grows or a window reaches past an example's end.

Oracle: each example's outputs equal the function on that exact example
(plain JAX), at sizes 0, 1, mid and the row size (a row holding one example
of exactly ``R`` and its gap), with an example longer than the row (it runs
in the padded layout); sizes where ``jnp`` clamps differently (``x[1:]`` at
``n = 0``) run padded; gradients of a loss over every family equal the
per-example gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import polymask as pm

R = 16
SIZES = [5, 0, 1, 16, 3, 9, 2, 7, 4, 11, 6, 20]  # 16: one example of exactly R; 20: padded
# the example of 20 runs padded by design here (test_packed tests the warning)
pytestmark = pytest.mark.filterwarnings("ignore::polymask.PackedLayoutWarning")


def _examples(sizes, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n, d)).astype(np.float32) for n in sizes]


def _check(fun, examples, *broadcast, specs=("n, 4",), min_packed=None):
    rm = pm.ragged_map(fun, specs, layout="packed", row_size=R)
    outs = rm(examples, *broadcast)
    for ex, out in zip(examples, outs):
        want = fun(*broadcast, ex)
        for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(want)):
            assert np.shape(a) == np.shape(b)
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
            assert np.asarray(a).dtype == jnp.asarray(b).dtype
    s = rm.stats()
    fits = sum(len(x) <= R for x in examples)
    assert s["layout"]["packed"] >= (fits - 2 if min_packed is None else min_packed)
    assert s["packed"]["compiles"] == 1
    return rm


def test_slices_and_shifts_keep_the_packed_axis():
    def f(x):
        return (x[1:], x[:-1] * 2, jnp.diff(x, axis=0), x[2:-1], jnp.sum(jnp.diff(x, axis=0), 0),
                lax.slice_in_dim(x, 1, x.shape[0] - 1, axis=0),
                lax.dynamic_slice_in_dim(x, 1, x.shape[0] - 1, axis=0))

    rm = _check(f, _examples([n for n in SIZES if n >= 2]))
    assert rm._packed.program.gap == 0  # nothing grows: rows as before


def test_sorting_a_value_of_size_n_minus_c_sorts_each_example():
    def f(x):  # dead positions of x[1:] sort after the example, not into the next one
        return (jnp.sort(x[1:], 0), jnp.argsort(jnp.diff(x, axis=0), 0), jnp.median(x[:-1], 0),
                jnp.sort(jnp.pad(x, ((1, 0), (0, 0))), 0))

    _check(f, _examples([n for n in SIZES if n >= 2]))


def test_sizes_where_jnp_clamps_differently_run_padded():
    """``x[1:]`` stages ``max(0, n - 1)``: n + c with c = -1 except at n = 0,
    which runs in the padded layout and gives plain JAX's empty result."""
    rm = _check(lambda x: x[1:] + 1, _examples(SIZES), min_packed=len(SIZES) - 2)
    assert rm.stats()["layout"]["packed"] == len(SIZES) - 2  # not n = 0, not the long one
    assert 0 in pm.ragged_map(lambda x: x[1:], ("n, 4",)).explain(
        np.ones((5, 4), np.float32), print_output=False).padded_sizes


def test_pad_grows_each_example_inside_its_gap():
    def f(x):
        return (jnp.pad(x, ((2, 1), (0, 0))), jnp.pad(x, ((0, 3), (1, 0)), constant_values=7.0),
                lax.pad(x, -1.0, ((-1, 2, 0), (0, 0, 0))), jnp.cumsum(jnp.pad(x, ((1, 1), (0, 0))), 0))

    rm = _check(f, _examples([n for n in SIZES if n >= 1]))
    assert rm._packed.program.gap == 3
    assert "followed by 3 free positions" in rm.explain(np.ones((5, 4), np.float32),
                                                        print_output=False)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_concatenate_along_the_packed_axis():
    cls = np.arange(8, dtype=np.float32).reshape(2, 4)

    def f(cls, x):  # a [CLS] row, a rotation, a per-example summary appended
        return (jnp.concatenate([cls, x], 0), jnp.roll(x, 2, axis=0), jnp.roll(x, -1, axis=0),
                jnp.concatenate([x[1:], jnp.mean(x, 0, keepdims=True), x[:1] * 3], 0))

    rm = _check(f, _examples([n for n in SIZES if n >= 1]), cls)
    assert rm._packed.program.gap == 2


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_convolutions_along_the_packed_axis_read_only_their_example():
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(3, 4, 3)), jnp.float32)  # (out, in, width)
    k = jnp.asarray([1.0, -2.0, 0.5], jnp.float32)

    def conv(x, padding, dilation=1):
        return lax.conv_general_dilated(x.T[None], w, (1,), [padding], rhs_dilation=(dilation,),
                                        dimension_numbers=("NCH", "OIH", "NCH"))[0].T

    def f(x):
        return (conv(x, (1, 1)), conv(x, (2, 0)), conv(x, (0, 0)), conv(x, (2, 2), 2),
                jnp.convolve(x[:, 0], k, mode="same"), jnp.convolve(x[:, 1], k, mode="full"))

    rm = _check(f, _examples([n for n in SIZES if n >= 1]))
    assert rm._packed.program.gap == 4  # jnp.convolve(mode="full") pads its input to n + 4
    # plain JAX raises at n = 0 (jnp.convolve of an empty input): so does ragged_map
    with pytest.raises(pm.ShapeError, match=r"examples\[1\]"):
        pm.ragged_map(f, ("n, 4",), layout="packed", row_size=R)(_examples([3, 0]))


def test_pooling_windows_along_the_packed_axis():
    def f(x):
        mx = lax.reduce_window(x, -jnp.inf, lax.max, (3, 1), (1, 1), ((1, 1), (0, 0)))
        mn = lax.reduce_window(x, jnp.inf, lax.min, (2, 2), (1, 1), ((0, 1), (0, 1)))
        sm = lax.reduce_window(x, 0.0, lax.add, (2, 1), (1, 1), "VALID")
        # a window of the whole example (flax's max_pool(x, (num_points, 1)), PointNet)
        glob = lax.reduce_window(x, -jnp.inf, lax.max, (x.shape[0], 1), (1, 1), "VALID")
        return mx, mn, sm, jnp.mean(jnp.exp(mx - jnp.max(mx)), 0), glob

    _check(f, _examples([n for n in SIZES if n >= 2]))


def test_top_k_along_the_packed_axis_is_per_example():
    ex = _examples([n for n in SIZES if n >= 3])
    for x in ex:
        x[::2, 1] = 1.0  # ties: the lower index first, as lax.top_k
    ex[2][1, 0] = np.nan

    ex[3][:3, 3] = [-0.0, 0.0, -0.0]  # XLA's TopK ranks +0.0 above -0.0
    ex[3][3:, 3] = -1.0

    def f(x):
        v, i = lax.top_k(x.T, 3)
        return v, i, lax.top_k(-x[:, 2], 1), lax.top_k(x[1:].T, 2)

    _check(f, ex)
    rm = pm.ragged_map(f, ("n, 4",), layout="padded", row_size=R)
    for x, out in zip(ex[3:4], rm(ex[3:4])):
        np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(f(x)[1]))
    # k larger than an example: plain JAX raises, so does ragged_map
    with pytest.raises(pm.ShapeError, match=r"examples\[1\]"):
        pm.ragged_map(f, ("n, 4",), layout="packed", row_size=R)(_examples([4, 2]))


def test_a_nan_stays_in_its_example_through_shifts_and_windows():
    k = jnp.asarray([1.0, 1.0, 1.0], jnp.float32)

    def f(x):
        y = jnp.pad(x, ((1, 1), (0, 0)))
        return jnp.convolve(y[:, 0], k, mode="same"), jnp.diff(y, axis=0)

    ex = _examples([4, 5, 3])
    ex[1][0, 0] = ex[1][-1, 0] = np.nan  # both ends: the windows of the neighbours
    outs = pm.ragged_map(f, ("n, 4",), layout="packed", row_size=R)(ex)
    for x, out in zip(ex, outs):
        for a, b in zip(out, f(x)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
    for i in (0, 2):
        assert all(np.all(np.isfinite(np.asarray(o))) for o in outs[i])


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_gradients_through_sizes_n_plus_c_equal_per_example_gradients():
    rng = np.random.default_rng(6)
    params = {"W": jnp.asarray(rng.normal(size=(4, 4)) * 0.5, jnp.float32),
              "w": jnp.asarray(rng.normal(size=(2, 4, 3)) * 0.5, jnp.float32),
              "cls": jnp.asarray(rng.normal(size=(1, 4)), jnp.float32)}

    def loss(p, x):
        h = jnp.tanh(x @ p["W"])
        h = jnp.concatenate([p["cls"], h], 0)  # n + 1
        c = lax.conv_general_dilated(h.T[None], p["w"], (1,), [(2, 0)],
                                     dimension_numbers=("NCH", "OIH", "NCH"))[0].T  # causal
        d = jnp.diff(jnp.pad(c, ((1, 1), (0, 0))), axis=0)  # n + 2
        pool = lax.reduce_window(d, -jnp.inf, lax.max, (2, 1), (1, 1), "VALID")  # n + 1
        top, _ = lax.top_k(pool.T, 2)
        return jnp.sum(top ** 2) + jnp.mean(jnp.tanh(d)) + jnp.sum(c[1:] * c[:-1])

    xs = _examples([3, 1, 16, 7, 9, 2, 5])
    vg = pm.value_and_grad(loss, (None, "n, 4"), layout="packed", row_size=R)
    got_loss, got = vg(params, xs)
    want_loss, want = jax.value_and_grad(lambda p: sum(loss(p, x) for x in xs) / len(xs))(params)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
