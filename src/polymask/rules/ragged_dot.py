"""``ragged_dot_general`` (``lax.ragged_dot``: mixture-of-experts layers), in
its three modes: the lhs ragged axis is a free axis (mode 1, ``[m, k] x
[g, k, n] -> [m, n]``), a contracted one (mode 2, ``[m, k] x [k, n] ->
[g, m, n]``) or a batch one (mode 3, a ``dot_general``).

Masking is ``dot_general``'s (``contractions.py``): contracted padding is
zeroed on both operands with ``select``; for float dtypes all operand padding
and the result's padding are zeroed too, so the backward pass (which
contracts over the free axes, the ragged one included) stays exact and finite.
Which group a row belongs to depends only on ``group_sizes`` (a cumulative
sum), never on the ragged axis' size, so each logical row meets the same
group as in the unpadded program, and rows past ``sum(group_sizes)`` are 0 in
both. Padding of ``group_sizes`` itself (its batch prefix axes, the group
count in mode 3) is set to 0: padded groups are empty.

The padded program binds ``polymask_ragged_dot``, a twin of the primitive
with the same parameters, lowering (JAX's per-platform one, native kernels
included) and derivatives. Only its batching rule differs: JAX's batches only
operands that are all batched at axis 0 and raises ``NotImplementedError``
otherwise (shared expert weights under ``jax.vmap``, the ragged batch of a
masked function); the twin's moves axes, folds the vmapped axis into the lhs
when the rhs is shared (mode 1: an outer free axis of the lhs) and broadcasts
otherwise.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from ..tracing.registry import register
from .util import clean, is_inexact, masked_axes

__all__ = ["ragged_dot_p"]

NONCONTRACTING, CONTRACTING, BATCH = 1, 2, 3


def _remaining(dims, *removed):
    drop = set(itertools.chain(*removed))
    return [d for d in dims if d not in drop]


def _mode(dn) -> tuple[int, int]:
    """``(mode, lhs ragged axis)`` of ``RaggedDotDimensionNumbers`` ``dn``."""
    (ragged,) = dn.lhs_ragged_dimensions
    (lc, _), (lb, _) = dn.dot_dimension_numbers
    if ragged in lc:
        return CONTRACTING, ragged
    if ragged in lb:
        return BATCH, ragged
    return NONCONTRACTING, ragged


def _prefix_dims(lhs_ndim: int, dn) -> list[int]:
    """The lhs axes that ``group_sizes``'s leading axes follow (``[b..., x..., g]``)."""
    mode, ragged = _mode(dn)
    (lc, _), (lb, _) = dn.dot_dimension_numbers
    lb, lc = list(lb), list(lc)
    if mode == NONCONTRACTING:
        free = _remaining(range(lhs_ndim), lc, lb)
        return lb + free[:free.index(ragged)]
    if mode == CONTRACTING:
        return lb + lc[:lc.index(ragged)]
    return lb[:lb.index(ragged)]


def _dnums(dot, ragged, group):
    return lax.RaggedDotDimensionNumbers(dot_dimension_numbers=dot,
                                         lhs_ragged_dimensions=ragged,
                                         rhs_group_dimensions=group)


# ----------------------------------------------------------------------------
# The twin primitive of the padded program
# ----------------------------------------------------------------------------
def _raw(lhs, rhs, group_sizes, *, ragged_dot_dimension_numbers, precision,
         preferred_element_type, group_offset, out_sharding):
    return lax.ragged_dot_general(
        lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type, group_offset=group_offset,
        out_sharding=out_sharding)


ragged_dot_p = compat.Primitive("polymask_ragged_dot")
ragged_dot_p.def_impl(_raw)
compat.def_lowering_as(ragged_dot_p, _raw)


@ragged_dot_p.def_abstract_eval
def _abstract(lhs, rhs, group_sizes, **params):
    out = jax.eval_shape(functools.partial(_raw, **params), lhs, rhs, group_sizes)
    return compat.ShapedArray(out.shape, out.dtype)


def _jvp(primals, tangents, **params):
    x, y, gs = primals
    dx, dy, _ = tangents
    out = ragged_dot_p.bind(x, y, gs, **params)
    parts = []
    if not compat.is_symbolic_zero(dx):
        parts.append(ragged_dot_p.bind(dx, y, gs, **params))
    if not compat.is_symbolic_zero(dy):
        parts.append(ragged_dot_p.bind(x, dy, gs, **params))
    if not parts:
        return out, compat.symbolic_zero_like(out)
    return out, functools.reduce(lax.add, parts)


