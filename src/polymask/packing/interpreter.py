"""The packed interpreter: a traced jaxpr evaluated on one row of packed examples.

Like the masking interpreter (``tracing/interpreter.py``) it holds no
primitive-specific code: each equation that touches a packed axis goes to
its packed rule (``registry.py``, filled by ``rules/``); one that does not is
bound unchanged (shared operands) or ``vmap``-ed over the segment slots
(per-segment operands). After each equation, results with two or more
packed axes get their cross-segment entries selected to 0 (the
block-diagonal invariant every rule may assume); forward-only runs defer
that select to the value's first reader that is not elementwise, and
speculative ones let reductions and products mask by arithmetic with a
NaN check (``PackedRun.arithmetic_mask``, ``rerun_if_nan``).

``packed_program`` traces the user's function once (the symbolic trace of
``mask``, bound ``R``) and checks that it can run packed: one ragged dim var,
the case most sizes reach, every size along the ragged axis ``n + c`` or
a constant (``sizes.py``, which also gives the rows' gap).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_compat as compat
from ..core.diagnostics import relocate
from ..core.errors import ShapeError, TooManyCases, UnsupportedError
from ..core.shapes import DimEnv
from ..rules.families import family_of
from ..tracing.cases.splitting import trace_function_cases
from ..tracing.interpreter import walk_jaxpr, with_plain_weak_types
from ..tracing.registry import has_inner_jaxpr
from ..tracing.symbolic import MaskedProgram
from .registry import (
    OwedReport,
    PackedContext,
    PackedUnsupported,
    PerSegment,
    cross_value,
    nan_keeper,
    nan_poison,
    packed_rule,
    propagates_nan,
    reads_unmasked,
)
from .segments import SEGMENT_FIELDS, Segments
from .sizes import RaggedSizes, check_sizes, not_n, param_dims

__all__ = ["PackedRun", "PackedProgram", "RarePaths", "packed_program", "ROWS_AXIS"]

# the axis name runners give ``jax.vmap`` over rows: a rule can ask whether
# any row of the call needs a rare path (``PackedRun.any_row``) and keep that
# path behind a real ``lax.cond`` instead of a select that always computes it
ROWS_AXIS = "polymask_rows"


@dataclasses.dataclass(eq=False)
class _Check:
    """A NaN check not yet made (``PackedRun.rerun_if_nan``): NaN at a live
    entry of ``data`` reruns the call. ``owed``: reports of masked maxes this
    value depends on that no value it was computed from carried; ``covers``:
    those it carries itself (computed from their witness sum)."""

    data: Any
    aval: Any
    axes: tuple[int, ...]
    owed: frozenset = frozenset()
    covers: frozenset = frozenset()


class PackedRun:
    """One evaluation of a program on one row: the ragged size ``n`` as a
    dimension expression, the row's ``Segments`` and the per-segment sizes."""

    def __init__(self, prog: MaskedProgram, var: str, seg: Segments, forward_only: bool,
                 observe: Callable | None = None, sizes: RaggedSizes | None = None,
                 rows_axis: str | None = None, rare: RarePaths | None = None):
        self.prog = prog
        self.var = var
        self.n = prog.spec_var_expr(var)
        self.sizes = sizes or RaggedSizes(prog, var, ())
        self.seg = seg
        self.forward_only = forward_only
        # observe(eqn, how, outs): ``explain(layout="packed")`` records how each
        # equation ran (its packed rule, bound on shared values, or vmapped)
        self.observe = observe
        self.rows_axis = rows_axis  # the vmap axis over rows, when the caller names it
        self.rare = rare  # speculative row programs: the rare paths' flags (``rare_path``)
        # NaN checks not yet made: id(data) -> _Check (``rerun_if_nan``)
        self._pending: dict[int, _Check] = {}
        # values NaN wherever a masked max's operand was: id(data) -> (data, the
        # max's OwedReports); a sum of one over the max's axes is their witness
        self._holds: dict[int, tuple[Any, frozenset]] = {}
        self._dims = DimEnv(prog.scope, prog.dim_bounds, prog.internal_values({var: seg.lengths}))

    def with_segments(self, arrays) -> PackedRun:
        """This run on other segment arrays (``Segments.arrays()``)."""
        return PackedRun(self.prog, self.var, Segments.from_arrays(arrays, self.seg.gap),
                         self.forward_only, self.observe, self.sizes, self.rows_axis,
                         self.rare)

    def any_row(self, flag):
        """Whether ``flag`` (a boolean scalar of this row) holds in any row of
        the call: unbatched when the rows' ``vmap`` names ``rows_axis``, so a
        ``lax.cond`` on it skips its branch at run time for the whole batch
        (a batched predicate turns the cond into a select of both branches)."""
        if self.rows_axis is None:
            return flag
        return lax.psum(flag.astype(jnp.int32), self.rows_axis) > 0

    def rare_path(self, flag, exact: Callable, usual: Callable):
        """``exact()`` where ``flag`` (a boolean of this row) holds in any row
        of the call, else ``usual()``: a rule's slow path for data it rarely
        meets (a NaN or inf of one example before a block-diagonal product).

        In a speculative row program (``RarePaths``) the program computes
        ``usual()`` only and reports ``flag``; the runner reruns the call in
        the exact program where any row's flag holds. A ``lax.cond`` keeps
        both branches' operands alive, and XLA:CPU then materialises them
        between fusions: the cond around the attention product cost the
        bfloat16 MiniLM row program 11 of its 126 ms per call untaken (one
        process). Inside a loop body (another trace than the row's) it stays
        a ``lax.cond``."""
        if self.speculates():
            self.rare.flags.append(jnp.any(flag))
            return usual()
        return lax.cond(self.any_row(flag), exact, usual)

    def speculates(self) -> bool:
        """Whether this is a speculative row program evaluated at the row's own
        trace (not inside a loop body or branch): a rule may then leave its
        rare cases to the exact program (``rare_path``, ``rerun_if_nan``)."""
        rare = self.rare
        return rare is not None and rare.trace is not None and \
            compat.current_trace() is rare.trace

    def arithmetic_mask(self, x, aval, kind: str):
        """The data of ``Unmasked`` block-diagonal ``x`` for a reader that
        reduces with ``kind``: entries whose packed axes lie in different
        segments made the identity by arithmetic, ``x * M`` for a sum
        (``M``: 1 within a block, else 0) and ``x + B`` for a max or min
        (``B``: -0.0 within a block, the exact identity of addition, else -inf
        or +inf). None where ``x`` is not ``Unmasked``, not floating, or
        this run does not speculate, or where ``x`` was computed from a masked
        value and may hold an infinity between examples (the reader selects).

        The masked data replaces ``x``'s for its later readers, and what each
        elementwise equation after it holds between examples is followed
        (``Unmasked.cross``): a softmax's ``exp(s - max)`` holds 0 there, so
        its sum and its product read it as it is and the row program holds
        one mask per attention, as a hand-written one does (bfloat16 MiniLM,
        8 rows of 256 per call: 147.7 -> 125.7 ms per call; three masks read
        per layer had been the gap to the hand-written packed encoder).

        Why: XLA:CPU's YNNPACK fusions take a dot, a reduction and arithmetic
        into one kernel but no select or compare (xla/backends/cpu/ynn_support.cc),
        so the exact mask, a select, split each softmax of attention into
        pieces with the R x R scores materialised between them (bfloat16
        MiniLM: the selects were 25 of 148 ms per call of 8 rows of 256).

        Exact where the cross entries are finite (``x * 0 = 0``,
        ``x - inf = -inf``); a non-finite one (another example's NaN or
        inf, ``exp`` overflowing between examples) makes the reader's result
        NaN, which ``rerun_if_nan`` reports: the call then reruns in the exact
        program. (XLA's simplifier may turn the product with a 0/1 mask back
        into a select, as jaxlib 0.10's does: exact too, without the NaN.)
        XLA:CPU's max reductions may drop a NaN, so the max and min readers
        owe a report of it (``OwedReport``), witnessed by the softmax's sum
        or made by ``reductions._nan_poison`` where no sum follows.
        The row's dead positions have segment id ``S``: they form
        one more block, so a dead query row of attention reduces over dead
        keys (the host's copies of real data, finite) and stays finite, never
        ``max = -inf`` and ``exp(inf)`` flowing into the next layer."""
        if not (isinstance(x, Unmasked) and self.speculates()
                and jnp.issubdtype(x.data.dtype, jnp.floating)):
            return None
        if x.cross is not None:  # computed from a masked value (``Unmasked.cross``)
            # its own identity there: read as is; else possibly inf, and
            # ``inf * 0`` would be NaN: the reader selects instead
            return x.data if x.cross == _IDENTITY[kind] else None
        masked = self._masked_by_arithmetic(x.data, aval, kind)
        self._replace_data(x, masked, _IDENTITY[kind])
        return masked

    def _replace_data(self, x, data, cross: float) -> None:
        """``x`` holds ``data`` from now on (equal to its data at every entry
        inside an example), known to hold ``cross`` between examples: later
        readers of ``x`` (``exp(s - max)`` after the max of a softmax) compute
        on the masked data, and the softmax's sum and product need no mask of
        their own. A pending NaN check of the old data moves with it."""
        entry = self._pending.pop(id(x.data), None)
        if entry is not None:
            entry.data = data
            self._pending[id(data)] = entry
        x.data, x.cross = data, cross

    def _masked_by_arithmetic(self, data, aval, kind: str):
        """``data`` with its cross-segment entries made ``kind``'s identity:
        ``x + B`` (max, min) or ``x * M`` (sum)."""
        axes = self.packed_axes(aval)
        views = [self.axis_segments(aval, a) for a in axes]
        ids = [self.seg.along(v.seg, a, data.ndim) for a, v in zip(axes, views)]
        same = ids[0] == ids[1]
        for other in ids[2:]:
            same = same & (ids[0] == other)
        if kind == "min":
            return data + jnp.where(same, -0.0, jnp.inf).astype(data.dtype)
        # one bias for the max and both products (XLA materialises a mask
        # broadcast over the heads once per call: one instead of three)
        bias = jnp.where(same, -0.0, -jnp.inf).astype(jnp.float32)
        if kind == "max":
            return data + bias.astype(data.dtype)
        keep = jnp.exp(bias)  # exp(-0) = 1, exp(-inf) = 0
        if data.dtype.itemsize < 4:  # bfloat16 operands: one float32 mask (exact: 0 or x)
            return (data.astype(jnp.float32) * keep).astype(data.dtype)
        return data * keep.astype(data.dtype)

    def rerun_if_nan(self, out, aval, axes, owes: tuple[Any, OwedReport] | None = None,
                     sums: tuple[Any, tuple[int, ...]] | None = None) -> None:
        """In a speculative run, a NaN at a live entry of ``out`` (a reader's
        result of an ``arithmetic_mask``-ed operand; packed ``axes``) reruns
        the call in the exact program. A NaN that plain JAX has too (an
        example's own NaN) reruns as well and gets the exact program's value.

        The check waits (``_pending``) while ``out``'s readers propagate NaN
        (``registry.propagates_nan``: ``exp(s - max)``, a sum, a product):
        their results carry it, and it is made on the first value read
        otherwise (a compare, a select, a loop, a row output). Checked at once,
        the softmax's max and sum would be outputs of their fusions, and
        XLA:CPU's YNNPACK fusion of attention (dot, softmax, dot: one kernel)
        would split at each.

        ``owes``: ``(operand, report)``, ``out`` is a masked max or min that
        may have dropped a NaN of its masked ``operand`` (``OwedReport``).
        ``sums``: ``(operand, axes)``, ``out`` is a sum of ``operand`` over
        ``axes``: the witness of the reports ``operand`` holds over them."""
        if not self.speculates():
            return
        check = _Check(out, aval, tuple(axes))
        if owes is not None:
            operand, owed = owes
            check.owed = frozenset({owed})
            self._holds[id(operand)] = (operand, check.owed)
        if sums is not None:
            operand, reduced = sums
            held = self._holds.get(id(operand))
            for owed in held[1] if held is not None else ():
                if owed.witness is None and owed.reduced == tuple(reduced):
                    owed.witness = check
                    check.covers |= {owed}
        self._pending[id(out)] = check

    def _data(self, x):
        return x.data if isinstance(x, (Unmasked, PerSegment)) else x

    def _is_pending(self, x) -> bool:
        return bool(self._pending) and id(self._data(x)) in self._pending

    def _carry_pending(self, outs, avals, axes) -> None:
        """``outs`` carry their operands' pending checks (a NaN in an operand
        is a NaN at a live position of each result)."""
        for o, aval, ax in zip(outs, avals, axes):
            data = self._data(o)
            if hasattr(data, "dtype") and jnp.issubdtype(data.dtype, jnp.inexact):
                self._pending.setdefault(id(data), _Check(data, aval, tuple(ax)))

    def _owed_of(self, pending) -> tuple[frozenset, frozenset]:
        """The reports owed and covered by ``pending`` operands' checks."""
        owed, covers = frozenset(), frozenset()
        for x in pending:
            entry = self._pending.get(id(self._data(x)))
            if entry is not None:
                owed, covers = owed | entry.owed, covers | entry.covers
        return owed, covers

    def _pass_owed(self, outs, owed: frozenset, covers: frozenset) -> None:
        """Results' checks take their operands' owed reports, less those
        they carry (a value divided by a softmax's sum carries its max's)."""
        if not (owed or covers):
            return
        for o in outs:
            entry = self._pending.get(id(self._data(o)))
            if entry is not None:
                entry.covers |= covers
                entry.owed = (entry.owed | owed) - entry.covers

    def _hold_nan_of(self, invals, outs) -> None:
        """An elementwise result that propagates NaN, of its operands' shape,
        is NaN wherever they were: it holds their masked maxes' operands'
        NaN (``_holds``)."""
        held = frozenset()
        for x in invals:
            entry = self._holds.get(id(x))
            if entry is not None:
                held |= entry[1]
        if not held or len(outs) != 1:
            return
        out = self._data(outs[0])
        if any(getattr(out, "shape", None) == getattr(x, "shape", ()) for x in invals
               if id(x) in self._holds):
            self._holds[id(out)] = (out, held)

    def check_pending(self, x) -> None:
        """Make ``x``'s pending NaN check now (a flag of the speculative row
        program: ``rerun_if_nan``), with the reports it owes: its witness's
        check where a sum witnessed one, else the report itself."""
        if not self._pending:
            return
        entry = self._pending.pop(id(self._data(x)), None)
        if entry is None:
            return
        per_segment = isinstance(x, PerSegment)
        if not self.speculates():  # read inside a body: its tracers cannot leave it
            self.rare.deferred.append(lambda: self._make_check(entry, per_segment))
            return
        self._make_check(entry, per_segment)

    def _make_check(self, entry: _Check, per_segment: bool) -> None:
        self._flag_nan(entry.data, entry.aval, entry.axes, per_segment)
        for owed in entry.owed:
            w = owed.witness
            if w is not None:
                self._flag_nan(w.data, w.aval, w.axes)
            else:
                self._flag_nan(owed.report(), owed.aval, owed.axes)

    def _flag_nan(self, data, aval, axes, per_segment: bool = False) -> None:
        bad = jnp.isnan(data)
        if axes and not per_segment:
            bad = bad & self.live_mask(aval, axes, data.shape)
        self.rare.flags.append(jnp.any(bad))

    # -- sizes ------------------------------------------------------------------
    def is_n(self, d) -> bool:
        """Whether ``d`` is exactly the ragged size ``n`` (offset 0)."""
        return self.sizes.offset(d) == 0

    def offset(self, d) -> int:
        """``c`` of a ragged size ``n + c`` (raises for other sizes)."""
        c = self.sizes.offset(d)
        if c is None:
            raise PackedUnsupported(not_n(self.prog, self.n, d))
        return c

    def is_packed(self, d) -> bool:
        """Whether size ``d`` is ``n + c``: an axis of that size is packed."""
        return self.sizes.offset(d) is not None

    def size(self, d) -> int:
        """A size in a row: ``n + c`` is the row's ``R`` positions; a constant
        is itself."""
        k = self.sizes.constant(d)
        if k is not None:
            return k
        self.offset(d)
        return self.seg.R

    def segments(self, c: int) -> Segments:
        """The row's segments for values of size ``n + c`` (``Segments.at``;
        not cached: a view made inside a loop body must not be used outside)."""
        return self.seg.at(c)

    def axis_segments(self, aval, axis: int) -> Segments:
        """The segments of ``aval``'s packed ``axis``."""
        return self.segments(self.offset(aval.shape[axis]))

    def packed_axes(self, aval) -> tuple[int, ...]:
        out = []
        for i, d in enumerate(getattr(aval, "shape", ())):
            if compat.is_dim_expr(d) and self.sizes.constant(d) is None:
                self.offset(d)  # raises for sizes other than n + c
                out.append(i)
        return tuple(out)

    def segment_size(self, d, as_value: bool = False):
        # not DimEnv.logical: its cache would keep a value computed inside a
        # loop body or branch (an inner trace) for use outside it
        raw = jnp.asarray(self._dims.logical_raw(d), jnp.int32)
        if not as_value:  # a size or position, not the number x.shape[0] - 2 (-1 at 1)
            raw = jnp.maximum(raw, 0)
        return raw * jnp.ones((self.seg.S,), jnp.int32)

    # -- evaluation ---------------------------------------------------------------
    def eval_closed(self, closed, args: list) -> list:
        return self.eval_jaxpr(closed.jaxpr, closed.consts, args)

    def eval_jaxpr(self, jaxpr, consts, args) -> list:
        """Outputs settled (``Unmasked`` values masked): rules and the row
        function receive values that keep the invariant."""
        outs = walk_jaxpr(jaxpr, consts, args, self._apply_at_user_line)
        for o in outs:
            self.check_pending(o)
        return [self.settle(o, v) for o, v in zip(outs, jaxpr.outvars)]

    def eval_inline(self, closed, args) -> list:
        """A call's body evaluated where it is called (``jit``, ``custom_jvp``
        in forward-only runs): ``Unmasked`` values pass in and out unsettled,
        so a softmax inside ``jax.nn.softmax``'s ``custom_jvp`` is masked by
        its readers as if it were written inline."""
        return walk_jaxpr(closed.jaxpr, closed.consts, args, self._apply_at_user_line)

    def _apply_at_user_line(self, eqn, invals) -> list:
        with compat.user_context(eqn.source_info):
            return self.apply(eqn, invals)

    def apply(self, eqn, invals) -> list:
        name = eqn.primitive.name
        try:
            in_packed = [self.packed_axes(v.aval) for v in eqn.invars]
            out_packed = [self.packed_axes(v.aval) for v in eqn.outvars]
        except PackedUnsupported as e:
            inner = self._innermost_culprit(eqn)
            raise PackedUnsupported(
                f"primitive '{inner or name}'{'' if inner is None else f' inside {name!r}'} "
                f"(used at {compat.source_line(eqn.source_info)}) cannot run packed: {e}"
            ) from None
        rule = packed_rule(name)
        touches = any(in_packed) or any(out_packed) or _params_have_dims(eqn.params)
        local = self.forward_only and family_of(name)[0] == "elementwise"
        # a rule that reads unmasked operands masks them itself (or inlines a call)
        passed = self.forward_only and rule is not None and reads_unmasked(name)
        pending = [x for x in invals if self._is_pending(x)]
        if pending and not self.speculates():  # a row value read inside a body
            for x in pending:
                self.check_pending(x)
            pending = []
        crosses = [x.cross if local and isinstance(x, Unmasked) else None for x in invals]
        invals = [x.data if local and isinstance(x, Unmasked)
                  else x if passed else self.settle(x, v)
                  for x, v in zip(invals, eqn.invars)]
        ctx = None
        try:
            if rule is not None and (touches or has_inner_jaxpr(eqn.params)):
                how = f"{rule.__module__.rsplit('.', 1)[-1]}.{rule.__qualname__}"
                ctx = PackedContext(eqn, self, in_packed, out_packed)
                out = rule(ctx, *invals, **eqn.params)
            elif touches:
                raise PackedUnsupported(
                    f"the packed layout has no rule for primitive '{name}' "
                    f"(used at {compat.source_line(eqn.source_info)})")
            else:
                how = ("vmap over segments" if any(isinstance(x, PerSegment) for x in invals)
                       else "bound (shared)")
                out = _per_segment_or_shared(eqn, invals)
        except PackedUnsupported as e:
            raise relocate(e, compat.source_line_with_caller(eqn.source_info)) from None
        except (ShapeError, UnsupportedError):
            raise
        except Exception as e:  # no JAX-internal error escapes the packed layout
            raise PackedUnsupported(
                f"primitive '{name}' (used at {compat.source_line(eqn.source_info)}) cannot "
                f"run packed: its packed rule failed with {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}") from e
        outs = list(out) if eqn.primitive.multiple_results else [out]
        if self._holds and local and propagates_nan(eqn) is True:
            self._hold_nan_of(invals, outs)
        if pending:
            owed, covers = self._owed_of(pending)
            outs = self._pass_pending(eqn, ctx, pending, outs, out_packed)
            self._pass_owed(outs, owed, covers)
        outs = [self.live_only(o, v.aval, axes)
                for o, v, axes in zip(outs, eqn.outvars, out_packed)]
        if any(c is not None for c in crosses) and isinstance(outs[0], Unmasked):
            # an operand that may be infinite between examples makes the result
            # unknown too (``0 * inf``); None is another example's (finite) data
            maybe_inf = any(c is not None and math.isnan(c) for c in crosses)
            cross = None if maybe_inf else cross_value(eqn, crosses)
            outs[0].cross = math.nan if cross is None else cross
        if self.observe is not None:
            self.observe(eqn, how, [o.data if isinstance(o, Unmasked) else o for o in outs])
        return outs

    def _pass_pending(self, eqn, ctx, pending, outs, out_packed) -> list:
        """Operands' pending NaN checks after ``eqn``: carried by its results
        where it propagates NaN (after a poison term where it may drop one),
        else made now. Returns the results."""
        if ctx is not None and ctx.carries_nan_checks:
            return outs  # an inlined body or an arithmetic mask's reader handled them
        how = propagates_nan(eqn)
        if how == "poison" and len(outs) == 1:
            outs = [self.poisoned(outs[0], pending)]
        elif not how or how == "poison":
            for x in pending:
                self.check_pending(x)
            return outs
        self._carry_pending(outs, [v.aval for v in eqn.outvars], out_packed)
        return outs

    def poisoned(self, out, pending):
        """``out`` plus ``x * 0 * -0.0`` of each pending operand ``x`` of its
        shape: ``-0.0`` (the exact identity of addition) where ``x`` is finite,
        NaN where it is not, whatever ``out``'s primitive did with the NaN."""
        data = self._data(out)
        for x in pending:
            xd = self._data(x)
            if getattr(xd, "shape", None) == getattr(data, "shape", None):
                data = data + nan_poison(xd).astype(data.dtype)
            else:
                self.check_pending(x)
        return data

    def unpacked(self, eqn, invals):
        """An equation with no packed operand or result, as the interpreter
        runs one without a rule: bound on shared values, else ``vmap``-ed over
        the segment slots. None when its inner jaxprs use the ragged size
        (``x.shape[0]`` in a loop's predicate): the caller runs them packed."""
        if _mentions_sizes(eqn.params):
            return None
        return _per_segment_or_shared(eqn, invals)

    def _innermost_culprit(self, eqn) -> str | None:
        """The first primitive inside ``eqn``'s inner jaxprs that makes a size
        other than ``n`` (``slice`` inside the ``jit`` of ``jnp.diff``)."""
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            for e in getattr(inner, "eqns", ()):
                try:
                    for v in e.outvars:
                        self.packed_axes(v.aval)
                except PackedUnsupported:
                    return self._innermost_culprit(e) or e.primitive.name
        return None

    def same_segment(self, aval, axes, shape):
        """``Segments.same_segment`` for ``aval``'s packed ``axes`` (each axis
        with the view of its own size)."""
        views = [self.axis_segments(aval, a) for a in axes]
        return self.seg.same_segment(axes, shape, views)

    def live_mask(self, aval, axes, shape):
        """Where a value of ``aval`` (packed ``axes``, row ``shape``) is live:
        its first packed axis at a live position of its own size's view (not
        past ``n + c`` in its region, not the row's tail) and every other in
        that position's segment (``live_everywhere`` also asks each of them
        to be live)."""
        views = [self.axis_segments(aval, a) for a in axes]
        ndim = len(shape)
        ok = self.seg.along(views[0].live, axes[0], ndim)
        for a, v in zip(axes[1:], views[1:]):
            ok = ok & (self.seg.along(views[0].seg, axes[0], ndim)
                       == self.seg.along(v.seg, a, ndim))
        return jnp.broadcast_to(ok, tuple(shape))

    def live_everywhere(self, aval, axes, shape):
        """``live_mask`` with every packed axis at a live position (a dead
        column of a live row too): where a block-diagonal value's entries are
        terms of its example (``live_mask`` leaves a dead column to the
        operand it meets, whose dead entries are 0 or never read)."""
        ok = self.live_mask(aval, axes, shape)
        ndim = len(shape)
        for a in axes[1:]:
            ok = ok & self.seg.along(self.axis_segments(aval, a).live, a, ndim)
        return ok

    def live_only(self, x, aval, axes):
        """The packed layout's invariant, enforced after every equation: a
        value's dead entries (past ``n + c`` in an example's region, the row's
        tail, another example's block of a value with two packed axes) are
        selected to 0, whatever the equation computed there (``log`` of a
        dead 0 is ``-inf``; a shift reads the next example). The select is also
        the backward gate: its transpose sends exactly 0 to dead entries, so a
        ``0 * inf`` of a restricted-domain function's derivative at a dead entry
        (``sqrt`` after ``x[1:]``) stops there and never reaches a live entry
        or a shared parameter (docs/packing.md, "The invariant").

        A forward-only run (``ragged_map``) keeps the select only for values
        with two or more packed axes (their cross-example zeros are what
        contractions sum over): every rule computes a live result from live
        entries only, so a dead entry cannot reach a live one there, and a
        select per equation would cost the MiniLM row program a fifth of its
        time. There, the select of a value with two or more packed axes is
        deferred to where it is read (``Unmasked``, ``settle``): elementwise
        equations read each entry at its own position, so they run on the
        unmasked data, and the select lands in the fusion of the reduction
        or product that reads across positions. A softmax over attention
        scores then masks once per reduction and once before the product,
        not after each of its seven equations, each select a pass over the
        rows' R x R scores that XLA materialised (bfloat16 MiniLM, 8 rows of
        256 per call, one process: 130 -> 124 ms). Where JAX differentiates
        the row program (``value_and_grad``), its transposes of the rules'
        gathers would carry a dead result's cotangent to the live entry it
        read: every packed value is gated."""
        if not axes or isinstance(x, (PerSegment, Unmasked)) or \
                (self.forward_only and len(axes) < 2):
            return x
        if self.forward_only:
            return Unmasked(x)
        return self._select_live(x, aval, axes)

    def settle(self, x, var):
        """``x`` with the invariant kept: an ``Unmasked`` value's entries
        between blocks selected to 0 (``var``: its jaxpr variable or literal).

        The row's dead positions (id ``S``) form one more block, and its
        entries stay as computed: a function of the host's copies of real
        positions, like an example's. Selected to 0 as well, a causal mask
        (``tril(ones((n, n), bool))[None]``, settled by its broadcast) was
        False on every dead query row, the next ``where(mask, s, -inf)`` made
        those rows ``-inf``, their softmax NaN, and the next layer's masks
        (``x + B``: ``NaN - inf``) carried that NaN into live rows: every call
        of a two-layer ``-inf``-masked decoder reran in the exact program.
        Nothing reads a dead row into a live result (another block)."""
        if not isinstance(x, Unmasked):
            return x
        self.check_pending(x)
        aval = var.aval
        same = self.same_segment(aval, self.packed_axes(aval), x.data.shape)
        return lax.select(same, x.data, jnp.zeros_like(x.data))

    def _select_live(self, x, aval, axes):
        ok = self.live_mask(aval, axes, x.shape)
        return lax.select(ok, x, jnp.zeros_like(x))


