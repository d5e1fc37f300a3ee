"""Ragged training: ``polymask.value_and_grad`` with a flax Transformer and optax SGD
gives the same parameters as the same steps computed example by example."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import channel_batches

import polymask as pm

nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")

VOCAB, DIM = 11, 16


class TinyLM(nn.Module):
    """Embedding, one pre-LN Transformer block (causal), a vocabulary head."""

    @nn.compact
    def __call__(self, tokens):  # (n,) int -> (n, VOCAB)
        x = nn.Embed(VOCAB, DIM)(tokens)
        x = x + nn.Embed(32, DIM)(jnp.arange(tokens.shape[0]))
        causal = nn.make_causal_mask(tokens)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(x), mask=causal)
        x = x + nn.Dense(DIM)(nn.gelu(nn.Dense(2 * DIM)(nn.LayerNorm()(x))))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def token_loss(model, params, tokens, labels):  # per-token losses, shape (n,)
    logits = model.apply(params, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def make_data(lengths, seed=0):
    rng = np.random.default_rng(seed)
    toks = [rng.integers(0, VOCAB, n).astype(np.int32) for n in lengths]
    labels = [np.roll(t, -1) for t in toks]
    return toks, labels


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_sgd_steps_equal_example_by_example():
    model = TinyLM()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(4, jnp.int32))
    loss = lambda p, tokens, labels: token_loss(model, p, tokens, labels)
    vg = pm.value_and_grad(loss, {"tokens": "n", "labels": "n"},
                           buckets=pm.buckets.pow2(8), batch_buckets=pm.buckets.pow2(4))
    batches = [make_data(ls, seed=i) for i, ls in
               enumerate([[3, 5, 1, 5], [0, 12, 3], [1, 3, 5, 3]])]
    # the reference: per example on exact arrays (one compile per length), then
    # the mean over all tokens of the batch
    example_vg = jax.jit(jax.value_and_grad(lambda p, t, y: jnp.sum(loss(p, t, y))))

    def exact_value_and_grad(p, toks, labels):
        parts = [example_vg(p, t, y) for t, y in zip(toks, labels)]
        n = sum(len(t) for t in toks)
        total = sum(v for v, _ in parts) / n
        grads = jax.tree_util.tree_map(lambda *g: sum(g) / n, *[g for _, g in parts])
        return total, grads

    opt = optax.sgd(0.5)
    p_masked, p_exact = params, params
    s_masked, s_exact = opt.init(params), opt.init(params)
    losses = []
    for toks, labels in batches:
        lm, gm = vg(p_masked, toks, labels)
        le, ge = exact_value_and_grad(p_exact, toks, labels)
        np.testing.assert_allclose(lm, le, rtol=1e-5, atol=1e-6)
        upd, s_masked = opt.update(gm, s_masked, p_masked)
        p_masked = optax.apply_updates(p_masked, upd)
        upd, s_exact = opt.update(ge, s_exact, p_exact)
        p_exact = optax.apply_updates(p_exact, upd)
        losses.append(float(lm))
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), p_masked, p_exact)
    # bounds 8 and 16, batch size 4 (3 padded to 4): two compiled programs
    assert vg.compiles == 2
    assert losses[-1] < losses[0] + 1.0


def test_scalar_losses_and_ragged_batch_input():
    w = jnp.array([1.0, -2.0, 0.5])
    loss = lambda w, x: jnp.mean(x @ w) ** 2  # one scalar per example
    xs = [np.random.default_rng(n).normal(size=(n, 3)).astype(np.float32) for n in (2, 5, 3)]
    vg = pm.value_and_grad(loss, (None, "n, 3"))
    lm, gm = vg(w, pm.stack(xs, bound=(8, 3)))
    le, ge = jax.value_and_grad(lambda w: sum(loss(w, jnp.asarray(x)) for x in xs) / 3)(w)
    np.testing.assert_allclose(lm, le, rtol=1e-5)
    np.testing.assert_allclose(gm, ge, rtol=1e-5)
    ls, _ = pm.value_and_grad(loss, (None, "n, 3"), reduce="sum")(w, xs)
    np.testing.assert_allclose(ls, le * 3, rtol=1e-5)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_spec_string_is_the_one_example_arguments_spec(layout):
    """``value_and_grad(loss, "n, 4")`` as ``ragged_map(f, "n, 4")``: the string
    was read as four specs ('in_specs has 4 entries')."""
    w = jnp.full((4, 4), 0.1, jnp.float32)
    loss = lambda w, x: jnp.sum(jnp.sqrt(jnp.diff(x @ w) + 1))  # noqa: E731
    xs = [np.random.default_rng(i).normal(size=(n, 4)).astype(np.float32) * 0.1
          for i, n in enumerate((3, 5, 2))]
    v, g = pm.value_and_grad(loss, "n, 4", layout=layout, reduce="sum")(w, xs)
    np.testing.assert_allclose(v, sum(loss(w, x) for x in xs), rtol=1e-5)
    np.testing.assert_allclose(g, sum(jax.grad(loss)(w, x) for x in xs), rtol=1e-4, atol=1e-6)


def test_every_argument_differentiated_leaves_no_batch_and_says_so():
    """``value_and_grad(loss, specs, argnums=(0, 1))(X, y)`` read as
    ``jax.value_and_grad``: no argument is a batch of examples. A ShapeError
    says which arguments are the examples (was a bare StopIteration)."""
    loss = lambda X, y: jnp.sum((X @ jnp.ones(3) - y) ** 2)  # noqa: E731
    X, y = np.ones((4, 3), np.float32), np.ones(4, np.float32)
    vg = pm.value_and_grad(loss, ("n, 3", "n"), argnums=(0, 1))
    with pytest.raises(pm.ShapeError, match=r"argnums=\(0, 1\) differentiates every one of "
                       r"the 2 argument\(s\).*vg\(params, examples...\)"):
        vg(X, y)
    # the rewrite the message names: one example, sizes shared
    v, g = pm.jit(jax.value_and_grad(loss, argnums=(0, 1)), ("n, 3", "n"))(X, y)
    want = jax.value_and_grad(loss, argnums=(0, 1))(X, y)
    np.testing.assert_allclose(v, want[0], rtol=1e-6)
    np.testing.assert_allclose(g[0], want[1][0], rtol=1e-6)


def test_batch_mistakes_are_shape_errors_not_fallbacks():
    """A spec key ``fun`` does not take and lists of different lengths are the
    user's mistakes: ShapeError (were: the per-example fallback, silently
    taking the typo; a bare IndexError)."""
    loss = lambda p, x, y: jnp.sum((x @ p - y) ** 2)  # noqa: E731
    p = jnp.ones(2)
    xs = [np.ones((3, 2), np.float32), np.ones((2, 2), np.float32)]
    ys = [np.ones(3, np.float32), np.ones(2, np.float32)]
    with pytest.raises(pm.ShapeError, match="names argument 'xx', which <lambda> does not take"):
        pm.value_and_grad(loss, {"xx": "n, 2", "y": "n"})(p, xs, ys)
    with pytest.raises(pm.ShapeError, match=r"different batch sizes \[1, 2\]"):
        pm.value_and_grad(loss, {"x": "n, 2", "y": "n"})(p, xs, ys[:1])
    v, g = pm.value_and_grad(loss, {"x": "n, 2", "y": "n"}, reduce="sum")(p, xs, ys)
    np.testing.assert_allclose(v, sum(loss(p, x, y) for x, y in zip(xs, ys)), rtol=1e-6)


def test_buckets_round_up_the_dim_vars_only():
    """``buckets=`` pads an example's dim var axes, not its static ones
    (``"n, 3"`` padded to (8, 3), as ``ragged_map`` pads; it was (8, 8), which
    the spec refuses, so every batch ran per example shape)."""
    loss = lambda w, x: jnp.sum((x @ w) ** 2)  # noqa: E731
    vg = pm.value_and_grad(loss, (None, "n, 3"), buckets=pm.buckets.pow2())
    w = jnp.ones(3)
    for ns in ((2, 5, 7), (1, 6, 3), (0, 4, 8)):
        xs = [np.random.default_rng(n).normal(size=(n, 3)).astype(np.float32) for n in ns]
        v, g = vg(w, xs)
        want = jax.value_and_grad(lambda w: sum(loss(w, jnp.asarray(x)) for x in xs) / 3)(w)
        np.testing.assert_allclose(v, want[0], rtol=1e-5)
        np.testing.assert_allclose(g, want[1], rtol=1e-5)
    assert vg.exact_compiles == 0 and vg.compiles == 1  # all pad to (8, 3)


def test_buckets_by_dim_var_as_polymask_jit_takes_them():
    """``buckets={"n": policy, None: default}`` (polymask.jit's form) was a raw
    TypeError; each dim var gets its policy."""
    loss = lambda w, x, y: jnp.sum((x @ w) ** 2) + jnp.sum(y)  # noqa: E731
    vg = pm.value_and_grad(loss, (None, "n, 3", "m"),
                           buckets={"n": pm.buckets.pow2(), None: pm.buckets.fixed(16)})
    w = jnp.ones(3)
    for ns, ms in (((2, 5), (1, 9)), ((7, 3), (16, 0))):
        xs = [np.random.default_rng(n).normal(size=(n, 3)).astype(np.float32) for n in ns]
        ys = [np.arange(m, dtype=np.float32) for m in ms]
        v, g = vg(w, xs, ys)
        want = jax.value_and_grad(lambda w: sum(loss(w, jnp.asarray(x), jnp.asarray(y))
                                                for x, y in zip(xs, ys)) / 2)(w)
        np.testing.assert_allclose(v, want[0], rtol=1e-5)
        np.testing.assert_allclose(g, want[1], rtol=1e-5)
    assert vg.exact_compiles == 0 and vg.compiles == 1  # n to 8, m to 16 both times
    with pytest.raises(pm.ShapeError, match=r"dim var 'm' = 17 \(from args\[2\]\.shape\[0\]"
                                            r".*larger than the largest bucket 16"):
        vg(w, [np.ones((3, 3), np.float32)], [np.ones(17, np.float32)])


def test_a_loss_with_auxiliary_outputs_is_named_at_its_definition():
    loss = lambda w, x: (jnp.sum(x @ w), jnp.max(x))  # noqa: E731
    vg = pm.value_and_grad(loss, (None, "n, 3"))
    with pytest.raises(pm.ShapeError, match=r"must return one array.*test_training\.py:\d+.*"
                                            r"return the loss alone"):
        vg(jnp.ones(3), [np.ones((2, 3), np.float32)])


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_stacked_batch_runs_in_either_layout(layout):
    """``polymask.stack`` batches in ``layout="packed"`` were a raw TypeError
    ('Masked' object is not iterable): their exact examples are packed."""
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    rng = np.random.default_rng(4)
    xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in (2, 0, 5)]
    w = jnp.asarray(rng.normal(size=3).astype(np.float32))
    v, g = pm.value_and_grad(loss, "n, 3", layout=layout)(w, pm.stack(xs))
    want = jax.value_and_grad(lambda w: sum(loss(w, jnp.asarray(x)) for x in xs) / 3)(w)
    np.testing.assert_allclose(v, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("batch", ["list", "stack", "array"])
def test_auxiliary_outputs_are_named_in_every_path(layout, batch):
    def loss_aux(w, x):
        return jnp.sum(x @ w), jnp.max(x)

    xs = [np.ones((2, 3), np.float32), np.ones((4, 3), np.float32)]
    data = {"list": xs, "stack": pm.stack(xs), "array": np.ones((2, 4, 3), np.float32)}[batch]
    with pytest.raises(pm.ShapeError, match=r"got a tuple of 2 from .*loss_aux defined at "
                                            r".*test_training\.py:\d+; return the loss alone"):
        pm.value_and_grad(loss_aux, "n, 3", layout=layout)(jnp.ones(3), data)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("batch", ["list", "stack"])
def test_constraints_hold_for_every_example_or_name_the_one_that_breaks_them(layout, batch):
    """``constraints=`` as ``mask`` takes them: the values are plain JAX's, and an
    example whose sizes break them is a ShapeError naming it (the program has
    no check of its own: checks=False), in either layout."""
    loss = lambda w, x: jnp.sum(jnp.diff(x @ w) ** 2)  # noqa: E731
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.normal(size=3).astype(np.float32))
    vg = pm.value_and_grad(loss, "n, 3", layout=layout, constraints=["n >= 2"])
    pack = pm.stack if batch == "stack" else list
    xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in (2, 7, 4)]
    v, g = vg(w, pack(xs))
    want = jax.value_and_grad(lambda w: sum(loss(w, jnp.asarray(x)) for x in xs) / 3)(w)
    np.testing.assert_allclose(v, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, want[1], rtol=1e-5, atol=1e-6)
    bad = xs + [rng.normal(size=(1, 3)).astype(np.float32)]
    with pytest.raises(pm.ShapeError, match=r"constraint 'n >= 2' does not hold for n=1") as e:
        vg(w, pack(bad))
    assert "examples[3]" in str(e.value)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("batch", ["list", "stack"])
def test_sizes_that_do_not_fit_the_specs_are_errors_never_values(layout, batch):
    """The program of value_and_grad has no size check (checks=False), so the
    sizes are checked on the host: a length that is not of the spec's form
    (3 for '2*n') names its example and the argument's place in the call,
    in either layout and batch form, where it once gave a loss computed on
    the length read as 2*1."""
    loss = lambda w, x: jnp.sum(w * x)  # noqa: E731
    pack = pm.stack if batch == "stack" else list
    vg = pm.value_and_grad(loss, "2*n", layout=layout)
    even = [np.arange(n, dtype=np.float32) for n in (4, 6)]
    if layout == "padded":  # (the packed layout packs sizes n + c only: PackedUnsupported)
        np.testing.assert_allclose(vg(jnp.float32(1.0), pack(even))[0], (6 + 15) / 2)
    with pytest.raises(pm.ShapeError, match=r"examples\[1\]: args\[1\]\.shape\[0\]: .*size 3 "
                                            r"is not of the form 2\*n"):
        vg(jnp.float32(1.0), pack([even[0], np.ones(3, np.float32)]))


def test_a_hand_built_batch_with_a_size_past_its_bound_is_an_error():
    loss = lambda w, x: jnp.sum(w * x)  # noqa: E731
    bad = pm.Masked(np.ones((2, 5), np.float32), (np.array([3, 7]),))
    with pytest.raises(pm.ShapeError, match=r"examples\[1\]: .*logical size 7 is outside \[0, 5\]"):
        pm.value_and_grad(loss, "n")(jnp.float32(1.0), bad)
    with pytest.raises(pm.ShapeError, match=r"\[3, 7\] is outside \[0, 5\]"):
        pm.value_and_grad(loss, "n", layout="packed")(jnp.float32(1.0), bad)


def test_spec_mistakes_are_errors_not_reasons_to_fall_back(recwarn):
    """A spec that does not fit the examples (rank, a static size) or the call
    (too many entries) is raised as it is: no exact shape would make it right,
    so value_and_grad does not run the examples per shape under a warning."""
    loss = lambda w, x: jnp.sum(w * x)  # noqa: E731
    w = jnp.float32(1.0)
    xs = [np.ones((n, 2), np.float32) for n in (3, 5)]
    for spec, said in (("n", "spec 'n' has 1 axis but the array has rank 2"),
                       ("n, 3", "spec 'n, 3' says 3, but the array's size there is 2"),
                       (("n, 2", "n, 2", "n, 2"), "in_specs has 3 entries")):
        with pytest.raises(pm.ShapeError, match=re.escape(said)):
            pm.value_and_grad(loss, spec)(w, xs)
    assert not [r for r in recwarn if issubclass(r.category, pm.FallbackWarning)]
    with pytest.raises(TypeError, match="in_specs must be None, a spec string"):
        pm.value_and_grad(loss, 3)


def test_a_loss_with_a_data_dependent_selection_trains_in_the_padded_layout():
    """pm.boolean_mask needs concrete inputs outside mask: the check that the
    plain loss runs on each example runs it eagerly (it traced it abstractly,
    and refused), and the padded program gives plain JAX's loss and gradient."""
    def loss(w, x):
        return (pm.boolean_mask(x, x > 2) * w).sum()

    xs = [np.array([3.0, 1.0, 5.0], np.float32), np.array([1.0, 2.0, 0.0, 4.0], np.float32),
          np.array([1.0], np.float32)]  # an empty selection too
    want = jax.value_and_grad(lambda w: sum((x[x > 2] * w).sum() for x in xs))(jnp.float32(2.0))
    got = pm.value_and_grad(loss, "n", reduce="sum")(jnp.float32(2.0), xs)
    np.testing.assert_allclose(got, want)


def test_a_batch_whose_static_axis_size_is_one_int_trains():
    """jax.vmap gives a static axis one int size for the whole batch."""
    params = {"w": jnp.arange(4.0)}
    vg = pm.value_and_grad(lambda p, x: jnp.sum((x @ p["w"]) ** 2), "n, 4")
    data = pm.stack([np.ones((3, 4), np.float32), np.ones((4, 4), np.float32)]).data
    v, _ = vg(params, pm.Masked(data, (jnp.array([3, 4]), 4)))
    np.testing.assert_allclose(v, (3 * 36 + 4 * 36) / 2)
    with pytest.raises(pm.ShapeError, match=r"examples\[1\].*logical size 6 is outside"):
        vg(params, pm.Masked(data, (jnp.array([3, 6]), 4)))


def test_parameters_at_another_position_than_argnums_say_so():
    def loss(p, x, y):
        return jnp.sum((x @ p["w"] - y) ** 2)

    p = {"w": jnp.ones((4,))}
    xs = [np.ones((n, 4), np.float32) for n in (3, 5)]
    ys = [np.ones(n, np.float32) for n in (3, 5)]
    with pytest.raises(pm.SpecError, match=r"gives a spec to args\[1\], which argnums=1 "
                                           "differentiates"):
        pm.value_and_grad(loss, {"x": "n, 4", "y": "n"}, argnums=1)(p, xs, ys)
    scale = lambda w, x: jnp.sum(w * x)  # noqa: E731
    with pytest.raises(pm.ShapeError, match=r"args\[0\] is not in argnums=1, so it is a batch "
                                            r"of examples.*shapes \[\(\)\]"):
        pm.value_and_grad(scale, "n", argnums=1)(jnp.float32(2.0), [ys[0], ys[0]])
    # parameters may be a tuple or list of arrays of different shapes
    tw = (jnp.ones((4,)), jnp.ones((4, 4)))
    v, g = pm.value_and_grad(lambda p, x: jnp.sum(x @ (p[1] @ p[0])), "n, 4")(tw, xs)
    np.testing.assert_allclose(v, (3 * 16 + 5 * 16) / 2)
    assert [np.shape(a) for a in g] == [(4,), (4, 4)]
    v, _ = pm.value_and_grad(loss, {"x": "n, 4", "y": "n"})(p, xs, ys)  # argnums=0: fine
    np.testing.assert_allclose(v, (3 * 9 + 5 * 9) / 2)


def test_a_packed_refusal_says_which_layout_runs_it():
    loss = lambda w, x: jnp.sum(jnp.linalg.qr(x * w)[1])  # noqa: E731  (no packed rule: qr)
    xs = [np.ones((n, 3), np.float32) for n in (4, 5)]
    w = jnp.float32(2.0)
    with pytest.raises(pm.PackedUnsupported, match=r"value_and_grad\(layout='packed'\): .*'qr'"
                                                   r".*layout='padded' \(the default\) runs it"):
        pm.value_and_grad(loss, "n, 3", layout="packed")(w, xs)
    v, g = pm.value_and_grad(loss, "n, 3")(w, xs)
    want = jax.value_and_grad(lambda w: sum(loss(w, jnp.asarray(x)) for x in xs) / 2)(w)
    np.testing.assert_allclose(v, want[0], rtol=1e-5)
    np.testing.assert_allclose(g, want[1], rtol=1e-5)
    with pytest.raises(pm.PackedUnsupported, match="layout='auto' or 'padded' runs it"):
        pm.ragged_map(lambda x: loss(w, x), "n, 3", layout="packed")(xs)


def test_typed_keys_in_examples_are_refused_with_the_key_data_form():
    def loss(p, x, key):
        return jnp.sum(jnp.where(jax.random.bernoulli(key, 0.7, x.shape), x * p, 0.0))

    xs = [np.ones(n, np.float32) for n in (3, 5, 2)]
    keys = [jax.random.key(i) for i in range(3)]
    for layout in ("padded", "packed"):
        with pytest.raises(TypeError, match="key_data"):
            pm.value_and_grad(loss, {"x": "n", "key": ""}, layout=layout)(2.0, xs, keys)
    # the form the message gives equals plain JAX's per-example mean
    vg = pm.value_and_grad(lambda p, x, kd: loss(p, x, jax.random.wrap_key_data(kd)),
                           {"x": "n", "kd": "2"})
    value, grad = vg(2.0, xs, [jax.random.key_data(k) for k in keys])
    ref = jax.value_and_grad(lambda p: sum(loss(p, jnp.asarray(x), k)
                                           for x, k in zip(xs, keys)) / 3)(2.0)
    np.testing.assert_allclose(value, ref[0], rtol=1e-6)
    np.testing.assert_allclose(grad, ref[1], rtol=1e-6)


def test_without_specs_the_examples_axes_of_equal_sizes_share_a_dim_var():
    # ragged_map's specs read off each call's examples: x (n, 16) and y (n,) share
    # n, the feature axis is static, so x @ W - y trains in shared programs; a
    # batch of equal lengths (all static) trains too
    rng = np.random.default_rng(2)
    b = jnp.float32(0.5)

    def loss(p, x, y, label):
        return jnp.mean(((x @ p["w"]).sum(-1) + b - y) ** 2) + (p["w"].sum() - label) ** 2

    params = {"w": jnp.asarray(rng.normal(size=(16, 4)).astype(np.float32))}
    vg = pm.value_and_grad(loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        for lengths in [(2, 5, 9), (3, 3, 3), (1, 4, 9), (2, 5, 9)]:
            xs = [rng.normal(size=(n, 16)).astype(np.float32) for n in lengths]
            ys = [rng.normal(size=(n,)).astype(np.float32) for n in lengths]
            labels = [np.float32(rng.normal()) for _ in lengths]
            value, grads = vg(params, xs, ys, labels)
            plain = [jax.value_and_grad(loss)(params, *e) for e in zip(xs, ys, labels)]
            np.testing.assert_allclose(value, np.mean([v for v, _ in plain]), rtol=1e-5)
            np.testing.assert_allclose(grads["w"], np.mean([g["w"] for _, g in plain], 0),
                                       rtol=1e-4, atol=1e-5)
    # (1, 4, 9) and (2, 5, 9) again share the first program (padded to 9)
    assert vg.exact_compiles == 0 and vg.compiles == 2


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_without_specs_empty_and_uniform_batches_train(layout):
    # specs read off the examples: an axis empty in every example stays a dim var
    # (the stacked batch pads it to 1), and the packed layout packs examples of
    # one length too; plain JAX's failure keeps its type
    def loss(w, x, y):
        return jnp.sum((x @ w - y) ** 2)

    w = jnp.arange(4.0)
    vg = pm.value_and_grad(loss, layout=layout, reduce="sum")
    for lengths in [(0,), (0, 0), (0, 3), (4, 4), (2, 5)]:
        xs = [np.ones((n, 4), np.float32) for n in lengths]
        ys = [np.full(n, 2.0, np.float32) for n in lengths]
        value, grad = vg(w, xs, ys)
        plain = [jax.value_and_grad(loss)(w, x, y) for x, y in zip(xs, ys)]
        np.testing.assert_allclose(value, sum(v for v, _ in plain), rtol=1e-6)
        np.testing.assert_allclose(grad, sum(g for _, g in plain), rtol=1e-6)
    with pytest.raises(TypeError):  # a feature size w does not take: jax.jit's TypeError
        vg(w, [np.ones((3, 5), np.float32)], [np.ones(3, np.float32)])


def test_value_and_grad_without_specs_shares_programs_across_batches_of_one_length():
    """Batches of one length each (a length-bucketed loader) compiled one
    program per length: an axis whose size changed between calls stays
    dynamic."""
    rng = np.random.default_rng(0)
    W = rng.normal(size=(16, 4)).astype(np.float32)

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p) - y[:, None]) ** 2)

    vg = pm.value_and_grad(loss)
    lengths = (10, 20, 13, 30, 7, 20, 25)
    for L in lengths:
        xs = [rng.normal(size=(L, 16)).astype(np.float32) for _ in range(3)]
        ys = [rng.normal(size=(L,)).astype(np.float32) for _ in range(3)]
        v, g = vg(W, xs, ys)
        np.testing.assert_allclose(v, np.mean([loss(W, x, y) for x, y in zip(xs, ys)]),
                                   rtol=1e-5)
        want = sum(jax.grad(loss)(W, x, y) for x, y in zip(xs, ys)) / 3
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6)
    assert vg.compiles == 4 < len(set(lengths))  # 10 static, then buckets 32, 16, 8


