"""The packed layout's invariant (docs/packing.md, "The invariant"): a dead
entry of a value never influences a live entry of any output, forward or
backward, and a NaN or inf in one example never changes another example.

Oracle: plain JAX per example. For isolation, the stronger check: the other
examples' outputs are bitwise the same whether one example holds NaN/inf or
not (same compiled row program, same row placement).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import polymask as pm
from polymask.packing import PackedUnsupported

R = 16
SIZES = [3, 5, 2, 4, 1]  # one row of 15 positions: every example has neighbours


def _examples(sizes=SIZES, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n, d)).astype(np.float32) for n in sizes]


def _leaves(t):
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(t)]


def _heads(x):
    """Two heads of two features: (n, 2, 2)."""
    return x.reshape(x.shape[0], 2, 2)


def _mha_shared_values(x):  # the issue's first example: heads share the values x
    s = jnp.stack([x @ x.T, 2.0 * (x @ x.T)])
    return jnp.einsum("hnm,md->hnd", jax.nn.softmax(s, -1), x)


def _mha_values_summed_over_heads(x):
    h = _heads(x)
    p = jax.nn.softmax(jnp.einsum("nhd,mhd->hnm", h, h), -1)
    return jnp.einsum("hnm,mhd->nd", p, h)


def _dpa(x):  # ordinary multi-head: 2 heads of 2
    return jax.nn.dot_product_attention(_heads(x), _heads(x), _heads(x))


def _gqa_causal(x):  # grouped-query: 4 query heads share 2 key/value heads
    q = x.reshape(x.shape[0], 4, 1)
    kv = x[:, :2].reshape(x.shape[0], 2, 1)
    return jax.nn.dot_product_attention(q, kv, kv, is_causal=True)


def _causal(s):
    n = s.shape[-1]
    return jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]


def _causal_inf_attention(x):  # the mask written with -inf (GPT-style decoders)
    s = x @ x.T
    return jax.nn.softmax(jnp.where(_causal(s), s, -jnp.inf), -1) @ x


def _causal_heads(x):  # two heads of two, tril(...)[None] broadcast over them
    n = x.shape[0]
    q = x.reshape(n, 2, 2).transpose(1, 0, 2)
    s = jnp.einsum("hnd,hmd->hnm", q, q)
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool))[None], s, -jnp.inf)
    return jnp.einsum("hnm,hmd->nhd", jax.nn.softmax(s, -1), q).reshape(n, 4)


def _inf_masked_max_alone(x):  # a masked max no sum follows: it reports a NaN itself
    s = x @ x.T
    return jnp.max(jnp.where(_causal(s), s, -jnp.inf), -1)


def _max_beside_an_unread_sum(x):
    """The softmax's sum (the max's witness) is computed but never reaches a
    result: the max's report is made on the sum's own check."""
    s = x @ x.T
    m = jnp.max(s, -1, keepdims=True)
    _unread = jnp.sum(jnp.exp(s - m), -1)
    return m[:, 0] * 2.0


def _max_then_a_sum_in_a_loop(x):
    """A max read again inside a loop body (another trace): its NaN check is
    made at the row's trace, after the body (``RarePaths.deferred``); made
    inside, its flag escaped the body (UnexpectedTracerError)."""
    s = x @ x.T
    m = jnp.max(s, -1, keepdims=True)
    z = lax.fori_loop(0, 2, lambda i, a: a + jnp.sum(jnp.exp(s - m), -1),
                      jnp.zeros(x.shape[0], x.dtype))
    return m[:, 0], z


# One function per packed rule family (packing/rules/*.py), each mixing
# positions of its example in the way that family does.
FAMILIES = {
    "elementwise": lambda x: jnp.log(jnp.abs(x)) * jnp.sqrt(jnp.abs(x) + 1),
    "reductions": lambda x: (jax.nn.softmax(x, axis=0), jnp.mean(x, 0), jnp.max(x, 0),
                             jnp.argmax(x[:, 0])),
    "cumulative": lambda x: (jnp.cumsum(x, 0), lax.cummax(x, axis=0),
                             jnp.cumprod(x[::-1], 0)[::-1]),
    "contractions": lambda x: (x @ x.T @ x, x.T @ x, jax.nn.softmax(x @ x.T, -1) @ x),
    "multi-head attention": _mha_shared_values,
    "heads summed": _mha_values_summed_over_heads,
    "dot_product_attention": _dpa,
    "grouped-query causal": _gqa_causal,
    "causal attention masked with -inf": _causal_inf_attention,
    "a -inf-masked max, no sum": _inf_masked_max_alone,
    "a max beside an unread sum": _max_beside_an_unread_sum,
    "a max read in a loop body": _max_then_a_sum_in_a_loop,
    "indexing": lambda x: (x[0], x[-1], x[1:] - x[:-1], jnp.take(x, jnp.array([0, 2]), 0,
                                                                 mode="clip")),
    "windows": lambda x: (jnp.pad(x, ((1, 2), (0, 0))), jnp.roll(x, 1, 0),
                          jnp.concatenate([jnp.ones((1, 4)), x]),
                          lax.reduce_window(x, 0.0, lax.add, (2, 1), (1, 1), "SAME")),
    "conv": lambda x: lax.conv_general_dilated(
        x.T[None], jnp.ones((4, 4, 3), x.dtype), (1,), "SAME")[0].T,
    "sorting": lambda x: (jnp.sort(x, 0), jnp.argsort(x[:, 1]),
                          lax.top_k(x[:, 0], 1)[0]),
    "control flow": lambda x: (
        lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(4), x)[1],
        lax.cond(jnp.sum(x) > 0, lambda v: v * 2, lambda v: -v, x),
        lax.fori_loop(0, 3, lambda i, v: jnp.tanh(v) + v, x)),
    "calls": lambda x: jax.jit(lambda v: jax.nn.relu(v) @ v.T)(x),
    "layout": lambda x: (x.reshape(x.shape[0], 2, 2).sum(-1), jnp.tile(jnp.sum(x, 0),
                                                                          (x.shape[0], 1)),
                         x[::-1], jnp.arange(x.shape[0]) * 1.0),
}


# bfloat16: the row program's own products and sums round differently from one
# example's (tolerance of bfloat16's 8-bit mantissa); isolation stays bitwise
TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_nan_or_inf_in_one_example_never_changes_another(family, dtype):
    fun = FAMILIES[family]
    tol = TOLERANCE[dtype]
    clean = [a.astype(dtype) for a in _examples()]
    dirty = [a.copy() for a in clean]
    dirty[1][2, 1] = np.nan  # an example in the middle of the row
    dirty[3][0, 0] = np.inf
    rm = pm.ragged_map(fun, ("n, 4",), layout="packed", row_size=R)
    got_clean = rm(clean)
    assert rm.stats()["packed"]["compiles"] == 1  # finite data: the speculative program only
    got_dirty = rm(dirty)
    packed = rm.stats()["packed"]
    # a NaN or inf before a block-diagonal product is a rule's rare path: that
    # call reran in the exact row program, compiled then (and only then)
    rare = family in ("contractions", "multi-head attention", "heads summed",
                      "dot_product_attention", "grouped-query causal",
                      "causal attention masked with -inf", "a -inf-masked max, no sum",
                      "a max beside an unread sum", "a max read in a loop body")
    assert packed["exact_reruns"] == int(rare), packed
    assert packed["compiles"] == 1 + int(rare), packed
    for i, (ex, a, b) in enumerate(zip(clean, got_clean, got_dirty)):
        for u, w in zip(_leaves(a), _leaves(fun(jnp.asarray(ex)))):  # a row's vs one's
            assert u.dtype == w.dtype, f"example {i}: {u.dtype} vs plain {w.dtype}"
            _assert_close(u, w, tol, f"example {i}")
        if i in (1, 3):  # the corrupted examples: plain JAX's values, NaN and inf kinds too
            with np.errstate(invalid="ignore"):
                plain = _leaves(fun(jnp.asarray(dirty[i])))
            for u, w in zip(_leaves(b), plain):
                _assert_same_nonfinite(u, w, f"example {i} ({family})", tol)
            continue
        for u, w in zip(_leaves(b), _leaves(a)):  # bitwise: the neighbour changed nothing
            np.testing.assert_array_equal(u, w, err_msg=f"example {i} ({family})")


def _is_float(a) -> bool:
    return "float" in str(a.dtype)  # ml_dtypes' bfloat16 is not np.inexact


def _assert_close(got, want, tol, msg):
    got, want = np.asarray(got), np.asarray(want)
    if not _is_float(want):
        np.testing.assert_array_equal(got, want, err_msg=msg)
        return
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                               rtol=tol, atol=tol, err_msg=msg)


def _assert_same_nonfinite(got, want, msg, tol=2e-5):
    """Plain JAX's values: NaN where it has NaN, the same infinities, close elsewhere."""
    got, want = np.asarray(got), np.asarray(want)
    if not _is_float(want):
        np.testing.assert_array_equal(got, want, err_msg=msg)
        return
    got, want = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=msg)
    np.testing.assert_array_equal(np.isinf(got) * np.sign(got), np.isinf(want) * np.sign(want),
                                  err_msg=msg)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=tol, atol=tol, err_msg=msg)


