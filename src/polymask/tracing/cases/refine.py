"""Error cases traced once per size: plain JAX's own trace at each size.

A case can fail only because its sizes are symbolic (``jnp.pad(mode="wrap")``
computes ``n % k`` in Python, ``int(x.shape[0])``). When the sizes reaching it
are few (within ``max_cases``), each is traced pinned to one value: that trace
is plain JAX's, so it works where plain JAX works and fails where plain JAX
fails (``cases.trace_cases`` calls these).
"""

from __future__ import annotations

import itertools
import re

import jax

from ... import _jax_compat as compat
from ...core.diagnostics import INCOMPATIBLE_SHAPES, user_line_of_exception
from ...core.dimvars import sizes_text
from ...core.errors import FailsAsPlainJax, ShapeError, TooManyCases, UnsupportedError, typed_as
from ..symbolic import NoSizeMeets
from .tree import (
    PER_SIZE_SHARED_MAX,
    Case,
    CaseTree,
    PerSizeBucket,
    Split,
    common_outputs,
    count_limited,
    enumerate_sizes,
    error_case,
    names_a_count,
    per_size_text,
    plain_failure,
    spec_var_names,
)

__all__ = ["case_remedy", "per_size_limit", "per_size_remedy", "refine_errors",
           "trace_per_size_or_raise"]


def trace_per_size_or_raise(root, cases: list[Case], first: dict, trace_one,
                             max_cases: int, explore, per_shape: bool = False) -> CaseTree:
    """Every case failed: trace once per size (``refine_errors``) when the
    sizes are few, else raise the first error (``jnp.pad(mode="wrap")`` fails
    symbolically at every size but works at each concrete one). ``per_shape``:
    the runner runs a bucket of one case per size per exact shape
    (``_stop_where_a_runner_goes_per_shape``)."""
    signature = first.get("signature")
    refined = False  # some size was traced one by one (and failed there too)
    if signature is not None:
        tree = CaseTree(root, cases, signature.internal, signature, max_cases=max_cases)
        enumerate_sizes(tree)
        if per_shape:
            _stop_where_a_runner_goes_per_shape(tree, max_cases)
        if refine_errors(tree, trace_one, max_cases, explore, per_shape):
            live = [c for c in tree.cases if c.program is not None and c.reachable]
            if live:
                tree.base = live[0].program
                common_outputs(tree, live)
                return tree
        failed = [c for c in tree.cases if c.error is not None and c.reachable]
        # a plain JAX error (not one of polymask's own, e.g. two data-dependent
        # sizes): _every_size_fails tells plain JAX's failures (a case of one
        # size) from polymask's symbolic trace failing (a case of many)
        # (an error of the whole trace, no split: the error itself, below)
        refined = any(c.one_size for c in failed)
        if failed and (refined or "root_error" not in first) and not isinstance(
                first.get("root_error"), ShapeError):
            raise _every_size_fails(failed, max_cases)
    if "root_error" in first:
        e = first["root_error"]
        if signature is not None and getattr(e, "fixed_size_vars", ()):
            # (as the spec names them: the runner makes those axes static)
            e.fixed_size_vars = spec_var_names(e.fixed_size_vars, signature.internal)
        # (where the sizes were traced one by one and fail there too, no
        # max_cases helps: the error alone)
        # (nor where a data-dependent size's value was needed: no max_cases helps)
        if (signature is not None and isinstance(e, ShapeError) and not refined
                and "max_cases" not in str(e) and "data-dependent size" not in str(e)):
            raise TooManyCases(f"{e}\n  (polymask traces such a function once per size when "
                             f"the bounds allow at most {per_size_limit(max_cases)} sizes, 0 to "
                             f"2 x max_cases = {2 * max_cases} (mask, polymask.jit and "
                             f"ragged_map take max_cases=){_count_text(signature)})",
                             reason=str(e), fixed_size_vars=e.fixed_size_vars) from None
        if signature is not None and not isinstance(e, (ShapeError, UnsupportedError)):
            _note_symbolic_trace(e, signature, max_cases)
        raise e
    err = next(c for c in cases if c.error is not None)
    raise ShapeError(f"the function fails for every size:\n  {err.error}")


