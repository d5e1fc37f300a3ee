"""Windowed ops: ``conv_general_dilated``, ``reduce_window*``, ``select_and_*_add``.

Every windowed op is masked the same way, one window axis at a time:

* The input's padding is filled with the value the unpadded program pads
  with (0 for convolutions and sums, the identity for max/min), with
  ``select`` (NaN-safe). A generic ``reduce_window`` has no such value: XLA
  *skips* padding positions and base-dilation holes (a window is its init
  value combined with its in-bounds elements only, so an init value that is
  not an identity, e.g. ``add`` from 1, counts once per window). When a
  logical window may read past the logical size (high padding on a masked
  axis) or a position written by ``lax.pad`` (below), the op runs on
  ``(*operands, valid)`` with a reducer that skips invalid elements.
* The op's low padding ``lo`` is a dimension expression of the *logical*
  size (``SAME`` with strides is parity dependent). Output ``o`` reads
  dilated-padded input position ``o*s + j*r - lo``. When ``lo`` evaluates to
  a Python int the physical op uses it directly, with a high padding chosen so
  that the physical output has exactly the padded output size. Otherwise the
  input is *shifted* like XLA's DynamicPadder does: pad it by the window
  (``lax.pad``, which also applies base/lhs dilation) and ``dynamic_slice`` it
  at ``A - lo``; the physical op then runs with zero padding.
* Since the logical region of the input is followed by fill values, every
  logical output sees exactly the unpadded window; only output positions past
  the logical output size read padding, and they are free.
* Backward pass (JAX differentiates the padded program): the transposes of
  conv / reduce_window_sum / select_and_gather_add sum output cotangents over
  windows, so float outputs get their padding selected to 0; inputs are
  zero/identity-filled, so every backward product is finite.
* Grouped convolutions whose grouped axis is dynamic (``"2*k"`` features with
  ``feature_group_count=2``, batch with ``batch_group_count``, or grouped
  output features) re-lay the logical groups out one per padded group block.

* A window size given by a dimension expression (``x.shape[0]``) is
  evaluated at the logical sizes; when that value is traced, ``lax.switch``
  runs the op with each possible static window size (1 to its bound, at most
  ``_MAX_WINDOW_BRANCHES`` values, else ``UnsupportedError``), so any reducer,
  associative or not, gives XLA's result. A window size < 1 is a ShapeError.

Known limit (JAX's symbolic shapes, not this module): a base/lhs-dilated axis
has symbolic size ``d*(n-1)+1``, which JAX derives assuming ``n >= 1``; at
logical size 0 with padding larger than the window, the logical output size
follows that formula, not JAX's concrete result (e.g. base dilation 2, padding
``(1, 2)``, window 3 at ``n = 0``: 0 instead of 1).
"""

from __future__ import annotations

import itertools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .. import _jax_compat as compat
from ..core.shapes import is_static, needs_mask
from ..tracing.registry import register
from .util import (
    clean,
    clean_float,
    fill_padding,
    identity_of,
    in_masked_trace,
    is_inexact,
    keep_nan,
    masked_axes,
    same_dim,
    valid_mask,
)

_BRUTE_FORCE_LIMIT = 2048
_MAX_WINDOW_BRANCHES = 64  # values a dynamic window size may take (lax.switch branches)


# ----------------------------------------------------------------------------
# Per-axis plans
# ----------------------------------------------------------------------------
def _expr_range(ctx, e) -> tuple[int, int]:
    """Bounds of a dimension expression over all legal logical sizes (0 included).

    JAX's decision procedure (sound for sizes >= 1) plus the all-zero corner;
    loose bounds only cost extra padding of the shifted input.
    """
    if not compat.is_dim_expr(e):
        return int(e), int(e)
    names = sorted(compat.dim_vars(e))
    lo, hi = compat.lower_bound(e), compat.upper_bound(e)
    at0 = int(compat.evaluate_dim(e, {v: 0 for v in names}))
    if np.isfinite(lo) and np.isfinite(hi):
        return min(int(lo), at0), max(int(hi), at0)
    bounds = ctx.dims.bounds
    if len(names) == 1 and bounds[names[0]] <= _BRUTE_FORCE_LIMIT:
        vals = [int(compat.evaluate_dim(e, {names[0]: v}))
                for v in range(bounds[names[0]] + 1)]
        return min(vals), max(vals)
    raise ctx.unsupported(f"cannot bound the window padding {e}")


