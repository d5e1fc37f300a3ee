"""Sizes ``n + c`` along a packed axis: ``pad``, ``concatenate``, convolutions
and pooling windows. No value crosses from one example into another.

A value whose ragged axis has size ``n + c`` lives in the first ``n + c``
positions of each example's region (``segments.py``); the packer leaves a
gap of ``G`` free positions after every example, ``G`` the largest ``c``
and halo of the program (``interpreter._check_sizes``).

- ``pad`` by ``(lo, hi)``: each example's values move ``lo`` positions
  towards its end; its first ``lo`` and last ``hi`` positions take the
  padding value (negative widths crop).
- ``concatenate`` along the packed axis (a [CLS] row before the tokens,
  ``jnp.roll``): each position reads the piece its index within the
  example falls in, the pieces' boundaries per example (a piece of size
  ``n + c`` ends at a different place in every example).
- ``conv_general_dilated`` and ``reduce_window_{sum,max,min}`` along a packed
  axis (stride 1; strided ones change ``n`` to ``n // s``, which has no
  packed rule): the operand's dead positions become 0 (the reducer's
  identity), as XLA's DynamicPadder fills padding before a convolution, and
  the window is padded so that position ``p`` of the result reads from
  ``p - lo``: every window of an example reads its own values and dead
  positions only, when the gap holds ``c + max(lo, hi)`` positions (the
  halo registered here).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ...rules.util import identity_of, keep_nan
from ..registry import PerSegment, register_nan_keeper, register_packed, register_packed_halo
from ..segments import shift_along


def _along(seg, ids, axis, x):
    return jnp.broadcast_to(seg.along(ids, axis, x.ndim), x.shape)


# -- pad ----------------------------------------------------------------------------
@register_packed(lax.pad_p)
def pad_rule(ctx, x, padding_value, *, padding_config):
    if isinstance(x, PerSegment) or isinstance(padding_value, PerSegment):
        raise ctx.unsupported("a per-example operand or padding value")
    packed = ctx.in_packed[0]
    other = [(0, 0, 0) if a in packed else tuple(c) for a, c in enumerate(padding_config)]
    if any(c != (0, 0, 0) for c in other):
        x = lax.pad(x, padding_value, other)
    pv = jnp.asarray(padding_value, x.dtype)
    for a in packed:
        lo, _, interior = padding_config[a]
        if interior:
            raise ctx.unsupported("interior padding along the ragged axis")
        vin = ctx.axis_segments(ctx.in_avals[0], a)
        vout = ctx.axis_segments(ctx.out_avals[0], a)
        j = vout.rpos  # index within the example's region
        inside = (vout.region < vout.S) & (j >= lo) & (j - lo < vin.lengths[vout.slot])
        x = jnp.where(_along(vout, inside, a, x), shift_along(x, -int(lo), a), pv)
    return x


# -- concatenate ------------------------------------------------------------------------
@register_packed(lax.concatenate_p)
def concatenate_rule(ctx, *xs, dimension):
    a = dimension
    out_aval = ctx.out_avals[0]
    if a not in ctx.out_packed[0]:
        if any(isinstance(x, PerSegment) for x in xs):
            raise ctx.unsupported("a per-example operand")
        return ctx.bind(*xs)
    if len(ctx.out_packed[0]) != 1:
        raise ctx.unsupported("a concatenation along one packed axis of several")
    vout = ctx.axis_segments(out_aval, a)
    R = vout.R
    j, slot = vout.rpos, vout.slot  # (R,): index within the example, its slot
    start = vout.starts[slot]
    bound = jnp.zeros_like(j)  # where the current piece starts, per position
    out = None
    for x, aval in zip(xs, ctx.in_avals):
        d = aval.shape[a]
        if ctx.run.is_packed(d):
            size = ctx.axis_segments(aval, a).lengths[slot]
            piece = jnp.take(x, jnp.clip(start + j - bound, 0, R - 1), axis=a, mode="clip")
        else:
            size = ctx.run.size(d)
            if size == 0:
                continue
            piece = _constant_piece(x, jnp.clip(j - bound, 0, size - 1), slot, a)
        inside = (j >= bound) & (j < bound + size)
        out = piece if out is None else jnp.where(_along(vout, inside, a, piece), piece, out)
        bound = bound + size
    if out is None:  # every piece is empty: nothing is live
        return jnp.zeros(ctx.shape(out_aval), out_aval.dtype)
    return out


def _constant_piece(x, t, slot, a):
    """A piece of constant length ``k`` along ``a`` read at index ``t[p]`` for
    each position ``p`` (``(R,)``): shared data is the same for every
    example, per-example data (``(S, ...)``) is read at the position's slot."""
    if not isinstance(x, PerSegment):
        return jnp.take(x, t, axis=a, mode="clip")
    g = jnp.take(x.data, slot, axis=0, mode="clip")  # (R, *shape)
    idx = t.reshape((-1,) + (1,) * (g.ndim - 1))
    g = jnp.take_along_axis(g, idx, axis=a + 1, mode="clip")  # axis a + 1 now 1 long
    return jnp.moveaxis(jnp.squeeze(g, a + 1), 0, a)


