"""Host callbacks see the logical arrays: ``debug_callback`` (``jax.debug.callback``),
``debug_print`` (``jax.debug.print``), ``pure_callback`` and ``io_callback``.

The user's host function is wrapped. The traced logical sizes travel to the
host as one extra int32 operand; there the wrapper slices every operand with a
dynamic shape to its logical corner with NumPy, so padding (garbage, NaN) never
reaches the user's function and one compiled program serves every size. The
user's function gets ``jax.Array`` operands on the CPU device, as from JAX's
own callbacks.
Results whose shapes hold dim vars are checked against their logical shape and
padded back to their bound with zeros on the host (the interpreter gives them
their logical shape from the symbolic result shape); static results pass
through.

Under ``jax.vmap`` of the masked function each row must be sliced by its own
sizes. Debug callbacks and ``io_callback`` are called once per row by JAX
itself, as is ``pure_callback`` with ``vmap_method="sequential"``. With
``"expand_dims"`` / ``"broadcast_all"`` the host gets whole batches (the sizes
too): equal sizes in every row make one call, a ragged batch one call per row
(a batch of one, which both methods allow). ``"legacy_vectorized"`` leaves
unbatched operands without a batch axis, so rows cannot be told apart on the
host: it is bound as ``"sequential"`` (exact, as a vectorized callback must
agree with its per-row calls). So is a callback without a ``vmap_method``
whose own operands are not batched (JAX would refuse to batch it): the sizes
operand, or the guard of one case of a case split, is batched under ``vmap``
where the user's operands are not (equinox's ``error_if`` inside
``lax.cond``), and per row it is exact. With batched operands of its own it
stays as it is, and ``jax.vmap`` refuses it as plain JAX does.

``state.guard`` travels with the sizes: the host skips the user's function
where it is false, i.e. in rows of other cases of a case split (under ``vmap``
every case runs for every row) and on the padding steps of a loop run to the
bound (``scan`` / ``fori_loop`` over a dynamic length; under ``vmap`` the rows
of a ``while_loop`` already done), so the user's function is called exactly
as on exact shapes. The rules are registered ``sees_guard=True``: under a
guard they run even when every size is at its bound.

A nested ``polymask.mask`` stages its size checks as a debug callback under a
``lax.cond`` whose predicate is a masked reduction; its operands (per-row
checks under ``vmap``) are sliced like any other, so the callback only sees
the logical rows.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from ..core.shapes import is_static, needs_mask
from ..core.trace_state import trace_state
from ..tracing.registry import register


# ----------------------------------------------------------------------------
# Rule side: what the host needs to know, and the sizes operand
# ----------------------------------------------------------------------------
class _At(NamedTuple):
    """An axis whose logical size is entry ``index`` of the sizes operand."""

    index: int


# Per axis of an operand or result: None (the whole axis: its size is the
# bound), an int (a static logical size) or ``_At`` (a traced size).


class _SizesOperand:
    """Gathers the traced sizes the host needs into one int32 operand."""

    def __init__(self):
        self.values: list = []

    def add(self, value) -> int:
        for i, v in enumerate(self.values):
            if v is value:
                return i
        self.values.append(value)
        return len(self.values) - 1

    def axes(self, logical, bounds) -> tuple:
        return tuple(None if not needs_mask(s, b) else int(s) if is_static(s) else _At(self.add(s))
                     for s, b in zip(logical, bounds))

    def operands(self) -> list:
        if not self.values:
            return []
        return [jnp.stack([jnp.asarray(v, jnp.int32) for v in self.values])]


@dataclasses.dataclass(frozen=True)
class _HostPlan:
    """How the host cuts the operands and pads the results (trailing axes; any
    leading axes are batch axes added by ``vmap``)."""

    in_axes: tuple  # per operand, per axis: None | int | _At
    out_axes: tuple  # per result, likewise
    out_bounds: tuple  # per result, its padded shape
    out_dtypes: tuple
    guard: int | None  # entry of the sizes operand: 0 where another case runs
    has_sizes: bool
    pure: bool = False  # a pure_callback: XLA drops it when its results are empty


def _plan(ctx, with_results: bool, pure: bool = False):
    """The host plan and the extra operands; None when nothing needs cutting."""
    sizes = _SizesOperand()
    in_axes = tuple(sizes.axes(s, b) for s, b in zip(ctx.in_logical, ctx.in_bounds))
    out_axes = out_bounds = out_dtypes = ()
    if with_results:
        out_axes = tuple(sizes.axes(s, b) for s, b in zip(ctx.out_logical, ctx.out_bounds))
        out_bounds = tuple(tuple(b) for b in ctx.out_bounds)
        out_dtypes = tuple(np.dtype(a.dtype) for a in ctx.out_avals)
    guard = None if ctx.state.guard is None else sizes.add(ctx.state.guard)
    if guard is None and all(a is None for ax in (*in_axes, *out_axes) for a in ax):
        return None, []
    plan = _HostPlan(in_axes, out_axes, out_bounds, out_dtypes, guard, bool(sizes.values), pure)
    return plan, sizes.operands()


# ----------------------------------------------------------------------------
# Host side: NumPy only (no JAX program per size)
# ----------------------------------------------------------------------------
def _sizes_at(axes, row) -> tuple:
    return tuple(int(row[a.index]) if isinstance(a, _At) else a for a in axes)


def _cut(x, sizes):
    """The logical corner of the trailing axes of ``x`` (leading batch axes kept)."""
    return x[(Ellipsis, *(slice(None) if s is None else slice(0, s) for s in sizes))]


def _lead(x, rank: int) -> tuple:
    return tuple(x.shape[:x.ndim - rank])


def _row_of(x, idx: tuple, rank: int):
    """Row ``idx`` of the batch axes of ``x`` (kept, of size 1); a batch axis of
    size 1 (an unbatched operand under ``expand_dims``) broadcasts."""
    lead = _lead(x, rank)
    sel = tuple(slice(0, 1) if n == 1 else slice(i, i + 1)
                for i, n in zip(idx[len(idx) - len(lead):], lead))
    return x[sel]


def _result(r, j: int, logical: tuple, bound: tuple, call_lead: tuple, lead: tuple):
    """Result ``j`` checked against its logical shape, zero-padded to its bound
    and broadcast to the batch (``call_lead`` is the batch the callback saw)."""
    r = np.asarray(r)
    want = call_lead + logical
    if r.shape != want:
        raise ValueError(
            f"polymask: host callback result {j} has shape {r.shape}, but its "
            f"result_shape_dtypes give {want} at these logical sizes")
    out = np.zeros(call_lead + bound, r.dtype)
    out[tuple(slice(0, n) for n in r.shape)] = r
    if call_lead != lead:
        out = np.ascontiguousarray(np.broadcast_to(out, lead + bound))
    return out


def _as_jax_arrays(cuts: list) -> list:
    """The cut NumPy arrays as ``jax.Array`` on the host's CPU device: what JAX's
    own callback implementations hand the user's function (``pure_callback_impl``
    and ``debug_callback_impl`` ``device_put`` their operands there)."""
    return jax.device_put(cuts, jax.local_devices(backend="cpu")[0])


def _dropped_by_xla(plan: _HostPlan, row) -> bool:
    """Whether plain JAX would not call this pure callback: XLA replaces an
    instruction without side effects whose results all have zero elements by
    constants, so on exact shapes the host function is never called."""
    return plan.pure and bool(plan.out_axes) and all(
        0 in _sizes_at(ax, row) or 0 in bound for ax, bound in zip(plan.out_axes, plan.out_bounds))


def _call(fn, plan: _HostPlan, args, row, lead: tuple) -> list:
    """One call of the user's function on the logical corners of ``args``."""
    if (plan.guard is not None and not row[plan.guard]) or _dropped_by_xla(plan, row):
        return [np.zeros(lead + b, d) for b, d in zip(plan.out_bounds, plan.out_dtypes)]
    res = fn(*_as_jax_arrays([_cut(a, _sizes_at(ax, row)) for a, ax in zip(args, plan.in_axes)]))
    if not plan.out_bounds:
        return []
    call_lead = np.broadcast_shapes(*(_lead(a, len(ax)) for a, ax in zip(args, plan.in_axes)))
    res = list(res)
    if len(res) != len(plan.out_bounds):
        raise ValueError(f"polymask: host callback returned {len(res)} results, "
                         f"expected {len(plan.out_bounds)}")
    outs = []
    for j, (r, ax, bound) in enumerate(zip(res, plan.out_axes, plan.out_bounds)):
        logical = tuple(b if s is None else s for s, b in zip(_sizes_at(ax, row), bound))
        outs.append(_result(r, j, logical, bound, tuple(call_lead), lead))
    return outs


