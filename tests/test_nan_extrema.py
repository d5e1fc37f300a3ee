"""A NaN reaches every max and min that reads it, at any bound.

XLA:CPU's ``reduce_max``/``reduce_min`` and max/min windows may drop a NaN
(openxla/xla#21461): a row of 64 with one NaN reduces to a number, in plain
``jax.jit`` too, while the same row 3 wide gives NaN. polymask reduces at the
bound's width, so without ``rules.util.keep_nan`` an example whose exact
``jax.jit`` program returns NaN got a number (the padded layout, ``polymask.jit``
and the packed layout's exact program). The reference here is NumPy
(``np.max`` propagates NaN, as ``jnp.max`` documents), on the exact arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import polymask as pm

BOUND = 64


def _data(n, width=4, nan_at=(1, 0), seed=0):
    x = np.random.default_rng(seed).normal(size=(n, width)).astype(np.float32)
    if nan_at is not None and n > nan_at[0]:
        x[nan_at] = np.nan
    return x


def _padded(x, bound=BOUND, seed=1):
    """``x`` padded along axis 0 with finite garbage (the drop needs finite
    neighbours: XLA's vector max keeps the other operand of a NaN)."""
    out = np.random.default_rng(seed).normal(size=(bound, *x.shape[1:])).astype(x.dtype)
    out[: x.shape[0]] = x
    return out


def _scores_max(x):
    return jnp.max(x @ x.T, axis=-1)


def _scores_min(x):
    return jnp.min(x @ x.T, axis=-1)


def _reference(fun, x):
    s = x.astype(np.float64) @ x.T.astype(np.float64)
    return (np.max if fun is _scores_max else np.min)(s, axis=-1)


def _same(out, ref):
    out = np.asarray(out, np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_allclose(out[~np.isnan(ref)], ref[~np.isnan(ref)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fun", [_scores_max, _scores_min])
def test_a_masked_max_keeps_a_nan_at_the_bounds_width(fun):
    f = pm.mask(fun, "n, 4")
    jf = jax.jit(f)
    with pytest.raises(pm.ShapeError, match="zero-size"):  # as plain JAX raises at n = 0
        f(pm.Masked(_padded(_data(0)), (0, 4)))
    for n in (1, 3, 17, 40):
        x = _data(n)
        ref = _reference(fun, x)
        eager = f(pm.Masked(_padded(x), (n, 4)))
        jitted = jf(pm.Masked(_padded(x), (jnp.int32(n), 4)))
        for out in (eager, jitted):
            _same(out.data[:n], ref)
    sizes = np.array([1, 3, 17, 40], np.int32)
    batch = np.stack([_padded(_data(int(n))) for n in sizes])
    out = jax.vmap(f)(pm.Masked(batch, (sizes, np.full(4, 4, np.int32))))
    for i, n in enumerate(sizes):
        _same(out.data[i, :n], _reference(fun, _data(int(n))))


def test_a_masked_max_over_a_static_axis_keeps_a_nan():
    # XLA:CPU drops the NaN from 4,096 entries up (64 x 64), not from 8 x 64
    f = pm.mask(lambda a: jnp.max(a, axis=-1), "n, 64")
    x = _data(40, width=64, nan_at=(2, 5))
    out = f(pm.Masked(_padded(x), (40, 64)))
    _same(out.data[:40], np.max(x.astype(np.float64), axis=-1))


def test_max_pooling_keeps_a_nan():
    def pool(a):  # windows of 8 along the static axis, 64 rows along the ragged one
        return lax.reduce_window(a, -jnp.inf, lax.max, (1, 8), (1, 8), "VALID")

    f = pm.mask(pool, "n, 64")
    x = _data(40, width=64, nan_at=(2, 5))
    out = jax.jit(f)(pm.Masked(_padded(x), (jnp.int32(40), 64))).data[:40]
    _same(out, x.reshape(40, 8, 8).astype(np.float64).max(-1))


def test_polymask_jit_keeps_a_nan_that_plain_jit_keeps():
    x = _data(3)
    plain = jax.jit(_scores_max)(x)
    assert np.isnan(np.asarray(plain)).all()  # 3 wide, XLA propagates it
    out = pm.jit(_scores_max, "n, 4", buckets=[BOUND], tiered=False)(x)
    _same(out, _reference(_scores_max, x))


@pytest.mark.parametrize("fun", [_scores_max, _scores_min])
def test_the_packed_layout_keeps_a_nan_in_its_example_only(fun):
    rm = pm.ragged_map(fun, "n, 4", layout="packed", row_size=BOUND)
    xs = [_data(3), _data(2, seed=1, nan_at=None), _data(40, seed=2, nan_at=(7, 2)),
          _data(5, seed=3, nan_at=None)]
    for out, x in zip(rm(xs), xs):
        _same(out, _reference(fun, x))


def test_packed_max_pooling_keeps_a_nan():
    def pool(a):  # windows of 8 along the static axis of each position
        return lax.reduce_window(a, -jnp.inf, lax.max, (1, 8), (1, 8), "VALID")

    rm = pm.ragged_map(pool, "n, 64", layout="packed", row_size=BOUND)
    xs = [_data(30, width=64, nan_at=(11, 1)), _data(20, width=64, seed=4, nan_at=None)]
    for out, x in zip(rm(xs), xs):
        _same(out, x.reshape(-1, 8, 8).astype(np.float64).max(-1))


@pytest.mark.parametrize("fun", [lambda x: jnp.max(x), lambda x: jnp.min(x),
                                 lambda x: jnp.max(jnp.mean(x, 0)), lambda x: jnp.max(x[0])])
def test_a_batch_of_per_example_extrema_keeps_each_nan(fun):
    """A max of a per-example value (no ragged axis left) is reduced for a whole
    call of examples at once, ``(examples, 4)``: at 1,024 or more entries
    XLA:CPU drops the NaN (found by the new-user check: 16 examples of 40
    packed, or padded batches of 1,024)."""
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(int(n), 4)).astype(np.float32) for n in rng.integers(20, 40, 1024)]
    for k in range(0, len(xs), 2):
        xs[k][0, k % 4] = np.nan
    refs = [np.asarray(jax.jit(fun)(x)) for x in xs]  # 4 to 160 entries: XLA keeps the NaN
    assert all(np.isnan(r).all() for r in refs[::2])
    for layout, kw in (("packed", dict(row_size=64)), ("padded", dict(batch_size=1024))):
        outs = pm.ragged_map(fun, "n, 4", layout=layout, **kw)(xs)
        for o, r in zip(outs, refs):
            _same(o, r.astype(np.float64))


@pytest.mark.parametrize("fn", [jnp.max, jnp.min, lambda x: jnp.max(x.reshape(-1)),
                                lambda x: jnp.min(x, axis=0)])
def test_a_complex_nan_last_in_a_max_or_min_stays_as_in_plain_jax(fn):
    """JAX's complex max/min selects on a lexicographic comparison: a NaN is
    kept only as the last element reduced (later elements replace it). The
    padding reduced after the last logical element replaced that NaN by the
    fill, -inf + 0j, a value that is no element at all (helper B)."""
    masked = pm.mask(fn, "n")
    for n in (1, 2, 5):
        for pos in range(n):
            x = (np.arange(n) + 1j * np.arange(n)[::-1]).astype(np.complex64)
            x[pos] = complex(np.nan, 1.0)
            want = jax.jit(fn)(x)
            for fill in (np.nan, 0.0):
                padded = np.full(8, fill, np.complex64)
                padded[:n] = x
                got = masked(pm.Masked(jnp.asarray(padded), (n,))).unpad()
                np.testing.assert_array_equal(got, want)
                got = jax.jit(masked)(pm.Masked(jnp.asarray(padded), (jnp.int32(n),))).unpad()
                np.testing.assert_array_equal(got, want)