# -- windows: convolutions and pooling ------------------------------------------------
def _window_padding(ctx, x, axes, padding, window, dilation, strides, base_dilation, fill):
    """The operand with dead positions set to ``fill`` and the padding that
    keeps each packed axis at the row's ``R`` positions, result position
    ``p`` reading from ``p - lo``."""
    padding = [tuple(p) for p in padding]
    for a, w in axes:  # a: operand axis, w: its window index
        if strides[w] != 1 or base_dilation[w] != 1:
            raise ctx.unsupported("a strided or dilated window along the ragged axis")
        seg = ctx.axis_segments(ctx.in_avals[0], a)
        x = jnp.where(_along(seg, seg.live, a, x), x, jnp.asarray(fill, x.dtype))
        lo = int(padding[w][0])
        padding[w] = (lo, int(dilation[w]) * (int(window[w]) - 1) - lo)
    return x, tuple(padding)


@register_packed(lax.conv_general_dilated_p)
def conv_rule(ctx, lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation,
              dimension_numbers, **params):
    if isinstance(lhs, PerSegment) or isinstance(rhs, PerSegment) or ctx.in_packed[1]:
        raise ctx.unsupported("a per-example or ragged kernel")
    lhs_spec, rhs_spec, _ = dimension_numbers
    packed = ctx.in_packed[0]
    if lhs_spec[1] in packed:
        raise ctx.unsupported("the ragged axis as the convolution's feature axis")
    axes = [(a, w) for w, a in enumerate(lhs_spec[2:]) if a in packed]
    if not axes:  # the ragged axis is the batch axis: per position
        return ctx.bind(lhs, rhs)
    window = [rhs.shape[d] for d in rhs_spec[2:]]
    lhs, pad = _window_padding(ctx, lhs, axes, padding, window, rhs_dilation, window_strides,
                               lhs_dilation, 0)
    return ctx.bind(lhs, rhs, padding=pad)


_RW_KIND = {"reduce_window_sum": "sum", "reduce_window_max": "max",
            "reduce_window_min": "min"}


@register_packed(lax.reduce_window_sum_p, lax.reduce_window_max_p, lax.reduce_window_min_p)
def reduce_window_rule(ctx, x, *, window_dimensions, window_strides, padding, base_dilation,
                       window_dilation):
    if isinstance(x, PerSegment):
        raise ctx.unsupported("a per-segment operand")
    kind = _RW_KIND[ctx.primitive.name]
    if any(ctx.run.is_packed(w) for w in window_dimensions):
        return _whole_example_window(ctx, x, kind, window_dimensions, window_strides, padding,
                                     base_dilation, window_dilation)
    axes = [(a, a) for a in ctx.in_packed[0]]
    x, pad = _window_padding(ctx, x, axes, padding, window_dimensions, window_dilation,
                             window_strides, base_dilation, identity_of(x.dtype, kind))
    out = ctx.bind(x, padding=pad)
    if kind == "sum":
        return out
    out = keep_nan(out, x, lambda v: lax.reduce_window_sum_p.bind(v, **ctx.params(padding=pad)))
    # a window of dead positions only is +-inf: its place is dead, but a later
    # ``x - max`` would make it NaN, and a gradient's 0 * NaN reaches the weights
    for a in ctx.out_packed[0]:
        seg = ctx.axis_segments(ctx.out_avals[0], a)
        out = jnp.where(_along(seg, seg.live, a, out), out, jnp.zeros((), out.dtype))
    return out


@register_nan_keeper(lax.reduce_window_max_p, lax.reduce_window_min_p)
def _keep_nan_of_per_segment_window(out, x, params):
    return keep_nan(out, x, lambda v: lax.reduce_window_sum_p.bind(v, **params))


def _whole_example_window(ctx, x, kind, window, strides, padding, base_dilation, dilation):
    """A window as long as the example along its packed axis, the other
    windows trivial (flax's ``max_pool(x, (num_points, 1))``, a global pool):
    one segment reduction, one value per example."""
    (a,) = ctx.in_packed[0] if len(ctx.in_packed[0]) == 1 else (None,)
    trivial = all(int(window[i]) == 1 and tuple(padding[i]) == (0, 0)
                  for i in range(x.ndim) if i != a) if a is not None else False
    if (not trivial or ctx.run.offset(window[a]) != ctx.run.offset(ctx.in_avals[0].shape[a])
            or tuple(padding[a]) != (0, 0) or dilation[a] != 1 or base_dilation[a] != 1
            or any(s != 1 for s in base_dilation)):
        raise ctx.unsupported("a window of the ragged size that is not the whole example")
    seg = ctx.axis_segments(ctx.in_avals[0], a)
    out = seg.segment_reduce(jnp.moveaxis(x, a, 0), kind)  # (S, rest...)
    shape = ctx.shape(ctx.out_avals[0])
    return PerSegment(jnp.expand_dims(out, a + 1).reshape((seg.S,) + shape))


@register_packed_halo(lax.conv_general_dilated_p)
def conv_halo(eqn, offset) -> int:
    lhs_spec = eqn.params["dimension_numbers"][0]
    shape = eqn.invars[0].aval.shape
    return _halo(offset, [(shape[a], eqn.params["padding"][w])
                          for w, a in enumerate(lhs_spec[2:])])


@register_packed_halo(lax.reduce_window_sum_p, lax.reduce_window_max_p,
                      lax.reduce_window_min_p)
def reduce_window_halo(eqn, offset) -> int:
    shape = eqn.invars[0].aval.shape
    return _halo(offset, list(zip(shape, eqn.params["padding"])))


def _halo(offset, sizes_and_padding) -> int:
    """The gap a window needs after an operand of size ``n + c``: ``c`` and
    the window's reach past either end of the example (``max(lo, hi)``)."""
    need = 0
    for d, (lo, hi) in sizes_and_padding:
        c = offset(d)
        if c is not None:
            need = max(need, c + max(int(lo), int(hi), 0))
    return need