# the note's first words: runners keep it in their refusal text (runners/fallback.py)
TRACE_NOTE = "(raised while polymask traced the function"


def _note_symbolic_trace(e: BaseException, signature, max_cases: int) -> None:
    """A library's own error from the symbolic trace (lineax's "Vector and
    operator structures do not match" for specs ``("n, n", "m")``) is raised as
    it is, with a note (Python 3.11+) saying it comes from the trace at
    symbolic sizes, not from the data, and what lets polymask trace it."""
    if not hasattr(e, "add_note") or any(
            n.startswith(TRACE_NOTE) for n in getattr(e, "__notes__", ())):
        return
    if not signature.var_order:  # no symbolic size: plain JAX's own trace
        return
    sizes = ", ".join(f"{v} <= {signature.var_bounds[v]}" for v in signature.var_order)
    count = 1
    for v in signature.var_order:
        count *= signature.var_bounds[v] + 1
    e.add_note(
        f"{TRACE_NOTE} with symbolic sizes ({sizes}) at {user_line_of_exception(e)}, not "
        "by the data: axes named by different dim vars are different sizes while "
        "tracing; if two are always equal, give them one name in in_specs. Where they "
        "do differ: " + per_size_remedy(max_cases, count) + ")")


def _count_text(signature) -> str:
    """``"; here 41 sizes: max_cases=20 would trace them"``: how many size
    combinations the bounds allow, and the max_cases that traces them."""
    count = 1
    for v in signature.var_order:
        count *= signature.var_bounds[v] + 1
    return f"; here {count} sizes: {_per_size_need(count)}" if count > 1 else ""


# past this many cases, tracing sizes one by one is no remedy to suggest
_MOST_CASES_SUGGESTED = 256


def _per_size_need(count: int) -> str:
    """The ``max_cases`` that traces ``count`` sizes one by one, or that none
    is a remedy (default specs give every axis of ``a @ b`` its own dim var:
    thousands of combinations)."""
    if count // 2 <= _MOST_CASES_SUGGESTED:
        return f"max_cases={count // 2} would trace them"
    return "too many to trace one by one"


def _every_size_fails(failed: list[Case], max_cases: int) -> ShapeError:
    """The error when every case fails.

    Only a case traced at one size is plain JAX's own trace (its error is the
    function's at that size). A case of several sizes was traced with symbolic
    sizes (too many to trace one by one): its error is polymask's limit, not
    what ``jax.jit`` does on the exact arrays, and it leads the message, with
    the sizes where plain JAX fails too listed after it."""
    symbolic = sorted((c for c in failed if not c.one_size),
                      key=lambda c: -len(c.reached_by or []))
    if not symbolic:
        return _every_size_fails_as_plain(failed)
    main = symbolic[0]
    sizes = [v for c in symbolic for v in (c.reached_by or [])]
    plain = [c for c in failed if c.one_size]
    also = "".join(f"\n  ({sizes_text(c.reached_by)}: plain JAX fails too: "
                   f"{c.error.splitlines()[0]})" for c in plain[:2])
    if count_limited(main):  # tracing the sizes one by one keeps it
        return ShapeError(
            f"polymask cannot trace the function with data-dependent sizes"
            f"{f' ({sizes_text(sizes)})' if sizes else ''} at {main.where}:\n  "
            f"{main.error}{also}")
    return TooManyCases(  # polymask's limit (sizes one by one past max_cases), not the user's
        f"polymask cannot trace the function with symbolic sizes"
        f"{f' ({sizes_text(sizes)})' if sizes else ''} at {main.where}:\n  "
        f"{main.error.splitlines()[0]}\n  {case_remedy(main, max_cases, len(sizes))}{also}",
        fixed_size_vars=tuple(dict.fromkeys(v for c in symbolic for v in c.fixed_size_vars)))


