"""The packed layout of ragged_map: examples packed into rows with segment ids.

Oracle: every example's outputs equal the function on that exact example
(plain JAX), at sizes 0, 1, mid and the row size, with an example longer
than the row (it runs in the padded layout) and rows holding several
examples. One test per packed rule family; each runs one compiled program.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import polymask as pm
from polymask.packing import PackedUnsupported

R = 16
SIZES = [5, 1, 16, 3, 9, 2, 7, 4, 11, 6]  # 16: a row holding one example of exactly R


def _examples(sizes, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n, d)).astype(np.float32) for n in sizes]


def _check(fun, examples, *broadcast, specs=("n, 4",), sizes_ok=None, **kw):
    rm = pm.ragged_map(fun, specs, layout="packed", row_size=R, **kw)
    outs = rm(examples, *broadcast)
    for ex, out in zip(examples, outs):
        args = ex if isinstance(ex, tuple) else (ex,)
        want = fun(*broadcast, *args)
        for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
            assert np.asarray(a).dtype == jnp.asarray(b).dtype
    return rm


def test_per_position_ops_and_contractions_over_other_axes():
    W = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)

    def f(W, x):
        h = jnp.tanh(x @ W + 1.0)
        return jnp.where(h > 0, h * 2, jnp.exp(h)), jnp.sum(h, axis=1)

    rm = _check(f, _examples(SIZES + [0]), W)
    s = rm.stats()
    assert s["packed"]["compiles"] == 1 and s["layout"]["packed"] == len(SIZES) + 1
    # ten examples of 64 positions in all, rows of 16: at least 4 rows
    assert s["packed"]["real_positions"] == sum(SIZES)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_reductions_along_the_packed_axis_are_per_example():
    def f(x):
        return (jnp.sum(x, 0), jnp.max(x, 0), jnp.min(x[:, 1]), jnp.prod(x[:, :2] + 2, 0),
                jnp.mean(x, 0), jnp.var(x[:, 0]), jnp.any(x > 1.5), jnp.all(x > -3, 0),
                jnp.linalg.norm(x), x.shape[0] * 1.0)

    _check(f, _examples(SIZES))
    # n = 0: jnp.max raises in plain JAX (that example runs padded and raises)
    with pytest.raises(pm.ShapeError, match="no identity"):
        pm.ragged_map(f, ("n, 4",), layout="packed", row_size=R)(_examples([2, 0]))


def test_empty_examples_reduce_to_the_identity_as_in_plain_jax():
    def f(x):  # sum 0, mean nan, lax.reduce_max -inf: plain JAX's values at n = 0
        return jnp.sum(x, 0), jnp.mean(x, 0), lax.reduce_max(x, (0,)), jnp.cumsum(x, 0)

    _check(f, _examples([0, 3, 0, 0, 16, 0]))


def test_argmax_argmin_and_first_last_elements():
    def f(x):
        return (jnp.argmax(x[:, 0]), jnp.argmin(x, axis=0), x[0], x[-1],
                lax.dynamic_slice_in_dim(x, 1, 2), lax.dynamic_index_in_dim(x, -1, 0, False))

    ex = _examples([n for n in SIZES if n >= 3])
    ex[0][2, 0] = np.nan  # the first NaN wins, as in lax.argmax
    _check(f, ex)


def test_argmax_over_one_axis_of_attention_scores_indexes_within_the_example():
    """The best key of each query (``argmax`` over one packed axis of a
    block-diagonal value): its index in the query's own example; a NaN wins,
    a block of ``-inf`` gives 0, as in ``lax.argmax``."""
    def f(x):
        s = x @ x.T
        return (jnp.argmax(s, -1), jnp.argmin(s, 0),
                jnp.argmax(jnp.full_like(s, -jnp.inf), -1))

    ex = _examples([n for n in SIZES if n >= 1])
    ex[2][1, 2] = np.nan
    _check(f, ex)


def test_sizes_where_the_plain_function_raises_run_padded_and_raise():
    def f(x):
        return x[0]

    rm = pm.ragged_map(f, ("n, 4",), layout="packed", row_size=R)
    with pytest.raises(pm.ShapeError, match=r"examples\[1\]"):
        rm(_examples([3, 0, 2]))


def test_cumulative_ops_restart_at_every_example():
    def f(x):
        return (jnp.cumsum(x, 0), lax.cummax(x, 0, reverse=True), jnp.cumprod(x[:, 0] * 0.5),
                lax.cumlogsumexp(x[:, 1], 0), jnp.cumsum(x, 1))

    _check(f, _examples(SIZES + [0]))


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_attention_scores_are_block_diagonal_per_example():
    rng = np.random.default_rng(2)
    Wq, Wk = (rng.normal(size=(4, 8)).astype(np.float32) for _ in range(2))

    def attn(Wq, Wk, x):
        q, k = x @ Wq, x @ Wk
        s = q @ k.T / np.sqrt(8.0)
        causal = jnp.arange(x.shape[0])[:, None] >= jnp.arange(x.shape[0])[None, :]
        p = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
        ctx = p @ x
        gram = x.T @ x  # contracting the packed axis: one matrix per example
        pooled = jnp.mean(ctx, 0)
        scores = ctx @ pooled  # a per-example vector against every position
        return ctx, gram, pooled, scores, jnp.einsum("hnd,hmd->hnm", q.reshape(-1, 2, 4).transpose(1, 0, 2), k.reshape(-1, 2, 4).transpose(1, 0, 2))

    _check(attn, _examples(SIZES + [0]), Wq, Wk)


def test_positions_restart_and_relayouts_keep_the_packed_axis():
    table = np.random.default_rng(3).normal(size=(R, 4)).astype(np.float32)

    def f(table, x):
        n = x.shape[0]
        pos = jnp.arange(n)
        y = x + table[pos]  # position embeddings of each example's own positions
        z = y.reshape(n, 2, 2).transpose(1, 0, 2)
        return z, y[::-1], jnp.flip(x, 1), pos * 2, jnp.expand_dims(y, 1)[:, 0]

    _check(f, _examples(SIZES + [0]), table)


def test_sort_argsort_and_gathers_within_each_example():
    def f(x):
        order = jnp.argsort(x[:, 0])
        return jnp.sort(x, axis=0), order, x[order], jnp.take(x, jnp.array([1, 0]), axis=1)

    _check(f, _examples(SIZES + [0]))


def test_a_per_example_feature_tiled_along_the_ragged_axis():
    """PointNet's segmentation head: the global max-pooled feature tiled next to
    every point (``jnp.tile(g, (n, 1))``), and tiles along other axes."""
    def f(x):
        g = jnp.max(x, axis=0, keepdims=True)  # (1, 4): one per example
        return (jnp.concatenate([x, jnp.tile(g, (x.shape[0], 1))], axis=1), jnp.tile(x, (1, 2)),
                jnp.tile(jnp.ones((1, 2)), (x.shape[0], 1)))

    _check(f, _examples([n for n in SIZES if n >= 1]))


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_a_scan_over_positions_reads_packed_tables_within_its_example():
    """dynamax's HMM filter: ``scan`` over ``arange(T)`` whose body reads
    ``log_likelihoods[t]`` (a packed const indexed by the step)."""
    A = jnp.asarray([[0.9, 0.1, 0.0, 0.0], [0.2, 0.7, 0.1, 0.0],
                     [0.0, 0.2, 0.6, 0.2], [0.1, 0.0, 0.1, 0.8]], jnp.float32)

    def hmm_filter(A, ll):
        ll = jnp.asarray(ll)

        def step(carry, t):
            log_norm, probs = carry
            w = probs * jnp.exp(ll[t] - ll[t].max())
            norm = w.sum()
            return (log_norm + jnp.log(norm) + ll[t].max(), A.T @ (w / norm)), w / norm

        (log_norm, _), filtered = lax.scan(step, (0.0, jnp.full(4, 0.25)),
                                           jnp.arange(ll.shape[0]))
        return log_norm, filtered

    _check(hmm_filter, _examples(SIZES, seed=4), A)  # n = 0: plain JAX raises (ll[t])
    vg = pm.value_and_grad(lambda A, ll: hmm_filter(A, ll)[0], (None, "n, 4"), layout="packed",
                           row_size=R)
    ex = _examples([3, 16, 5, 1], seed=5)
    got, g = vg(A, ex)
    want, gw = jax.value_and_grad(lambda A: sum(hmm_filter(A, x)[0] for x in ex) / len(ex))(A)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(g, gw, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_cond_and_while_with_packed_values_take_each_examples_own_path():
    W = np.random.default_rng(9).normal(size=(4, 4)).astype(np.float32)

    def f(W, x):
        a = lax.cond(x.sum() > 0, lambda x: x * 2, lambda x: jnp.cumsum(x, 0), x)
        b, m = lax.cond(x[0, 0] > 0, lambda x: (x @ W, x.mean(0)), lambda x: (-x, jnp.zeros(4)), x)
        c = lax.switch(jnp.int32(jnp.abs(x.sum())) % 3,
                       [lambda x: x, lambda x: jnp.tanh(x @ W), lambda x: x[::-1]], x)
        k, d = lax.while_loop(lambda s: jnp.abs(s[1]).sum() < 40.0,  # per example
                              lambda s: (s[0] + 1, s[1] * 1.5 + 0.1), (0, x))
        e = lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.tanh(s[1] @ W)),
                           (0, x))[1]  # a shared predicate: one loop
        return a, b, m, c, k, d, e

    ex = _examples([n for n in SIZES if n >= 1], seed=3)  # n = 0 would loop forever
    _check(f, ex, W, specs=("n, 4",))

    def loss(W, x):
        h = lax.cond(x.sum() > 0, lambda x: jnp.tanh(x @ W), lambda x: x @ W * 0.5, x)
        return jnp.sum(h ** 2)

    vg = pm.value_and_grad(loss, (None, "n, 4"), layout="packed", row_size=R)
    got, g = vg(jnp.asarray(W), ex)
    want, gw = jax.value_and_grad(lambda W: sum(loss(W, x) for x in ex) / len(ex))(jnp.asarray(W))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(g, gw, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_loops_and_branches_that_read_the_ragged_size():
    """Bodies that use sizes (``x.shape[0]``, a mean over tokens, ``c[0]``):
    values computed inside a loop body stay there (no tracer escapes), and
    loops with no packed operand still see each example's own size."""
    W = jnp.asarray(np.random.default_rng(11).normal(size=(3, 4, 4)) * 0.3, jnp.float32)

    def f(W, x):
        a = lax.fori_loop(0, 2, lambda i, c: c - jnp.mean(c, 0) + c[0], x)
        b = lax.while_loop(lambda c: c[1] < x.shape[0], lambda c: (c[0] + 1.0, c[1] + 1),
                           (jnp.sum(x), 0))[0]
        c = lax.cond(jnp.sum(x) > 0.5, lambda t: t * x.shape[0], lambda t: t - 1.0, jnp.sum(x))
        d = lax.scan(lambda c, r: (lax.cond(c[0] > x.shape[0], lambda c: c * 0, lambda c: c + r,
                                            c), None), jnp.zeros(4), x)[0]
        e = lax.scan(lambda h, w: (jax.nn.softmax(h @ h.T) @ h @ w - jnp.mean(h, 0), None),
                     x, W)[0]  # a scan over stacked layers
        return a, b, c, d, e

    ex = _examples([n for n in SIZES if n >= 1], seed=12)
    _check(f, ex, W)
    vg = pm.value_and_grad(lambda W, x: jnp.sum(f(W, x)[4] ** 2), (None, "n, 4"),
                           layout="packed", row_size=R)
    got, g = vg(W, ex[:4])
    want, gw = jax.value_and_grad(
        lambda W: sum(jnp.sum(f(W, x)[4] ** 2) for x in ex[:4]) / 4)(W)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(g, gw, rtol=1e-4, atol=1e-5)


