"""Linear algebra on dynamic square / rectangular / batch axes (issue 5, item 4).

The logical matrix is embedded in an identity block; each case runs the oracle
(eager, static sizes, jit with one trace, vmap ragged batch, grad with NaN
padding). Sizes include 0 and the bound.
"""

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import polymask as pm
from polymask._jax_compat import testing as jax_private
from polymask.testing import check_oracle, garbage_pad

RNG = np.random.default_rng(0)
TOL = dict(rtol=2e-4, atol=2e-4)
# The eager modes dispatch op by op (a compile per op and shape): keep them for
# the acceptance case and use jit / vmap / grad elsewhere to keep the file fast.
FAST = dict(TOL, modes=("jit", "vmap", "grad"), static_sizes=False)


def spd(n, rng=RNG):
    a = rng.normal(size=(n, n)).astype(np.float32)
    return (a @ a.T + n * np.eye(n)).astype(np.float32)


def gen(n, rng=RNG):
    # Diagonally weighted so that LU pivots are unambiguous and solves are stable.
    return (rng.normal(size=(n, n)) + 2 * np.eye(n)).astype(np.float32)


def vec(*shape, rng=RNG):
    return rng.normal(size=shape).astype(np.float32)


def requires(*prims):
    """The rules a test relies on must be registered (a missing one is an error, not a skip)."""
    missing = [p for p in prims if pm.rules.get_rule(p) is None]
    assert not missing, f"masking rules not registered: {missing}"
    return lambda test: test


def cho_solve(a, b):
    return jsl.cho_solve(jsl.cho_factor(a), b)


# --------------------------------------------------------------------------
# Acceptance: Cholesky solve on a logical n x n SPD matrix, larger bound
# --------------------------------------------------------------------------
@requires("gather")
def test_cholesky_solve_oracle():
    ex = [(spd(n), vec(n)) for n in (1, 5, 7)]
    check_oracle(cho_solve, ex, [(8, 8), (8,)], ("n, n", "n"), **TOL)


@requires("gather")
def test_cholesky_solve_values_and_one_trace():
    f = pm.mask(cho_solve, ("n, n", "n"))
    traces = []

    def g(a, b):
        traces.append(1)
        return f(a, b)

    jg = jax.jit(g)
    for n in (2, 5, 6):
        a, b = spd(n), vec(n)
        out = jg(pm.Masked(jnp.asarray(garbage_pad(a, (9, 9))), (jnp.int32(n), jnp.int32(n))),
                 pm.Masked(jnp.asarray(garbage_pad(b, (9,))), (jnp.int32(n),)))
        np.testing.assert_allclose(out.unpad(), np.linalg.solve(a, b), rtol=1e-4, atol=1e-4)
        assert int(out.shape[0]) == n
    assert len(traces) == 1


def test_cholesky_primitive_and_triangular_solve():
    def tri(a, b):
        l_ = jnp.linalg.cholesky(a)
        return l_, jsl.solve_triangular(l_, b, lower=True)

    ex = [(spd(n), vec(n, k)) for n, k in ((1, 2), (5, 3), (0, 2))]
    check_oracle(tri, ex, [(6, 6), (6, 4)], ("n, n", "n, k"), **FAST)


@pytest.mark.parametrize("left_side,lower,transpose_a,unit", [
    (True, True, False, False), (True, False, True, False),
    (False, True, False, True), (False, False, True, False)])
def test_triangular_solve_variants(left_side, lower, transpose_a, unit):
    def f(a, b):
        return lax.linalg.triangular_solve(a, b, left_side=left_side, lower=lower,
                                           transpose_a=transpose_a, unit_diagonal=unit)

    def mk(n, k):
        a = np.tril(gen(n)) if lower else np.triu(gen(n))
        b = vec(n, k) if left_side else vec(k, n)
        return a, b

    ex = [mk(n, k) for n, k in ((2, 3), (5, 2))]
    spec_b = "n, k" if left_side else "k, n"
    bound_b = (6, 4) if left_side else (4, 6)
    check_oracle(f, ex, [(6, 6), bound_b], ("n, n", spec_b), **FAST)


