"""Run time of case splits: the logical sizes choose a case of a ``CaseTree``.

Eagerly the case is chosen in Python; with traced sizes (under ``jax.jit``) by
``lax.switch`` over the cases (under ``jax.vmap`` the switch becomes a select:
every case is computed). Every case's outputs are padded to the largest padded
shape over the cases. Sizes that reach an error case (the plain function fails
there) raise ``ShapeError`` through the prologue's checks, or on the host
(``host_error``, for ``polymask.jit``), never a value.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ... import _jax_compat as compat
from ...core.dimvars import sizes_text
from ...core.errors import ShapeError, TooManyCases, UnsupportedError, typed_as
from ...core.masked import Masked
from ...core.trace_state import cases_batched, replaced, trace_state
from ..interpreter import run_program_counts, with_plain_weak_types
from ..prologue import Check, concrete_value, run_checks
from .refine import case_remedy
from .splitting import Case, CaseTree
from .tree import ONE_OUTPUT_REMEDY, count_limited, names_a_count, plain_failure

__all__ = ["run_cases", "host_error", "case_program"]


def _pad_to(data, shape):
    data = jnp.asarray(data)
    if tuple(data.shape) == tuple(shape):
        return data
    return jnp.pad(data, [(0, t - s) for s, t in zip(data.shape, shape)])


def _error_message(tree: CaseTree, c: Case) -> str:
    if c.differs:  # plain JAX runs them, with outputs of another rank or structure
        what, _, note = c.error.partition("\n")
        return (f"for these sizes ({_sizes_of(tree, c)}) {what} (the sizes are told apart "
                f"at {c.where}){chr(10) + note if note else ''}"
                f"{ONE_OUTPUT_REMEDY.replace(_EXAMPLE_CONSTRAINT, _leaving_out(tree, c))}")
    if c.one_size or c.plain:
        as_plain, remedy = plain_failure(c.error)
        sizes = sizes_text(c.reached_by) if c.reached_by else tree.describe_conditions(c)
        return (f"for these sizes ({sizes}) the function fails at "
                f"{c.where}, {as_plain}:\n  {c.error}{remedy}")
    if count_limited(c):
        return (f"for these sizes ({tree.describe_conditions(c)}) polymask cannot trace the "
                f"function with data-dependent sizes at {c.where}:\n  {c.error}")
    count = len(c.reached_by) if c.reached_by else 0
    return (f"for these sizes ({_sizes_of(tree, c)}) polymask cannot trace the "
            f"function with symbolic sizes at {c.where}:\n  {c.error}\n  "
            f"{case_remedy(c, tree.max_cases, count)}")


_EXAMPLE_CONSTRAINT = "(for example constraints=['n >= 1'] where only n = 0 differs)"


def _leaving_out(tree: CaseTree, c: Case) -> str:
    """The constraint that leaves out the smallest sizes up to the largest of
    a differing case's (``c``'s and the others': ``jnp.split(x, n)`` returns
    another structure at every n), where they are one dim var's
    (``constraints=['n >= 2']`` for ``n in {1}``); else the dim vars to
    constrain."""
    names = {k for values in (c.reached_by or ()) for k in values}
    if len(names) != 1:
        return f"(on {', '.join(sorted(names))}, excluding the sizes above)" if names else \
            "(excluding the sizes above)"
    (name,) = names
    differing = [values[name] for d in tree.cases if d.differs for values in (d.reached_by or ())
                 if set(values) == names]
    top = max([values[name] for values in c.reached_by] + differing)
    return (f"(constraints=['{name} >= {top + 1}'] leaves out "
            f"{f'{name} = 0' if top == 0 else f'{name} <= {top}'})")


def _sizes_of(tree: CaseTree, c: Case) -> str:
    """The sizes reaching case ``c`` as values where they are one dim var's
    (``t in {2..40}``, not ``min(t, 1) - t <= -1``), else its conditions."""
    if c.reached_by and len({k for values in c.reached_by for k in values}) == 1:
        return sizes_text(c.reached_by)
    return tree.describe_conditions(c)


def _error_checks(tree: CaseTree, idx, checks_on: bool = True) -> list[Check]:
    """The checks that ``idx`` is no error case. Without ``checks_on`` those
    of cases a count chooses only (the host checks the sizes' own)."""
    return [Check(idx == c.index, _error_message(tree, c), error_type=c.error_type,
                  error_class=(ShapeError if c.one_size or c.plain or count_limited(c) or c.differs
                               else TooManyCases))
            for c in tree.cases if c.error is not None and c.reachable
            and (checks_on or _chosen_by_a_count(c))]


def _chosen_by_a_count(case: Case) -> bool:
    return any(names_a_count(cond) for cond in case.conditions)


def case_error(tree: CaseTree, case: Case, prefix: str = "") -> ShapeError:
    """The ``ShapeError`` of an error case, also of the type plain JAX raised
    there (``errors.typed_as``: ``except IndexError`` still catches it)."""
    if case.one_size or case.plain:  # plain JAX's own failure at these sizes
        return typed_as(ShapeError(prefix + _error_message(tree, case)), case.error_type)
    if count_limited(case) or case.differs:  # (no max_cases helps: not TooManyCases)
        return ShapeError(prefix + _error_message(tree, case))
    # polymask's limit (a case traced with symbolic sizes), as when every size fails
    return TooManyCases(prefix + _error_message(tree, case),
                        fixed_size_vars=case.fixed_size_vars)


def host_error(tree: CaseTree, values: dict[str, int], prefix: str = "") -> ShapeError | None:
    """The error of the case that concrete spec dim var ``values`` choose (None:
    no error). Past a split on a count, an error of every case the count may
    choose (one that only some counts reach is checked in the program)."""
    if tree.single or all(c.error is None for c in tree.cases):
        return None
    reached = tree.reachable_cases(tree.base.internal_values(values))
    if any(c.error is None for c in reached):
        return None
    return case_error(tree, reached[0], prefix)


def case_program(tree: CaseTree, internal_values: dict):
    """The program of the case these (internal, concrete) sizes choose (past a
    split on a count: the first the count may choose).

    Raises:
      ShapeError: they choose an error case (``mask``'s message: the function
        fails there, as on the exact arrays).
    """
    reached = tree.reachable_cases(internal_values)
    case = next((c for c in reached if c.error is None), reached[0])
    if case.error is not None:
        raise case_error(tree, case)
    return case.program


def count_values(tree: CaseTree, leaves, values: dict) -> dict:
    """The data-dependent sizes the tree's splits on counts read, computed
    from the inputs before a case is chosen: each by a program that computes
    it (a case under the split; XLA keeps only what the count needs), with
    its checks off (``guard`` False: a run of any sizes is harmless).

    Raises:
      UnsupportedError: a count is computed inside a loop or a branch of the
        function, not where the case could be chosen.
    """
    out: dict = {}
    for split in tree.count_splits:
        names = split.counts() - out.keys()
        if not names:
            continue
        sides = {f"{split.cond} >= 0", f"{split.cond} <= -1"}
        prog = next(c.program for c in tree.cases
                    if c.program is not None and sides & set(c.conditions))
        got = run_program_counts(prog, leaves, values, names)
        if names - got.keys():
            raise UnsupportedError(
                f"the function compares a data-dependent size at {split.where} "
                f"({split.text}) that it computes inside a loop or a branch: polymask "
                "chooses between the two paths before the program runs and cannot "
                "compute that size there. Compare it outside the loop or branch, or "
                "use it as a value (jnp.where(n > 2, a, b) with n = jnp.asarray(s.shape[0])).")
        out.update(got)
    return out


def run_cases(tree: CaseTree, leaves, values: dict, call_site: str,
              run_program: Callable, checks_on: bool = True,
              outer_guard=None) -> list[Masked]:
    """Run the case the logical sizes select (see the module doc).

    ``checks_on=False`` (``mask(..., checks=False)``; ``polymask.jit`` checks
    on the host instead, ``programs.raise_case_error``): sizes of an error case
    are not checked in the program. ``outer_guard``: whether the call is real
    at all (``MaskedFunction.call_guarded``), and-ed into each case's guard.
    """
    counts = count_values(tree, leaves, values) if tree.count_splits else {}
    idx = tree.select({**values, **counts})
    if checks_on or concrete_value(idx) is not None or tree.count_splits:
        run_checks(_error_checks(tree, idx, checks_on or concrete_value(idx) is not None),
                   call_site)
    if concrete_value(idx) is not None:
        case = tree.cases[int(np.asarray(idx))]
        outs = run_program(case.program, leaves, values)
        return [Masked(_pad_to(o.data, b), o.shape) for o, b in zip(outs, tree.out_bounds)]

    # checks="functional": a branch's traced checks are values of the branch's
    # trace; each branch returns them folded into one bool, added after the switch
    outer_bads = trace_state().functional_checks
    # inside shard_map every branch returns the inputs' varying axes (one type)
    varying = compat.varying_axes((leaves, values, idx))

    def branch(case: Case):
        def run():
            return compat.as_varying(run_case(), varying)

        def run_case():
            if case.program is None or not case.reachable:
                datas = [jnp.zeros(b, v.aval.dtype) for b, v in
                         zip(tree.out_bounds, tree.base.closed_jaxpr.jaxpr.outvars)]
                return datas, [[jnp.int32(0)] * len(b) for b in tree.out_bounds], jnp.bool_(False)
            guard = idx == case.index
            if outer_guard is not None:
                guard = jnp.logical_and(guard, outer_guard)
            with replaced("functional_checks", None if outer_bads is None else []) as bads:
                outs = run_program(case.program, leaves, values, guard=guard)
            bad = jnp.any(jnp.stack([jnp.asarray(b) for b in bads])) if bads else jnp.bool_(False)
            return ([_pad_to(o.data, b) for o, b in zip(outs, tree.out_bounds)],
                    [[jnp.asarray(s, jnp.int32) for s in o.shape] for o in outs], bad)
        return run

    batched = compat.is_batched(idx) or trace_state().batched_outside
    try:
        with cases_batched(batched):
            datas, sizes, bad = lax.switch(jnp.clip(idx, 0, len(tree.cases) - 1),
                                           [branch(c) for c in tree.cases])
        if outer_bads is not None:
            outer_bads.append(bad)
    except NotImplementedError as e:  # JAX: "IO effect not supported in vmap-of-cond"
        if "effect" not in str(e):
            raise
        raise UnsupportedError(
            f"the masked function has {len(tree.cases)} cases (a size comparison splits it) "
            f"and {str(e).rstrip('.')}: under vmap (ragged_map, jax.vmap) JAX cannot run an "
            "ordered or IO effect (io_callback, ordered debug callbacks) inside the switch "
            "between them. "
            "A constraint that decides the comparison (constraints=['n >= 1']) removes the "
            f"split; jax.debug.callback is not an IO effect.\n  in the masked call at {call_site}"
        ) from None
    # (the switch's outputs are strongly typed: x.shape[0] as an output is a
    # weakly typed int in plain JAX, as in a single-case program)
    datas = with_plain_weak_types(tree.base.closed_jaxpr.jaxpr.outvars, list(datas))
    static = static_out_sizes(tree)
    return [Masked(d, tuple(st if st is not None else s for s, st in zip(ss, sts)))
            for d, ss, sts in zip(datas, sizes, static)]


def static_out_sizes(tree: CaseTree) -> list[list[int | None]]:
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