def test_value_and_grad_without_specs_keeps_a_leading_axis_static_where_it_must_be():
    loss = lambda W, x: jnp.sum(jnp.tanh(W @ x) ** 2)  # noqa: E731
    vg = pm.value_and_grad(loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for W, xs in channel_batches():
            v, g = vg(W, xs)
            np.testing.assert_allclose(v, np.mean([loss(W, x) for x in xs]), rtol=1e-5)
            want = sum(jax.grad(loss)(W, x) for x in xs) / 3
            np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6)
    assert vg.fallbacks() == {}


@pytest.mark.parametrize("per_example", [tuple, dict])
def test_value_and_grad_of_a_list_of_pairs_says_to_pass_one_list_per_argument(per_example):
    """``vg(W, [(x, y), ...])`` said the parameters might be at another position."""
    W = np.ones((4, 2), np.float32)
    loss = lambda p, x, y: jnp.mean((x @ p - y) ** 2)  # noqa: E731
    pairs = [(np.ones((n, 4), np.float32), np.ones((n, 2), np.float32)) for n in (3, 5)]
    batch = pairs if per_example is tuple else [{"x": x, "y": y} for x, y in pairs]
    with pytest.raises(pm.ShapeError, match=rf"args\[1\] is a list of {per_example.__name__}s"):
        pm.value_and_grad(loss)(W, batch)
    v, _ = pm.value_and_grad(loss)(W, *map(list, zip(*pairs)))  # the remedy it gives
    np.testing.assert_allclose(v, np.mean([loss(W, x, y) for x, y in pairs]), rtol=1e-6)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_examples_of_a_size_with_another_loss_rank_run_apart(layout, reduce):
    """``(x @ w).squeeze()`` per-element losses are a scalar at n = 1: such
    examples ran with their whole padded batch example by example. Now only
    they run exact (as jax.jit), the others in the shared program, and the
    sums add up to the exact batch's; NaN padding stays out."""
    def loss(w, x):
        return (x @ w).squeeze() ** 2

    vg = pm.value_and_grad(loss, "n, 3", reduce=reduce, layout=layout)
    w = np.linspace(-1, 1, 3, dtype=np.float32).reshape(3, 1)
    rng = np.random.default_rng(0)

    def exact(xs):
        def f(w):
            total = sum(jnp.sum(loss(w, x)) for x in xs)
            count = sum(np.size(loss(w, x)) for x in xs)
            return total if reduce == "sum" else total / max(count, 1)
        return jax.value_and_grad(f)(w)

    with pytest.warns(pm.FallbackWarning, match=r"n in \{1\}"):
        for sizes in ([1, 2, 5], [3, 7], [1, 1], [6, 1, 2, 1]):
            xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in sizes]
            (v, g), (v2, g2) = vg(w, xs), exact(xs)
            np.testing.assert_allclose(v, v2, rtol=1e-5)
            np.testing.assert_allclose(g, g2, rtol=1e-5, atol=1e-6)
    assert vg.exact_compiles == 1  # the shape (1, 3) only
    (where,) = vg.fallbacks()
    assert where.startswith("n in {1}")
    reason = vg.fallbacks()[where]
    assert "polymask.mask returns" not in reason and "y.squeeze(-1)" in reason  # (the runner's)
    if layout == "padded":  # a stacked batch with NaN padding too
        xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in (1, 4, 2)]
        batch = pm.stack(xs, bound=(4, 3))
        batch = pm.Masked(jnp.where(batch.valid(), batch.data, jnp.nan), batch.shape)
        (v, g), (v2, g2) = vg(w, batch), exact(xs)
        np.testing.assert_allclose(v, v2, rtol=1e-5)
        np.testing.assert_allclose(g, g2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", ["pairs", "transposed", "stacked_pairs"])
def test_packed_losses_with_the_ragged_axis_anywhere_or_twice(loss):
    """A per-element loss of two packed axes ((n, n) per-pair losses,
    AlphaFold's) divided by row_size * sum(n) instead of sum(n**2) in the
    packed layout (a silent wrong mean, scaled gradients); a loss whose ragged
    axis is not its first ((3, n)) crashed with a broadcasting ValueError.
    Both as the padded layout and the exact examples give (helper A)."""
    fun = {
        "pairs": lambda p, x: (x @ x.T * p) ** 2,                    # (n, n)
        "transposed": lambda p, x: ((x * p) ** 2).T,                  # (3, n)
        "stacked_pairs": lambda p, x: jnp.stack([x @ x.T * p, x @ x.T]),  # (2, n, n)
    }[loss]
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in (3, 1, 5, 2, 0)]
    p = jnp.float32(1.5)

    def exact(q):
        outs = [fun(q, jnp.asarray(x)) for x in xs]
        return sum(jnp.sum(o) for o in outs) / sum(o.size for o in outs)

    want = jax.value_and_grad(exact)(p)
    for layout in ("packed", "padded"):
        vg = pm.value_and_grad(fun, ("n, 3",), layout=layout)
        got = vg(p, xs)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
        assert vg.last_padded <= 1  # (packed: the rows ran them, n = 0 at most padded)