def _dilated(size: int, d: int) -> int:
    return 0 if size == 0 else d * (size - 1) + 1


class _AxisPlan:
    """How one window axis of the physical op is laid out.

    ``kind`` is "param" (static, non-negative low padding: the op pads
    itself), "static" (static padding with a negative side: ``lax.pad`` the
    input by ``(lo, hi)``, interior ``d - 1``) or "dynamic" (``lax.pad`` by
    ``(A, B)`` and ``dynamic_slice`` at ``A - lo``). The last two run the op
    with zero padding and no base/lhs dilation on this axis.
    """

    def __init__(self, ctx, axis, in_size, lo_expr, keff, stride, dilation, out_bound):
        self.axis = axis
        self.in_size = in_size
        self.dilation = dilation
        self.zlen = (out_bound - 1) * stride + keff
        lo = ctx.dims.logical_raw(lo_expr) if compat.is_dim_expr(lo_expr) else int(lo_expr)
        if is_static(lo):
            lo = int(lo)
            hi = self.zlen - _dilated(in_size, dilation) - lo
            self.lo = lo
            self.kind = "param" if lo >= 0 and hi >= 0 else "static"
            self.cfg = (lo, hi, dilation - 1)
        else:
            lmin, lmax = _expr_range(ctx, lo_expr)
            self.lo = jnp.clip(jnp.asarray(lo, jnp.int32), lmin, lmax)
            self.lrange = (lmin, lmax)
            a = max(lmax, 0)
            b = max(0, self.zlen - lmin - _dilated(in_size, dilation))
            self.kind = "dynamic"
            self.cfg = (a, b, dilation - 1)
            self.start = a - self.lo
        if self.kind == "param":
            self.pad, self.phys_dilation = (lo, hi), dilation
        else:
            self.pad, self.phys_dilation = (0, 0), 1


def _phys(plans):
    return (tuple(p.pad for p in plans), tuple(p.phys_dilation for p in plans))


def _shift_input(x, fill, plans: list[_AxisPlan]):
    """Lay ``x`` out for the physical op (one pad + at most one dynamic_slice)."""
    moved = [p for p in plans if p.kind != "param"]
    if not moved:
        return x
    cfg = [(0, 0, 0)] * x.ndim
    for p in moved:
        cfg[p.axis] = p.cfg
    x = lax.pad(x, jnp.asarray(fill, x.dtype), cfg)
    dyn = [p for p in moved if p.kind == "dynamic"]
    if not dyn:
        return x
    starts = [jnp.int32(0)] * x.ndim
    sizes = list(x.shape)
    for p in dyn:
        starts[p.axis] = p.start
        sizes[p.axis] = p.zlen
    return lax.dynamic_slice(x, starts, sizes)


def _unshift_output(z, plans: list[_AxisPlan]):
    """Inverse of ``_shift_input`` (no dilation): ``out[i] = z[i + lo]`` per moved axis."""
    moved = [p for p in plans if p.kind != "param"]
    if not moved:
        return z
    cfg = [(0, 0, 0)] * z.ndim
    starts = [jnp.int32(0)] * z.ndim
    sizes = list(z.shape)
    for p in moved:
        if p.kind == "static":
            cfg[p.axis] = (-p.lo, p.in_size - p.zlen + p.lo, 0)
            sizes[p.axis] = p.in_size
        else:
            lmin, lmax = p.lrange
            c = max(0, -lmin)
            cfg[p.axis] = (c, max(0, p.in_size + lmax - p.zlen), 0)
            starts[p.axis] = c + p.lo
            sizes[p.axis] = p.in_size
    z = lax.pad(z, jnp.zeros((), z.dtype), cfg)
    if all(p.kind == "static" for p in moved):
        return z
    return lax.dynamic_slice(z, starts, sizes)


