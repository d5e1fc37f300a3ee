"""``ragged_dot_general`` (``lax.ragged_dot``, mixture-of-experts layers) in its
three modes: the oracle (NaN / huge-int padding, sizes 0, 1 and the bound,
eager, jit with one trace, vmap ragged batch, grad), group sizes summing to
less than the ragged axis, vmap/grad compositions with shared expert weights,
polymask.jit, and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import oracle
from jax import lax

import polymask as pm
from polymask.testing import check_oracle, garbage_pad

RNG = np.random.default_rng(0)
TOL = dict(rtol=2e-4, atol=2e-4)
G = 3  # groups (static in modes 1 and 2, as JAX requires)


def vec(*shape):
    """Positive values: the functions below take ``log`` first, which turns
    the zeros of entry-masked padding into -inf before the contraction."""
    return RNG.uniform(0.5, 1.5, size=shape).astype(np.float32)


def gsizes(*sizes):
    return np.array(sizes, np.int32)


def dn(dot, ragged, group):
    return lax.RaggedDotDimensionNumbers(dot_dimension_numbers=dot,
                                         lhs_ragged_dimensions=ragged,
                                         rhs_group_dimensions=group)


def moe(x, w, gs):
    return lax.ragged_dot(jnp.log(x), jnp.log(w), gs)


def test_rule_registered_and_plain_jax_gives_zeros_past_the_groups():
    assert pm.rules.get_rule("ragged_dot_general") is not None
    out = moe(vec(5, 2), vec(G, 2, 4), gsizes(1, 1, 1))
    assert np.all(np.asarray(out[3:]) == 0)


# --------------------------------------------------------------------------
# Mode 1 (ragged free axis): lax.ragged_dot, the MoE case
# --------------------------------------------------------------------------
W = vec(G, 4, 5)
# m = 0, 1, 5 and the bound 8; the group sizes sum to m or less (rows past
# the sum are 0); plain, so they are batched per example under vmap.
MODE1 = [(vec(0, 4), W, gsizes(0, 0, 0)), (vec(1, 4), W, gsizes(0, 1, 0)),
         (vec(5, 4), W, gsizes(2, 0, 1)), (vec(8, 4), W, gsizes(3, 2, 3))]


def test_ragged_dot_tokens_dynamic():
    oracle(moe, MODE1, [(8, 4), None, None], ("m, 4", None, None), n_grad=4, **TOL)


def test_ragged_dot_every_axis_dynamic_but_groups():
    # m, k, n dynamic: contracted padding (k) is zeroed on both sides, the
    # weights' padding (k, n) is NaN; the weights are batched under vmap.
    exs = [(vec(m, k), vec(G, k, n), gs) for m, k, n, gs in
           [(0, 1, 2, gsizes(0, 0, 0)), (1, 0, 1, gsizes(1, 0, 0)),
            (4, 3, 5, gsizes(1, 1, 1)), (6, 4, 5, gsizes(2, 2, 2))]]
    oracle(moe, exs, [(6, 4), (G, 4, 5), None], ("m, k", "_, k, n", None), n_grad=4, **TOL)


def test_ragged_dot_integers():
    # integer padding is not entry-masked: it holds huge values
    exs = [(RNG.integers(-5, 5, (m, k)).astype(np.int32),
            RNG.integers(-5, 5, (G, k, 2)).astype(np.int32), gs)
           for m, k, gs in [(0, 3, gsizes(0, 0, 0)), (4, 1, gsizes(1, 2, 0)),
                            (6, 3, gsizes(2, 2, 2))]]
    oracle(lax.ragged_dot, exs, [(6, 3), (G, 3, 2), None], ("m, k", "_, k, 2", None),
           modes=("eager", "jit", "vmap"))


def test_group_sizes_summing_past_the_logical_rows():
    # Plain JAX (CPU) ends the groups at m; in the padded program the last
    # groups reach into padded rows (-inf after log): nothing leaks, forward
    # or backward.
    exs = [(vec(m, 4), W, gs) for m, gs in [(2, gsizes(1, 2, 3)), (5, gsizes(3, 2, 3))]]
    oracle(moe, exs, [(8, 4), None, None], ("m, 4", None, None), **TOL)


def test_ragged_dot_general_mode1_with_batch_axes_and_group_sizes_per_batch():
    # lhs [b, m, k], rhs [g, b, k, n], group_sizes [b, g] (b dynamic: its
    # padded rows hold huge ints) -> [b, m, n]
    d = dn((((2,), (2,)), ((0,), (1,))), [1], [0])

    def f(x, w, gs):
        return lax.ragged_dot_general(jnp.log(x), jnp.log(w), gs, d)

    exs = []
    for b, m in [(1, 0), (2, 3), (3, 5)]:
        gs = np.stack([RNG.multinomial(RNG.integers(0, m + 1), [1 / G] * G)
                       for _ in range(b)]).astype(np.int32)
        exs.append((vec(b, m, 2), vec(G, b, 2, 3), gs))
    oracle(f, exs, [(3, 5, 2), (G, 3, 2, 3), (3, G)], ("b, m, 2", "_, b, 2, 3", f"b, {G}"),
           **TOL)


def test_grad_inside_mask_binds_modes_1_and_2():
    # JAX's transpose of mode 1 is a mode-1 (d lhs) and a mode-2 (d rhs, the
    # ragged axis contracted) ragged_dot_general: both masked here.
    def f(x, w, gs):
        return jax.grad(lambda x, w: jnp.sum(jnp.sin(moe(x, w, gs))), argnums=(0, 1))(x, w)

    oracle(f, MODE1, [(8, 4), None, None], ("m, 4", None, None),
           modes=("eager", "jit", "vmap"), **TOL)


# --------------------------------------------------------------------------
# Mode 2 (ragged contracted axis) and mode 3 (ragged batch axis)
# --------------------------------------------------------------------------
def test_mode2_ragged_contracting_axis_dynamic():
    d = dn((((1,), (0,)), ((), ())), [1], [])

    def f(x, y, gs):
        return lax.ragged_dot_general(jnp.log(x), jnp.log(y), gs, d)  # [m,k]x[k,n]->[g,m,n]

    exs = [(vec(m, k), vec(k, n), gs) for m, k, n, gs in
           [(0, 0, 1, gsizes(0, 0, 0)), (1, 1, 0, gsizes(0, 1, 0)),
            (3, 4, 2, gsizes(1, 1, 1)), (4, 6, 3, gsizes(2, 0, 4)),
            (3, 2, 2, gsizes(1, 2, 3))]]  # groups past k: they end at k in plain JAX
    # JAX has no transpose for mode 2: no grad mode
    oracle(f, exs, [(4, 6), (6, 3), None], ("m, k", "k, n", None),
           modes=("eager", "jit", "vmap"), **TOL)


def test_mode3_ragged_batch_axis_with_dynamic_group_count():
    d = dn((((2,), (1,)), ((0,), (0,))), [0], [])

    def f(x, y, gs):
        return lax.ragged_dot_general(jnp.log(x), jnp.log(y), gs, d)  # -> [b, m, n]

    exs = [(vec(b, m, k), vec(b, k, 2), RNG.integers(0, 3, g).astype(np.int32))
           for b, m, k, g in [(0, 1, 2, 1), (1, 0, 1, 2), (3, 2, 1, 2), (2, 3, 2, 3),
                              (4, 3, 3, 4)]]
    oracle(f, exs, [(4, 3, 3), (4, 3, 2), (4,)], ("b, m, k", "b, k, 2", "g"),
           modes=("eager", "jit", "vmap"), **TOL)


# --------------------------------------------------------------------------
# Compositions: shared expert weights under vmap (JAX's own batching rule
# handles only all-batched operands), vmap of grad, grad of vmap
# --------------------------------------------------------------------------
MOE = pm.mask(moe, ("m, 4", None, None))
SIZES = np.array([0, 1, 5, 8], np.int32)
GS = np.stack([ex[2] for ex in MODE1])
XS = np.stack([garbage_pad(ex[0], (8, 4)) for ex in MODE1])


def _masked_loss(x, m, w, gs):
    out = MOE(pm.Masked(x, (m, 4)), w, gs)
    return jnp.sum(jnp.where(out.valid(), jnp.sin(out.data), 0.0))


def _ref_grads():
    return [jax.grad(lambda x, w: jnp.sum(jnp.sin(moe(x, w, ex[2]))), argnums=(0, 1))(
        ex[0], W) for ex in MODE1]


@pytest.mark.parametrize("gs_batched", [False, True])
def test_vmap_of_grad_with_shared_weights(gs_batched):
    gs = GS if gs_batched else GS[3]
    gx, gw = jax.jit(jax.vmap(jax.grad(_masked_loss, argnums=(0, 2)),
                              in_axes=(0, 0, None, 0 if gs_batched else None)))(
        XS, SIZES, W, gs)
    for i, m in enumerate(SIZES):
        rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.sin(moe(x, w, gs[i] if gs_batched else gs))),
                          argnums=(0, 1))(MODE1[i][0], W)
        np.testing.assert_allclose(gx[i, :m], rx, **TOL)
        assert np.all(np.asarray(gx[i, m:]) == 0)
        np.testing.assert_allclose(gw[i], rw, **TOL)


def test_grad_of_vmap_over_a_ragged_batch_shared_weights():
    def loss(w, xs):
        return jnp.sum(jax.vmap(_masked_loss, in_axes=(0, 0, None, 0))(xs, SIZES, w, GS))

    gw, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(W, XS)
    refs = _ref_grads()
    np.testing.assert_allclose(gw, sum(r[1] for r in refs), **TOL)
    for i, m in enumerate(SIZES):
        np.testing.assert_allclose(gx[i, :m], refs[i][0], **TOL)
        assert np.all(np.isfinite(np.asarray(gx))) and np.all(np.asarray(gx[i, m:]) == 0)


def test_jit_compiles_once_across_token_counts():
    traces = []

    def f(x, w, gs):
        traces.append(1)
        return MOE(x, w, gs)

    jf = jax.jit(f)
    for (x, w, gs), b in zip(MODE1, (8, 8, 8, 8)):
        out = jf(pm.Masked(jnp.asarray(garbage_pad(x, (b, 4))), (np.int32(len(x)), 4)), w, gs)
        np.testing.assert_allclose(out.unpad(), moe(x, w, gs), **TOL)
    assert len(traces) == 1


def test_polymask_jit_forward_only():
    pj = pm.jit(moe, ("m, 4", None, None))
    for x, w, gs in MODE1:
        np.testing.assert_allclose(np.asarray(pj(x, w, gs)), moe(x, w, gs), **TOL)


# --------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------
def test_dynamic_group_count_in_mode_1_is_traced_per_group_count():
    """JAX's ragged_dot refuses a symbolic group count; jax.jit on the exact
    arrays gets an int. polymask pins only g (5 traces; m stays symbolic) and
    matches plain JAX at every group count, 0 included."""
    exs = [(vec(m, 4), vec(g, 4, 5), gsizes(*sizes)) for m, g, sizes in
           ((8, 4, (2, 1, 3, 2)), (0, 0, ()), (3, 1, (3,)), (5, 2, (1, 2)), (1, 3, (0, 1, 0)))]
    check_oracle(moe, exs, [(8, 4), (4, 4, 5), (4,)], ("m, 4", "g, 4, 5", "g"),
                 modes=("eager", "jit", "vmap"))
    f = pm.mask(moe, ("m, 4", "g, 4, 5", "g"))
    tree, _ = f.cases(*(pm.Masked(jnp.asarray(garbage_pad(a, b)), a.shape)
                        for a, b in zip(exs[0], [(8, 4), (4, 4, 5), (4,)])))
    assert len(tree.cases) == 5


def test_group_offset_is_refused():
    # lax.ragged_dot cannot even trace a group_offset (an unhashable param);
    # bound directly with a hashable one, the rule refuses it by name.
    (eqn,) = jax.make_jaxpr(lax.ragged_dot)(vec(2, 4), W, gsizes(1, 1, 0)).eqns
    prim, params = eqn.primitive, eqn.params

    def f(x, w, gs):
        return prim.bind(x, w, gs, **dict(params, group_offset=(0,)))

    with pytest.raises(pm.UnsupportedError, match="ragged_dot_general.*group_offset"):
        pm.mask(f, ("m, 4", None, None))(pm.Masked(jnp.zeros((8, 4)), (np.int32(3), 4)), W,
                                         gsizes(1, 1, 0))


def test_grad_of_mode_2_is_not_implemented_as_in_jax():
    d = dn((((1,), (0,)), ((), ())), [1], [])

    def f(x, y):
        return jnp.sum(lax.ragged_dot_general(x, y, gsizes(1, 1, 1), d))

    with pytest.raises(NotImplementedError):
        jax.grad(f)(vec(2, 3), vec(3, 2))
    mf = pm.mask(f, ("m, k", "k, 2"))
    with pytest.raises(NotImplementedError, match="RAGGED_CONTRACTING"):
        jax.grad(lambda x: mf(pm.Masked(x, (np.int32(2), np.int32(3))),
                              pm.Masked(jnp.ones((4, 2)), (np.int32(3), 2))).data)(
            jnp.ones((4, 4)))


def test_sort_by_expert_moe_layer_under_vmap():
    # the usual MoE layer: tokens sorted by expert, then ragged_dot with shared
    # weights. Its cases (n == 0 and n >= 1) run in a lax.switch under vmap,
    # and JAX's own ragged_dot batching fails where the switch batches the lhs
    # on another axis: the rule binds its twin at the bound too (new-user pass)
    n_exp, d, h = 4, 8, 6
    w = jnp.asarray(vec(n_exp, d, h))

    def layer(x, e, w):
        order = jnp.argsort(e)
        counts = jnp.bincount(e, length=n_exp).astype(jnp.int32)
        return lax.ragged_dot(jnp.log(x[order]), w, counts)

    ns = [0, 3, 16]
    xs = np.stack([vec(16, d) for _ in ns])
    es = RNG.integers(0, n_exp, (len(ns), 16)).astype(np.int32)
    masked = pm.mask(layer, ("n, 8", "n", None))
    out = jax.vmap(masked, in_axes=(0, 0, None))(
        pm.Masked(jnp.asarray(xs), (jnp.array(ns), jnp.full(len(ns), d))),
        pm.Masked(jnp.asarray(es), (jnp.array(ns),)), w)
    for i, n in enumerate(ns):
        np.testing.assert_allclose(np.asarray(out.data[i, :n]),
                                   layer(xs[i, :n], es[i, :n], w), **TOL)
