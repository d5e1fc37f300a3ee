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

import collections
from collections.abc import Callable, Sequence
from typing import Any

from ... import _jax_compat as compat
from ...core.diagnostics import user_frame_of_exception
from ...core.dimvars import display_text, pretty_condition
from ...core.errors import (
    FailsAsPlainJax,
    ShapeError,
    SpecError,
    TooManyCases,
    UnsupportedError,
)
from ...core.shapes import SHIFT_SUFFIX
from ...core.trace_state import replaced, trace_state
from ..symbolic import CountCheck, MaskedProgram, NoSizeMeets, flatten_args, trace
from .refine import refine_errors, trace_per_size_or_raise
from .tree import (
    Case,
    CaseTree,
    Split,
    common_outputs,
    enumerate_sizes,
    error_case,
    fails_in_plain_jax,
    splits_under,
    vars_compared_equal_to_constants,
)

__all__ = ["Case", "Split", "CaseTree", "trace_cases", "trace_function_cases",
           "explore_splits", "DEFAULT_MAX_CASES"]

DEFAULT_MAX_CASES = 16


def _internal_of(cond) -> dict[str, tuple[str, int]]:
    """Display map for the internal dim vars in ``cond`` (``n__p1`` -> ``n``)."""
    out = {}
    for name in compat.dim_vars(cond):
        if name.endswith(SHIFT_SUFFIX):
            out[name[:-len(SHIFT_SUFFIX)]] = (name, 1)
    return out


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
    # (a runner's request, for this trace only: not for a masked call inside it)
    per_shape = trace_state().per_size_per_shape
    with replaced("per_size_per_shape", False):
        root, cases, first = explore_splits(trace_one, max_cases)
        if all(c.empty for c in cases):  # (the root splits, and no size meets either side)
            raise SpecError("no sizes within the bounds meet the constraints: every case of "
                            "the function's size comparisons is empty")
        if "prog" not in first:
            return trace_per_size_or_raise(root, cases, first, trace_one, max_cases,
                                           explore_splits, per_shape)
    base = first["prog"]
    tree = CaseTree(root, cases, base.internal, base, max_cases=max_cases)
    if not tree.single:
        enumerate_sizes(tree)
        live = [c for c in cases if c.program is not None and c.reachable]
        if not live:
            err = next(c for c in cases if c.error is not None and c.reachable)
            raise FailsAsPlainJax(
                f"the function fails for every logical size within the bounds: "
                f"{err.error}\n  (for {tree.describe_conditions(err)}, at {err.where})")
        if refine_errors(tree, trace_one, max_cases, explore_splits):
            live = [c for c in tree.cases if c.program is not None and c.reachable]
        tree.base = live[0].program
        common_outputs(tree, live)
    return tree