# --------------------------------------------------------------------------
# LU: factors, pivots and permutation equal the unpadded ones
# --------------------------------------------------------------------------
def test_lu_pivots_and_permutation_exact():
    def f(a):
        return lax.linalg.lu(a)

    ex = [(gen(n),) for n in (1, 3, 6)] + [(RNG.normal(size=(4, 4)).astype(np.float32),)]
    check_oracle(f, ex, [(6, 6)], "n, n", modes=("jit", "vmap"), static_sizes=False, **TOL)
    # padding pivots / permutation are the identity (k -> k)
    out = pm.mask(f, "n, n")(pm.Masked(jnp.asarray(garbage_pad(gen(3), (6, 6))), (3, 3)))
    np.testing.assert_array_equal(np.asarray(out[1].data)[3:], [3, 4, 5])
    np.testing.assert_array_equal(np.asarray(out[2].data)[3:], [3, 4, 5])


def test_scipy_lu_and_rectangular():
    check_oracle(jsl.lu, [(gen(n),) for n in (1, 3, 5)], [(6, 6)], "n, n", **FAST)
    # wide and tall logical matrices: padding steps never permute logical rows
    ex = [(vec(m, n),) for m, n in ((2, 5), (5, 2), (3, 3), (4, 1))]
    check_oracle(lambda a: lax.linalg.lu(a), ex, [(6, 7)], "m, n", modes=("jit",),
                 static_sizes=False, **TOL)


def test_lu_pivots_to_permutation():
    def f(a):
        _, piv, _ = lax.linalg.lu(a)
        return lax.linalg.lu_pivots_to_permutation(piv, a.shape[0])

    check_oracle(f, [(vec(n, n),) for n in (1, 4, 6)], [(7, 7)], "n, n",
                 modes=("jit", "vmap"), static_sizes=False)


# --------------------------------------------------------------------------
# jnp.linalg: solve, inv, det, slogdet
# --------------------------------------------------------------------------
@requires("gather", "sort")
def test_solve():
    ex = [(gen(n), vec(n)) for n in (1, 3, 6)]
    check_oracle(jnp.linalg.solve, ex, [(6, 6), (6,)], ("n, n", "n"), **FAST)
    ex = [(gen(n), vec(n, 2)) for n in (2, 5)]
    check_oracle(jnp.linalg.solve, ex, [(6, 6), (6, 2)], ("n, n", "n, 2"), modes=("jit",),
                 static_sizes=False, **TOL)


def test_inv():
    ex = [(gen(n),) for n in (1, 3, 5)]
    check_oracle(jnp.linalg.inv, ex, [(6, 6)], "n, n", **FAST)


def test_det_slogdet():
    ex = [(gen(n),) for n in (2, 3, 5)]
    check_oracle(lambda a: (jnp.linalg.det(a), *jnp.linalg.slogdet(a)), ex, [(6, 6)],
         "n, n", **FAST)
    # values (not gradients) also at n = 1 and n = bound
    ex = [(gen(n),) for n in (1, 6)]
    check_oracle(jnp.linalg.det, ex, [(6, 6)], "n, n", modes=("jit", "vmap"),
         static_sizes=False, **TOL)


def test_det_grad_size_one():
    # JAX's det JVP branches on `a.shape[-1] == 1` in Python: a case split.
    check_oracle(jnp.linalg.det, [(gen(1),), (gen(2),)], [(4, 4)], "n, n", modes=("grad",),
         static_sizes=False, **TOL)


def test_det_grad_over_a_batch_axis_taken_outside_the_mask():
    # brax's inv_3x3 (found from outside, session 63): jnp.linalg.det's JVP
    # rule, JAX's own, compares the batch size; it was traced only when
    # differentiated, after the cases were chosen, and refused at every n
    rng = np.random.default_rng(3)
    batch = (rng.normal(size=(6, 3, 3)) + 2 * np.eye(3)).astype(np.float32)
    check_oracle(jnp.linalg.det, [(batch[:n],) for n in (5, 1, 6)], [(6, 3, 3)], "n, 3, 3",
                 modes=("grad",), static_sizes=False, **TOL)


def test_det_of_empty_matrix_is_one():
    f = pm.mask(jnp.linalg.det, "n, n")
    out = f(pm.Masked(jnp.full((4, 4), jnp.nan), (jnp.int32(0), jnp.int32(0))))
    assert float(out.data) == 1.0


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_custom_linear_solve_symmetric_transpose_and_aux():
    def f(a, b):
        def solve(_mv, x):
            return jnp.linalg.solve(a, x)

        def tsolve(_vm, x):
            return jnp.linalg.solve(a.T, x)

        def solve_aux(_mv, x):
            return jnp.linalg.solve(a, x), jnp.sum(x)

        mv = lambda x: a @ x  # noqa: E731
        return (lax.custom_linear_solve(mv, b, solve, symmetric=True),
                lax.custom_linear_solve(mv, b, solve, tsolve),
                lax.custom_linear_solve(mv, b, solve_aux, symmetric=True, has_aux=True))

    ex = [(spd(n), vec(n)) for n in (1, 3, 5)]
    check_oracle(f, ex, [(6, 6), (6,)], ("n, n", "n"), **FAST)