def _causal_attention_then_tanh(x):  # causal zeros and sign of the weights matter for inf
    n = x.shape[0]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), x @ x.T, -jnp.inf)
    return jnp.tanh(jax.nn.softmax(s, -1) @ (x - 0.5))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fun", [_causal_attention_then_tanh, _gqa_causal, _mha_shared_values])
def test_the_example_holding_nan_or_inf_gets_plain_jaxs_kinds_after_attention(fun, value):
    """The contraction adds an example's own non-finite terms back with the
    weights' signs and zeros applied (``0 * inf`` is NaN inside its block), so
    a later ``tanh`` maps them as plain JAX does (an unweighted ``+inf`` gave
    ``tanh = 1`` where plain JAX has NaN)."""
    ex = _examples()
    ex[1][2, 1] = value
    got = pm.ragged_map(fun, ("n, 4",), layout="packed", row_size=R)(ex)
    for i, (x, g) in enumerate(zip(ex, got)):
        with np.errstate(invalid="ignore"):
            _assert_same_nonfinite(g, fun(x), f"example {i}")


def test_the_issues_multi_head_example_gives_plain_values():
    a = np.full((3, 4), 0.5, np.float32)
    b = np.full((2, 4), 0.5, np.float32)
    b[0, 0] = np.nan
    out = pm.ragged_map(_mha_shared_values, ("n, 4",), layout="packed", row_size=16)([a, b])
    np.testing.assert_allclose(out[0], _mha_shared_values(a), rtol=1e-6)
    assert np.isfinite(out[0]).all()
    np.testing.assert_array_equal(np.isnan(out[1]), np.isnan(_mha_shared_values(b)))


