"""Symbolic tracing: the user's function as a jaxpr over dimension expressions.

``trace(fun, args, in_specs, constraints)`` traces ``fun`` once per padded
signature with ``jax.make_jaxpr`` on ``ShapeDtypeStruct``s whose shapes are
``jax.export`` dimension expressions, so every size-derived value stays
symbolic (``dim_as_value``, as Thunder's shape primitive keeps it). The result
is a ``MaskedProgram``: the jaxpr plus everything the prologue and the
interpreter need to run it on padded arrays.

``current_scope()`` is the ``SymbolicScope`` of the trace in progress; the
data-dependent ops create their fresh dim vars in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from ..core import dimvars
from ..core.diagnostics import (
    called,
    is_library_frame,
    is_shape_mismatch,
    lower_bound_that_fixes,
    translate_trace_error,
    user_frame_of_exception,
)
from ..core.errors import ShapeError, UnsupportedError
from ..core.masked import Masked, ragged_batch_hint
from ..core.shapes import DimEnv, canonical_dtype, is_static
from ..core.specs import (
    AxisSpec,
    broadcast_specs,
    parse_leaf_spec,
    scope_and_name_generator,
    spec_identifiers,
    unknown_dim_vars_error,
)
from ..core.trace_state import current_scope, scope_active
from .registry import check_preconditions
from .trace_warnings import recording

__all__ = ["MaskedProgram", "NoSizeMeets", "trace", "trace_flat", "current_scope", "is_masked",
           "flatten_args", "dtype_of"]


def is_masked(x) -> bool:
    return isinstance(x, Masked)


def dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def flatten_args(args: Sequence[Any]):
    """Leaves (a ``Masked`` is one leaf) and treedef of a call's positional args."""
    return jax.tree_util.tree_flatten(tuple(args), is_leaf=is_masked)


def internal_values(internal: dict[str, tuple[str, int]],
                    values: dict[str, Any]) -> dict[str, Any]:
    """Internal dim var values (``n__p1 = n + 1``) from the spec dim vars' values."""
    out = {}
    for v, x in values.items():
        name, off = internal.get(v, (v, 0))
        if off == 0:
            out[name] = x
        elif is_static(x):
            out[name] = int(x) + off
        else:
            out[name] = jnp.asarray(x, jnp.int32) + off
    return out


@dataclasses.dataclass
class SizeSignature:
    """The dim vars of a trace that failed (``exception.polymask_signature``):
    enough for ``cases/splitting.py`` to trace it again once per size."""

    var_order: list[str]
    var_bounds: dict[str, int]
    internal: dict[str, tuple[str, int]]
    scope: Any
    dim_bounds: dict[str, int]
    user_scope: Any = None  # the user's constraints over the spec dim vars

    def internal_values(self, values: dict[str, Any]) -> dict[str, Any]:
        return internal_values(self.internal, values)


@dataclasses.dataclass(frozen=True)
class CountCheck:
    """A condition on data-dependent sizes (``"_u1 - 2 >= 0"``, internal dim
    var names) that a program was traced under because plain JAX fails on its
    other side (``lax.top_k(sel, 2)`` of fewer than 2 entries;
    ``cases/splitting.py``). The counts are known only while the program
    runs: the rule binding the last of them checks it there, and where it
    does not hold raises ``message``, as plain JAX raises at those counts."""

    condition: str
    counts: frozenset
    message: str
    error_type: type | None = None  # plain JAX's exception there (the ShapeError is one too)

    @classmethod
    def of(cls, condition: str, text: str, where: str, failure, plain: bool) -> CountCheck:
        """The check of ``condition`` (a split's outcome), whose other outcome
        is the error case ``failure``, plain JAX's own failure or (not
        ``plain``) polymask's limit; ``text``/``where``: the comparison."""
        (expr,) = jax.export.symbolic_shape(condition.rsplit(" ", 2)[0])
        counts = frozenset(v for v in compat.dim_vars(expr) if compat.is_fresh_dim_name(v))
        said = (f"the function fails here in plain JAX: {failure.error}"
                if plain else  # (polymask's own limit there)
                f"polymask cannot trace the function for these sizes: {failure.error}")
        return cls(condition, counts, (
            f"{said} (at {failure.where}). A data-dependent size decides it (the "
            f"comparison {text} at {where}); polymask runs the comparison's other "
            "outcome, and checks the count while the program runs"),
            failure.error_type if plain else None)

    def violated(self, dims: DimEnv):
        """Whether the condition fails at ``dims``' values: a bool, or a traced one."""
        expr, op, _ = self.condition.rsplit(" ", 2)
        (e,) = jax.export.symbolic_shape(expr, scope=dims.scope)
        value = dims.logical_raw(e)
        return value < 0 if op == ">=" else value >= 0


