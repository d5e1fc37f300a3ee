"""Reductions along packed axes: one value per segment.

A reduction over every packed axis of its operand is a segment reduction
(``jax.ops.segment_*`` over ``Segments.seg``; padding positions have the
out-of-range id ``S`` and never reach a result): the result is per segment.
A reduction over some packed axes of a block-diagonal value (the softmax
max and sum over attention scores) keeps the others: entries of another
segment become the reduction's identity first (XLA DynamicPadder's padding
rule, with "padding" meaning "another segment"). ``argmax``/``argmin`` give
the index within the segment, the first extremum (NaN first) like ``lax``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...rules.families import FAMILIES
from ...rules.util import identity_of, keep_nan
from ..registry import PerSegment, nan_poison, register_nan_keeper, register_packed

_SEGMENT_KIND = {"sum": "sum", "max": "max", "min": "min", "prod": "prod",
                 "or": "max", "and": "min"}


def _mask_other_segments(ctx, x, reduced, kept, kind):
    """Entries whose reduced packed axes lie in another segment than ``kept[0]``
    (or than ``reduced[0]`` when none is kept) become the identity."""
    ref = kept[0] if kept else reduced[0]
    others = [a for a in reduced if a != ref]
    if not others:
        return x
    ok = ctx.run.same_segment(ctx.in_avals[0], [ref, *others], x.shape)
    return lax.select(ok, x, jnp.full_like(x, identity_of(x.dtype, kind)))


def _nan_poison(data, axes, kind: str):
    """The report a masked max or min owes (``registry.OwedReport``), made
    where no softmax sum witnessed it: ``-0.0`` where no reduced entry of
    ``data`` (the operand, before its mask) is NaN or the infinity opposite
    to the reduction's identity, else NaN; a sum of ``y * 0`` for
    ``y = exp(x * c)`` (``exp(-x * c)`` for a min). XLA:CPU's max
    and min reductions may drop a NaN (a row of 64 with a NaN reduces to a
    number, even in plain ``jax.jit``), so the report never comes from their
    own result.

    The ``exp`` lets the reduction's own identity through: a max's ``-inf``
    (a causal mask written ``where(causal, s, -inf)``, or the mask's own
    ``-inf`` between examples) is a value the max reads as plain JAX does,
    where ``-inf * 0`` would be NaN and rerun every call in the exact
    program. A ``+inf`` (it meets the mask's ``-inf``: NaN) is reported.
    Computed in float32 or wider, ``c`` a power of two that puts the dtype's
    largest finite value at 64 (``exp(64)`` is finite): ``2**-122`` for
    float32 and bfloat16, ``2**-10`` for float16, whose own ``2**-120`` is 0.
    Not a clamp: ``max(x, 0)`` drops the NaN itself on jaxlib 0.10's XLA:CPU."""
    wide = data.astype(jnp.promote_types(data.dtype, jnp.float32))
    c = 2.0 ** (6 - jnp.finfo(data.dtype).maxexp)
    scaled = wide * jnp.asarray(c if kind == "max" else -c, wide.dtype)
    return _reduce_sum(nan_poison(jnp.exp(scaled)), axes).astype(data.dtype)


def _reduce_sum(x, axes):
    """``reduce_sum`` of ``x`` over ``axes`` in ``x``'s dtype. Bound through
    ``lax.reduce`` (which picks the primitive and its params) rather than with
    a max's params: jax 0.10's ``reduce_max`` has no ``out_sharding``, which
    its ``reduce_sum`` transpose requires."""
    return lax.reduce(x, np.zeros((), x.dtype), lax.add, tuple(axes))


def _bind_keeping_nan(ctx, x, axes, kind):
    """The reduction on row data; a max or min keeps its NaNs (``keep_nan``:
    XLA:CPU's may drop one)."""
    out = ctx.bind(x, axes=tuple(axes))
    if kind in ("max", "min"):
        out = keep_nan(out, x, lambda v: _reduce_sum(v, axes))
    return out


@register_nan_keeper(lax.reduce_max_p, lax.reduce_min_p)
def _keep_nan_of_per_segment_extremum(out, x, params):
    return keep_nan(out, x, lambda v: _reduce_sum(v, params["axes"]))


def _reducer(kind: str):
    def rule(ctx, x, *, axes, **params):
        if isinstance(x, PerSegment):
            raise ctx.unsupported("a per-segment operand")
        packed = ctx.in_packed[0]
        reduced = [a for a in axes if a in packed]
        kept = [a for a in packed if a not in axes]
        raw = getattr(x, "data", x)  # before the mask replaces it (``Unmasked``)
        arithmetic = (ctx.masked_by_arithmetic(0, x, kind)
                      if reduced and kept and kind in ("sum", "max", "min") else None)
        if arithmetic is not None:  # a speculative run's softmax: no select (interpreter)
            out = ctx.bind(arithmetic)
            if kind == "sum":
                return ctx.rerun_if_nan(out, sums=(raw, tuple(axes)))
            # the NaN report waits for the softmax's sum (``OwedReport``)
            report = ctx.owed_report(lambda: _nan_poison(raw, axes, kind), axes)
            return ctx.rerun_if_nan(out, owes=(arithmetic, report))
        x = ctx.settled(0, x)
        if not reduced:
            return _bind_keeping_nan(ctx, x, axes, kind)
        x = _mask_other_segments(ctx, x, reduced, kept, kind)
        if kept:
            return _bind_keeping_nan(ctx, x, axes, kind)
        # every packed axis reduced: the others first, then one segment reduction
        a0 = reduced[0]
        seg = ctx.axis_segments(ctx.in_avals[0], a0)
        rest = tuple(a for a in axes if a != a0)
        if rest:
            x = _bind_keeping_nan(ctx, x, rest, kind)
            a0 -= sum(1 for a in rest if a < a0)
        x = jnp.moveaxis(x, a0, 0)
        if kind in ("or", "and") and x.dtype != jnp.bool_:
            # (a segment max / min is a bool's or / and, not an integer's bitwise one)
            raise ctx.unsupported(f"a bitwise {kind} of {x.dtype} values over the packed axis "
                                  "(the padded layout runs it)")
        out = seg.segment_reduce(x, _SEGMENT_KIND[kind])
        return PerSegment(out.astype(ctx.out_avals[0].dtype))

    return rule


for _name, (_family, _kind) in list(FAMILIES.items()):
    if _family == "reduction" and _name not in ("argmax", "argmin", "reduce_xor"):
        register_packed(_name, reads_unmasked=True)(_reducer(_kind))


def _arg_extremum(kind: str):
    def rule(ctx, x, *, axes, index_dtype):
        (axis,) = axes
        if axis not in ctx.in_packed[0]:
            return ctx.bind(x)
        if len(ctx.in_packed[0]) > 1:
            return _block_arg_extremum(ctx, x, axis, kind, index_dtype)
        seg = ctx.axis_segments(ctx.in_avals[0], axis)
        x = jnp.moveaxis(x, axis, 0)  # (R, ...)
        first = _first_extremum(seg, x, kind)
        return PerSegment(first.astype(index_dtype))

    return rule


def _block_arg_extremum(ctx, x, axis: int, kind: str, index_dtype):
    """``argmax`` over one packed axis of a block-diagonal value (the best key
    of each attention query): the row's other segments take the worst value
    (``identity_of``), the row's ``argmax`` gives a position, and its place in
    its example (``Segments.pos``) is the index. Where that position lies in
    another segment, every entry of the query's own block ties with the
    worst value (all ``-inf``), and the first, index 0, is ``lax.argmax``'s."""
    aval = ctx.in_avals[0]
    kept = [a for a in ctx.in_packed[0] if a != axis]
    ok = ctx.run.same_segment(aval, [kept[0], axis], x.shape)
    x = lax.select(ok, x, jnp.full_like(x, identity_of(x.dtype, kind)))
    at = ctx.bind(x)  # a position in the row, per query
    seg = ctx.axis_segments(aval, axis)
    q = kept[0] - (kept[0] > axis)  # the kept axis's place in the result
    qseg = ctx.axis_segments(aval, kept[0])
    own = jnp.take(seg.seg, at) == seg.along(qseg.seg, q, at.ndim)
    return jnp.where(own, jnp.take(seg.pos, at), 0).astype(index_dtype)


def _first_extremum(seg, x, kind: str):
    """Per segment, the position of the first extremum of ``x`` (``(R, ...)``;
    a NaN first, as ``lax.argmax``), by one segmented scan of (value,
    position) pairs: every comparison reads one computed ``x`` (an ``x ==
    segment_max(x)`` test compared two computations of ``x``, which XLA may
    round differently in two fusions: no position matched under
    ``--xla_backend_optimization_level=0``)."""
    ids = jnp.broadcast_to(seg.along(seg.seg, 0, x.ndim), x.shape)
    pos = jnp.broadcast_to(seg.along(seg.pos, 0, x.ndim), x.shape)
    inexact = jnp.issubdtype(x.dtype, jnp.inexact)

    def op(a, b):  # a: the earlier positions, b: the later ones
        (va, pa, sa), (vb, pb, sb) = a, b
        wins = va >= vb if kind == "max" else va <= vb  # ties: the earlier one
        if inexact:
            wins = jnp.isnan(va) | (~jnp.isnan(vb) & wins)
        take_a = (sa == sb) & wins
        return (jnp.where(take_a, va, vb), jnp.where(take_a, pa, pb), sb)

    _, best_pos, _ = lax.associative_scan(op, (x, pos, ids), axis=0)
    last = jnp.clip(seg.starts + seg.lengths - 1, 0, x.shape[0] - 1)  # (S,)
    return jnp.take(jnp.take(best_pos, last, axis=0), seg.alias, axis=0)


register_packed(lax.argmax_p)(_arg_extremum("max"))
register_packed(lax.argmin_p)(_arg_extremum("min"))