# Losses on sizes n - c followed by a function with a restricted domain: the
# dead entries of the n - c value must not turn the gradient into NaN.
LOSSES = {
    "sqrt of diff": lambda w, x: jnp.sum(jnp.sqrt(jnp.diff(x @ w) + 1)),
    "path length": lambda w, x: jnp.sum(jnp.linalg.norm(jnp.diff(x * w, axis=0), axis=-1)),
    "x[1:] then log": lambda w, x: jnp.sum(jnp.log(x[1:] @ w + 10.0)),
    "x[:-1] then 1/x": lambda w, x: jnp.sum(1.0 / (x[:-1] @ w + 10.0)),
    "valid convolve then sqrt": lambda w, x: jnp.sum(
        jnp.sqrt(jnp.convolve(x @ w, jnp.array([1.0, -1.0]), mode="valid") + 2.0)),
}

# A scan along the ragged axis runs its body at dead steps too (the row's
# tail, where x is 0): 0 is outside these bodies' domains.
SCAN_LOSSES = {
    "log inside a scan": lambda w, x: lax.scan(
        lambda c, xt: (c, jnp.log(xt @ w)), 0.0, x)[1].sum(),
    "sqrt of a scan's carry": lambda w, x: lax.scan(
        lambda c, xt: (c + xt @ w, jnp.sqrt(c + xt @ w)), 0.0, x)[1].sum(),
    "log of a reversed scan's carry": lambda w, x: lax.scan(
        lambda c, xt: (c + xt @ w, jnp.log(c + xt @ w)), 0.0, x, reverse=True)[1].sum(),
    "lax.map then 1/x": lambda w, x: lax.map(lambda xt: 1.0 / (xt @ w), x).sum(),
}


@pytest.mark.parametrize("name", list(SCAN_LOSSES))
def test_gradients_through_a_scan_along_the_ragged_axis_equal_plain(name):
    loss = SCAN_LOSSES[name]
    w = np.full((4,), 0.25, np.float32)
    xs = [a * a + 0.5 for a in _examples([3, 1, 5, 2])]  # positive: plain is finite
    vg = pm.value_and_grad(loss, ("n, 4",), layout="packed", reduce="sum", row_size=R)
    for batch in ([xs[0]], xs):
        val, grad = vg(w, batch)
        plain = [jax.value_and_grad(loss)(w, x) for x in batch]
        np.testing.assert_allclose(val, sum(v for v, _ in plain), rtol=1e-5)
        np.testing.assert_allclose(grad, sum(g for _, g in plain), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(LOSSES))