def case_remedy(case: Case, max_cases: int, count: int) -> str:
    """``per_size_remedy``, or where the case's traces at single sizes failed
    the same way (``Case.sampled``: plain JAX's own error there), that."""
    if not case.sampled:
        return per_size_remedy(max_cases, count)
    sizes = " and ".join(f"({sizes_text([v])})" for v in case.sampled)
    need = f" (here {count}: {_per_size_need(count)})" if count else ""
    return (f"Traced at one size each, {sizes} "
            f"{'fails' if len(case.sampled) == 1 else 'fail'} the same way, as plain JAX does "
            "on those exact arrays: most likely the function's own error at each of these "
            f"sizes. polymask traces them one by one only up to "
            f"{per_size_limit(max_cases)} sizes{need}.")


def per_size_remedy(max_cases: int, count: int) -> str:
    """Why a case of many sizes that fails symbolically is polymask's limit, and
    what the user can change (``count``: the sizes reaching it, 0 = unknown)."""
    limit = per_size_limit(max_cases)
    need = f" (here {count}: {_per_size_need(count)})" if count else ""
    return (
        "jax.jit on the exact arrays traces each size with Python ints; polymask traces "
        f"these sizes one by one in one program only where there are at most {limit} of "
        f"them (sizes 0 to 2 x max_cases){need}. Code that needs a size as a Python "
        "value (np.arange(n), len(x), a NumPy table sliced by a size, a Python if on it) "
        "works symbolically when written with jnp (jnp.arange(n) instead of np.arange(n), "
        "x.shape[0] instead of len(x)); else use a smaller "
        "bound (polymask.jit: smaller buckets), raise max_cases= (mask, polymask.jit and "
        "ragged_map take it), or make "
        "that axis static with '_' in the spec (one program per size, as jax.jit).")


def _every_size_fails_as_plain(failed: list[Case]) -> ShapeError:
    """Each size traced on its own fails (plain JAX's own traces): a tracing
    limit of ``jax.jit`` first (its remedy applies to every size), then the others."""
    failed = sorted(failed, key=lambda c: not plain_failure(c.error)[1])
    main = failed[0]
    sizes = [v for c in failed for v in (c.reached_by or [])]
    as_plain, remedy = plain_failure(main.error)
    others = [c for c in failed[1:] if c.error.splitlines()[0] != main.error.splitlines()[0]]
    also = "".join(f"\n  ({sizes_text(c.reached_by)}: {c.error.splitlines()[0]})"
                   for c in others[:2] if c.reached_by)
    return typed_as(FailsAsPlainJax(
        f"the function fails for every logical size within the bounds"
        f"{f' ({sizes_text(sizes)})' if sizes else ''}, {as_plain}, at "
        f"{main.where}:\n  {main.error}{remedy}{also}"), main.error_type)


def per_size_limit(max_cases: int) -> int:
    """How many size combinations one error case may be traced at, one by one.

    Every size up to a bound of twice ``max_cases`` (0..32 by default, a
    ``pow2`` bucket of 32 included): a size traced on its own is the only way code that
    needs a size as a Python int (``len(x)``, ``jnp.diag_indices(n)``,
    ``np.arange(n)``) runs at all, and each such trace is plain JAX's own, so
    a bound of 20 or 30 (a state-space model's time steps, a GP's points)
    works by default; past that the compile of one branch per size dominates
    and the error names the remedy."""
    return 2 * max_cases + 1


