"""Case splits: one masked program per outcome of an undecidable size comparison.

While a function is traced, a comparison of sizes that JAX cannot decide (a
Python ``if`` on a size, ``lax.cond`` on a size predicate, ``top_k``'s
``k <= n``, a ``dynamic_slice`` window, ``x.shape[0] == 1`` inside JAX's det
...) raises ``SplitNeeded(e)`` (``_jax_compat.trace_hooks``). ``trace_cases``
then traces again with ``e >= 0`` and with ``e <= -1`` added to the scope,
where JAX's decision procedure decides it, and so on: the result is a small
decision tree (``CaseTree``) whose leaves are masked programs, or *error
cases* where the plain function itself fails (``top_k`` with ``k > n``).

At run time the logical sizes choose the leaf: in Python when they are
concrete, with ``lax.switch`` when they are traced (under ``jax.jit``; under
``jax.vmap`` the switch becomes a select per example). Every leaf's outputs
are padded to the largest padded shape over the leaves. An error case raises
a ``ShapeError`` through the prologue's checks (eagerly, or at run time inside
``jit``/``vmap``), never a value.

A function without undecidable comparisons has one leaf and runs exactly as
before (no switch).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_compat as compat
from .diagnostics import user_frame_of_exception
from .dimvars import describe_conditions, display_text, pretty_condition, sizes_text
from .errors import ShapeError, UnsupportedError
from .shapes import SHIFT_SUFFIX, DimEnv, is_static
from .trace import MaskedProgram, flatten_args, trace

__all__ = ["Case", "Split", "CaseTree", "trace_cases", "trace_function_cases",
           "DEFAULT_MAX_CASES"]

DEFAULT_MAX_CASES = 16
_ENUMERATE_LIMIT = 4096  # largest number of size combinations enumerated per tree


@dataclasses.dataclass
class Case:
    """One leaf: a program, or an error of the plain function under ``conditions``."""

    index: int
    conditions: tuple[str, ...]
    program: MaskedProgram | None = None
    error: str | None = None
    where: str = ""
    reached_by: list[dict[str, int]] | None = None  # None: not enumerated

    @property
    def one_size(self) -> bool:
        """Reached by one combination of sizes only (an error there is plain JAX's)."""
        return self.reached_by is not None and len(self.reached_by) == 1

    @property
    def reachable(self) -> bool:
        return self.reached_by is None or bool(self.reached_by)


@dataclasses.dataclass
class Split:
    """An inner node: ``cond >= 0`` goes to ``yes``, else to ``no``."""

    cond: Any
    text: str  # the comparison as JAX reported it (spec dim vars)
    where: str  # the user's line
    yes: Any = None
    no: Any = None


@dataclasses.dataclass
class CaseTree:
    """The decision tree of one padded signature."""

    root: Any
    cases: list[Case]
    internal: dict[str, tuple[str, int]]
    base: MaskedProgram  # a traced program: specs, bounds and prologue checks
    out_tree: Any = None
    out_bounds: list[tuple[int, ...]] = dataclasses.field(default_factory=list)

    @property
    def single(self) -> bool:
        return isinstance(self.root, Case)

    def display(self, text: str) -> str:
        return display_text(text, self.internal)

    def describe_conditions(self, case: Case) -> str:
        if not case.conditions:
            return "all sizes"
        return describe_conditions(case.conditions, self.internal)

    def explain_header(self, shown_program: MaskedProgram | None = None) -> str:
        """``polymask.explain``'s lines about the cases (empty for one case); the
        trace shown is ``shown_program``'s (default: the first live case)."""
        if self.single:
            return ""
        prog = shown_program or self.base
        shown = next(c.index for c in self.cases if c.program is prog)
        return ("\ncases (a size comparison JAX cannot decide; the sizes choose one at run "
                f"time; the trace below is case {shown}):\n"
                + "\n".join("  " + ln for ln in self.summary().splitlines()))

    def splits(self) -> list[Split]:
        out, todo = [], [self.root]
        while todo:
            node = todo.pop()
            if isinstance(node, Split):
                out.append(node)
                todo += [node.no, node.yes]
        return out

    def summary(self) -> str:
        """The decision tree in words: each comparison and each case."""
        lines = []

        def walk(node, depth):
            pad = "  " * depth
            if isinstance(node, Split):
                lines.append(f"{pad}if {pretty_condition(f'{node.cond} >= 0', self.internal)}   "
                             f"[{node.text} at {node.where}]")
                walk(node.yes, depth + 1)
                lines.append(f"{pad}else")
                walk(node.no, depth + 1)
                return
            what = (f"error: {node.error.splitlines()[0]}" if node.error is not None
                    else "outputs " + ", ".join(
                        "(" + ", ".join(self.display(str(d)) for d in s) + ")"
                        for s in node.program.out_shapes))
            sizes = ""
            if node.reached_by is not None:
                sizes = "; sizes " + (sizes_text(node.reached_by) if node.reached_by
                                      else "none (unreachable)")
            lines.append(f"{pad}case {node.index}: {what}{sizes}")

        walk(self.root, 0)
        return "\n".join(lines)

    # -- run time -------------------------------------------------------------
    def select(self, values: dict[str, Any]):
        """The case index for internal dim var values (an int or an int32 tracer)."""
        env = DimEnv(self.base.scope, self.base.dim_bounds, values)

        def walk(node):
            if isinstance(node, Case):
                return node.index
            v = env.logical_raw(node.cond)
            if is_static(v):
                return walk(node.yes) if int(v) >= 0 else walk(node.no)
            return jnp.where(v >= 0, walk(node.yes), walk(node.no))

        out = walk(self.root)
        return out if is_static(out) else jnp.asarray(out, jnp.int32)


def _internal_of(cond) -> dict[str, tuple[str, int]]:
    """Display map for the internal dim vars in ``cond`` (``n__p1`` -> ``n``)."""
    out = {}
    for name in compat.dim_vars(cond):
        if name.endswith(SHIFT_SUFFIX):
            out[name[:-len(SHIFT_SUFFIX)]] = (name, 1)
    return out


def _error_text(e: BaseException, internal) -> str:
    text = str(e).strip() or type(e).__name__
    if not isinstance(e, ShapeError):
        text = f"{type(e).__name__}: {text.split(chr(10) + chr(10))[0]}"
    return display_text(text, internal or {})


def trace_cases(trace_one: Callable[[tuple[str, ...]], MaskedProgram],
                max_cases: int = DEFAULT_MAX_CASES) -> CaseTree:
    """Trace a function once per case, splitting on undecidable size comparisons.

    ``trace_one(conditions)`` traces it at one padded signature with the case's
    conditions added to the scope (``trace.trace_flat``); it raises
    ``SplitNeeded`` at a comparison JAX cannot decide.

    Raises:
      ShapeError: as ``trace``; when more than ``max_cases`` cases are needed;
        when every reachable case is an error of the plain function (its
        error); when the cases' outputs differ in structure, dtype or rank.
      UnsupportedError: as ``trace``.
    """
    cases: list[Case] = []
    splits: list[Split] = []
    first: dict[str, Any] = {}

    def explore(conditions: tuple[str, ...]):
        if len(cases) >= max_cases:
            raise _too_many(splits, max_cases, first.get("internal", {}))
        split = None
        try:
            prog = trace_one(conditions)
        except UnsupportedError:
            raise
        except (compat.SplitNeeded, compat.SplitBeforeRaise) as s:
            split = s  # traced below, outside this handler (no exception context)
        except Exception as e:
            signature = getattr(e, "polymask_signature", None)
            if not conditions:
                if signature is None:
                    raise
                first["root_error"] = e  # raised again unless a trace per size works
            if signature is not None:
                first.setdefault("signature", signature)
            case = _error_case(len(cases), conditions, e,
                               first.get("internal") or getattr(signature, "internal", None))
            cases.append(case)
            return case
        if split is not None:
            text = display_text(str(split).replace("Symbolic dimension comparison ", "")
                                .replace(" is inconclusive.", ""), _internal_of(split.cond))
            where = user_frame_of_exception(split)
            if {f"{split.cond} >= 0", f"{split.cond} <= -1"} & set(conditions):
                raise ShapeError(  # JAX's decision procedure cannot use the condition
                    f"cannot decide the size comparison {text} at {where} even for one "
                    "outcome of it; state what you know as constraints "
                    "(mask(..., constraints=['n >= 3']))")
            node = Split(split.cond, text, where)
            splits.append(node)
            node.yes = explore(conditions + (f"{split.cond} >= 0",))
            node.no = explore(conditions + (f"{split.cond} <= -1",))
            return node
        first.setdefault("prog", prog)
        first.setdefault("internal", prog.internal)
        case = Case(len(cases), conditions, program=prog)
        cases.append(case)
        return case

    root = explore(())
    if "prog" not in first:
        return _trace_per_size_or_raise(root, cases, first, trace_one, max_cases)
    base = first["prog"]
    tree = CaseTree(root, cases, base.internal, base)
    if not tree.single:
        _enumerate(tree)
        live = [c for c in cases if c.program is not None and c.reachable]
        if not live:
            err = next(c for c in cases if c.error is not None and c.reachable)
            raise ShapeError(
                f"the function fails for every logical size within the bounds: "
                f"{err.error}\n  (for {tree.describe_conditions(err)}, at {err.where})")
        if _refine_errors(tree, trace_one, max_cases):
            live = [c for c in tree.cases if c.program is not None and c.reachable]
        tree.base = live[0].program
        _common_outputs(tree, live)
    return tree


def _trace_per_size_or_raise(root, cases: list[Case], first: dict, trace_one,
                             max_cases: int) -> CaseTree:
    """Every case failed: trace once per size (``_refine_errors``) when the
    sizes are few, else raise the first error (``jnp.pad(mode="wrap")`` fails
    symbolically at every size but works at each concrete one)."""
    signature = first.get("signature")
    if signature is not None:
        tree = CaseTree(root, cases, signature.internal, signature)
        _enumerate(tree)
        if _refine_errors(tree, trace_one, max_cases):
            live = [c for c in tree.cases if c.program is not None and c.reachable]
            if live:
                tree.base = live[0].program
                _common_outputs(tree, live)
                return tree
    if "root_error" in first:
        raise first["root_error"]
    err = next(c for c in cases if c.error is not None)
    raise ShapeError(f"the function fails for every size:\n  {err.error}")


def _error_case(index: int, conditions, e: BaseException, internal) -> Case:
    where = getattr(e, "polymask_where", None) or user_frame_of_exception(e)
    return Case(index, conditions, error=_error_text(e, internal), where=where)


def _refine_errors(tree: CaseTree, trace_one, max_cases: int) -> bool:
    """Trace an error case reached by several size combinations once per combination.

    The symbolic trace of a case can fail where JAX needs a concrete size
    (``jnp.pad(mode="wrap")`` computes ``n % k`` in Python). Pinned to one size
    of every dim var, the trace is plain JAX's own: it works where plain JAX
    works and fails where plain JAX fails. Done while the total stays within
    ``max_cases``.
    """
    base = tree.base
    names = list(base.var_order)
    # fresh scopes: the base program's may pin a var to one value
    var_exprs = []
    for v in names:
        name, off = base.internal[v]
        (e,) = jax.export.symbolic_shape(name, scope=jax.export.SymbolicScope(
            (f"{name} <= {base.var_bounds[v] + off}",)))
        var_exprs.append(e - off)
    changed = False
    for case in list(tree.cases):
        if case.error is None or not case.reached_by or case.one_size:
            continue
        combos = sorted(tuple(a[v] for v in names) for a in case.reached_by)
        if len(tree.cases) + len(combos) - 1 > max_cases:
            continue
        leaves = {}
        for combo in combos:
            conditions = ()
            for v, a in zip(names, combo):
                name, off = base.internal[v]
                conditions += (f"{name} - {a + off} >= 0", f"- {name} + {a + off} >= 0")
            try:
                leaves[combo] = Case(0, conditions, program=trace_one(conditions))
            except UnsupportedError:
                raise
            except Exception as e:
                leaves[combo] = _error_case(0, conditions, e, tree.internal)
        _replace(tree, case, _dispatch(combos, names, var_exprs, leaves, case.where))
        changed = True
    if changed:
        tree.cases = _leaves_in_order(tree.root)
        for i, c in enumerate(tree.cases):
            c.index = i
        _enumerate(tree)
    return changed


def _dispatch(combos, names, var_exprs, leaves, where):
    """Threshold splits that send each of ``combos`` (only these reach here) to its leaf."""
    if len(combos) == 1:
        return leaves[combos[0]]
    j = next(j for j in range(len(names)) if len({c[j] for c in combos}) > 1)
    values = sorted({c[j] for c in combos})
    node = _dispatch([c for c in combos if c[j] == values[0]], names, var_exprs, leaves, where)
    for a in values[1:]:
        yes = _dispatch([c for c in combos if c[j] == a], names, var_exprs, leaves, where)
        node = Split(var_exprs[j] - a, f"'{names[j]}' >= {a}", where, yes=yes, no=node)
    return node


def _replace(tree: CaseTree, old, new) -> None:
    if tree.root is old:
        tree.root = new
        return
    todo = [tree.root]
    while todo:
        node = todo.pop()
        if isinstance(node, Split):
            if node.yes is old:
                node.yes = new
            if node.no is old:
                node.no = new
            todo += [node.yes, node.no]


def _leaves_in_order(node) -> list[Case]:
    if isinstance(node, Case):
        return [node]
    return _leaves_in_order(node.yes) + _leaves_in_order(node.no)


def trace_function_cases(fun: Callable, args: Sequence[Any], in_specs=None,
                         constraints: Sequence[str] = (),
                         max_cases: int = DEFAULT_MAX_CASES) -> tuple[CaseTree, list]:
    """``trace_cases`` of ``fun`` at the padded signature of ``args``: ``(tree, leaves)``."""
    tree = trace_cases(lambda conditions: trace(fun, args, in_specs, constraints, conditions)[0],
                       max_cases)
    return tree, flatten_args(args)[0]


def _too_many(splits: list[Split], max_cases: int, internal) -> ShapeError:
    comps = "\n".join(f"  {s.text} at {s.where}" for s in splits)
    return ShapeError(
        f"tracing needs more than max_cases={max_cases} cases: the size comparisons that "
        f"JAX cannot decide are\n{comps}\n  State what you know as constraints "
        "(mask(..., constraints=['n >= 3'])) or raise max_cases.")


def _enumerate(tree: CaseTree) -> None:
    """Which spec sizes reach each case (when the bounds allow few combinations)."""
    base = tree.base
    names = list(base.var_order)
    sizes = [range(base.var_bounds[v] + 1) for v in names]
    if not names or np.prod([len(r) for r in sizes]) > _ENUMERATE_LIMIT:
        return
    for c in tree.cases:
        c.reached_by = []
    for combo in itertools.product(*sizes):
        values = dict(zip(names, combo))
        idx = tree.select(base.internal_values(values))
        tree.cases[int(idx)].reached_by.append(values)


def _common_outputs(tree: CaseTree, live: list[Case]) -> None:
    """Check the cases agree on outputs; the padded shape is the max over cases."""
    ref = live[0].program
    bounds = [list(b) for b in ref.out_bounds()]
    dtypes = [v.aval.dtype for v in ref.closed_jaxpr.jaxpr.outvars]
    for c in live[1:]:
        p = c.program
        if p.out_tree != ref.out_tree:
            raise ShapeError(
                f"the cases of a size comparison return different output structures: "
                f"{ref.out_tree} for {tree.describe_conditions(live[0])} and {p.out_tree} for "
                f"{tree.describe_conditions(c)}; every case must return the same pytree")
        for i, (v, b) in enumerate(zip(p.closed_jaxpr.jaxpr.outvars, p.out_bounds())):
            if v.aval.dtype != dtypes[i] or len(b) != len(bounds[i]):
                raise ShapeError(
                    f"the cases of a size comparison return different outputs: output {i} "
                    f"is {dtypes[i]}[rank {len(bounds[i])}] for "
                    f"{tree.describe_conditions(live[0])} but {v.aval.dtype}[rank {len(b)}] "
                    f"for {tree.describe_conditions(c)}")
            bounds[i] = [max(x, y) for x, y in zip(bounds[i], b)]
    tree.out_tree = ref.out_tree
    tree.out_bounds = [tuple(b) for b in bounds]