def test_gradients_after_shifts_and_restricted_domains_equal_plain(name):
    loss = LOSSES[name]
    w = np.full((4,), 0.25, np.float32)
    ramp = np.repeat(np.arange(6, dtype=np.float32)[:, None], 4, 1)  # rising: live diffs > 0
    # alone in its row (the row's tail follows), and rows of several examples
    batches = [[ramp], [ramp, ramp[:3] * 0.5, ramp[:2] + 3.0, ramp[:4] * 0.1]]
    vg = pm.value_and_grad(loss, ("n, 4",), layout="packed", reduce="sum", row_size=R)
    for batch in batches:
        val, grad = vg(w, batch)
        plain = [jax.value_and_grad(loss)(w, x) for x in batch]
        np.testing.assert_allclose(val, sum(v for v, _ in plain), rtol=1e-5)
        np.testing.assert_allclose(grad, sum(g for _, g in plain), rtol=1e-5, atol=1e-6)
        assert np.isfinite(np.asarray(grad)).all()


def test_a_window_of_the_examples_length_with_padding_is_a_packed_refusal():
    def causal(x):  # a causal prefix sum by a window as long as the example
        n = x.shape[0]
        return lax.reduce_window(x, 0.0, lax.add, (n, 1), (1, 1), [(n - 1, 0), (0, 0)])

    xs = _examples([3, 5, 1])
    with pytest.raises(PackedUnsupported, match=r"reduce_window_sum.*test_packed_invariant"):
        pm.ragged_map(causal, ("n, 4",), layout="packed", row_size=8)(xs)
    ex = pm.explain(causal, ("n, 4",), xs[0], layout="packed")
    assert "reduce_window_sum" in str(ex) and "cannot" in str(ex)
    outs = pm.ragged_map(causal, ("n, 4",), row_size=8)(xs)  # auto: padded, exact
    for x, o in zip(xs, outs):
        np.testing.assert_allclose(o, np.cumsum(x, 0), rtol=1e-5, atol=1e-6)


def test_a_case_per_size_refusal_names_the_function_line_and_a_fitting_hint():
    def f(x):
        return lax.scan(lambda c, _: (c + 1.0, c), 0.0, None, length=x.shape[0])[1]

    xs = _examples([3, 5, 1])
    with pytest.raises(PackedUnsupported) as e:
        pm.ragged_map(f, ("n, 4",), layout="packed", row_size=64)(xs)
    msg = str(e.value)
    assert "'scan'" in msg and "test_packed_invariant.py" in msg
    assert "lax.scan(step, init, x)" in msg
    for x, o in zip(xs, pm.ragged_map(f, ("n, 4",), row_size=64)(xs)):
        np.testing.assert_array_equal(o, np.arange(x.shape[0], dtype=np.float32))


def test_a_function_traced_only_per_size_is_a_packed_refusal_not_a_shape_error():
    def f(x):  # NumPy needs the size as an int: jax.jit traces per size
        return x * np.arange(x.shape[0])[:, None]

    xs = _examples([3, 5, 1])
    for R_ in (8, 64):
        with pytest.raises(PackedUnsupported, match="test_packed_invariant.py") as err:
            pm.ragged_map(f, ("n, 4",), layout="packed", row_size=R_)(xs)
    # the remedy that applies to the packed layout, not max_cases (which cannot help it)
    assert "layout='padded' or 'auto' runs this function" in str(err.value)
    assert "max_cases=32 traces" not in str(err.value)
    out = pm.ragged_map(f, ("n, 4",), layout="auto", row_size=64)(xs)
    for o, x in zip(out, xs):
        np.testing.assert_allclose(o, f(x))


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_an_empty_batch_is_a_zero_loss_with_zero_gradients(layout, reduce):
    w = {"a": np.ones((4,), np.float32), "b": np.float32(2.0)}
    vg = pm.value_and_grad(lambda p, x: jnp.sum(x @ p["a"]) * p["b"], ("n, 4",),
                           layout=layout, reduce=reduce)
    val, grad = vg(w, [])
    assert float(val) == 0.0
    np.testing.assert_array_equal(grad["a"], np.zeros(4, np.float32))
    assert float(grad["b"]) == 0.0
    out = pm.ragged_map(lambda x: x * 2, ("n, 4",), layout=layout)([])
    assert out == []


