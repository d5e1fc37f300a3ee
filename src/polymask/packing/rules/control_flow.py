"""``lax.scan`` in the packed layout.

- A scan along the packed axis (an RNN over tokens, a state-space model's
  recurrence): one scan over the row's positions whose carry restarts from
  the example's ``init`` at every segment start (at every segment end for
  ``reverse=True``), the segmented-scan reset of Blelloch's formulation run
  step by step. The final carry of each example is the carry after its last
  step (``init`` for an empty example): one value per segment.
- A scan of a constant length (a loop over layers) whose values are packed:
  its body runs packed at every step.
- ``cond``/``switch`` with packed operands: every branch runs packed and each
  example takes its own branch's results (a predicate per example, e.g.
  ``x.sum() > 0``) or all take one (a shared predicate): ``select_n``, as
  ``jax.vmap`` batches a ``cond`` whose predicate is batched.
- ``while_loop`` with packed values: the body runs packed until every
  example's predicate is false; an example whose loop has ended keeps its
  carry (``vmap``'s batched ``while``). A shared predicate is one loop.

Equations of these primitives with no packed value run as the interpreter
runs any equation without a rule (bound, or ``vmap``-ed over the slots),
unless their bodies use the ragged size (``x.shape[0]`` in a predicate):
those run through the packed interpreter like the others.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ... import _jax_compat as compat
from ..registry import PerSegment, register_packed


def _kind_of(x) -> str:
    return "segment" if isinstance(x, PerSegment) else "plain"


def _as_segments(x, S: int) -> PerSegment:
    return x if isinstance(x, PerSegment) else PerSegment(jnp.broadcast_to(x, (S,) + jnp.shape(x)))


def _select(ctx, which, cases, aval):
    """``select_n(which, *cases)`` of one result: ``which`` shared (a scalar)
    or per example (``PerSegment (S,)``); ``cases`` of one kind, ``aval`` the
    result's symbolic aval."""
    if not isinstance(which, PerSegment):
        if isinstance(cases[0], PerSegment):
            return PerSegment(lax.select_n(which, *[c.data for c in cases]))
        return lax.select_n(which, *cases)
    axes = ctx.run.packed_axes(aval)
    if axes:  # packed: each position takes its example's choice
        seg = ctx.run.axis_segments(aval, axes[0])
        at = which.data[seg.slot]
        shape = jnp.shape(cases[0])
        pick = jnp.broadcast_to(seg.along(at, axes[0], len(shape)), shape)
        return lax.select_n(pick, *cases)
    data = [c.data for c in cases]  # per segment: (S, ...)
    pick = which.data.reshape((-1,) + (1,) * (data[0].ndim - 1))
    return PerSegment(lax.select_n(jnp.broadcast_to(pick, data[0].shape), *data))


def _same_kinds(outs_per_case, S: int):
    """Results of several branches (or steps) in one kind per result: a
    result per example in any of them is per example in all."""
    n = len(outs_per_case[0])
    seg = [any(isinstance(o[i], PerSegment) for o in outs_per_case) for i in range(n)]
    return [[_as_segments(o[i], S) if seg[i] else o[i] for i in range(n)]
            for o in outs_per_case]


@register_packed(lax.cond_p)
def cond_rule(ctx, index, *ops, branches, **params):
    if not any(ctx.in_packed) and not any(ctx.out_packed):
        out = ctx.run.unpacked(ctx.eqn, [index, *ops])
        if out is not None:
            return out
    outs = [ctx.eval_jaxpr(br, *ops) for br in branches]
    outs = _same_kinds(outs, ctx.seg.S)
    if isinstance(index, PerSegment):
        which = PerSegment(jnp.clip(index.data, 0, len(branches) - 1).astype(jnp.int32))
        # a shared result chosen per example is per example
        outs = [[_as_segments(o, ctx.seg.S) if not ctx.run.packed_axes(v.aval) else o
                 for o, v in zip(out, ctx.eqn.outvars)] for out in outs]
    else:
        which = jnp.clip(index, 0, len(branches) - 1).astype(jnp.int32)
    if len(branches) == 1:
        return outs[0]
    return [_select(ctx, which, [o[i] for o in outs], v.aval)
            for i, v in enumerate(ctx.eqn.outvars)]


