"""The masking-rule registry (keyed by primitive) and the rule context.

One ``RuleRecord`` per primitive holds everything polymask knows about it:
its masking rule, its precondition and the flags that tell the interpreter
when to call the rule. Rule modules (``polymask/rules/``) fill the table, as
``lax`` fills the tables of JAX's interpreters; the interpreter reads it.

A masking rule computes a primitive's padded outputs from padded inputs so
that the logical region equals what the primitive gives on the unpadded
inputs. Signature::

    @register("reduce_sum")
    def _reduce_sum(ctx: RuleContext, x, *, axes, out_sharding): ...

It returns one padded array (or a list when the primitive has multiple
results) whose shape is ``ctx.out_bounds[i]``. The interpreter checks that.
Like ``jax/_src/interpreters/batching.py``, the interpreter holds no
primitive-specific code: everything lives in one module per rule family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from .. import _jax_compat as compat
from ..core.dimvars import display_internal_names
from ..core.errors import ShapeError, UnsupportedError
from ..core.trace_state import trace_state
from .prologue import Check, run_checks
from .state import RunState

COVERAGE_DOC = "docs/coverage.md"


@dataclasses.dataclass
class RuleRecord:
    """What polymask knows about one primitive.

    ``primitive``: the primitive object it was registered by (None: by
    name); ``rule``: its masking rule (None: only a precondition so far);
    ``precondition``: ``fn(eqn)`` run on the symbolic jaxpr right after the
    trace (``register_precondition``); ``entry_reads``: ``fn(avals, params)``
    giving the axes the primitive reads entries of at run-time positions
    (``register_entry_reads``); ``sees_guard`` / ``at_bound``: when the
    interpreter calls the rule although every size is at its bound
    (``register``).
    """

    name: str
    primitive: Any = None  # the primitive object, when registered by it
    rule: Callable | None = None
    precondition: Callable | None = None
    entry_reads: Callable | None = None
    sees_guard: bool = False
    at_bound: bool = False


_RECORDS: dict[str, RuleRecord] = {}

# A primitive is given as the JAX (or polymask) primitive object, or by name
# where no public object exists or it exists in some JAX versions only (a name
# the installed JAX lacks is skipped: ``compat.has_primitive``).
PrimitiveLike = Any  # compat.Primitive | str


def _name(prim: PrimitiveLike) -> str | None:
    """The primitive's name, or None for a name the installed JAX does not have."""
    if isinstance(prim, str):
        return prim if compat.has_primitive(prim) else None
    return prim.name


def _record(name: str) -> RuleRecord:
    rec = _RECORDS.get(name)
    if rec is None:
        rec = _RECORDS[name] = RuleRecord(name)
    return rec


def register(*prims: PrimitiveLike, override: bool = False, sees_guard: bool = False,
             at_bound: bool = False):
    """Decorator: register a masking rule for these primitives (objects or names).

    Like JAX's own rule tables, a second rule for the same primitive is an
    error (``ValueError``) unless ``override=True``: two modules silently
    fighting over a primitive would make the winner depend on import order.
    ``sees_guard=True``: while ``RunState.guard`` is set (a case of a case
    split, a step of a loop run to the bound) the rule is called even when
    every size is at its bound (host callbacks skip the guarded-off calls);
    equations with effects always are. ``at_bound=True``: the rule is called
    even when every size is at its bound (a rule that binds a twin primitive,
    e.g. with a batching rule JAX's lacks, so that every case of a case split
    batches alike under ``vmap``).
    """

    def deco(fn):
        for p in prims:
            name = _name(p)
            if name is None:  # not in the installed JAX version
                continue
            register_rule(name, fn, override=override)
            rec = _RECORDS[name]
            if not isinstance(p, str):
                rec.primitive = p
            rec.sees_guard |= sees_guard
            rec.at_bound |= at_bound
        return fn

    return deco


def register_rule(name: str, fn: Callable, *, override: bool = False) -> None:
    """Register ``fn`` as the masking rule of primitive ``name`` (see ``register``)."""
    rec = _record(name)
    if rec.rule is not None and not override:
        raise ValueError(
            f"a masking rule for primitive '{name}' is already registered "
            f"({_describe(rec.rule)}); cannot also register {_describe(fn)} "
            f"(pass override=True to replace it)")
    rec.rule = fn


