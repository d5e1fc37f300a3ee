"""Linear algebra on dynamic square, rectangular and batch axes.

The logical matrix is embedded in an identity block (DESIGN.md): the padding
rows and columns hold 1 on the diagonal and 0 elsewhere, written with
``select`` so garbage (NaN, inf) never reaches the factorisation. For a
square logical ``A`` padded to ``N``::

    E = [[A, 0],
         [0, I]]

is block diagonal, so every factorisation of ``E`` is the factorisation of
``A`` in the leading block and of ``I`` in the trailing one: Cholesky gives
``blockdiag(L, I)``, LU with partial pivoting gives ``blockdiag(LU, I)`` with
pivots/permutation equal to the unpadded ones on the logical region and the
identity (``k -> k``) in padding (no padding row is ever a better pivot: its
entries in logical columns are exactly 0), ``det(E) = det(A)``. Right-hand
sides get zero padding, so solutions are 0 in padding. Padded batch elements
become identity matrices (finite, invertible).

For rectangular ``(m, n)`` matrices the 1s sit at ``(k, k)`` for every padding
*row* ``k >= m``; padding columns ``k`` in ``[n, m)`` of a tall matrix are all
zero, which makes the extra LU steps take the zero pivot in place (LAPACK's
``getrf`` skips the swap and the scaling for a zero pivot) and the extra QR
reflectors trivial (``tau = 0``), so logical rows are never permuted or
reflected by padding steps.

Backward pass: JAX differentiates the padded program. Every float output is
``select``-ed back to its embedding on the padding, so cotangents arriving in
padding (possibly NaN) are dropped by the select's transpose, and the
factors the JVP rules read (``L``, ``U``, ``R``) are finite and invertible.

``eigh`` / ``svd``: padding eigenvalues (singular values) are distinct values
``c + k`` above the Gershgorin bound (Frobenius norm), so they never tie with
the logical spectrum; eigh's ascending order keeps the logical eigenvalues
first, svd's descending order puts the padding first and the outputs are
rolled back by the padding count.

Unsupported (``UnsupportedError`` with the reason) when a matrix axis is
dynamic: ``eig``, ``schur``, ``hessenberg``, ``tridiagonal`` (their spectra or
reductions interleave padding with the logical result), ``geqp3`` / ``qr``
with column pivoting (padding columns compete as pivots), ``svd`` singular
vectors of a non-square logical matrix (extra zero singular values mix with
the null space), ``eigh`` with
``sort_eigenvalues=False`` or ``subset_by_index``.

``fft`` along a dynamic axis: zero padding would change the DFT (the
transform length must be the logical size), so a dynamic axis is transformed
with Bluestein's chirp-z algorithm: a length-``n`` DFT for a traced ``n`` as a
convolution computed with FFTs of a static length ``>= 2 * bound - 1``
(``rfft`` keeps the first ``n//2 + 1`` bins; ``irfft`` rebuilds the Hermitian
spectrum of length ``n``). Static transformed axes bind ``fft`` unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.lax import linalg as lax_linalg

from .._jax_compat import linalg as compat_linalg
from ..core.errors import ShapeError
from ..core.shapes import needs_mask
from ..tracing.registry import register, register_precondition
from .util import clean, clean_float, masked_axes, valid_mask


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------
def _matrix_masked(logical, bounds) -> bool:
    return bool(masked_axes(logical, bounds, [len(bounds) - 2, len(bounds) - 1]))


def _embed(x, logical, diag=None):
    """``x`` with its padding replaced by the identity embedding.

    ``x``: ``(..., M, N)`` padded, ``logical`` its logical shape. Logical
    entries are kept; padding gets ``diag`` (default 1, or an array
    broadcastable to ``x``) at ``(k, k)`` for every row ``k`` that is padding
    (row ``>= m`` or a padded batch element), 0 elsewhere. Returns ``x``
    unchanged when nothing is padded.
    """
    valid = valid_mask(logical, x.shape)
    if valid is None:
        return x
    nd = x.ndim
    rows = lax.broadcasted_iota(jnp.int32, x.shape, nd - 2)
    cols = lax.broadcasted_iota(jnp.int32, x.shape, nd - 1)
    row_ok = valid_mask(logical, x.shape, list(range(nd - 2)) + [nd - 2])
    on_diag = rows == cols
    if row_ok is not None:
        on_diag = on_diag & ~row_ok
    one = jnp.ones((), x.dtype) if diag is None else jnp.broadcast_to(diag, x.shape).astype(
        x.dtype)
    fill = lax.select(on_diag, jnp.broadcast_to(one, x.shape), jnp.zeros_like(x))
    return lax.select(valid, x, fill)


def _fill_index(x, logical):
    """Integer index vectors: padding entries become their own position."""
    m = valid_mask(logical, x.shape)
    if m is None:
        return x
    return lax.select(m, x, lax.broadcasted_iota(x.dtype, x.shape, x.ndim - 1))


# ----------------------------------------------------------------------------
# Cholesky and triangular solves
# ----------------------------------------------------------------------------
@register(lax_linalg.cholesky_p)
def cholesky_rule(ctx, x, **params):
    lg = ctx.in_logical[0]
    if not masked_axes(lg, ctx.in_bounds[0]):
        return ctx.bind(x)
    out = ctx.bind(_embed(x, lg))
    return _embed(out, ctx.out_logical[0])


@register(lax_linalg.cholesky_update_p)
def cholesky_update_rule(ctx, r, w, **params):
    lr, lw = ctx.in_logical
    if not (masked_axes(lr, ctx.in_bounds[0]) or masked_axes(lw, ctx.in_bounds[1])):
        return ctx.bind(r, w)
    out = ctx.bind(_embed(r, lr), clean(w, lw))
    return _embed(out, ctx.out_logical[0])


@register(lax_linalg.triangular_solve_p)
def triangular_solve_rule(ctx, a, b, **params):
    la, lb = ctx.in_logical
    if not (masked_axes(la, ctx.in_bounds[0]) or masked_axes(lb, ctx.in_bounds[1])):
        return ctx.bind(a, b)
    out = ctx.bind(_embed(a, la), clean(b, lb))
    # Values are already 0 in padding; the select makes cotangents there 0 too.
    return clean(out, ctx.out_logical[0])


@register(lax_linalg.tridiagonal_solve_p)
def tridiagonal_solve_rule(ctx, dl, d, du, b, **params):
    lg = ctx.in_logical
    if not any(masked_axes(lo, bd) for lo, bd in zip(lg, ctx.in_bounds)):
        return ctx.bind(dl, d, du, b)
    # Padding rows are decoupled identity rows: d = 1, dl = du = 0, and the
    # last logical row's super-diagonal (ignored by the unpadded solve) is 0.
    dl = clean(dl, lg[0])
    du_ok = valid_mask(lg[2], du.shape)
    if du_ok is not None:
        n = jnp.asarray(lg[2][-1], jnp.int32)
        du_ok = du_ok & (lax.broadcasted_iota(jnp.int32, du.shape, du.ndim - 1) < n - 1)
        du = lax.select(du_ok, du, jnp.zeros_like(du))
    d_ok = valid_mask(lg[1], d.shape)
    if d_ok is not None:
        d = lax.select(d_ok, d, jnp.ones_like(d))
    out = ctx.bind(dl, d, du, clean(b, lg[3]))
    return clean(out, ctx.out_logical[0])


@register(lax_linalg.symmetric_product_p)
def symmetric_product_rule(ctx, a, c, **params):
    la, lc = ctx.in_logical
    out = ctx.bind(clean(a, la), clean(c, lc))
    return clean(out, ctx.out_logical[0])


# ----------------------------------------------------------------------------
# LU
# ----------------------------------------------------------------------------
@register(lax_linalg.lu_p)
def lu_rule(ctx, x, **params):
    lg = ctx.in_logical[0]
    if not masked_axes(lg, ctx.in_bounds[0]):
        return ctx.bind(x)
    lu, pivots, perm = ctx.bind(_embed(x, lg))
    lu = _embed(lu, ctx.out_logical[0])
    return [lu, _fill_index(pivots, ctx.out_logical[1]), _fill_index(perm, ctx.out_logical[2])]


@register(lax_linalg.lu_pivots_to_permutation_p)
def lu_pivots_to_permutation_rule(ctx, pivots, **params):
    # A padding pivot swaps its row with itself; logical pivots only touch
    # logical rows, so the permutation is right on the logical prefix.
    return ctx.bind(_fill_index(pivots, ctx.in_logical[0]))


# ----------------------------------------------------------------------------
# custom_linear_solve (jnp.linalg.solve, inv): recurse into the four jaxprs
# ----------------------------------------------------------------------------
@register(lax.linear_solve_p)
def custom_linear_solve_rule(ctx, *args, const_lengths, jaxprs):
    counts = list(const_lengths)
    consts, pos = [], 0
    for c in counts:
        consts.append(list(args[pos:pos + c]))
        pos += c
    b = list(args[pos:])
    mv_c, _, solve_c, tsolve_c = consts
    n_out = len(jaxprs.matvec.out_avals)
    has_aux = len(jaxprs.solve.out_avals) > n_out
    symmetric = jaxprs.vecmat is not None and jaxprs.vecmat is jaxprs.matvec

    def run(jaxpr, cs, x):
        # (JAX traces each function on its own, the solve calling the matvec
        # inside it: sizes computed in one trace must not serve another)
        with ctx.state.scoped():
            outs = ctx.eval_jaxpr(jaxpr, *cs, *x)
        if has_aux and jaxpr is not jaxprs.matvec and len(outs) > n_out:
            return list(outs[:n_out]), list(outs[n_out:])
        return list(outs)

    def matvec(x):
        return run(jaxprs.matvec, mv_c, x)

    def solve(_mv, x):
        return run(jaxprs.solve, solve_c, x)

    transpose_solve = None
    if jaxprs.transpose_solve is not None and not symmetric:
        def transpose_solve(_vm, x):
            return run(jaxprs.transpose_solve, tsolve_c, x)

    out = lax.custom_linear_solve(matvec, b, solve, transpose_solve, symmetric=symmetric,
                                  has_aux=has_aux)
    if has_aux:
        x, aux = out
        return list(x) + list(aux)
    return list(out)


# ----------------------------------------------------------------------------
# Symmetric eigendecomposition
# ----------------------------------------------------------------------------
@register(lax_linalg.eigh_p)
def eigh_rule(ctx, x, *, lower, sort_eigenvalues, subset_by_index, **params):
    lg, bd = ctx.in_logical[0], ctx.in_bounds[0]
    if not masked_axes(lg, bd):
        return ctx.bind(x)
    if not _matrix_masked(lg, bd):
        v, w = ctx.bind(_embed(x, lg))
        return [_embed(v, ctx.out_logical[0]), clean(w, ctx.out_logical[1])]
    if not sort_eigenvalues:
        raise ctx.unsupported(
            "eigh with sort_eigenvalues=False on a dynamic matrix axis: the padding "
            "eigenvalues land in implementation-defined positions of the spectrum")
    if subset_by_index is not None:
        raise ctx.unsupported(
            "eigh with subset_by_index on a dynamic matrix axis: the index range refers "
            "to the logical spectrum, which the padded solver cannot select")
    # Padding eigenvalues c + k, with c above the Gershgorin bound of the
    # logical matrix: they are distinct (finite JVP) and sort after every
    # logical eigenvalue, so the ascending spectrum keeps the logical ones first.
    xc = clean(x, lg)
    real = jnp.abs(xc).dtype
    # (of the finite entries: an inf must not make the padding block inf too)
    finite = jnp.where(jnp.isfinite(xc), jnp.abs(xc), 0)
    radius = jnp.max(jnp.sum(finite, axis=-1), axis=-1, keepdims=True)
    k = lax.broadcasted_iota(real, x.shape[:-1], x.ndim - 2)
    shift = lax.stop_gradient(radius + 1.0 + k)[..., None]
    e = _embed(x, lg, diag=shift)
    v, w = ctx.bind(e)
    # A NaN in the logical matrix: plain JAX's result depends on the matrix
    # size and the machine (one XLA:CPU host: some eigenvalues NaN below 32 x 32,
    # none from 32 up),
    # so the padded solve cannot follow it; NaN everywhere, never a number.
    v, w = _nan_where(jnp.isnan(xc), v, w)
    return [_embed(v, ctx.out_logical[0]), clean(w, ctx.out_logical[1])]


def _nan_where(bad, *outs):
    """``outs`` (a decomposition's, batch axes first) all NaN for the matrices
    where ``bad`` (the matrix's shape) holds anywhere."""
    any_bad = jnp.any(bad, axis=(-2, -1))
    return [jnp.where(any_bad.reshape(any_bad.shape + (1,) * (o.ndim - any_bad.ndim)),
                      jnp.nan, o) for o in outs]


# ----------------------------------------------------------------------------
# QR and SVD
# ----------------------------------------------------------------------------
@register(lax_linalg.qr_p)
def qr_rule(ctx, x, *, pivoting, full_matrices, **params):
    lg, bd = ctx.in_logical[0], ctx.in_bounds[0]
    if not masked_axes(lg, bd):
        return ctx.bind(x)
    if pivoting and _matrix_masked(lg, bd):
        raise ctx.unsupported(
            "qr with column pivoting on a dynamic matrix axis: padding columns would "
            "compete with logical columns as pivots")
    e = _embed(x, lg)
    if not pivoting and not full_matrices and bd[-2] >= bd[-1] and needs_mask(lg[-1], bd[-1]):
        outs = _qr_with_finite_jvp(ctx, e, lg[-2], lg[-1])
    else:
        outs = ctx.bind(e)
    q, r = outs[0], outs[1]
    q = _embed(q, ctx.out_logical[0])
    r = clean(r, ctx.out_logical[1])
    res = [q, r]
    if pivoting:
        res.append(_fill_index(outs[2], ctx.out_logical[2]))
    return res


def _qr_with_finite_jvp(ctx, e, m, n):
    """The thin QR of the embedded ``e`` (padded ``M >= N``; logical ``m x n``)
    with JAX's JVP taken at a nearby full-rank point.

    Padding columns ``k`` in ``[n, m)`` of a tall logical matrix are zero in
    the embedding (no padding row there to hold a 1), so column ``k`` of ``r``
    is zero, ``r[k, k] = 0``, and JAX's JVP (``triangular_solve(r, dx)``) gave
    NaN gradients. The JVP reads ``r`` with 1 at those ``(k, k)``: ``(q, r')``
    is then the QR of ``e`` with those columns replaced by ``q[:, k]``. The
    logical ``q``, ``r`` and their tangents depend only on the logical columns
    (QR works left to right; the padding columns' tangents are 0), which are
    unchanged, so the tangents are exact on the logical block, and finite.
    """
    shape = e.shape[:-2] + (e.shape[-1], e.shape[-1])
    rows = lax.broadcasted_iota(jnp.int32, shape, len(shape) - 2)
    cols = lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
    zero_column = (rows == cols) & (cols >= n) & (rows < m)

    @jax.custom_jvp
    def qr(e):
        return tuple(ctx.bind(e))

    @qr.defjvp
    def qr_jvp(primals, tangents):
        (e,), (de,) = primals, tangents
        q, r = qr(e)
        r_full_rank = lax.select(zero_column, jnp.ones_like(r), r)
        dq, dr = compat_linalg.thin_qr_jvp(q, r_full_rank, de)
        return (q, r), (dq, dr)

    return qr(e)


@register(lax_linalg.svd_p)
def svd_rule(ctx, x, *, compute_uv, subset_by_index, **params):
    lg, bd = ctx.in_logical[0], ctx.in_bounds[0]
    if not masked_axes(lg, bd):
        return ctx.bind(x)
    if not _matrix_masked(lg, bd):
        outs = ctx.bind(_embed(x, lg))
        return [clean_float(o, lo) for o, lo in zip(outs, ctx.out_logical)]
    if subset_by_index is not None:
        raise ctx.unsupported("svd with subset_by_index on a dynamic matrix axis: the "
                              "index range refers to the logical spectrum")
    if compute_uv:
        return _svd_uv(ctx, x, lg, bd)
    # Zero padding: the padded singular values are the logical ones followed
    # by zeros (descending order keeps the logical ones first).
    (s,) = ctx.bind(clean(x, lg))
    return [clean(s, ctx.out_logical[0])]


def _svd_uv(ctx, x, lg, bd):
    """Singular vectors of a square logical matrix on dynamic axes.

    Padding singular values ``c + k`` (``c`` above the Frobenius norm, distinct
    so the JVP's ``1 / (s_i^2 - s_j^2)`` stays finite) sort *before* the
    logical ones; the outputs are rolled by their count ``min(M, N) - n`` so the
    logical singular values and vectors come first, as in the unpadded result.
    """
    m_expr, n_expr = ctx.in_avals[0].shape[-2:]
    if not (m_expr is n_expr or m_expr == n_expr):
        raise ctx.unsupported(
            "svd singular vectors (compute_uv=True) of a non-square logical matrix on a "
            "dynamic axis: the padded matrix has extra zero singular values whose vectors "
            "mix with the logical null space (and make the JVP divide by zero gaps); use "
            "compute_uv=False (jnp.linalg.svdvals), a square logical matrix, or static "
            "matrix axes")
    xc = clean(x, lg)
    real = jnp.abs(xc).dtype
    norm = jnp.sqrt(jnp.sum(jnp.square(jnp.abs(xc)), axis=(-2, -1), keepdims=True))
    rows = lax.broadcasted_iota(real, x.shape, x.ndim - 2)
    e = _embed(x, lg, diag=lax.stop_gradient(norm + 1.0 + rows))
    s, u, vt = ctx.bind(e)
    # An inf in the logical matrix: LAPACK rejects the padded one (its norm is
    # inf) and returns finite vectors where plain JAX's are NaN; NaN everywhere.
    s, u, vt = _nan_where(jnp.isinf(xc), s, u, vt)
    k_pad = s.shape[-1]
    shift = k_pad - lg[-1]
    s = jnp.roll(s, -shift, axis=-1)
    u = jnp.roll(u, -shift, axis=-1)
    vt = jnp.roll(vt, -shift, axis=-2)
    s, u, vt = _as_one_by_one(xc, lg[-1], s, u, vt)
    lo_s, lo_u, lo_vt = ctx.out_logical
    return [clean(s, lo_s), _embed(u, lo_u), _embed(vt, lo_vt)]


def _as_one_by_one(xc, n, s, u, vt):
    """A 1 x 1 logical matrix ``[[a]]`` as LAPACK factors one: ``s = |a|``, ``u =
    a / |a|`` (real: ``copysign(1, a)``; ``a = 0``: 1), ``vt = 1`` (its bidiagonal
    SVD of order 1 puts the sign in ``U``). In the padded matrix the block
    is part of a larger bidiagonal, which put the sign in ``vt`` instead. A
    NaN or inf keeps the padded result (NaN, as plain JAX's)."""
    a = xc[..., 0, 0]
    if jnp.iscomplexobj(a):
        mag = jnp.abs(a)
        ua = jnp.where(mag == 0, jnp.ones_like(a), a / jnp.where(mag == 0, 1, mag))
    else:
        ua = jnp.copysign(jnp.ones_like(a), a)
    one = (n == 1) & jnp.isfinite(a)
    return (jnp.where(one, s.at[..., 0].set(jnp.abs(a).astype(s.dtype)), s),
            jnp.where(one, u.at[..., 0, 0].set(ua.astype(u.dtype)), u),
            jnp.where(one, vt.at[..., 0, 0].set(jnp.ones_like(ua).astype(vt.dtype)), vt))


# ----------------------------------------------------------------------------
# Everything else: batch axes only
# ----------------------------------------------------------------------------
_MATRIX_REASONS = {
    "eig": "the padding eigenvalues of the identity block interleave with the logical "
           "ones in an implementation-defined order",
    "schur": "the Schur form of the padded matrix orders padding and logical eigenvalues "
             "in an implementation-defined way",
    "hessenberg": "not implemented for a dynamic matrix axis (Householder reflectors "
                  "and taus would need re-laying out)",
    "tridiagonal": "not implemented for a dynamic matrix axis",
    "geqp3": "column pivoting: padding columns would compete with logical columns as pivots",
}


# Core (non-batch) rank of each operand; the leading axes are batch axes.
_CORE_RANKS = {"geqp3": (2, 1)}


def _batch_only_rule(name):
    def rule(ctx, *args, **params):
        ranks = _CORE_RANKS.get(name, (2,) * len(args))
        ins = []
        for a, lo, bd, r in zip(args, ctx.in_logical, ctx.in_bounds, ranks):
            core = list(range(len(bd) - r, len(bd)))
            if masked_axes(lo, bd, core):
                raise ctx.unsupported(f"{name} on a dynamic matrix axis: "
                                      f"{_MATRIX_REASONS[name]}")
            if r == 2 and jnp.issubdtype(a.dtype, jnp.inexact):
                a = _embed(a, lo)
            elif jnp.issubdtype(a.dtype, jnp.inexact):
                a = clean(a, lo)
            ins.append(a)
        outs = ctx.bind(*ins)
        if not ctx.primitive.multiple_results:
            return clean_float(outs, ctx.out_logical[0])
        return [clean_float(o, lo) for o, lo in zip(outs, ctx.out_logical)]

    rule.__name__ = f"{name}_batch_rule"
    return rule


# geqp3 has no public primitive object: registered by name.
_MATRIX_PRIMITIVES = {"eig": lax_linalg.eig_p, "schur": lax_linalg.schur_p,
                      "hessenberg": lax_linalg.hessenberg_p,
                      "tridiagonal": lax_linalg.tridiagonal_p}
for _name in _MATRIX_REASONS:
    register(_MATRIX_PRIMITIVES.get(_name, _name))(_batch_only_rule(_name))


# ----------------------------------------------------------------------------
# Householder QR in LAPACK's form: geqrf, householder_product (orgqr)
# ----------------------------------------------------------------------------
@register("geqrf")
def geqrf_rule(ctx, x, **params):
    """Householder QR (LAPACK ``geqrf``) of the logical ``m x n`` block.

    The padding is the identity embedding (``_embed``: 1 at ``(k, k)`` of each
    padding row, 0 elsewhere). Householder QR works column by column, left to
    right: the reflector of a logical column ``j`` is built from rows
    ``j..M-1`` of that column, which are 0 in every padding row, so it touches
    logical rows only and equals the logical one, as does its ``tau``; later
    reflectors (padding columns) act on rows ``>= m`` alone. So the logical
    block of the output and the first ``min(m, n)`` taus are ``geqrf`` of the
    logical matrix (Golub & Van Loan, Matrix Computations, 4th ed., 5.2.2).
    """
    lg, bd = ctx.in_logical[0], ctx.in_bounds[0]
    if not masked_axes(lg, bd):
        return ctx.bind(x)
    a, taus = ctx.bind(_embed(x, lg))
    return [clean_float(a, ctx.out_logical[0]), clean_float(taus, ctx.out_logical[1])]


@register(lax_linalg.householder_product_p)
@register(lax_linalg.ormqr_p)
def householder_reflectors_rule(ctx, a, taus, *rest, **params):
    """``Q = H_0 ... H_{k-1}`` from reflectors of a logical ``m x n`` block:
    its first columns (``householder_product``, LAPACK ``orgqr``) or applied
    to a matrix ``c`` (``ormqr``: ``Q c``, ``Q^T c``, ``c Q``, ``c Q^T``).

    With the reflectors' padding rows cleaned to 0 and the padding taus 0
    (``H_j = I``), every reflector acts on logical rows only: the padded ``Q``
    is the logical one with the identity on the padding, so the logical block
    of each product is the logical product (``c``'s padding cleaned to 0).
    """
    if not any(masked_axes(lo, bd) for lo, bd in zip(ctx.in_logical, ctx.in_bounds)):
        return ctx.bind(a, taus, *rest)
    ins = [clean(x, lo) for x, lo in zip((a, taus, *rest), ctx.in_logical)]
    return clean_float(ctx.bind(*ins), ctx.out_logical[0])


# ----------------------------------------------------------------------------
# FFT: Bluestein (chirp-z) transforms of the logical length
# ----------------------------------------------------------------------------
_MAX_DYNAMIC_FFT = 23170  # (2 * bound)^2 must fit in int32 for the chirp phases


def _next_pow2(k: int) -> int:
    return 1 << max(int(k) - 1, 0).bit_length()


def _chirp(t, n, sign, cdtype):
    """``exp(sign * i * pi * t^2 / n)`` with the phase reduced mod 2n in int32."""
    rdtype = jnp.finfo(cdtype).dtype
    tm = t % (2 * n)
    ang = (jnp.pi * sign) * ((tm * tm) % (2 * n)).astype(rdtype) / n.astype(rdtype)
    return lax.complex(jnp.cos(ang), jnp.sin(ang)).astype(cdtype)


def _dft_last(x, n, inverse: bool):
    """Length-``n`` DFT along the last axis (padded length ``P >= n``), ``n`` traced.

    Bluestein: ``X_k = w_k sum_j (x_j w_j) conj(w)_{k-j}`` with
    ``w_t = exp(s i pi t^2 / n)``; the convolution runs as FFTs of a static
    length ``L >= 2P - 1``. Inputs at ``j >= n`` are ignored; outputs at
    ``k >= n`` are garbage (the caller cleans them). IFFT includes ``1/n``.
    """
    p = x.shape[-1]
    big = _next_pow2(2 * p - 1)
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 1)
    sign = 1.0 if inverse else -1.0
    t = lax.iota(jnp.int32, p)
    w = _chirp(t, n, sign, x.dtype)
    a = jnp.where(t < n, x * w, jnp.zeros((), x.dtype))
    a = jnp.pad(a, [(0, 0)] * (x.ndim - 1) + [(0, big - p)])
    tt = lax.iota(jnp.int32, big)
    d = jnp.minimum(tt, big - tt)
    d = jnp.where(d < n, d, 0)
    b = jnp.where(jnp.minimum(tt, big - tt) < n, _chirp(d, n, -sign, x.dtype),
                  jnp.zeros((), x.dtype))
    conv = jnp.fft.ifft(jnp.fft.fft(a, axis=-1) * jnp.fft.fft(b), axis=-1)[..., :p]
    out = conv * w
    if inverse:
        out = out / n.astype(out.real.dtype)
    return out


def _along(fn, x, axis):
    return jnp.moveaxis(fn(jnp.moveaxis(x, axis, -1)), -1, axis)


def _complex_axis(x, axis, n, dynamic: bool, inverse: bool):
    if dynamic:
        return _along(lambda v: _dft_last(v, n, inverse), x, axis)
    kind = lax.FftType.IFFT if inverse else lax.FftType.FFT
    return _along(lambda v: lax.fft(v, kind, (v.shape[-1],)), x, axis)


@register_precondition(lax.fft_p)
def fft_precondition(eqn) -> None:
    """An rfft of length 0 fails to lower in plain JAX: ``n >= 1`` splits the
    trace, and its ``n == 0`` case is an error case."""
    kind = eqn.params["fft_type"]
    n = eqn.invars[0].aval.shape[-1]
    if (kind == lax.FftType.RFFT or str(kind).endswith("RFFT")) and not n >= 1:
        e = ShapeError("rfft of an axis of length 0: plain JAX cannot compile it on "
                       "the exact arrays either")
        e.polymask_plain = True  # plain JAX's failure at these sizes: no remedy of polymask's
        raise e


@register(lax.fft_p, at_bound=True)  # (an empty result: see below)
def fft_rule(ctx, x, *, fft_type, fft_lengths):
    k = len(fft_lengths)
    lin, bin_ = ctx.in_logical[0], ctx.in_bounds[0]
    lout, bout = ctx.out_logical[0], ctx.out_bounds[0]
    nd = len(bin_)
    axes = list(range(nd - k, nd))
    dyn = {a for a in axes if masked_axes(lin, bin_, [a]) or masked_axes(lout, bout, [a])}
    if any(bout[a] == 0 for a in axes):
        # an empty result (irfft to length 0, in a case pinned to a small size):
        # no transform, whose transpose (JAX's 1 / prod(fft_lengths)) fails at
        # trace time in every branch of the cases' switch under grad
        return jnp.zeros(bout, ctx.out_avals[0].dtype)
    if not dyn:
        return clean_float(ctx.bind(x), lout)
    if max(max(bin_[a], bout[a]) for a in dyn) > _MAX_DYNAMIC_FFT:
        raise ctx.unsupported(
            f"fft along a dynamic axis with a bound above {_MAX_DYNAMIC_FFT}: the int32 "
            "chirp phases of the masked (Bluestein) transform would overflow")
    kind = lax.FftType(fft_type) if not isinstance(fft_type, lax.FftType) else fft_type
    x = clean(x, lin)
    last = axes[-1]
    lead = axes[:-1]
    if kind in (lax.FftType.FFT, lax.FftType.IFFT):
        inverse = kind == lax.FftType.IFFT
        for a in axes:
            x = _complex_axis(x, a, lin[a], a in dyn, inverse)
        return clean(x, lout)
    if kind == lax.FftType.RFFT:
        cdtype = jnp.result_type(x.dtype, jnp.complex64)
        if last in dyn:
            ctx.require(lin[last] == 0, "rfft of an axis of length 0 (plain JAX cannot "
                                        "compile it on the exact arrays either)")
            full = _complex_axis(x.astype(cdtype), last, lin[last], True, False)
            y = lax.slice_in_dim(full, 0, bout[last], axis=last)
        elif bin_[last] == 0:  # plain JAX fails to lower an rfft of length 0
            ctx.require(True, "rfft of an axis of length 0 (plain JAX cannot compile it on "
                              "the exact arrays either)")
            y = jnp.zeros(x.shape[:last] + (bout[last],) + x.shape[last + 1:], cdtype)
        else:  # a static last axis (e.g. a case with its size fixed): XLA's own rfft
            y = lax.fft(x, lax.FftType.RFFT, (bin_[last],)).astype(cdtype)
        for a in lead:
            y = _complex_axis(y, a, lin[a], a in dyn, False)
        return clean(y, lout)
    # IRFFT: inverse complex transforms on the leading axes, then rebuild the
    # Hermitian spectrum of logical length n on the last axis and invert it.
    for a in lead:
        x = _complex_axis(x, a, lin[a], a in dyn, True)
    if last not in dyn:  # a static last axis: XLA's own irfft
        return clean(lax.fft(x, lax.FftType.IRFFT, (bout[last],)), lout)
    n = lout[last]
    n32 = jnp.asarray(n, jnp.int32)
    kk = lax.iota(jnp.int32, bout[last])
    upper = kk > n32 // 2
    idx = jnp.clip(jnp.where(upper, n32 - kk, kk), 0, bin_[last] - 1)
    xl = jnp.moveaxis(x, last, -1)
    spec = jnp.take(xl, idx, axis=-1)
    spec = jnp.where(upper, jnp.conj(spec), spec)
    y = jnp.real(_dft_last(spec, n, True))
    y = jnp.moveaxis(y, -1, last)
    return clean(y.astype(ctx.out_avals[0].dtype), lout)