def _transpose(ct, x, y, gs, *, ragged_dot_dimension_numbers, **params):
    """JAX's transpose rule of ``ragged_dot_general`` (mode 1 only, as in JAX),
    binding the twin."""
    dn = ragged_dot_dimension_numbers
    (x_contract, y_contract), (x_batch, y_batch) = dn.dot_dimension_numbers
    x_ndim = x.aval.ndim if compat.is_undefined_primal(x) else np.ndim(x)
    y_ndim = y.aval.ndim if compat.is_undefined_primal(y) else np.ndim(y)
    mode, ragged = _mode(dn)
    if mode != NONCONTRACTING:
        raise NotImplementedError(
            "Unimplemented transpose for ragged dot general in mode "
            f"{'RAGGED_CONTRACTING' if mode == CONTRACTING else 'RAGGED_BATCH'} (as in JAX).")
    if compat.is_symbolic_zero(ct):
        return [None, None, None]
    x_kept = _remaining(range(x_ndim), x_contract, x_batch)
    y_group = list(dn.rhs_group_dimensions)
    y_kept = _remaining(range(y_ndim), y_contract, y_batch, y_group)
    nb, nx, ny = len(x_batch), len(x_kept), len(y_kept)
    ans_batch = list(range(nb))
    ans_x = list(range(nb, nb + nx))
    ans_y = list(range(nb + nx, nb + nx + ny))

    def grad(lhs, rhs, dims, unsorted, aval):
        out = ragged_dot_p.bind(lhs, rhs, gs, ragged_dot_dimension_numbers=dims,
                                **dict(params, out_sharding=None))
        out = lax.transpose(out, tuple(int(a) for a in np.argsort(unsorted)))
        return out if out.dtype == aval.dtype else lax.convert_element_type(out, aval.dtype)

    x_bar = y_bar = None
    if not compat.is_undefined_primal(y):
        dims = _dnums(((ans_y, y_kept), (ans_batch, list(y_batch))),
                      [nb + x_kept.index(ragged)], y_group)
        unsorted = (list(x_batch) + x_kept
                    + [int(a) for a in np.take(x_contract, np.argsort(y_contract))])
        x_bar = grad(ct, y, dims, unsorted, x.aval)
    if not compat.is_undefined_primal(x):
        dims = _dnums(((x_kept, ans_x), (list(x_batch), ans_batch)), [ragged], [])
        unsorted = (y_group + list(y_batch)
                    + [int(a) for a in np.take(y_contract, np.argsort(x_contract))] + y_kept)
        y_bar = grad(x, ct, dims, unsorted, y.aval)
    return [x_bar, y_bar, None]


def _shift(dims, at: int):
    """Axis numbers after inserting an axis at ``at``."""
    return [d + 1 if d >= at else d for d in dims]


def _batch(args, dims, *, ragged_dot_dimension_numbers, **params):
    """vmap: the vmapped axis becomes an lhs free axis outer to the ragged one
    (mode 1 with a shared rhs: no copy of the weights) or a new batch axis of
    both operands (other operands broadcast)."""
    lhs, rhs, gs = args
    lbd, rbd, gbd = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    dn = ragged_dot_dimension_numbers
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    lhs_ex = tuple(s for i, s in enumerate(lhs.shape) if i != lbd)  # one example's shape
    mode, ragged = _mode(dn)

    def at0(x, d):
        return jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)

    # group_sizes at its full per-example shape [prefix..., g], vmapped axis first
    gs = at0(gs, gbd)
    prefix = tuple(lhs_ex[a] for a in _prefix_dims(len(lhs_ex), dn))
    if gs.ndim == 2 and prefix:
        gs = jnp.broadcast_to(gs[(slice(None),) + (None,) * len(prefix)],
                              (size,) + prefix + gs.shape[-1:])
    lhs = at0(lhs, lbd)
    params = dict(params, out_sharding=None)
    if mode == NONCONTRACTING and rbd is None:
        nb = len(lb)
        new = _dnums(((_shift(lc, 0), list(rc)), (_shift(lb, 0), list(rb))),
                     [ragged + 1], list(dn.rhs_group_dimensions))
        out = ragged_dot_p.bind(lhs, rhs, jnp.moveaxis(gs, 0, nb),
                                ragged_dot_dimension_numbers=new, **params)
        return out, nb
    rhs = at0(rhs, rbd)
    new = _dnums(((_shift(lc, 0), _shift(rc, 0)), ([0] + _shift(lb, 0), [0] + _shift(rb, 0))),
                 [ragged + 1], _shift(dn.rhs_group_dimensions, 0))
    out = ragged_dot_p.bind(lhs, rhs, gs, ragged_dot_dimension_numbers=new, **params)
    return out, (1 if mode == CONTRACTING else 0)


compat.def_jvp(ragged_dot_p, _jvp)
compat.def_transpose(ragged_dot_p, _transpose)
compat.def_batching(ragged_dot_p, _batch)


# ----------------------------------------------------------------------------
# The masking rule
# ----------------------------------------------------------------------------
@register("ragged_dot_general", at_bound=True)  # the twin batches where JAX's cannot
def ragged_dot_general_rule(ctx, lhs, rhs, group_sizes, *, ragged_dot_dimension_numbers,
                            group_offset, **params):
    if group_offset is not None:
        raise ctx.unsupported("group_offset is set (JAX implements ragged_dot_general "
                              "only without it)")
    (lc, rc), _ = ragged_dot_dimension_numbers.dot_dimension_numbers
    group_sizes = clean(group_sizes, ctx.in_logical[2])  # padded groups are empty

    def bind(lhs, rhs):
        return ragged_dot_p.bind(lhs, rhs, group_sizes,
                                 **ctx.concrete_params(group_offset=None))

    zl, zr = ctx.has_zero_padding(lhs), ctx.has_zero_padding(rhs)
    if ctx.state.forward_only:  # never differentiated: contracted padding only
        out = bind(lhs if zl else clean(lhs, ctx.in_logical[0], lc),
                   rhs if zr else clean(rhs, ctx.in_logical[1], rc))
        return ctx.mark_zero_padding(out) if zl and zr else out
    inexact = is_inexact(ctx.out_avals[0].dtype)
    if not zl:
        lhs = clean(lhs, ctx.in_logical[0], None if inexact else lc)
    if not zr:
        rhs = clean(rhs, ctx.in_logical[1], None if inexact else rc)
    out = bind(lhs, rhs)
    if inexact and masked_axes(ctx.out_logical[0], ctx.out_bounds[0]):
        out = ctx.mark_zero_padding(clean(out, ctx.out_logical[0]))
    return out