def explore_splits(trace_one: Callable[[tuple[str, ...]], MaskedProgram], max_cases: int):
    """``(root, cases, first)``: the split tree of ``trace_one``'s undecidable size
    comparisons, leaves traced (programs or error cases), not yet refined per
    size. ``first`` holds the first program (``"prog"``), the root's error
    (``"root_error"``) and a failed trace's ``SizeSignature``."""
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
        except NoSizeMeets:
            cases.append(Case(len(cases), conditions, reached_by=[], empty=True))
            return cases[-1]
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
            case = error_case(len(cases), conditions, e,
                               first.get("internal") or getattr(signature, "internal", None))
            cases.append(case)
            return case
        if split is not None:
            text = display_text(str(split).replace("Symbolic dimension comparison ", "")
                                .replace(" is inconclusive.", ""), _internal_of(split.cond))
            where = getattr(split, "polymask_where", None) or user_frame_of_exception(split)
            if {f"{split.cond} >= 0", f"{split.cond} <= -1"} & set(conditions):
                raise ShapeError(  # JAX's decision procedure cannot use the condition
                    f"cannot decide the size comparison {text} at {where} even for one "
                    "outcome of it; state what you know as constraints "
                    "(mask(..., constraints=['n >= 3']))")
            node = Split(split.cond, text, where)
            if compat.names_a_count(split.cond):
                empty = _count_to_split_on_first(split.cond, conditions)
                if empty is not None:  # (its emptiness first: then the comparison again)
                    node = Split(empty - 1, f"'{empty}' >= '1'", where)
                return explore_count_split(conditions, node, getattr(split, "only_yes", False))
            splits.append(node)
            node.yes = explore(conditions + (f"{split.cond} >= 0",))
            node.no = explore(conditions + (f"{split.cond} <= -1",))
            return node
        first.setdefault("prog", prog)
        first.setdefault("internal", prog.internal)
        case = Case(len(cases), conditions, program=prog)
        cases.append(case)
        return case

    def explore_count_split(conditions: tuple[str, ...], node: Split, only_yes: bool = False):
        """A comparison of a data-dependent size (``_u1 - 2``): both outcomes
        traced, and where plain JAX fails on one of them (``lax.top_k(s, 2)``
        where ``s`` has fewer than 2 entries), the other one kept with a
        run-time check of its condition that raises the failing side's error.
        Where both outcomes run, both are kept under the split: at run time
        the count, computed first, chooses (``dispatch.count_values``)."""
        start, n_splits = len(cases), len(splits)
        sides = []
        for holds in (">= 0", "<= -1"):
            first_case = len(cases)
            if holds == "<= -1" and only_yes:  # (the split proves shapes equal above)
                holds_at = pretty_condition(f"{node.cond} >= 0", first.get("internal") or {})
                e = ShapeError(f"JAX proves these shapes equal only where {holds_at}")
                e.polymask_where = node.where
                cases.append(error_case(first_case, conditions, e, first.get("internal")))
                root = cases[-1]
            else:
                root = explore(conditions + (f"{node.cond} {holds}",))
            sides.append((holds, root, cases[first_case:]))
        runs = [any(c.program is not None for c in side[2]) for side in sides]
        if all(runs) and _counts_made_at_top_level(sides[0][2], node):
            # both kept: the count, computed first, chooses while the program runs
            node.yes, node.no = sides[0][1], sides[1][1]
            splits.insert(n_splits, node)
            _first_program_kept(first, cases)
            return node
        if all(runs):  # a count made inside a loop or branch: not known beforehand
            if not _on_emptiness(node):
                del cases[start:], splits[n_splits:]
                e = compat.InconclusiveDimensionOperation(
                    f"Symbolic dimension comparison {node.text} is inconclusive: the "
                    "data-dependent size is computed inside a loop or a branch.")
                e.polymask_where = node.where
                cases.append(error_case(start, conditions, e, first.get("internal")))
                return cases[-1]
            # a count's emptiness: the side >= 1 alone, a count of 0 refused
            # while it runs (``MaskedProgram.assumed_nonempty``), as JAX traces it
            _, root, kept = sides[0]
            _keep(cases, start, kept, splits, n_splits, root, first)
            for c in kept:
                if c.program is not None:
                    c.program.assumed_nonempty.update(dict.fromkeys(node.counts(), node.where))
            return root
        (holds, root, kept), (_, _, dropped) = sides if not runs[1] else sides[::-1]
        if not any(runs):  # fails at every count: one error case says it
            root, kept = kept[0], kept[:1]
        _keep(cases, start, kept, splits, n_splits, root, first)
        check = CountCheck.of(f"{node.cond} {holds}", node.text, node.where, dropped[0],
                              fails_in_plain_jax(dropped[0]))
        for c in kept:
            if c.program is not None:
                c.program.count_checks += (check,)
                _count_pinned_to_one(c.program, check, node.where)
        return root

    return explore(()), cases, first


def _count_to_split_on_first(cond, conditions: tuple[str, ...]):
    """A count of ``cond`` whose emptiness the trace splits on before ``cond``
    (its dim var), or None. A comparison of a count with another size
    (``a.shape[0] + b.shape[0] > 4``) narrows the count's bounds on JAX's
    assumption that the other is >= 1 (``_u1 <= 3``): a count of 4 beside an
    empty ``b`` would be cut to 3 entries. Past a split on each count's
    emptiness that assumption holds, or the count is the constant 0."""
    names = compat.dim_vars(cond)
    if len(names) < 2:
        return None
    for v in sorted(n for n in names if compat.is_fresh_dim_name(n)):
        if f"{v} - 1 >= 0" not in conditions:
            return compat.fresh_dim(v, cond.scope)
    return None


