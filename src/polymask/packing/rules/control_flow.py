"""``lax.scan`` in the packed layout.

- A scan along the packed axis (an RNN over tokens, a state-space model's
  recurrence): one scan over the row's positions whose carry restarts from
  the example's ``init`` at every segment start (at every segment end for
  ``reverse=True``), the segmented-scan reset of Blelloch's formulation run
  step by step. The final carry of each example is the carry after its last
  step (``init`` for an empty example): one value per segment.
- A scan of a constant length (a loop over layers) whose values are packed:
  its body runs packed at every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ... import _jax_compat as compat
from ..registry import PerSegment, register_packed


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
    if any(ctx.in_packed[:n_in]):
        raise ctx.unsupported("a scan along the packed axis whose consts or carry are packed")
    if any(axes != (0,) for axes in ctx.in_packed[n_in:]):
        raise ctx.unsupported("scanned inputs packed along another axis than the scanned one")
    ids = seg.seg
    prev = jnp.concatenate([jnp.full((1,), -1, ids.dtype), ids[:-1]])
    nxt = jnp.concatenate([ids[1:], jnp.full((1,), -1, ids.dtype)])
    restart = (ids != nxt) if reverse else (ids != prev)  # the first step of a segment
    init0 = [_row(v, 0) for v in init]

    def step(carry, inp):
        slot, fresh, row = inp
        k = [_row(c, slot) for c in consts]
        carry = [lax.select(fresh, jnp.broadcast_to(_row(i, slot), jnp.shape(c)), c)
                 for i, c in zip(init, carry)]
        outs = run.eval_closed(jaxpr, [*k, *carry, *row])
        outs = [o.data if isinstance(o, PerSegment) else o for o in outs]
        return outs[:num_carry], (outs[num_carry:], outs[:num_carry])

    _, (ys, carries) = lax.scan(step, init0, (seg.slot, restart, xs), reverse=reverse)
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
