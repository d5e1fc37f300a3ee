"""Primitives whose implementation is Python: masked through that implementation.

Libraries define primitives of their own to give a Python function custom
derivatives and batching (equinox's ``filter_primitive``: lineax's
``linear_solve``, optimistix's solvers through it). Such a primitive has no
rule here, but its eager implementation is ordinary JAX code: the default rule
traces that implementation at the equation's symbolic shapes and masks it
equation by equation, as it masks the user's own code. Values are the
implementation's.

What the implementation does not carry is the primitive's own derivative and
batching rules, and its operations alone need not give the right derivative
(lineax's solves stop gradients that their JVP rule supplies). So a
derivative of the inlined primitive raises ``UnsupportedError`` (never a
wrong gradient): ``polymask.jit``, ``ragged_map`` and ``value_and_grad`` then
run those sizes per exact shape under ``jax.jit`` (``runners/fallback.py``),
where the primitive's own rules apply. Under ``jax.vmap`` (ragged batches of
``mask``) the implementation runs once per example in a loop
(``jax.custom_batching.sequential_vmap``): it may hold callbacks or
closed-over values that only the primitive's own batching rule could batch
(lineax: "Detected batching of lineax.linear_solve with respect to a
closed-over value"). A primitive whose implementation is XLA's own
(``apply_primitive``) is never inlined.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .. import _jax_compat as compat
from ..core.errors import UnsupportedError
from ..tracing.registry import register, register_default
from .util import dynamic_sizes


@register_default(compat.has_python_impl, sees_guard=True, at_bound=True)
def inlined_impl_rule(ctx, *args, **params):
    prim = ctx.primitive
    if not _traced_at_symbolic_shapes(ctx):  # bound unchanged (dims in params substituted)
        if ctx.state.guard is None or not _may_call_the_host(ctx):
            return ctx.bind(*args)
        return _bound_where_guarded(ctx, args, ctx.concrete_params())
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.in_avals]
    closed = jax.make_jaxpr(lambda *xs: prim.impl(*xs, **params))(*avals)
    if any(e.primitive is prim for e in closed.jaxpr.eqns):
        raise ctx.unsupported(f"'{prim.name}' has no masking rule and its implementation "
                              "binds itself")
    message = (f"polymask cannot differentiate primitive '{prim.name}' here: it has no "
               "masking rule, so its Python implementation was masked, and its own "
               f"derivative rule works at exact shapes only\n  at {ctx.source_line}")

    if any(compat.is_linearized(a) for a in args):
        # tangents inside a custom JVP rule (optimistix's implicit function theorem
        # solves with them): reverse mode must transpose what the implementation
        # does to them, which only the primitive's own transpose rule can
        raise UnsupportedError(message)
    # the sizes are explicit arguments: a function JAX traces again (custom_jvp,
    # sequential_vmap) must not close over the outer trace's values
    names, sizes = dynamic_sizes(ctx.state)
    out_bounds = ctx.out_bounds

    @jax.custom_batching.sequential_vmap  # under vmap: one example at a time
    def masked_impl(sizes, xs):
        state = ctx.state.with_sizes(names, sizes)
        run_impl = lambda: tuple(ctx.interpreter.eval_closed(closed, list(xs), state))
        if state.guard is None:
            return run_impl()
        # one case of a case split: under vmap every case runs for every example, and
        # the implementation's own checks (equinox's error_if: a host callback) must
        # not fire on the examples whose sizes chose another case
        skipped = lambda: tuple(jnp.zeros(b, v.aval.dtype)
                                for b, v in zip(out_bounds, ctx.eqn.outvars))
        return jax.lax.cond(state.guard, run_impl, skipped)

    @jax.custom_jvp
    def run(sizes, xs):
        return masked_impl(sizes, xs)

    @run.defjvp
    def _no_derivative(primals, tangents):
        raise UnsupportedError(message)

    outs = list(run(sizes, tuple(args)))
    return outs if prim.multiple_results else outs[0]


def _traced_at_symbolic_shapes(ctx) -> bool:
    """Whether the equation's shapes hold dim vars. Its params may then hold
    them too, where ``substitute_dims`` cannot reach (lineax keeps the
    operator's ``ShapeDtypeStruct`` structure in an equinox ``Static`` inside
    a treedef), so even with every size at its bound it is never bound as it
    is: its implementation is masked, and runs on the padded arrays' shapes
    (binding it eagerly compared ``(n,)`` with ``(8,)`` and raised "pytree does
    not match out_structure")."""
    return any(compat.is_dim_expr(d) for a in (*ctx.in_avals, *ctx.out_avals)
               for d in getattr(a, "shape", ()))


def _may_call_the_host(ctx) -> bool:
    """Whether the implementation (traced at the equation's exact shapes) calls
    the host, directly or through another primitive implemented in Python.
    Only those need guarding per example; the others keep their own batching
    rule, which may differ from running the implementation per example on
    purpose (equinox's ``select_if_vmap`` is ``x`` alone and a select batched)."""
    prim, params = ctx.primitive, ctx.concrete_params()
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.in_avals]
    jaxpr = jax.make_jaxpr(lambda *xs: prim.impl(*xs, **params))(*avals).jaxpr
    return (bool(jaxpr.effects) or compat.host_call_in(jaxpr) is not None
            or any(compat.has_python_impl(e.primitive) for e in jaxpr.eqns))


