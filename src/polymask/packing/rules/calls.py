"""Calls: inner jaxprs are evaluated inline by the packed interpreter.

``jit``/``closed_call``/``remat`` bodies are inlined. A custom JVP
(``jax.nn.softmax``, ``jax.nn.relu``) keeps its rule: the packed call is
wrapped in a ``jax.custom_jvp`` whose JVP evaluates JAX's JVP jaxpr packed
too. A custom VJP with packed operands is inlined only when nothing
differentiates the program (``ragged_map``); under differentiation the
packed layout refuses it (the padded layout runs it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ... import _jax_compat as compat
from ..registry import PerSegment, register_packed


@register_packed("jit", reads_unmasked=True)
def jit_rule(ctx, *args, jaxpr, **params):
    return ctx.eval_inline(jaxpr, *args)


@register_packed("closed_call", "eval_jaxpr", reads_unmasked=True)
def call_rule(ctx, *args, **params):
    return ctx.eval_inline(compat.closed_jaxpr(compat.call_jaxpr_of(params)), *args)


@register_packed("remat2", reads_unmasked=True)
def remat_rule(ctx, *args, jaxpr, **params):
    return ctx.eval_inline(compat.closed_jaxpr(jaxpr), *args)


def _float(x) -> bool:
    d = x.data if isinstance(x, PerSegment) else x
    return jnp.issubdtype(jnp.result_type(d), jnp.inexact)


@register_packed("custom_jvp_call", reads_unmasked=True)
def custom_jvp_rule(ctx, *args, call_jaxpr, jvp_jaxpr_fun, num_consts, symbolic_zeros):
    run = ctx.run
    if run.forward_only:  # nothing differentiates the program: its body inline
        return ctx.eval_inline(call_jaxpr, *args)
    consts, xs = list(args[:num_consts]), list(args[num_consts:])
    if not all(_float(x) for x in xs):
        return ctx.eval_jaxpr(call_jaxpr, *args)

    # the row's segment arrays are arguments, not closed over (custom_jvp
    # functions must not close over tracers of the enclosing vmap/jit)
    @jax.custom_jvp
    def packed_call(segs, consts, xs):
        return run.with_segments(segs).eval_closed(call_jaxpr, [*consts, *xs])

    @packed_call.defjvp
    def packed_call_jvp(primals, tangents):
        segs, consts, xs = primals
        _, _, txs = tangents
        jvp_jaxpr, jvp_consts, out_zeros = compat.call_wrapped(jvp_jaxpr_fun,
                                                               *([False] * len(xs)))
        outs = run.with_segments(segs).eval_jaxpr(jvp_jaxpr, jvp_consts, [*xs, *txs])
        n_out = len(out_zeros)
        primals_out, nz = outs[:n_out], iter(outs[n_out:])
        tangents_out = [jax.tree_util.tree_map(jnp.zeros_like, p) if z else next(nz)
                        for p, z in zip(primals_out, out_zeros)]
        return primals_out, tangents_out

    return packed_call(run.seg.arrays(), consts, xs)


@register_packed("custom_vjp_call", reads_unmasked=True)
def custom_vjp_rule(ctx, *args, call_jaxpr, num_consts, **params):
    if not ctx.run.forward_only and (any(ctx.in_packed) or any(ctx.out_packed)):
        raise ctx.unsupported("a custom VJP over packed values under differentiation")
    return ctx.eval_inline(call_jaxpr, *args)