def test_top_k_orders_nan_by_sign_as_xla_in_both_layouts():
    # XLA's TopK: -NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN
    col = np.array([1.0, -np.nan, 2.0, 0.5, np.nan, -np.inf, -0.0, 0.0], np.float32)
    x = np.stack([col, col], 1)
    for k in (1, 3, 8):
        f = lambda x, k=k: lax.top_k(x[:, 0], k)  # noqa: E731
        want = [np.asarray(a) for a in f(x)]
        for layout in ("padded", "packed"):
            got = pm.ragged_map(f, ("n, 2",), layout=layout, row_size=16)([x, x[:k]])[0]
            np.testing.assert_array_equal(got[1], want[1], err_msg=f"{layout} k={k}")


def test_a_loss_that_does_not_depend_on_the_example_counts_once_per_example():
    def loss(w, x):  # the same value for every example
        return jnp.sum(w * 2.0) + 3.0

    w = np.ones(4, np.float32)
    xs = _examples([2, 3, 5])
    for reduce in ("sum", "mean"):
        got = pm.value_and_grad(loss, ("n, 4",), layout="packed", reduce=reduce)(w, xs)
        want = pm.value_and_grad(loss, ("n, 4",), reduce=reduce)(w, xs)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    np.testing.assert_allclose(got[0], loss(w, xs[0]), rtol=1e-6)  # the mean


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_an_example_where_the_plain_loss_fails_is_a_shape_error_naming_it(layout):
    def loss(w, x):  # jnp.max of an empty diff: plain JAX raises at n = 1
        return jnp.max(jnp.diff(x @ w)) ** 2

    xs = _examples([3, 1, 20])  # 20: longer than a row of 16, padded in either layout
    vg = pm.value_and_grad(loss, ("n, 4",), layout=layout, row_size=R)
    with pytest.raises(pm.ShapeError, match=r"examples\[1\].*test_packed_invariant.py"):
        vg(np.ones(4, np.float32), xs)


def test_a_convolution_whose_kernel_is_the_data_keeps_nan_where_plain_jax_does():
    # jnp.convolve swaps its operands when the signal is shorter than the
    # kernel: the ragged data becomes a kernel of masked size. XLA leaves a
    # convolution's padding implicit (no 0 * nan there); found by the packed
    # fuzzer (n = 2 runs in the padded layout)
    f = lambda x: jnp.convolve(x, jnp.array([1.0, -0.5, 0.25]), mode="same")  # noqa: E731
    xs = [np.array([0.5, np.nan], np.float32), np.array([np.nan, 0.5], np.float32),
          np.array([0.5, 2.0], np.float32), np.arange(5, dtype=np.float32)]
    for layout in ("padded", "packed"):
        for x, got in zip(xs, pm.ragged_map(f, ("n",), layout=layout, row_size=8)(xs)):
            want = np.asarray(f(x))
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{x}")
            np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=1e-6)


def _cross_scores(x):  # another example's first half meets this one's second half
    return x[:, :2] @ x[:, 2:].T


GARBAGE_READERS = {
    "sum": lambda x: jnp.sum(jnp.exp(_cross_scores(x)), -1),
    "max": lambda x: jnp.max(-jnp.exp(_cross_scores(x)), -1),
    "product": lambda x: jnp.exp(_cross_scores(x)) @ x,
    "softmax": lambda x: jax.nn.softmax(jnp.exp(_cross_scores(x)), -1) @ x,
}


