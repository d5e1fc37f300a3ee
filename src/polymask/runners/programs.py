"""One compiled program per bucket signature: ``ProgramCache`` (entries, pending
background compiles, stats, one lock) and ``CallPlans``, held by ``polymask.jit``
and ``ragged_map`` alike; the traced function of a program (``build_inner``)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from ..core.binding import specs_of_passed
from ..core.diagnostics import at_call_site, dim_vars_named, user_call_site
from ..core.errors import ShapeError, TooManyCases, plain_type_of
from ..core.masked import Masked
from ..core.plan import CallPlan, plan_call, structure_key
from ..core.specs import spec_identifiers
from ..core.trace_state import mapped_per_example, replaced
from ..tracing.cases.dispatch import host_error
from ..tracing.cases.splitting import DEFAULT_MAX_CASES
from ..tracing.cases.tree import PerSizeBucket, needs_a_size_as_value, per_size_reason
from ..tracing.transform import mask
from .compiling import COMPILE_TICK, background_executor, compile_counter, install_listeners
from .fallback import bucket_text
from .outputs import OutputPlan, output_plan


def checked_compiler_options(options, name: str = "compiler_options") -> dict:
    """``options`` (None or a mapping of XLA option names to values, as for
    ``jax.jit(compiler_options=...)``) as a dict (NumPy scalars as Python ones).

    Raises:
      TypeError: not a mapping, a name that is not a string, or a value that
        is not a string, number or bool (``name``: the parameter, for messages).
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"{name} must be a dict of XLA option names to values, "
                        f"got {type(options).__name__}")
    out = {}
    for k, v in options.items():
        v = v.item() if isinstance(v, np.generic) else v
        if not isinstance(k, str):
            raise TypeError(f"{name}: option names are strings, got {k!r}")
        if not isinstance(v, (str, int, float, bool)):
            raise TypeError(f"{name}: the value of {k!r} must be a str, int, float or "
                            f"bool, got {type(v).__name__}")
        out[k] = v
    return out


def count_value(c) -> int:
    """The next value of an ``itertools.count`` without advancing it (lock-free counters)."""
    r = repr(c)
    return int(r[r.index("(") + 1:-1])


@dataclasses.dataclass(eq=False)
class Entry:
    """One compiled program: a ``jax.jit`` of the masked function at one signature.

    ``outputs`` is filled in while the program is traced (from the masked
    program's symbolic output shapes). ``live`` is True once compiled and until
    evicted; ``tick`` is the last use (approximate LRU, written without a lock).
    ``buckets``/``cover_key`` describe it to tiered lookups.
    """

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    fn: Callable | None = None
    outputs: OutputPlan | None = None
    compile_s: float = 0.0
    live: bool = False
    tick: int = 0
    cover_key: Any = None
    buckets: dict | None = None
    padded: int = 0
    tree: Any = None  # the CaseTree (tracing/cases/), known once traced
    prepared: Any = None  # (program, avals, key) once program_store keyed it
    compiler_options: dict = dataclasses.field(default_factory=dict)  # XLA's, per program
    unshared: str | None = None  # its trace failed: why (the runner runs per exact shape)
    evicted: bool = False  # dropped from the cache (a compile finishing later is dropped too)


def at_call_site_error(e: ShapeError | str) -> ShapeError:
    """``e`` (or a ``ShapeError`` of this message) naming the user's call site."""
    return at_call_site(ShapeError(e) if isinstance(e, str) else e, user_call_site())


def _sizes(var_names, values) -> dict[str, int]:
    return dict(zip(var_names, (int(v) for v in values)))


def _reached_cases(entry: Entry, var_names, values) -> list:
    """The cases of ``entry``'s tree these logical sizes reach (past a split
    on a count: every case the count may choose)."""
    tree = entry.tree
    return tree.reachable_cases(tree.base.internal_values(_sizes(var_names, values)))


def raise_case_error(entry: Entry, var_names, values, prefix: str = "") -> None:
    """Raise ``ShapeError`` when these logical sizes reach an error case of the
    entry's decision tree (the plain function fails at them: top_k with k > n).

    Checked on the host: the compiled program has no host callback.
    """
    if entry.tree is None:
        return
    error = host_error(entry.tree, _sizes(var_names, values), prefix)
    if error is not None:
        raise error


def case_error_is_plain(entry: Entry, var_names, values) -> bool:
    """Whether the error case these sizes reach is plain JAX's own failure (its
    case was traced at these sizes), not a case polymask could not trace with
    symbolic sizes (``np.arange(n)`` past the per-size limit)."""
    return all(c.pinned for c in _reached_cases(entry, var_names, values)
               if c.error is not None)


