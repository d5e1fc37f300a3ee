"""``jax.random`` with dynamic shapes (rules/random.py): the logical region holds
the numbers plain JAX draws for the exact shape (partitionable threefry keys)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm
import polymask.testing
from polymask._jax_compat import testing as jax_private
from polymask.testing import check_oracle


def _x(*shape, seed=0):
    return (np.random.default_rng(seed).random(shape) + 0.5).astype(np.float32)


def dropout(x, rate=0.3):
    keep = jax.random.bernoulli(jax.random.key(7), 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0.0)


@pytest.mark.parametrize("fun", [
    lambda x: jax.random.normal(jax.random.key(3), x.shape) * x,
    lambda x: jax.random.uniform(jax.random.PRNGKey(1), x.shape) + x,  # a raw uint32 key
    dropout,
    lambda x: x * jax.random.randint(jax.random.fold_in(jax.random.key(2), 5), x.shape, 0, 9),
    lambda x: x + jax.random.normal(jax.random.split(jax.random.key(4))[1], x.shape),
], ids=["normal", "uniform_raw_key", "dropout", "randint_fold_in", "split"])
def test_samplers_match_plain_jax_at_every_size(fun):
    check_oracle(fun, [(_x(n),) for n in (0, 1, 5, 8)], [(8,)], "n")


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_two_dynamic_axes_use_the_logical_strides():
    ex = [(_x(b, n, seed=b + n),) for b, n in ((1, 3), (2, 5), (3, 0), (4, 7), (4, 8))]
    check_oracle(dropout, ex, [(4, 8)], "b, n")
    for dtype in (jnp.uint8, jnp.uint16, jnp.uint32):  # every bit width JAX has without x64
        bits = lambda x, dtype=dtype: jax.random.bits(jax.random.key(0), x.shape, dtype)
        check_oracle(bits, ex, [(4, 8)], "b, n", modes=("jit", "vmap"))


def test_polymask_jit_dropout_compiles_once():
    f = pm.jit(dropout, "b, n", buckets=pm.buckets.fixed(16))
    for b, n in ((1, 1), (3, 9), (16, 16), (2, 0)):
        x = _x(b, n)
        # (jax.jit's: eager division rounds differently by one ulp on jax 0.12.1)
        np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(jax.jit(dropout)(x)))
    assert f.stats()["compiles"] == 1


def test_refused_key_schemes_name_the_remedy():
    x = pm.pad(_x(3), (8,))
    rbg = lambda x: jax.random.normal(jax.random.key(0, impl="unsafe_rbg"), x.shape)
    with pytest.raises(pm.UnsupportedError, match="partitionable threefry"):
        pm.mask(rbg, "n")(x)
    many = lambda x: jax.random.split(jax.random.key(0, impl="unsafe_rbg"), x.shape[0])
    with pytest.raises(pm.UnsupportedError, match="random_split.*partitionable threefry"):
        pm.mask(many, "n")(x)
    prev = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        with pytest.raises(pm.UnsupportedError, match="jax_threefry_partitionable=True"):
            pm.mask(lambda x: jax.random.normal(jax.random.key(1), x.shape), "n")(x)
        with pytest.raises(pm.UnsupportedError, match="random_split.*jax_threefry_partitionable"):
            pm.mask(lambda x: jax.random.split(jax.random.key(1), x.shape[0]), "n")(x)
        x2 = pm.pad(_x(2, 3), (4, 8))
        with pytest.raises(pm.UnsupportedError, match="random_gamma.*jax_threefry_partitionable"):
            pm.mask(lambda x: jax.random.gamma(jax.random.key(1), x), "b, n")(x2)
    finally:
        jax.config.update("jax_threefry_partitionable", prev)


# --- keys with dynamic shapes, samplers built on split keys -------------------------------------

KEY = jax.random.key(11)
SIZES = (0, 1, 5, 40)  # bound 40: more sizes than max_cases, so one symbolic trace


def _sizes(*ns, seed=0):
    return [(_x(n, seed=seed + n),) for n in ns]


def _ex2(pairs=((0, 0), (1, 1), (2, 0), (3, 5), (4, 8))):
    return [(_x(b, n, seed=b * 10 + n),) for b, n in pairs]


def _key_bits(keys):
    return jax.random.key_data(keys).astype(jnp.float32)


@pytest.mark.parametrize("fun", [
    lambda x: _key_bits(jax.random.split(KEY, x.shape[0])) * x[:, None],
    lambda x: _key_bits(jax.random.split(jax.random.PRNGKey(3), x.shape[0])) * x[:, None],
    lambda x: jax.vmap(lambda k, v: jax.random.uniform(k, (3,)) * v)(
        jax.random.split(KEY, x.shape[0]), x),
    lambda x: jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, 7)))(
        jax.random.split(KEY, x.shape[0])) + x,
    lambda x: _key_bits(jax.random.clone(jax.random.wrap_key_data(
        jax.random.key_data(jax.random.split(KEY, x.shape[0]))))) * x[:, None],
], ids=["split", "split_raw_key", "vmap_uniform", "vmap_fold_in_normal", "wrap_unwrap_clone"])
def test_split_with_a_dynamic_count_matches_plain_jax(fun):
    # the keys are bit-exact; samplers' floats may differ by an ulp between programs
    check_oracle(fun, _sizes(*SIZES), [(40,)], "n", atol=1e-7, rtol=1e-6)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_split_and_bits_over_two_dynamic_axes_use_the_logical_strides():
    split2 = lambda x: _key_bits(jax.random.split(KEY, x.shape)) * x[..., None]
    check_oracle(split2, _ex2(), [(4, 8)], "b, n", atol=0, rtol=0)
    # random bits of dynamic shape from an array of keys of dynamic shape
    per_row = lambda x: jax.vmap(lambda k, r: jax.random.normal(k, r.shape) * r)(
        jax.random.split(KEY, x.shape[0]), x)
    check_oracle(per_row, _ex2(), [(4, 8)], "b, n", modes=("jit", "vmap", "grad"),
                 atol=1e-7, rtol=1e-6)
    bits = lambda x: jax.vmap(lambda k: jax.random.bits(k, (x.shape[1],), jnp.uint8))(
        jax.random.split(KEY, x.shape[0]))
    check_oracle(bits, _ex2(), [(4, 8)], "b, n", modes=("jit", "vmap"))


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
@pytest.mark.parametrize("fun, modes", [
    (lambda a: jax.random.gamma(KEY, a), ("jit", "vmap", "grad")),  # eager: dropout's
    (lambda a: jax.random.loggamma(KEY, a), ("jit", "grad")),
    (lambda a: jax.random.gamma(KEY, a[None, :], (3, a.shape[0])), ("jit", "vmap")),
    (lambda a: jax.random.beta(KEY, a, a[::-1] + 0.5), ("jit", "grad")),  # vmap: gamma's
    (lambda a: jax.random.dirichlet(KEY, a), ("jit", "grad")),  # eager/vmap: gamma's
    (lambda a: jax.vmap(jax.random.gamma)(jax.random.split(KEY, a.shape[0]), a),
     ("jit", "vmap")),  # grad: gamma's
], ids=["gamma", "loggamma", "gamma_2d", "beta", "dirichlet", "gamma_split_keys"])
def test_gamma_family_matches_plain_jax(fun, modes):
    # gamma's custom derivative (w.r.t. alpha) included; padding alpha is NaN
    check_oracle(fun, _sizes(0, 1, 40), [(40,)], "n", modes=modes, rtol=1e-6, atol=1e-6,
                 grad_rtol=1e-4)


def test_gamma_family_over_two_dynamic_axes():
    # split keys laid out with the logical strides of both axes
    ex = _ex2(((0, 0), (2, 0), (4, 8)))
    # (gradients and vmap of the samplers: the one-axis tests above)
    check_oracle(lambda a: jax.random.gamma(KEY, a), ex, [(4, 8)], "b, n",
                 modes=("jit", "vmap"), rtol=1e-6, atol=1e-6)
    check_oracle(lambda a: jax.random.dirichlet(KEY, a), _ex2(((1, 1), (3, 5))), [(4, 8)],
                 "b, n", modes=("jit",), rtol=1e-6, atol=1e-6)


def test_poisson_matches_plain_jax_over_one_and_two_dynamic_axes():
    """jax 0.12.1 binds ``jax.random.poisson`` as a primitive (``random_poisson``),
    which had no masking rule: every masked poisson draw raised. Rates below
    and above Knuth's threshold (10); the draws are bit-equal."""
    def rate(x):
        return jnp.abs(x) * 8.0

    check_oracle(lambda x: jax.random.poisson(KEY, rate(x)), _sizes(0, 1, 5, 40), [(40,)],
                 "n", modes=("eager", "jit", "vmap"), atol=0, rtol=0)
    check_oracle(lambda x: jax.random.poisson(KEY, rate(x)), _ex2(), [(4, 8)], "b, n",
                 modes=("jit",), atol=0, rtol=0)


