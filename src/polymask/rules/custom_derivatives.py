"""``custom_jvp_call`` / ``custom_vjp_call``: mask the primal *and* keep the rule.

The user's derivative rule (``jax.nn.relu``'s JVP at 0, ``logsumexp``'s stable
JVP, a user's gradient clipping ``custom_vjp``) is kept: the primal jaxpr, the
JVP jaxpr, the forward jaxpr and the traced backward function are each
evaluated by the masking interpreter. The logical sizes are passed to the
re-created ``jax.custom_jvp`` / ``jax.custom_vjp`` as explicit integer
arguments, so the functions close over no tracers (vmap- and jit-safe).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from ..core.dimvars import display_internal_names
from ..core.errors import UnsupportedError
from ..core.trace_state import tangent_operands, trace_state
from ..tracing.prologue import Check, run_checks
from ..tracing.registry import register, register_precondition
from .tangents import tangent_equations
from .util import clean, dynamic_sizes


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _all_float(xs) -> bool:
    return all(map(_is_float, xs))


@register("custom_jvp_call")
def custom_jvp_rule(ctx, *args, call_jaxpr, jvp_jaxpr_fun, num_consts, symbolic_zeros):
    interp = ctx.interpreter
    consts, xs = list(args[:num_consts]), list(args[num_consts:])
    if not _all_float(xs):
        # Integer primals have float0 tangents; JAX's own rule would not use
        # them either, so differentiate the masked primal directly.
        return ctx.eval_jaxpr(call_jaxpr, *args)
    names, sizes = dynamic_sizes(ctx.state)

    @jax.custom_jvp
    def masked_call(sizes, consts, xs):
        return interp.eval_closed(call_jaxpr, [*consts, *xs], ctx.state.with_sizes(names, sizes))

    @masked_call.defjvp
    def masked_call_jvp(primals, tangents):
        sizes, consts, xs = primals
        _, _, txs = tangents
        try:
            jvp_jaxpr, jvp_consts, out_zeros = compat.call_wrapped(
                jvp_jaxpr_fun, *([False] * len(xs)))
        except Exception as e:  # noqa: BLE001 - JAX's own JVP rule fails at these shapes
            # e.g. JAX's det JVP at size 0 (plain JAX fails too). In one case of a
            # case split the error holds only where that case runs (ctx.require
            # is guarded), so other sizes still differentiate.
            guard = ctx.state.with_sizes(names, sizes).guard
            run_checks([Check(True if guard is None else guard,
                              _rule_failure(e, ctx.source_line))], ctx.source_line)
            primals_out = masked_call(sizes, consts, xs)
            return primals_out, [jnp.zeros_like(p) if _is_float(p) else
                                 np.zeros(np.shape(p), jax.dtypes.float0) for p in primals_out]
        env = ctx.state.with_sizes(names, sizes)
        # the rule's own solves of tangents (optimistix's implicit function
        # theorem) run linearly with their transpose rule (rules/inlined.py)
        # (the jaxpr's invars end with the tangents; constants may lead them)
        tangent_invars = jvp_jaxpr.invars[len(jvp_jaxpr.invars) - len(txs):]
        with tangent_operands(tangent_equations(jvp_jaxpr, tangent_invars)):
            outs = interp.eval_jaxpr(jvp_jaxpr, jvp_consts, [*xs, *txs], env)
        n_out = len(out_zeros)
        primals_out, nz_tangents = outs[:n_out], iter(outs[n_out:])
        tangents_out = [jnp.zeros_like(p) if z else next(nz_tangents)
                        for p, z in zip(primals_out, out_zeros)]
        # an integer or bool output's tangent is float0, whatever the rule's
        # jaxpr computed for it (optimistix's solver state carries step counts)
        tangents_out = [t if _is_float(p) else np.zeros(np.shape(p), jax.dtypes.float0)
                        for p, t in zip(primals_out, tangents_out)]
        return primals_out, tangents_out

    return masked_call(sizes, consts, xs)


def _rule_failure(e: Exception, where: str, rule: str = "custom JVP") -> str:
    """Why a custom derivative rule gave no derivative. A size comparison the
    rule makes (``t[::-1]`` asks ``n >= 1``) or a size it needs as a Python
    value cannot be answered there: the rule is traced when the derivative is
    taken, after the masked trace chose its cases (a JAX rule, a ``defjvps``
    one, or one whose trace failed at its first try); traced inside the
    masked function, at the call's sizes, it can."""
    text = f"{type(e).__name__}: {display_internal_names(str(e).splitlines()[0])}"
    if isinstance(e, compat.InconclusiveDimensionOperation) or "DimExpr" in str(e):
        return (f"the derivative (the function's {rule} rule, at {where}) needs sizes "
                f"polymask cannot decide there: {text}\n  The rule is traced when "
                "the derivative is taken, after the masked trace chose its cases; "
                "differentiate inside the masked function instead (polymask.mask("
                "jax.grad(f)), or jax.jvp / jax.vjp inside it), where the rule is traced "
                "at the call's sizes")
    return f"the derivative (the {rule} rule) fails at these sizes: {text}\n  at {where}"