def reaches_error_case(entry: Entry, var_names, values) -> bool:
    """Whether these logical sizes reach an error case of ``entry``'s tree."""
    return entry.tree is not None and host_error(
        entry.tree, _sizes(var_names, values)) is not None


def reaches_untraced_case(entry: Entry, var_names, values) -> bool:
    """Whether these sizes reach an error case of ``entry`` that polymask could
    not trace symbolically (not plain JAX's failure): a smaller bucket, traced
    size by size under the per-size limit, may still share a program."""
    if not reaches_error_case(entry, var_names, values):
        return False
    # (outputs of another rank are so in every bucket: Case.differs)
    return not any(c.differs for c in _reached_cases(entry, var_names, values)) and \
        not case_error_is_plain(entry, var_names, values)


def fallback_where(entry: Entry | None, var_names, values, bucket: dict) -> str:
    """How ``.fallbacks()`` and its warning name the sizes of an error case that
    plain ``jax.jit`` runs: the bucket (``"n <= 8"``), or the case's own sizes
    where only its outputs differ (``Case.differs``: ``"n in {1} (of n <= 8)"``;
    the bucket's other sizes share its program)."""
    where = bucket_text(bucket)
    if entry is None or entry.tree is None:
        return where
    differing = [c for c in _reached_cases(entry, var_names, values) if c.differs]
    return f"{entry.tree.case_sizes(differing[0])} (of {where})" if differing else where


def build_inner(fun, entry: Entry, in_tree, plan: CallPlan, in_specs, constraints,
                n_bcast=0, bcast_tree=None, n_bcast_leaves=0, max_cases=DEFAULT_MAX_CASES,
                per_size_per_shape: bool = False):
    """The traced function of ``entry`` (see ``build_inner_and_cases``)."""
    return build_inner_and_cases(fun, entry, in_tree, plan, in_specs, constraints, n_bcast,
                                 bcast_tree, n_bcast_leaves, max_cases=max_cases,
                                 per_size_per_shape=per_size_per_shape)[0]


def build_inner_and_cases(fun, entry: Entry, in_tree, plan: CallPlan, in_specs, constraints,
                          n_bcast=0, bcast_tree=None, n_bcast_leaves=0, row_guard=False,
                          max_cases=DEFAULT_MAX_CASES, per_size_per_shape: bool = False):
    """The traced function: rebuild ``Masked`` inputs from a size vector, run ``mask(fun)``.

    Its arguments are the broadcast leaves, the static leaves, the padded
    dynamic leaves and the logical-size vector (``plan.var_names`` order). It
    returns the output data leaves, plus the data-dependent output sizes as
    one int32 vector when there are any (``entry.outputs.device_axes``).
    Dynamic inputs are padded with zeros by the runner, so the masked program
    skips its entry select (``zero_padded=True``). ``row_guard``
    (``ragged_map``): the size vector ends with one more entry, 0 for a spare
    row of a batch (no host callback or run-time check acts there,
    ``MaskedFunction.call_guarded``), and a ``pure_callback`` without a
    ``vmap_method`` is called per example (``rules.callbacks``).
    ``per_size_per_shape`` (``polymask.jit`` with its fallback): a case tree
    whose every size is a case of its own (``per_size_reason``) raises
    ``PerSizeBucket`` once traced, so the bucket runs per exact shape.

    Returns ``(inner, case_tree)``: ``case_tree(*flat_in)`` traces only the
    cases (the same ``mask``, so ``inner``'s trace reuses them), fills in the
    entry's output plan and returns the ``CaseTree`` (``program_store`` keys).
    """
    if in_specs is None:  # the plan's dim vars (equal sizes share one: plan_call)
        in_specs = specs_of_plan(in_tree, plan)
    mask_specs = (None,) * n_bcast + tuple(in_specs)
    masked = mask(fun, mask_specs, constraints=constraints, checks=False, zero_padded=True,
                  differentiable=False, max_cases=max_cases)
    var_index = {v: i for i, v in enumerate(plan.var_names)}
    n_static = sum(1 for p in plan.leaves if p.static)

    def size(a, sizes):
        if a.var is None:
            return a.expr
        s = sizes[var_index[a.var]]
        s = s * a.coeff if a.coeff != 1 else s
        return s + a.offset if a.offset else s

    def logical(axes, sizes):
        return tuple(size(a, sizes) for a in axes)

    def rebuild(flat_in):
        bcast_leaves = flat_in[:n_bcast_leaves]
        static_it = iter(flat_in[n_bcast_leaves:n_bcast_leaves + n_static])
        dyn_it = iter(flat_in[n_bcast_leaves + n_static:-1])
        sizes = flat_in[-1]
        flat = [next(static_it) if p.static else Masked(
                    compat.as_weakly_typed(next(dyn_it)) if p.weak else next(dyn_it),
                    logical(p.axes, sizes)) for p in plan.leaves]
        args = jax.tree_util.tree_unflatten(in_tree, flat)
        if n_bcast:
            args = tuple(jax.tree_util.tree_unflatten(bcast_tree, list(bcast_leaves))) + args
        return args

    def note_cases(args):
        """Trace the cases (once per signature: ``mask`` caches them) and put the
        output plan and the decision tree on the entry."""
        with replaced("per_size_per_shape", per_size_per_shape):
            tree, _ = masked.cases(*args)  # the tracer's symbolic output shapes
        entry.outputs = output_plan(tree.base, tree.single)
        entry.tree = tree
        if per_size_per_shape and per_size_reason(tree) is not None:
            raise PerSizeBucket(per_size_reason(tree), fixed_size_vars=tuple(dict.fromkeys(
                v for _, _, names in tree.per_size_at for v in names)))
        return tree

    def inner(*flat_in):
        args = rebuild(flat_in)
        note_cases(args)
        outputs = entry.outputs
        if row_guard:  # ragged_map: a batch of examples
            with mapped_per_example():
                out = masked.call_guarded(flat_in[-1][-1] != 0, *args)
        else:  # polymask.jit: the warnings the trace recorded are said per shape
            out = masked.call_for_runner(None, *args)
        out_leaves = jax.tree_util.tree_leaves(out, is_leaf=lambda x: isinstance(x, Masked))
        datas = [o.data if isinstance(o, Masked) else jnp.asarray(o) for o in out_leaves]
        if not outputs.device_axes:
            return datas
        return datas, jnp.stack([jnp.asarray(out_leaves[li].shape[k], jnp.int32).reshape(())
                                 for li, k in outputs.device_axes])

    return inner, lambda *flat_in: note_cases(rebuild(flat_in))