@register_packed(lax.while_p)
def while_rule(ctx, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
    if not any(ctx.in_packed) and not any(ctx.out_packed):
        out = ctx.run.unpacked(ctx.eqn, list(args))
        if out is not None:
            return out
    run, S = ctx.run, ctx.seg.S
    cc, bc = list(args[:cond_nconsts]), list(args[cond_nconsts:cond_nconsts + body_nconsts])
    init = list(args[cond_nconsts + body_nconsts:])
    avals = [v.aval for v in ctx.eqn.outvars]

    def pred(carry):
        return run.eval_closed(cond_jaxpr, [*cc, *carry])[0]

    def body(carry):
        return run.eval_closed(body_jaxpr, [*bc, *carry])

    # kinds that the body or the predicate make per example start per example
    for _ in range(len(init) + 1):
        out = jax.eval_shape(body, init)
        if [_kind_of(o) for o in out] == [_kind_of(i) for i in init]:
            break
        init = _same_kinds([init, out], S)[0]
    if isinstance(jax.eval_shape(pred, init), PerSegment):
        init = [_as_segments(i, S) if not run.packed_axes(a) else i for i, a in zip(init, avals)]

        def step(carry):  # examples whose loop ended keep their carry
            go = pred(carry)
            new = _same_kinds([carry, body(carry)], S)[1]
            return [_select(ctx, PerSegment(go.data.astype(jnp.int32)), [c, b], a)
                    for c, b, a in zip(carry, new, avals)]

        return lax.while_loop(lambda c: jnp.any(pred(c).data), step, init)
    return lax.while_loop(pred, lambda c: _same_kinds([c, body(c)], S)[1], init)


def _row(v, slot):
    return v.data[slot] if isinstance(v, PerSegment) else v


@register_packed(lax.scan_p)
def scan_rule(ctx, *args, reverse, length, jaxpr, **params):
    num_consts, num_carry = compat.scan_counts(params)
    consts = list(args[:num_consts])
    init = list(args[num_consts:num_consts + num_carry])
    xs = list(args[num_consts + num_carry:])
    if ctx.run.is_packed(length):
        seg = ctx.run.segments(ctx.offset(length))
        return _scan_along_packed_axis(ctx, seg, jaxpr, consts, init, xs, reverse, num_carry)
    return _scan_with_packed_values(ctx, jaxpr, consts, init, xs, reverse, num_carry,
                                    ctx.run.size(length))


def _scan_along_packed_axis(ctx, seg, jaxpr, consts, init, xs, reverse, num_carry):
    run = ctx.run
    n_in = len(consts) + len(init)
    if any(ctx.in_packed[len(consts):n_in]):
        raise ctx.unsupported("a scan along the packed axis whose carry is packed")
    # each step runs its body with its own example as the row's only segment:
    # packed consts it indexes by step (dynamax's log_likelihoods[t]) and sizes
    # it reads (x.shape[0]) are that example's
    if any(axes != (0,) for axes in ctx.in_packed[n_in:]):
        raise ctx.unsupported("scanned inputs packed along another axis than the scanned one")
    ids = seg.seg
    prev = jnp.concatenate([jnp.full((1,), -1, ids.dtype), ids[:-1]])
    nxt = jnp.concatenate([ids[1:], jnp.full((1,), -1, ids.dtype)])
    restart = (ids != nxt) if reverse else (ids != prev)  # the first step of a segment
    init0 = [_row(v, 0) for v in init]

    def step(carry, inp):
        slot, fresh, live, row = inp
        # a dead step (the row's tail, a gap, past n + c) is the invariant's
        # dead entry: its inputs and outputs are selected to 0, so a body that
        # makes inf there (log of 0) never sends 0 * inf into a shared
        # parameter's or init's cotangent (the select's transpose is the gate)
        gate = functools.partial(_live_only, live)
        k = [gate(_row(c, slot)) for c in consts]
        carry = [gate(lax.select(fresh, jnp.broadcast_to(_row(i, slot), jnp.shape(c)), c))
                 for i, c in zip(init, carry)]
        outs = run.with_segments(seg.single(slot)).eval_closed(
            jaxpr, [*k, *carry, *map(gate, row)])
        # one example: a value per segment is that example's (S = 1)
        outs = [gate(o.data[0] if isinstance(o, PerSegment) else o) for o in outs]
        return outs[:num_carry], (outs[num_carry:], outs[:num_carry])

    _, (ys, carries) = lax.scan(step, init0, (seg.slot, restart, seg.live, xs),
                                reverse=reverse)
    last = seg.starts if reverse else seg.starts + seg.lengths - 1  # (S,)
    last = jnp.clip(last, 0, seg.R - 1)
    empty = seg.lengths == 0
    finals = []
    for i, c in zip(init, carries):
        at_end = c[last]
        init_s = (i.data if isinstance(i, PerSegment)
                  else jnp.broadcast_to(i, (seg.S,) + jnp.shape(i)))
        mask = empty.reshape((-1,) + (1,) * (at_end.ndim - 1))
        finals.append(PerSegment(jnp.where(mask, init_s.astype(at_end.dtype), at_end)))
    return [*finals, *ys]


def _live_only(live, v):
    """``v`` at a live step, 0 at a dead one (numeric values; others as they are)."""
    dtype = jnp.result_type(v)
    if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
        return v
    return lax.select(jnp.broadcast_to(live, jnp.shape(v)), v, jnp.zeros_like(v))


def _scan_with_packed_values(ctx, jaxpr, consts, init, xs, reverse, num_carry, length):
    run = ctx.run

    def body(carry, x):
        outs = run.eval_closed(jaxpr, [*consts, *carry, *x])
        return outs[:num_carry], outs[num_carry:]

    # per-segment xs are (S, L, ...): the scan slices L, so it goes first
    xs_in = [PerSegment(jnp.moveaxis(v.data, 1, 0)) if isinstance(v, PerSegment) else v
             for v in xs]
    # carries whose kind the body changes (shared in, per segment out) start per segment
    x0 = [PerSegment(v.data[0]) if isinstance(v, PerSegment) else v[0] for v in xs_in]
    xs_in = [PerSegment(v.data) if isinstance(v, PerSegment) else v for v in xs_in]
    out_kinds = jax.eval_shape(lambda c, x: body(c, x)[0], init, x0)
    init = [PerSegment(jnp.broadcast_to(v, (ctx.seg.S,) + jnp.shape(v)))
            if isinstance(o, PerSegment) and not isinstance(v, PerSegment) else v
            for v, o in zip(init, out_kinds)]
    carry, ys = lax.scan(body, init, xs_in, length=length, reverse=reverse)
    ys = [PerSegment(jnp.moveaxis(v.data, 0, 1)) if isinstance(v, PerSegment) else v
          for v in ys]
    return [*carry, *ys]