@dataclasses.dataclass
class RarePaths:
    """A speculative row program's record: the trace of its row function
    (flags from loop bodies, other traces, cannot leave them) and the flags
    of the rare paths it did not take (``PackedRun.rare_path``)."""

    trace: Any
    flags: list = dataclasses.field(default_factory=list)
    # NaN checks of row values first read inside a loop body or branch (another
    # trace, whose tracers cannot leave it): made at the row's trace, last
    deferred: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def make_deferred_checks(self) -> None:
        """Make the deferred NaN checks (their flags join ``flags``); the row
        function calls this at its own trace, after the last equation."""
        deferred, self.deferred = self.deferred, []
        for check in deferred:
            check()

    def any(self):
        """Whether any rare path's flag holds (a boolean of the row)."""
        if not self.flags:
            return jnp.zeros((), bool)
        return jnp.any(jnp.stack(self.flags))


@dataclasses.dataclass
class Unmasked:
    """A packed value with two or more packed axes whose dead entries are
    not yet selected to 0 (forward-only runs): elementwise equations read its
    data as is, a rule that ``reads_unmasked`` masks it itself (by arithmetic
    in a speculative program: ``PackedRun.arithmetic_mask``), every other
    reader gets ``PackedRun.settle``'s select.

    ``cross``: None while ``data`` between examples is the examples' own
    values (other examples' data: finite in practice, so an arithmetic mask
    is exact there). Once an arithmetic mask made it a reduction's identity,
    ``data`` is replaced (mutable: later readers of this value compute on the
    masked data, ``PackedRun.arithmetic_mask``) and ``cross`` says what every
    entry between examples holds: 0, inf or -inf (or NaN there), followed
    through elementwise equations (``registry.register_cross_value``); NaN
    where no longer known (maybe inf: such a value's readers select). A reader
    that reduces with the identity ``cross`` holds reads ``data`` as it is."""

    data: Any
    cross: float | None = None