def test_packed_training_on_empty_and_long_only_batches():
    def loss(p, x):
        return jnp.sum((x[:-1] @ p - x[1:]) ** 2, axis=-1)

    P = jnp.full((4, 4), 0.1)
    for layout in ("padded", "packed"):  # a batch of empty examples: loss 0, grads 0
        v, g = pm.value_and_grad(loss, (None, "n, 4"), layout=layout, row_size=16,
                                 reduce="sum")(P, [np.zeros((0, 4), np.float32)] * 2)
        assert float(v) == 0.0 and not np.any(np.asarray(g))
    vg = pm.value_and_grad(loss, (None, "n, 4"), layout="packed", row_size=16)
    xs = _examples([17, 20])  # longer than a row: padded, counted
    got, g = vg(P, xs)
    want, gw = jax.value_and_grad(
        lambda P: sum(jnp.sum(loss(P, x)) for x in xs) / sum(len(x) - 1 for x in xs))(P)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(g, gw, rtol=1e-4, atol=1e-6)
    assert vg.last_padded == 2


def test_per_example_values_without_the_ragged_axis():
    ex = [(x, np.float32(i) * 0.5, np.int32(i % 3)) for i, x in enumerate(_examples(SIZES))]

    def f(x, scale, i):
        return jnp.sum(x * scale, 0), x[jnp.minimum(i, x.shape[0] - 1)], jnp.sum(x, 0)[i]

    _check(f, ex, specs=("n, 4", None, None))


