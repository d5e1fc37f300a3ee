"""Masking rules: ``gather``, ``scatter*``, ``dynamic_slice``, ``dynamic_update_slice``.

Clamping and out-of-bounds behaviour follow the *logical* bounds, as the
unpadded program would see them:

- start indices are clamped to ``[0, logical_dim - logical_slice]`` (modes
  ``clip`` and ``promise_in_bounds``; XLA clamps gathers and dynamic slices
  the same way), or flagged out of bounds against those logical limits
  (``fill``: the slice is filled, the scatter update is dropped);
- the padded op then reads or writes at those starts; when a padded window
  placed at the largest logical start would run past the buffer, the
  operand is first extended with zeros (so XLA's own clamping never shifts
  a window), and cut back afterwards;
- index arrays may hold garbage (huge ints) in their padding: clamping makes
  gathers read a harmless position, and scatter updates from padding
  positions are sent to an out-of-bounds index so XLA drops them.

NaN-safety in ``grad``: a gather's transpose is a scatter-add of the output
cotangent, so float gather / dynamic-slice results get their padding
selected to 0 (padding rows may read logical positions). Scatter updates that
are dropped get zero cotangent from the transposed (fill-mode) gather.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from ..core.shapes import is_static, needs_mask, upper_bound_int
from ..tracing.registry import register, register_entry_reads
from .util import clean_float, identity_of, same_dim, valid_mask

_MODE = lax.GatherScatterMode


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
_ub = upper_bound_int


def _sub_ub(a, b) -> int:
    """Upper bound of ``a - b`` for dimension expressions / ints."""
    try:
        return _ub(a - b)
    except Exception:  # pragma: no cover - defensive: fall back to a's bound
        return _ub(a)


def _guard(rule):
    """Report an unboundable size as ``UnsupportedError`` with the user's line."""
    @functools.wraps(rule)
    def wrapped(ctx, *args, **params):
        try:
            return rule(ctx, *args, **params)
        except ValueError as e:
            if "unbounded dimension expression" in str(e):
                raise ctx.unsupported(str(e) + "; add an upper-bound constraint") from None
            raise

    return wrapped


def _max0(v):
    if is_static(v):
        return max(int(v), 0)
    return jnp.maximum(jnp.asarray(v, jnp.int32), 0)


def _sub(a, b):
    if is_static(a) and is_static(b):
        return int(a) - int(b)
    return jnp.asarray(a, jnp.int32) - jnp.asarray(b, jnp.int32)


def _extend(x, ext):
    """Pad ``x`` with zeros at the high end of each axis by ``ext[d]``."""
    if not any(ext):
        return x
    zero = jnp.zeros((), x.dtype)
    return lax.pad(x, zero, [(0, int(e), 0) for e in ext])


def _cut(x, shape):
    if tuple(x.shape) == tuple(shape):
        return x
    return lax.slice(x, (0,) * x.ndim, tuple(shape))