def jit_program(entry: Entry, make_fn, args, compile_now: bool = False):
    """The entry's callable program: ``jax.jit`` of ``make_fn(entry)``, compiled
    on its first call, or now for ``args`` (values or abstract) with
    ``compile_now`` (``jax.jit``'s cache keeps it for the calls)."""
    fn = jax.jit(make_fn(entry), compiler_options=entry.compiler_options or None)
    if compile_now:
        fn.lower(*args).compile()
    return fn


def specs_of_plan(in_tree, plan: CallPlan) -> tuple:
    """Specs (a tuple of per-argument pytrees of spec strings, None for a
    static leaf) naming each dynamic axis by the plan's dim var expression (``s0``,
    ``s0 + 1``)."""
    leaves = [None if p.static else ", ".join(str(a.expr) for a in p.axes)
              for p in plan.leaves]
    return tuple(jax.tree_util.tree_unflatten(in_tree, leaves))


class CallPlans:
    """The ``CallPlan`` of each call signature (tree, exact shapes and dtypes, specs)."""

    def __init__(self, in_specs, constraints, policy_for, equal_sizes_share: bool = False):
        self.in_specs = in_specs
        self.constraints = constraints
        self.policy_for = policy_for
        self.equal_sizes_share = equal_sizes_share  # (plan_call's, for the runner's specs)
        # with equal_sizes_share: (leaf path, axis) of axes that met a fixed size,
        # (leaf path, axis, size) of axes static at one size (a size-1 broadcast,
        # coinciding sizes), and (leaf path, axis) -> (leaf path, axis, offset)
        # of axes a trace found to be another axis plus a constant
        self.static_axes: frozenset[tuple] = frozenset()
        self.related_axes: dict[tuple, tuple] = {}
        # without equal_sizes_share: the specs' dim vars whose axes are static
        # (the function needs their sizes as Python values)
        self.static_vars: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._plans: dict = {}

    def plan(self, args, in_specs=None, spec_key=None) -> tuple[CallPlan, list, Any]:
        """``(plan, leaves, tree)`` of ``args``; ``in_specs``/``spec_key`` replace the
        runner's specs (``ragged_map`` with specs read off the examples)."""
        if spec_key is None:
            in_specs = specs_of_passed(self.in_specs, len(args))
        leaves, tree = jax.tree_util.tree_flatten(tuple(args))
        key = (structure_key(tree, leaves), spec_key)
        plan = self._plans.get(key)
        if plan is None:
            try:
                _refuse_masked(args)
                plan = plan_call(args, in_specs, self.constraints, self.policy_for,
                                 equal_sizes_share=self.equal_sizes_share and spec_key is None,
                                 static_axes=self.static_axes,
                                 related_axes=self.related_axes)
                if spec_key is None and self.static_vars & set(plan.var_names):
                    # (planned with them first: their sizes and constraints checked)
                    plan = plan_call(args, in_specs, self.constraints_of_static_plans(),
                                     self.policy_for, static_vars=self.static_vars)
            except ShapeError as e:
                raise at_call_site_error(e) from None
            with self._lock:
                if len(self._plans) > 4096:
                    self._plans.clear()
                self._plans[key] = plan
        return plan, leaves, tree

    def adapt_to(self, plan: CallPlan, error: BaseException) -> bool:
        """Plan later calls around what ``error``, the failed trace of ``plan``,
        found, where the runner names the dim vars itself
        (``equal_sizes_share``): True when the call can be planned and traced
        again (each time one more axis is static or related, so this ends),
        else False.

        - An axis that met a fixed size (the error's ``fixed_size_vars``; ``x @
          W`` with ``W`` closed over) is static.
        - A broadcast that failed on a dim var of size 1 in this call (``(n, 1)
          * (1, m)``: both 1s are one dim var) makes that var's axes static at
          size 1: a size-1 axis broadcasts.
        - Two shapes that must be equal, one dim var plus a constant each, and
          equal at this call's sizes (``r + v[1:]`` with ``v`` one longer than
          ``r``: ``(s0,)`` and ``(s1 - 1,)``) make the larger var's axes that
          of the other plus the constant (``s0 + 1``) in calls whose sizes keep
          the relation, as ``in_specs=("T", "T + 1")`` would.
        """
        if not self.equal_sizes_share:
            return self._make_spec_vars_static(plan, error)
        # a relation first: where one var is pinned, a trace also says that the
        # other met a fixed size (the pinned size), which would make it static
        if self._relate(plan, error):
            return True
        names = getattr(error, "fixed_size_vars", ())
        ones = () if names else _broadcast_ones(plan, error)
        if not (names or ones):
            return False
        # a fixed size: that axis is static at every size, unless its dim var
        # stands for several axes only because their sizes coincided in this
        # call (jnp.cov first called at (3, 3)): then at this size only, and a
        # call of other sizes finds which of them met it; a size-1 broadcast: at
        # size 1 only ((path, axis, 1): the first call (1, 1) must not pin n)
        # (at this size only too where the plan has an axis static at its size
        # only: the fixed size met may be that axis's, another argument's)
        shared = _coinciding_vars(plan)
        provisional = self._has_axis_static_at_its_size(plan)
        axes = {(leaf.path, k) if a.var in names and a.var not in shared and not provisional
                else (leaf.path, k, leaf.shape[k])
                for leaf in plan.leaves if leaf.axes is not None
                for k, a in enumerate(leaf.axes) if a.var in names or a.var in ones}
        if axes:
            with self._lock:
                if not axes <= self.static_axes:
                    self.static_axes = self.static_axes | axes
                    self._plans.clear()
        return bool(axes)

    def constraints_of_static_plans(self) -> tuple[str, ...]:
        """The user's constraints that name no static dim var (``static_vars``:
        those are checked where the call is planned with the user's specs)."""
        return tuple(c for c in self.constraints
                     if not spec_identifiers(c) & self.static_vars)

    def _make_spec_vars_static(self, plan: CallPlan, error: BaseException) -> bool:
        """With the user's specs: the dim vars whose sizes the function needs
        as Python values (``for i in range(x.shape[0])``: one case per size)
        are static in later calls, so that each size of them compiles one
        program for every size of the others (per exact shape before: ``"n,
        m"`` compiled each ``(n, m)``). Only a var every axis of which it names
        alone (not ``"n * m"``), and where another var stays symbolic (else
        the bucket runs per exact shape, as before)."""
        names = self._new_static_vars(plan, error)
        if not names:
            return False
        with self._lock:
            self.static_vars = self.static_vars | names
            self._plans.clear()
        return True

    def _new_static_vars(self, plan: CallPlan, error: BaseException) -> set[str]:
        """The spec dim vars ``error`` needs as Python values that are not static
        yet, where another var of ``plan`` stays symbolic (else none)."""
        names = set(_spec_vars_needed(plan, error)) - self.static_vars
        return names if set(plan.var_names) - names - self.static_vars else set()

    def _has_axis_static_at_its_size(self, plan: CallPlan) -> bool:
        """Whether an axis of ``plan`` is static by a ``(path, axis, size)`` entry."""
        return any((leaf.path, k, leaf.shape[k]) in self.static_axes
                   for leaf in plan.leaves if leaf.axes is not None
                   for k, a in enumerate(leaf.axes) if a.var is None)

    def may_adapt_to(self, plan: CallPlan, error: BaseException) -> bool:
        """Whether ``adapt_to(plan, error)`` could plan the call again (it
        changes nothing here)."""
        if not self.equal_sizes_share:
            return bool(self._new_static_vars(plan, error))
        return bool(
            getattr(error, "fixed_size_vars", ()) or _broadcast_ones(plan, error)
            or _equal_size_relations(plan, error))

    def _relate(self, plan: CallPlan, error: BaseException) -> bool:
        """``adapt_to``'s relations between axes (see there)."""
        related = {}
        for derived, base, offset in _equal_size_relations(plan, error):
            base_axis = next(((leaf.path, k) for leaf in plan.leaves
                              for k, a in enumerate(leaf.axes or ())
                              if a.var == base and (a.coeff, a.offset) == (1, 0)), None)
            if base_axis is None:
                continue
            related.update({(leaf.path, k): (*base_axis, offset)
                            for leaf in plan.leaves for k, a in enumerate(leaf.axes or ())
                            if a.var == derived and (a.coeff, a.offset) == (1, 0)})
        with self._lock:
            new = {k: v for k, v in related.items() if self.related_axes.get(k) != v}
            if new:
                self.related_axes = {**self.related_axes, **new}
                self._plans.clear()
        return bool(new)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