def test_an_example_longer_than_a_row_runs_padded_with_one_warning():
    with pytest.warns(pm.PackedLayoutWarning, match=r"1 example .* longer than row_size=16 "
                      r"\(the longest: 40") as record:
        rm = _check(lambda x: jnp.cumsum(x, 0), _examples([3, 40, 5]))
    assert record[0].filename == __file__  # at the user's line
    lay = rm.stats()["layout"]
    assert lay["packed"] == 2 and lay["padded"] == 1 and "ran padded" in lay["reason"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per runner
        rm(_examples([50, 2]))
    auto = pm.ragged_map(lambda x: jnp.cumsum(x, 0), "n, 4", layout="auto", row_size=R)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" chooses per call: nothing to warn of
        auto(_examples([3, 40, 5]))


def test_with_warnings_as_errors_every_call_with_a_too_long_example_raises_before_running():
    rm = pm.ragged_map(lambda x: jnp.cumsum(x, 0), "n, 4", layout="packed", row_size=R)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with pytest.raises(pm.PackedLayoutWarning, match="runs padded"):
                rm(_examples([3, 40, 5]))
        assert rm.stats()["packed"]["calls"] == 0  # nothing ran
        outs = rm(_examples([3, 5]))  # all fit: runs, silently
    np.testing.assert_allclose(outs[1], np.cumsum(_examples([3, 5])[1], 0), rtol=1e-6)
    default = pm.ragged_map(lambda x: jnp.cumsum(x, 0), "n, 4", layout="packed")
    default(_examples([3, 5]))  # rows of 64, from this first call's longest example
    with pytest.warns(pm.PackedLayoutWarning, match=r"row_size was chosen from the first "
                      r"call's longest example; pass row_size=128 or more"):
        default(_examples([3, 100]))
    assert "longer than row_size=64: sizes 100" in default.stats()["layout"]["reason"]


def test_scans_along_the_packed_axis_restart_per_example():
    W = np.random.default_rng(4).normal(size=(4, 4)).astype(np.float32) * 0.5

    def rnn(W, x, h0):
        def cell(h, r):
            h = jnp.tanh(h @ W + r)
            return h, h * 2
        last, hs = lax.scan(cell, h0, x)
        back, _ = lax.scan(cell, h0, x, reverse=True)
        # a loop of constant length (layers) over packed values
        y = lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y @ W) + x, x)
        return last, hs, back, y

    ex = [(x, np.full(4, i * 0.1, np.float32)) for i, x in enumerate(_examples(SIZES + [0]))]
    _check(rnn, ex, W, specs=("n, 4", None))


def test_an_input_axis_of_an_affine_size_is_refused_with_its_spec_and_auto_runs_it():
    # EasyDeL's PPO log-probs: token ids of t + 3 entries beside logits of t rows
    def logps(logits, ids):
        target = ids[3:]
        return jnp.take_along_axis(jax.nn.log_softmax(logits), target[:, None], axis=-1)[:, 0]

    rng = np.random.default_rng(3)
    ex = [(rng.normal(size=(t, 7)).astype(np.float32),
           rng.integers(0, 7, t + 3).astype(np.int32)) for t in (2, 5, 0)]
    with pytest.raises(PackedUnsupported, match=r"args\[1\].shape\[0\] has size t \+ 3 "
                       r"\(its spec\); layout='auto'"):
        pm.ragged_map(logps, ("t, 7", "t + 3"), layout="packed", row_size=R)(ex)
    out = pm.ragged_map(logps, ("t, 7", "t + 3"), layout="auto", row_size=R)(ex)
    for o, (lg, ids) in zip(out, ex):
        np.testing.assert_allclose(o, logps(lg, ids), rtol=1e-6, atol=1e-6)


def test_an_index_of_a_ragged_window_and_a_constant_runs_packed():
    # alphafold's all_atom: pred_atom_positions[1:, 1, :] (found from outside). JAX
    # stages it as one gather whose starts are per example along both axes (the
    # window's min(1, n) and the 1): it was refused packed
    def f(x):
        return x[1:, 1, :].sum(-1) + x[:-1, -1, 0]

    def g(x):
        return jnp.diff(x[:, 2], axis=0) * x[1:, 0]

    rng = np.random.default_rng(4)
    ex = [(rng.normal(size=(t, 3, 2)).astype(np.float32),) for t in (2, 5, 1, 7, 0)]
    for fun in (f, g):
        out = pm.ragged_map(fun, ("t, 3, 2",), layout="packed", row_size=R)(ex)
        for o, (x,) in zip(out, ex):
            np.testing.assert_allclose(o, fun(x), rtol=1e-6, atol=1e-6)


def test_a_library_check_that_sizes_are_ints_is_refused_packed_and_auto_runs_it():
    # penzai's NamedArray.check_valid (found from outside): "the function needs the
    # size as a Python value" read as a guess where a library rejects symbolic sizes
    def f(x):
        if not isinstance(x.shape[0], int):
            raise ValueError("named axes must be ordered dicts of int sizes")
        return x * 2.0

    ex = _examples([3, 5, 1])
    with pytest.raises(PackedUnsupported, match=r"the function's trace takes a case per size"):
        pm.ragged_map(f, ("n, 4",), layout="packed", row_size=R)(ex)
    out = pm.ragged_map(f, ("n, 4",), layout="auto", row_size=R)(ex)
    for o, x in zip(out, ex):
        np.testing.assert_allclose(o, f(x))
    runner = pm.jit(f, "n, 4", tiered=False, buckets=[8])
    with pytest.warns(pm.FallbackWarning, match=r"needs the size as a Python value, or "
                      r"something it calls rejects a symbolic one"):
        np.testing.assert_allclose(runner(ex[0]), f(ex[0]))


def test_a_size_refusal_names_the_constant_apart_from_a_dim_var_named_c():
    # jax-fem's cell count c: "c + k for a constant k", not "c + c for a constant c"
    with pytest.raises(PackedUnsupported, match=r"to be c \+ k for a constant k .*4\*c"):
        pm.ragged_map(lambda x: x.reshape(-1), ("c, 4",), layout="packed",
                      row_size=R)(_examples([3, 4]))