def _var_axes(axis_specs) -> dict[str, str]:
    """Each spec dim var's first input axis (``args[0].shape[1]``), from the
    ``AxisSpec`` lists of the input leaves."""
    axes: dict[str, str] = {}
    for leaf in axis_specs:
        for a in leaf:
            if a.var:
                axes.setdefault(a.var, a.where)
    return axes


@dataclasses.dataclass
class MaskedProgram:
    """One symbolic trace of a function at a padded signature (one case).

    Sizes may be 0 but JAX's decision procedure assumes every dim var >= 1,
    so a spec dim var ``n`` is traced as ``n__p1 - 1`` with an internal dim
    var ``n__p1 = n + 1 >= 1`` (unless the user's constraints say ``n >= 1``):
    JAX's own shape arithmetic is then exact at size 0. Users never see the
    internal names (``display``).

    Attributes:
      closed_jaxpr: the traced jaxpr; avals have dimension expressions in
        the internal dim vars.
      scope: the ``SymbolicScope`` of the internal dim vars (bounds, the
        user's constraints and this case's conditions are constraints).
      axis_specs: per input leaf, the ``AxisSpec`` of each axis (``expr`` in
        internal dim vars; ``var``, ``coeff``, ``offset`` as in the spec).
      var_bounds: the bound (largest logical size) of each spec dim var.
      leaf_bounds: per input leaf, its padded shape in this program.
      out_tree: the treedef of the function's outputs.
      var_order: spec dim vars in order of first appearance.
      dim_bounds: the bound of each internal dim var.
      internal: spec dim var -> ``(internal name, offset)`` (internal = var + offset).
      user_scope: the scope of the user's constraints over the spec dim vars.
      conditions: this case's conditions (``"e >= 0"`` / ``"e <= -1"``, internal).
      assumed_nonempty: data-dependent dim var -> the user's line of a size
        comparison traced on JAX's assumption that it is >= 1 (the rule that
        binds it checks at run time that it is not 0).
      count_checks: conditions on data-dependent sizes this program was traced
        under, whose other side fails in plain JAX (``CountCheck``): the
        rule that binds the last of their sizes checks them at run time.
    """

    closed_jaxpr: Any
    scope: Any
    axis_specs: list[list[AxisSpec]]
    var_bounds: dict[str, int]
    leaf_bounds: list[tuple[int, ...]]
    out_tree: Any
    var_order: list[str]
    dim_bounds: dict[str, int] = dataclasses.field(default_factory=dict)
    internal: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    user_scope: Any = None
    conditions: tuple[str, ...] = ()
    assumed_nonempty: dict[str, str] = dataclasses.field(default_factory=dict)
    count_checks: tuple[CountCheck, ...] = ()
    # Python warnings the trace raised (``trace_warnings.py``): said when a call reaches it
    trace_warnings: tuple = dataclasses.field(default=(), compare=False, repr=False)
    # tracing/eager.py's per-call-structure state (calls, its compiled form)
    eager_states: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                           compare=False)

    def var_axes(self) -> dict[str, str]:
        """Each spec dim var's first input axis (``args[0].shape[1]``)."""
        return _var_axes(self.axis_specs)

    @property
    def out_shapes(self) -> list[tuple]:
        """Symbolic output shapes (dimension expressions) per output leaf."""
        return [tuple(v.aval.shape) for v in self.closed_jaxpr.jaxpr.outvars]

    def out_bounds(self) -> list[tuple[int, ...]]:
        """Padded output shapes per output leaf."""
        env = DimEnv(self.scope, self.dim_bounds, {})
        return [env.padded_shape(s) for s in self.out_shapes]

    def internal_values(self, values: dict[str, Any]) -> dict[str, Any]:
        """Internal dim var values from the spec dim vars' logical values."""
        return internal_values(self.internal, values)

    def spec_var_expr(self, v: str):
        """The (internal) dimension expression of spec dim var ``v``."""
        name, off = self.internal.get(v, (v, 0))
        (e,) = jax.export.symbolic_shape(name, scope=self.scope)
        return e - off

    def display(self, e) -> str:
        """``e`` (or a text with internal names) in terms of the spec dim vars."""
        return dimvars.display_text(str(e), self.internal)