def needs_a_value(error: BaseException) -> bool:
    """Whether ``error`` is the function needing a size as a Python value
    (``np.arange(x.shape[0])``, ``int(n)``, ``if n > k``: ``TooManyCases``),
    not an axis meeting a fixed size (``x @ W``)."""
    if isinstance(error, PerSizeBucket):
        return True
    plain = plain_type_of(error)
    return isinstance(error, TooManyCases) and (
        (plain is not None and issubclass(plain, jax.errors.ConcretizationTypeError))
        or needs_a_size_as_value(error))


def _spec_vars_needed(plan: CallPlan, error: BaseException) -> tuple[str, ...]:
    """The dim vars of ``plan`` (the user's specs) whose sizes ``error`` says
    the function needs as Python values, each naming its axes alone."""
    if not needs_a_value(error):
        return ()
    names = {v for v in getattr(error, "fixed_size_vars", ()) if v in plan.var_names}
    for leaf in plan.leaves:
        for a in leaf.axes or ():
            used = compat.dim_vars(a.expr) if compat.is_dim_expr(a.expr) else set()
            if used & names and not used <= names:
                return ()
    return tuple(sorted(names))


def _coinciding_vars(plan: CallPlan) -> set[str]:
    """The dim vars that stand for more than one axis of ``plan``."""
    seen: set[str] = set()
    shared: set[str] = set()
    for leaf in plan.leaves:
        for a in leaf.axes or ():
            if a.var is not None:
                (shared if a.var in seen else seen).add(a.var)
    return shared