def default_fill(dtype):
    """JAX's default ``fill_value`` for ``mode='fill'`` gathers."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.inexact):
        return np.nan
    if dtype == np.bool_:
        return True
    if np.issubdtype(dtype, np.signedinteger):
        return np.iinfo(dtype).min
    return np.iinfo(dtype).max


# ----------------------------------------------------------------------------
# gather
# ----------------------------------------------------------------------------
@register(lax.gather_p)
@_guard
def gather_rule(ctx, operand, indices, *, dimension_numbers, slice_sizes, mode, fill_value,
                indices_are_sorted, unique_indices, **params):  # (jax 0.12.1: out_sharding)
    """Gather with start clamping / fill decided against the logical operand size."""
    dn = dimension_numbers
    mode = _MODE.from_any(mode)
    op_sym = ctx.in_avals[0].shape
    op_l, op_b = ctx.in_logical[0], ctx.in_bounds[0]
    ss_pad = [ctx.padded(s) for s in slice_sizes]
    ss_log = [ctx.logical(s) for s in slice_sizes]
    idx_dtype = indices.dtype
    if not jnp.issubdtype(idx_dtype, jnp.integer):
        raise ctx.unsupported(f"gather indices of dtype {idx_dtype}")
    n_batch = indices.ndim - 1

    # Operand extension so that a padded window at the largest start fits.
    ext = [0] * operand.ndim
    for d in range(operand.ndim):
        hi = _sub_ub(op_sym[d], slice_sizes[d]) if d in dn.start_index_map else 0
        ext[d] = max(0, hi + ss_pad[d] - op_b[d])

    # promise_in_bounds (jnp indexing's): XLA clamps the gather, and the
    # scatter-add of its transpose drops an out-of-bounds start: the value
    # is the clamped window's, with no gradient to it
    drops_gradient = (mode == _MODE.PROMISE_IN_BOUNDS and not ctx.state.forward_only
                      and jnp.issubdtype(operand.dtype, jnp.inexact))
    cols = []
    in_bounds = None
    for k, d in enumerate(dn.start_index_map):
        s = indices[..., k]
        hi = _max0(_sub(op_l[d], ss_log[d]))
        hi_v = jnp.asarray(hi, idx_dtype) if not is_static(hi) else np.asarray(hi, idx_dtype)
        if mode == _MODE.FILL_OR_DROP or drops_gradient:
            ok = (s <= hi_v)
            if jnp.issubdtype(idx_dtype, jnp.signedinteger):
                ok = ok & (s >= 0)
            in_bounds = ok if in_bounds is None else (in_bounds & ok)
        cols.append(jnp.clip(s, np.asarray(0, idx_dtype), hi_v))
    new_idx = jnp.stack(cols, axis=-1) if cols else indices

    count = math.prod(ctx.in_logical[1][:-1]) if indices.ndim else 1  # index rows
    _require_window_fits(ctx, op_l, ss_log, count, "a gather (jnp.take, x[i] with an index "
                         "array, percentile) reads from an axis of logical size 0 (plain JAX "
                         "raises there, a non-empty take from an empty axis, or takes a path "
                         "of its own for an empty axis, as jnp.take_along_axis's zeros, which "
                         "this one program does not follow)")
    out = ctx.primitive.bind(
        _extend(operand, ext), new_idx,
        **ctx.concrete_params(mode=_MODE.PROMISE_IN_BOUNDS, fill_value=None))
    if in_bounds is not None:
        out_shape = tuple(ctx.out_bounds[0])
        batch_pos = [i for i in range(len(out_shape)) if i not in dn.offset_dims]
        assert len(batch_pos) == n_batch
        m = lax.broadcast_in_dim(in_bounds, out_shape, tuple(batch_pos))
        if mode == _MODE.FILL_OR_DROP:
            fv = default_fill(out.dtype) if fill_value is None else fill_value
            if compat.is_dim_expr(fv):  # a size as the fill (intersect1d: arr1.size)
                fv = ctx.dims.logical_value(fv)
            out = lax.select(m, out, jnp.broadcast_to(jnp.asarray(fv, out.dtype), out.shape))
        else:
            out = _no_gradient_outside(out, m)
    return clean_float(out, ctx.out_logical[0])


@register_entry_reads(lax.gather_p)
def gather_entry_reads(avals, params) -> list:
    """The operand axes a gather reads at run-time positions (its
    ``start_index_map`` with a non-empty slice), each with the index rows'
    dims (all of ``indices``' but the last)."""
    if len(avals) != 2:
        return []
    operand, indices = avals
    dn, slice_sizes = params["dimension_numbers"], params["slice_sizes"]
    rows = tuple(indices.shape[:-1])
    return [(operand.shape[axis], rows) for axis in dn.start_index_map
            if slice_sizes[axis] != 0]


@jax.custom_jvp
def _no_gradient_outside(out, keep):
    """``out``, its gradient zero where ``keep`` is False (an index past the
    logical size: plain JAX's scatter transpose drops it). A custom JVP, not
    ``select(keep, out, stop_gradient(out))``: where JAX transposes the
    program as it is (the matvec of ``custom_linear_solve`` in ``det``'s and
    ``lstsq``'s gradients) this transposes as the identity, and
    ``stop_gradient`` has no transpose rule."""
    return out


@_no_gradient_outside.defjvp
def _no_gradient_outside_jvp(primals, tangents):
    out, keep = primals
    return out, jnp.where(keep, tangents[0], jnp.zeros((), out.dtype))


# ----------------------------------------------------------------------------
# scatter family
# ----------------------------------------------------------------------------
_SCATTER_KIND = {"scatter-add": "sum", "scatter-sub": "sum", "scatter-mul": "prod",
                 "scatter-min": "min", "scatter-max": "max"}


@register(lax.scatter_p, *_SCATTER_KIND, at_bound=True)  # (an empty operand)
@_guard
def scatter_rule(ctx, operand, indices, updates, *, dimension_numbers, indices_are_sorted,
                 unique_indices, mode, update_jaxpr, update_consts,
                 **params):  # (jax 0.12.1: out_sharding)
    """Scatter: updates from padding or logically out-of-bounds starts are dropped.

    Window padding of the updates (a masked window axis) is filled with the
    combiner's identity; for a plain ``scatter`` it must land on operand
    padding (a window spanning a whole, non-indexed operand axis of the same
    size), otherwise the case is unsupported.
    """
    if 0 in operand.shape:
        # an empty operand (a case pinning its size to 0): nothing to scatter into.
        # (Bound, JAX's own JVP rule fails on it: its gather of the scattered ids
        # is out of range, and a switch linearizes every case's program, so
        # jax.grad failed at every size: ColabDesign's x[-n:].at[p].set(0).)
        return operand
    if not any(needs_mask(s, b) for lg, bd in zip(ctx.in_logical, ctx.in_bounds)
               for s, b in zip(lg, bd)):
        return ctx.bind(operand, indices, updates)  # (at the bound: as is)
    dn = dimension_numbers
    mode = _MODE.from_any(mode)
    name = ctx.primitive.name
    op_sym = ctx.in_avals[0].shape
    upd_sym = ctx.in_avals[2].shape
    op_l, op_b = ctx.in_logical[0], ctx.in_bounds[0]
    idx_l, idx_b = ctx.in_logical[1], ctx.in_bounds[1]
    upd_l, upd_b = ctx.in_logical[2], ctx.in_bounds[2]
    idx_dtype = indices.dtype
    if not jnp.issubdtype(idx_dtype, jnp.integer):
        raise ctx.unsupported(f"scatter indices of dtype {idx_dtype}")

    # Window size (symbolic) of every operand dim.
    win_sym: list = [1] * operand.ndim
    win_axis: list = [None] * operand.ndim  # updates axis of the window dim
    j = 0
    for d in range(operand.ndim):
        if d in dn.inserted_window_dims or d in dn.operand_batching_dims:
            continue
        ax = dn.update_window_dims[j]
        win_sym[d], win_axis[d] = upd_sym[ax], ax
        j += 1
    win_pad = [ctx.padded(w) for w in win_sym]
    win_log = [ctx.logical(w) for w in win_sym]

    # Window padding of the updates.
    bad_win = []
    for d in range(operand.ndim):
        ax = win_axis[d]
        if ax is None or not needs_mask(upd_l[ax], upd_b[ax]):
            continue
        if d not in dn.scatter_dims_to_operand_dims and same_dim(win_sym[d], op_sym[d]) \
                and win_pad[d] == op_b[d]:
            continue  # the window padding lands on the operand's padding
        bad_win.append(ax)
    single = (bad_win and not dn.operand_batching_dims and dn.scatter_dims_to_operand_dims
              and int(np.prod(idx_b[:-1], dtype=np.int64)) == 1)
    if bad_win:
        kind = _SCATTER_KIND.get(name)
        if kind is None and not single:
            raise ctx.unsupported(
                "scatter (set) of updates whose window axes "
                f"{bad_win} have a dynamic size smaller than the operand axis they write "
                "into, at several scatter positions; the padded window would overwrite "
                "logical elements")

    # Operand extension so a padded window at the largest logical start fits.
    # (a batching axis pairs the operand with the indices one to one: no window,
    # and it must keep the indices' size, 0 included)
    ext = [0] * operand.ndim
    for d in range(operand.ndim):
        if d in dn.operand_batching_dims:
            continue
        hi = _sub_ub(op_sym[d], win_sym[d]) if d in dn.scatter_dims_to_operand_dims else 0
        ext[d] = max(0, hi + win_pad[d] - op_b[d])
    op_ext = _extend(operand, ext)
    ext_shape = op_ext.shape

    if bad_win:
        m = valid_mask(upd_l, upd_b, bad_win)
        kind = _SCATTER_KIND.get(name)
        if kind is not None:
            fill = lax.full_like(updates, identity_of(updates.dtype, kind))
        else:
            # One scatter position (``x.at[a:a+k].set(v)``): the window padding
            # rewrites the operand's current values (read-modify-write).
            start = [jnp.zeros((), jnp.int32)] * operand.ndim
            for k, d in enumerate(dn.scatter_dims_to_operand_dims):
                s = indices.reshape(-1)[k].astype(jnp.int32)
                hi = _max0(_sub(op_l[d], win_log[d]))
                start[d] = jnp.clip(s, 0, jnp.asarray(hi, jnp.int32))
            old = lax.dynamic_slice(op_ext, start, win_pad)
            fill = old.reshape(updates.shape)
        updates = lax.select(m, updates, fill)

    # Validity of each scatter (batch) position.
    valid = valid_mask(idx_l[:-1], idx_b[:-1]) if indices.ndim > 1 else None
    cols = []
    for k, d in enumerate(dn.scatter_dims_to_operand_dims):
        s = indices[..., k]
        hi = _max0(_sub(op_l[d], win_log[d]))
        hi_v = jnp.asarray(hi, idx_dtype) if not is_static(hi) else np.asarray(hi, idx_dtype)
        if mode == _MODE.CLIP:
            s = jnp.clip(s, np.asarray(0, idx_dtype), hi_v)
        else:
            ok = s <= hi_v
            if jnp.issubdtype(idx_dtype, jnp.signedinteger):
                ok = ok & (s >= 0)
            valid = ok if valid is None else (valid & ok)
        cols.append(s)
    if cols and valid is not None:
        cols = [jnp.where(valid, s, _oob_index(idx_dtype, ext_shape[d]))
                for s, d in zip(cols, dn.scatter_dims_to_operand_dims)]
    elif valid is not None:
        raise ctx.unsupported("scatter with an empty index vector and padded indices")
    new_idx = jnp.stack(cols, axis=-1) if cols else indices

    out = ctx.primitive.bind(op_ext, new_idx, updates,
                             **ctx.concrete_params(mode=_MODE.FILL_OR_DROP))
    return _cut(out, op_b)


def _oob_index(dtype, size: int):
    """An index past the end of an axis of ``size`` (XLA drops such updates)."""
    info = np.iinfo(np.dtype(dtype))
    v = min(int(size), int(info.max))
    return np.asarray(v, dtype)


# ----------------------------------------------------------------------------
# dynamic_slice / dynamic_update_slice
# ----------------------------------------------------------------------------
def _require_window_fits(ctx, op_l, win_l, count, message: str) -> None:
    """A window larger than its operand is a TypeError of plain JAX's shape
    rule (``slice_sizes`` must fit the operand), checked by JAX's trace at
    the symbolic sizes: exactly for the spec's dim vars (traced shifted, 0
    included), but on the assumption >= 1 for a data-dependent size (an
    empty selection). Along such an axis it is checked at run time, where
    the window is read at all (``count`` > 0 windows)."""
    bad = False
    op_sym = ctx.in_avals[0].shape
    for o, w, sym in zip(op_l, win_l, op_sym):
        if not any(map(compat.is_fresh_dim_name, compat.dim_vars(sym))):
            continue
        b = (int(w) > int(o)) if is_static(o) and is_static(w) else jnp.asarray(w) > jnp.asarray(o)
        bad = b if bad is False else (bad | b)
    if bad is False or (is_static(count) and int(count) == 0):
        return  # no data-dependent axis, or no window read
    if not is_static(count):
        bad = bad & (jnp.asarray(count) > 0)
    ctx.require(bad, message)


def _clamped_starts(starts, op_l, size_l):
    out = []
    for s, lo, sz in zip(starts, op_l, size_l):
        hi = _max0(_sub(lo, sz))
        s = jnp.asarray(s)
        out.append(jnp.clip(s, jnp.zeros((), s.dtype), jnp.asarray(hi, s.dtype)))
    return out


@register(lax.dynamic_slice_p)
@_guard
def dynamic_slice_rule(ctx, operand, *args, slice_sizes):
    nd = operand.ndim
    starts, dyn = args[:nd], args[nd:]
    if dyn:
        raise ctx.unsupported("dynamic_slice with dynamic slice sizes")
    op_sym = ctx.in_avals[0].shape
    op_l, op_b = ctx.in_logical[0], ctx.in_bounds[0]
    ss_pad = [ctx.padded(s) for s in slice_sizes]
    ss_log = [ctx.logical(s) for s in slice_sizes]
    ext = [max(0, _sub_ub(op_sym[d], slice_sizes[d]) + ss_pad[d] - op_b[d]) for d in range(nd)]
    _require_window_fits(ctx, op_l, ss_log, 1, "a dynamic slice (lax.dynamic_slice, "
                         "dynamic_index_in_dim) is longer than its operand's logical size "
                         "(plain JAX raises: slice sizes must fit the operand)")
    starts = _clamped_starts(starts, op_l, ss_log)
    out = lax.dynamic_slice(_extend(operand, ext), starts, ss_pad)
    return clean_float(out, ctx.out_logical[0])


@register(lax.dynamic_update_slice_p)
@_guard
def dynamic_update_slice_rule(ctx, operand, update, *starts):
    nd = operand.ndim
    op_sym, upd_sym = ctx.in_avals[0].shape, ctx.in_avals[1].shape
    op_l, op_b = ctx.in_logical[0], ctx.in_bounds[0]
    upd_l, upd_b = ctx.in_logical[1], ctx.in_bounds[1]
    ext = [max(0, _sub_ub(op_sym[d], upd_sym[d]) + upd_b[d] - op_b[d]) for d in range(nd)]
    starts = _clamped_starts(starts, op_l, upd_l)
    op_ext = _extend(operand, ext)
    m = valid_mask(upd_l, upd_b)
    if m is not None:
        # Only the update's logical corner may be written: keep the old values
        # under the update's padding (read-modify-write of the window).
        old = lax.dynamic_slice(op_ext, starts, upd_b)
        update = lax.select(m, update, old)
    out = lax.dynamic_update_slice(op_ext, update, starts)
    return _cut(out, op_b)