def _check_output_types(out, out_flat, call) -> None:
    """An output leaf JAX cannot return (a ``str`` tag): jax.jit's TypeError,
    naming the user's function and the output's path (JAX's own names the
    trace's inner function and counts the flattened outputs)."""
    bad = next((i for i, o in enumerate(out_flat)
                if not (is_masked(o) or compat.is_jax_value(o))), None)
    if bad is None:
        return
    path = jax.tree_util.keystr(
        jax.tree_util.tree_flatten_with_path(out, is_leaf=is_masked)[0][bad][0])
    fun = getattr(call, "__wrapped__", call)
    code = getattr(fun, "__code__", None)
    name = getattr(fun, "__name__", fun)
    where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else None
    error = TypeError(f"function {name}{f' at {where}' if where else ''} returned a value of "
                      f"type {type(out_flat[bad])} at output {path or '(the output itself)'}, "
                      "which is not a valid JAX type (jax.jit refuses it too)")
    if where:  # (the error cases name the function: its frame has returned)
        error.polymask_where = f"{where} ({name})"
    raise error


def arg_paths(args) -> list[str]:
    flat = jax.tree_util.tree_flatten_with_path(tuple(args), is_leaf=is_masked)[0]
    return ["args" + jax.tree_util.keystr(p) for p, _ in flat]


def _leaf_data(leaf):
    return leaf.data if is_masked(leaf) else leaf


def _parse_axis_specs(leaves, spec_leaves, paths, scope, gen_name) -> list[list[AxisSpec]]:
    out = []
    for leaf, spec, path in zip(leaves, spec_leaves, paths):
        padded = tuple(int(d) for d in np.shape(_leaf_data(leaf)))
        try:
            out.append(parse_leaf_spec(spec, path, padded, scope,
                                       default_dynamic=is_masked(leaf), name_gen=gen_name))
        except ShapeError as e:
            hint = ragged_batch_hint(leaf.shape, padded) if is_masked(leaf) else ""
            if not hint:
                raise
            raise ShapeError(f"{e}{hint}") from None
    return out


def _check_constraint_vars(scope, axis_specs, spec_leaves=()) -> None:
    spec_vars = {a.var for axes in axis_specs for a in axes if a.var}
    # names an equality constraint substituted away ('n == 3', 'm == 2*n')
    spec_vars |= {n for s in spec_leaves if isinstance(s, str) for n in spec_identifiers(s)}
    for _, e1, e2, text in compat.explicit_constraints(scope):
        unknown = (compat.dim_vars(e1) | compat.dim_vars(e2)) - spec_vars
        if unknown:
            raise unknown_dim_vars_error(text, unknown, spec_vars)


def _var_bounds(leaves, axis_specs) -> tuple[dict[str, int], list[str]]:
    """Each dim var's bound: the smallest one its axes' padded sizes allow."""
    bounds: dict[str, int] = {}
    order: list[str] = []
    for leaf, axes in zip(leaves, axis_specs):
        shape = np.shape(_leaf_data(leaf))
        for a in axes:
            if a.var is None:
                continue
            data_bound = (int(shape[a.axis]) - a.offset) // a.coeff
            if a.var not in bounds:
                order.append(a.var)
                bounds[a.var] = data_bound
            else:
                bounds[a.var] = min(bounds[a.var], data_bound)
    for v, b in bounds.items():
        if b < 1:
            raise ShapeError(f"dim var '{v}' has bound {b}: padded sizes must leave room for "
                             "at least one element (bound >= 1); for an empty array pad it "
                             "first, pm.pad(x, bound) or pm.Masked(buffer, sizes), or call "
                             "polymask.jit, which pads exact arrays itself")
    return bounds, order