def test_an_unsupported_primitive_names_itself_and_auto_falls_back():
    def f(x):  # a size 2n along the packed axis
        return jnp.concatenate([x, x[::-1]], 0)

    with pytest.raises(PackedUnsupported, match="'concatenate'"):
        pm.ragged_map(f, ("n, 4",), layout="packed", row_size=R)(_examples([3, 4]))
    rm = pm.ragged_map(f, ("n, 4",), layout="auto", row_size=R)
    out = rm(_examples([3, 4]))
    for a, b in zip(jax.tree_util.tree_leaves(out[1]), jax.tree_util.tree_leaves(f(_examples([3, 4])[1]))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert rm.stats()["layout"]["packed"] == 0
    assert "concatenate" in rm.stats()["layout"]["reason"]
    assert rm.stats()["packed"]["examples"] == 0  # nothing ran packed
    with pytest.raises(PackedUnsupported, match=r"'(iota|slice|gather)'.*floordiv"):  # x[::2]
        pm.ragged_map(lambda x: x[::2], ("n, 4",), layout="packed",
                      row_size=R)(_examples([3, 4]))


def test_auto_packs_when_the_cost_model_says_so():
    W = np.eye(4, dtype=np.float32)

    def f(W, x):
        s = (x @ W) @ x.T
        return jax.nn.softmax(s, -1) @ x

    many_short = _examples([3, 5, 2, 4, 6, 3, 2, 5] * 4)
    rm = pm.ragged_map(f, ("n, 4",), layout="auto", row_size=R)
    rm(many_short, W)
    assert rm.stats()["layout"]["packed"] == len(many_short), rm.stats()["layout"]
    assert rm.stats()["layout"]["reason"].startswith("cost model")
    # rows as long as the examples: packing saves nothing, attention is R^2 per row
    one_long = _examples([16, 16, 15])
    rm2 = pm.ragged_map(f, ("n, 4",), layout="auto", row_size=64)
    rm2(one_long, W)
    assert rm2.stats()["layout"]["packed"] == 0, rm2.stats()["layout"]


def test_auto_without_specs_packs_after_a_first_call_of_equal_lengths():
    """Without specs each call's specs are read off its examples: a first call
    whose examples all have one length has no dim var, which the packed
    layout cannot take. That refusal was kept for good, so every later call
    ran padded with the first call's reason."""
    W = np.eye(4, dtype=np.float32)

    def f(x):
        return jax.nn.softmax((x @ W) @ x.T, -1) @ x

    rm = pm.ragged_map(f, layout="auto", row_size=R)
    equal = _examples([5, 5, 5])
    rm(equal)
    assert rm.stats()["layout"]["packed"] == 0
    assert "nothing to pack" in rm.stats()["layout"]["reason"]
    many_short = _examples([3, 5, 2, 4, 6, 3, 2, 5] * 4)
    for o, x in zip(rm(many_short), many_short):
        np.testing.assert_allclose(o, f(x), rtol=1e-5, atol=1e-6)
    assert rm.stats()["layout"]["packed"] == len(many_short), rm.stats()["layout"]


def _tiny_lm_params(seed=0, V=7, D=8):
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.normal(size=s) * 0.4, jnp.float32)
    return {"emb": r(V, D), "pos": r(R, D), "wq": r(D, D), "wk": r(D, D), "wv": r(D, D),
            "out": r(D, V), "g": 1 + r(D)}


def _token_loss(p, tokens, labels):
    """A one-layer causal attention LM written for one exact sequence."""
    n = tokens.shape[0]
    x = p["emb"][tokens] + p["pos"][jnp.arange(n)]
    x = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["g"]
    s = (x @ p["wq"]) @ (x @ p["wk"]).T / np.sqrt(8.0)
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -1e9)
    h = x + jax.nn.softmax(s, -1) @ (x @ p["wv"])
    logp = jax.nn.log_softmax(h @ p["out"], -1)
    return -jnp.take_along_axis(logp, labels[:, None], 1)[:, 0]


def test_packed_training_steps_equal_per_example_steps():
    rng = np.random.default_rng(5)
    # (n = 0 takes its own traced case on some JAX versions: packed training
    # refuses such batches, test_packed_training_refuses_sizes_of_another_traced_case)
    sizes = [1, 16, 5, 9, 3, 12, 7, 2]
    batches = [([rng.integers(0, 7, n).astype(np.int32) for n in sizes],
                [rng.integers(0, 7, n).astype(np.int32) for n in sizes]) for _ in range(3)]
    vg = pm.value_and_grad(_token_loss, {"tokens": "n", "labels": "n"}, layout="packed",
                           row_size=R, rows_per_call=2)

    def exact_mean(p, tokens, labels):
        losses = [_token_loss(p, t, l) for t, l in zip(tokens, labels)]
        return jnp.sum(jnp.concatenate(losses)) / sum(len(t) for t in tokens)

    exact_step = jax.jit(jax.value_and_grad(exact_mean))  # the reference, one program
    p_packed = p_exact = _tiny_lm_params()
    for tokens, labels in batches:  # three SGD steps each way
        loss, g = vg(p_packed, tokens, labels)
        want, g_exact = exact_step(p_exact, tokens, labels)
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        for a in jax.tree_util.tree_leaves(g):
            assert np.all(np.isfinite(np.asarray(a)))
        p_packed = jax.tree_util.tree_map(lambda w, d: w - 0.5 * d, p_packed, g)
        p_exact = jax.tree_util.tree_map(lambda w, d: w - 0.5 * d, p_exact, g_exact)
        for a, b in zip(jax.tree_util.tree_leaves(p_packed), jax.tree_util.tree_leaves(p_exact)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert vg.compiles == 1  # 64 tokens in rows of 16, two rows per call: one program


def test_precompiled_row_program_serves_later_calls_without_a_compile():
    rm = pm.ragged_map(lambda x: jnp.cumsum(x, 0) * 2, ("n, 4",), layout="packed",
                       row_size=R, rows_per_call=2)
    rm.precompile_packed(jax.ShapeDtypeStruct((1, 4), np.float32))
    ex = _examples([3, 16, 7, 9, 1])
    with pm.compile_counter() as cc:
        out = rm(ex)
    assert cc.compiles == 0
    for x, o in zip(ex, out):
        np.testing.assert_allclose(np.asarray(o), np.cumsum(x, 0) * 2, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_gradients_through_every_packed_family_equal_per_example_gradients():
    rng = np.random.default_rng(6)
    params = {"W": jnp.asarray(rng.normal(size=(4, 4)) * 0.5, jnp.float32),
              "v": jnp.asarray(rng.normal(size=(4,)), jnp.float32)}

    def loss(p, x):  # one scalar per example, touching each family
        h = jnp.tanh(x @ p["W"])
        last, hs = lax.scan(lambda c, r: (jnp.tanh(c + r), c), p["v"], h)
        att = jax.nn.softmax(h @ h.T, -1) @ h
        srt = jnp.sort(h[:, 0])
        return (jnp.sum(jnp.cumsum(h, 0) ** 2) + jnp.max(att) + jnp.mean(hs * p["v"])
                + jnp.sum(last) + jnp.sum(srt * jnp.arange(x.shape[0])) + jnp.sum(h[::-1][0]))

    xs = _examples([3, 1, 16, 7, 9, 2, 5])
    vg = pm.value_and_grad(loss, (None, "n, 4"), layout="packed", row_size=R)
    got_loss, got = vg(params, xs)

    def exact(p):
        return sum(loss(p, x) for x in xs) / len(xs)

    want_loss, want = jax.value_and_grad(exact)(params)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_split_along_another_axis_keeps_the_packed_axis_whole():
    W = np.random.default_rng(7).normal(size=(4, 6)).astype(np.float32)

    def f(W, x):  # a fused q/k/v projection split on the feature axis (nanoGPT, mamba)
        q, k, v = jnp.split(x @ W, 3, axis=1)
        a, b = jnp.split(x, [1], axis=-1)
        return q * k + v, a, b

    _check(f, _examples(SIZES + [0]), W)


def test_a_shared_table_sliced_to_the_ragged_size_reads_positions_within_the_example():
    rng = np.random.default_rng(8)
    table = rng.normal(size=(R + 2, 4)).astype(np.float32)
    mask = rng.random((R, R)) < 0.5  # not shift invariant, unlike a causal mask

    def f(table, mask, x):  # wpe[:t], bias[:t, :t] (nanoGPT), a start, lax.slice
        n = x.shape[0]
        s = jnp.where(mask[:n, :n], x @ x.T, -1.0)
        return (x + table[:n], x * table[2:n + 2], jnp.sum(s, 1), jax.nn.softmax(s, -1) @ x,
                x - lax.slice_in_dim(table, 1, n + 1))

    _check(f, _examples(SIZES + [0]), table, mask)


def test_spare_rows_and_rows_of_empty_examples_keep_gradients_finite():
    w = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)

    def loss(w, x):  # 0/0 where the data is all zeros
        y = x * w
        return jnp.sum(jnp.where(y.sum() != 0, y / y.sum(), y) * y) + jnp.sum(y ** 2)

    rng = np.random.default_rng(8)
    xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in (8, 7, 5)]
    vg = pm.value_and_grad(loss, (None, "n, 3"), layout="packed", reduce="sum", row_size=8,
                           rows_per_call=4)  # three rows, one spare
    got, g = vg(w, xs + [np.zeros((0, 3), np.float32)])
    want, g_exact = jax.value_and_grad(lambda w: sum(loss(w, x) for x in xs))(w)
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(got, want, rtol=1e-4)
    np.testing.assert_allclose(g, g_exact, rtol=1e-4, atol=1e-4)