@pytest.mark.parametrize("reader", list(GARBAGE_READERS))
def test_elementwise_garbage_between_examples_never_reaches_a_reader(reader):
    """Forward-only runs defer the select of a block-diagonal value to its
    first reader that is not elementwise (``PackedRun.settle``): ``exp`` runs
    on the unmasked scores, whose cross-example entries here are
    ``exp(200) = inf`` while each example's own are ``exp(0) = 1``; the
    reduction or product after it must see 0 there, as plain JAX per
    example does (one example's scores have no such entries)."""
    fun = GARBAGE_READERS[reader]
    ex = [np.array([[10, 10, 0, 0]] * n, np.float32) if i % 2 else
          np.array([[0, 0, 10, 10]] * n, np.float32) for i, n in enumerate(SIZES)]
    rm = pm.ragged_map(fun, ("n, 4",), layout="packed", row_size=R)
    got = rm(ex)
    # one row: neighbours meet. The speculative program masks each reader by
    # arithmetic (x * exp(-inf), x - inf): inf * 0 is NaN, and the call reruns
    # exactly, unless XLA's simplifier made the product with a 0/1 mask a
    # select (jaxlib 0.10 does): exact values either way
    assert rm.stats()["packed"]["calls"] == 1
    assert rm.stats()["packed"]["exact_reruns"] <= 1
    for i, (x, g) in enumerate(zip(ex, got)):
        _assert_close(g, fun(jnp.asarray(x)), 2e-5, f"example {i}")


def _spread_scores(x):  # exp of differences: 1-ish within an example, inf between two
    return jnp.exp(x[:, None, 0] - x[None, :, 0])


# the max of the scores (NaN in the speculative program where a cross-example
# entry is inf) read by a compare, which drops a NaN: the NaN check must be
# made there, not after the compare
NAN_DROPPING_READERS = {
    "compare": lambda x: jnp.where(jnp.max(_spread_scores(x), -1) < 10.0, 1.0, -1.0),
    "compare after exp": lambda x: jnp.exp(jnp.max(_spread_scores(x), -1)) > 0,
    "inside jit": lambda x: jax.jit(lambda s: jnp.max(s, -1) < 10.0)(_spread_scores(x)),
    "attention then compare": lambda x: jax.nn.softmax(_spread_scores(x), -1) @ x > 50.0,
}


@pytest.mark.parametrize("reader", list(NAN_DROPPING_READERS))
def test_a_nan_check_is_made_before_a_reader_that_drops_nan(reader):
    """Speculative row programs check a masked reduction's result for NaN
    only once a reader would drop the NaN (a compare, an argmax): while
    readers propagate it (exp, a sum, a product) the check waits, so XLA can
    fuse the whole attention. Here one example's scores against its
    neighbour's are ``exp(100) = inf``: the max reads ``inf - inf = NaN``
    there, and only the check before the compare makes the call rerun in the
    exact program; without it the compare turns NaN into a wrong False."""
    fun = NAN_DROPPING_READERS[reader]
    ex = [np.full((n, 1), 100.0 if i % 2 else 0.0, np.float32) + 0.1 * np.arange(n)[:, None]
          for i, n in enumerate(SIZES)]
    rm = pm.ragged_map(fun, ("n, 1",), layout="packed", row_size=R)
    got = rm(ex)
    assert rm.stats()["packed"]["calls"] == 1
    assert rm.stats()["packed"]["exact_reruns"] == 1
    for i, (x, g) in enumerate(zip(ex, got)):
        np.testing.assert_array_equal(g, fun(jnp.asarray(x)), err_msg=f"example {i}")
    same = [np.full_like(x, 3.0) + 0.1 * np.arange(len(x))[:, None] for x in ex]
    got = rm(same)  # finite everywhere: the speculative program's values, no rerun
    assert rm.stats()["packed"]["exact_reruns"] == 1
    for i, (x, g) in enumerate(zip(same, got)):
        np.testing.assert_array_equal(g, fun(jnp.asarray(x)), err_msg=f"example {i}")


def test_a_rare_path_inside_a_loop_body_stays_a_cond():
    """Speculative row programs leave a rule's rare path out and report it,
    but a loop body is another trace: there it stays a ``lax.cond`` (a flag
    from the body could not leave it), and a NaN of one example still
    changes no other."""
    fun = lambda x: lax.fori_loop(0, 2, lambda i, v: jax.nn.softmax(v @ v.T, -1) @ v, x)
    clean = _examples()
    dirty = [a.copy() for a in clean]
    dirty[1][0, 2] = np.nan
    rm = pm.ragged_map(fun, ("n, 4",), layout="packed", row_size=R)
    got_clean, got_dirty = rm(clean), rm(dirty)
    assert rm.stats()["packed"]["exact_reruns"] == 0  # the body's cond took it
    for i, (x, a, b) in enumerate(zip(dirty, got_clean, got_dirty)):
        with np.errstate(invalid="ignore"):
            _assert_same_nonfinite(b, fun(jnp.asarray(x)), f"example {i}")
        if i != 1:
            np.testing.assert_array_equal(b, a, err_msg=f"example {i}")