class NoSizeMeets(Exception):
    """A case of a split that no sizes within the bounds meet: its conditions
    contradict (``compat.allows_no_values``). It is not traced: no call runs
    it (``cases/splitting.py`` keeps it as an empty leaf)."""

    def __init__(self, conditions):
        super().__init__(f"no sizes meet the conditions {list(conditions)}")
        self.conditions = tuple(conditions)


def split_of(e: BaseException):
    """The ``SplitNeeded`` of ``e``: ``e`` itself, or one JAX was handling when it
    raised ``e`` (its ``__cause__``/``__context__``), None when there is none.

    JAX code that catches an inconclusive comparison and then raises (``jnp.pad``
    with ``mode="symmetric"`` needs ``n > 1`` proven) fails only because the
    comparison was undecided: each outcome, traced with it decided, is what
    plain JAX does at those sizes. (Code that falls back without raising,
    ``max``/``min``, never gets here.)
    """
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (compat.SplitNeeded, compat.SplitBeforeRaise)):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _split_for_unproven_equality(e: BaseException, scope, internal):
    """A split that lets JAX prove two shapes of one dim var equal, or None.

    ``x - concatenate([0], x[:-1])`` compares ``(n,)`` with ``(max(0, n - 1) +
    1,)``: equal for ``n >= 1``, which JAX cannot prove for every ``n >= 0``.
    Splitting at the smallest ``k`` for which ``n >= k`` proves it traces the
    sizes ``>= k`` as one case, and the few sizes below are traced on their own,
    as plain JAX traces them (at ``n = 0`` it broadcasts ``(0,)`` with ``(1,)``).
    No split when the scope already implies ``n >= k`` (the mismatch is real).
    """
    msg = str(e).split("\n\n")[0].strip()
    if not is_shape_mismatch(e, msg):
        return None
    names = [name for name, _ in internal.values() if re.search(rf"\b{re.escape(name)}\b", msg)]
    # a count's too (``jnp.diff(sel, n=2)``): its case below k is not traced but
    # refused where the count is known (``cases/splitting.py``: ``only_yes``)
    names += sorted(set(re.findall(rf"\b{compat.FRESH_DIM_PREFIX}\d+\b", msg)))
    if len(names) != 1:
        return None
    (name,) = names
    k = lower_bound_that_fixes(msg, name)
    if k is None:
        return None
    (var,) = jax.export.symbolic_shape(name, scope=scope)
    cond = var - k
    try:
        if cond >= 0:
            return None  # already known: the shapes differ for another reason
    except compat.InconclusiveDimensionOperation:
        pass
    spec = next(((v, off) for v, (n, off) in internal.items() if n == name), (name, 0))
    return compat.SplitNeeded(f"{spec[0]} >= {k - spec[1]} proves the shapes in "
                              f"{dimvars.display_text(msg, internal)!r} equal", cond,
                              only_yes=compat.is_fresh_dim_name(name),
                              where=user_frame_of_exception(e))  # (the mismatch's line)


_CLAMP = re.compile(r"\b(?:max|min)\(([^(),]+),\s*([^(),]+)\)")


def _split_for_a_clamped_size(e: BaseException, scope, internal):
    """A split on the two sides of a ``max`` / ``min`` in a size JAX needed as
    a constant, or None.

    JAX's gradient of a VALID convolution pads its cotangent by ``(k - 1, n -
    max(n - k + 1, 0))``: ``k - 1`` at every ``n >= k - 1``, but a padding
    must be an int, so the trace failed at every size and was traced once per
    size. Traced with ``n - k + 1 >= 0`` (and apart with ``<= -1``), JAX
    itself decides the ``max`` and the padding is a constant."""
    names = {name for name, _ in internal.values()}
    for m in _CLAMP.finditer(str(e)):
        sides = m.group(1).strip(), m.group(2).strip()
        if not set(re.findall(r"[A-Za-z_]\w*", " ".join(sides))) <= names:
            continue
        try:
            a, b = jax.export.symbolic_shape(", ".join(sides), scope=scope)
            cond = a - b
            if cond >= 0 or cond <= -1:  # decided here already: not what failed
                continue
        except compat.InconclusiveDimensionOperation:
            return compat.SplitNeeded(f"'{sides[0]}' >= '{sides[1]}' (a {m.group(0)[:3]} "
                                      "needed as a constant)", cond,
                                      where=user_frame_of_exception(e))
        except Exception:
            continue
    return None