def test_packed_training_runs_other_sizes_padded_and_adds_them():
    """Sizes of another traced case (n = 0 here), sizes jnp clamps differently
    (x[1:] at n = 0, 1) and examples longer than a row train in the padded
    layout; the sums are added: the result equals the per-example one."""
    def loss(p, x):
        return jnp.sum(p) * 0.0 if x.shape[0] == 0 else jnp.sum(x[0] * p)

    vg = pm.value_and_grad(loss, (None, "n, 3"), layout="packed", row_size=8)
    xs = [np.ones((3, 3), np.float32), np.zeros((0, 3), np.float32),
          np.full((12, 3), 2.0, np.float32)]
    p = jnp.asarray([1.0, 2.0, 3.0])
    got, g = vg(p, xs)
    want, gw = jax.value_and_grad(lambda p: sum(loss(p, x) for x in xs) / len(xs))(p)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(g, gw, rtol=1e-6)
    assert vg.last_padded == 2  # n = 0 (another case) and the 12-long example

    def lm(p, x):  # shifted targets, per-token losses averaged over the batch's tokens
        pred = jnp.tanh(x[:-1] @ p)
        return jnp.sum((pred - x[1:]) ** 2, axis=1)

    W = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3)) * 0.5, jnp.float32)
    xs = _examples([5, 0, 1, 8, 3], d=3)
    vg = pm.value_and_grad(lm, (None, "n, 3"), layout="packed", row_size=8)
    got, g = vg(W, xs)
    tokens = sum(max(len(x) - 1, 0) for x in xs)
    want, gw = jax.value_and_grad(lambda W: sum(jnp.sum(lm(W, x)) for x in xs) / tokens)(W)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(g, gw, rtol=1e-5, atol=1e-6)
    assert vg.last_padded >= 1  # n = 0 (x[1:] is max(0, n - 1))


