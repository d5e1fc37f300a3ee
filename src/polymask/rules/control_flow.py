"""Calls and control flow: recurse into inner jaxprs with the same dim env.

``jit``/``pjit``, ``closed_call``, ``remat`` and custom-derivative calls are
evaluated inline by the masking interpreter. ``scan``, ``while`` and ``cond``
live in this module too (see the control-flow issue).
"""

from __future__ import annotations

from .registry import register


@register("pjit", "jit")
def pjit_rule(ctx, *args, jaxpr, **params):
    return ctx.eval_jaxpr(jaxpr, *args)


@register("closed_call", "core_call")
def closed_call_rule(ctx, *args, call_jaxpr, **params):
    return ctx.eval_jaxpr(call_jaxpr, *args)


@register("remat2", "checkpoint")
def remat_rule(ctx, *args, jaxpr, prevent_cse, differentiated, policy):
    import jax

    from .. import _jax_compat as compat

    closed = jaxpr if isinstance(jaxpr, compat.ClosedJaxpr) else compat.ClosedJaxpr(jaxpr, ())

    @jax.checkpoint
    def body(*xs):
        return ctx.eval_jaxpr(closed, *xs)

    return body(*args)


@register("custom_jvp_call")
def custom_jvp_rule(ctx, *args, call_jaxpr, jvp_jaxpr_fun, num_consts, symbolic_zeros):
    return ctx.eval_jaxpr(call_jaxpr, *args)


@register("custom_vjp_call", "custom_vjp_call_jaxpr")
def custom_vjp_rule(ctx, *args, call_jaxpr, **params):
    return ctx.eval_jaxpr(call_jaxpr, *args)