def _describe(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register_precondition(*prims: PrimitiveLike):
    """Decorator: ``fn(eqn)`` checks each equation of these primitives right
    after the symbolic trace (``tracing/symbolic.py``), while a size comparison the bounds
    cannot decide still splits the trace into cases. It raises ``ShapeError``
    at sizes where plain JAX fails only later (lowering, compiling), so they
    become error cases that ``shape_formula``, ``explain`` and the host checks
    of ``polymask.jit`` report like plain JAX's trace-time errors."""
    return _recording("precondition", prims)


def _recording(field: str, prims):
    """A decorator that records ``fn`` as ``field`` of each primitive's record."""

    def deco(fn):
        for p in prims:
            name = _name(p)
            if name is not None:
                setattr(_record(name), field, fn)
        return fn

    return deco


def register_entry_reads(*prims: PrimitiveLike):
    """Decorator: ``fn(avals, params) -> [(size, rows), ...]`` names the axes
    (of symbolic ``size``) whose entries these primitives read at run-time
    positions, with the dims ``rows`` of the index rows reading them. While a
    data-dependent size may be 0, the trace splits on its emptiness before
    such a read (``_jax_compat``'s ``set_entry_reads``): plain JAX's own path
    for an empty axis differs (``jnp.take`` raises, ``jnp.nanmedian`` is
    NaN), and the program traced for a count >= 1 cannot follow it."""
    return _recording("entry_reads", prims)


def _entry_reads(name: str) -> Callable | None:
    rec = _RECORDS.get(name)
    return None if rec is None else rec.entry_reads


compat.set_entry_reads(_entry_reads)


def check_preconditions(jaxpr, outer_line: str = compat.UNKNOWN_LOCATION) -> None:
    """Run the registered preconditions on ``jaxpr`` and its inner jaxprs
    (whose equations may have no user frame: then the enclosing call's line)."""
    for eqn in jaxpr.eqns:
        line = compat.source_line(eqn.source_info)
        if line == compat.UNKNOWN_LOCATION:
            line = outer_line
        rec = _RECORDS.get(eqn.primitive.name)
        fn = None if rec is None else rec.precondition
        if fn is not None:
            try:
                fn(eqn)
            except (compat.SplitNeeded, compat.SplitBeforeRaise, ShapeError) as e:
                e.polymask_where = line  # the user's line, for the case tree
                raise
        for inner, _ in compat.inner_jaxprs(eqn.params):
            check_preconditions(inner, line)


def rule_record(name: str) -> RuleRecord | None:
    """The record of primitive ``name`` (None: nothing registered)."""
    return _RECORDS.get(name)


def get_rule(name: str) -> Callable | None:
    rec = _RECORDS.get(name)
    return None if rec is None else rec.rule


# Rules for whole families of primitives without a rule of their own:
# (predicate(primitive) -> bool, rule), tried in registration order.
_DEFAULT_RULES: list[tuple[Callable, Callable, dict]] = []


def register_default(predicate: Callable[[Any], bool], sees_guard: bool = False,
                     at_bound: bool = False):
    """Register a rule for every primitive without a registered rule for which
    ``predicate(primitive)`` holds (``rules/inlined.py``: primitives whose
    implementation is Python); ``sees_guard`` and ``at_bound`` as for
    ``register``."""
    def deco(rule):
        _DEFAULT_RULES.append((predicate, rule, {"sees_guard": sees_guard,
                                                 "at_bound": at_bound}))
        return rule
    return deco


def rule_for(prim) -> Callable | None:
    """The masking rule of primitive object ``prim``: its own, else a default
    rule whose predicate holds (``register_default``), else None."""
    rule = get_rule(prim.name)
    if rule is not None:
        return rule
    for predicate, default, _flags in _DEFAULT_RULES:
        if predicate(prim):
            return default
    return None


def _rule_flag(prim, flag: str) -> bool:
    """``flag`` of the masking rule of primitive object ``prim``: its own
    rule's, else its default rule's."""
    rec = _RECORDS.get(prim.name)
    if rec is not None and rec.rule is not None:
        return getattr(rec, flag)
    return any(flags[flag] and predicate(prim) for predicate, _, flags in _DEFAULT_RULES)


def sees_guard(prim) -> bool:
    """The masking rule of primitive object ``prim`` was registered with
    ``sees_guard=True``."""
    return _rule_flag(prim, "sees_guard")


def runs_at_bound(prim) -> bool:
    """The masking rule of primitive object ``prim`` was registered with
    ``at_bound=True``."""
    return _rule_flag(prim, "at_bound")


def registered_primitives() -> list[str]:
    """The primitives with a masking rule."""
    return sorted(n for n, rec in _RECORDS.items() if rec.rule is not None)


def has_inner_jaxpr(params) -> bool:
    """True when an equation's params hold an inner jaxpr (calls, loops, branches)."""
    return any(True for _ in compat.inner_jaxprs(params))


def substitute_dims(obj, fn):
    """Replace every dimension expression inside params (tuples, lists, dicts)."""
    if compat.is_dim_expr(obj):
        return fn(obj)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(substitute_dims(o, fn) for o in obj)
    if isinstance(obj, list):
        return [substitute_dims(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: substitute_dims(v, fn) for k, v in obj.items()}
    if hasattr(obj, "_fields") and isinstance(obj, tuple):  # NamedTuple params
        return type(obj)(*(substitute_dims(o, fn) for o in obj))
    if isinstance(obj, compat.ShapedArray) and compat.is_symbolic_shape(obj.shape):
        return obj.update(shape=substitute_dims(tuple(obj.shape), fn))  # callbacks' result_avals
    return obj


class RuleContext:
    """What a masking rule may ask about the equation it is masking.

    Attributes:
      eqn: the jaxpr equation (symbolic avals and params).
      state: the ``RunState`` of the run (shared per-run facts, ``scoped()``).
      dims: ``state.dims``, the ``DimEnv`` (dim var bounds and logical values).
      interpreter: the interpreter (``eval_jaxpr`` recurses through it).
      in_logical / out_logical: per operand / result, the logical shape
        (tuple of Python ints or int32 scalars).
      in_bounds / out_bounds: per operand / result, the padded shape.
      source_line: the user's source line of this equation.
    """

    def __init__(self, eqn, state: RunState):
        self.eqn = eqn
        self.state = state
        self.dims = dims = state.dims
        self.interpreter = state.interpreter
        self.primitive = eqn.primitive
        self.in_avals = [v.aval for v in eqn.invars]
        self.out_avals = [v.aval for v in eqn.outvars]
        self.in_bounds = [_shape_of(a, dims.padded) for a in self.in_avals]
        self.in_logical = [_shape_of(a, dims.logical) for a in self.in_avals]
        self._out_bounds = None
        self._out_logical = None

    # Output shapes are lazy: data-dependent primitives bind fresh dim vars
    # in their rule before anyone can evaluate their output shapes.
    @property
    def out_bounds(self):
        if self._out_bounds is None:
            self._out_bounds = [_shape_of(a, self.dims.padded) for a in self.out_avals]
        return self._out_bounds

    @property
    def out_logical(self):
        if self._out_logical is None:
            self._out_logical = [_shape_of(a, self.dims.logical) for a in self.out_avals]
        return self._out_logical

    @property
    def source_line(self) -> str:
        """``file:line (function)`` of the equation; inside an installed library
        (lineax's ``linear_solve``), also the user's line that called it: from
        the equation's traceback, else from the enclosing equations' (a
        library's jitted function records no frame outside its jit)."""
        line = compat.source_line(self.eqn.source_info)
        if line.startswith(compat.UNKNOWN_LOCATION):  # inside JAX: the enclosing user line
            for eqn in reversed(self.state.eqn_stack):
                outer = compat.source_line_with_caller(eqn.source_info)
                if not outer.startswith(compat.UNKNOWN_LOCATION):
                    return outer
            return line
        if not compat.in_installed_package(line):
            return line
        for eqn in (self.eqn, *reversed(self.state.eqn_stack)):  # innermost first
            caller = compat.line_outside_packages(eqn.source_info)
            if caller is not None:
                return f"{line}, called from {caller}"
        return line

    def padded(self, d) -> int:
        return self.dims.padded(d)

    def logical(self, d):
        return self.dims.logical(d)

    def concrete_params(self, **overrides) -> dict[str, Any]:
        """The equation's params with dimension expressions at their padded size."""
        params = dict(self.eqn.params)
        params.update(overrides)
        return substitute_dims(params, self.dims.padded)

    def bind(self, *args, **overrides):
        """Bind the primitive on padded operands with padded-size params (inside
        ``shard_map``, operands cast to one set of varying axes, as ``jax.lax``
        casts them: the jaxpr was traced outside it)."""
        return self.primitive.bind(*compat.with_matching_varying_axes(args),
                                   **self.concrete_params(**overrides))

    def eval_jaxpr(self, closed_jaxpr, *args) -> list:
        """Evaluate an inner (closed) jaxpr with masking, sharing the dim env."""
        return self.interpreter.eval_closed(closed_jaxpr, list(args), self.state)

    def has_zero_padding(self, x) -> bool:
        """True when every padded position of ``x`` is known to hold exactly 0."""
        return self.state.has_zero_padding(x)

    def mark_zero_padding(self, x):
        """Declare that every padded position of the result ``x`` is exactly 0."""
        self.state.mark_zero_padding(x)
        return x

    def require(self, bad, message: str, values: tuple = (),
                error_type: type | None = None) -> None:
        """A run-time check: raise ``ShapeError(message)`` where ``bad`` holds.

        ``bad`` is a bool or a traced bool; traced checks are staged like the
        prologue's (``prologue.run_checks``). With ``values`` (sizes, maybe
        traced), ``{0}``, ``{1}``... in ``message`` name their actual values
        (other braces in ``message`` must then be doubled). ``error_type``:
        what plain JAX raises there (the ``ShapeError`` is also one,
        ``errors.typed_as``).
        """
        line = self.source_line
        if values:
            line = line.replace("{", "{{").replace("}", "}}")
        if self.state.guard is not None:  # one case of a case split: only where it runs
            bad = jnp.logical_and(bad, self.state.guard)
        message = display_internal_names(message)
        run_checks([Check(bad, f"{message}\n  at {line}", tuple(values), error_type)],
                   trace_state().call_site or self.source_line)

    def unsupported(self, reason: str) -> UnsupportedError:
        reason = display_internal_names(reason)
        return UnsupportedError(
            f"polymask cannot mask primitive '{self.primitive.name}' here: {reason}\n"
            f"  at {self.source_line}\n  (coverage table: {COVERAGE_DOC})")


def _shape_of(aval, fn):
    shape = getattr(aval, "shape", ())
    return tuple(fn(d) for d in shape)