def test_position_tables_with_attention_stay_finite_in_short_rows():
    """The row's unused tail repeats a real example's positions: a table of
    positions no longer than the longest example (``jnp.take``'s default mode
    fills NaN past it) is read in range, so ``0 * nan`` never reaches a real
    example through the block-diagonal attention product (new-user report)."""
    tbl = np.random.default_rng(9).normal(size=(24, 4)).astype(np.float32)

    def f(tbl, x):
        x = x + jnp.take(tbl, jnp.arange(x.shape[0]), axis=0)
        return jax.nn.softmax(x @ x.T, -1) @ x

    sizes = [20, 7, 3, 19, 13, 18, 14, 19, 10, 2, 20, 20, 3, 11, 2, 16]
    rm = pm.ragged_map(f, ("n, 4",), layout="packed", row_size=64)
    for x, out in zip(_examples(sizes), rm(_examples(sizes), tbl)):
        np.testing.assert_allclose(np.asarray(out), f(tbl, x), rtol=2e-5, atol=2e-5)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_the_packed_training_example_trains():
    import importlib.util
    import pathlib

    pytest.importorskip("flax")
    pytest.importorskip("optax")
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_ragged.py"
    spec = importlib.util.spec_from_file_location("train_ragged", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    losses = mod.main(["--steps", "3", "--out", ""])
    assert len(losses) == 3 and all(np.isfinite(losses)), losses
    assert losses[0] == pytest.approx(3.0466, abs=2e-3)  # the exact per-token loss at init


def test_nan_in_one_example_stays_in_that_example():
    def f(x):  # contracting the packed axis; attention's weighted sum (0 * nan across)
        att = jax.nn.softmax(x @ x.T, -1)
        heads = x.reshape(-1, 2, 2)
        w = jax.nn.softmax(jnp.einsum("ihd,jhd->hij", heads, heads), -1)
        return x.T @ x, jnp.sum(x, 0), att @ x, (x.T @ att.T).T, jnp.einsum("hij,jhd->ihd", w, heads)

    ex = _examples([3, 5, 4, 6])
    ex[1][2, 0] = np.nan
    ex[3][1, 1] = np.inf
    outs = pm.ragged_map(f, ("n, 4",), layout="packed", row_size=R)(ex)
    for x, out in zip(ex, outs):
        for a, b in zip(out, f(x)):
            a, b = np.asarray(a), np.asarray(b)
            # a corrupted example: non-finite where plain JAX is (inf may read NaN)
            assert (np.isfinite(a) == np.isfinite(b)).all()
            np.testing.assert_allclose(np.where(np.isfinite(a), a, 0), np.where(np.isfinite(b), b, 0),
                                       rtol=2e-5, atol=2e-5)
    for i in (0, 2):
        assert all(np.all(np.isfinite(np.asarray(o))) for o in outs[i])


def test_explain_packed_names_each_equations_rule_or_the_refusal():
    """explain(layout="packed"): which layout ragged_map runs and why."""
    def attn(W, x):
        s = (x @ W) @ x.T
        return jnp.mean(jax.nn.softmax(s, axis=-1) @ x, axis=0)

    e = pm.explain(attn, (None, "n, 4"), jnp.ones((4, 4)), jnp.ones((16, 4)),
                   layout="packed", print_output=False)
    assert e.runs and e.reason is None and e.padded_sizes == []
    by_prim = {}
    for r in e.rows:
        by_prim.setdefault(r.primitive, []).append(r)
    scores = [r for r in by_prim["dot_general"] if r.kinds == ["packed axes (0, 1)"]]
    assert scores and scores[0].how == "contractions.dot_general_rule"
    assert any(r.how == "reductions._reducer.rule" and r.kinds == ["per example"]
               for r in by_prim["reduce_sum"])  # the mean over the example
    assert "rows of 16 positions" in e
    assert not any("<unknown" in r.source for r in e.rows)

    e = pm.explain(lambda x: jnp.diff(x), "n", jnp.ones(16), layout="packed",
                   print_output=False)
    # (one trace for every size: x[1:] is n - min(n, 1); its n - 1 form is
    # packed, n = 0, where the two differ, runs padded)
    assert e.runs and [r.how for r in e.rows if r.primitive == "gather"] == [
        "indexing.gather_rule"] * 2 and e.padded_sizes == [0]
    e = pm.explain(lambda x: jnp.cumsum(x[::2]), "n", jnp.ones(16), layout="packed",
                   print_output=False)
    assert not e.runs
    assert "floordiv(n + 1, 2)" in e.reason
    assert "test_packed.py" in e.reason  # the user's line
    # the same refusal is what ragged_map's auto layout reports when it falls back
    rm = pm.ragged_map(lambda x: jnp.cumsum(x[::2]), ("n",), row_size=R)
    outs = rm([np.arange(n, dtype=np.float32) ** 2 for n in (3, 5)])
    np.testing.assert_allclose(np.asarray(outs[1]), np.cumsum(np.arange(5.0)[::2] ** 2))
    assert "floordiv(n + 1, 2)" in rm.stats()["layout"]["reason"]
    with pytest.raises(ValueError, match="layout"):
        pm.explain(attn, (None, "n, 4"), layout="bogus")


def test_a_case_per_size_past_max_cases_is_a_packed_refusal():
    """A size used as a Python int at a row's bound above 2 x max_cases: the
    packed layout refuses (PackedUnsupported, a case per size), auto pads."""
    def f(x):
        acc = jnp.zeros((), x.dtype)
        for i in range(x.shape[0]):  # a case per size
            acc = acc + x[i] * i
        return acc

    ex = [np.arange(n, dtype=np.float32) for n in (3, 5, 2)]
    with pytest.raises(pm.PackedUnsupported, match="case per size"):
        pm.ragged_map(f, ("n",), layout="packed", row_size=64)(ex)
    rm = pm.ragged_map(f, ("n",), row_size=64)
    for x, o in zip(ex, rm(ex)):
        np.testing.assert_allclose(np.asarray(o), float(np.sum(x * np.arange(len(x)))))
    assert rm.stats()["layout"]["packed"] == 0


def test_a_case_per_size_refusal_names_the_per_size_use_not_other_splits():
    # jumanji's CVRP step: a scatter inside lax.cond splits at n = 0, and
    # len(trajectory) needs the size as a Python int; only the latter is why
    # every size is a case (the reason named the scatter's line first)
    def step(action, visits, trajectory):
        traj = lax.cond(action > 0, lambda: trajectory.at[visits].set(action),
                        lambda: trajectory)
        return traj, jnp.float32(-len(trajectory))  # PER-SIZE-USE

    ex = [(-np.ones(2 * n, np.int32),) for n in (1, 2, 3, 5)]
    rm = pm.ragged_map(lambda a, k, t: step(a, k, t), ("2*n",), layout="auto")
    for (t,), (traj, c) in zip(ex, rm(ex, np.int32(2), np.int32(1))):
        want = step(jnp.int32(2), jnp.int32(1), jnp.asarray(t))
        np.testing.assert_array_equal(traj, want[0])
        assert float(c) == float(want[1])
    reason = rm.stats()["layout"]["reason"]
    line = next(i for i, t in enumerate(open(__file__), 1) if "# PER-SIZE-USE" in t
                and "next(" not in t)
    assert f"the size is used at {__file__}:{line} (step)" in reason, reason


def test_a_host_call_inside_a_branch_is_a_packed_refusal():
    """equinox's error_if calls the host inside a lax.cond branch: the packed
    layout refuses it (the host would see rows: a packed row's empty segment
    made the mean NaN and the check raised on valid examples), auto pads
    without ever running it packed."""
    eqx = pytest.importorskip("equinox")

    def f(x):
        m = jnp.mean(x)
        return eqx.error_if(m, jnp.isnan(m), "empty")

    ex = [np.array([1.0, 2.0], np.float32), np.array([3.0], np.float32)]
    with pytest.raises(pm.PackedUnsupported, match="'pure_callback'.*calls the host"):
        pm.ragged_map(f, "n", layout="packed")(ex)
    rm = pm.ragged_map(f, "n")
    np.testing.assert_allclose([float(o) for o in rm(ex)], [1.5, 3.0])
    assert rm.stats()["layout"]["packed"] == 0
    assert "calls the host" in rm.stats()["layout"]["reason"]


def test_jax_debug_print_is_a_packed_refusal_naming_its_line():
    """jax.debug.print sees rows in the packed layout: refused naming the
    primitive and the user's line (the message showed the effect object's
    repr, ``<jax._src.debugging.DebugEffect object at 0x...>``; helper C)."""
    def f(x):
        jax.debug.print("sum {}", x.sum())
        return x * 2

    line = f"{__file__}:{f.__code__.co_firstlineno + 1}"
    with pytest.raises(pm.PackedUnsupported) as info:
        pm.ragged_map(f, layout="packed")([np.ones(n, np.float32) for n in (3, 5)])
    assert "DebugEffect" in str(info.value) and line in str(info.value)
    assert " object at 0x" not in str(info.value)


def test_ragged_map_explain_uses_its_own_specs_and_row_size():
    """RaggedMap.explain: the packed view with the map's specs (broadcast
    arguments take none) and row size (newcomer check: explain and ragged_map
    wanted different specs for one function)."""
    def attn(W, x):
        s = (x @ W) @ x.T
        return jnp.mean(jax.nn.softmax(s, axis=-1) @ x, axis=0)

    W = jnp.eye(4)
    rm = pm.ragged_map(attn, ("n, 4",))
    e = rm.explain(np.ones((5, 4), np.float32), W, print_output=False)
    assert e.runs and "rows of 64 positions" in e  # default_row_size(5)
    e = pm.ragged_map(attn, ("n, 4",), row_size=32).explain(np.ones((5, 4), np.float32), W,
                                                            print_output=False)
    assert "rows of 32 positions" in e
    e = pm.ragged_map(lambda x: x[::2], ("n",)).explain(np.ones(5, np.float32),
                                                         print_output=False)
    assert not e.runs and "floordiv(n + 1, 2)" in e.reason


def test_argmax_of_a_computed_value_finds_every_segments_extremum():
    """Fuzz seed 0 #1100: ``argmax(x * 1.5 - 0.25, 0)`` gave INT32_MAX for some
    columns under XLA's cheap compile (the suite's flags): ``x ==
    segment_max(x)`` compared two computations of ``x`` that XLA rounded
    differently. One segmented scan of (value, position) pairs compares one."""
    rng = np.random.default_rng(1100)
    xs = [rng.normal(size=(int(n), 4)).astype(np.float32) for n in rng.integers(1, 9, 40)]
    for fn in (lambda x: jnp.argmax(x * 1.5 - 0.25, axis=0),
               lambda x: jnp.argmin(jnp.sin(x) * 3.0 + x, axis=0)):
        out = pm.ragged_map(fn, "n, 4", layout="packed", row_size=8)(xs)
        for o, x in zip(out, xs):
            np.testing.assert_array_equal(o, fn(x))


def test_threads_sharing_one_packed_runner_lose_no_count_and_compile_once():
    """A server's threads call one ragged_map: one packed compile, every example counted."""
    import concurrent.futures

    rm = pm.ragged_map(lambda x: jnp.cumsum(x, 0), ("n, 2",), layout="packed", row_size=16)
    rng = np.random.default_rng(0)
    batches = [[rng.normal(size=(int(n), 2)).astype(np.float32) for n in rng.integers(1, 9, 3)]
               for _ in range(48)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(rm, batches))
    for batch, out in zip(batches, outs):
        for x, y in zip(batch, out):
            np.testing.assert_allclose(y, np.cumsum(x, 0), rtol=1e-6, atol=1e-6)
    st = rm.stats()["packed"]
    assert st["compiles"] == 1 and st["examples"] == 48 * 3
    assert st["real_positions"] == sum(len(x) for b in batches for x in b)


def test_packed_stats_have_their_keys_before_the_first_call():
    rm = pm.ragged_map(lambda x: jnp.sum(x), ("n",), layout="packed", row_size=8)
    before = rm.stats()["packed"]
    assert before["calls"] == 0 and before["exact_reruns"] == 0 and before["row_size"] == 8
    rm([np.ones(3, np.float32), np.ones(5, np.float32)])
    after = rm.stats()["packed"]
    assert set(after) == set(before) and after["calls"] == 1 and after["examples"] == 2
    assert "packed" not in pm.ragged_map(lambda x: jnp.sum(x), ("n",), layout="padded").stats()


def test_a_later_call_with_other_broadcast_or_static_axis_shapes_gets_its_own_trace():
    # The packed trace bakes in the broadcast arguments' structure and shapes and
    # the examples' static axis sizes (read as numbers, or a dict key tested in
    # Python); a later call that changes them reused it and returned the first
    # call's numbers (w.shape[0] = 3 for a w of 5; the "a" branch for {"b": ..})
    def f(w, x):
        return jnp.sum(x) * jnp.sum(w) + w.shape[0] + 100 * x.shape[1]

    def g(p, x):
        return jnp.sum(x) * (p["a"] if "a" in p else -p["b"])

    rng = np.random.default_rng(0)
    for layout in ("packed", "auto"):
        rf, rg = (pm.ragged_map(h, ("n, _",), layout=layout) for h in (f, g))
        for w, d in ((np.ones(3, np.float32), 2), (np.ones(5, np.float32), 2),
                     (np.ones(5, np.float32), 3), (np.ones((2, 2), np.float32), 3)):
            exs = [rng.normal(size=(n, d)).astype(np.float32) for n in (2, 3, 5)]
            np.testing.assert_allclose(rf(exs, w), [f(w, e) for e in exs], rtol=1e-5)
            for p in ({"a": 2.0}, {"b": 2.0}):
                np.testing.assert_allclose(rg(exs, p), [g(p, e) for e in exs], rtol=1e-5)
    # calls that alternate between two broadcast shapes keep both programs
    rm = pm.ragged_map(f, ("n, _",), layout="packed")
    exs = [rng.normal(size=(n, 2)).astype(np.float32) for n in (2, 3)]
    for w in [np.ones(3, np.float32), np.ones(5, np.float32)] * 3:
        np.testing.assert_allclose(rm(exs, w), [f(w, e) for e in exs], rtol=1e-5)
    assert rm.stats()["compiles"] == 2
    # training: the step follows the runner's new trace
    vg = pm.value_and_grad(lambda w, x: jnp.sum(x * w) + w.shape[0], ("n, _",),
                           layout="packed")
    for d in (4, 3):
        w = np.ones(d, np.float32)
        exs = [rng.normal(size=(n, d)).astype(np.float32) for n in (2, 3)]
        loss, grad = vg(w, exs)
        want, want_g = jax.value_and_grad(
            lambda w: sum(jnp.sum(e * w) + w.shape[0] for e in exs) / 2)(w)
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        np.testing.assert_allclose(grad, want_g, rtol=1e-5)


def test_low_precision_and_bool_segment_sums_accumulate_as_plain_jax():
    # A contraction or reduction over the packed axis ends in a segment sum
    # (a scatter-add), which rounded to bfloat16 / float16 at every update:
    # 1000 bfloat16 ones summed to 256 (plain JAX's dot and reduce accumulate
    # in float32: 1000). A bool dot or reduction (an or of ands) was refused.
    def pool(x):
        return jnp.ones_like(x) @ x

    fns = {"x @ x": lambda x: x @ x, "pool": pool,
           "softmax @ x": lambda x: jax.nn.softmax(jnp.zeros_like(x)) @ x,
           "lax.reduce": lambda x: lax.reduce(x, np.zeros((), x.dtype), lax.add, (0,))}
    for dtype, n in ((jnp.bfloat16, 1000), (jnp.float16, 3000)):
        xs = [np.ones(n, dtype), np.ones(3, dtype),
              np.random.default_rng(0).uniform(0.5, 1.5, 300).astype(dtype)]
        for name, f in fns.items():
            got = pm.ragged_map(f, "n", layout="packed", row_size=4096)(xs)
            for g, x in zip(got, xs):
                want = jax.jit(f)(jnp.asarray(x))
                assert g.dtype == want.dtype, name
                np.testing.assert_allclose(np.float32(g), np.float32(want), rtol=1e-2,
                                           err_msg=f"{name} {jnp.dtype(dtype).name}")
    vg = pm.value_and_grad(lambda w, x: jnp.sum(x * w), "n", layout="packed", row_size=2048)
    loss, grad = vg(jnp.ones((), jnp.bfloat16), [np.ones(1004, jnp.bfloat16)] * 2)
    assert float(loss) == 1004.0 and float(grad) == 1004.0
    bools = [np.array([True, False, True]), np.array([False, False]), np.array([True] * 4)]
    empty = [np.zeros(0, bool)]  # an empty segment's or / and: its identity
    for f in (lambda x: x @ x, jnp.any, jnp.all, jnp.max, jnp.min):
        xs = bools + empty if f not in (jnp.max, jnp.min) else bools
        got = pm.ragged_map(f, "n", layout="packed")(xs)
        assert [bool(g) for g in got] == [bool(jax.jit(f)(b)) for b in xs]


def test_a_packed_refusal_raised_by_the_function_names_its_line():
    # arguments in the wrong order: the function itself raises while traced for
    # the packed layout; the refusal says where, and how to see the real error
    def f(x, key):  # ragged_map calls fun(*broadcast, *example): key comes first
        return jax.random.fold_in(key, x.shape[0])

    xs = [np.ones(5, np.float32), np.ones(2, np.float32)]
    with pytest.raises(PackedUnsupported, match=r"(?s)IndexError.*raised at .*test_packed.py:"
                                                r"\d+ \(f\).*broadcast arguments first"):
        pm.ragged_map(f, "n", layout="packed")(xs, jax.random.key(0))


def test_rows_are_the_plain_first_fit_decreasing_scans():
    """``pack_rows`` finds each example's row with a segment tree of the rows'
    free positions (the scan of every row for every example was quadratic:
    benchmarks/host_time.py measures it; nothing is timed here): the same
    rows as the plain first-fit decreasing scan, gaps and the slot limit
    included."""
    from polymask.packing.segments import pack_rows

    def scan(lengths, room, slots, gap):
        rows, fill = [], []
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            n = lengths[i] + gap
            for r, used in enumerate(fill):
                if used + n <= room + gap and len(rows[r]) < slots:
                    rows[r].append((i, used))
                    fill[r] += n
                    break
            else:
                rows.append([(i, 0)])
                fill.append(n)
        return rows

    rng = np.random.default_rng(7)
    for n, hi, slots, gap in ((300, 40, 16, 1), (200, 200, 4, 0), (150, 256, 8, 0),
                              (100, 5, 3, 2), (1, 0, 1, 0), (0, 1, 1, 0)):
        lengths = rng.integers(0, hi + 1, size=n).tolist()
        packing = pack_rows(lengths, 256, slots, gap)
        assert packing.rows == scan(lengths, 256, slots, gap)
        assert all(packing.slot_of[i] == (r, s) for r, row in enumerate(packing.rows)
                   for s, (i, _) in enumerate(row))


def test_packed_product_has_a_gradient():
    """``value_and_grad(layout="packed")`` of ``jnp.prod`` was refused: the
    per-segment product was JAX's scatter-multiply, whose gradient JAX
    implements only for unique indices (helper B, session 54). It is a
    segmented cumulative product read at each segment's end now."""
    rng = np.random.default_rng(3)
    xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in (5, 0, 1, 3, 2, 7)]
    xs[3][1, 0] = 0.0  # (a zero factor: its gradient is the others' product)

    def loss(p, x):
        return jnp.sum(jnp.prod(x * p + 0.25, 0)) + jnp.prod(x[:, 0])

    p = np.ones((3,), np.float32)
    v, g = pm.value_and_grad(loss, (None, "n, 3"), reduce="sum", layout="packed",
                             row_size=16)(p, xs)
    want_v = sum(loss(p, jnp.asarray(x)) for x in xs)
    want_g = sum(jax.grad(loss)(p, jnp.asarray(x)) for x in xs)
    np.testing.assert_allclose(v, want_v, rtol=1e-5)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-6)