def _params_have_dims(params) -> bool:
    return bool(param_dims(params))


def _mentions_sizes(params) -> bool:
    """Whether an inner jaxpr of ``params`` has a symbolic size (an aval or a
    param: ``dim_as_value`` of ``x.shape[0]``)."""
    for inner, _ in compat.inner_jaxprs(params):
        for v in [*inner.invars, *inner.outvars]:
            if compat.is_symbolic_shape(getattr(getattr(v, "aval", None), "shape", ())):
                return True
        for eqn in inner.eqns:
            if _params_have_dims(eqn.params) or _mentions_sizes(eqn.params) or any(
                    compat.is_symbolic_shape(getattr(v.aval, "shape", ())) for v in eqn.outvars):
                return True
    return False


def _per_segment_or_shared(eqn, invals):
    """An equation with no packed axis: bound as is when every operand is
    shared, else ``vmap``-ed over the segment slots (per-segment operands
    mapped, shared ones not): any primitive with a batching rule."""
    prim, params = eqn.primitive, eqn.params
    if not any(isinstance(x, PerSegment) for x in invals):
        return prim.bind(*invals, **params)
    axes = [0 if isinstance(x, PerSegment) else None for x in invals]
    datas = [x.data if isinstance(x, PerSegment) else x for x in invals]
    keeper = nan_keeper(prim.name)

    def one(*a):
        out = prim.bind(*a, **params)
        return out if keeper is None else keeper(out, a[0], params)

    out = jax.vmap(one, in_axes=axes)(*datas)
    if prim.multiple_results:
        return [PerSegment(o) for o in out]
    return PerSegment(out)


