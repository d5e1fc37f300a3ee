"""``jnp.linalg.pinv`` and ``jnp.linalg.lstsq`` on dynamic matrix axes.

Both call ``svd(a, full_matrices=False)`` with singular vectors, which the
``svd`` rule refuses for a non-square logical matrix (``rules/linalg.py``).
Their results do not depend on the signs of the singular vectors (nor on the
basis chosen inside a repeated singular value, nor on the null-space
vectors: their reciprocal singular values are 0), so while a masked function
is traced, ``jnp.linalg.pinv`` / ``jnp.linalg.lstsq`` on a symbolic matrix
shape are routed to ``pinv_symbolic`` / ``lstsq_symbolic`` (trace patches of
the module-global helpers they call, ``_jax_compat/linalg.py``), which compute *a* thin SVD of ``a``
from primitives that are masked exactly, and then follow JAX's own formulas:

* ``m >= n`` (a Python comparison of the sizes: a case split when JAX cannot
  decide it): ``a = Q R`` (reduced QR, ``R`` square ``n x n``),
  ``R = U_r S V^H``, so ``a = (Q U_r) S V^H``.
* ``m < n``: ``a^H = Q R`` (``R`` square ``m x m``), ``R^H = U_r S V_r^H``,
  so ``a = U_r S (V_r^H Q^H)``.

Reduced QR of a tall logical matrix and the SVD of a square one are masked
exactly (identity embedding), and ``R`` has the singular values of ``a``, so
``s``, ``rank``, the cutoffs and the results equal plain JAX up to rounding.
The defaults follow JAX: ``pinv`` ``rtol = 10 * max(m, n) * eps`` and
``lstsq`` ``rcond = eps * max(m, n)`` with the *logical* sizes (the branch
fixes which is the larger); zero-size matrices give JAX's empty results.

Derivatives: ``pinv`` keeps JAX's custom JVP (Golub-Pereyra, products of
masked matrices only); ``lstsq`` is differentiated as plain JAX does it,
through the rectangular SVD: the thin SVD here carries JAX's SVD JVP formula
as a custom JVP (sign-covariant, so the derivative of the sign-invariant result is plain
JAX's), and the derivatives of QR and of the square SVD are never taken.

Singular vectors themselves (``jnp.linalg.svd(a, full_matrices=False)`` on a
non-square dynamic matrix) stay refused: LAPACK's signs depend on the matrix
height (``gesdd`` takes a QR-first path for tall matrices), so no padded
computation reproduces plain JAX's signs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from .._jax_compat import linalg as compat_linalg

__all__ = ["lstsq_symbolic", "pinv_symbolic"]

_PINV_MODULE, _PINV_NAME = compat_linalg.pinv_home()
_LSTSQ_MODULE, _LSTSQ_NAME = compat_linalg.lstsq_home()
_ORIGINAL_PINV = getattr(_PINV_MODULE, _PINV_NAME)
_ORIGINAL_LSTSQ = getattr(_LSTSQ_MODULE, _LSTSQ_NAME)
_HIGHEST = lax.Precision.HIGHEST


def _symbolic_matrix(a) -> bool:
    shape = jnp.shape(a)
    return len(shape) >= 2 and compat.is_symbolic_shape(shape[-2:])


def _h(x):
    return jnp.conj(jnp.swapaxes(x, -1, -2))


def _svd_factors(a, tall: bool):
    if tall:
        q, r = jnp.linalg.qr(a, mode="reduced")
        ur, s, vh = jnp.linalg.svd(r, full_matrices=False)
        return jnp.matmul(q, ur, precision=_HIGHEST), s, vh
    q, r = jnp.linalg.qr(_h(a), mode="reduced")
    u, s, vrh = jnp.linalg.svd(_h(r), full_matrices=False)
    return u, s, jnp.matmul(vrh, _h(q), precision=_HIGHEST)


def _thin_svd(a):
    """``(u, s, vh, tall)``: a thin SVD of ``a`` (``(..., m, n)``, both sizes
    >= 1) with vectors of any sign, from a reduced QR and the SVD of the square
    factor, and whether ``m >= n`` (the branch taken). Its derivative is JAX's
    SVD JVP (``jax._src.lax.linalg._svd_jvp_rule``, ``full_matrices=False``) on
    these factors: sign-covariant, so what pinv / lstsq compute from them
    differentiates as in plain JAX (the derivatives of QR and of the square SVD
    are never taken)."""
    m, n = a.shape[-2:]
    tall = bool(m >= n)  # a case split when JAX cannot decide it
    extra_u = tall and bool(m > n)  # JAX's JVP adds these terms only for m != n
    extra_v = not tall

    @jax.custom_jvp
    def svd(a):
        return _svd_factors(a, tall)

    @svd.defjvp
    def svd_jvp(primals, tangents):
        (a,), (da,) = primals, tangents
        u, s, vh = svd(a)
        mm = lambda x, y: jnp.matmul(x, y, precision=_HIGHEST)  # noqa: E731
        ut, v = _h(u), _h(vh)
        s_dim = s[..., None, :]
        s_col = jnp.swapaxes(s_dim, -1, -2)
        ds_full = mm(mm(ut, da), v)
        ds = jnp.real(jnp.diagonal(ds_full, 0, -2, -1))
        s_diffs = (s_dim + s_col) * (s_dim - s_col)
        eye = jnp.eye(s.shape[-1], dtype=s.dtype)
        f = 1 / (s_diffs + eye) - eye
        dss = s_dim.astype(a.dtype) * ds_full
        sds = s_col.astype(a.dtype) * ds_full
        s_zeros = (s == 0).astype(s.dtype)
        s_inv = 1 / (s + s_zeros) - s_zeros
        dudv_diag = .5 * (ds_full - _h(ds_full)) * (eye * s_inv[..., None, :]).astype(a.dtype)
        du = mm(u, f.astype(a.dtype) * (dss + _h(dss)) + dudv_diag)
        dv = mm(v, f.astype(a.dtype) * (sds + _h(sds)))
        if extra_u:
            dav = mm(da, v)
            du = du + (dav - mm(u, mm(ut, dav))) / s_dim.astype(a.dtype)
        if extra_v:
            dahu = mm(_h(da), u)
            dv = dv + (dahu - mm(v, mm(vh, dahu))) / s_dim.astype(a.dtype)
        return (u, s, vh), (du, ds, _h(dv))

    u, s, vh = svd(a)
    return u, s, vh, tall


def _size_value(d, dtype):
    return jnp.asarray(d, dtype) if compat.is_dim_expr(d) else np.asarray(d, dtype)


# ----------------------------------------------------------------------------
# pinv
# ----------------------------------------------------------------------------
def pinv_symbolic(a, rtol=None, hermitian: bool = False):
    """JAX's ``_pinv(a, rtol, hermitian)`` (behind ``jnp.linalg.pinv``) for a
    symbolic matrix shape (see the module docstring)."""
    if hermitian or not _symbolic_matrix(a):
        return _ORIGINAL_PINV(a, rtol, hermitian)
    a = jnp.asarray(a)
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        a = a.astype(jnp.result_type(a.dtype, jnp.float32))
    m, n = a.shape[-2:]
    if m == 0 or n == 0:
        return jnp.zeros(a.shape[:-2] + (n, m), a.dtype)
    real = jnp.finfo(a.dtype).dtype
    if rtol is None:
        big = m if m >= n else n
        rtol = (10. * _size_value(big, real)) * jnp.asarray(jnp.finfo(real).eps, real)
    rtol = jnp.broadcast_to(jnp.asarray(rtol, real), a.shape[:-2])
    tall = bool(m >= n)  # decided above (a case split when JAX cannot decide it)

    @jax.custom_jvp
    def _pinv(a, rtol):
        u, s, vh, _ = _thin_svd(jnp.conj(a))
        cutoff = rtol[..., None] * s[..., 0:1]
        s = jnp.where(s > cutoff, s, np.inf).astype(u.dtype)
        res = jnp.matmul(jnp.swapaxes(vh, -1, -2), jnp.swapaxes(u, -1, -2) / s[..., None],
                         precision=_HIGHEST)
        return res.astype(a.dtype)

    @_pinv.defjvp
    def _pinv_jvp(primals, tangents):
        # JAX's own rule (jax._src.numpy.linalg._pinv_jvp, Golub-Pereyra).
        a, rtol = primals
        a_dot, _ = tangents
        p = _pinv(a, rtol)
        mm = lambda x, y: jnp.matmul(x, y, precision=_HIGHEST)  # noqa: E731
        if tall:
            s = mm(mm(p, _h(p)), _h(a_dot))
            t = mm(mm(_h(a_dot), _h(p)), p)
            p_dot = -mm(mm(p, a_dot), p) + s - mm(mm(s, a), p) + t - mm(mm(p, a), t)
        else:
            s = mm(p, mm(_h(p), _h(a_dot)))
            t = mm(_h(a_dot), mm(_h(p), p))
            p_dot = -mm(p, mm(a_dot, p)) + s - mm(s, mm(a, p)) + t - mm(p, mm(a, t))
        return p, p_dot

    return _pinv(a, rtol)


# ----------------------------------------------------------------------------
# lstsq
# ----------------------------------------------------------------------------
def lstsq_symbolic(a, b, rcond=None):
    """JAX's ``_jit_lstsq(a, b, rcond)`` (behind ``jnp.linalg.lstsq`` with
    ``numpy_resid=False``) for a symbolic matrix shape (see the module
    docstring). ``numpy_resid=True`` is not routed: it branches in Python on
    the traced rank, which fails under any trace."""
    if not _symbolic_matrix(a):
        return _ORIGINAL_LSTSQ(a, b, rcond)
    a, b = jnp.asarray(a), jnp.asarray(b)
    dtype = jnp.result_type(a.dtype, b.dtype, jnp.float32)
    a, b = a.astype(dtype), b.astype(dtype)
    if a.shape[0] != b.shape[0]:
        raise ValueError("Leading dimensions of input arrays must match")
    b_orig_ndim = b.ndim
    if b_orig_ndim == 1:
        b = b[:, None]
    if a.ndim != 2:
        raise TypeError(f"{a.ndim}-dimensional array given. Array must be two-dimensional")
    if b.ndim != 2:
        raise TypeError(f"{b.ndim}-dimensional array given. Array must be one or "
                        "two-dimensional")
    m, n = a.shape
    real = jnp.finfo(dtype).dtype
    eps = jnp.asarray(jnp.finfo(dtype).eps, real)
    if m == 0 or n == 0:
        s = jnp.zeros((0,), dtype)
        rank = jnp.array(0, dtype=int)
        x = jnp.zeros((n, *b.shape[1:]), dtype)
    else:
        if rcond is None:
            rcond = eps * _size_value(m if m >= n else n, real)
        else:
            rcond = jnp.where(rcond < 0, eps, rcond)
        u, s, vt, _ = _thin_svd(a)
        mask = (s > 0) & (s >= jnp.asarray(rcond, dtype=s.dtype) * s[0])
        rank = mask.sum()
        safe_s = jnp.where(mask, s, 1).astype(dtype)
        s_inv = jnp.where(mask, 1 / safe_s, 0)[:, None]
        utb = jnp.matmul(jnp.conj(u).T, b, precision=_HIGHEST)
        x = jnp.matmul(jnp.conj(vt).T, s_inv * utb, precision=_HIGHEST)
    b_estimate = jnp.matmul(a, x, precision=_HIGHEST)
    resid = jnp.linalg.norm(b - b_estimate, axis=0) ** 2
    if b_orig_ndim == 1:
        x = x.ravel()
    return x, resid, rank, s


compat.replace_during_trace("jnp.linalg.pinv (_pinv)", pinv_symbolic)
compat.replace_during_trace("jnp.linalg.lstsq (_jit_lstsq)", lstsq_symbolic)