@pytest.mark.parametrize("fun", [
    lambda x: jax.scipy.special.betaln(jnp.abs(x) + 0.5, 2.0),
    lambda x: jax.scipy.stats.cauchy.ppf(jax.nn.sigmoid(x)),
    lambda x: jax.scipy.special.fresnel(x)[0],
    lambda x: jax.scipy.stats.t.logpdf(x, jnp.abs(x) + 1.0),
    lambda x: jax.grad(lambda a: jax.random.gamma(KEY, a).sum())(jnp.abs(x) + 0.5),
], ids=["betaln", "cauchy_ppf", "fresnel", "t_logpdf", "gamma_grad_inside"])
def test_special_functions_jax_0121_binds_as_new_primitives(fun):
    """jax 0.12.1 writes these with new elementwise primitives (``sinpi``,
    ``tanpi``, ``random_gamma_grad``, ...), which had no masking rule."""
    check_oracle(fun, _sizes(0, 1, 5), [(8,)], "n", modes=("eager", "jit", "vmap"),
                 rtol=1e-5, atol=1e-6)


_NEW_ELEMENTWISE = {  # jax 0.12.1's lax functions of new primitives: name -> arity
    "sinpi": 1, "cospi": 1, "tanpi": 1, "asinpi": 1, "acospi": 1, "atanpi": 1,
    "exp2m1": 1, "log2p1": 1, "atan2pi": 2, "fma": 3, "fmuladd": 3}