def refine_errors(tree: CaseTree, trace_one, max_cases: int, explore,
                  per_shape: bool = False) -> bool:
    """Trace an error case reached by several size combinations once per combination.

    The symbolic trace of a case can fail where JAX needs a concrete size
    (``jnp.pad(mode="wrap")`` computes ``n % k`` in Python, ``len(x)``). Pinned
    to one size of every dim var, the trace is plain JAX's own: it works where
    plain JAX works and fails where plain JAX fails. Only the dim vars the
    failure needs are pinned (``_vars_to_pin``: ``len(edges)`` needs the edge
    count, not the node count), the others stay symbolic within the case's
    conditions (and split on the comparisons of them JAX cannot decide:
    ``explore`` is ``cases.explore_splits``), so a graph's 7 x 7 size pairs
    cost 7 traces. Done while the combinations of one case stay within
    ``per_size_limit(max_cases)``. ``per_shape`` (every case failed
    symbolically, and the runner runs a per-size bucket per exact shape):
    once the first pinned trace shows which dim vars each case needs, a case
    of more than ``PER_SIZE_SHARED_MAX`` of their values raises
    ``PerSizeBucket`` before the other values are traced.
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
    stop = per_shape and len(names) > 1 and _fails_symbolically_only(tree)
    for case in list(tree.cases):
        # (a data-dependent size's use stays symbolic at every pinned size: no help)
        if case.error is None or not case.reached_by or case.one_size or count_limited(case):
            continue
        combos = sorted(tuple(a[v] for v in names) for a in case.reached_by)
        pinned, first = _vars_to_pin(case, combos, base, trace_one, explore, max_cases)
        if pinned is None:
            case.sampled = _failing_the_same_way(case, combos, base, names, trace_one)
            continue
        # (not shapes in conflict, (s0,) against (s1 - 1,): sizes that may
        # relate, which a runner without specs plans so, s1 = s0 + 1)
        if stop and first is not None and INCOMPATIBLE_SHAPES not in case.error:
            _stop_before_each_pinned_value(case, combos, pinned, names, max_cases)
        node = _pinned_cases(case, combos, pinned, first, base, names, var_exprs, trace_one,
                             explore, tree.internal, max_cases)
        leaves = [] if node is None else _leaves_in_order(node)
        if leaves and all(c.error is not None and count_limited(c) for c in leaves):
            # a data-dependent size's use at every size: one error for them all
            # (its sizes, not one pinned size each)
            case.error, case.where = leaves[0].error, leaves[0].where
            continue
        if node is not None:
            _replace(tree, case, node)
            tree.per_size_at.append((case.where, _what_failed(case.error),
                                     tuple(base.var_order[j] for j in pinned)))
            changed = True
    if changed:
        tree.cases = _leaves_in_order(tree.root)
        for i, c in enumerate(tree.cases):
            c.index = i
        enumerate_sizes(tree)
    return changed


def _stop_where_a_runner_goes_per_shape(tree: CaseTree, max_cases: int) -> None:
    """Every case failed symbolically and one dim var decides them: traced size
    by size, each size would be a case of its own. Where the runner runs such
    a bucket per exact shape (``trace_state().per_size_per_shape`` at the
    trace's start), raise
    ``PerSizeBucket`` now, before tracing every size of the bucket (a first
    call then costs about jax.jit's one trace, not the bucket's).

    Raises:
      PerSizeBucket: as above, past ``PER_SIZE_SHARED_MAX`` sizes (and within
        ``per_size_limit``: past it, the trace's own ``TooManyCases`` says more).
    """
    if len(tree.base.var_order) != 1 or not _fails_symbolically_only(tree):
        return
    failed = [c for c in tree.cases if c.error is not None and c.reachable]
    count = sum(len(c.reached_by) for c in failed)
    if PER_SIZE_SHARED_MAX < count <= per_size_limit(max_cases):
        raise PerSizeBucket(per_size_text([(c.where, _what_failed(c.error)) for c in failed],
                                          count), fixed_size_vars=tuple(tree.base.var_order))


def _fails_symbolically_only(tree: CaseTree) -> bool:
    """Every reachable case failed at polymask's symbolic limit only: an error
    of the function's own (a RuntimeError or KeyError at every size) is traced
    per size to say so."""
    failed = [c for c in tree.cases if c.error is not None and c.reachable]
    return bool(failed) and not any(
        c.reached_by is None or c.one_size or c.plain or count_limited(c)
        or c.error_type is not None for c in failed)


def _stop_before_each_pinned_value(case: Case, combos, pinned, names, max_cases: int) -> None:
    """Several dim vars (a loop over n of (n, m) inputs): the first pinned
    trace worked, so each value of the ``pinned`` vars would be a case of its
    own; past ``PER_SIZE_SHARED_MAX`` values the runner goes per exact shape,
    so raise ``PerSizeBucket`` before tracing the others."""
    count = len({tuple(c[j] for j in pinned) for c in combos})
    if PER_SIZE_SHARED_MAX < count <= per_size_limit(max_cases):
        raise PerSizeBucket(per_size_text([(case.where, _what_failed(case.error))], count),
                            fixed_size_vars=tuple(names[j] for j in pinned))


def _what_failed(error: str) -> str:
    """The line of an error case's text that says what failed (``'_DimExpr'
    object cannot be interpreted as an integer``), not its heading (``JAX
    cannot trace this with a symbolic size at ...:``)."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    return lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]


def _pinned_cases(case, combos, pinned, first, base, names, var_exprs, trace_one, explore,
                  internal, max_cases: int):
    """The dispatch that replaces ``case``: one trace per value of the pinned
    dim vars (the others symbolic within the case's conditions, split where
    needed). A group whose trace still fails is traced once per combination,
    so every error left is plain JAX's own at one size; None when that needs
    more than ``per_size_limit(max_cases)`` traces (the case keeps its error)."""
    # (a count's conditions stay: a case under a split on a count is one of its sides)
    on_counts = tuple(c for c in case.conditions if names_a_count(c))

    def leaf(conditions):
        conditions = on_counts + conditions
        try:
            return Case(0, conditions, program=trace_one(conditions))
        except UnsupportedError:
            raise
        except NoSizeMeets:
            return Case(0, conditions, reached_by=[], empty=True)
        except (compat.SplitNeeded, compat.SplitBeforeRaise) as e:
            split = e  # (a comparison of a count: its cases, below)
        except Exception as e:
            return error_case(0, conditions, e, internal)
        node, _ = _explore_pinned(explore, trace_one, conditions, max_cases)
        return node if node is not None else error_case(0, conditions, split, internal)

    key = lambda c: tuple(c[j] for j in pinned)  # noqa: E731
    groups = sorted({key(c) for c in combos})
    partial = len(pinned) < len(names)
    budget = per_size_limit(max_cases)
    leaves = {}
    for group in groups:
        pins = _pins(base, [names[j] for j in pinned], group)
        if not partial:
            got, used = leaf(pins), 1
        elif group == key(combos[0]):
            got, used = first
        else:
            got, used = _explore_pinned(explore, trace_one, case.conditions + pins, max_cases,
                                        plain_errors=True)
        budget -= used
        sub = [c for c in combos if key(c) == group]
        if partial and got is not None and not _traces(got):
            free = [j for j in range(len(names)) if j not in pinned]
            got = _if_plain_everywhere(got, [({names[j]: c[j] for j in free},
                                              leaf(_pins(base, names, c)))
                                             for c in dict.fromkeys((sub[0], sub[-1]))])
            budget -= 2
        if got is None:
            budget -= len(sub)
            got = _dispatch(sub, names, var_exprs,
                            {c: leaf(_pins(base, names, c)) for c in sub}, case.where)
        if budget < 0:
            return None
        leaves[group] = got
    return _dispatch(groups, [names[j] for j in pinned], [var_exprs[j] for j in pinned],
                     leaves, case.where)


def _if_plain_everywhere(node, pinned: list[tuple[dict[str, int], Case]]):
    """``node``, every case of it an error of a pinned value with the other
    dim vars symbolic, when plain JAX fails with the same error, word for
    word once those vars' values are put in its text, at the first and last
    combinations of them (``pinned``: their values, the case traced with
    every size an int): an error that does not depend on them
    (AlphaFold's sharded_apply slices 4 rows of an empty axis at s = 0,
    whatever n: traced once per (s, n) instead, past the per-size limit every
    size was refused). Then its cases are plain JAX's errors. None otherwise:
    an error of the symbolic trace itself (TracerBoolConversionError of
    np.arange(m); einsum's "Size of label 'i' ... (3) does not match ... (8)"
    where opt_einsum read a placeholder for m) is traced once per combination."""
    def at(text: str, values: dict[str, int]) -> str:
        for v, a in values.items():
            text = re.sub(rf"\b{re.escape(v)}\b", str(a), text)
        return text

    cases = _leaves_in_order(node)
    if any(p.error is None for _, p in pinned) or any(
            c.error_type is not p.error_type or at(c.error, values) != p.error
            for c in cases for values, p in pinned):
        return None
    for c in cases:
        c.plain = c.pinned = True
    return node


def _explore_pinned(explore, trace_one, prefix: tuple[str, ...], max_cases: int,
                    plain_errors: bool = False):
    """``(node, programs)``: the split tree of the function traced with ``prefix``
    added to every case's conditions; node None when no case of it traces.
    ``plain_errors``: where every case fails with an error of a Python or
    JAX type (not polymask's own), those error cases are the node
    (``_pinned_cases`` checks that plain JAX fails so too)."""
    try:
        root, cases, first = explore(lambda conditions: trace_one(prefix + conditions),
                                     max_cases)
    except UnsupportedError:
        raise
    except Exception:
        return None, 1
    if "prog" not in first and not (plain_errors and cases and all(
            c.error_type is not None and not count_limited(c) for c in cases)):
        return None, 1
    for c in cases:  # conditions as the whole tree's cases have them
        c.conditions = prefix + c.conditions
    # the budget counts programs: an error case (plain JAX fails there) compiles nothing
    return root, sum(c.program is not None for c in cases)


def _pins(base, names, values) -> tuple[str, ...]:
    """Scope conditions that pin each dim var in ``names`` to its value."""
    conditions = ()
    for v, a in zip(names, values):
        name, off = base.internal[v]
        conditions += (f"{name} - {a + off} >= 0", f"- {name} + {a + off} >= 0")
    return conditions


def _failing_the_same_way(case: Case, combos, base, names, trace_one) -> list[dict]:
    """Of the case's first and last size combinations (too many to trace each),
    those where the function, traced at that one size (plain JAX's own
    trace), fails with the case's error: its message can say plain JAX fails
    there (maxtext's attention at k = 0, a max of an empty array, for every
    q and p), not only that polymask could not trace the sizes."""
    out = []
    for combo in dict.fromkeys((combos[0], combos[-1])):
        try:
            trace_one(case.conditions + _pins(base, names, combo))
        except UnsupportedError:
            raise
        except Exception as e:  # noqa: BLE001 - plain JAX's error at that size, or polymask's
            said = error_case(0, (), e, base.internal).error.splitlines()[:1]
            if said and said == case.error.splitlines()[:1]:
                out.append(dict(zip(names, combo)))
    return out


def _vars_to_pin(case: Case, combos, base, trace_one, explore, max_cases: int):
    """``(indices, (node, traces))``: the dim vars to pin for ``case``, the
    smallest set (fewest traces) whose pinning at the case's first combination
    traces (that trace's split tree), or all of them (node None) when none
    does; ``(None, None)`` when even that needs more than the per-size limit."""
    room = per_size_limit(max_cases)
    n = len(base.var_order)
    everything = list(range(n))
    if len(combos) > room and n == 1:
        return None, None
    varying = [j for j in everything if len({c[j] for c in combos}) > 1]
    fixed = [j for j in everything if j not in varying]
    subsets = [sorted(fixed + list(s)) for k in range(1, len(varying))
               for s in itertools.combinations(varying, k)]
    count = {tuple(s): len({tuple(c[j] for j in s) for c in combos}) for s in subsets}
    for s in sorted(subsets, key=lambda s: count[tuple(s)]):
        if count[tuple(s)] > room:
            break
        names = [base.var_order[j] for j in s]

        def pinned_at(combo):
            return _explore_pinned(explore, trace_one,
                                   case.conditions + _pins(base, names, [combo[j] for j in s]),
                                   max_cases, plain_errors=True)

        node, used = pinned_at(combos[0])
        # (plain JAX's own error at the first combination, s = 0: whether pinning
        # these vars traces is seen at the last)
        if node is not None and not _traces(node) and not _traces(pinned_at(combos[-1])[0]):
            continue
        if node is not None:
            return s, (node, used)
    return (everything, None) if len(combos) <= room else (None, None)


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


def _traces(node) -> bool:
    """Whether a case of ``node`` (a split tree, or None) has a program."""
    return node is not None and any(c.program is not None for c in _leaves_in_order(node))


def _leaves_in_order(node) -> list[Case]:
    if isinstance(node, Case):
        return [node]
    return _leaves_in_order(node.yes) + _leaves_in_order(node.no)