def trace(fun: Callable, args: Sequence[Any], in_specs=None,
          constraints: Sequence[str] = (), conditions: Sequence[str] = ()
          ) -> tuple[MaskedProgram, list]:
    """Trace ``fun`` symbolically at the padded signature of ``args``.

    ``conditions`` (over the internal dim vars) are added to the scope: the
    case of a case split (``cases/splitting.py``). Returns ``(program, leaves)`` where
    ``leaves`` are the flat input leaves.

    Raises:
      compat.SplitNeeded: a size comparison JAX cannot decide (``cases/splitting.py``
        traces each outcome).
      ShapeError: a bad spec or constraint, or a size question JAX cannot
        answer while tracing (translated by ``diagnostics``).
      UnsupportedError: raised by a polymask op while tracing.
    """
    leaves, in_tree = flatten_args(args)
    spec_leaves = broadcast_specs(in_specs, list(args), is_masked)

    traced = compat.replacement_of(fun)

    def call(*flat):
        return called(traced, *jax.tree_util.tree_unflatten(in_tree, list(flat)))

    prog = trace_flat(call, leaves, spec_leaves, arg_paths(args), constraints, conditions)
    return prog, leaves


def _names_a_data_dependent_size(text: str) -> bool:
    return any(compat.is_fresh_dim_name(w) for w in re.findall(r"\b_\w+", text))