@pytest.mark.parametrize("name", sorted(_NEW_ELEMENTWISE))
def test_lax_functions_of_jax_0121s_new_primitives(name):
    op = getattr(jax.lax, name, None)
    if op is None:
        pytest.skip(f"lax.{name} is new in jax 0.12.1")
    arity = _NEW_ELEMENTWISE[name]
    check_oracle(lambda x: op(*(jnp.tanh(x) * 0.9 + 0.05 * k for k in range(arity))),
                 _sizes(0, 1, 5), [(8,)], "n", modes=("eager", "jit", "vmap", "grad"),
                 rtol=1e-5, atol=1e-6)


def test_raw_bits_are_plain_jaxs_at_every_size():
    if jax_private.raw_bits is None:  # (not public: random_bits's streams before XOR)
        pytest.skip("raw_bits is new in jax 0.12.1")
    fun = lambda x: [w.astype(jnp.float32) * x for w in jax_private.raw_bits(KEY, x.shape)]  # noqa: E731
    check_oracle(fun, _sizes(0, 1, 5, 40), [(40,)], "n", modes=("eager", "jit"), atol=0, rtol=0)
    check_oracle(fun, _ex2(), [(4, 8)], "b, n", modes=("jit",), atol=0, rtol=0)


def test_gamma_padding_alpha_stays_finite():
    a = pm.Masked(jnp.full((16,), jnp.nan).at[:3].set(jnp.array([0.1, 1.0, 5.0])),
                  (jnp.int32(3),))
    out = jax.jit(pm.mask(lambda a: jax.random.gamma(KEY, a), "n"))(a)
    assert np.all(np.isfinite(np.asarray(out.data)))
    np.testing.assert_array_equal(out.unpad(), jax.random.gamma(KEY, a.unpad()))