def _equal_size_relations(plan: CallPlan, error: BaseException) -> list[tuple[str, str, int]]:
    """``(derived var, base var, offset)`` with ``derived = base + offset``
    (offset > 0) for each pair of sizes that ``error``'s message gives as two
    shapes that must be equal (aligned from the right, as broadcasting and
    JAX's messages align them), each one dim var of ``plan`` plus a constant
    (``max(0, s1 - 3)`` too: ``s1 - 3`` where it is not clamped), equal at
    this call's sizes: ``(s0,), (s1 - 1,)`` at s0 = 5, s1 = 6 gives
    ``("s1", "s0", 1)``."""
    values = dict(zip(plan.var_names, plan.values))
    found = []
    for line in str(error).splitlines():
        if "shape" not in line.lower():
            continue
        tuples = _parenthesised_lists(line)
        for i, a in enumerate(tuples):
            for b in tuples[i + 1:]:
                for x, y in zip(reversed(a), reversed(b)):
                    fx, fy = _var_plus_constant(x, values), _var_plus_constant(y, values)
                    if fx is None or fy is None or fx[0] == fy[0]:
                        continue
                    (vx, cx), (vy, cy) = fx, fy
                    if values[vx] + cx != values[vy] + cy or cx == cy:
                        continue
                    # vx + cx == vy + cy: the var with the smaller constant is larger
                    rel = (vx, vy, cy - cx) if cx < cy else (vy, vx, cx - cy)
                    if rel not in found:
                        found.append(rel)
    return found