@dataclasses.dataclass
class PackedProgram:
    """A function traced for the packed layout.

    Attributes:
      program: the symbolic trace (one case for every size up to ``row_size``).
      var: the ragged dim var (its axes are packed).
      row_size: R, the bound the trace was made at.
      in_kinds: per input leaf, ``"packed"`` (axes of ``var``: ``packed_axes``)
        or ``"segment"`` (no dim var: one value per example).
      packed_axes: per input leaf, its packed axes.
      tree, case_index: the case tree and the case traced for packing (the
        one most sizes reach; the sizes of other cases run padded: ``runs``).
      out_kinds: per output leaf, ``"packed"``, ``"segment"`` or ``"shared"``
        (known once ``row_fn`` is traced).
      gap: G, the free positions after each example in a row (sizes ``n + c``
        with ``c > 0`` and windows around positions need them: ``required_gap``).
    """

    program: MaskedProgram
    var: str
    row_size: int
    packed_axes: list[tuple[int, ...]]
    tree: Any = None  # the CaseTree: its other cases are errors of the plain function
    case_index: int = 0
    out_kinds: list[str] | None = None
    gap: int = 0
    sizes: RaggedSizes | None = None

    @property
    def positions(self) -> int:
        """Positions per row: the row size and the gap after its last example."""
        return self.row_size + self.gap

    def out_offset(self, i: int) -> int:
        """``c`` of output leaf ``i``'s packed axes (sizes ``n + c``; 0 if none)."""
        cs = [self.sizes.offset(d) for d in self.out_shapes[i] if compat.is_dim_expr(d)]
        if len(set(cs)) > 1:
            raise PackedUnsupported(f"output {i} has packed axes of different sizes")
        return cs[0] if cs else 0

    def out_lengths(self, n: int) -> list[tuple[int, ...]]:
        """Per output leaf, the sizes of an example of size ``n`` (its packed
        axes are cut out of the row at these lengths)."""
        values = self.program.internal_values({self.var: int(n)})
        return [tuple(int(compat.evaluate_dim(d, values)) if compat.is_dim_expr(d) else int(d)
                      for d in shape) for shape in self.out_shapes]

    def runs(self, n: int) -> bool:
        """Whether size ``n`` reaches the traced program (else it runs in the
        padded layout, which also reports the sizes where plain JAX raises)."""
        if self.sizes is not None and int(n) in self.sizes.irregular:
            return False
        if self.tree is None or self.tree.single:
            return True
        return int(self.tree.select(self.program.internal_values({self.var: int(n)}))) \
            == self.case_index

    def raises(self, n: int) -> bool:
        """Whether size ``n`` reaches an error case: the function raises there
        on the exact arrays, in either layout."""
        if self.tree is None or self.tree.single:
            return False
        index = int(self.tree.select(self.program.internal_values({self.var: int(n)})))
        return self.tree.cases[index].error is not None

    @property
    def out_shapes(self):
        return self.program.out_shapes

    def row_fn(self, n_broadcast: int, forward_only: bool = True,
               observe: Callable | None = None, rows_axis: str | None = None,
               speculative: bool = False) -> Callable:
        """``fn(*broadcast, *example_leaves, *segment_arrays) -> outputs`` for
        one row (``vmap`` it over rows). Example leaves are row data (packed
        axes of length R) or per-segment ``(S, ...)`` stacks. ``observe``:
        see ``PackedRun``. ``rows_axis``: the ``axis_name`` of the caller's
        ``vmap`` over rows (``ROWS_AXIS``), None when the row is not vmapped
        under a name. ``speculative``: the rules' rare paths are left out
        and one more output, a boolean, says whether the row needed one
        (``PackedRun.rare_path``): the caller then reruns the call in the
        program made without ``speculative``."""
        prog, var = self.program, self.var

        def fn(*args):
            k = len(SEGMENT_FIELDS)
            leaves, segs = args[:-k], Segments.from_arrays(args[-k:], self.gap)
            rare = RarePaths(compat.current_trace()) if speculative else None
            run = PackedRun(prog, var, segs, forward_only, observe, self.sizes, rows_axis,
                            rare)
            wrapped = list(leaves[:n_broadcast])
            invars = prog.closed_jaxpr.jaxpr.invars[n_broadcast:]
            for x, axes, v in zip(leaves[n_broadcast:], self.packed_axes, invars):
                wrapped.append(run.live_only(x, v.aval, axes) if axes else PerSegment(x))
            outs = run.eval_closed(prog.closed_jaxpr, wrapped)
            kinds = ["segment" if isinstance(o, PerSegment) else
                     ("packed" if run.packed_axes(v.aval) else "shared")
                     for o, v in zip(outs, prog.closed_jaxpr.jaxpr.outvars)]
            self.out_kinds = kinds
            outs = with_plain_weak_types(prog.closed_jaxpr.jaxpr.outvars, [
                o.data if isinstance(o, PerSegment) else jnp.asarray(o) for o in outs])
            if not speculative:
                return outs
            rare.make_deferred_checks()
            return outs + [rare.any()]

        return fn