def _host_function(fn, plan: _HostPlan):
    """The function the host runs: cut, call ``fn`` (per row when the batch is ragged), pad."""
    n_in = len(plan.in_axes)

    def host(*flat):
        args = [np.asarray(a) for a in flat[:n_in]]
        sizes = np.asarray(flat[n_in]) if plan.has_sizes else np.zeros((0,), np.int32)
        lead = tuple(np.broadcast_shapes(sizes.shape[:-1], *(
            _lead(a, len(ax)) for a, ax in zip(args, plan.in_axes))))
        if sizes.ndim == 1:  # one row (no vmap, or JAX calls the host per row)
            return _call(fn, plan, args, sizes, lead)
        rows = sizes.reshape(-1, sizes.shape[-1])
        if len(rows) and (rows == rows[0]).all():  # a batch of equal sizes: one call
            return _call(fn, plan, args, rows[0], lead)
        # A ragged batch (expand_dims / broadcast_all): one call per row.
        outs = [np.zeros(lead + b, d) for b, d in zip(plan.out_bounds, plan.out_dtypes)]
        for idx in np.ndindex(*lead):
            row_args = [_row_of(a, idx, len(ax)) for a, ax in zip(args, plan.in_axes)]
            row = _row_of(sizes, idx, 1).reshape(-1)
            res = _call(fn, plan, row_args, row, (1,) * len(lead))
            for o, r in zip(outs, res):
                o[idx] = r.reshape(o.shape[len(lead):])
        return outs

    return host