def _parenthesised_lists(line: str) -> list[list[str]]:
    """The comma-separated entries of each outermost ``(...)`` group of
    ``line`` (nested parentheses stay in their entry: ``(max(0, s1 - 1),)``
    is one entry)."""
    groups, depth, entry, entries = [], 0, [], []
    for ch in line:
        if ch == "(":
            depth += 1
            if depth == 1:
                entry, entries = [], []
                continue
        elif ch == ")":
            depth -= 1
            if depth == 0:
                entries.append("".join(entry))
                groups.append([e.strip() for e in entries if e.strip()])
                continue
        elif ch == "," and depth == 1:
            entries.append("".join(entry))
            entry = []
            continue
        if depth >= 1:
            entry.append(ch)
        depth = max(depth, 0)
    return groups


def _var_plus_constant(text: str, values: Mapping[str, int]) -> tuple[str, int] | None:
    """``(var, c)`` where the size expression ``text`` is ``var + c`` for one dim
    var of ``values`` at its value there (JAX's form of it: ``s1 - 1``,
    ``max(0, s1 - 3)``), else None."""
    if not any(v in text for v in values):
        return None
    try:
        (e,) = jax.export.symbolic_shape(text)
        names = compat.dim_vars(e)
        if len(names) != 1 or not names <= values.keys():
            return None
        (v,) = names
        at = lambda n: int(compat.evaluate_dim(e, {v: n}))  # noqa: E731
        n = int(values[v])
        c = at(n) - n
        if at(n + 1) - (n + 1) != c:  # not of slope 1 here
            return None
        return v, c
    except Exception:  # noqa: BLE001 - not one size expression of these vars
        return None


def _broadcast_ones(plan: CallPlan, error: BaseException) -> tuple[str, ...]:
    """The dim vars of size 1 in ``plan`` that a failed broadcast names."""
    text = str(error)
    if "broadcast" not in text.lower():
        return ()
    return tuple(dim_vars_named(text, [v for v, n in zip(plan.var_names, plan.values)
                                       if n == 1]))


BASE_STATS = ("calls", "compiles", "cache_hits", "evictions", "compile_time_s",
              "logical_elements", "padded_elements", "xla_compiles", "persistent_cache_hits",
              "background_compiles", "precompiles", "tiered_calls", "pad_compiles")