def test_an_empty_buffer_along_the_ragged_axis_packs():
    """``jnp.empty_like(x)`` (the ``empty`` primitive from jax 0.11; evosax's
    rank shaping via ``rankdata``) had no packed rule: the layout refused it."""
    def f(x):
        return jnp.where(x > 0, x, jnp.empty_like(x) * 0 + 1.0).cumsum()

    xs = [np.random.default_rng(k).normal(size=k).astype(np.float32) for k in (0, 1, 3, 7, 12)]
    rm = pm.ragged_map(f, "n", layout="packed")
    for x, out in zip(xs, rm(xs)):
        np.testing.assert_allclose(out, jax.jit(f)(x), rtol=1e-6)
    assert rm.stats()["layout"]["packed"] == len(xs)


def test_a_typed_prng_key_per_example_packs():
    """A typed key per example (``ragged_map(f, ("n, 8", None))`` over
    ``(x, jax.random.key(i))`` pairs) crashed the packed layout's input
    stacking (``np.dtype(key<fry>)``), reported as a trace failure and run
    padded by ``layout="auto"``."""
    def f(x, k):
        return x.sum(0) + jax.random.uniform(k, (8,))

    xs = [np.full((n, 8), 0.5, np.float32) for n in (0, 3, 5, 7)]
    keys = [jax.random.key(i) for i in range(len(xs))]
    for layout in ("packed", "padded"):
        rm = pm.ragged_map(f, ("n, 8", None), layout=layout)
        for x, k, out in zip(xs, keys, rm(list(zip(xs, keys)))):
            np.testing.assert_allclose(out, jax.jit(f)(x, k), rtol=1e-6)
        assert rm.stats()["layout"][layout] == len(xs)
    # rbg keys: JAX draws a vmap's batch of them from one key (jax-ml/jax#20094),
    # as jax.vmap does; said, since the draws are not each example's own
    rbg = [jax.random.key(i, impl="rbg") for i in range(len(xs))]
    with pytest.warns(UserWarning, match="jax-ml/jax#20094"):
        pm.ragged_map(f, ("n, 8", None), layout="packed")(list(zip(xs, rbg)))