# the identity a reader that reduces with this kind needs between examples
_IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf}

_PER_SIZE_REMEDY = ("(the packed layout needs one program for every size; layout='padded' or "
                    "'auto' runs this function with one trace per size, as jax.jit does, "
                    "where max_cases allows)")


def packed_program(fun: Callable, args: Sequence[Any], in_specs, constraints: Sequence[str],
                   n_broadcast: int, max_cases: int) -> PackedProgram:
    """Trace ``fun`` for the packed layout at ``args`` (broadcast arguments
    first, then one example's leaves padded to the row size along its ragged
    axis).

    Raises:
      PackedUnsupported: the function cannot run packed (more than one dim
        var, a size comparison that splits the trace, an error case, a
        ragged axis of another size than ``n``).
      ShapeError, UnsupportedError: as ``mask`` (bad specs).
    """
    try:
        tree, _ = trace_function_cases(fun, args, in_specs, constraints, max_cases)
    except TooManyCases as e:  # a case per size at a row's bound: not one program
        raise PackedUnsupported(
            "the function's trace takes a case per size or splits too often at the row's "
            f"bound, so no traced program serves several sizes:\n  {e.reason}\n  "
            f"{_PER_SIZE_REMEDY}") from e
    live = [c for c in tree.cases if c.program is not None]
    if not live:
        raise PackedUnsupported(f"the function raises at every size ({tree.summary()})")
    # the case most sizes reach (n >= 1 beside a case for n = 0): its sizes run
    # packed, the others padded (``PackedProgram.runs``)
    case = max(live, key=lambda c: len(c.reached_by or ()))
    if len(tree.cases) > 1 and case.reached_by is not None and len(case.reached_by) <= 1:
        raise PackedUnsupported(
            "the function's trace takes a case per size (a size used as a Python int or "
            "a branch on it), so no traced program serves several sizes: "
            f"{_split_points(tree)}\n  {_PER_SIZE_REMEDY}")
    prog = case.program
    if len(prog.var_order) != 1:
        raise PackedUnsupported(
            f"the packed layout packs one ragged axis; the specs name {len(prog.var_order)} "
            f"dim vars ({', '.join(prog.var_order)})")
    _refuse_host_calls(prog.closed_jaxpr.jaxpr)
    var = prog.var_order[0]
    R = int(prog.var_bounds[var])
    sizes = RaggedSizes(prog, var, range(R + 1) if case.reached_by is None else
                        [int(v[var]) for v in case.reached_by])
    gap = check_sizes(prog.closed_jaxpr.jaxpr, {prog.internal.get(var, (var, 0))[0]}, prog,
                       sizes)
    n = prog.spec_var_expr(var)
    packed_axes = []
    for axes in prog.axis_specs[n_broadcast:]:
        for a in axes:
            if a.var is not None and (a.coeff != 1 or a.offset != 0):
                raise PackedUnsupported(
                    f"the packed layout packs axes of size exactly '{var}'; {a.where} has "
                    f"size {_affine_text(a.coeff, var, a.offset)} (its spec)")
        packed_axes.append(tuple(i for i, a in enumerate(axes) if a.var is not None))
    for axes in prog.axis_specs[:n_broadcast]:
        if any(a.var is not None for a in axes):
            raise PackedUnsupported("a broadcast argument has a dim var")
    del n
    return PackedProgram(prog, var, int(prog.var_bounds[var]), packed_axes, tree=tree,
                         case_index=case.index, gap=gap, sizes=sizes)


