"""Windowed ops: ``conv_general_dilated``, ``reduce_window*``, ``select_and_*_add``.

Every windowed op is masked the same way, one window axis at a time:

* The input's padding is filled with the value the unpadded program pads
  with (0 for convolutions and sums, the identity for max/min, the init value
  for a generic ``reduce_window``), with ``select`` (NaN-safe).
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

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from ..shapes import is_static, needs_mask
from .registry import register
from .util import clean, clean_float, fill_padding, identity_of

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
@register("conv_general_dilated")
def conv_rule(ctx, lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation,
              dimension_numbers, feature_group_count, batch_group_count, **params):
    dn = dimension_numbers
    lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lb, rb, ob = ctx.in_bounds[0], ctx.in_bounds[1], ctx.out_bounds[0]
    ll, rl = ctx.in_logical[0], ctx.in_logical[1]
    if 0 in ob:
        return _zeros_out(ctx)
    groups = max(feature_group_count, batch_group_count)
    # Grouped dynamic axes: the logical groups are contiguous blocks of the
    # logical size; lay them out one block per padded group (and back for the
    # output features) so the physical op sees each group at its own offset.
    grouped_lhs_axis = lspec[1] if feature_group_count > 1 else lspec[0]
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
    lhs = _shift_input(lhs, 0, plans)
    pad, dil = _phys(plans)
    out = ctx.bind(lhs, rhs, padding=pad, lhs_dilation=dil)
    if compact_out:
        out = _gather_groups(out, ospec[1], groups, ctx.out_logical[0][ospec[1]])
    return clean_float(out, ctx.out_logical[0])


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


def _with_static_windows(ctx, window_dimensions, body):
    """``body(window_dimensions)`` with every window size a Python int.

    A window size given by a dimension expression (``x.shape[0]``) is
    evaluated at the logical sizes; when that value is traced, ``lax.switch``
    dispatches over its possible values (the op is run with each static window
    size in its own branch, so every reducer, associative or not, gives XLA's
    result). Sizes where JAX rejects the window (< 1) raise ``ShapeError``.
    """
    name = ctx.primitive.name
    static, dynamic = [], []  # dynamic: (axis, candidate sizes, logical value)
    for ax, w in enumerate(window_dimensions):
        if not compat.is_dim_expr(w):
            static.append(int(w))
            continue
        raw = ctx.dims.logical_raw(w)
        ctx.require(raw < 1, f"{name}: the window size {w} of axis {ax} is {{0}} at these "
                    "sizes; window sizes must be >= 1", values=(raw,))
        if is_static(raw):
            static.append(max(int(raw), 1))
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


@register(*_RW_KIND)
def reduce_window_monoid_rule(ctx, x, *, window_dimensions, window_strides, padding,
                              base_dilation, window_dilation):
    if 0 in ctx.out_bounds[0]:
        return _zeros_out(ctx)
    fill = identity_of(x.dtype, _RW_KIND[ctx.primitive.name])
    x = fill_padding(x, ctx.in_logical[0], fill)

    def run(wd):
        plans = _window_plans(ctx, ctx.in_bounds[0], ctx.out_bounds[0], wd,
                              window_strides, padding, base_dilation, window_dilation)
        pad, dil = _phys(plans)
        return ctx.bind(_shift_input(x, fill, plans), padding=pad, base_dilation=dil,
                        window_dimensions=wd)

    out = _with_static_windows(ctx, window_dimensions, run)
    return clean_float(out, ctx.out_logical[0])


@register("reduce_window")
def reduce_window_generic_rule(ctx, *args, jaxpr, consts, window_dimensions, window_strides,
                               padding, base_dilation, window_dilation):
    n = len(args) // 2
    operands, inits = args[:n], args[n:]
    if 0 in ctx.out_bounds[0]:
        return [_zeros_out(ctx, i) for i in range(n)]
    filled = [fill_padding(x, lg, init)
              for x, lg, init in zip(operands, ctx.in_logical[:n], inits)]

    def run(wd):
        plans = _window_plans(ctx, ctx.in_bounds[0], ctx.out_bounds[0], wd,
                              window_strides, padding, base_dilation, window_dilation)
        shifted = [_shift_input(x, init, plans) for x, init in zip(filled, inits)]
        pad, dil = _phys(plans)
        return list(ctx.bind(*shifted, *inits, padding=pad, base_dilation=dil,
                             window_dimensions=wd))

    outs = _with_static_windows(ctx, window_dimensions, run)
    return [clean_float(o, lo) for o, lo in zip(outs, ctx.out_logical)]


# ----------------------------------------------------------------------------
# Gradients of max/min pooling
# ----------------------------------------------------------------------------
def _select_fill(select_prim, dtype):
    return identity_of(dtype, "max" if select_prim.name == "ge" else "min")


@register("select_and_gather_add")
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

    out = _with_static_windows(ctx, window_dimensions, run)
    return clean_float(out, ctx.out_logical[0])


@register("select_and_scatter_add")
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

    out = _with_static_windows(ctx, window_dimensions, run)
    return clean_float(out, ctx.out_logical[0])
