"""Least squares on a variable number of samples: ``pinv`` / ``lstsq`` (trace
patches computing a thin SVD from QR and a square SVD, ``rules/linalg_lstsq.py``),
and the singular-value functions on tall and wide dynamic matrices.

Sizes 0, 1, k-1, k, a middle one and the bound, NaN padding; eager (first
example), jit (one trace), vmap (a ragged batch) and grad.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import oracle

import polymask as pm
from polymask.testing import check_oracle, garbage_pad

K, BOUND = 3, 8
SIZES = (0, 1, K - 1, K, 5, BOUND)
TOL = dict(rtol=2e-4, atol=2e-4)


def mat(n, k, seed, deficient=False):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, k)).astype(np.float32)
    if deficient and k >= 3:
        a[:, 2] = a[:, 0] - 2 * a[:, 1]  # rank min(n, 2)
    return a


def vec(n, seed):
    return np.random.default_rng(seed + 100).normal(size=(n,)).astype(np.float32)


def pinv(a, b):
    return jnp.linalg.pinv(a)


def lstsq(a, b):
    return jnp.linalg.lstsq(a, b)  # (x, resid, rank, s)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
@pytest.mark.parametrize("fun", [pinv, lstsq])
@pytest.mark.parametrize("tall", [True, False])
def test_pinv_lstsq_well_conditioned(fun, tall):
    """(n, 3) samples x features, and the transposed (3, n) (n < 3: underdetermined)."""
    if tall:
        ex = [(mat(n, K, n), vec(n, n)) for n in SIZES]
        specs, bounds = ("n, 3", "n"), [(BOUND, K), (BOUND,)]
    else:
        ex = [(mat(K, n, n), vec(K, n)) for n in SIZES]
        specs, bounds = ("3, n", "3"), [(K, BOUND), (K,)]
    # grad: a size below, at and above k (n = 0 has no entries to differentiate)
    grad_ex = [ex[1], ex[3], ex[4]]
    check_oracle(fun, ex, bounds, specs, modes=("jit", "vmap"), static_sizes=False, **TOL)
    check_oracle(fun, ex[4:5], bounds, specs, modes=("eager",), **TOL)
    check_oracle(fun, grad_ex, bounds, specs, modes=("grad",), static_sizes=False, **TOL)


@pytest.mark.parametrize("fun", [pinv, lstsq])
def test_pinv_lstsq_rank_deficient_and_zero(fun):
    # rank 2 < 3 features; the zero matrix (rank 0): rank, s and the cutoff match
    ex = [(mat(n, K, 7 + n, deficient=True), vec(n, n)) for n in (2, K, 5, BOUND)]
    ex += [(np.zeros((4, K), np.float32), vec(4, 1))]
    check_oracle(fun, ex, [(BOUND, K), (BOUND,)], ("n, 3", "n"), modes=("jit", "vmap"),
                 static_sizes=False, **TOL)


def test_pinv_grad_rank_deficient():
    # JAX's custom JVP of pinv (Golub-Pereyra) is kept on the masked program
    ex = [(mat(n, K, 20 + n, deficient=True), vec(n, n)) for n in (K, 6)]
    check_oracle(pinv, ex, [(BOUND, K), (BOUND,)], ("n, 3", "n"), modes=("grad",),
                 static_sizes=False, **TOL)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_lstsq_both_axes_dynamic_matrix_rhs_rcond():
    def f(a, b):
        x, resid, rank, s = jnp.linalg.lstsq(a, b, rcond=1e-3)
        return x, resid, rank, s, jnp.linalg.pinv(a, rtol=1e-3)

    ex = [(mat(m, n, 3 * m + n), mat(m, 2, m)) for m, n in ((5, 2), (2, 5), (4, 4), (1, 3))]
    oracle(f, ex, [(6, 6), (6, 2)], ("m, n", "m, 2"), n_grad=2, **TOL)


@pytest.mark.parametrize("tall", [True, False])
def test_singular_value_functions(tall):
    def f(a):
        return (jnp.linalg.svd(a, compute_uv=False), jnp.linalg.norm(a, ord=2),
                jnp.linalg.qr(a)[1])

    def g(a):  # plain JAX raises at size 0 for these (an error case, tested below)
        return jnp.linalg.matrix_rank(a), jnp.linalg.cond(a)

    spec, bound = ("n, 3", (BOUND, K)) if tall else ("3, n", (K, BOUND))
    mk = (lambda n, s, d=False: mat(n, K, s, d)) if tall else (
        lambda n, s, d=False: mat(n, K, s, d).T.copy())
    ex = [(mk(n, n),) for n in SIZES]
    check_oracle(f, ex, [bound], spec, modes=("jit", "vmap"), static_sizes=False, **TOL)
    ex = [(mk(n, n),) for n in SIZES[1:]] + [(mk(5, 9, True),)]
    check_oracle(g, ex, [bound], spec, modes=("jit", "vmap"), static_sizes=False, **TOL)
    with pytest.raises(pm.ShapeError, match="as it does on the exact arrays"):
        pm.mask(g, spec)(pm.Masked(jnp.full(bound, jnp.nan), tuple(
            jnp.int32(0) if b == BOUND else b for b in bound)))


def test_polymask_jit_lstsq_one_compile():
    f = pm.jit(lambda a, b: jnp.linalg.lstsq(a, b)[0], ("n, 3", "n"),
               buckets=pm.buckets.pow2(16, maximum=16))
    for n in (4, 7, 11, 16):
        a, b = mat(n, K, n), vec(n, n)
        np.testing.assert_allclose(np.asarray(f(a, b)), jnp.linalg.lstsq(a, b)[0], **TOL)
    assert f.stats()["compiles"] == 1


def test_pinv_padded_buffer_values():
    # padding of the output is finite; the logical block is the pseudo-inverse
    a = mat(5, K, 1)
    out = pm.mask(jnp.linalg.pinv, "n, 3")(
        pm.Masked(jnp.asarray(garbage_pad(a, (BOUND, K))), (jnp.int32(5), K)))
    np.testing.assert_allclose(out.unpad(), np.linalg.pinv(a), **TOL)
    assert np.isfinite(np.asarray(out.data)).all()


def test_svd_vectors_non_square_still_refused():
    # LAPACK's signs of U / V depend on the matrix height (gesdd's QR-first path
    # for tall matrices): the zero-padded matrix's vectors differ in sign from
    # plain JAX's for some inputs, so they are refused rather than wrong.
    a = pm.Masked(jnp.ones((6, 3)), (jnp.int32(4), 3))
    with pytest.raises(pm.UnsupportedError, match="non-square logical matrix"):
        pm.mask(lambda a: jnp.linalg.svd(a, full_matrices=False), "n, 3")(a)


def test_outside_masked_trace_unchanged():
    a, b = mat(5, K, 2), vec(5, 2)
    np.testing.assert_allclose(jax.jit(jnp.linalg.lstsq)(a, b)[0],
                               np.linalg.lstsq(a, b, rcond=None)[0], **TOL)