def _row_max_of_spread(x):  # the new-user check's repro A: no NaN or inf in the inputs
    a = x[:, 0]
    return jnp.max(jnp.exp(a[:, None] - a[None, :]), axis=-1)


def _max_weight_compared(x):  # repro B: a NaN in one example, a compare in the other
    w = jax.nn.softmax(x @ x.T, axis=-1)
    return jnp.where(jnp.max(w, axis=-1) > 0.5, 1.0, 0.0)


def _row_max_of_spread_beside_an_unread_sum(x):
    """Repro A's max with a softmax sum that reaches no result: the sum is the
    max's witness (``OwedReport``), so the max's report is made on the sum."""
    a = x[:, 0]
    e = jnp.exp(a[:, None] - a[None, :])
    m = jnp.max(e, axis=-1, keepdims=True)
    _unread = jnp.sum(jnp.exp(e - m), axis=-1)
    return m[:, 0]


SPREAD = [np.array([[0.0, 0.0], [0.5, 0.0]], np.float32),
          np.array([[100.0, 0.0], [100.2, 0.0]], np.float32)]


@pytest.mark.parametrize("fun, examples", [
    (_row_max_of_spread, SPREAD),
    (_row_max_of_spread_beside_an_unread_sum, SPREAD),
    (_max_weight_compared, [np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]], np.float32),
                            np.array([[np.nan, 0.0], [1.0, 1.0]], np.float32)]),
])
def test_a_masked_max_in_a_wide_row_never_drops_another_examples_nan(fun, examples):
    """XLA:CPU's max reductions over rows of 64 may drop a NaN (plain
    ``jax.jit`` of ``jnp.max`` too), so the speculative program's masked max
    (``x + B``, NaN where another example's entry is inf or NaN) reported
    nothing and returned -inf: a wrong value in the clean example. The max
    owes a NaN report (``OwedReport``): the check of its result makes it,
    or the check of the softmax sum that witnessed it, and the call reruns in
    the exact program."""
    rm = pm.ragged_map(fun, ("n, 2",), layout="packed", row_size=64)
    got = rm(examples)
    assert rm.stats()["packed"]["exact_reruns"] == 1
    np.testing.assert_array_equal(got[0], fun(jnp.asarray(examples[0])))
    if not np.isnan(examples[1]).any():
        np.testing.assert_array_equal(got[1], fun(jnp.asarray(examples[1])))


@pytest.mark.parametrize("dtype, fill", [("float32", 7e18), ("bfloat16", 7e18),
                                         ("float16", 1.0), ("float16", 60.0)])
def test_a_masked_max_reports_nothing_for_finite_scores_of_any_size(dtype, fill):
    """The report a max makes where no sum witnesses it (``_nan_poison``,
    ``exp(x * c) * 0``) is finite for every finite score, the dtype's largest
    (scores of 1.96e38 in float32 and bfloat16, 60 * 60 * 4 = 14400 in
    float16, whose own 2**-120 is 0) and its ``-inf`` mask included: no
    rerun. The first form (``c = 2**-120``, in the data's dtype) reran each
    call of these."""
    rm = pm.ragged_map(_inf_masked_max_alone, ("n, 4",), layout="packed", row_size=64)
    ex = [np.full((n, 4), fill, np.float32).astype(dtype) for n in (3, 5, 9)]
    for _ in range(2):
        got = rm(ex)
    assert rm.stats()["packed"]["exact_reruns"] == 0
    for x, g in zip(ex, got):
        want = _inf_masked_max_alone(jnp.asarray(x))
        assert np.isfinite(np.asarray(want, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))


def _scores(x):
    return x @ x.T


def _shifted(x):  # the scores minus their max: -inf between examples once masked
    s = _scores(x)
    return s - jnp.max(s, -1, keepdims=True)


