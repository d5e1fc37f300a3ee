"""The case tree of a traced function: its leaves (programs or error cases),
its splits, and choosing a leaf from logical sizes (``splitting.py`` builds it,
``dispatch.py`` runs it)."""

from __future__ import annotations

import dataclasses
import itertools
import linecache
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import _jax_compat as compat
from ...core.diagnostics import SIZE_AS_CONSTANT, dim_vars_named, user_frame_of_exception
from ...core.dimvars import describe_conditions, display_text, pretty_condition, sizes_text
from ...core.errors import ShapeError, TooManyCases, UnsupportedError
from ...core.shapes import DimEnv, is_static
from ..prologue import constraint_checks
from ..symbolic import MaskedProgram

__all__ = ["Case", "Split", "CaseTree", "enumerate_sizes", "common_outputs", "error_case",
           "per_size_reason", "per_size_text", "PerSizeBucket", "PER_SIZE_SHARED_MAX",
           "spec_var_names",
           "plain_failure", "fails_in_plain_jax", "count_limited", "splits_under"]

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
    pinned: bool = False  # traced with every size a Python int (an error is plain JAX's)
    error_type: type | None = None  # the exception the error was (not polymask's own)
    plain: bool = False  # an error plain JAX has at every size of the case (rfft of length 0)
    fixed_size_vars: tuple[str, ...] = ()  # the error's (``ShapeError.fixed_size_vars``)
    differs: bool = False  # its outputs differ from the kept cases' (``common_outputs``)
    empty: bool = False  # no sizes meet its conditions: not traced (``NoSizeMeets``)
    # sizes of an error case of many where its trace at that one size failed the same way
    sampled: list[dict[str, int]] = dataclasses.field(default_factory=list)

    @property
    def one_size(self) -> bool:
        """Reached by one combination of sizes only and traced at it (an error
        there is plain JAX's; a case of one size traced symbolically, e.g.
        pinned by conditions on several dim vars, is not)."""
        return self.reached_by is not None and len(self.reached_by) == 1 and self.pinned

    @property
    def reachable(self) -> bool:
        return not self.empty and (self.reached_by is None or bool(self.reached_by))


@dataclasses.dataclass
class Split:
    """An inner node: ``cond >= 0`` goes to ``yes``, else to ``no``."""

    cond: Any
    text: str  # the comparison as JAX reported it (spec dim vars)
    where: str  # the user's line
    yes: Any = None
    no: Any = None

    @property
    def on_count(self) -> bool:
        """A comparison of a data-dependent size (``_u1 - 2``): the count,
        known only while the program runs, chooses the side (``dispatch.py``)."""
        return names_a_count(str(self.cond))

    def counts(self) -> set[str]:
        """The data-dependent dim vars the comparison reads."""
        return {v for v in compat.dim_vars(self.cond) if compat.is_fresh_dim_name(v)}