class ProgramCache:
    """The compiled programs of one runner (``polymask.jit``, ``ragged_map``), one
    per key (a bucket signature): the entries (least recently used evicted past
    ``cache_size``), the background compiles still pending, and the stats, under
    one lock.

    ``build_program(entry, make_fn, args, compile_now)`` makes an entry's
    callable (default ``jit_program``; ``ragged_map``: from the program store
    when one is active); ``options_for(key)`` gives the XLA options of a key's
    program (default: ``compiler_options``). ``extra_stats``: counters of the
    runner's own, starting at 0.
    """

    def __init__(self, cache_size: int, compiler_options: dict, *, build_program=jit_program,
                 options_for: Callable | None = None, extra_stats: tuple[str, ...] = ()):
        self.cache_size = int(cache_size)
        self.compiler_options = compiler_options
        self.build_program = build_program
        self.options_for = options_for or (lambda key: self.compiler_options)
        self.lock = threading.Lock()
        self._entries: dict = {}
        self._pending: dict = {}  # key -> Future of a background compile
        self._stats = dict.fromkeys(BASE_STATS + tuple(extra_stats), 0)
        self._stats["compile_time_s"] = 0.0
        install_listeners()

    # -- entries -----------------------------------------------------------------
    def get(self, key) -> Entry | None:
        """The entry of ``key``, or None (no stats, no LRU tick)."""
        return self._entries.get(key)

    def entries(self) -> list[Entry]:
        with self.lock:
            return list(self._entries.values())

    def entry(self, key, hit: bool = True) -> Entry:
        """The entry of ``key`` (created, and the least recently used evicted, if absent)."""
        with self.lock:
            e = self._entries.get(key)
            if e is not None:
                if e.live and hit:
                    self._stats["cache_hits"] += 1
                e.tick = next(COMPILE_TICK)
                return e
            e = Entry(tick=next(COMPILE_TICK), compiler_options=self.options_for(key))
            self._entries[key] = e
            while len(self._entries) > self.cache_size:
                old_key = min(self._entries, key=lambda k: self._entries[k].tick)
                old = self._entries.pop(old_key)
                old.live, old.evicted = False, True
                if old.fn is not None:  # a program dropped (not a bucket still compiling)
                    self._stats["evictions"] += 1
            return e

    @property
    def has_evicted(self) -> bool:
        """Whether a compiled program was ever dropped for room (the cache is
        under pressure: more buckets in use than it holds)."""
        return self._stats["evictions"] > 0

    def compile_run(self, entry: Entry, make_fn, flat_args, before_compile=None):
        """Trace, compile and run ``entry`` on ``flat_args`` once (under its lock).

        ``before_compile(entry)``, when given, runs between the trace (the
        entry's case tree is known) and XLA's compile, and may raise: a call
        whose own case sends it elsewhere compiles nothing.

        Returns the outputs, or None when another thread compiled it first.
        """
        with entry.lock:
            if entry.fn is not None:
                return None
            t0 = time.perf_counter()
            with compile_counter() as cc:
                try:
                    fn = self.build_program(entry, make_fn, flat_args)
                    if before_compile is not None:
                        fn.trace(*flat_args)  # (jax.jit's trace cache keeps it for the call)
                except ShapeError as e:  # from the trace: name the user's call
                    raise at_call_site_error(e) from None
                if before_compile is not None:
                    before_compile(entry)
                try:
                    out = fn(*flat_args)
                except ShapeError as e:
                    raise at_call_site_error(e) from None
                jax.block_until_ready(out)
            self._install(entry, fn, time.perf_counter() - t0, cc, None)
            return out

    def call_entry(self, entry: Entry, make_fn, flat_args):
        """Run ``entry`` (tracing and compiling it on first use, once, under its lock)."""
        if entry.fn is None:
            out = self.compile_run(entry, make_fn, flat_args)
            if out is not None:
                return out
        return entry.fn(*flat_args)

    def precompile_entry(self, entry: Entry, make_fn, avals,
                         kind: str | None = "precompiles", before_compile=None) -> bool:
        """Lower and compile ``entry`` for ``avals`` (abstract or concrete
        arguments; no run). True if compiled now. ``before_compile``: as
        ``compile_run``'s."""
        with entry.lock:
            if entry.fn is not None:
                return False
            t0 = time.perf_counter()
            with compile_counter() as cc:
                if before_compile is None:
                    fn = self.build_program(entry, make_fn, avals, compile_now=True)
                else:
                    fn = self.build_program(entry, make_fn, avals)
                    fn.trace(*avals)
                    before_compile(entry)
                    fn.lower(*avals).compile()
            self._install(entry, fn, time.perf_counter() - t0, cc, kind)
            return True

    def _install(self, entry: Entry, fn, seconds: float, cc, kind: str | None) -> None:
        """Make ``fn`` the entry's compiled program and count the compile (``kind``:
        an extra counter, e.g. ``"precompiles"``)."""
        entry.compile_s = seconds
        entry.fn = fn
        with self.lock:
            entry.live = not entry.evicted  # evicted while compiling: dropped at once
            st = self._stats
            st["evictions"] += entry.evicted
            st["compiles"] += 1
            st["compile_time_s"] += seconds
            st["xla_compiles"] += cc.compiles
            st["persistent_cache_hits"] += cc.cache_hits
            if kind is not None:
                st[kind] += 1

    # -- background compiles -------------------------------------------------------
    def is_pending(self, key) -> bool:
        with self.lock:
            return key in self._pending

    def submit_once(self, key, work: Callable, defer: bool = False) -> None:
        """Run ``work()`` on the background compiler unless a job for ``key`` is
        pending; ``key`` stops being pending when ``work`` returns or raises.
        ``defer``: the compile yields to calls (``BackgroundCompiler``)."""
        with self.lock:
            if key in self._pending:
                return

            def job():
                try:
                    return work()
                finally:
                    with self.lock:
                        self._pending.pop(key, None)

            self._pending[key] = background_executor().submit(job, defer=defer)

    def urge(self, key) -> None:
        """The pending background compile of ``key`` starts without waiting
        (``BackgroundCompiler.urge``)."""
        with self.lock:
            fut = self._pending.get(key)
        if fut is not None:
            background_executor().urge(fut)

    def wait(self) -> None:
        """Wait for the background compiles submitted so far (deferred ones start now)."""
        with background_executor().hurried():
            while True:
                with self.lock:
                    futs = list(self._pending.values())
                if not futs:
                    return
                for f in futs:
                    f.result()

    # -- stats -----------------------------------------------------------------------
    def add(self, **counts) -> None:
        """Add to counters of the stats (``calls=1``, ``xla_compiles=cc.compiles``)."""
        with self.lock:
            for k, n in counts.items():
                self._stats[k] += n

    def count_call(self, logical: int, padded: int) -> None:
        self.add(calls=1, logical_elements=logical, padded_elements=padded)

    def count_compiles(self, cc) -> None:
        """Count XLA compiles made outside ``_install`` (a stored program's fallback)."""
        self.add(xla_compiles=cc.compiles, persistent_cache_hits=cc.cache_hits)

    def stats(self) -> dict:
        """The counters (with ``logical_elements``/``padded_elements``) and ``cache_size``."""
        with self.lock:
            s = dict(self._stats)
            s["cache_size"] = sum(1 for e in self._entries.values() if e.live)
        return s

    def clear(self) -> None:
        """Drop every compiled program (stats are kept)."""
        with self.lock:
            for e in self._entries.values():
                e.live = False
            self._entries.clear()


