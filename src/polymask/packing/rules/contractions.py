"""``dot_general`` in the packed layout.

- No packed axis contracted (``x @ W``, per-position projections, batch
  dims over the packed axis): one matmul over the row, free.
- Packed axes contracted while the result keeps a packed axis (attention's
  ``softmax(QK^T) V``): the operand holding both axes is block-diagonal
  (cross-segment entries are 0, ``registry`` docstring), so the plain matmul
  over the row sums each segment's own terms only. A NaN or inf of one
  example in the other operand would still meet those zeros (``0 * nan``):
  that operand enters the matmul with its non-finite entries as 0, and each
  example's own non-finite terms are added back per segment (their sum:
  NaN, or the inf a positive weight keeps), so they stay in their example.
  This holds for every operand structure (batch dims, several free or
  contracted axes: heads sharing values, per-head values summed over heads,
  grouped-query attention's ``(K, G)`` heads).
  Every other example is exact. The example holding the inf or NaN is
  non-finite where plain JAX is, but the kind may differ (NaN, +inf or -inf:
  the weights' signs and zeros are not applied to the added-back terms).
- Packed axes contracted and none kept (``x^T y`` of one example): a value
  per segment: the product per position, then a segment sum.
- A per-segment operand against a packed one (a pooled vector scored
  against every token): gathered at each position first, as a batch dim.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..registry import PerSegment, broadcast_with_new_axis, register_packed


def _dims(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb)


@register_packed(lax.dot_general_p)
def dot_general_rule(ctx, lhs, rhs, *, dimension_numbers, **params):
    lc, rc, lb, rb = _dims(dimension_numbers)
    lp, rp = ctx.in_packed
    ls, rs = isinstance(lhs, PerSegment), isinstance(rhs, PerSegment)
    if ls or rs:
        return _segment_against_packed(ctx, lhs, rhs, lc, rc, lb, rb, ls)
    contracted = [a for a in lc if a in lp]
    if not contracted:
        return ctx.bind(lhs, rhs)
    if ctx.out_packed[0]:
        return _block_diagonal_contraction(ctx, lhs, rhs, lc, rc, lb, rb)
    return _per_segment_contraction(ctx, lhs, rhs, lc, rc, lb, rb, contracted[0])


def _block_diagonal_contraction(ctx, lhs, rhs, lc, rc, lb, rb):
    """A block-diagonal operand ``B`` (two or more packed axes, cross-segment
    entries 0) contracting its packed axis with the one packed axis ``k`` of a
    dense operand ``D``, for any structure ``dot_general`` takes (batch dims,
    several free or contracted axes: heads sharing values ``hnm,md->hnd``,
    per-head values summed over heads ``hnm,mhd->nd``, grouped-query
    attention's ``(K, G)`` heads). ``D`` enters the product with its
    non-finite entries as 0, so no ``0 * nan`` meets another example; the
    non-finite entries are then summed per segment (over ``k`` and ``D``'s
    other contracted axes) and added back at ``B``'s free packed axis, so
    the example holding them is non-finite where plain JAX is (module
    docstring: the kind may differ)."""
    lp, rp = ctx.in_packed
    if len(lp) >= 2 and len(rp) == 1:
        dense_is_lhs = False
    elif len(rp) >= 2 and len(lp) == 1:
        dense_is_lhs = True
    else:  # both block-diagonal: cross entries are 0 on both sides, no NaN meets them
        return ctx.bind(lhs, rhs)
    dense = lhs if dense_is_lhs else rhs
    d_aval, b_aval = (ctx.in_avals if dense_is_lhs else ctx.in_avals[::-1])
    (dc, db, dp), (bc, bb, bp) = ((lc, lb, lp), (rc, rb, rp))[::1 if dense_is_lhs else -1]
    (k,) = dp
    b_free = [a for a in range(len(b_aval.shape)) if a not in bc and a not in bb]
    q = next((a for a in b_free if a in bp), None)
    if k not in dc or q is None or not jnp.issubdtype(dense.dtype, jnp.inexact):
        return ctx.bind(lhs, rhs)
    finite = jnp.isfinite(dense)
    clean = jnp.where(finite, dense, jnp.zeros_like(dense))
    out = ctx.bind(clean, rhs) if dense_is_lhs else ctx.bind(lhs, clean)
    bad = jnp.where(finite, jnp.zeros_like(dense), dense)
    summed = tuple(a for a in dc if a != k)
    bad = jnp.sum(bad, axis=summed) if summed else bad
    kept = [a for a in range(dense.ndim) if a not in summed]  # D's axes left in ``bad``
    bad = jnp.moveaxis(bad, kept.index(k), 0)
    rest = [a for a in kept if a != k]  # D's batch and free axes, in D's order
    per_seg = ctx.axis_segments(d_aval, k).segment_reduce(bad, "sum")  # (S, rest...)
    g = ctx.axis_segments(b_aval, q).to_positions(per_seg, fill_padding=True)  # (R, rest...)
    # where each axis lands in dot_general's result: (batch..., lhs free..., rhs free...)
    d_free = [a for a in range(dense.ndim) if a not in dc and a not in db]
    nb = len(db)
    d_first = nb if dense_is_lhs else nb + len(b_free)
    b_first = nb + len(d_free) if dense_is_lhs else nb
    dims = [db.index(a) if a in db else d_first + d_free.index(a) for a in rest]
    add = broadcast_with_new_axis(g, b_first + b_free.index(q), dims, out.shape)
    add = add.astype(out.dtype)
    return jnp.where(add == 0, out, out + add)


def _per_segment_contraction(ctx, lhs, rhs, lc, rc, lb, rb, a):
    """Contracting packed axis ``a`` of lhs (and its partner) with no packed
    axis left: the product per position (``a`` as a batch dim), then a
    segment sum. No product with 0 crosses segments: a NaN of one example
    stays in that example (a one-hot matmul would give ``0 * nan``)."""
    seg = ctx.axis_segments(ctx.in_avals[0], a)
    ra = rc[lc.index(a)]
    lc2 = tuple(c for c in lc if c != a)
    rc2 = tuple(c for c, l in zip(rc, lc) if l != a)
    per_position = lax.dot_general(
        lhs, rhs, ((lc2, rc2), ((a, *lb), (ra, *rb))),
        precision=ctx.eqn.params.get("precision"),
        preferred_element_type=ctx.eqn.params.get("preferred_element_type"))
    # (R, batch..., lhs free..., rhs free...): the result's order after R
    return PerSegment(seg.segment_reduce(per_position, "sum").astype(ctx.out_avals[0].dtype))


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