def _keep(cases: list[Case], start: int, kept: list[Case], splits: list[Split], n_splits: int,
          root, first: dict) -> None:
    """One side of a split on a count kept in place of both (its cases and splits)."""
    cases[start:] = kept
    for i, c in enumerate(cases):
        c.index = i
    splits[n_splits:] = splits_under(root)
    _first_program_kept(first, cases)


def _on_emptiness(node: Split) -> bool:
    """A split on whether a count is 0 (``_u1 - 1``, ``_jax_compat._note_nonempty``)."""
    (count,) = node.counts() or ("",)
    return str(node.cond) == f"{count} - 1"


_CALLS = ("jit", "pjit", "closed_call", "eval_jaxpr")  # evaluated inline (rules/control_flow)


def _counts_made_at_top_level(side: list[Case], node: Split) -> bool:
    """Whether the programs of ``side`` compute the counts ``node`` compares
    outside any loop, branch or custom derivative (``dispatch.count_values``
    reads them from a run of the program, before choosing a side)."""
    for c in side:
        if c.program is not None:
            return node.counts() <= _counts_made(c.program.closed_jaxpr.jaxpr)
    return False


def _counts_made(jaxpr) -> set[str]:
    made: set[str] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _CALLS:
            inner = eqn.params.get("jaxpr") or compat.call_jaxpr_of(eqn.params)
            made |= _counts_made(getattr(inner, "jaxpr", inner))
            continue
        for p in eqn.params.values():
            for d in (p if isinstance(p, (tuple, list)) else (p,)):
                if compat.is_dim_expr(d):
                    made |= {v for v in compat.dim_vars(d) if compat.is_fresh_dim_name(v)}
    return made


def _first_program_kept(first: dict, cases: list[Case]) -> None:
    """``first["prog"]`` (a tree of one case runs it) among the cases kept."""
    live = [c.program for c in cases if c.program is not None]
    if live:
        first["prog"] = live[0]
    else:
        first.pop("prog", None)


def _count_pinned_to_one(prog: MaskedProgram, check: CountCheck, where: str) -> None:
    """A count the condition leaves 0 or 1 (``if sel.shape[0] >= 2: raise``):
    JAX, which assumes every dim var >= 1, traced it as the constant 1 (``s +
    ones(3)`` broadcasts), so a count of 0 must not run the program
    (``MaskedProgram.assumed_nonempty``, checked at run time)."""
    for v in check.counts:
        if compat.upper_bound(compat.fresh_dim(v, prog.scope)) <= 1:
            prog.assumed_nonempty.setdefault(v, where)


def trace_function_cases(fun: Callable, args: Sequence[Any], in_specs=None,
                         constraints: Sequence[str] = (),
                         max_cases: int = DEFAULT_MAX_CASES) -> tuple[CaseTree, list]:
    """``trace_cases`` of ``fun`` at the padded signature of ``args``: ``(tree, leaves)``."""
    tree = trace_cases(lambda conditions: trace(fun, args, in_specs, constraints, conditions)[0],
                       max_cases)
    return tree, flatten_args(args)[0]


def _too_many(splits: list[Split], max_cases: int, internal) -> ShapeError:
    seen = collections.Counter((s.text, s.where) for s in splits)  # (once each, in order)
    comps = "\n".join(f"  {text} at {where}" + (f" ({k} times)" if k > 1 else "")
                      for (text, where), k in seen.items())
    return TooManyCases(
        f"tracing needs more than max_cases={max_cases} cases: the size comparisons that "
        f"JAX cannot decide are\n{comps}\n  State what you know as constraints "
        "(mask(..., constraints=['n >= 3'])) or raise max_cases.",
        fixed_size_vars=vars_compared_equal_to_constants(splits))