def _zeros_out(ctx, i=0):
    return jnp.zeros(ctx.out_bounds[i], ctx.out_avals[i].dtype)


# ----------------------------------------------------------------------------
# Convolution
# ----------------------------------------------------------------------------
@register(lax.conv_general_dilated_p)
def conv_rule(ctx, lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation,
              dimension_numbers, feature_group_count, batch_group_count, **params):
    dn = dimension_numbers
    lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lb, rb, ob = ctx.in_bounds[0], ctx.in_bounds[1], ctx.out_bounds[0]
    ll, rl = ctx.in_logical[0], ctx.in_logical[1]
    for i, ax in enumerate(rspec[2:]):  # plain JAX rejects an empty kernel axis
        w = ctx.in_avals[1].shape[ax]
        if compat.is_dim_expr(w):
            raw = ctx.dims.logical_raw(w)
            ctx.require(raw < 1, f"conv_general_dilated expects window to have positive "
                        f"value for {i}-th window dimension, but got {{0}} (the kernel's "
                        f"axis {ax}, of size {w}) at these sizes", values=(raw,),
                        error_type=ValueError)
    if 0 in ob:
        return _zeros_out(ctx)
    if compat.is_dim_expr(feature_group_count) or compat.is_dim_expr(batch_group_count):
        groups = 1  # a dim var's count of static-size groups: see _check_dynamic_groups
        _check_dynamic_groups(ctx, feature_group_count, batch_group_count)
    else:
        groups = max(feature_group_count, batch_group_count)
    # Grouped dynamic axes: the logical groups are contiguous blocks of the
    # logical size; lay them out one block per padded group (and back for the
    # output features) so the physical op sees each group at its own offset.
    grouped_lhs_axis = lspec[1] if groups > 1 and feature_group_count > 1 else lspec[0]
    if groups > 1 and needs_mask(ll[grouped_lhs_axis], lb[grouped_lhs_axis]):
        lhs = _spread_groups(clean(lhs, ll), grouped_lhs_axis, groups, ll[grouped_lhs_axis])
        ll = tuple(lb[a] if a == grouped_lhs_axis else ll[a] for a in range(lhs.ndim))
    compact_out = groups > 1 and needs_mask(rl[rspec[0]], rb[rspec[0]])
    if compact_out:
        rhs = _spread_groups(clean(rhs, rl), rspec[0], groups, rl[rspec[0]])
        rl = tuple(rb[a] if a == rspec[0] else rl[a] for a in range(rhs.ndim))
    if 0 in ob:
        return _zeros_out(ctx)
    lhs = clean(lhs, ll)
    rhs = clean(rhs, rl)
    plans = []
    for i, ax in enumerate(lspec[2:]):
        k = rb[rspec[2 + i]]
        keff = _dilated(k, rhs_dilation[i])
        plans.append(_AxisPlan(ctx, ax, lb[ax], padding[i][0], keff, window_strides[i],
                               lhs_dilation[i], ob[ospec[2 + i]]))
    real = _shifted_indicator(ll, lb, lspec[2:], plans, lhs.dtype)
    lhs = _shift_input(lhs, 0, plans)
    pad, dil = _phys(plans)
    live_k = valid_mask(rl, rb, list(rspec[2:]))
    if live_k is not None and is_inexact(rhs.dtype):
        out = _conv_keeping_nonfinite_terms(ctx, lhs, rhs, real, live_k, pad, dil)
    else:
        out = ctx.bind(lhs, rhs, padding=pad, lhs_dilation=dil)
    if compact_out:
        out = _gather_groups(out, ospec[1], groups, ctx.out_logical[0][ospec[1]])
    return clean_float(out, ctx.out_logical[0])


def _shifted_indicator(ll, lb, spatial, plans, dtype):
    """1 where the laid-out input holds a real (logical) position, 0 at the
    zeros ``_shift_input`` materialises (padding the op would leave implicit)."""
    real = valid_mask(ll, lb, list(spatial))
    shape = tuple(int(b) for b in lb)
    real = jnp.ones(shape, dtype) if real is None else real.astype(dtype)
    return _shift_input(real, 0, plans)


