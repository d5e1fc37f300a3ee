"""The masking interpreter: walk a traced jaxpr, applying each primitive's rule.

Like ``jax/_src/interpreters/batching.py`` it holds no primitive-specific
code: the rule for each primitive comes from the registry (``rules/``). An
equation whose sizes are all static and equal to their bounds needs no rule:
the primitive is bound unchanged (the static fast path).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from ..core.diagnostics import relocate
from ..core.errors import ShapeError, UnsupportedError
from ..core.masked import Masked
from ..core.masks import valid_mask
from ..core.shapes import DimEnv, is_static, needs_mask
from .registry import (
    COVERAGE_DOC,
    RuleContext,
    has_inner_jaxpr,
    rule_for,
    runs_at_bound,
    sees_guard,
    substitute_dims,
)
from .state import RunState, holds_zero
from .symbolic import MaskedProgram, is_masked

__all__ = ["Interpreter", "run_program", "all_sizes_at_bound", "runs_rule", "walk_jaxpr",
           "with_plain_weak_types"]

# ``observe(eqn, state)`` returns a context manager entered around the
# evaluation of each equation (``polymask.explain`` uses it).
Observer = Callable[[Any, RunState], contextlib.AbstractContextManager]


def _params_have_dims(params) -> bool:
    found = []
    substitute_dims(dict(params), lambda d: found.append(d) or d)
    return bool(found)


def runs_rule(eqn, state: RunState) -> bool:
    """Whether ``eqn`` goes through its masking rule; else it is bound unchanged
    at the bound (every size at its bound, no guard to honour). Under a guard
    (vmap runs every case; loops run to the bound) an effect or a host
    callback goes through its rule even at the bound: the rule skips the
    guarded-off calls."""
    prim = eqn.primitive
    guarded_effect = (state.guard is not None and rule_for(prim) is not None
                      and (bool(eqn.effects) or sees_guard(prim)))
    return not all_sizes_at_bound(eqn, state.dims) or guarded_effect or runs_at_bound(prim)


def all_sizes_at_bound(eqn, dims: DimEnv) -> bool:
    """The static fast path applies: every size of ``eqn`` is static and at its bound.

    Then nothing is padded and the primitive is bound unchanged. Equations
    with sizes in their params (``dim_as_value``, a ``broadcast_in_dim`` to a
    symbolic shape) and with inner jaxprs always go through their rule.
    """
    if has_inner_jaxpr(eqn.params) or _params_have_dims(eqn.params):
        return False
    for v in (*eqn.invars, *eqn.outvars):
        for d in getattr(v.aval, "shape", ()):
            if not compat.is_dim_expr(d):
                continue
            if not compat.dim_vars(d) <= set(dims.logical_values):
                return False
            val = dims.logical(d)
            if not is_static(val) or int(val) != dims.padded(d):
                return False
    return True


def walk_jaxpr(jaxpr, consts, args, apply: Callable) -> list:
    """Evaluate ``jaxpr`` equation by equation: ``apply(eqn, invals) -> outvals``
    (a list); the walk every interpreter of polymask shares (masking, packed)."""
    env: dict[Any, Any] = {}

    def read(v):
        return compat.literal_value(v) if compat.is_jaxpr_literal(v) else env[v]

    constvars, invars = compat.jaxpr_inputs(jaxpr, consts)
    env.update(zip(constvars, consts))
    env.update(zip(invars, args))
    for eqn in jaxpr.eqns:
        outs = apply(eqn, [read(v) for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, compat.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


class Interpreter:
    """Walks a jaxpr applying masking rules."""

    def __init__(self, observe: Observer | None = None):
        self.observe = observe

    def eval_closed(self, closed, args: list, state: RunState) -> list:
        return self.eval_jaxpr(closed.jaxpr, closed.consts, args, state)

    def eval_jaxpr(self, jaxpr, consts, args, state: RunState) -> list:
        state.jaxpr_stack.append(jaxpr)
        try:
            return walk_jaxpr(jaxpr, consts, args, lambda eqn, ins: self.apply(eqn, ins, state))
        finally:
            state.jaxpr_stack.pop()

    def apply(self, eqn, invals, state: RunState) -> list:
        observed = self.observe(eqn, state) if self.observe else contextlib.nullcontext()
        state.eqn_stack.append(eqn)
        try:
            with compat.user_context(eqn.source_info), observed:
                out = self._apply_rule(eqn, invals, state)
        finally:
            state.eqn_stack.pop()
        outs = list(out) if eqn.primitive.multiple_results else [out]
        _check_out_shapes(eqn, outs, state.dims)
        return with_plain_weak_types(eqn.outvars, outs)

    def _apply_rule(self, eqn, invals, state: RunState):
        prim = eqn.primitive
        rule = rule_for(prim)
        if not runs_rule(eqn, state):
            return prim.bind(*compat.with_matching_varying_axes(invals), **eqn.params)
        if rule is None:
            raise UnsupportedError(
                f"polymask has no masking rule for primitive '{prim.name}' "
                f"(used at {compat.source_line(eqn.source_info)}); "
                f"see {COVERAGE_DOC} for the covered primitives")
        try:
            return rule(RuleContext(eqn, state), *invals, **eqn.params)
        except (ShapeError, UnsupportedError) as e:
            # Equations of inner jaxprs (jnp functions are jitted) have no
            # user frame: name the enclosing equation's user line instead.
            raise relocate(e, compat.source_line_with_caller(eqn.source_info)) from None
        except compat.SplitNeeded:
            raise  # a size comparison to split the trace on (tracing/cases/)
        except (compat.InconclusiveDimensionOperation, NotImplementedError) as e:
            # A rule that met a case it cannot handle (a size it needs as a
            # constant, a JAX transformation without an implementation): name
            # the primitive and the user's line, not JAX's internals.
            said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UnsupportedError(
                f"primitive '{prim.name}' (used at {compat.source_line(eqn.source_info)}) "
                f"cannot run masked here: {type(e).__name__}: {said}") from e
        except TypeError as e:
            # JAX's shape rules raise TypeError: a rule that binds an op on padded
            # operands that disagree ("add got incompatible shapes") is polymask's
            # defect, never the user's; say so, with the primitive and the user's
            # line, instead of JAX's bare message from inside a rule. Other
            # TypeErrors are plain JAX's own and keep their type (jax.jvp of a
            # custom_vjp; reduce_window's JVP of an input-dependent init value)
            if not _names_operand_shapes(e):
                raise
            said = (str(e).strip().splitlines() or ["(no message)"])[0].rstrip(".")
            raise UnsupportedError(
                f"polymask internal error: its masking rule for primitive '{prim.name}' "
                f"(used at {compat.source_line_with_caller(eqn.source_info)}) failed: "
                f"TypeError: {said}. Please report it (with this message); "
                "polymask.jit and ragged_map run such sizes per exact shape, as jax.jit "
                "does") from e


def _names_operand_shapes(e: TypeError) -> bool:
    """Whether a TypeError is a JAX shape rule's ("incompatible shapes",
    "must have the same shape", "got operand of shape ...")."""
    return "shape" in str(e)


def _check_out_shapes(eqn, outs, dims: DimEnv) -> None:
    for v, o in zip(eqn.outvars, outs):
        want = dims.padded_shape(getattr(v.aval, "shape", ()))
        got = tuple(np.shape(o))
        if got != want:
            raise AssertionError(
                f"polymask internal error: rule for '{eqn.primitive.name}' returned "
                f"padded shape {got}, expected {want} (symbolic {v.aval.shape})")


def with_plain_weak_types(outvars, outs) -> list:
    """``outs`` weakly typed where the jaxpr variables ``outvars`` are: a rule
    that builds its value anew (a size as a number, ``x.shape[0]``, is a weakly
    typed Python int in plain JAX) would otherwise hand the user an output
    that promotes differently (``out + int8 array``: int32 instead of int8)."""
    for i, (v, o) in enumerate(zip(outvars, outs)):
        weak = getattr(v.aval, "weak_type", None)
        # (JAX values only: a rule's NumPy constant stays one, for the rules after it)
        if (weak is not None and isinstance(o, jax.Array)
                and compat.is_weakly_typed(o) != weak):
            outs[i] = compat.as_weakly_typed(o, weak)
    return outs


_INTERPRETER = Interpreter()


def _entry_mask(data, logical):
    """Zero float padding once on entry: gradients w.r.t. padding are then exactly 0
    (a type with no zero keeps its padding: rules fill it where they need to)."""
    if not jnp.issubdtype(data.dtype, jnp.inexact) or not holds_zero(data.dtype):
        return data
    m = valid_mask(logical, data.shape)
    if m is None:
        return data
    return lax.select(m, data, jnp.zeros_like(data))


def _entry_arg(leaf, axes, leaf_bound, state: RunState, zero_padded: bool = False):
    dims = state.dims
    data = jnp.asarray(leaf.data if is_masked(leaf) else leaf)
    if tuple(data.shape) != leaf_bound:  # a shared dim var with a smaller bound elsewhere
        data = lax.slice(data, (0,) * data.ndim, leaf_bound)
    logical = [dims.logical(a.expr) for a in axes]
    if zero_padded and is_masked(leaf):  # the caller padded with zeros: no entry select
        state.mark_zero_padding(data)
        return data
    arg = _entry_mask(data, logical)
    if arg is not data or not any(needs_mask(s, n) for s, n in zip(logical, data.shape)):
        state.mark_zero_padding(arg)
    return arg


def run_program(prog: MaskedProgram, leaves, values: dict,
                interpreter: Interpreter | None = None, zero_padded: bool = False,
                forward_only: bool = False, guard=None) -> list[Masked]:
    """Evaluate a traced program on padded leaves with dim var values ``values``.

    ``zero_padded``: the padding of every ``Masked`` input is known to be zero
    (no entry select; rules see the inputs as zero-padded). ``forward_only``:
    the result is never differentiated; ``guard``: see ``RunState``.
    """
    state = RunState(DimEnv(prog.scope, prog.dim_bounds, values), interpreter or _INTERPRETER,
                     forward_only=forward_only, guard=guard,
                     assumed_nonempty=prog.assumed_nonempty, count_checks=prog.count_checks)
    # (rules.util.shared_masks() would build each validity mask once, but a shared
    # mask is materialised by XLA instead of fused into each select: measured
    # 2x slower MiniLM steady state at bucket 256, so masks stay per use.)
    args = [_entry_arg(leaf, axes, lb, state, zero_padded)
            for leaf, axes, lb in zip(leaves, prog.axis_specs, prog.leaf_bounds)]
    outs = state.interpreter.eval_closed(prog.closed_jaxpr, args, state)
    return [Masked(jnp.asarray(o), state.dims.logical_shape(shape))
            for o, shape in zip(outs, prog.out_shapes)]


def run_program_counts(prog: MaskedProgram, leaves, values: dict, names) -> dict:
    """The values of the data-dependent dim vars ``names`` (``_u1``) that a run
    of ``prog`` binds at its top level (not inside a loop or branch body: those
    are left out), its run-time checks and callbacks off (a guard of False)."""
    state = RunState(DimEnv(prog.scope, prog.dim_bounds, values), _INTERPRETER,
                     forward_only=True, guard=jnp.bool_(False),
                     assumed_nonempty=prog.assumed_nonempty, count_checks=prog.count_checks)
    args = [_entry_arg(leaf, axes, lb, state)
            for leaf, axes, lb in zip(leaves, prog.axis_specs, prog.leaf_bounds)]
    state.interpreter.eval_closed(prog.closed_jaxpr, args, state)
    bound = state.dims.logical_values
    return {n: bound[n] for n in names if n in bound}