def _left_pad(xs):
    """perch's ``ema_conv1d`` (google-research/perch, chirp/audio_utils.py): the
    first frame repeated ``conv_width - 1`` times before the signal."""
    left = jnp.repeat(xs[:, 0:1], 2, axis=1)
    return jnp.concatenate([left, xs], axis=1)


def _first_and_last(x):
    return (jnp.concatenate([jnp.repeat(x[0:1], 2, axis=0), x,
                             x[-1:].T.reshape(1, 4)], 0).cumsum(0))


@pytest.mark.parametrize("fun, spec, shape", [
    (_left_pad, "1, n, 4", lambda n: (1, n, 4)),
    (_first_and_last, "n, 4", lambda n: (n, 4)),
])
def test_a_per_example_value_is_reshaped_and_broadcast_per_example(fun, spec, shape):
    """``x[0:1]`` is one value per example; broadcasting or reshaping it into
    another per-example value (``jnp.repeat`` along the ragged axis) failed
    inside the broadcast rule (IndexError) and the reshape (TypeError), reported
    as PackedUnsupported. Such a primitive now runs per example."""
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=shape(n)).astype(np.float32) for n in (1, 5, 9, 2, 16)]
    xs[1][..., 0, :] = np.nan  # a NaN in one example stays there
    rm = pm.ragged_map(fun, (spec,), layout="packed")
    for got, x in zip(rm([(x,) for x in xs]), xs):
        want = jax.jit(fun)(x)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert rm.stats()["layout"]["packed"] == len(xs)
