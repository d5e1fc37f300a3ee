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
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _jax_compat as compat
from .diagnostics import user_frame_of_exception
from .dimvars import display_text
from .errors import ShapeError, UnsupportedError
from .masked import Masked
from .prologue import Check, concrete_value, run_checks
from .shapes import SHIFT_SUFFIX, DimEnv, is_static
from .trace import MaskedProgram, flatten_args, trace

__all__ = ["Case", "Split", "CaseTree", "trace_cases", "trace_function_cases", "run_cases",
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
        return " and ".join(pretty_condition(c, self.internal) for c in case.conditions)

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
                sizes = "; sizes " + (_sizes_text(node.reached_by) if node.reached_by
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


def pretty_condition(text: str, internal) -> str:
    """``"n__p1 - 3 <= -1"`` -> ``"n <= 1"`` (other forms: the expression as is)."""
    expr, op, rhs = text.rpartition(" >= ")[0] or text.rpartition(" <= ")[0], \
        (">=" if " >= " in text else "<="), text.rsplit(" ", 1)[1]
    shown = display_text(expr, internal)
    m = re.fullmatch(r"(- )?(\w+)(?: ([+-]) (\d+))?", shown)
    if not m:
        return f"{shown} {op} {rhs}"
    neg, var = bool(m.group(1)), m.group(2)
    c = int(m.group(4) or 0) * (-1 if m.group(3) == "-" else 1)
    bound = int(rhs) - c  # (+/-) var op bound
    if neg:
        return f"{var} {'<=' if op == '>=' else '>='} {-bound}"
    return f"{var} {op} {bound}"


def _sizes_text(assignments: list[dict[str, int]]) -> str:
    names = sorted(assignments[0])
    if len(names) == 1:
        vals = sorted(a[names[0]] for a in assignments)
        return f"{names[0]} in {_ranges(vals)}"
    shown = ", ".join("(" + ", ".join(f"{k}={a[k]}" for k in names) + ")"
                      for a in assignments[:6])
    return shown + (f", ... ({len(assignments)} in all)" if len(assignments) > 6 else "")


def _ranges(vals: list[int]) -> str:
    parts, start = [], None
    for i, v in enumerate(vals):
        if start is None:
            start = v
        if i + 1 == len(vals) or vals[i + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}..{v}")
            start = None
    return "{" + ", ".join(parts) + "}"


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
        except compat.SplitNeeded as s:
            split = s  # traced below, outside this handler (no exception context)
        except Exception as e:
            if not conditions:
                raise
            case = Case(len(cases), conditions, error=_error_text(e, first.get("internal")),
                        where=user_frame_of_exception(e))
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
        err = next(c for c in cases if c.error is not None)
        raise ShapeError(f"the function fails for every size:\n  {err.error}")
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
        tree.base = live[0].program
        _common_outputs(tree, live)
    return tree


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


def _pad_to(data, shape):
    data = jnp.asarray(data)
    if tuple(data.shape) == tuple(shape):
        return data
    return jnp.pad(data, [(0, t - s) for s, t in zip(data.shape, shape)])


def _error_message(tree: CaseTree, c: Case) -> str:
    return (f"for these sizes ({tree.describe_conditions(c)}) the function fails at "
            f"{c.where}:\n  {c.error}")


def _error_checks(tree: CaseTree, idx) -> list[Check]:
    return [Check(idx == c.index, _error_message(tree, c)) for c in tree.cases
            if c.error is not None and c.reachable]


def host_error(tree: CaseTree, values: dict[str, int]) -> str | None:
    """The error of the case that concrete spec dim var ``values`` choose (None: no error)."""
    if tree.single or all(c.error is None for c in tree.cases):
        return None
    case = tree.cases[int(tree.select(tree.base.internal_values(values)))]
    return None if case.error is None else _error_message(tree, case)


def run_cases(tree: CaseTree, leaves, values: dict, call_site: str,
              run_program: Callable, checks_on: bool = True) -> list[Masked]:
    """Run the case the logical sizes select (see the module doc).

    ``checks_on=False`` (``mask(..., checks=False)``; ``polymask.jit`` checks
    on the host instead, ``programs.raise_case_error``): sizes of an error case
    are not checked in the program.
    """
    idx = tree.select(values)
    if checks_on or concrete_value(idx) is not None:
        run_checks(_error_checks(tree, idx), call_site)
    if concrete_value(idx) is not None:
        case = tree.cases[int(np.asarray(idx))]
        outs = run_program(case.program, leaves, values)
        return [Masked(_pad_to(o.data, b), o.shape) for o, b in zip(outs, tree.out_bounds)]

    def branch(case: Case):
        def run():
            if case.program is None or not case.reachable:
                datas = [jnp.zeros(b, v.aval.dtype) for b, v in
                         zip(tree.out_bounds, tree.base.closed_jaxpr.jaxpr.outvars)]
                return datas, [[jnp.int32(0)] * len(b) for b in tree.out_bounds]
            outs = run_program(case.program, leaves, values)
            return ([_pad_to(o.data, b) for o, b in zip(outs, tree.out_bounds)],
                    [[jnp.asarray(s, jnp.int32) for s in o.shape] for o in outs])
        return run

    datas, sizes = lax.switch(jnp.clip(idx, 0, len(tree.cases) - 1),
                              [branch(c) for c in tree.cases])
    static = _static_out_sizes(tree)
    return [Masked(d, tuple(st if st is not None else s for s, st in zip(ss, sts)))
            for d, ss, sts in zip(datas, sizes, static)]


def _static_out_sizes(tree: CaseTree) -> list[list[int | None]]:
    """Per output axis, its size when it is the same int in every live case (else None):
    such an axis stays a Python int, as in a single-case program."""
    live = [c.program for c in tree.cases if c.program is not None and c.reachable]
    out = []
    for i, bound in enumerate(tree.out_bounds):
        axes = []
        for k in range(len(bound)):
            sizes = {None if compat.is_dim_expr(d) else int(d)
                     for d in (p.out_shapes[i][k] for p in live)}
            axes.append(sizes.pop() if len(sizes) == 1 else None)
        out.append(axes)
    return out


def as_jax_tree(tree: CaseTree, outs: list[Masked]):
    return jax.tree_util.tree_unflatten(tree.out_tree, outs)
