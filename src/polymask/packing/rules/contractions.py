"""``dot_general`` in the packed layout.

- No packed axis contracted (``x @ W``, per-position projections, batch
  dims over the packed axis): one matmul over the row, free.
- Packed axes contracted while the result keeps a packed axis (attention's
  ``softmax(QK^T) V``): the operand holding both axes is block-diagonal
  (cross-segment entries are 0, ``registry`` docstring), so the plain matmul
  over the row sums each segment's own terms only. A NaN or inf of one
  example in the other operand would still meet those zeros (``0 * nan``):
  that operand enters the matmul with its non-finite entries as 0, and
  each example's own non-finite terms are added back within its block
  (``+inf``, ``-inf`` or NaN as plain JAX gets them: the weights' signs and
  zeros applied) when any row holds one. This holds for every operand
  structure (batch dims, several free or contracted axes: heads sharing
  values, per-head values summed over heads, grouped-query attention's
  ``(K, G)`` heads). Every example, the one holding the NaN or inf
  included, gets plain JAX's values.
- Packed axes contracted and none kept (``x^T y`` of one example): a value
  per segment: the product per position, then a segment sum.
- A per-segment operand against a packed one (a pooled vector scored
  against every token): gathered at each position first, as a batch dim.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..registry import PerSegment, register_packed


def _dims(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb)


@register_packed(lax.dot_general_p, reads_unmasked=True)
def dot_general_rule(ctx, lhs, rhs, *, dimension_numbers, **params):
    lc, rc, lb, rb = _dims(dimension_numbers)
    lp, rp = ctx.in_packed
    masked = _arithmetic_block(ctx, lhs, rhs, lc, rc)
    if masked is not None:
        return ctx.rerun_if_nan(masked)
    lhs, rhs = ctx.settled(0, lhs), ctx.settled(1, rhs)
    ls, rs = isinstance(lhs, PerSegment), isinstance(rhs, PerSegment)
    if ls or rs:
        return _segment_against_packed(ctx, lhs, rhs, lc, rc, lb, rb, ls)
    contracted = [a for a in lc if a in lp]
    if not contracted:
        return ctx.bind(lhs, rhs)
    if ctx.out_packed[0]:
        return _block_diagonal_contraction(ctx, lhs, rhs, lc, rc, lb, rb)
    return _per_segment_contraction(ctx, lhs, rhs, lc, rc, lb, rb, contracted[0])


def _arithmetic_block(ctx, lhs, rhs, lc, rc):
    """A speculative run's block-diagonal product (attention's ``P V``): the
    block operand, not yet masked (``Unmasked``), times its same-segment 0/1
    mask (``PackedRun.arithmetic_mask``), against the dense operand as it is.
    A cross-segment term is then ``0 * d``: 0 for finite entries, NaN for a
    NaN or inf of either operand, which ``rerun_if_nan`` reports (the call
    reruns in the exact program). None where this form does not apply."""
    lp, rp = ctx.in_packed
    if len(lp) >= 2 and len(rp) == 1:
        block_i, dense_c, dense_p = 0, rc, rp
    elif len(rp) >= 2 and len(lp) == 1:
        block_i, dense_c, dense_p = 1, lc, lp
    else:
        return None
    dense = (lhs, rhs)[1 - block_i]
    if dense_p[0] not in dense_c or isinstance(dense, PerSegment) or \
            not jnp.issubdtype(dense.dtype, jnp.inexact):
        return None
    block = ctx.masked_by_arithmetic(block_i, (lhs, rhs)[block_i], "sum")
    if block is None:
        return None
    return ctx.bind(lhs if block_i else block, block if block_i else rhs)


def _block_diagonal_contraction(ctx, lhs, rhs, lc, rc, lb, rb):
    """A block-diagonal operand ``B`` (two or more packed axes, cross-segment
    entries 0) contracting its packed axis with the one packed axis ``k`` of a
    dense operand ``D``, for any structure ``dot_general`` takes (batch dims,
    several free or contracted axes: heads sharing values ``hnm,md->hnd``,
    per-head values summed over heads ``hnm,mhd->nd``, grouped-query
    attention's ``(K, G)`` heads). ``D`` enters the product with its
    non-finite entries as 0, so no ``0 * nan`` meets another example; where
    any row of the call holds one, its terms are added back exactly
    (``_with_nonfinite_terms``) on a rare path that finite data never takes
    (``PackedRun.rare_path``: a ``lax.cond``, or a rerun of the call)."""
    lp, rp = ctx.in_packed
    if len(lp) >= 2 and len(rp) == 1:
        dense_is_lhs = False
    elif len(rp) >= 2 and len(lp) == 1:
        dense_is_lhs = True
    else:  # both block-diagonal: cross entries are 0 on both sides, no NaN meets them
        return ctx.bind(lhs, rhs)
    dense, block = (lhs, rhs) if dense_is_lhs else (rhs, lhs)
    d_aval, b_aval = (ctx.in_avals if dense_is_lhs else ctx.in_avals[::-1])
    (dc, _, dp), (_, _, bp) = ((lc, lb, lp), (rc, rb, rp))[::1 if dense_is_lhs else -1]
    (k,) = dp
    if k not in dc or not jnp.issubdtype(dense.dtype, jnp.inexact):
        return ctx.bind(lhs, rhs)
    finite = jnp.isfinite(dense)
    clean = jnp.where(finite, dense, jnp.zeros_like(dense))
    out = ctx.bind(clean, rhs) if dense_is_lhs else ctx.bind(lhs, clean)

    def product(b_ind, d_ind):  # a count per result entry, in dot_general's layout
        b_ind, d_ind = b_ind.astype(jnp.float32), d_ind.astype(jnp.float32)
        pair = (d_ind, b_ind) if dense_is_lhs else (b_ind, d_ind)
        return lax.dot_general(*pair, ctx.eqn.params["dimension_numbers"])

    def exact():  # its masks and products are computed only when the cond takes it
        in_block = ctx.run.live_everywhere(b_aval, bp, block.shape)
        # B's NaNs stay (a NaN times D's finite entries, inside B's block only,
        # keeps its sign bit as plain JAX's product does); its infinities go
        fin_block = jnp.where(jnp.isinf(block), jnp.zeros_like(block), block)
        fin = ctx.bind(clean, fin_block) if dense_is_lhs else ctx.bind(fin_block, clean)
        return _with_nonfinite_terms(fin, _Classes(block, in_block), _Classes(dense), product)

    return ctx.run.rare_path(~jnp.all(finite), exact, lambda: out)


class _Classes:
    """An operand's entries by sign and finiteness (``live``: where its
    terms exist at all: a block-diagonal operand's own block)."""

    def __init__(self, x, live=None):
        live = jnp.ones(x.shape, bool) if live is None else live
        fin = jnp.isfinite(x)
        self.pos_fin, self.neg_fin = fin & (x > 0), fin & (x < 0)
        self.pos_inf, self.neg_inf = x == jnp.inf, x == -jnp.inf
        self.zero = (x == 0) & live
        self.nan = jnp.isnan(x)
        self.x = x
        self.inf = self.pos_inf | self.neg_inf
        self.pos, self.neg = x > 0, x < 0
        self.live = live


def _with_nonfinite_terms(fin, b, d, product):
    """``fin`` (the product of D's finite entries with B's finite and NaN
    entries) with every term ``B[i, j] * D[j]`` that has an infinite factor
    or a NaN of D added back as plain JAX has it, over ``j`` in ``i``'s block
    only: the counts of ``+inf``, ``-inf`` and NaN terms are products of
    finite 0/1 indicators (no ``0 * inf`` can cross a block). An entry with a
    NaN term (a NaN of D, ``0 * inf``) or infinities of both signs is NaN,
    else ``+inf`` or ``-inf``, else ``fin``."""
    plus = (product(b.pos_inf, d.pos) + product(b.neg_inf, d.neg)
            + product(b.pos_fin, d.pos_inf) + product(b.neg_fin, d.neg_inf))
    minus = (product(b.pos_inf, d.neg) + product(b.neg_inf, d.pos)
             + product(b.pos_fin, d.neg_inf) + product(b.neg_fin, d.pos_inf))
    # NaN signs matter: XLA's top_k and sort order NaNs by their sign bit. A NaN
    # factor of D propagates its own sign; an invalid operation (0 * inf,
    # inf - inf) makes the machine's default NaN, made here by the same arithmetic
    neg_nan = product(b.live, d.nan & jnp.signbit(d.x))
    pos_nan = product(b.live, d.nan & ~jnp.signbit(d.x))
    invalid = product(b.zero, d.inf) + product(b.inf, d.zero)
    dtype = fin.dtype
    inf = jnp.full(fin.shape, jnp.inf, dtype)
    nan = jnp.asarray(jnp.nan, dtype)
    made_nan = inf * jnp.zeros((), dtype)
    add = jnp.where(pos_nan > 0, nan, jnp.where(neg_nan > 0, -nan, jnp.where(
        (invalid > 0) | ((plus > 0) & (minus > 0)), made_nan,
        jnp.where(plus > 0, inf, jnp.where(minus > 0, -inf, 0)))))
    return jnp.where(add == 0, fin, fin + add)


def _per_segment_contraction(ctx, lhs, rhs, lc, rc, lb, rb, a):
    """Contracting packed axis ``a`` of lhs (and its partner) with no packed
    axis left: the product per position (``a`` as a batch dim), then a
    segment sum. No product with 0 crosses segments: a NaN of one example
    stays in that example (a one-hot matmul would give ``0 * nan``)."""
    seg = ctx.axis_segments(ctx.in_avals[0], a)
    ra = rc[lc.index(a)]
    lc2 = tuple(c for c in lc if c != a)
    rc2 = tuple(c for c, l in zip(rc, lc) if l != a)
    out_dtype = ctx.out_avals[0].dtype
    preferred = ctx.eqn.params.get("preferred_element_type")
    if out_dtype in (jnp.bfloat16, jnp.float16):
        # plain JAX's dot accumulates a bfloat16 / float16 product in float32 and
        # rounds once: the per-position products and their sum do too
        preferred = jnp.float32
    per_position = lax.dot_general(
        lhs, rhs, ((lc2, rc2), ((a, *lb), (ra, *rb))),
        precision=ctx.eqn.params.get("precision"), preferred_element_type=preferred)
    # (R, batch..., lhs free..., rhs free...): the result's order after R
    return PerSegment(seg.segment_reduce(per_position, "sum").astype(out_dtype))


def _segment_against_packed(ctx, lhs, rhs, lc, rc, lb, rb, lhs_is_segment):
    """A per-segment operand with a shared or packed one. With a shared one
    the interpreter never calls here (it ``vmap``s); with a packed one of one
    packed free axis ``k``, the per-segment operand is gathered at each
    position and ``k`` becomes a batch dim."""
    seg_op, other = (lhs, rhs) if lhs_is_segment else (rhs, lhs)
    other_packed = ctx.in_packed[1] if lhs_is_segment else ctx.in_packed[0]
    if isinstance(other, PerSegment) or len(other_packed) != 1:
        raise ctx.unsupported("a per-segment operand against a block-diagonal one")
    (k,) = other_packed
    g = ctx.seg.to_positions(seg_op.data)  # (R, *seg shape)
    sc, oc = (lc, rc) if lhs_is_segment else (rc, lc)
    sb, ob = (lb, rb) if lhs_is_segment else (rb, lb)
    shift = lambda t: tuple(i + 1 for i in t)
    new_dn = ((shift(sc), oc), ((0, *shift(sb)), (k, *ob)))
    if lhs_is_segment:
        out = lax.dot_general(g, other, new_dn)
    else:
        (c1, c2), (b1, b2) = new_dn
        out = lax.dot_general(other, g, ((c2, c1), (b2, b1)))
    # out: (R, batch..., lhs free..., rhs free...); the plain product puts the
    # packed axis k among the free dims of its operand: move it there
    n_batch = len(lb)
    if lhs_is_segment:  # k is a free dim of rhs
        rhs_free = [d for d in range(other.ndim) if d not in rc and d not in rb]
        lhs_free_n = seg_op.data.ndim - 1 - len(lc) - len(lb)
        dest = n_batch + lhs_free_n + rhs_free.index(k)
    else:  # k is a free dim of lhs
        lhs_free = [d for d in range(other.ndim) if d not in lc and d not in lb]
        dest = n_batch + lhs_free.index(k)
    return jnp.moveaxis(out, 0, dest).astype(ctx.out_avals[0].dtype)