# Readers of scores whose max's arithmetic mask replaced their data (the
# speculative program's softmax: ``Unmasked.cross``, -inf between examples,
# then 0 after exp): what each later equation holds between examples is
# followed, a reader of its own identity reads the data as is, any other
# reader selects (``inf * 0`` would be NaN and a rerun).
AFTER_THE_MAX = {
    "softmax attention": lambda x: jax.nn.softmax(_scores(x), -1) @ x,
    "softmax twice": lambda x: jax.nn.softmax(jax.nn.softmax(_scores(x), -1), -1) @ x,
    "entropy (0 * log 0 between examples)": lambda x: -jnp.sum(
        jax.nn.softmax(_scores(x), -1) * jax.nn.log_softmax(_scores(x), -1), -1),
    "max then min of the same scores": lambda x: (
        lambda s: jnp.max(s, -1) - jnp.min(s, -1))(_scores(x)),
    "exp of the negated shift (inf between examples)": lambda x: jnp.sum(
        jnp.exp(-_shifted(x) * 0.1), -1),
    "square of the shift": lambda x: jnp.sum(_shifted(x) ** 2, -1),
    "shift times a per-query factor": lambda x: jnp.sum(
        jnp.exp(_shifted(x) * jnp.sum(x, -1, keepdims=True)), -1),
    # a value that may be infinite between examples (s / T after the mask: no
    # rule) times one known to hold 0 there: unknown, not 0 (0 * inf is NaN)
    "distillation (0 times an unknown infinity)": lambda x: -jnp.sum(
        jax.nn.softmax(_scores(x), -1) * jax.nn.log_softmax(_scores(x) / 2.0, -1), -1),
    "p times 1 / p": lambda x: (lambda p: jnp.sum(p * (1.0 / p), -1))(
        jax.nn.softmax(_scores(x), -1)),
    # scores with a -inf mask of their own: the max reads -inf as plain JAX
    # does, and its NaN report waits for the softmax's sum (``OwedReport``)
    "causal softmax masked with -inf": _causal_inf_attention,
    "softmax(where=causal)": lambda x: jax.nn.softmax(
        _scores(x), -1, where=_causal(_scores(x))) @ x,
    "logsumexp of -inf-masked scores": lambda x: jax.nn.logsumexp(
        jnp.where(_causal(_scores(x)), _scores(x), -jnp.inf), -1),
    "a -inf-masked max with no sum after it": _inf_masked_max_alone,
    # the mask broadcast over heads (settled): dead query rows must not turn
    # all -inf, or their NaN reaches the second layer's live rows
    "two causal layers, a -inf mask broadcast over heads":
        lambda x: _causal_heads(_causal_heads(x)),
    "a max beside an unread sum": _max_beside_an_unread_sum,
}


@pytest.mark.parametrize("reader", list(AFTER_THE_MAX))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_readers_after_a_masked_max_get_plain_values_without_a_rerun(reader, dtype):
    fun = AFTER_THE_MAX[reader]
    ex = [0.5 * a.astype(dtype) for a in _examples()]
    rm = pm.ragged_map(fun, ("n, 4",), layout="packed", row_size=R)
    got = rm(ex)
    assert rm.stats()["packed"]["exact_reruns"] == 0  # finite data: the speculative program
    for i, (x, g) in enumerate(zip(ex, got)):
        _assert_close(g, fun(jnp.asarray(x)), TOLERANCE[dtype], f"example {i}")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("body", ["gram", "attention"])
def test_a_nan_or_inf_in_one_example_never_reaches_anothers_gradient(bad, body):
    """The backward pass of a product over a packed row (x @ x.T, attention
    scores) multiplies another example's non-finite value by a zero cotangent:
    0 * inf is NaN. A call whose loss or gradients are not finite runs in the
    padded layout, so each parameter row used only by clean examples keeps
    plain JAX's gradient (each example reads its own embedding rows here)."""
    rng = np.random.default_rng(9)
    E = jnp.asarray(rng.normal(size=(24, 4)).astype(np.float32))
    seqs = [np.arange(4 * i, 4 * i + n).astype(np.int32) for i, n in enumerate([3, 4, 2, 4, 4, 4])]
    fs = [rng.normal(size=(len(s), 4)).astype(np.float32) for s in seqs]
    fs[2][1, 0] = bad  # example 2 reads rows 8 and 9

    def loss(E, t, f):
        x = E[t] + f
        if body == "gram":
            return jnp.sum(x @ x.T)
        return jnp.sum(jax.nn.softmax(x @ x.T, axis=-1) @ x)

    want = sum(jax.jit(jax.grad(loss))(E, s, f) for s, f in zip(seqs, fs))
    vg = pm.value_and_grad(loss, {"t": "n", "f": "n, 4"}, layout="packed", reduce="sum")
    _, got = vg(E, seqs, fs)
    assert vg.nonfinite_reruns == 1
    np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(want)))
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite],
                               rtol=1e-4, atol=1e-4)
