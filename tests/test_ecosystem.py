"""polymask with flax (linen, nnx), equinox and optax: the way in.

Every model below is the library's own layer, unmodified (no hand-written
masks): values and gradients on ragged lengths 0..bound equal the exact
per-example ones.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm

eqx = pytest.importorskip("equinox")
nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")

BOUND = 6
TOL = dict(rtol=2e-5, atol=2e-5)


def is_masked(x):
    return isinstance(x, pm.Masked)


def close(a, b, **kw):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **{**TOL, **kw})


def tree_close(a, b):
    jax.tree_util.tree_map(close, a, b)


def ragged(d, seed=0, bound=BOUND):
    """Inputs of every length 0..bound, padded with NaN (the contract allows any padding)."""
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, d)).astype(np.float32) for n in range(bound + 1)]
    return xs, pm.stack(xs, bound=(bound, d), fill=np.nan)


# -- 1. specs for keyword arguments; unspecced arguments are unpadded ----------------------------
def test_kwargs_specs_by_name_and_static_kwargs():
    traces = []

    def f(params, x, *, mask=None, deterministic=False, scale=1.0):
        traces.append(deterministic)
        y = x @ params["w"] * scale
        if mask is not None:
            y = jnp.where(mask[:, None], y, 0.0)
        return y if deterministic else y + 1.0

    params = {"w": jnp.ones((3, 2))}
    g = pm.mask(f, {"x": "n, 3", "mask": "n"})  # params: no spec = unpadded
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    keep = np.array([True, False, True, True, False])
    for n in range(0, 6):
        xm, mm = pm.pad(x[:n], (5, 3)), pm.pad(keep[:n], (5,))
        for det in (True, False):
            out = g(params, xm, mask=mm, deterministic=det, scale=jnp.float32(2))
            close(out.unpad(), f(params, x[:n], mask=keep[:n], deterministic=det, scale=2.0))
    assert sorted(set(traces)) == [False, True]
    n_traces = len(traces)
    g(params, pm.pad(x[:2], (5, 3)), mask=pm.pad(keep[:2], (5,)), deterministic=True,
      scale=jnp.float32(3))
    assert len(traces) == n_traces  # bool kwarg is static (cached), array kwarg is an input
    # names given positionally or by keyword resolve the same way
    out = g(params, x=pm.pad(x[:4], (5, 3)), deterministic=True)
    close(out.unpad(), f(params, x[:4], deterministic=True))


def test_dict_specs_by_index_and_errors():
    f = lambda a, b: a.sum() + b.sum()
    g = pm.mask(f, {1: "n"})
    assert float(g(jnp.ones(3), pm.pad(jnp.ones(2), 5)).data) == 5.0
    with pytest.raises(pm.ShapeError, match="names argument 'c'"):
        pm.mask(f, {"c": "n"})(jnp.ones(3), jnp.ones(3))
    with pytest.raises(pm.ShapeError, match="in_specs\\['m'\\] is one spec"):
        pm.mask(lambda x, m: x, {"m": "n"})(jnp.ones(2), m=(jnp.ones(2), jnp.ones(2)))


def test_jit_of_masked_with_kwargs():
    f = pm.mask(lambda x, *, w: jnp.sum(x * w), {"x": "n", "w": "n"})
    jf = jax.jit(f, static_argnames=())
    for n in range(0, 5):
        x = pm.Masked(jnp.arange(4.0), (jnp.int32(n),))
        assert float(jf(x, w=x).data) == float(np.sum(np.arange(n) ** 2))


# -- 2. unpad of vmapped outputs with any mix of static and dynamic sizes -------------------------
def test_unpad_mixed_static_dynamic():
    xs, b = ragged(4)
    f = pm.mask(lambda x: (x * 2, x.sum(0), x.sum(), x[:, :3].T, x[None]), "n, 4")
    rows, col, tot, tr, lead = jax.vmap(f)(b)
    assert rows.shape[1] == 4 and isinstance(rows.shape[1], int)  # (n, 4): static 4
    for got, x in zip(rows.unpad(), xs):
        close(got, x * 2)
    for got, x in zip(col.unpad(), xs):
        close(got, x.sum(0))
    assert [np.shape(t) for t in tot.unpad()] == [()] * len(xs)
    assert [np.shape(t) for t in tr.unpad()] == [(3, len(x)) for x in xs]
    assert [np.shape(t) for t in lead.unpad()] == [(1, len(x), 4) for x in xs]
    # two batch axes: nested lists
    b2 = pm.Masked(np.stack([b.data, b.data]), tuple(np.stack([s, s]) for s in b.shape))
    out = jax.vmap(jax.vmap(pm.mask(lambda x: x[:, :2], "n, 4")))(b2)
    nested = out.unpad()
    assert len(nested) == 2 and [u.shape for u in nested[1]] == [(len(x), 2) for x in xs]
    # filled(): padding replaced, usable as a loss
    close(rows.filled(0.0).sum(), sum(float((x * 2).sum()) for x in xs))


# -- 3. models as functions: equinox and flax.nnx modules ----------------------------------------
class RowMLP(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(4, 3, 16, 2, activation=jax.nn.gelu, key=key)

    def __call__(self, x):  # (n, 4) -> (n, 3)
        return jax.vmap(self.mlp)(x)


def test_masked_function_is_a_pytree_of_the_module():
    model = RowMLP(jax.random.PRNGKey(0))
    mf = pm.mask(model, "n, 4")
    assert jax.tree_util.tree_leaves(mf) == jax.tree_util.tree_leaves(model)
    again = jax.tree_util.tree_map(lambda a: a, mf)
    assert isinstance(again, type(mf)) and again.in_specs == "n, 4"
    dyn, static = eqx.partition(mf, eqx.is_array)
    assert isinstance(eqx.combine(dyn, static), type(mf))


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_equinox_mlp_filter_jit_filter_grad():
    model = RowMLP(jax.random.PRNGKey(0))
    xs, b = ragged(4)
    fj = eqx.filter_jit(pm.mask(model, "n, 4"))

    @eqx.filter_jit
    @eqx.filter_grad
    def grad_masked(m, x):
        return pm.mask(m, "n, 4")(x).filled(0.0).sum()

    grad_exact = eqx.filter_jit(eqx.filter_grad(lambda m, x: m(x).sum()))
    for i, x in enumerate(xs):
        xm = pm.Masked(b.data[i], tuple(s[i] for s in b.shape))
        close(fj(xm).unpad(), model(x))
        tree_close(grad_masked(model, xm), grad_exact(model, jnp.asarray(x)))
    # the whole ragged batch at once: vmap over the data, not the model
    out = eqx.filter_jit(lambda m, b: jax.vmap(pm.mask(m, "n, 4"))(b))(model, b)
    for got, x in zip(out.unpad(), xs):
        close(got, model(x))


class GRU(eqx.Module):
    cell: eqx.nn.GRUCell

    def __init__(self, key):
        self.cell = eqx.nn.GRUCell(3, 5, key=key)

    def __call__(self, xs):  # (n, 3) -> final hidden (5,) and all hiddens (n, 5)
        def step(h, x):
            h = self.cell(x, h)
            return h, h
        return jax.lax.scan(step, jnp.zeros(5), xs)


def test_equinox_gru_under_scan():
    model = GRU(jax.random.PRNGKey(1))
    xs, b = ragged(3, seed=1)

    def loss(out):
        h, hs = out
        return jnp.sum(h ** 2) + jnp.sum(jnp.sin(hs))

    @eqx.filter_jit
    def masked_value_and_grad(m, x):
        return eqx.filter_value_and_grad(
            lambda m, x: loss(jax.tree_util.tree_map(
                lambda o: o.filled(0.0), pm.mask(m, "n, 3")(x), is_leaf=is_masked)))(m, x)

    exact = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, x: loss(m(x))))
    forward = eqx.filter_jit(pm.mask(model, "n, 3"))
    for i, x in enumerate(xs):
        xm = pm.Masked(b.data[i], tuple(s[i] for s in b.shape))
        h, hs = forward(xm)
        close(h.unpad(), model(x)[0])
        close(hs.unpad(), model(x)[1])
        v, g = masked_value_and_grad(model, xm)
        ve, ge = exact(model, jnp.asarray(x))
        close(v, ve)
        tree_close(g, ge)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_nnx_multihead_attention_jit_grad():
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False,
                                 rngs=nnx.Rngs(0))
    xs, b = ragged(8, seed=2)

    @nnx.jit
    def masked_vg(m, x):
        return nnx.value_and_grad(
            lambda m, x: pm.mask(m, "n, 8")(x, deterministic=True).filled(0.0).sum())(m, x)

    exact = nnx.jit(nnx.value_and_grad(lambda m, x: m(x, deterministic=True).sum()))
    forward = nnx.jit(lambda m, x: pm.mask(m, "n, 8")(x, deterministic=True))
    for i, x in enumerate(xs):
        xm = pm.Masked(b.data[i], tuple(s[i] for s in b.shape))
        close(forward(mha, xm).unpad(), mha(jnp.asarray(x), deterministic=True))
        v, g = masked_vg(mha, xm)
        ve, ge = exact(mha, jnp.asarray(x))
        close(v, ve)
        tree_close(nnx.to_pure_dict(g), nnx.to_pure_dict(ge))


class Block(nn.Module):
    """A pre-LN Transformer block, straight flax.linen layers."""

    dim: int = 8
    heads: int = 2

    @nn.compact
    def __call__(self, x, mask=None, deterministic=True):
        h = nn.SelfAttention(num_heads=self.heads, dropout_rate=0.1)(
            nn.LayerNorm()(x), mask=mask, deterministic=deterministic)
        x = x + h
        h = nn.Dense(2 * self.dim)(nn.LayerNorm()(x))
        h = nn.Dropout(0.1)(nn.gelu(h), deterministic=deterministic)
        return x + nn.Dense(self.dim)(h)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_linen_transformer_block_via_apply():
    block = Block()
    xs, b = ragged(8, seed=3)
    params = block.init(jax.random.PRNGKey(0), jnp.ones((2, 8)))
    # params need no spec; keyword arguments (mask=, deterministic=) pass through
    apply = pm.mask(block.apply, {1: "n, 8", "mask": "1, n, n"})

    def masked_loss(p, x, m):
        return apply(p, x, mask=m, deterministic=True).filled(0.0).sum()

    def exact_loss(p, x, m):
        return block.apply(p, x, mask=m, deterministic=True).sum()

    causal = [nn.make_causal_mask(jnp.ones(len(x))) for x in xs]  # (1, n, n)
    cm = pm.stack([np.asarray(c) for c in causal], bound=(1, BOUND, BOUND))
    vals, grads = jax.jit(jax.vmap(jax.value_and_grad(masked_loss), (None, 0, 0)))(
        params, b, cm)
    exact_vg = jax.jit(jax.value_and_grad(exact_loss))
    for i, (x, c) in enumerate(zip(xs, causal)):
        ve, ge = exact_vg(params, jnp.asarray(x), c)
        close(vals[i], ve)
        tree_close(jax.tree_util.tree_map(lambda g: g[i], grads), ge)
    # without a mask; rngs= is an unpadded keyword pytree of arrays
    rng = {"dropout": jax.random.PRNGKey(5)}
    out = jax.jit(apply)(params, pm.Masked(b.data[3], (3, 8)), rngs=rng)
    close(out.unpad(), block.apply(params, xs[3]))
    # dropout *on* (attention weights and activations): the exact draw in the
    # logical region (rules/random.py), so the same values as flax on exact arrays
    for i, x in enumerate(xs[:4]):
        out = apply(params, pm.Masked(b.data[i], (len(x), 8)), deterministic=False, rngs=rng)
        close(out.unpad(), block.apply(params, jnp.asarray(x), deterministic=False, rngs=rng))


def test_polymask_jit_accepts_modules():
    model = RowMLP(jax.random.PRNGKey(2))
    f = pm.jit(model, "n, 4")
    for n in (0, 1, 3, 5, 9):
        x = np.random.default_rng(n).normal(size=(n, 4)).astype(np.float32)
        close(f(x), model(x))
    assert f.stats()["compiles"] == 2  # buckets 8 and 16


def test_an_nnx_module_mutated_inside_a_closure_is_told_to_pass_the_module():
    """A train-mode BatchNorm closed over by a lambda fails under jax.jit, not
    eagerly: the error says so and names the way in, pm.mask(module, spec)."""
    bn = nnx.BatchNorm(4, use_running_average=False, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    with pytest.raises(pm.ShapeError, match="(?s)under jax.jit on the exact arrays.*"
                                            r"pm\.mask\(module, spec\)"):
        pm.mask(lambda x: bn(x), "n, 4")(pm.pad(x, (8, 4)))
    assert pm.mask(bn, "n, 4")(pm.pad(x, (8, 4))).unpad().shape == (5, 4)


def test_polymask_jit_of_linen_attention_without_specs_shares_when_sizes_meet_the_heads():
    """flax's MultiHeadDotProductAttention with 4 heads of 4 features, first
    called with a batch of 4: batch, heads and head size are one dim var, and
    a later batch of 3 fails in flax's initialiser at a size read as a value.
    That error named the size by the case's internal dim var (``s1__p1``),
    which no axis has, so the bucket ran per exact shape with a warning."""
    m = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16)
    params = m.init(jax.random.key(0), jnp.ones((2, 5, 16)))
    apply = lambda p, x: m.apply(p, x)  # noqa: E731
    f = pm.jit(apply, tiered=False)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for b, n in [(4, 5), (4, 7), (3, 6), (4, 4), (2, 9)]:
            x = rng.normal(size=(b, n, 16)).astype(np.float32)
            np.testing.assert_allclose(f(params, x), jax.jit(apply)(params, x),
                                       rtol=2e-5, atol=2e-5)
    assert f.stats()["exact_compiles"] == 0 and f.fallbacks() == {}


def test_polymask_jit_of_a_linen_apply_without_specs_shares_over_the_batch():
    """flax's Dense calls its initialiser's ``fan_in != 0`` on a size read as a
    traced value: JAX's TracerBoolConversionError. That error names the size
    read last, which the runner plans static; the parameters' shapes then meet
    flax's shape check as constants. Every call ran per exact shape before.
    The first call's bucket, whose case for the call's sizes is that error, is
    planned again before XLA compiles it (one compile for the first call, not
    two)."""
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.relu(nn.Dense(32)(x))).mean(0)

    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((3, 16)))
    f = pm.jit(model.apply, tiered=False)
    rng = np.random.default_rng(0)
    compiles = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (3, 7, 12, 5, 30, 9):
            x = rng.normal(size=(n, 16)).astype(np.float32)
            np.testing.assert_allclose(f(params, x), jax.jit(model.apply)(params, x),
                                       rtol=1e-5, atol=1e-6)
            compiles.append(f.stats()["compiles"])
    assert f.stats()["exact_compiles"] == 0
    assert compiles == [1, 1, 2, 2, 3, 3]  # buckets 8, 16, 32
