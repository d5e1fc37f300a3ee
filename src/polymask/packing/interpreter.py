"""The packed interpreter: a traced jaxpr evaluated on one row of packed examples.

Like the masking interpreter (``tracing/interpreter.py``) it holds no
primitive-specific code: each equation that touches a packed axis goes to
its packed rule (``registry.py``, filled by ``rules/``); one that does not is
bound unchanged (shared operands) or ``vmap``-ed over the segment slots
(per-segment operands). After each equation, results with two or more
packed axes get their cross-segment entries selected to 0 (the
block-diagonal invariant every rule may assume).

``packed_program`` traces the user's function once (the symbolic trace of
``mask``, bound ``R``) and checks that it can run packed: one ragged dim var,
one case for every size, every axis of a ragged size exactly ``n``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_compat as compat
from ..core.diagnostics import relocate
from ..core.errors import ShapeError, TooManyCases, UnsupportedError
from ..core.shapes import DimEnv
from ..tracing.cases.splitting import trace_function_cases
from ..tracing.interpreter import walk_jaxpr
from ..tracing.registry import has_inner_jaxpr, substitute_dims
from ..tracing.symbolic import MaskedProgram
from .registry import PackedContext, PackedUnsupported, PerSegment, packed_rule
from .segments import Segments

__all__ = ["PackedRun", "PackedProgram", "packed_program"]


class PackedRun:
    """One evaluation of a program on one row: the ragged size ``n`` as a
    dimension expression, the row's ``Segments`` and the per-segment sizes."""

    def __init__(self, prog: MaskedProgram, var: str, seg: Segments, forward_only: bool,
                 observe: Callable | None = None):
        self.prog = prog
        self.var = var
        self.n = prog.spec_var_expr(var)
        self.seg = seg
        self.forward_only = forward_only
        # observe(eqn, how, outs): ``explain(layout="packed")`` records how each
        # equation ran (its packed rule, bound on shared values, or vmapped)
        self.observe = observe
        self._dims = DimEnv(prog.scope, prog.dim_bounds, prog.internal_values({var: seg.lengths}))

    def with_segments(self, arrays) -> PackedRun:
        """This run on other segment arrays (``Segments.arrays()``)."""
        return PackedRun(self.prog, self.var, Segments.from_arrays(arrays), self.forward_only,
                         self.observe)

    # -- sizes ------------------------------------------------------------------
    def is_n(self, d) -> bool:
        return compat.is_dim_expr(d) and _is(d, self.n)

    def size(self, d) -> int:
        """A size in a row: ``n`` is ``R``; a constant is itself."""
        if not compat.is_dim_expr(d):
            return int(d)
        if self.is_n(d):
            return self.seg.R
        raise PackedUnsupported(_not_n(self.prog, self.n, d))

    def packed_axes(self, aval) -> tuple[int, ...]:
        out = []
        for i, d in enumerate(getattr(aval, "shape", ())):
            if compat.is_dim_expr(d):
                self.size(d)  # raises for sizes other than n
                out.append(i)
        return tuple(out)

    def segment_size(self, d):
        return jnp.asarray(self._dims.logical(d), jnp.int32) * jnp.ones((self.seg.S,), jnp.int32)

    # -- evaluation ---------------------------------------------------------------
    def eval_closed(self, closed, args: list) -> list:
        return self.eval_jaxpr(closed.jaxpr, closed.consts, args)

    def eval_jaxpr(self, jaxpr, consts, args) -> list:
        return walk_jaxpr(jaxpr, consts, args, self._apply_at_user_line)

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
        try:
            if rule is not None and (touches or has_inner_jaxpr(eqn.params)):
                how = f"{rule.__module__.rsplit('.', 1)[-1]}.{rule.__qualname__}"
                out = rule(PackedContext(eqn, self, in_packed, out_packed), *invals,
                           **eqn.params)
            elif touches:
                raise PackedUnsupported(
                    f"the packed layout has no rule for primitive '{name}' "
                    f"(used at {compat.source_line(eqn.source_info)})")
            else:
                how = ("vmap over segments" if any(isinstance(x, PerSegment) for x in invals)
                       else "bound (shared)")
                out = _per_segment_or_shared(eqn, invals)
        except PackedUnsupported as e:
            raise relocate(e, compat.source_line(eqn.source_info)) from None
        outs = list(out) if eqn.primitive.multiple_results else [out]
        outs = [self._block_diagonal(o, v.aval, axes)
                for o, v, axes in zip(outs, eqn.outvars, out_packed)]
        if self.observe is not None:
            self.observe(eqn, how, outs)
        return outs

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

    def _block_diagonal(self, x, aval, axes):
        """Cross-segment entries of a value with 2+ packed axes selected to 0."""
        if len(axes) < 2 or isinstance(x, PerSegment):
            return x
        ok = self.seg.same_segment(axes, x.shape)
        return lax.select(ok, x, jnp.zeros_like(x))


