"""Data-dependent output sizes: primitives and masking rules.

Each polymask op whose output size depends on the data (``nonzero``,
``boolean_mask``, ``unique``, value-sized ``arange`` and ``dynamic_slice``) is
a primitive of its own. While the masked trace runs, ``polymask.ops`` creates
a *fresh* dim var (``_u1``, ...) in the trace's ``SymbolicScope``, with the
constraint ``_u1 <= bound`` (the bound is known statically: the operand's
padded size or a user's ``max_size=``), and passes it in the ``out_dims``
param; the abstract eval returns avals with that var, so later equations carry
it like any other dim var (sums, cumsums, gathers, further masks).

At run time the masking rule computes the *logical* value of the var (a
count, a clamped length: an int32 scalar, batched under ``vmap``, staged under
``jit``), binds it with ``ctx.dims.add_var(name, bound, value)`` and returns
the padded result. Results are compacted to the front of a buffer of the
bound (a cumsum + scatter, O(bound)); float outputs have their padding
selected to 0 so that cotangents in the padding cannot flow back through the
gather into logical positions.

These primitives are only ever bound inside ``polymask.mask``'s trace; outside
it ``polymask.ops`` calls ``jax.numpy`` directly. Their rules run even where
every size is static (``at_bound=True``): a trace at size 0 has the count 0.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from ..core.diagnostics import user_call_site
from ..core.errors import UnsupportedError
from ..tracing.registry import register
from .util import clean, is_inexact, valid_mask

__all__ = ["nonzero_p", "boolean_mask_p", "boolean_unmask_p", "unique_p", "arange_p",
           "dynamic_slice_p"]


def _impl(name):
    def impl(*args, **params):
        raise NotImplementedError(
            f"polymask primitive '{name}' only runs inside polymask.mask")
    return impl


def _prim(name, multiple_results=False):
    p = compat.Primitive(name)
    p.multiple_results = multiple_results
    p.def_impl(_impl(name))
    return p


def var_name(d) -> str:
    """Name of a fresh dim var (a one-variable dimension expression)."""
    (name,) = compat.dim_vars(d)
    return name


def _fit(x, length: int, axis: int = 0):
    """Slice or zero-pad ``x`` along ``axis`` to ``length`` (results are compacted
    to the front, so this keeps every logical element)."""
    have = x.shape[axis]
    if have == length:
        return x
    if have > length:
        return lax.slice_in_dim(x, 0, length, axis=axis)
    cfg = [(0, 0, 0)] * x.ndim
    cfg[axis] = (0, length - have, 0)
    return lax.pad(x, jnp.zeros((), x.dtype), cfg)


def _bind_fresh(ctx, d, value):
    """Bind the logical value of a fresh dim var (once per masked evaluation).

    Where the trace compared it on JAX's assumption that it is >= 1
    (``MaskedProgram.assumed_nonempty``: ``x[nonzero(x)].max()``), a value
    of 0 is a run-time ``ShapeError``: the program took the nonempty path;
    so is a value outside a condition the program was traced under
    (``MaskedProgram.count_checks``: ``lax.top_k(sel, 2)`` needs 2 entries).
    """
    name = var_name(d) if compat.is_dim_expr(d) else getattr(d, "count_name", None)
    if name is None:  # a count known to be 0 (a trace at size 0)
        return int(d)
    # (a count the case of a split makes 0: bound too, to check the case's condition)
    bound = int(compat.upper_bound(d)) if compat.is_dim_expr(d) else 0
    value = jnp.asarray(value, jnp.int32)
    ctx.dims.add_var(name, bound, value)
    bound_now = ctx.dims.logical_values.keys()
    for check in ctx.state.count_checks:  # (the split outcome traced: CountCheck)
        if name in check.counts and check.counts <= bound_now:
            ctx.require(check.violated(ctx.dims), check.message, error_type=check.error_type)
    line = ctx.state.assumed_nonempty.get(name)
    if line is not None:
        ctx.require(value == 0,
                    f"the size of this result is 0, and the function compares it, divides by it "
                    f"or computes a shape from it (at {line}) where JAX's trace assumes it "
                    "is at least 1: plain JAX takes another path at 0 (max, min or argmax "
                    "of an empty array raises, as do indexing into it, 1 / its size and "
                    "jnp.zeros(size - 1)), which this one program does not follow")
    return bound


def own_bound(ctx, d, default: int) -> int:
    """The bound of the data-dependent size ``d`` by its op (``max_size=``):
    a case of a split on it may narrow ``d``'s bound in the trace (``_u1 <=
    2``), and a count computed to choose that case (``dispatch.count_values``)
    must not be cut to it."""
    if not compat.is_dim_expr(d):
        return default
    return compat.own_bound(ctx.dims.scope, var_name(d), default)


def compact(valid_flat):
    """Positions of the True entries of a bool vector, in order, padded with 0.

    Returns ``(positions (P,) int32, count int32)``: O(P) cumsum + scatter.
    """
    (p,) = valid_flat.shape
    count = jnp.sum(valid_flat, dtype=jnp.int32)
    slot = jnp.cumsum(valid_flat.astype(jnp.int32)) - 1
    target = jnp.where(valid_flat, slot, p)
    pos = jnp.zeros((p,), jnp.int32).at[target].set(lax.iota(jnp.int32, p), mode="drop")
    return pos, count


def _logical_valid(x_shape, logical):
    """Bool array of the padded shape, True on the logical corner."""
    m = valid_mask(logical, x_shape)
    return jnp.ones(x_shape, bool) if m is None else m


def _unravel(pos, shape):
    """Padded flat positions -> per-axis indices (int32)."""
    out = []
    for k in range(len(shape)):
        stride = int(np.prod(shape[k + 1:], dtype=np.int64))
        out.append(((pos // stride) % int(shape[k])).astype(jnp.int32))
    return tuple(out)


def _logical_flat(idxs, logical):
    """Per-axis indices -> logical row-major flat index (sizes may be traced)."""
    flat = jnp.zeros_like(idxs[0])
    for i, n in zip(idxs, logical):
        flat = flat * jnp.asarray(n, jnp.int32) + i
    return flat


# ----------------------------------------------------------------------------
# nonzero / argwhere / flatnonzero
# ----------------------------------------------------------------------------
nonzero_p = _prim("polymask_nonzero", multiple_results=True)


@nonzero_p.def_abstract_eval
def _nonzero_abstract(x, *, out_dim, mode):
    u = out_dim
    if mode == "nonzero":
        return [compat.ShapedArray((u,), jnp.int32) for _ in range(x.ndim)]
    if mode == "argwhere":
        return [compat.ShapedArray((u, x.ndim), jnp.int32)]
    return [compat.ShapedArray((u,), jnp.int32)]


@register(nonzero_p, at_bound=True)
def nonzero_rule(ctx, x, *, out_dim, mode):
    shape = tuple(x.shape)
    valid = (x != 0) & _logical_valid(shape, ctx.in_logical[0])
    pos, count = compact(valid.reshape(-1))
    _bind_fresh(ctx, out_dim, count)
    pos = _fit(pos, ctx.padded(out_dim))
    idxs = _unravel(pos, shape)
    if mode == "nonzero":
        return list(idxs)
    if mode == "argwhere":
        return [jnp.stack(idxs, axis=1)]
    return [_logical_flat(idxs, ctx.in_logical[0])]


# ----------------------------------------------------------------------------
# boolean_mask / compress / extract: x[m] along `axis`
# ----------------------------------------------------------------------------
boolean_mask_p = _prim("polymask_boolean_mask")


@boolean_mask_p.def_abstract_eval
def _boolean_mask_abstract(x, m, *, axis, out_dim, check_extra):
    k = m.ndim
    shape = tuple(x.shape[:axis]) + (out_dim,) + tuple(x.shape[axis + k:])
    return compat.ShapedArray(shape, x.dtype)


@register(boolean_mask_p, at_bound=True)
def boolean_mask_rule(ctx, x, m, *, axis, out_dim, check_extra):
    m_log = ctx.in_logical[1]
    valid = m & _logical_valid(tuple(m.shape), m_log)
    if check_extra:
        # compress: a condition longer than the axis may only be False there.
        n = ctx.in_logical[0][axis]
        beyond = lax.iota(jnp.int32, m.shape[0]) >= jnp.asarray(n, jnp.int32)
        ctx.require(jnp.any(valid & beyond),
               "polymask.compress: the condition selects an index beyond the logical size "
               "of the axis")
        valid = valid & ~beyond
    pos, count = compact(valid.reshape(-1))
    _bind_fresh(ctx, out_dim, count)
    if any(d == 0 for d in x.shape[axis:axis + m.ndim]):
        # an empty selected axis (a trace at size 0) selects nothing: no gather
        # (XLA takes no slice of an empty axis)
        return jnp.zeros(ctx.out_bounds[0], x.dtype)
    idxs = _unravel(_fit(pos, ctx.padded(out_dim)), tuple(m.shape))
    index = (slice(None),) * axis + idxs
    out = x.at[index].get(mode="clip")
    if is_inexact(out.dtype):
        out = clean(out, ctx.out_logical[0], [axis])
    return out


# ----------------------------------------------------------------------------
# unique (flattened), with index / inverse / counts
# ----------------------------------------------------------------------------
unique_p = _prim("polymask_unique", multiple_results=True)


@unique_p.def_abstract_eval
def _unique_abstract(x, *, out_dim, return_index, return_inverse, return_counts,
                     equal_nan):
    outs = [compat.ShapedArray((out_dim,), x.dtype)]
    if return_index:
        outs.append(compat.ShapedArray((out_dim,), jnp.int32))
    if return_inverse:
        outs.append(compat.ShapedArray(tuple(x.shape), jnp.int32))
    if return_counts:
        outs.append(compat.ShapedArray((out_dim,), jnp.int32))
    return outs


@register(unique_p, at_bound=True)
def unique_rule(ctx, x, *, out_dim, return_index, return_inverse, return_counts, equal_nan):
    shape = tuple(x.shape)
    p = math.prod(shape)
    logical = ctx.in_logical[0]
    valid = _logical_valid(shape, logical).reshape(-1)
    vals = lax.stop_gradient(x).reshape(-1)  # like jnp.unique: no gradient
    floating = is_inexact(vals.dtype)
    if floating and not jnp.iscomplexobj(vals):
        vals = jnp.where(jnp.isnan(vals), jnp.nan, vals)  # canonical NaN sorts last
    key = vals.astype(jnp.uint8) if vals.dtype == jnp.bool_ else vals
    iota = lax.iota(jnp.int32, p)
    lflat = _logical_flat(_unravel(iota, shape), logical) if len(shape) > 1 else iota
    invalid = (~valid).astype(jnp.int32)
    s_inv, s_key, s_lflat, s_perm = lax.sort((invalid, key, lflat, iota), num_keys=3)
    s_vals = s_key.astype(vals.dtype) if vals.dtype == jnp.bool_ else s_key
    prev = jnp.roll(s_key, 1)
    same = s_key == prev
    if floating and equal_nan:
        same = same | (jnp.isnan(s_key) & jnp.isnan(prev))
    first = (s_inv == 0) & ((iota == 0) | ~same)
    starts, u = compact(first)
    _bind_fresh(ctx, out_dim, u)
    n_valid = jnp.sum(valid, dtype=jnp.int32)
    ob = ctx.padded(out_dim)
    values = _fit(s_vals[starts], ob)
    if floating:
        values = jnp.where(lax.iota(jnp.int32, ob) < u, values, jnp.zeros_like(values))
    outs = [values]
    if return_index:
        outs.append(_fit(s_lflat[starts], ob))
    if return_inverse:
        gid = jnp.cumsum(first.astype(jnp.int32)) - 1
        inv = jnp.zeros((p,), jnp.int32).at[s_perm].set(gid, unique_indices=True)
        outs.append(inv.reshape(shape))
    if return_counts:
        nxt = jnp.where(iota + 1 < u, jnp.roll(starts, -1), n_valid)
        outs.append(_fit(jnp.where(iota < u, nxt - starts, 0), ob))
    return outs


# ----------------------------------------------------------------------------
# arange with a traced length
# ----------------------------------------------------------------------------
arange_p = _prim("polymask_arange")


@arange_p.def_abstract_eval
def _arange_abstract(start, stop, step, *, out_dim, dtype):
    return compat.ShapedArray((out_dim,), dtype)


def arange_length(start, stop, step):
    """``len(range(start, stop, step))`` (ceil for floats), clamped at 0, as int32."""
    if jnp.issubdtype(jnp.result_type(start, stop, step), jnp.integer):
        a = jnp.asarray(stop, jnp.int32) - jnp.asarray(start, jnp.int32)
        b = jnp.asarray(step, jnp.int32)
        n = -((-a) // b)
    else:
        n = jnp.ceil((jnp.asarray(stop) - jnp.asarray(start)) / jnp.asarray(step))
    return jnp.maximum(n, 0).astype(jnp.int32)


@register(arange_p, at_bound=True)
def arange_rule(ctx, start, stop, step, *, out_dim, dtype):
    length = arange_length(start, stop, step)
    bound = int(compat.upper_bound(out_dim))  # (a case's conditions may narrow it)
    max_size = own_bound(ctx, out_dim, bound)
    ctx.require(length > max_size,
           f"polymask.arange: the length is larger than max_size={max_size}")
    _bind_fresh(ctx, out_dim, jnp.minimum(length, max_size))
    i = lax.iota(dtype, bound) if jnp.issubdtype(dtype, jnp.integer) else \
        lax.iota(jnp.int32, bound).astype(dtype)
    return (jnp.asarray(start, dtype) + i * jnp.asarray(step, dtype)).astype(dtype)


# ----------------------------------------------------------------------------
# dynamic_slice with traced sizes
# ----------------------------------------------------------------------------
dynamic_slice_p = _prim("polymask_dynamic_slice")


@dynamic_slice_p.def_abstract_eval
def _dynamic_slice_abstract(x, *starts_and_sizes, out_shape, fresh):
    return compat.ShapedArray(tuple(out_shape), x.dtype)


@register(dynamic_slice_p, at_bound=True)
def dynamic_slice_rule(ctx, x, *starts_and_sizes, out_shape, fresh):
    k = len(starts_and_sizes) // 2
    starts, sizes = starts_and_sizes[:k], starts_and_sizes[k:]
    in_log, in_bd = ctx.in_logical[0], ctx.in_bounds[0]
    begin, lengths, widths = [], [], []
    for a in range(x.ndim):
        if a >= k:
            begin.append(jnp.int32(0))
            widths.append(in_bd[a])
            continue
        n = jnp.asarray(in_log[a], jnp.int32)
        d = out_shape[a]
        if fresh[a]:
            bound = int(compat.upper_bound(d))  # (a case's conditions may narrow it)
            max_size = own_bound(ctx, d, bound)
            length = jnp.clip(jnp.asarray(sizes[a], jnp.int32), 0, n)
            ctx.require(length > max_size,
                   f"polymask.dynamic_slice: the size along axis {a} is larger than "
                   f"max_size={max_size}")
            length = jnp.minimum(length, max_size)
            _bind_fresh(ctx, d, length)
        else:
            bound = ctx.padded(d)
            length = jnp.asarray(ctx.logical(d), jnp.int32)
            ctx.require(length > n,
                   f"polymask.dynamic_slice: slice size {d} along axis {a} is larger "
                   "than the logical size of the axis")
        begin.append(_clamped_start(starts[a], n, length))
        widths.append(bound)
        lengths.append(length)
    zero = jnp.zeros((), x.dtype)
    config = [(0, widths[a] if a < k else 0, 0) for a in range(x.ndim)]
    xp = lax.pad(x, zero, config)
    out = lax.dynamic_slice(xp, begin, widths)
    if is_inexact(out.dtype):
        out = clean(out, ctx.out_logical[0], list(range(k)))
    return out


def _clamped_start(start, n, length):
    """``lax.dynamic_slice``'s start on an axis of logical size ``n``: a negative
    start counts from the end (``-2`` is ``n - 2``), then the start is clamped
    so that ``length`` entries fit."""
    start = jnp.asarray(start, jnp.int32)
    start = jnp.where(start < 0, start + n, start)
    return jnp.clip(start, 0, jnp.maximum(n - length, 0))


# ----------------------------------------------------------------------------
# Differentiation *inside* mask (jax.grad in the masked function)
# ----------------------------------------------------------------------------
def _zero_jvp(prim):
    """Outputs with no derivative (indices, counts, unique values as in jnp.unique)."""
    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        outs = out if prim.multiple_results else [out]
        zeros = [compat.symbolic_zero_like(o) for o in outs]
        return out, (zeros if prim.multiple_results else zeros[0])
    compat.def_jvp(prim, jvp)


for _p in (nonzero_p, unique_p, arange_p):
    _zero_jvp(_p)

# x[m] is linear in x: its tangent is the same selection (same fresh dim var,
# so the tangent has the same data-dependent size); its transpose scatters the
# cotangent back to the selected positions.
boolean_unmask_p = _prim("polymask_boolean_unmask")


@boolean_unmask_p.def_abstract_eval
def _boolean_unmask_abstract(ct, m, *, axis, x_shape):
    return compat.ShapedArray(tuple(x_shape), ct.dtype)


def _boolean_mask_jvp(primals, tangents, **params):
    x, m = primals
    tx, _ = tangents
    out = boolean_mask_p.bind(x, m, **params)
    if compat.is_symbolic_zero(tx):
        return out, compat.symbolic_zero_like(out)
    return out, boolean_mask_p.bind(tx, m, **params)


def _boolean_mask_transpose(ct, x, m, *, axis, out_dim, check_extra):
    if compat.is_symbolic_zero(ct):
        return [None, None]
    return [boolean_unmask_p.bind(ct, m, axis=axis, x_shape=tuple(x.aval.shape)), None]


compat.def_jvp(boolean_mask_p, _boolean_mask_jvp)
compat.def_transpose(boolean_mask_p, _boolean_mask_transpose)
compat.def_linear(boolean_unmask_p, lambda ct, _ct, m, *, axis, x_shape: [
    None if compat.is_symbolic_zero(ct) else
    boolean_mask_p.bind(ct, m, axis=axis, out_dim=_ct.aval.shape[axis], check_extra=False),
    None])


@register(boolean_unmask_p, at_bound=True)
def boolean_unmask_rule(ctx, ct, m, *, axis, x_shape):
    """Transpose of ``x[m]``: scatter-add the (cleaned) cotangent to the selected slots."""
    valid = m & _logical_valid(tuple(m.shape), ctx.in_logical[1])
    n = ctx.out_logical[0][axis]
    if m.ndim == 1:  # compress: a longer condition only selects inside the axis
        valid = valid & (lax.iota(jnp.int32, m.shape[0]) < jnp.asarray(n, jnp.int32))
    pos, count = compact(valid.reshape(-1))
    ct = clean(ct, ctx.in_logical[0], [axis]) if is_inexact(ct.dtype) else ct
    idxs = _unravel(pos, tuple(m.shape))
    keep = lax.iota(jnp.int32, pos.shape[0]) < count
    idxs = tuple(jnp.where(keep, i, b) for i, b in zip(idxs, m.shape))  # padding: dropped
    index = (slice(None),) * axis + idxs
    zeros = jnp.zeros(ctx.out_bounds[0], ct.dtype)
    return zeros.at[index].add(ct, mode="drop")


# dynamic_slice is linear in x: the tangent is the same slice; the transpose
# writes the cotangent back at the (clamped) start.
dynamic_unslice_p = _prim("polymask_dynamic_unslice")


@dynamic_unslice_p.def_abstract_eval
def _dynamic_unslice_abstract(ct, *starts, x_shape):
    return compat.ShapedArray(tuple(x_shape), ct.dtype)


def _dynamic_slice_jvp(primals, tangents, **params):
    x, *rest = primals
    out = dynamic_slice_p.bind(x, *rest, **params)
    if compat.is_symbolic_zero(tangents[0]):
        return out, compat.symbolic_zero_like(out)
    return out, dynamic_slice_p.bind(tangents[0], *rest, **params)


def _dynamic_slice_transpose(ct, x, *starts_and_sizes, out_shape, fresh):
    if compat.is_symbolic_zero(ct):
        return [None] * (1 + len(starts_and_sizes))
    k = len(starts_and_sizes) // 2
    out = dynamic_unslice_p.bind(ct, *starts_and_sizes[:k], x_shape=tuple(x.aval.shape))
    return [out] + [None] * len(starts_and_sizes)


compat.def_jvp(dynamic_slice_p, _dynamic_slice_jvp)
compat.def_transpose(dynamic_slice_p, _dynamic_slice_transpose)


@register(dynamic_unslice_p, at_bound=True)
def dynamic_unslice_rule(ctx, ct, *starts, x_shape):
    """Transpose of ``dynamic_slice``: the cleaned cotangent placed at the start."""
    k = len(starts)
    lengths, x_log = ctx.in_logical[0], ctx.out_logical[0]
    x_bd, ct_bd = ctx.out_bounds[0], ctx.in_bounds[0]
    if is_inexact(ct.dtype):
        ct = clean(ct, lengths, list(range(k)))
    begin = []
    for a in range(len(x_bd)):
        if a >= k:
            begin.append(jnp.int32(0))
            continue
        n = jnp.asarray(x_log[a], jnp.int32)
        begin.append(_clamped_start(starts[a], n, jnp.asarray(lengths[a], jnp.int32)))
    big = tuple(x_bd[a] + (ct_bd[a] if a < k else 0) for a in range(len(x_bd)))
    buf = lax.dynamic_update_slice(jnp.zeros(big, ct.dtype), ct, begin)
    return lax.slice(buf, (0,) * len(x_bd), tuple(x_bd))


# ----------------------------------------------------------------------------
# jax.vmap *inside* mask: a shared selection batches; per-example sizes cannot
# ----------------------------------------------------------------------------
def _per_example_size_error(what):
    return UnsupportedError(
        f"polymask.{what} under jax.vmap inside polymask.mask (at {user_call_site()}): "
        "each example would get its "
        "own data-dependent size, but one masked value has one size. Put jax.vmap outside "
        "instead (jax.vmap(polymask.mask(f))): then each example of the ragged batch gets "
        "its own count.")


def _not_batched(bd) -> bool:
    return bd is None  # jax.interpreters.batching.not_mapped


def _boolean_mask_batch(args, dims, *, axis, out_dim, check_extra):
    x, m = args
    bx, bm = dims
    if not _not_batched(bm):
        raise _per_example_size_error("boolean_mask / compress (with a batched mask)")
    x = jnp.moveaxis(x, bx, 0)
    return boolean_mask_p.bind(x, m, axis=axis + 1, out_dim=out_dim,
                               check_extra=check_extra), 0


def _dynamic_slice_batch(args, dims, *, out_shape, fresh):
    x, *rest = args
    if not all(_not_batched(d) for d in dims[1:]):
        raise _per_example_size_error("dynamic_slice (with batched starts or sizes)")
    x = jnp.moveaxis(x, dims[0], 0)
    k = len(rest) // 2
    starts = [jnp.int32(0)] + list(rest[:k])
    sizes = [jnp.int32(x.shape[0])] + list(rest[k:])
    return dynamic_slice_p.bind(x, *starts, *sizes, out_shape=(x.shape[0],) + tuple(out_shape),
                                fresh=(False,) + tuple(fresh)), 0


def _refuse_batch(what):
    def rule(args, dims, **params):
        raise _per_example_size_error(what)
    return rule


compat.def_batching(boolean_mask_p, _boolean_mask_batch)
compat.def_batching(dynamic_slice_p, _dynamic_slice_batch)
compat.def_batching(nonzero_p, _refuse_batch("nonzero / where / argwhere"))
compat.def_batching(unique_p, _refuse_batch("unique"))
compat.def_batching(arange_p, _refuse_batch("arange (with a batched length)"))