def _conv_keeping_nonfinite_terms(ctx, lhs, rhs, real, live_k, pad, dil):
    """A convolution whose kernel has a masked window axis (``jnp.convolve``
    swaps its operands when the signal is shorter than the kernel: the data
    becomes the kernel). XLA leaves a convolution's padding implicit (no
    ``0 * nan`` term), but here the input's padding and the kernel's beyond
    its logical size are real zeros: both operands enter with non-finite
    entries as 0, and an output is NaN where some term plain JAX computes
    (a real input position times a logical kernel tap) is non-finite,
    counted with two convolutions of 0/1 indicators (the kind, NaN or inf,
    may differ from plain JAX's)."""
    zero = lambda x: jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))  # noqa: E731
    bad = lambda x: (~jnp.isfinite(x)).astype(lhs.dtype)  # noqa: E731
    conv = lambda a, b: ctx.bind(a, b, padding=pad, lhs_dilation=dil)  # noqa: E731
    out = conv(zero(lhs), zero(rhs))
    live = live_k.astype(lhs.dtype)
    count = conv(bad(lhs), live) + conv(real, bad(rhs) * live)
    return jnp.where(count > 0, jnp.full_like(out, jnp.nan), out)


def _check_dynamic_groups(ctx, feature_group_count, batch_group_count) -> None:
    """A group count given by a dim var (``vmap`` of a convolution with a kernel
    per example) where every group has a static size: group ``g`` is the block
    ``[g * size, (g + 1) * size)`` of the grouped axes, so the logical groups
    are a prefix and the padded count (the bound) adds whole padding groups,
    whose outputs are padding. Else refused."""
    dn = ctx.eqn.params["dimension_numbers"]
    lhs_shape, rhs_shape = ctx.in_avals[0].shape, ctx.in_avals[1].shape
    axes = [(lhs_shape, dn.lhs_spec[1], feature_group_count),
            (lhs_shape, dn.lhs_spec[0], batch_group_count),
            (rhs_shape, dn.rhs_spec[0], feature_group_count * batch_group_count)]
    for shape, axis, count in axes:
        if not compat.is_dim_expr(count):
            continue
        per = shape[axis] // count
        if compat.is_dim_expr(per) or per * count != shape[axis]:
            raise ctx.unsupported(f"a convolution with {count} groups of a dynamic size")


def _spread_groups(x, axis, groups, size):
    """Logical ``[g0 | g1 | ...]`` (blocks of ``size // groups``) -> one block per
    padded group of ``bound // groups``; the rest zero."""
    bound = x.shape[axis]
    per_bound = bound // groups
    per = jnp.asarray(size, jnp.int32) // groups
    p = lax.iota(jnp.int32, bound)
    g, j = p // per_bound, p % per_bound
    ok = j < per
    src = jnp.where(ok, g * per + j, 0)
    y = jnp.take(x, src, axis=axis, mode="clip")
    shape = [1] * x.ndim
    shape[axis] = bound
    return lax.select(jnp.broadcast_to(ok.reshape(shape), y.shape), y, jnp.zeros_like(y))