def test_custom_linear_solve_whose_solve_calls_a_slicing_matvec():
    """jax.scipy.sparse.linalg.cg's shape: the solve calls the matvec, which
    slices the dynamic axis (a stencil). JAX traces the two functions apart;
    a size computed in the matvec's trace leaked into the solve's under jit
    (UnexpectedTracerError; helper A, jax-cfd / jax.scipy programs)."""
    def f(b):
        mv = lambda x: 2 * x - jnp.concatenate([x[1:], jnp.zeros(1)])  # noqa: E731
        return lax.custom_linear_solve(mv, b, solve=lambda m, r: r - 0.1 * m(r),
                                       symmetric=True)

    def cg(b):
        mv = lambda x: 2.5 * x - jnp.pad(x[1:], (0, 1)) - jnp.pad(x[:-1], (1, 0))  # noqa: E731
        return jax.scipy.sparse.linalg.cg(mv, b, maxiter=8)[0]

    ex = [(vec(n),) for n in (0, 1, 3, 6)]
    check_oracle(f, ex, [(6,)], "n", modes=("eager", "jit", "vmap", "grad"), rtol=1e-5,
                 atol=1e-6)
    check_oracle(cg, [(vec(n),) for n in (1, 4, 6)], [(6,)], "n", modes=("jit", "grad"),
                 rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------
# Dynamic batch axes (ragged batches of matrices)
# --------------------------------------------------------------------------
def test_dynamic_batch_and_matrix_axes():
    def f(a, b):
        l_ = jnp.linalg.cholesky(a)
        y = lax.linalg.triangular_solve(l_, b, left_side=True, lower=True)
        return lax.linalg.triangular_solve(l_, y, left_side=True, lower=True, transpose_a=True)

    ex = [(np.stack([spd(n) for _ in range(b)]), vec(b, n, 2)) for b, n in ((1, 3), (3, 2),
                                                                              (2, 5))]
    check_oracle(f, ex, [(3, 5, 5), (3, 5, 2)], ("b, n, n", "b, n, 2"), **FAST)


def test_static_matrix_dynamic_batch():
    ex = [(np.stack([spd(3) for _ in range(b)]),) for b in (1, 2, 4)]
    check_oracle(jnp.linalg.cholesky, ex, [(4, 3, 3)], "b, 3, 3", modes=("jit", "vmap"),
                 static_sizes=False, **TOL)


# --------------------------------------------------------------------------
# eigh, qr, svd values, fft
# --------------------------------------------------------------------------
def test_eigh():
    ex = [(spd(n),) for n in (1, 3, 5)]
    # eigenvalues and eigenvectors (padding eigenvalues sort after the logical ones)
    check_oracle(jnp.linalg.eigh, ex, [(6, 6)], "n, n", **FAST)


def test_qr():
    ex = [(gen(n),) for n in (1, 3, 5)]
    check_oracle(jnp.linalg.qr, ex, [(6, 6)], "n, n", **FAST)
    ex = [(vec(m, n),) for m, n in ((5, 2), (2, 5), (3, 3))]
    check_oracle(lambda a: [jnp.linalg.qr(a, mode=mode) for mode in ("reduced", "complete")],
                 ex, [(6, 6)], "m, n", modes=("jit", "vmap"), static_sizes=False, **TOL)


def test_svd_vectors_square():
    # padding singular values sort first; the outputs are rolled back. Its own
    # generator: singular vectors are unique up to sign only for well separated
    # singular values, so the inputs must not depend on the tests run before.
    rng = np.random.default_rng(11)
    check_oracle(jnp.linalg.svd, [(gen(n, rng),) for n in (1, 3, 5)], [(6, 6)], "n, n", **FAST)
    check_oracle(lambda a: jnp.linalg.svd(a, full_matrices=False),
                 [(gen(n, rng),) for n in (2, 5)], [(5, 7)], "n, n", modes=("jit", "vmap"),
                 static_sizes=False, **TOL)


@pytest.mark.parametrize("dtype", [np.float32, np.complex64])
def test_svd_vectors_of_a_one_by_one_matrix_carry_its_sign_in_u(dtype):
    """LAPACK factors [[a]] as u = a / |a|, vt = 1; the padded matrix put the
    sign in vt (u = 1, vt = -1 for [[-2]]: found by an API sweep from
    outside). Values, gradients, jit and vmap against plain JAX."""
    ex = [(np.array([[a]], dtype),) for a in (-2.0, 3.0, -0.0)]
    if dtype == np.complex64:
        ex = [(np.array([[a]], dtype),) for a in (3j, -2 + 1j, 0.5)]
    check_oracle(jnp.linalg.svd, ex, [(4, 4)], "n, n", modes=("eager", "jit", "vmap"),
                 static_sizes=False, **TOL)
    if dtype == np.float32:  # (complex: grad of a complex output's phase is not real)
        check_oracle(jnp.linalg.svd, ex[:2], [(4, 4)], "n, n", modes=("grad",),
                     static_sizes=False, **TOL)
    # a NaN: plain JAX's NaN (not a sign of 1); an inf: NaN everywhere (limitations.md)
    nan = pm.mask(jnp.linalg.svd, "n, n")(pm.pad(np.array([[np.nan]], dtype), (4, 4)))
    for out, want in zip(nan, jnp.linalg.svd(np.array([[np.nan]], dtype))):
        np.testing.assert_array_equal(out.unpad(), want)
    inf = pm.mask(jnp.linalg.svd, "n, n")(pm.pad(np.array([[np.inf]], dtype), (4, 4)))
    assert all(np.isnan(np.asarray(o.unpad())).all() for o in inf)


def test_svd_values():
    ex = [(vec(m, n),) for m, n in ((5, 2), (2, 5), (3, 3), (1, 4))]
    check_oracle(lambda a: jnp.linalg.svd(a, compute_uv=False), ex, [(6, 6)], "m, n", **FAST)


def test_eig_dynamic_batch_only():
    def f(x):
        return jnp.sort(jnp.abs(jnp.linalg.eigvals(x)), axis=-1)

    ex = [(vec(b, 3, 3),) for b in (1, 3)]
    check_oracle(f, ex, [(4, 3, 3)], "b, 3, 3", modes=("jit", "vmap"), static_sizes=False, **TOL)


def test_unsupported_have_reasons():
    a = pm.Masked(jnp.eye(4), (jnp.int32(3), jnp.int32(3)))
    with pytest.raises(pm.UnsupportedError, match="non-square logical matrix"):
        pm.mask(jnp.linalg.svd, "m, n")(a)
    with pytest.raises(pm.UnsupportedError, match="fft along a dynamic axis with a bound"):
        pm.mask(jnp.fft.fft, "n")(pm.Masked(jnp.ones(23171), (jnp.int32(3),)))
    with pytest.raises(pm.UnsupportedError, match="eig on a dynamic matrix axis"):
        pm.mask(lambda x: jnp.linalg.eigvals(x), "n, n")(a)


def test_fft_static_axis_dynamic_batch():
    ex = [(vec(b, 8),) for b in (1, 3)]
    check_oracle(lambda x: jnp.abs(jnp.fft.fft(x)), ex, [(4, 8)], "b, 8", **FAST)


def test_fft_dynamic_axis_bluestein():
    # the harness differentiates real outputs: take real / imaginary parts
    def f(x):
        y = jnp.fft.fft(x)
        z = jnp.fft.ifft(y * 1j + x)
        return jnp.real(y), jnp.imag(z), jnp.abs(jnp.fft.rfft(x))

    check_oracle(f, [(vec(n),) for n in (1, 6, 9)], [(9,)], "n", **FAST)


def test_fft_lengths_computed_from_sizes():
    """hyena's fft_conv, rfft(u, n=2 * T) and irfft(..., n=2 * T): JAX takes the
    lengths as ints (operator.index), so a length computed from a size was
    traced size by size and refused past the per-size limit (helper A,
    session 60). The lengths stay dimension expressions now: cropping, zero
    padding and irfft's own n // 2 + 1 input as JAX does them."""
    def hyena(u):
        k = jnp.cos(u)
        T = u.shape[0]
        y = jnp.fft.irfft(jnp.fft.rfft(u, n=2 * T) * jnp.fft.rfft(k, n=2 * T), n=2 * T)
        return y[:T]

    def lengths(u):
        return (jnp.fft.irfft(jnp.fft.rfft(u), n=u.shape[0]),  # odd n: not 2 * (m - 1)
                jnp.abs(jnp.fft.fft(u, n=u.shape[0] + 3, norm="ortho")),
                jnp.abs(jnp.fft.ifft(u, n=(u.shape[0] + 1) // 2)))  # cropped

    for f in (hyena, lengths):
        check_oracle(f, [(vec(n),) for n in (1, 4, 7)], [(40,)], "n", **FAST)
    with pytest.raises(pm.ShapeError, match="Shape should be positive"):
        pm.mask(hyena, "n")(pm.Masked(jnp.ones(40), (0,)))


def test_polyval_of_a_dynamic_number_of_coefficients():
    """jax 0.12's jnp.polyval builds a Python list of the coefficients
    (lax.polynomial): a dynamic count was traced per size and refused past
    the per-size limit (0.10 / 0.11 scan over them). Horner's rule as a scan
    in a masked trace, on every version; a data-dependent count too."""
    x = jnp.asarray([0.5, -1.5, 2.0])
    check_oracle(lambda p: jnp.polyval(p, x), [(vec(n),) for n in (0, 1, 5)], [(40,)], "n",
                 **FAST)
    sel = pm.mask(lambda p: jnp.polyval(pm.boolean_mask(p, p > 0), 2.0), "n")
    p = vec(40)
    for n in (0, 3, 40):
        want = jnp.polyval(p[:n][p[:n] > 0], 2.0)
        np.testing.assert_allclose(sel(pm.Masked(p, (n,))).data, want, rtol=1e-5)


def test_fft2_and_irfft_dynamic_axes():
    def f(x):
        return jnp.real(jnp.fft.fft2(x)), jnp.fft.irfft2(jnp.fft.rfft2(x) * 2.0)

    ex = [(vec(m, n),) for m, n in ((2, 4), (4, 2))]
    check_oracle(f, ex, [(5, 6)], "m, 2*k", **FAST)


def test_gradient_under_jit_and_vmap_past_a_case_with_an_empty_irfft():
    """jax-cfd's exponential filter, x of shape (n, n): the case of n = 1 has
    an irfft to length 0, whose transpose (JAX's 1 / prod(fft_lengths))
    raised ZeroDivisionError while JAX transposed every branch of the cases'
    switch: jax.jit(jax.grad) and jax.vmap(jax.grad) failed at every size
    (found from outside). An empty result is now zeros, no transform."""
    def f(x):
        n = x.shape[0]
        k = jnp.fft.fftfreq(n)[:, None] ** 2 + jnp.fft.rfftfreq(n)[None, :] ** 2
        return jnp.sum(jnp.fft.irfft2(jnp.exp(-k) * jnp.fft.rfft2(x)) ** 2)

    x = np.random.default_rng(0).normal(size=(6, 6)).astype(np.float32)
    m = pm.mask(f, "n, n")
    loss = lambda d, n: m(pm.Masked(d, (n, n))).data  # noqa: E731
    grad = jax.jit(jax.grad(loss))
    sizes = [2, 3, 5, 6]
    batched = jax.vmap(jax.grad(loss), (None, 0))(jnp.asarray(x), jnp.array(sizes))
    for i, n in enumerate(sizes):
        want = jax.grad(f)(jnp.asarray(x[:n, :n]))
        for g in (grad(jnp.asarray(x), n), batched[i]):
            np.testing.assert_allclose(g[:n, :n], want, rtol=2e-4, atol=2e-5)
            assert not np.any(np.asarray(g)[n:]) and not np.any(np.asarray(g)[:, n:])


# --------------------------------------------------------------------------
# Property test: every size from 0 to the bound, including the NaN padding
# --------------------------------------------------------------------------
@requires("gather")
@given(n=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_property_cholesky_solve_sizes(n, seed):
    rng = np.random.default_rng(seed)
    a, b = spd(n, rng), vec(n, rng=rng)
    f = _MASKED_CHO
    out = f(pm.Masked(jnp.asarray(garbage_pad(a, (6, 6))), (jnp.int32(n), jnp.int32(n))),
            pm.Masked(jnp.asarray(garbage_pad(b, (6,))), (jnp.int32(n),)))
    want = np.linalg.solve(a, b) if n else np.zeros(0, np.float32)
    np.testing.assert_allclose(out.unpad(), want, rtol=1e-3, atol=1e-3)
    pad = np.asarray(out.data)[n:]
    assert np.all(np.isfinite(pad))


_MASKED_CHO = jax.jit(pm.mask(cho_solve, ("n, n", "n")))


@given(n=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_property_lu(n, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, n)).astype(np.float32)
    lu, piv, perm = _MASKED_LU(pm.Masked(jnp.asarray(garbage_pad(a, (6, 6))),
                                         (jnp.int32(n), jnp.int32(n))))
    rlu, rpiv, rperm = lax.linalg.lu(jnp.asarray(a))
    np.testing.assert_allclose(lu.unpad(), rlu, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(piv.unpad(), rpiv)
    np.testing.assert_array_equal(perm.unpad(), rperm)


_MASKED_LU = jax.jit(pm.mask(lambda a: lax.linalg.lu(a), "n, n"))


def test_rfft_of_an_empty_dynamic_axis_raises_like_plain_jax():
    with pytest.raises(ValueError, match="Cannot lower"):  # plain JAX fails to lower it
        jnp.fft.rfft(jnp.zeros(0))
    m = pm.mask(jnp.fft.rfft, "n")
    with pytest.raises(pm.ShapeError, match="rfft of an axis of length 0"):
        m(pm.pad(np.zeros(0, np.float32), (8,)))
    x = np.arange(1.0, 4.0, dtype=np.float32)
    out = m(pm.pad(x, (8,)))
    assert tuple(out.shape) == (2,)
    np.testing.assert_allclose(np.asarray(out.data)[:2], np.fft.rfft(x), rtol=1e-5, atol=1e-5)


def test_rfft_length_zero_is_an_error_case_for_formulas_and_the_runner():
    def f(x):
        return jnp.fft.rfft(x * 2)

    sf = pm.shape_formula(f, "n", (8,))
    with pytest.raises(pm.ShapeError, match="rfft of an axis of length 0"):
        sf.evaluate(n=0)  # plain JAX raises there; the formula gave (1,) before
    assert sf.evaluate(n=1) == (1,) and sf.evaluate(n=5) == (3,)
    g = pm.jit(f, "n")
    with pytest.raises(pm.ShapeError, match="rfft of an axis of length 0") as e:
        g(np.zeros(0, np.float32))  # on the host, before running (not a runtime error)
    assert "test_linalg.py" in str(e.value)  # the user's line
    # plain JAX's own failure there: no remedy for code that needs a size as a value
    assert "as it does on the exact arrays" in str(e.value) and "max_cases" not in str(e.value)
    x = np.arange(1.0, 6.0, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(g(x)), np.fft.rfft(2 * x), rtol=1e-5, atol=1e-5)
    fixed = pm.shape_formula(lambda x: jnp.fft.rfft(x, n=4), "n", (8,))  # a static length
    assert fixed.evaluate(n=0) == (3,)


def test_qr_gradient_with_a_dynamic_column_count():
    # a tall logical matrix with padded columns: the padding columns [n, m) are
    # zero in the embedding, r[k, k] = 0 there and JAX's QR JVP gave NaN
    # gradients; tall, wide and square logical shapes, batched too
    rng = np.random.default_rng(11)
    a = rng.normal(size=(7, 5)).astype(np.float32)
    both = lambda x: jnp.linalg.qr(x)[0].sum() * jnp.linalg.qr(x)[1]
    check_oracle(both, [(a[:, :4],), (a[:5, :2],), (a[:2, :4],), (a[:1, :1],)], [(9, 4)],
                 ("m, n",))
    check_oracle(both, [(np.stack([a[:5, :2]] * 2),), (np.stack([a[:2, :4]] * 2),)],
                 [(3, 6, 6)], ("b, m, n",))


def test_householder_qr_in_lapack_form_on_dynamic_matrix_axes():
    """geqrf (reflectors and taus), householder_product (Q) and ormqr (Q applied
    to a matrix) of the logical block: lineax's QR solver and optimistix's
    Gauss-Newton / Levenberg-Marquardt call them directly."""

    def f(x, c):
        a, taus = jax_private.geqrf(x)
        q = lax.linalg.householder_product(a, taus)
        qtc = jax_private.ormqr(a, taus, c, left=True, transpose=True)
        return a, taus, q, qtc

    rng = np.random.default_rng(0)
    exs = [(rng.normal(size=(m, k)).astype(np.float32), rng.normal(size=(m, 2)).astype(np.float32))
           for m, k in ((5, 3), (3, 3), (9, 1), (0, 0), (7, 7))]
    # (no m x 0 matrix with m > 0: jaxlib 0.12's XLA:CPU aborts compiling the plain
    # reference's ormqr there, SIGFPE, before polymask runs)
    check_oracle(f, exs, [(9, 7), (9, 2)], ("m, k", "m, 2"), modes=("eager", "jit", "vmap"),
                 rtol=1e-4, atol=1e-5)


def test_gradients_through_custom_linear_solve_transpose_det_and_lstsq():
    # det's gradient (n >= 4: LU) and lstsq's (n <= 3) transpose the matvec of
    # a custom_linear_solve as it is; a gather's out-of-bounds gradient guard
    # (a stop_gradient) in it had no transpose rule: NotImplementedError
    rng = np.random.default_rng(0)
    cases = [(jnp.linalg.det, "n, n", lambda n: (n, n), (8, 8)),
             (lambda a: jnp.linalg.lstsq(a, jnp.ones(a.shape[0]))[0], "n, 3",
              lambda n: (n, 3), (8, 3))]
    for f, spec, shape, bound in cases:
        mf = pm.mask(f, (spec,))
        for n in (2, 4, 5):
            a = rng.normal(size=shape(n)).astype(np.float32)
            want = jax.grad(lambda a: jnp.sum(f(a)))(jnp.asarray(a))

            def loss(d, n=n):
                out = mf(pm.Masked(d, shape(n)))
                return jnp.sum(jnp.where(out.valid(), out.data, 0))

            got = jax.grad(loss)(jnp.asarray(garbage_pad(a, bound)))
            np.testing.assert_allclose(got[:shape(n)[0], :shape(n)[1]], want, rtol=2e-4,
                                       atol=2e-5)


@pytest.mark.parametrize("n, bound", [(3, 8), (3, 64), (20, 64)])
def test_eigh_and_svd_of_a_non_finite_matrix_never_return_a_number_for_a_nan(n, bound):
    """Plain JAX's eigh of a matrix holding NaN has NaN eigenvalues below 32 x 32
    and none from 32 up (on one XLA:CPU host), so the padded solve at a bound of 64 gave
    ``[1, nan, nan]`` for plain JAX's ``[nan, nan, 1]``, and a point cloud of
    no points a PCA normal of ``[1, nan, nan]``: a NaN matrix now gives NaN
    everywhere. An inf no longer makes the padding block inf (plain JAX's
    values), and svd's vectors of a matrix holding inf are NaN, not LAPACK's
    zeros."""
    m = pm.mask(jnp.linalg.eigh, "n, n")
    nan = np.eye(n, dtype=np.float32)
    nan[0, 1] = nan[1, 0] = np.nan
    w, v = (o.unpad() for o in m(pm.pad(nan, (bound, bound))))
    assert np.isnan(w).all() and np.isnan(v).all()
    inf = 2 * np.eye(n, dtype=np.float32)
    inf[0, 0], inf[1, 2], inf[2, 1] = np.inf, 0.5, 0.5
    w, v = (o.unpad() for o in m(pm.pad(inf, (bound, bound))))
    pw, pv = jax.jit(jnp.linalg.eigh)(inf)
    np.testing.assert_allclose(w, pw, atol=1e-5, equal_nan=True)
    np.testing.assert_allclose(v, pv, atol=1e-5, equal_nan=True)
    inf = 2 * np.eye(n, dtype=np.float32)
    inf[0, 1] = np.inf
    outs = pm.mask(jnp.linalg.svd, "n, n")(pm.pad(inf, (bound, bound)))
    assert all(np.isnan(o.unpad()).all() for o in outs)


def test_pca_normal_of_no_points_is_nan_as_under_jax_jit():
    def pca_normal(x):
        c = x - x.mean(0)
        w, v = jnp.linalg.eigh(c.T @ c / x.shape[0])
        return v[:, 0]

    x = np.zeros((0, 3), np.float32)
    assert np.isnan(jax.jit(pca_normal)(x)).all()
    assert np.isnan(pm.jit(pca_normal, tiered=True)(x)).all()  # a covering bucket of 128
