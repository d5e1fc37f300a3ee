"""Error cases traced once per size: plain JAX's own trace at each size.

A case can fail only because its sizes are symbolic (``jnp.pad(mode="wrap")``
computes ``n % k`` in Python, ``int(x.shape[0])``). When the sizes reaching it
are few (within ``max_cases``), each is traced pinned to one value: that trace
is plain JAX's, so it works where plain JAX works and fails where plain JAX
fails (``cases.trace_cases`` calls these).
"""

from __future__ import annotations

import jax

from ...core.dimvars import sizes_text
from ...core.errors import ShapeError, UnsupportedError
from .tree import (
    Case,
    CaseTree,
    Split,
    common_outputs,
    enumerate_sizes,
    error_case,
    plain_failure,
)

__all__ = ["refine_errors", "trace_per_size_or_raise"]


def trace_per_size_or_raise(root, cases: list[Case], first: dict, trace_one,
                             max_cases: int) -> CaseTree:
    """Every case failed: trace once per size (``refine_errors``) when the
    sizes are few, else raise the first error (``jnp.pad(mode="wrap")`` fails
    symbolically at every size but works at each concrete one)."""
    signature = first.get("signature")
    if signature is not None:
        tree = CaseTree(root, cases, signature.internal, signature)
        enumerate_sizes(tree)
        if refine_errors(tree, trace_one, max_cases):
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
        if signature is not None and isinstance(e, ShapeError) and "max_cases" not in str(e):
            raise ShapeError(f"{e}\n  (polymask traces such a function once per size when "
                             f"the bounds allow at most {max_cases} sizes, mask(..., max_cases=))"
                             ) from None
        raise e
    err = next(c for c in cases if c.error is not None)
    raise ShapeError(f"the function fails for every size:\n  {err.error}")


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
    return ShapeError(
        f"polymask cannot trace the function with symbolic sizes"
        f"{f' ({sizes_text(sizes)})' if sizes else ''} at {main.where}:\n  "
        f"{main.error.splitlines()[0]}\n  jax.jit on the exact arrays traces each size "
        f"with Python ints; polymask traces the sizes one by one only when at most "
        f"{max_cases} combinations reach a case (here {len(sizes) or 'more'}). Code that "
        "needs a size as a Python value (np.arange(n), len(x), a NumPy table sliced by a "
        "size, a Python if on it) works symbolically when written with jnp "
        "(jnp.arange(x.shape[1]), x.shape[0]); else narrow the bounds, raise "
        f"mask(..., max_cases=), or make that axis static with '_' in the spec.{also}")


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
    return ShapeError(
        f"the function fails for every logical size within the bounds"
        f"{f' ({sizes_text(sizes)})' if sizes else ''}, {as_plain}, at "
        f"{main.where}:\n  {main.error}{remedy}{also}")


def refine_errors(tree: CaseTree, trace_one, max_cases: int) -> bool:
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
                leaves[combo] = error_case(0, conditions, e, tree.internal)
        _replace(tree, case, _dispatch(combos, names, var_exprs, leaves, case.where))
        changed = True
    if changed:
        tree.cases = _leaves_in_order(tree.root)
        for i, c in enumerate(tree.cases):
            c.index = i
        enumerate_sizes(tree)
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
