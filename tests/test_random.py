"""``jax.random`` with dynamic shapes (rules/random.py): the logical region holds
the numbers plain JAX draws for the exact shape (partitionable threefry keys)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm
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


def test_two_dynamic_axes_use_the_logical_strides():
    ex = [(_x(b, n, seed=b + n),) for b, n in ((1, 3), (2, 5), (3, 0), (4, 7), (4, 8))]
    check_oracle(dropout, ex, [(4, 8)], "b, n")
    for dtype in (jnp.uint8, jnp.uint16, jnp.uint32):  # every bit width JAX has without x64
        bits = lambda x, dtype=dtype: jax.random.bits(jax.random.key(0), x.shape, dtype)
        check_oracle(bits, ex, [(4, 8)], "b, n", modes=("eager", "jit", "vmap"))


def test_polymask_jit_dropout_compiles_once():
    f = pm.jit(dropout, "b, n", buckets=pm.buckets.fixed(16))
    for b, n in ((1, 1), (3, 9), (16, 16), (2, 0)):
        x = _x(b, n)
        np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(dropout(jnp.asarray(x))))
    assert f.stats()["compiles"] == 1


def test_refused_key_schemes_name_the_remedy():
    x = pm.pad(_x(3), (8,))
    rbg = lambda x: jax.random.normal(jax.random.key(0, impl="unsafe_rbg"), x.shape)
    with pytest.raises(pm.UnsupportedError, match="partitionable threefry"):
        pm.mask(rbg, "n")(x)
    many = lambda x: jax.random.split(jax.random.key(0), x.shape[0])
    with pytest.raises(pm.UnsupportedError, match="PRNG keys with a dynamic shape"):
        pm.mask(many, "n")(x)
    prev = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        with pytest.raises(pm.UnsupportedError, match="jax_threefry_partitionable=True"):
            pm.mask(lambda x: jax.random.normal(jax.random.key(1), x.shape), "n")(x)
    finally:
        jax.config.update("jax_threefry_partitionable", prev)