def _affine_text(coeff: int, var: str, offset: int) -> str:
    """``coeff*var + offset`` as a spec writes it: ``t + 3``, ``2*t``, ``2*t - 1``."""
    text = var if coeff == 1 else f"{coeff}*{var}"
    return text if offset == 0 else f"{text} {'+' if offset > 0 else '-'} {abs(offset)}"


def _split_points(tree) -> str:
    """Where a case tree needs a size as a Python value (``tree.per_size_at``:
    ``len(x)``), else where it splits: the user's lines (library lines when
    no user line is known), each once. (A split beside a per-size use, a
    scatter's at n = 0, is not why every size is a case.)"""
    from ..core.diagnostics import is_library_frame

    lines = list(dict.fromkeys(at for at, _, _ in tree.per_size_at)) or list(
        dict.fromkeys(sp.where for sp in tree.splits()))
    user = [w for w in lines if not is_library_frame(w.split(":", 1)[0])]
    shown = (user or lines)[:3]
    return ("the size is used at " + "; ".join(shown)) if shown else "no split recorded"


def _refuse_host_calls(jaxpr) -> None:
    """Host callbacks and effects see rows, not examples: not packed (a
    callback, ``jax.debug.print`` among them, named with its line first)."""
    eqn = compat.host_call_in(jaxpr)  # cond branches too (equinox's error_if)
    if eqn is not None:
        raise PackedUnsupported(
            f"primitive '{eqn.primitive.name}' (used at "
            f"{compat.source_line(eqn.source_info)}) calls the host, which would see "
            "packed rows, not examples")
    if jaxpr.effects:
        what = ", ".join(sorted({type(e).__name__ for e in jaxpr.effects}))
        eqn = compat.effectful_eqn_in(jaxpr)
        at = (f": primitive '{eqn.primitive.name}' (used at "
              f"{compat.source_line(eqn.source_info)})" if eqn is not None else "")
        raise PackedUnsupported(f"the function has effects ({what}){at}; it would see "
                                "packed rows, not examples")


# re-exported for rules that need to refuse a case with the standard error
__all__ += ["PackedUnsupported", "ShapeError", "UnsupportedError"]
