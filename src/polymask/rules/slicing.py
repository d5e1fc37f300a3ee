"""Masking rules: slice, rev, pad, concatenate, split, stack, unstack, tile.

Results start at the *logical* position: a slice whose start depends on a
size (``x[-3:]``: start ``n - 3``) reads at the logical start with a dynamic
slice; ``rev`` shifts the reversed buffer so the logical end comes first;
``pad`` shifts by the logical low padding; ``concatenate`` and ``split``
place or cut pieces at logical offsets (one whole-piece
``dynamic_update_slice`` / ``dynamic_slice`` per piece, no element loops).

Whenever a padded window placed at the largest possible start would run past
the buffer, the buffer is first extended with zeros (``lax.pad``) so that
XLA's clamping of dynamic starts never shifts a window.

Backward pass: the transpose of a slice is a pad, so output padding that was
read from *logical* input positions (``x[:-1]``: output padding reads
``x[n-1]``) would route padding cotangents (possibly NaN) into the logical
gradient; float results are then selected to 0 in their padding.

Limits that come from JAX's symbolic tracing, not from these rules: JAX
assumes dim vars >= 1, so a length that does not mention the size
(``x[:1]`` has length 1, ``lax.pad`` interior gives ``2n + 2``) is wrong
at logical size 0. (``jnp.take(mode="wrap")`` computes ``i % n`` on values;
``jnp.pad(mode="wrap")`` is a gather of the same: ``rules/numeric.py``.)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .. import _jax_compat as compat
from ..core.shapes import is_static, lower_bound_int, needs_mask, upper_bound_int
from ..tracing.registry import register
from .util import clean_float, in_masked_trace, masked_axes, same_dim, valid_mask

# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
_ub, _lb = upper_bound_int, lower_bound_int


def _add(a, b):
    if is_static(a) and is_static(b):
        return int(a) + int(b)
    return jnp.asarray(a, jnp.int32) + jnp.asarray(b, jnp.int32)


def _zero(dtype):
    return jnp.zeros((), dtype)


def _window(x, starts, spans, start_ubs):
    """``x[starts : starts + spans]`` per axis; starts may be traced.

    ``start_ubs`` bound the starts; the buffer is extended with zeros so that
    no window is clamped by XLA.
    """
    ext = [max(0, int(u) + int(s) - int(b)) for u, s, b in zip(start_ubs, spans, x.shape)]
    if any(ext):
        x = lax.pad(x, _zero(x.dtype), [(0, e, 0) for e in ext])
    if all(is_static(s) for s in starts):
        return lax.slice(x, tuple(int(s) for s in starts),
                         tuple(int(s) + int(p) for s, p in zip(starts, spans)))
    return lax.dynamic_slice(x, [jnp.asarray(s, jnp.int32) for s in starts],
                             tuple(int(p) for p in spans))


# ----------------------------------------------------------------------------
# slice
# ----------------------------------------------------------------------------
@register(lax.slice_p)
def slice_rule(ctx, x, *, start_indices, limit_indices, strides):
    """Strided slice read at the logical start (dynamic when it depends on sizes)."""
    in_sym = ctx.in_avals[0].shape
    out_b = ctx.out_bounds[0]
    strides = tuple(1 if s is None else int(s) for s in (strides or (1,) * x.ndim))
    starts = [ctx.logical(s) for s in start_indices]
    start_ubs = [_ub(s) for s in start_indices]
    spans = [max(0, (o - 1) * st + 1) for o, st in zip(out_b, strides)]
    y = _window(x, starts, spans, start_ubs)
    if any(st != 1 for st in strides):
        y = lax.slice(y, (0,) * y.ndim, tuple(y.shape), strides)
    assert tuple(y.shape) == tuple(out_b), (y.shape, out_b)
    # Output padding reads logical input positions unless the slice runs to
    # the end of the (logical) axis.
    leak = [d for d in range(x.ndim) if not same_dim(limit_indices[d], in_sym[d])]
    return clean_float(y, ctx.out_logical[0], leak)


# ----------------------------------------------------------------------------
# rev
# ----------------------------------------------------------------------------
@register(lax.rev_p)
def rev_rule(ctx, x, *, dimensions):
    """Reverse, then shift left by ``bound - logical`` so the logical end comes first.

    The shift reads from a zero extension, so output padding is 0 and its
    cotangent lands in the (dropped) extension.
    """
    lg, b = ctx.in_logical[0], ctx.in_bounds[0]
    y = lax.rev(x, tuple(dimensions))
    axes = masked_axes(lg, b, dimensions)
    if not axes:
        return y
    starts = [(b[d] - lg[d] if is_static(lg[d]) else b[d] - jnp.asarray(lg[d], jnp.int32))
              if d in axes else 0 for d in range(x.ndim)]
    ubs = [b[d] if d in axes else 0 for d in range(x.ndim)]
    return _window(y, starts, b, ubs)


# ----------------------------------------------------------------------------
# concatenate / split / stack / unstack
# ----------------------------------------------------------------------------
@register(lax.concatenate_p, at_bound=True)  # drops empty operands at the bound too
def concatenate_rule(ctx, *xs, dimension):
    """Place each operand at the sum of the logical sizes before it.

    Operands are written in order with ``dynamic_update_slice``; each one's
    padding is overwritten by the next operand's logical data.
    """
    d = dimension
    # Operands of bound 0 hold nothing: drop them. XLA's MLIR converter fails on
    # an empty slice at the end of a concatenate whose last operand is empty
    # ("SmallVector unable to grow"; without a message it drops a callback's
    # config); pinned cases make such operands (jnp.roll(x, 1)[1:] at n = 1).
    kept = [i for i, b in enumerate(ctx.in_bounds) if b[d] != 0] or [0]
    xs = [xs[i] for i in kept]
    sizes_l = [ctx.in_logical[i][d] for i in kept]
    sizes_b = [ctx.in_bounds[i][d] for i in kept]
    out_b = list(ctx.out_bounds[0])
    if not any(needs_mask(s, b) for s, b in zip(sizes_l[:-1], sizes_b[:-1])):
        # logical data contiguous from 0: cut padding past the bound, or pad up to
        # it (operands of static sizes in a case pinned at a size below the bound:
        # lax.map(..., batch_size=2) at n = 5 of 6 concatenates 4 and 1)
        y = ctx.bind(*xs)
        if y.shape[d] > out_b[d]:
            return lax.slice_in_dim(y, 0, out_b[d], axis=d)
        if y.shape[d] < out_b[d]:
            cfg = [(0, 0, 0)] * y.ndim
            cfg[d] = (0, out_b[d] - y.shape[d], 0)
            y = lax.pad(y, _zero(y.dtype), cfg)
        return y
    total = max(out_b[d], sum(sizes_b))
    first = xs[0]
    cfg = [(0, 0, 0)] * first.ndim
    cfg[d] = (0, total - sizes_b[0], 0)
    buf = lax.pad(first, _zero(first.dtype), cfg)
    off = sizes_l[0]
    for x, s in zip(xs[1:], sizes_l[1:]):
        start = [jnp.int32(0)] * x.ndim
        start[d] = jnp.asarray(off, jnp.int32)  # a constant when the offset is static
        buf = lax.dynamic_update_slice(buf, x, start)
        off = _add(off, s)
    if total != out_b[d]:
        buf = lax.slice_in_dim(buf, 0, out_b[d], axis=d)
    return buf


@register(lax.split_p)
def split_rule(ctx, x, *, sizes, axis):
    """Cut each piece at the sum of the logical sizes before it."""
    sizes_l = [ctx.logical(s) for s in sizes]
    sizes_b = [ctx.padded(s) for s in sizes]
    if not any(needs_mask(s, b) for s, b in zip(sizes_l[:-1], sizes_b[:-1])):
        # pieces contiguous from 0: the padded axis may be longer (a case
        # pinned at a size below the bound) or shorter than the pieces' bounds
        total = sum(sizes_b)
        if x.shape[axis] > total:
            x = lax.slice_in_dim(x, 0, total, axis=axis)
        elif x.shape[axis] < total:
            cfg = [(0, 0, 0)] * x.ndim
            cfg[axis] = (0, total - x.shape[axis], 0)
            x = lax.pad(x, _zero(x.dtype), cfg)
        return ctx.bind(x)
    outs = []
    off, off_sym = 0, 0
    for k, (s_sym, s_l, s_b) in enumerate(zip(sizes, sizes_l, sizes_b)):
        starts = [0] * x.ndim
        starts[axis] = off
        ubs = [0] * x.ndim
        ubs[axis] = _ub(off_sym) if compat.is_dim_expr(off_sym) else int(off_sym)
        spans = list(ctx.out_bounds[k])
        y = _window(x, starts, spans, ubs)
        if k < len(sizes) - 1:
            y = clean_float(y, ctx.out_logical[k], [axis])
        outs.append(y)
        off = _add(off, s_l)
        off_sym = off_sym + s_sym
    return outs


@register(lax.stack_p, lax.unstack_p)
def stack_rule(ctx, *xs, **params):
    """The logical corner stays a corner: bind at the bound."""
    return ctx.bind(*xs)


_ORIGINAL_TRACER_ITER = getattr(*compat.tracer_iteration_home())


def iterate_over_a_tracer(tracer):
    """``iter(tracer)`` (``for v in x``, ``sum(x)``, ``list(x)``, unpacking):
    a Python loop of as many steps as the first axis has entries, which a
    symbolic size cannot give. Raised as a size needed as a constant (JAX's
    own failure is an AttributeError inside it), so the trace goes size by
    size where the sizes are few, and the runners make that axis static."""
    shape = getattr(getattr(tracer, "aval", None), "shape", ())
    if in_masked_trace() and shape and compat.is_dim_expr(shape[0]):
        raise compat.InconclusiveDimensionOperation(
            f"Iterating over an axis of symbolic size '{shape[0]}' (for v in x, sum(x), "
            "list(x), unpacking) requires a constant size")
    return _ORIGINAL_TRACER_ITER(tracer)


compat.replace_during_trace("iter(tracer) (Tracer.__iter__)", iterate_over_a_tracer)


@register(lax.tile_p)
def tile_rule(ctx, x, *, reps):
    """``out[j] = x[j mod n]`` per axis with a padded size or a symbolic repeat
    count (``jnp.resize`` tiles ``ceil(k / n)`` times): one gather per axis.
    Static repeats of static axes concatenate, as ``tile`` lowers."""
    lg, b = ctx.in_logical[0], ctx.in_bounds[0]
    out_b = ctx.out_bounds[0]
    masked = set(masked_axes(lg, b))
    gathered = [d for d in range(x.ndim)
                if compat.is_dim_expr(reps[d]) or (d in masked and int(reps[d]) != 1)]
    if not gathered:
        return ctx.bind(x)
    y = x
    for d in range(x.ndim):
        if d in gathered:
            n = jnp.maximum(jnp.asarray(lg[d], jnp.int32), 1)
            idx = lax.iota(jnp.int32, out_b[d]) % n
            y = jnp.take(y, idx, axis=d, mode="clip")
        elif int(reps[d]) != 1:
            y = lax.concatenate([y] * int(reps[d]), d)
    return clean_float(y, ctx.out_logical[0], gathered)


# ----------------------------------------------------------------------------
# pad
# ----------------------------------------------------------------------------
@register(lax.pad_p)
def pad_rule(ctx, x, padding_value, *, padding_config):
    """Low/high/interior padding (negative allowed) placed at the logical offsets.

    1. fill the operand's padding with the padding value (only where high
       padding can expose it), 2. interior padding at the bound (padding stays
       at the end), 3. shift by the logical low padding (dynamic slice of a
       padded buffer), 4. cut to the output bound.
    """
    lg, b = ctx.in_logical[0], ctx.in_bounds[0]
    out_b = ctx.out_bounds[0]
    pv = jnp.asarray(padding_value, x.dtype)
    cfg = []
    for lo, hi, interior in padding_config:
        if compat.is_dim_expr(interior):
            raise ctx.unsupported("interior padding given by a dimension expression")
        cfg.append((lo, hi, int(interior)))
    masked = masked_axes(lg, b)
    if not masked and all(not compat.is_dim_expr(lo) and not compat.is_dim_expr(hi)
                          for lo, hi, _ in cfg):
        return ctx.bind(x, padding_value)
    fill_axes = [d for d in masked
                 if compat.is_dim_expr(cfg[d][1]) or int(cfg[d][1]) > 0]
    m = valid_mask(lg, b, fill_axes) if fill_axes else None
    if m is not None:
        x = lax.select(m, x, lax.broadcast(pv, x.shape))
    # interior at the bound
    if any(i for _, _, i in cfg):
        x = lax.pad(x, pv, [(0, 0, i) for _, _, i in cfg])
    # shift by the low padding, cut to the output bound
    ext, starts, spans = [], [], []
    for d, (lo, hi, _) in enumerate(cfg):
        n_y = x.shape[d]
        S = out_b[d]
        if not compat.is_dim_expr(lo):
            lo = int(lo)
            # out = y shifted right by lo, cut at S
            P = max(lo, 0)
            start = P - lo
            Q = max(0, start + S - (P + n_y))
            ext.append((P, Q, 0))
            starts.append(start)
        else:
            try:
                lo_ub, lo_lb = _ub(lo), _lb(lo)
            except ValueError as e:
                raise ctx.unsupported(str(e)) from None
            P = max(lo_ub, 0)
            Q = max(0, S - lo_lb - n_y)
            ext.append((P, Q, 0))
            lo_v = jnp.asarray(ctx.dims.logical_raw(lo), jnp.int32)
            starts.append(P - lo_v)
        spans.append(S)
    if any(p or q for p, q, _ in ext):
        x = lax.pad(x, pv, ext)
    if all(is_static(s) for s in starts):
        y = lax.slice(x, tuple(starts), tuple(s + p for s, p in zip(starts, spans)))
    else:
        y = lax.dynamic_slice(x, [jnp.asarray(s, jnp.int32) for s in starts], tuple(spans))
    # Output padding may hold cropped logical elements or padding values:
    # select it away for NaN-safe cotangents (incl. w.r.t. the padding value).
    return clean_float(y, ctx.out_logical[0])