def _gather_groups(x, axis, groups, size):
    """Inverse of ``_spread_groups`` (padding left as garbage: cleaned later)."""
    bound = x.shape[axis]
    per_bound = bound // groups
    per = jnp.maximum(jnp.asarray(size, jnp.int32) // groups, 1)
    p = lax.iota(jnp.int32, bound)
    src = (p // per) * per_bound + p % per
    return jnp.take(x, src, axis=axis, mode="clip")


# ----------------------------------------------------------------------------
# reduce_window
# ----------------------------------------------------------------------------
def _window_plans(ctx, in_bounds, out_bounds, window_dimensions, window_strides, padding,
                  base_dilation, window_dilation):
    plans = []
    for ax in range(len(in_bounds)):
        keff = _dilated(int(window_dimensions[ax]), window_dilation[ax])
        plans.append(_AxisPlan(ctx, ax, in_bounds[ax], padding[ax][0], keff,
                               window_strides[ax], base_dilation[ax], out_bounds[ax]))
    return plans


def _whole_axis_windows(ctx, operand: int, window_dimensions, padding, base_dilation=None,
                        window_dilation=None) -> set[int]:
    """The axes whose window spans the whole (padded) axis: ``w == n + lo + hi``
    with no dilation, as in global pooling (``nn.max_pool(x, (x.shape[1], 1))``
    in PointNet). There the op is one reduction over the axis: run with the
    padded axis as its window, the padding filled with the reducer's identity
    (or skipped), it needs no branch per window size."""
    shape = ctx.in_avals[operand].shape
    whole = set()
    for ax, w in enumerate(window_dimensions):
        undilated = all(d is None or d[ax] == 1 for d in (base_dilation, window_dilation))
        if (compat.is_dim_expr(w) and undilated
                and same_dim(w, shape[ax] + padding[ax][0] + padding[ax][1])):
            whole.add(ax)
    return whole


def _with_static_windows(ctx, window_dimensions, body, whole: set[int] = frozenset()):
    """``body(window_dimensions)`` with every window size a Python int.

    A window size given by a dimension expression (``x.shape[0]``) is
    evaluated at the logical sizes; when that value is traced, ``lax.switch``
    dispatches over its possible values (the op is run with each static window
    size in its own branch, so every reducer, associative or not, gives XLA's
    result). Sizes where JAX rejects the window (< 1) raise ``ShapeError``.
    An axis in ``whole`` (``_whole_axis_windows``) gets its padded size as
    its window.
    """
    name = ctx.primitive.name
    static, dynamic = [], []  # dynamic: (axis, candidate sizes, logical value)
    for ax, w in enumerate(window_dimensions):
        if not compat.is_dim_expr(w):
            static.append(int(w))
            continue
        raw = ctx.dims.logical_raw(w)
        ctx.require(raw < 1, f"{name}: the window size {w} of axis {ax} is {{0}} at these "
                    "sizes; window sizes must be >= 1", values=(raw,), error_type=TypeError)
        if is_static(raw) or ax in whole:
            static.append(ctx.padded(w) if ax in whole else max(int(raw), 1))
            continue
        dynamic.append((ax, range(1, max(ctx.padded(w), 1) + 1), jnp.asarray(raw, jnp.int32)))
        static.append(1)
    if not dynamic:
        return body(tuple(static))
    count = int(np.prod([len(c) for _, c, _ in dynamic]))
    if count > _MAX_WINDOW_BRANCHES:
        axes = [ax for ax, _, _ in dynamic]
        raise ctx.unsupported(
            f"the window size on axis {axes} depends on a dynamic size "
            f"({[str(window_dimensions[a]) for a in axes]}) and can take {count} values "
            f"(at most {_MAX_WINDOW_BRANCHES} are supported: lower the bounds); a window "
            "that spans a whole axis is a reduction over that axis, e.g. "
            "jnp.min(x, axis=...) / jnp.sum / jnp.max")
    # Touch the lazily computed output sizes outside the branches (their
    # values would otherwise be the inner traces').
    ctx.out_logical  # noqa: B018
    index, branches = jnp.int32(0), []
    for _, cands, raw in dynamic:
        index = index * len(cands) + (jnp.clip(raw, cands[0], cands[-1]) - cands[0])
    for combo in itertools.product(*(c for _, c, _ in dynamic)):
        wd = list(static)
        for (ax, _, _), w in zip(dynamic, combo):
            wd[ax] = w

        def branch(wd=tuple(wd)):
            with ctx.state.scoped():
                return body(wd)

        branches.append(branch)
    return lax.switch(index, branches)


_RW_KIND = {"reduce_window_sum": "sum", "reduce_window_max": "max",
            "reduce_window_min": "min"}


@register(lax.reduce_window_sum_p)
@register(lax.reduce_window_max_p, lax.reduce_window_min_p, at_bound=True)  # keep_nan
def reduce_window_monoid_rule(ctx, x, *, window_dimensions, window_strides, padding,
                              base_dilation, window_dilation):
    if 0 in ctx.out_bounds[0]:
        return _zeros_out(ctx)
    kind = _RW_KIND[ctx.primitive.name]
    fill = identity_of(x.dtype, kind)
    x = fill_padding(x, ctx.in_logical[0], fill)

    def run(wd):
        plans = _window_plans(ctx, ctx.in_bounds[0], ctx.out_bounds[0], wd,
                              window_strides, padding, base_dilation, window_dilation)
        pad, dil = _phys(plans)
        shifted = _shift_input(x, fill, plans)
        out = ctx.bind(shifted, padding=pad, base_dilation=dil, window_dimensions=wd)
        if kind == "sum":
            return out
        return keep_nan(out, shifted, lambda v: lax.reduce_window_sum_p.bind(
            v, **ctx.concrete_params(padding=pad, base_dilation=dil, window_dimensions=wd)))

    whole = _whole_axis_windows(ctx, 0, window_dimensions, padding, base_dilation,
                                window_dilation)
    out = _with_static_windows(ctx, window_dimensions, run, whole)
    return clean_float(out, ctx.out_logical[0])


@register(lax.reduce_window_p)
def reduce_window_generic_rule(ctx, *args, jaxpr, consts, window_dimensions, window_strides,
                               padding, base_dilation, window_dilation):
    """A generic reducer (its init value need not be an identity of it).

    XLA computes each window as ``init`` combined with the window's elements
    that lie in the (base-dilated) operand: padding positions and base-dilation
    holes are *skipped*, not read as ``init``. So positions past the logical
    size can hold no fill value that acts as "nothing" in general (an init of
    1 for ``add`` adds 1 per padded position a window reads). When some
    logical window may read such a position (a masked axis with high padding,
    or an axis laid out with ``lax.pad``), the op runs on ``(*operands,
    valid)`` with a reducer that skips invalid elements: the same reducer
    calls, in the same order, as on the exact array.
    """
    n = len(args) // 2
    operands, inits = args[:n], args[n:]
    if 0 in ctx.out_bounds[0]:
        return [_zeros_out(ctx, i) for i in range(n)]
    filled = [fill_padding(x, lg, init)
              for x, lg, init in zip(operands, ctx.in_logical[:n], inits)]
    reducer = compat.jaxpr_as_fun(jaxpr, consts)

    def run(wd):
        plans = _window_plans(ctx, ctx.in_bounds[0], ctx.out_bounds[0], wd,
                              window_strides, padding, base_dilation, window_dilation)
        shifted = [_shift_input(x, init, plans) for x, init in zip(filled, inits)]
        pad, dil = _phys(plans)
        if not whole and not _reads_invalid(ctx, plans, padding):
            return list(ctx.bind(*shifted, *inits, padding=pad, base_dilation=dil,
                                 window_dimensions=wd))
        valid = valid_mask(ctx.in_logical[0], ctx.in_bounds[0])
        if valid is None:
            valid = jnp.ones(ctx.in_bounds[0], jnp.bool_)
        valid = _shift_input(valid, False, plans)
        win = dict(window_dimensions=tuple(wd), window_strides=tuple(window_strides),
                   padding=pad, base_dilation=dil, window_dilation=tuple(window_dilation))
        return _reduce_window_skipping(reducer, shifted, inits, valid, win)

    # a whole-axis window reads the padding: only the skipping reducer ignores it
    whole = _whole_axis_windows(ctx, 0, window_dimensions, padding, base_dilation,
                                window_dilation)
    outs = _with_static_windows(ctx, window_dimensions, run, whole)
    return [clean_float(o, lo) for o, lo in zip(outs, ctx.out_logical)]


def _reads_invalid(ctx, plans, padding) -> bool:
    """Whether a logical output's window may read a position of the physical
    operand that is not a logical element (nor physical padding, which XLA
    skips): the padding of a masked axis with logical high padding > 0, or
    any position ``lax.pad`` wrote (a non-"param" axis)."""
    masked = set(masked_axes(ctx.in_logical[0], ctx.in_bounds[0]) or ())
    for p in plans:
        if p.kind != "param":
            return True
        if p.axis in masked:
            hi = ctx.dims.logical_raw(padding[p.axis][1])
            if not is_static(hi) or int(hi) > 0:
                return True
    return False


def _skipping(reducer, n, k=0, jvp_of=None):
    """The reducer over ``(*values, valid)`` that skips invalid elements.

    ``combine(a, b)`` is ``reducer(a, b)`` when both are valid, else the
    valid one (either when neither is): invalid elements act as an identity
    for any reducer and any association order. With ``jvp_of`` (the indices
    of the differentiated values), each element carries ``k`` tangents after
    its ``n`` values and the reducer's JVP is applied.
    """
    def combine(a, b):
        va, vb = a[-1], b[-1]
        if jvp_of is None:
            r = list(reducer(*a[:n], *b[:n]))
        else:
            r = _reducer_jvp(reducer, n, jvp_of, a, b)
        both = va & vb
        out = [lax.select(both, ri, lax.select(va, x, y)) for ri, x, y in zip(r, a, b)]
        return (*out, va | vb)

    return combine


def _reducer_jvp(reducer, n, diff, a, b):
    """``reducer(a, b)`` and its tangents along ``diff`` (values, then tangents)."""
    k = len(diff)

    def at(xs):  # the differentiated values of a then b, the others fixed
        fa, fb = list(a[:n]), list(b[:n])
        for j, i in enumerate(diff):
            fa[i], fb[i] = xs[j], xs[k + j]
        r = list(reducer(*fa, *fb))
        return [r[i] for i in diff], r

    prim = [a[i] for i in diff] + [b[i] for i in diff]
    tans = list(a[n:n + k]) + list(b[n:n + k])
    _, r_tan, r = jax.jvp(lambda *xs: at(xs), prim, tans, has_aux=True)
    return [*r, *r_tan]


def _reduce_window_skipping(reducer, operands, inits, valid, win):
    """``reduce_window`` of ``operands`` where elements with ``valid`` False are
    skipped (like XLA's padding); forward-mode differentiable like JAX's own
    generic ``reduce_window`` (no non-zero init tangents)."""
    n = len(operands)
    diff = [i for i in range(n) if is_inexact(operands[i].dtype)]

    @jax.custom_jvp
    def run(operands, inits, valid):
        outs = lax.reduce_window((*operands, valid), (*inits, True), _skipping(reducer, n),
                                 **win)
        return list(outs[:n])

    def run_jvp(primals, tangents):
        operands, inits, valid = primals
        t_ops, t_inits, _ = tangents
        if not all(isinstance(t, SymbolicZero) for t in t_inits):
            raise TypeError("reduce_window jvp does not support non-zero init_value_tangent.")
        tans = [t_ops[i] for i in diff]
        tans = [jnp.zeros(t.shape, t.dtype) if isinstance(t, SymbolicZero) else t
                for t in tans]
        zeros = [jnp.zeros((), operands[i].dtype) for i in diff]
        outs = lax.reduce_window(
            (*operands, *tans, valid), (*inits, *zeros, True),
            _skipping(reducer, n, len(diff), diff), **win)
        t_out = [np.zeros(o.shape, jax.dtypes.float0) for o in outs[:n]]
        for j, i in enumerate(diff):
            t_out[i] = outs[n + j]
        return list(outs[:n]), t_out

    run.defjvp(run_jvp, symbolic_zeros=True)
    return run(list(operands), list(inits), valid)


# ----------------------------------------------------------------------------
# Gradients of max/min pooling
# ----------------------------------------------------------------------------
def _select_fill(select_prim, dtype):
    return identity_of(dtype, "max" if select_prim.name == "ge" else "min")


@register(lax.select_and_gather_add_p)
def select_and_gather_add_rule(ctx, tangents, operand, *, select_prim, window_dimensions,
                               window_strides, padding, base_dilation, window_dilation):
    if 0 in ctx.out_bounds[0]:
        return _zeros_out(ctx)
    fill = _select_fill(select_prim, operand.dtype)
    operand = fill_padding(operand, ctx.in_logical[1], fill)
    tangents = clean(tangents, ctx.in_logical[0])

    def run(wd):
        plans = _window_plans(ctx, ctx.in_bounds[1], ctx.out_bounds[0], wd,
                              window_strides, padding, base_dilation, window_dilation)
        pad, dil = _phys(plans)
        return ctx.bind(_shift_input(tangents, 0, plans), _shift_input(operand, fill, plans),
                        padding=pad, base_dilation=dil, window_dimensions=wd)

    whole = _whole_axis_windows(ctx, 1, window_dimensions, padding, base_dilation,
                                window_dilation)
    out = _with_static_windows(ctx, window_dimensions, run, whole)
    return clean_float(out, ctx.out_logical[0])


@register(lax.select_and_scatter_add_p)
def select_and_scatter_add_rule(ctx, source, operand, *, select_prim, window_dimensions,
                                window_strides, padding):
    src_bounds = ctx.in_bounds[0]
    if 0 in src_bounds:
        return _zeros_out(ctx)
    fill = _select_fill(select_prim, operand.dtype)
    operand = fill_padding(operand, ctx.in_logical[1], fill)
    source = clean(source, ctx.in_logical[0])  # padded windows must scatter nothing
    ones = (1,) * operand.ndim

    def run(wd):
        plans = _window_plans(ctx, ctx.in_bounds[1], src_bounds, wd,
                              window_strides, padding, ones, ones)
        z = ctx.bind(source, _shift_input(operand, fill, plans), padding=_phys(plans)[0],
                     window_dimensions=wd)
        return _unshift_output(z, plans)

    whole = _whole_axis_windows(ctx, 1, window_dimensions, padding)
    out = _with_static_windows(ctx, window_dimensions, run, whole)
    return clean_float(out, ctx.out_logical[0])


_ORIGINAL_CONV = lax.conv_general_dilated


def _is_index(d) -> bool:
    try:
        operator.index(d)
    except TypeError:
        return False
    return True


def conv_symbolic_padding(lhs, rhs, window_strides, padding, lhs_dilation=None,
                          rhs_dilation=None, dimension_numbers=None, *args, **kwargs):
    """``lax.conv_general_dilated`` with explicit padding that depends on a
    size (an audio front end's ``pad = ceil(t / s) * s - t``): JAX takes only
    int pairs there (``operator.index``), though its own ``"SAME"`` padding
    is symbolic. The input is padded by ``lax.pad`` instead (zeros; negative
    amounts crop; ``lhs_dilation`` as interior padding), which is the same
    convolution (XLA's conv semantics: padding applies to the lhs-dilated
    input), and the conv runs unpadded."""
    if isinstance(padding, str) or not in_masked_trace() or all(
            _is_index(lo) and _is_index(hi) for lo, hi in padding):
        return _ORIGINAL_CONV(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                              dimension_numbers, *args, **kwargs)
    dnums = lax.conv_dimension_numbers(np.shape(lhs), np.shape(rhs), dimension_numbers)
    spatial = dnums.lhs_spec[2:]
    dilation = tuple(lhs_dilation) if lhs_dilation is not None else (1,) * len(spatial)
    config = [(0, 0, 0)] * np.ndim(lhs)
    for axis, (lo, hi), d in zip(spatial, padding, dilation):
        config[axis] = (lo, hi, d - 1)
    lhs = jnp.asarray(lhs)
    padded = lax.pad(lhs, jnp.zeros((), lhs.dtype), config)
    return _ORIGINAL_CONV(padded, rhs, window_strides, [(0, 0)] * len(spatial),
                          (1,) * len(spatial), rhs_dilation, dimension_numbers, *args, **kwargs)


compat.replace_during_trace("lax.conv_general_dilated", conv_symbolic_padding)
compat.replace_during_trace("jax._src.lax.convolution conv_general_dilated",
                            conv_symbolic_padding)