@register("custom_vjp_call")
def custom_vjp_rule(ctx, *args, call_jaxpr, fwd_jaxpr_thunk, num_consts, bwd, out_trees,
                    symbolic_zeros):
    interp = ctx.interpreter
    consts, xs = list(args[:num_consts]), list(args[num_consts:])
    if not _all_float(xs):
        return ctx.eval_jaxpr(call_jaxpr, *args)
    names, sizes = dynamic_sizes(ctx.state)
    in_avals = call_jaxpr.in_avals[num_consts:]
    out_avals = call_jaxpr.out_avals

    @jax.custom_vjp
    def masked_call(sizes, consts, xs):
        return interp.eval_closed(call_jaxpr, [*consts, *xs], ctx.state.with_sizes(names, sizes))

    def masked_fwd(sizes, consts, xs):
        env = ctx.state.with_sizes(names, sizes)
        try:
            fwd_jaxpr, fwd_consts = compat.call_wrapped(fwd_jaxpr_thunk, *([True] * len(xs)))
        except Exception as e:  # noqa: BLE001 - the rule fails at this case's sizes
            # (as the custom JVP rule's failure: raised where this case runs, so
            # the other cases still differentiate)
            run_checks([Check(True if env.guard is None else env.guard,
                              _rule_failure(e, ctx.source_line, "custom_vjp's forward"))],
                       ctx.source_line)
            return masked_call(sizes, consts, xs), (sizes, consts, None)
        outs = interp.eval_jaxpr(fwd_jaxpr, fwd_consts, xs, env)
        _, res_tree, input_fwds = out_trees()
        n_res = res_tree.num_leaves - sum(f is not None for f in input_fwds)
        res_out, primals_out = outs[:n_res], outs[n_res:]
        res_it = iter(res_out)
        # input_fwds index the primitive's operands, consts first (JAX's
        # process_custom_vjp_call): a residual may be a closed-over array
        operands = [*consts, *xs]
        res = [next(res_it) if f is None else operands[f] for f in input_fwds]
        return primals_out, (sizes, consts, res)

    where = ctx.source_line  # (the backward pass runs after the interpreter is done)

    def masked_bwd(saved, cts):
        sizes, consts, res = saved
        if res is None:  # (the forward rule failed: its check raises where this case runs)
            return None, [jnp.zeros_like(c) for c in consts], [jnp.zeros_like(x) for x in xs]
        env = ctx.state.with_sizes(names, sizes)
        fwd_jaxpr, _ = compat.call_wrapped(fwd_jaxpr_thunk, *([True] * len(in_avals)))
        res_avals = _residual_avals(fwd_jaxpr, out_trees()[2], call_jaxpr.in_avals)
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in [*res_avals, *out_avals]]

        def bwd_flat(*res_and_cts):
            outs = compat.custom_vjp_cotangents(bwd, *res_and_cts)
            return [compat.instantiate_zero(o) for o in outs]

        try:
            bwd_closed = jax.make_jaxpr(bwd_flat)(*structs)
        except (TypeError, NotImplementedError, compat.InconclusiveDimensionOperation) as e:
            raise _bwd_needs_sizes(where, e) from e  # (associative_scan: NotImplementedError)
        outs = interp.eval_closed(bwd_closed, [*res, *cts], env)
        # the user's bwd gives one cotangent per argument; where JAX has wrapped
        # it (_handle_consts_in_bwd) zeros for the consts come first
        # (a constant cotangent, t5x's jnp.array(0.0) for a Python float argument,
        # is a literal of the jaxpr: a Python scalar)
        cts_in = [jnp.asarray(c) for c in outs[len(outs) - len(xs):]]
        cts_in = [clean(c, env.dims.logical_shape(a.shape)) for c, a in zip(cts_in, in_avals)]
        return None, [jnp.zeros_like(c) for c in consts], cts_in

    masked_call.defvjp(masked_fwd, masked_bwd)
    return masked_call(sizes, consts, xs)


@register_precondition("custom_vjp_call", "custom_jvp_call")
def trace_the_derivative_rule_now(eqn) -> None:
    """JAX traces a custom_vjp's forward rule and a custom_jvp's JVP rule
    only when the call is differentiated (a memoized thunk), after the masked
    trace chose its cases: a size comparison there (levanter's flash
    attention raises unless ``T % block == 0``) was then answered
    structurally, outside any case, and raised at every size. Traced here,
    while the trace can still split, it takes the case's answers (the thunk
    keeps the jaxpr for the rule). Its other failures are left for the
    derivative, where plain JAX has them."""
    n_args = len(eqn.invars) - eqn.params["num_consts"]
    vjp = eqn.primitive.name == "custom_vjp_call"
    thunk = eqn.params["fwd_jaxpr_thunk" if vjp else "jvp_jaxpr_fun"]
    # (a forward program (the runners') never takes the derivative: its cases stay
    # the function's; jax.nn's rules compare no sizes: not traced twice)
    if not trace_state().differentiable or compat.defined_in_jax_nn(thunk):
        return
    try:
        # (the arguments the rules below call it with: the memo's key)
        compat.call_wrapped(thunk, *([vjp] * n_args))
    except (compat.SplitNeeded, compat.SplitBeforeRaise):
        trace_state().derivative_rule_splits = True
        raise
    except Exception:  # noqa: BLE001 - (a closure over the outer trace: plain JAX's error too)
        pass


def _bwd_needs_sizes(where: str, e: Exception) -> UnsupportedError:
    """A custom_vjp backward that needs a size as a Python int (``len(ts)`` in
    ``jax.experimental.ode.odeint``'s), traced here with symbolic sizes."""
    said = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return UnsupportedError(
        f"the backward function of the custom_vjp at {where} cannot run with "
        f"symbolic sizes ({type(e).__name__}: {display_internal_names(said)}): it needs a "
        "size as a Python value, or a comparison of sizes no one program decides. "
        "Differentiate inside mask, pm.mask(jax.grad(f), ...), where JAX differentiates "
        "the function at the call's sizes, or use polymask.jit / ragged_map, which run "
        "such sizes per exact shape")


def _residual_avals(fwd_jaxpr, input_fwds, in_avals):
    res_out_avals = iter(v.aval for v in fwd_jaxpr.outvars)
    return [next(res_out_avals) if f is None else in_avals[f] for f in input_fwds]