def _refuse_masked(args) -> None:
    """A ``Masked`` value given to a runner, which takes exact arrays and pads
    them itself (its data and sizes would be read as two arrays)."""
    for i, a in enumerate(args):
        flat = jax.tree_util.tree_flatten_with_path(a, is_leaf=lambda v: isinstance(v, Masked))[0]
        for path, v in flat:
            if isinstance(v, Masked):
                raise ShapeError(
                    f"args[{i}]{jax.tree_util.keystr(path)} is a Masked value (padded data and a "
                    "logical shape): polymask.jit and ragged_map take exact arrays and pad "
                    "them themselves; pass its .unpad(), or call polymask.mask(f) with "
                    "padded values (inside your own jax.jit, where sizes are traced, only "
                    "the latter)")


def finish_stats(s: dict) -> dict:
    """``s`` with the padding fraction in place of the element counts."""
    padded = s.pop("padded_elements")
    logical = s.pop("logical_elements")
    s["padding_fraction"] = (1.0 - logical / padded) if padded else 0.0
    return s


STATS_DOC = """Calls, compiles, cache hits, evictions, compile time and padding fraction.

        - ``calls``: calls (``ragged_map``: batches run).
        - ``compiles``: bucket programs made ready, compiled or loaded from a
          cache (foreground, background and precompiled);
          ``background_compiles``, ``precompiles``, ``refined_compiles``,
          ``stored_loads``: of those. ``xla_compiles`` says how many XLA
          actually compiled.
        - ``cache_hits``: calls that found a compiled program to run in (their
          own, or a covering one: ``tiered_calls``). A call whose compile
          fails is no hit. A call that
          waited for its program's background compile is neither a hit nor a
          compile of its own, so with background compiles ``compiles +
          cache_hits`` can exceed ``calls``.
        - ``compile_time_s``: seconds spent making programs ready (tracing,
          compiling or loading; a program compiled by a call includes that
          call's first run), summed over threads.
        - ``xla_compiles``: every XLA compile the programs caused
          (``jax.monitoring``); ``persistent_cache_hits``: programs loaded
          from the persistent compilation cache instead.
        - ``evictions``, ``cache_size``: programs dropped (least recently
          used) and compiled programs kept (a program still queued for a
          background compile is not counted).
        - ``tiered_calls``: ``polymask.jit`` calls served by a larger bucket
          while their own compiled in the background.
        - ``pad_compiles``: device-side input pads compiled (accelerators,
          ``jax.Array`` inputs; one per input shape).
        - ``padding_fraction``: share of the padded input elements that are
          padding, over all calls so far.
        - ``exact_compiles``, ``exact_calls``: the per-shape fallback (sizes a
          bucket program cannot share, ``fallbacks()`` says why): programs
          compiled per exact shape under ``jax.jit`` (not in ``compiles``;
          in ``xla_compiles``) and calls run in them (a call first served by
          a covering bucket counts in ``tiered_calls`` instead).
        - ``ragged_map`` only: ``refined_compiles`` (tighter programs made
          ready in the background after a call, ``refine_buckets``; not in
          ``background_compiles``) and ``stored_loads`` (programs loaded from
          the program store). ``packed``: the packed layout's own counts
          (``real_positions``, ``computed_positions``, ``exact_reruns``:
          calls rerun in the exact row program because a row met a rule's
          rare path, a NaN or inf before an attention product; its compile
          is in ``compiles``).
        - ``polymask.jit`` only: ``traced_calls``, calls under ``jax.grad``,
          ``jax.jit`` or ``jax.vmap`` (sizes checked, ``fun`` traced into the
          caller's program; not in ``calls``).
        """