@pytest.mark.parametrize("fun", [
    lambda x: jax.random.permutation(KEY, x),
    lambda x: jax.random.permutation(KEY, jnp.arange(x.shape[0])),
    lambda x: jax.random.permutation(KEY, jnp.outer(x, x), axis=1),
    lambda x: jax.random.permutation(KEY, jnp.outer(x, x), axis=0, independent=True),
], ids=["permutation", "arange", "axis1", "independent"])
def test_permutation_at_large_bounds(fun):
    check_oracle(fun, _sizes(*SIZES), [(40,)], "n", atol=0, rtol=0)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
@pytest.mark.parametrize("fun, fails", [
    (lambda x: jax.random.choice(KEY, x, (3, 2)), (0,)),
    (lambda x: jax.random.choice(KEY, x, (3,), replace=False), (0, 2)),
    (lambda x: jax.random.choice(KEY, x, (3,), p=x / x.sum()), (0,)),
    (lambda x: jax.random.choice(KEY, x, (3,), p=x / x.sum(), replace=False), (0, 2)),
], ids=["replace", "no_replace", "p", "p_no_replace"])
def test_choice_at_large_bounds_raises_where_plain_jax_does(fun, fails):
    check_oracle(fun, _sizes(1, 3, 17, 40)[1 if 2 in fails else 0:], [(40,)], "n",
                 atol=0, rtol=0)
    for n in fails:  # plain JAX raises: no inputs, or fewer inputs than draws
        with pytest.raises(ValueError):
            fun(jnp.asarray(_x(n)))
        with pytest.raises(pm.ShapeError):
            pm.mask(fun, "n")(pm.Masked(jnp.asarray(_x(40)), (jnp.int32(n),)))


def test_choice_with_p_follows_jax_binary_search_on_unsorted_weights():
    # weights with zeros and a NaN: JAX's binary search (not a count) decides the index
    w = np.array([0.5, 0.0, 0.0, 2.0, np.nan, 1.0, 0.0, 3.0], np.float32)
    fun = lambda p: jax.random.choice(KEY, jnp.arange(p.shape[0]), (6,), p=p)
    ex = [(w[:n],) for n in (1, 3, 5, 6, 8)]
    check_oracle(fun, ex, [(40,)], "n", modes=("eager", "jit", "vmap"))


def test_permutation_over_the_one_sort_round_threshold():
    # JAX sorts once up to 1625 elements, twice above: a case split on the size
    f = lambda x: jax.random.permutation(KEY, x)
    mf = jax.jit(pm.mask(f, "n"))
    for n in (1625, 1626, 2000):
        x = np.arange(n, dtype=np.float32)
        out = mf(pm.Masked(jnp.asarray(pm.testing.garbage_pad(x, (2000,))), (jnp.int32(n),)))
        np.testing.assert_array_equal(out.unpad(), f(jnp.asarray(x)))


def test_permutation_of_a_symbolic_int():
    # JAX needs the int as a Python int; inside a masked trace polymask shuffles
    # jnp.arange(n), plain JAX's own draw (it raised a ShapeError past max_cases)
    f = lambda x: x[jax.random.permutation(KEY, x.shape[0])]
    check_oracle(f, [(np.arange(n, dtype=np.float32),) for n in (0, 1, 5, 40)], [(40,)],
                 ("n",), modes=("eager", "jit", "vmap"))
    g = pm.jit(lambda x: jax.random.permutation(KEY, x.shape[0]), "n")
    for n in (3, 17, 100):
        np.testing.assert_array_equal(g(np.ones(n)), jax.random.permutation(KEY, n))


def test_jax_compat_random_helpers():
    from polymask._jax_compat import random as compat_random

    module, name = compat_random.shuffle_home()
    assert callable(getattr(module, name))
    module, name = compat_random.searchsorted_home()
    assert callable(getattr(module, name))
    assert [compat_random.shuffle_max_size(r) for r in range(3)] == [1, 1625, 2642245]
    assert compat_random.shuffle_rounds(1625) == 1 and compat_random.shuffle_rounds(1626) == 2
    le = compat_random.sort_comparator("left")
    assert bool(le(jnp.float32(1), jnp.float32(np.nan)))  # NaN sorts last
    a, b = compat_random.promote_dtypes(jnp.int32(1), 2.0)
    assert a.dtype == b.dtype == jnp.float32