def _bound_where_guarded(ctx, args, params):
    """The primitive traced at exact shapes (a case of a case split that fixes
    its sizes) under a guard: that case, or a loop's steps past the logical
    length. Only where the guard holds is it bound, unchanged.

    Under ``jax.vmap`` every case runs for every example (the switch between
    them becomes a select), so an example whose sizes chose another case hands
    this one garbage: the n = 1 case of a solve sees a 1 x 1 corner of an
    n = 0 example's padding, and the implementation's own checks (equinox's
    ``error_if``, a host callback) raise on it. Each example therefore runs
    alone behind its own guard (``sequential_vmap`` of a ``lax.cond``), as
    plain JAX runs it per example; without ``vmap`` that is one ``cond``. The
    derivative is the primitive's own (``custom_vmap`` cannot be transposed),
    so under ``jax.grad`` its batched bind runs unguarded, as before."""
    prim = ctx.primitive
    out_bounds = ctx.out_bounds

    def bind(*xs):
        outs = prim.bind(*xs, **params)
        return tuple(outs) if prim.multiple_results else (outs,)

    @jax.custom_batching.sequential_vmap
    def per_example(guard, xs):
        skipped = lambda: tuple(jnp.zeros(b, v.aval.dtype)
                                for b, v in zip(out_bounds, ctx.eqn.outvars))
        return jax.lax.cond(guard, lambda: bind(*xs), skipped)

    @jax.custom_jvp
    def run(guard, xs):
        return per_example(guard, xs)

    def _own_derivative(primals, tangents):
        # only the differentiated operands get tangents: the others stay JAX's
        # symbolic zeros, as the primitive's JVP rule expects (lineax asserts it)
        xs, txs = primals[1], tangents[1]
        live = [i for i, t in enumerate(txs) if not isinstance(t, SymbolicZero)]

        def of_live(*live_xs):
            full = list(xs)
            for i, x in zip(live, live_xs):
                full[i] = x
            return bind(*full)

        return jax.jvp(of_live, [xs[i] for i in live], [txs[i] for i in live])

    run.defjvp(_own_derivative, symbolic_zeros=True)

    outs = list(run(ctx.state.guard, tuple(args)))
    return outs if prim.multiple_results else outs[0]


# primitives of other libraries that have rules here: {name: module that defines
# them} (tests/test_registry.py checks each is a primitive there)
_UNVMAP = ("unvmap_any", "unvmap_all", "unvmap_max")
LIBRARY_PRIMITIVES = {name: "equinox.internal" for name in _UNVMAP}


@register(*_UNVMAP, sees_guard=True)
def unvmap_reduction_rule(ctx, x):
    """equinox's ``unvmap_any`` / ``unvmap_all`` / ``unvmap_max``: ``jnp.any`` /
    ``all`` / ``max`` over every element and, under ``jax.vmap``, over the batch
    too (their batching rule reduces the batched operand whole). Each example's
    logical elements are reduced first (the implementation, masked), then the
    primitive is bound on that scalar, so its batching rule reduces over the
    examples and never over padding (equinox's ``error_if`` branches on it).
    In one case of a case split, the rows whose sizes chose another case give
    the reduction's neutral value (their data is not the function's)."""
    prim = ctx.primitive
    closed = jax.make_jaxpr(prim.impl)(jax.ShapeDtypeStruct(ctx.in_avals[0].shape,
                                                             ctx.in_avals[0].dtype))
    (per_example,) = ctx.eval_jaxpr(closed, x)
    guard = ctx.state.guard
    if guard is not None:  # rows of another case (under vmap every case runs) do not count
        neutral = {"unvmap_any": False, "unvmap_all": True}.get(
            prim.name, jnp.iinfo(per_example.dtype).min if jnp.issubdtype(
                per_example.dtype, jnp.integer) else -jnp.inf)
        per_example = jnp.where(guard, per_example, jnp.asarray(neutral, per_example.dtype))
    return prim.bind(per_example)