# ----------------------------------------------------------------------------
# The rules
# ----------------------------------------------------------------------------
def _refuse_partitioned(ctx, partitioned: bool, plan) -> None:
    if partitioned and plan is not None:
        raise ctx.unsupported(
            "partitioned=True hands the callback per-device shards, which the "
            "logical shape (of the whole array) does not describe")


def _debug_host_function(fn, plan: _HostPlan):
    host = _host_function(fn, plan)

    def debug_host(*flat):
        host(*flat)
        return ()

    return debug_host


@register("debug_callback", sees_guard=True)
def debug_callback_rule(ctx, *args, callback, effect, partitioned):
    plan, extra = _plan(ctx, with_results=False)
    if plan is None:
        return ctx.bind(*args)
    _refuse_partitioned(ctx, partitioned, plan)
    return compat.debug_callback_p.bind(
        *args, *extra, callback=_debug_host_function(callback, plan), effect=effect,
        partitioned=partitioned)


@register("debug_print", sees_guard=True)
def debug_print_rule(ctx, *args, ordered, partitioned, **params):
    # Rebound as a debug_callback whose host function formats like jax.debug.print.
    plan, extra = _plan(ctx, with_results=False)
    if plan is None:
        return ctx.bind(*args)
    _refuse_partitioned(ctx, partitioned, plan)
    fmt = compat.debug_print_host_function(**params)
    return compat.debug_callback_p.bind(
        *args, *extra, callback=_debug_host_function(fmt, plan),
        effect=compat.debug_effect(ordered), partitioned=partitioned)


@register("pure_callback", sees_guard=True)
def pure_callback_rule(ctx, *args, callback, vmap_method, **_):
    if trace_state().per_example:
        vmap_method = "sequential"
    plan, extra = _plan(ctx, with_results=True, pure=True)
    if plan is None:
        return ctx.bind(*args, vmap_method=vmap_method)
    if vmap_method == "legacy_vectorized" or (  # see the module doc
            vmap_method is None and not trace_state().batched_outside
            and not any(map(compat.is_batched, args))):
        vmap_method = "sequential"
    return ctx.bind(*args, *extra, callback=_host_function(callback, plan),
                    vmap_method=vmap_method)


@register("io_callback", sees_guard=True)
def io_callback_rule(ctx, *args, callback, **_):
    plan, extra = _plan(ctx, with_results=True)
    if plan is None:
        return ctx.bind(*args)
    return ctx.bind(*args, *extra, callback=_host_function(callback, plan))