def splits_under(node) -> list[Split]:
    """The ``Split`` nodes of the tree under ``node``, depth first, yes first."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        if isinstance(n, Split):
            out.append(n)
            todo += [n.no, n.yes]
    return out


@dataclasses.dataclass
class CaseTree:
    """The decision tree of one padded signature."""

    root: Any
    cases: list[Case]
    internal: dict[str, tuple[str, int]]
    # a traced program (specs, bounds, prologue checks); while every case is an
    # error, a trace.SizeSignature (its dim vars) until a trace per size works
    base: MaskedProgram
    out_tree: Any = None
    out_bounds: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    max_cases: int = 16  # mask(..., max_cases=): the limit its errors name
    # where a symbolic trace failed and its sizes were traced one by one (refine.py):
    # (the user's line, the failure's first line, the dim vars pinned there)
    per_size_at: list[tuple[str, str, tuple[str, ...]]] = dataclasses.field(
        default_factory=list, compare=False)
    # tracing/eager.py's state for eager jax.vmap calls that switch between cases
    eager_states: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                           compare=False)

    @property
    def single(self) -> bool:
        return isinstance(self.root, Case)

    def display(self, text: str) -> str:
        return display_text(text, self.internal)

    def case_sizes(self, case: Case) -> str:
        """The sizes that reach ``case`` ("n in {0}") where they were enumerated
        and choose it, else its comparisons (a count's among them)."""
        if case.reached_by and not any(names_a_count(c) for c in case.conditions):
            return sizes_text(case.reached_by)
        return self.describe_conditions(case)

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
        chooser = "the sizes"
        if self.count_splits:
            chooser += " (and a data-dependent size computed first)"
        return (f"\ncases (a size comparison JAX cannot decide; {chooser} choose one at run "
                f"time; the trace below is case {shown}):\n"
                + "\n".join("  " + ln for ln in self.summary().splitlines()))

    def splits(self) -> list[Split]:
        return splits_under(self.root)

    def summary(self) -> str:
        """The decision tree in words: each comparison and each case."""
        lines = []

        def walk(node, depth):
            pad = "  " * depth
            if isinstance(node, Split):  # (its comparison as JAX made it: either side)
                lines.append(f"{pad}if {pretty_condition(f'{node.cond} >= 0', self.internal)}   "
                             f"[JAX compared {node.text} at {node.where}]")
                walk(node.yes, depth + 1)
                lines.append(f"{pad}else")
                walk(node.no, depth + 1)
                return
            if node.empty:
                lines.append(f"{pad}case {node.index}: empty (no sizes meet its conditions; "
                             "not traced)")
                return
            what = (f"error: {node.error.splitlines()[0]}" if node.error is not None
                    else "outputs " + ", ".join(
                        self.display(aval_text(v.aval))
                        for v in node.program.closed_jaxpr.jaxpr.outvars))
            sizes = ""
            if node.reached_by is not None:
                sizes = "; sizes " + (sizes_text(node.reached_by) if node.reached_by
                                      else "none (unreachable)")
            counted = [c for c in node.conditions if any(
                compat.is_fresh_dim_name(v) for v in _names(c))]
            if counted:  # (the sizes alone do not choose it: a count computed first does)
                sizes += " where " + describe_conditions(counted, self.internal)
                if not _satisfiable(counted):
                    sizes += " (unreachable: no count meets these)"
            for check in node.program.count_checks if node.program is not None else ():
                if _implied_by_others(check.condition, node.conditions):
                    continue  # (the case's own conditions rule its failure out: _u1 >= 3)
                sizes += (f"; {pretty_condition(_negated(check.condition), self.internal)}: "
                          "error, checked as the program runs")
            lines.append(f"{pad}case {node.index}: {what}{sizes}")

        walk(self.root, 0)
        return "\n".join(lines)

    @property
    def count_splits(self) -> list[Split]:
        """The splits on a data-dependent size, both sides of which run."""
        return [s for s in self.splits() if s.on_count]

    def reachable_cases(self, values: dict[str, Any]) -> list[Case]:
        """The cases concrete internal dim var ``values`` may reach: one, or,
        past a split on a count (not in ``values``), those of both sides."""
        env = DimEnv(self.base.scope, self.base.dim_bounds, values)
        out, todo = [], [self.root]
        while todo:
            node = todo.pop()
            if isinstance(node, Case):
                out.append(node)
            elif node.on_count and not node.counts() <= values.keys():
                todo += [node.no, node.yes]
            else:
                todo.append(node.yes if int(env.logical_raw(node.cond)) >= 0 else node.no)
        return out

    # -- run time -------------------------------------------------------------
    def select(self, values: dict[str, Any]):
        """The case index for internal dim var values (an int or an int32 tracer);
        past a split on a count, ``values`` holds the count too
        (``dispatch.count_values``)."""
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


def _negated(condition: str) -> str:
    """The other outcome of a split's condition (``"e >= 0"`` <-> ``"e <= -1"``)."""
    expr, op, _ = condition.rsplit(" ", 2)
    return f"{expr} <= -1" if op == ">=" else f"{expr} >= 0"


# counts up to which ``_implied_by_others`` looks (a count's bound is not in the
# case's dim bounds; its conditions are comparisons with small constants)
_COUNTS_LOOKED_AT = 4096


def _names(condition: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", condition))


def _counts_meeting(conditions, v: str) -> list[int] | None:
    """The values of the count ``v`` (0 .. ``_COUNTS_LOOKED_AT`` - 1) that
    meet every condition of ``conditions`` (each on ``v`` alone); None where
    JAX cannot parse one alone."""
    try:
        parsed = [_parsed(c) for c in conditions]
    except Exception:  # noqa: BLE001 - a condition JAX cannot parse alone
        return None
    return [k for k in range(_COUNTS_LOOKED_AT)
            if all((int(compat.evaluate_dim(e, {v: k})) >= 0) == at_least
                   for e, at_least in parsed)]


def _implied_by_others(check: str, conditions) -> bool:
    """Whether ``check`` (``"_u1 - 1 >= 0"``, on one count) holds at every
    count that the case's other conditions on that count allow (``"_u1 - 3
    >= 0"`` implies it): then its failure cannot happen in this case. Checks
    on several counts are never called implied."""
    names = _names(check)
    if len(names) != 1:
        return False
    (v,) = names
    others = [c for c in conditions if c != check and _names(c) == names]
    allowed, meeting = _counts_meeting(others, v), _counts_meeting([*others, check], v)
    return allowed is not None and meeting is not None and allowed == meeting


def _satisfiable(conditions) -> bool:
    """Whether some count meets ``conditions`` (each on one count; True
    where that cannot be told: several counts, a form JAX cannot parse)."""
    by_count: dict = {}
    for c in conditions:
        names = _names(c)
        if len(names) != 1:
            return True
        by_count.setdefault(names.pop(), []).append(c)
    return all(_counts_meeting(conds, v) != [] for v, conds in by_count.items())


def _parsed(condition: str):
    """``("e >= 0")`` -> ``(e, True)``; ``"e <= -1"`` -> ``(e, False)``."""
    expr, op, _ = condition.rsplit(" ", 2)
    (e,) = jax.export.symbolic_shape(expr)
    return e, op == ">="


def aval_text(aval) -> str:
    """``f32[n,3]``: an abstract value as JAX prints it in a jaxpr."""
    return aval.str_short(short_dtypes=True) if hasattr(aval, "str_short") else str(aval)


_TRACED_VALUE_ERRORS = ("ConcretizationTypeError", "TracerBoolConversionError",
                        "TracerArrayConversionError", "TracerIntegerConversionError")


def needs_a_size_as_value(error: BaseException) -> bool:
    """Whether ``error`` (polymask's) is the function needing a size as a
    Python value: a size made a constant (``int(n)``, ``np.zeros(n)``) or
    read as a traced value and converted (``np.arange(x.shape[0])``: the JAX
    error it names), not an axis meeting a fixed size (``x @ W``)."""
    text = str(error)
    return SIZE_AS_CONSTANT in text or any(f"{name}:" in text for name in _TRACED_VALUE_ERRORS)


def plain_failure(error: str) -> tuple[str, str]:
    """How plain JAX fails like this, and a remedy: ``(phrase, remedy)``.

    A traced value used as a Python value fails under ``jax.jit`` on the exact
    arrays but not eagerly; polymask traces like ``jax.jit``, so the remedy
    is to keep the value traced (or to make a Python constant static)."""
    if error.startswith("TraceContextError"):  # flax nnx: state mutated across traces
        return ("as it does under jax.jit on the exact arrays",
                "\n  a flax nnx module closed over by the function mutates its state inside "
                "the trace; pass the module itself, pm.mask(module, spec): its state then "
                "goes in and out of the masked call, as with nnx.jit")
    if error.startswith("InconclusiveDimensionOperation"):  # polymask's limit, not JAX's
        if names_a_count(error):  # a count's value or a comparison no program follows
            return ("where polymask's trace needs a data-dependent size (the count of a "
                    "polymask.nonzero / boolean_mask / ... result) in a way one program for "
                    "every count cannot follow (its value as a Python int, a lookup by it, "
                    "a comparison of it inside a loop or branch body)",
                    "\n  Use the count as a value: n = jnp.asarray(sel.shape[0]), then "
                    "jnp.where(n > 2, a, b), lax.cond or lax.switch on it.")
        return ("where polymask's trace cannot decide a comparison of sizes (plain JAX, "
                "with Python ints, is not stopped there)", "")
    if error.startswith("NonConcreteBooleanIndexError"):  # x[m]: eager JAX runs it
        return ("as it does under jax.jit on the exact arrays",
                "\n  x[m] with a traced boolean m has a data-dependent size: inside "
                "polymask.mask use polymask.boolean_mask(x, m) (or polymask.compress / "
                "polymask.extract).")
    if "returned a value of type" in error:  # a str among the outputs
        return ("as it does under jax.jit on the exact arrays",
                "\n  a jitted function returns arrays and numbers only: return the other "
                "values from outside it (a Python wrapper around the masked call)")
    if not (error.startswith(_TRACED_VALUE_ERRORS) or "is not a valid JAX type" in error
            or (error.startswith("TypeError") and "Tracer" in error)  # ([v] * traced value)
            or (error.startswith("IndexError") and compat.is_traced_slice_bounds_message(error))):
        return "as it does on the exact arrays", ""
    return ("as it does under jax.jit on the exact arrays",
            "\n  polymask traces the function as jax.jit does: a value computed from the "
            "arguments cannot be used as a Python value (if, int(), np.asarray(), a shape); "
            "use jnp.where / lax.cond / jnp ops on it, or pass a Python constant with "
            "functools.partial.")


def names_a_count(text: str) -> bool:
    """Whether ``text`` names a data-dependent size's dim var (``_u1``)."""
    return re.search(rf"\b{compat.FRESH_DIM_PREFIX}\d+\b", text) is not None


def count_limited(case: Case) -> bool:
    """An error case of polymask's limit with data-dependent sizes (two
    selections' counts, ``_u1`` and ``_u2``): neither tracing the sizes one by
    one nor a larger ``max_cases`` helps (diagnostics' messages of a count's
    use say "data-dependent size", also where JAX's own names none)."""
    return not (case.one_size or case.plain) and (
        names_a_count(case.error) or "data-dependent size" in case.error)


def fails_in_plain_jax(case: Case) -> bool:
    """Whether the error case ``case`` is plain JAX's own failure (eager, on the
    exact arrays), not polymask's limit nor a traced value's (a ``TypeError``
    naming a tracer: ``jnp.array_split`` computing with a count's value)."""
    return (case.error_type is not None and "Tracer" not in case.error
            and plain_failure(case.error)[0] == "as it does on the exact arrays")


def _error_text(e: BaseException, internal) -> str:
    text = str(e).strip()
    if not isinstance(e, ShapeError):
        # (a bare ``assert`` has no message: its type alone, not "AssertionError: AssertionError")
        text = (f"{type(e).__name__}: {text.split(chr(10) + chr(10))[0]}" if text
                else type(e).__name__)
        # (JAX's explanation of its symbolic comparisons, scope and all)
        text = re.split(r"\n(?:Using symbolic scope|This error arises)", text)[0]
        # JAX names polymask's internal function and argument ("flat_fun", "flat[0]")
        text = "\n".join(ln for ln in text.splitlines()
                         if "while tracing the function flat_fun" not in ln)
    return display_text(text, internal or {})


def error_case(index: int, conditions, e: BaseException, internal) -> Case:
    where = getattr(e, "polymask_where", None) or user_frame_of_exception(e)
    return Case(index, conditions, error=_error_text(e, internal), where=where,
                # (an undecidable comparison is polymask's limit: plain JAX runs there)
                error_type=None if isinstance(e, (ShapeError, UnsupportedError,
                                                  compat.InconclusiveDimensionOperation))
                else type(e),
                pinned=bool(getattr(e, "polymask_pinned", False)),
                plain=bool(getattr(e, "polymask_plain", False)),
                fixed_size_vars=spec_var_names(getattr(e, "fixed_size_vars", ()), internal))


def spec_var_names(names, internal) -> tuple[str, ...]:
    """``names`` as the spec names them (a case traces ``n`` as ``n__p1``)."""
    spec_name = {name: v for v, (name, _) in (internal or {}).items()}
    return tuple(spec_name.get(n, n) for n in names)


def enumerate_sizes(tree: CaseTree) -> None:
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
        if not _satisfies_constraints(base, values):
            continue  # the prologue rejects these sizes: they reach no case
        for case in tree.reachable_cases(base.internal_values(values)):
            case.reached_by.append(values)


def _satisfies_constraints(prog: MaskedProgram, values: dict[str, int]) -> bool:
    """Whether the user's constraints (``constraints=["n >= 30"]``) hold at these
    sizes: the prologue's own checks, at Python ints."""
    if getattr(prog, "user_scope", None) is None:
        return True
    return not any(bool(c.bad) for c in constraint_checks(prog, values))


# plain JAX changes an output's rank or structure with the size here (jax.scipy.signal.stft
# at n = 0); one padded output cannot hold both, so mask refuses and says how to go on
# (its first words: a runner's refusal text drops mask's remedy, runners/fallback.py)
ONE_OUTPUT_REMEDY_START = "\n  polymask.mask returns one padded output"
ONE_OUTPUT_REMEDY = (
    ONE_OUTPUT_REMEDY_START + " for every size up to the bound, so it "
    "cannot follow that change: leave those sizes out with constraints=[...] (for example "
    "constraints=['n >= 1'] where only n = 0 differs), or use polymask.jit / ragged_map, "
    "which run such sizes per exact shape as jax.jit does")


def _short(treedef, limit: int = 300) -> str:
    text = str(treedef)
    return text if len(text) <= limit else text[:limit] + " ..."


# a branch on a data-dependent size whose sides return different outputs
_ONE_OUTPUT_PER_COUNT_REMEDY = (
    "\n  A branch on a data-dependent size (the count of a polymask.nonzero / "
    "boolean_mask / ... result) runs both ways in one program, which returns one padded "
    "output for every count: make both sides return the same structure, dtype and rank "
    "(jnp.asarray(v, jnp.float32), v.reshape(-1))")


def _differing_outputs(tree: CaseTree, a: Case, b: Case, message: str) -> ShapeError:
    split = _separating_split(tree, a, b)
    on_count = split is not None and split.on_count
    e = ShapeError(message + (_ONE_OUTPUT_PER_COUNT_REMEDY if on_count else ONE_OUTPUT_REMEDY))
    e.fixed_size_vars = () if split is None or on_count else tuple(
        dim_vars_named(tree.display(str(split.cond)), list(tree.internal)))
    return e


def _separating_split(tree: CaseTree, a: Case, b: Case) -> Split | None:
    """The comparison that sends cases ``a`` and ``b`` different ways (its spec
    dim vars: ``jnp.cov``'s rows == 1, not its columns, compared too)."""
    node = tree.root
    while isinstance(node, Split):
        yes = f"{node.cond} >= 0"
        a_yes = yes in a.conditions
        if a_yes != (yes in b.conditions):
            return node
        node = node.yes if a_yes else node.no
    return None


def _static_data_note(a, b) -> str:
    """Where two output structures have the same leaves, what differs is the
    static data of a node (a size or a source location recorded in it)."""
    if a.num_leaves != b.num_leaves or a.num_nodes != b.num_nodes:
        return ""
    return ("\n  Both have the same leaves: a node's static data differs between the "
            "cases (checkify's Error records each check's source traceback, and an index "
            "check the indexed shape: put checkify outside polymask.mask for those, "
            "docs/ecosystem.md)")


_EQUALITY = re.compile(r"'([A-Za-z_]\w*)' [!=]= '(\d+)'|'(\d+)' [!=]= '([A-Za-z_]\w*)'")


def vars_compared_equal_to_constants(splits: list[Split]) -> tuple[str, ...]:
    """Dim vars that a split tests for equality with a constant (flax's check of
    a parameter's shape, ``'s4' == '50'``): their axes meet a fixed size."""
    found: list[str] = []
    for s in splits:
        m = _EQUALITY.fullmatch(s.text.strip())
        var = m and (m.group(1) or m.group(4))
        if var and var not in found:
            found.append(var)
    return tuple(found)


def common_outputs(tree: CaseTree, live: list[Case]) -> None:
    """Make the cases agree on outputs; the padded shape is the max over cases.

    Where cases return different structures, dtypes or ranks (``squeeze()``
    at n = 1, ``jax.scipy.signal.stft`` at n = 0), one padded output cannot
    hold both: the outputs reached by the most sizes are kept, and the other
    cases become error cases (``Case.differs``) whose sizes raise a
    ``ShapeError`` under ``mask`` and run per exact shape under the runners,
    as ``jax.jit`` runs them; the others share the program. ``tree.base``
    becomes the first kept case's program.

    Raises:
      ShapeError: a comparison of a data-dependent count (or none found)
        separates the differing cases, so no size can be left out before the
        program runs (its ``fixed_size_vars``: the dim vars of the comparison
        between them, as ``jnp.cov``'s rows with 1).
    """
    groups: dict = {}
    for c in live:
        groups.setdefault(_output_signature(c.program), []).append(c)
    kept = max(groups.values(), key=lambda g: (sum(len(c.reached_by or ()) for c in g),
                                               len(g), g[0] is live[0]))
    for c in live:
        if c not in kept:
            _leave_out_differing(tree, kept[0], c)
    ref = kept[0].program
    bounds = [list(b) for b in ref.out_bounds()]
    for c in kept[1:]:
        for i, b in enumerate(c.program.out_bounds()):
            bounds[i] = [max(x, y) for x, y in zip(bounds[i], b)]
    tree.base = ref
    tree.out_tree = ref.out_tree
    tree.out_bounds = [tuple(b) for b in bounds]


def _output_signature(prog: MaskedProgram) -> tuple:
    return prog.out_tree, tuple((v.aval.dtype, len(b)) for v, b in
                                zip(prog.closed_jaxpr.jaxpr.outvars, prog.out_bounds()))


def _leave_out_differing(tree: CaseTree, kept: Case, c: Case) -> None:
    """Case ``c``, whose outputs differ from ``kept``'s, becomes an error case
    (``Case.differs``); raise where a data-dependent count separates them."""
    split = _separating_split(tree, kept, c)
    if split is None or split.on_count:
        what, note = _how_outputs_differ(tree, kept, c, tree.case_sizes(kept))
        same = "; every case must return the same pytree" + note if note is not None else ""
        raise _differing_outputs(tree, kept, c,
                                 f"the cases of a size comparison return {what}{same}")
    what, note = _how_outputs_differ(tree, kept, c, "other sizes")
    c.program, c.pinned, c.plain, c.error_type, c.fixed_size_vars = None, False, False, None, ()
    c.error, c.where, c.differs = f"the function returns {what}{note or ''}", split.where, True


def _how_outputs_differ(tree: CaseTree, kept: Case, c: Case, kept_sizes: str):
    """``(what, note)``: how ``c``'s outputs differ from ``kept``'s (described as
    ``kept_sizes``); ``note`` is None where the structures are the same."""
    ref, p = kept.program, c.program
    if p.out_tree != ref.out_tree:
        return (f"different output structures: {_short(ref.out_tree)} for {kept_sizes} and "
                f"{_short(p.out_tree)} for {tree.case_sizes(c)}",
                _static_data_note(ref.out_tree, p.out_tree))
    i, (v, b, w, d) = next(
        (i, t) for i, t in enumerate(zip(p.closed_jaxpr.jaxpr.outvars, p.out_bounds(),
                                         ref.closed_jaxpr.jaxpr.outvars, ref.out_bounds()))
        if t[0].aval.dtype != t[2].aval.dtype or len(t[1]) != len(t[3]))
    return (f"different outputs: output {i} is {v.aval.dtype}[rank {len(b)}] for "
            f"{tree.case_sizes(c)} but {w.aval.dtype}[rank {len(d)}] for {kept_sizes}", None)


# per-size cases that still make one program: its compile costs at most about
# as many compiles of one size (a jnp.cov row count of 1 or 2; a bucket of 4)
PER_SIZE_SHARED_MAX = 4


def per_size_reason(tree: CaseTree) -> str | None:
    """Why a bucket's case tree shares no program across sizes (None: it does).

    Where the function needs a size as a Python value (``range(n)``,
    ``int(x.shape[0])``), ``mask`` traces it once per size (``tree.per_size_at``;
    here every live case is one size of the dim vars needed, more than
    ``PER_SIZE_SHARED_MAX`` of them): one program then holds a copy of the function per size,
    which XLA compiles all at the first call (seconds where ``jax.jit``
    compiles the one shape called), and which gains little per call. A
    runner that sees exact shapes compiles per exact shape instead, as
    ``jax.jit``; ``mask`` under the caller's ``jax.jit`` keeps the one program.
    """
    if tree is None or tree.single or not tree.per_size_at:
        return None
    live = [c for c in tree.cases if c.program is not None and c.reachable]
    # each live case one value of the dim vars the failures needed (the others,
    # symbolic, may span many: a loop over n of (n, m) inputs)
    pinned = sorted({v for _, _, names in tree.per_size_at for v in names})
    if len(live) <= PER_SIZE_SHARED_MAX or not pinned or not all(
            c.reached_by and len({tuple(a[v] for v in pinned) for a in c.reached_by}) == 1
            for c in live):
        return None
    return per_size_text([(at, why) for at, why, _ in tree.per_size_at], len(live))


def per_size_text(failures: list[tuple[str, str]], count: int) -> str:
    """``per_size_reason``'s text: ``failures`` are ``(user line, what failed)``."""
    where = "; ".join(dict.fromkeys(f"{at}{_code_at(at)} ({why})" for at, why in failures))
    return (f"every size is a case of its own ({_NEEDS_A_VALUE} at {where}), so a shared "
            f"program would hold {count} copies of the function, one per size, compiled "
            "together at the first call; each exact shape compiles only its own instead "
            f"{_PER_SIZE_REWRITE}")


def _code_at(at: str) -> str:
    """``: `the line's code` `` for a user line ``path:123 (f)``, else ``""``: JAX's
    error there may name no size (``np.arange(x.shape[0])``: a
    TracerBoolConversionError of NumPy's division)."""
    m = re.match(r"(.+):(\d+) \(", at)
    code = linecache.getline(m.group(1), int(m.group(2))).strip() if m else ""
    return f": `{code}`" if code and len(code) <= 100 else ""


_NEEDS_A_VALUE = ("the function needs the size as a Python value, or something it calls "
                  "rejects a symbolic one")
_PER_SIZE_REWRITE = ("(to share one program, write the jnp / lax form there: x.shape[0] "
                     "instead of len(x) or int(x.shape[0]); jnp.arange(n) or lax.fori_loop "
                     "instead of range(n); jnp instead of NumPy or math on a size, "
                     "jnp.log2(x.shape[0]) for math.log2(len(x)))")


def per_size_cause(text: str) -> str:
    """``per_size_text``'s cause and rewrite alone (an axis made static: its
    other axes still share, so "each exact shape" is not what runs); other
    texts as they are."""
    m = re.match(rf"every size is a case of its own \(({re.escape(_NEEDS_A_VALUE)} at .*)\), so a "
                 r"shared program would hold \d+ copies", text, re.S)
    if m is None:
        return text
    return f"{m.group(1)} {_PER_SIZE_REWRITE}{text[text.index(_PER_SIZE_REWRITE) + len(_PER_SIZE_REWRITE):]}"


class PerSizeBucket(TooManyCases):
    """Every size of a bucket is a case of its own (``per_size_reason``): a
    runner runs it per exact shape instead of compiling one program (or,
    naming the dim vars itself, makes the axes of ``fixed_size_vars``, whose
    sizes the function needs as Python values, static). Raised while the
    cases are traced where ``trace_state().per_size_per_shape`` says the
    runner would (before each size is traced: ``refine.py``), else by the
    runner once they are."""