def _params_have_dims(params) -> bool:
    found = []
    substitute_dims(dict(params), lambda d: found.append(d) or d)
    return bool(found)


def _per_segment_or_shared(eqn, invals):
    """An equation with no packed axis: bound as is when every operand is
    shared, else ``vmap``-ed over the segment slots (per-segment operands
    mapped, shared ones not): any primitive with a batching rule."""
    prim, params = eqn.primitive, eqn.params
    if not any(isinstance(x, PerSegment) for x in invals):
        return prim.bind(*invals, **params)
    axes = [0 if isinstance(x, PerSegment) else None for x in invals]
    datas = [x.data if isinstance(x, PerSegment) else x for x in invals]
    out = jax.vmap(lambda *a: prim.bind(*a, **params), in_axes=axes)(*datas)
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
    """

    program: MaskedProgram
    var: str
    row_size: int
    packed_axes: list[tuple[int, ...]]
    tree: Any = None  # the CaseTree: its other cases are errors of the plain function
    case_index: int = 0
    out_kinds: list[str] | None = None

    def runs(self, n: int) -> bool:
        """Whether size ``n`` reaches the traced program (else it runs in the
        padded layout, which also reports the sizes where plain JAX raises)."""
        if self.tree is None or self.tree.single:
            return True
        return int(self.tree.select(self.program.internal_values({self.var: int(n)}))) \
            == self.case_index

    @property
    def out_shapes(self):
        return self.program.out_shapes

    def row_fn(self, n_broadcast: int, forward_only: bool = True,
               observe: Callable | None = None) -> Callable:
        """``fn(*broadcast, *example_leaves, *segment_arrays) -> outputs`` for
        one row (``vmap`` it over rows). Example leaves are row data (packed
        axes of length R) or per-segment ``(S, ...)`` stacks. ``observe``:
        see ``PackedRun``."""
        prog, var = self.program, self.var

        def fn(*args):
            leaves, segs = args[:-6], Segments.from_arrays(args[-6:])
            run = PackedRun(prog, var, segs, forward_only, observe)
            wrapped = list(leaves[:n_broadcast])
            for x, axes in zip(leaves[n_broadcast:], self.packed_axes):
                wrapped.append(x if axes else PerSegment(x))
            outs = run.eval_closed(prog.closed_jaxpr, wrapped)
            kinds = ["segment" if isinstance(o, PerSegment) else
                     ("packed" if run.packed_axes(v.aval) else "shared")
                     for o, v in zip(outs, prog.closed_jaxpr.jaxpr.outvars)]
            self.out_kinds = kinds
            return [o.data if isinstance(o, PerSegment) else jnp.asarray(o) for o in outs]

        return fn


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
            "the function's trace takes a case per size (a size used as a Python int, "
            f"e.g. len(x) or range(n)) or splits too often at the row's bound:\n  {e}") from e
    live = [c for c in tree.cases if c.program is not None]
    if not live:
        raise PackedUnsupported(f"the function raises at every size ({tree.summary()})")
    # the case most sizes reach (n >= 1 beside a case for n = 0): its sizes run
    # packed, the others padded (``PackedProgram.runs``)
    case = max(live, key=lambda c: len(c.reached_by or ()))
    if len(tree.cases) > 1 and case.reached_by is not None and len(case.reached_by) <= 1:
        raise PackedUnsupported(
            "the function's trace takes a case per size (a size used as a Python int, "
            "e.g. len(x) or range(n)): no traced program serves several sizes")
    prog = case.program
    if len(prog.var_order) != 1:
        raise PackedUnsupported(
            f"the packed layout packs one ragged axis; the specs name {len(prog.var_order)} "
            f"dim vars ({', '.join(prog.var_order)})")
    _refuse_host_calls(prog.closed_jaxpr.jaxpr)
    var = prog.var_order[0]
    _refuse_other_sizes(prog.closed_jaxpr.jaxpr, {prog.internal.get(var, (var, 0))[0]}, prog,
                        prog.spec_var_expr(var))
    n = prog.spec_var_expr(var)
    packed_axes = []
    for axes in prog.axis_specs[n_broadcast:]:
        for a in axes:
            if a.var is not None and (a.coeff != 1 or a.offset != 0):
                raise PackedUnsupported(
                    f"the packed layout packs axes of size exactly '{var}'; {a.where} has "
                    f"size {a.coeff}*{var}+{a.offset}")
        packed_axes.append(tuple(i for i, a in enumerate(axes) if a.var is not None))
    for axes in prog.axis_specs[:n_broadcast]:
        if any(a.var is not None for a in axes):
            raise PackedUnsupported("a broadcast argument has a dim var")
    del n
    return PackedProgram(prog, var, int(prog.var_bounds[var]), packed_axes, tree=tree,
                         case_index=case.index)


def _refuse_other_sizes(jaxpr, allowed: set, prog, n, outer=(), line=None) -> None:
    """Every size along a ragged axis must be exactly ``n`` (checked before
    anything runs, so ``layout="auto"`` says why it pads): sizes of
    data-dependent dim vars (``nonzero``, boolean masks) differ per example
    inside a row, and sizes like ``n - 1`` have no packed rule yet. Inner
    jaxprs first: the innermost primitive is named."""
    for eqn in jaxpr.eqns:
        at = line or compat.source_line(eqn.source_info)  # the user's line: the outermost
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                _refuse_other_sizes(inner, allowed, prog, n, (*outer, eqn.primitive.name), at)
        where = "".join(f" inside {o!r}" for o in reversed(outer))
        for v in eqn.outvars:
            for d in getattr(v.aval, "shape", ()):
                if not compat.is_dim_expr(d):
                    continue
                if not compat.dim_vars(d) <= allowed:
                    raise PackedUnsupported(
                        f"primitive '{eqn.primitive.name}'{where} (used at {at}) has a "
                        f"data-dependent size "
                        f"{prog.display(str(d))}")
                if not _is(d, n):
                    raise PackedUnsupported(
                        f"primitive '{eqn.primitive.name}'{where} (used at {at}) cannot run "
                        f"packed: {_not_n(prog, n, d)}")


def _is(d, n) -> bool:
    """``d == n`` for dimension expressions (undecidable: not ``n``)."""
    try:
        return bool(d == n)
    except Exception:  # noqa: BLE001 - an undecidable comparison: not n
        return False


def _not_n(prog, n, d) -> str:
    return (f"the packed layout needs every size along the ragged axis to be exactly "
            f"{prog.display(str(n))}; this program has a size {prog.display(str(d))}")


def _refuse_host_calls(jaxpr) -> None:
    """Host callbacks and effects see rows, not examples: not packed."""
    if jaxpr.effects:
        raise PackedUnsupported(f"the function has effects ({jaxpr.effects}): host calls "
                                "would see packed rows, not examples")
    for eqn in jaxpr.eqns:
        if "callback" in eqn.primitive.name:
            raise PackedUnsupported(
                f"primitive '{eqn.primitive.name}' (used at "
                f"{compat.source_line(eqn.source_info)}) calls the host, which would see "
                "packed rows, not examples")
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                _refuse_host_calls(inner)


# re-exported for rules that need to refuse a case with the standard error
__all__ += ["PackedUnsupported", "ShapeError", "UnsupportedError"]