def trace_flat(call: Callable, leaves: Sequence[Any], spec_leaves: Sequence[Any],
               paths: Sequence[str], constraints: Sequence[str] = (),
               conditions: Sequence[str] = ()) -> MaskedProgram:
    """Trace ``call(*leaves)`` symbolically: one spec (or None) and one path per leaf.

    ``trace`` is this with the leaves of positional arguments; ``mask`` uses it
    directly for keyword arguments and pytree callees (modules), whose
    non-array leaves it keeps out of ``leaves``. Raises as ``trace``.
    """
    leaves = list(leaves)
    user_scope, gen_name = scope_and_name_generator(spec_leaves, constraints)
    user_axes = _parse_axis_specs(leaves, spec_leaves, paths, user_scope, gen_name)
    _check_constraint_vars(user_scope, user_axes, spec_leaves)
    var_bounds, var_order = _var_bounds(leaves, user_axes)
    internal = dimvars.internal_names(var_order, var_bounds, constraints)
    # (a case where a count is 0 is no constraint: ops._fresh makes it the constant 0)
    in_scope, empty, nonempty = compat.count_emptiness_conditions(conditions)
    scope, pinned = dimvars.internal_scope(constraints, in_scope, internal, var_bounds)
    compat.set_count_emptiness(scope, empty, nonempty)
    static = bool(internal) and len(pinned) == len(internal)
    var_expr = {}
    for v, (name, off) in internal.items():
        (e,) = jax.export.symbolic_shape(name, scope=scope)
        var_expr[v] = e - off
    axis_specs = [[a if a.var is None else
                   dataclasses.replace(a, expr=a.coeff * var_expr[a.var] + a.offset)
                   for a in axes] for axes in user_axes]
    dim_bounds = {internal[v][0]: b + internal[v][1] for v, b in var_bounds.items()}
    internal_off = {name: off for name, off in internal.values()}
    split_vars = {v: (1 if internal_off.get(v) else 0, b) for v, b in dim_bounds.items()}
    if conditions and compat.allows_no_values(scope, split_vars):
        raise NoSizeMeets(conditions)

    env = DimEnv(scope, dim_bounds, {})
    leaf_bounds = [tuple(env.padded(a.expr) for a in axes) for axes in axis_specs]
    # weak types kept: a Python scalar argument promotes as in plain JAX; 64-bit
    # host dtypes canonical (int64 -> int32 without x64), as jax.jit takes them,
    # without JAX's truncation warning
    avals = [jax.ShapeDtypeStruct(tuple(a.expr for a in axes),
                                  canonical_dtype(dtype_of(_leaf_data(leaf))),
                                  weak_type=compat.is_weakly_typed(_leaf_data(leaf)))
             for leaf, axes in zip(leaves, axis_specs)]

    out_trees = []

    def flat_fun(*flat):
        out = call(*flat)
        out_flat, out_tree = jax.tree_util.tree_flatten(out, is_leaf=is_masked)
        _check_output_types(out, out_flat, call)
        out_trees.append(out_tree)
        return [_leaf_data(o) for o in out_flat]

    replaced = compat.during_masked_trace(lambda f: not is_library_frame(f),
                               split_vars=split_vars, scope=scope)
    # a trace at pinned sizes runs the user's NumPy arithmetic on sizes that
    # no call may have (1 / np.sqrt(n) at n = 0): no warning for those
    quiet = np.errstate(all="ignore") if pinned else contextlib.nullcontext()
    try:
        with scope_active(scope), replaced as record, quiet, recording() as warned:
            closed = jax.make_jaxpr(flat_fun)(*avals)
            check_preconditions(closed.jaxpr)  # sizes where lowering fails: error cases
    except (ShapeError, UnsupportedError):
        raise
    except Exception as e:
        split = (split_of(e) or _split_for_unproven_equality(e, scope, internal)
                 or _split_for_a_clamped_size(e, scope, internal))
        if split is not None:
            raise split from None
        var_where = _var_axes(axis_specs)
        # At pinned sizes the trace is plain JAX's: its error is the plain
        # function's, not a symbolic-shape limitation to translate.
        shown = dimvars.displayed_error(e, internal)  # messages name spec dim vars
        # (at pinned sizes a data-dependent size stays symbolic: where JAX needed
        # its value, jnp.split's "rest is mod(_u1, 2)", that is what to say)
        # Under a condition on a count (a case of a comparison of one), an error
        # naming that count is plain JAX's at those counts (top_k's "k ... no
        # larger than minor dimension size"), not a need for the count's value.
        counted = any(_names_a_data_dependent_size(c) for c in conditions)
        # (a size object in the message, "'_DimExpr' object cannot be interpreted
        # as an integer" of a count, is never plain JAX's error: a size left symbolic)
        symbolic_left = "DimExpr" in str(e)
        # (a traced value made from a count, its size read last as a value, where
        # JAX needs a constant: jnp.choose(s.shape[0] % 2, ...) with mode='raise')
        read = getattr(e, "fixed_size_vars", ())
        count_value = bool(isinstance(e, jax.errors.ConcretizationTypeError) and read
                           and all(compat.is_fresh_dim_name(v) for v in read))
        symbolic_left |= count_value
        needs_count = ((_names_a_data_dependent_size(str(e)) and not counted) or symbolic_left
                       ) and not isinstance(e, compat.InconclusiveDimensionOperation)
        translated = (None if static and not needs_count
                      else translate_trace_error(shown, var_where, counts_known=counted,
                                                 count_left=(static and symbolic_left)
                                                 or count_value))
        signature = SizeSignature(var_order, var_bounds, internal, scope, dim_bounds, user_scope)
        if translated is not None:
            err = dimvars.displayed_error(translated, internal)
            if pinned:  # a pinned var's axes are constants here: "meets 5" may be its size
                # (another var's meeting a constant stays said: s1 of (s0, s1) * (s0, 16)
                # in the case s2 == 3 of an `assert pos.shape[-1] == 3`, AlphaFold's)
                held = {v for v, (name, _) in internal.items() if name in pinned}
                err.fixed_size_vars = tuple(v for v in getattr(err, "fixed_size_vars", ())
                                            if v not in held)
            err.polymask_where = user_frame_of_exception(e)  # the translation has no user frame
            err.polymask_signature = signature
            err.polymask_pinned = False
            raise err from None
        # A built-in error (JAX's own take arguments to build their text) is
        # shown with the spec's dim var names, not the internal ``n__p1 - 1``.
        raised = shown if type(e).__module__ == "builtins" else e
        try:
            raised.polymask_signature = signature
            raised.polymask_pinned = static and not symbolic_left  # at one size: plain JAX's
        except AttributeError:  # an exception type without a __dict__
            pass
        if raised is e:
            raise
        raise raised from None
    return MaskedProgram(closed, scope, axis_specs, var_bounds, leaf_bounds, out_trees[-1],
                         var_order, dim_bounds, internal, user_scope, tuple(conditions),
                         dict(record.assumed_nonempty), trace_warnings=tuple(warned))
