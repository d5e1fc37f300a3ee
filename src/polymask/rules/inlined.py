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
(lineax's solves stop gradients that their JVP rule supplies; an iterative
solve's loop cannot be transposed). So a derivative is the primitive's own
JVP rule, traced at the equation's shapes and masked like the implementation
(``_masked_derivative``). The solves it binds on primal values are masked as
this one; those it binds on tangents (and those a custom JVP rule binds on
tangents, as optimistix's implicit function theorem does) are linear maps
whose transpose is the primitive's own transpose rule, masked
(``_linear_in_tangents``: ``jax.custom_derivatives.linear_call``), so
``jax.grad`` never transposes the implementation. Where the JVP rule decides
on sizes in Python (lineax's least squares: is the matrix tall?), or under
``jax.vmap`` inside one case of a case split (the batched switch transposes
every case on every example, with residuals that may be another case's),
the derivative raises ``UnsupportedError`` (never a wrong gradient):
``polymask.jit``, ``ragged_map`` and ``value_and_grad`` then run those
sizes per exact shape under ``jax.jit`` (``runners/fallback.py``). Under
``jax.vmap`` (ragged batches of ``mask``) the implementation runs once per
example in a loop (``jax.custom_batching.sequential_vmap``): it may hold
callbacks or closed-over values that only the primitive's own batching rule
could batch (lineax: "Detected batching of lineax.linear_solve with respect
to a closed-over value"). A primitive whose implementation is XLA's own
(``apply_primitive``) is never inlined.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from .. import _jax_compat as compat
from ..core.dimvars import display_internal_names
from ..core.errors import UnsupportedError
from ..core.trace_state import tangent_operands, trace_state
from ..tracing.registry import register, register_default
from .tangents import tangent_equations
from .util import dynamic_sizes


@register_default(compat.has_python_impl, sees_guard=True, at_bound=True)
def inlined_impl_rule(ctx, *args, **params):
    prim = ctx.primitive
    args = _scalars_as_variables(ctx, args)
    symbolic = _traced_at_symbolic_shapes(ctx)
    if not symbolic:  # bound unchanged (dims in params substituted)
        if ctx.state.guard is None or not _may_call_the_host(ctx):
            return ctx.bind(*args)
        params = ctx.concrete_params()  # one case of a case split: bound where it holds
    avals = _structs(ctx.in_avals)
    closed = jax.make_jaxpr(lambda *xs: prim.impl(*xs, **params))(*avals)
    if symbolic and any(e.primitive is prim for e in closed.jaxpr.eqns):
        raise ctx.unsupported(f"'{prim.name}' has no masking rule and its implementation "
                              "binds itself")
    message = (f"polymask cannot differentiate primitive '{prim.name}' here (a library "
               "primitive implemented in Python, masked through its implementation)\n"
               f"  at {ctx.source_line}")

    linear = _tangent_positions(ctx, args)
    if linear:
        # tangents that the primitive's own JVP rule, or a custom JVP rule
        # (optimistix's implicit function theorem), solves with
        return _linear_in_tangents(ctx, closed, args, params, message, linear)

    if symbolic:
        primal = lambda state, xs: tuple(ctx.interpreter.eval_closed(closed, list(xs), state))
    else:
        primal = lambda state, xs: _bind(prim, xs, params)
    # the sizes are explicit arguments: a function JAX traces again (custom_jvp,
    # sequential_vmap) must not close over the outer trace's values
    names, sizes = dynamic_sizes(ctx.state)
    per_example = _per_example(ctx, names, primal, [
        (b, v.aval.dtype) for b, v in zip(ctx.out_bounds, ctx.eqn.outvars)])

    @jax.custom_jvp
    def run(sizes, xs):
        return per_example(sizes, (xs,))

    run.defjvp(_masked_derivative(ctx, params, names, message), symbolic_zeros=True)
    outs = list(run(sizes, tuple(args)))
    return outs if prim.multiple_results else outs[0]


def _scalars_as_variables(ctx, args) -> list:
    """The operands with the scalars made JAX arrays of their avals' types
    that stay variables of the jaxpr, as the library's code sees its
    constants under plain JAX. A scalar literal evaluates to a NumPy or
    Python scalar (``TypedFloat`` on jax 0.12), and a scalar constant bound
    inside ``jax.jit`` is a literal again in the jaxpr that ``jax.grad`` of
    that jit transposes; equinox partitions a primitive's operands by
    ``is_array``, so a float literal moves to the static part (lineax's
    transpose then rebuilt an optimistix solver with ``learning_rate=None``:
    "Closure-converted function called with different dynamic arguments").
    An optimization barrier is an equation, so its result stays a
    variable."""
    def as_variable(x, aval):
        if aval.shape or not _numeric(aval.dtype):  # PRNG keys and float0 stay as they are
            return x
        if not compat.is_tracer(x):
            x = jnp.asarray(x, aval.dtype)
            x = compat.as_weakly_typed(x) if aval.weak_type else x
        return jax.lax.optimization_barrier(x)
    return [as_variable(x, a) for x, a in zip(args, ctx.in_avals)]


def _numeric(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)


def _bind(prim, xs, params) -> tuple:
    outs = prim.bind(*xs, **params)
    return tuple(outs) if prim.multiple_results else (outs,)


def _masked_derivative(ctx, params, names, message: str):
    """The JVP rule of ``run(sizes, operands)``: the primitive's own JVP rule,
    traced at the equation's shapes and masked. The primitives it binds on
    primal values are masked as this one; those it binds on tangents are
    marked so (``tangent_operands``) and run linearly with their own transpose
    (``_linear_in_tangents``), so that reverse mode transposes them."""
    out_bounds = ctx.out_bounds
    float_outs = [i for i, v in enumerate(ctx.eqn.outvars) if _differentiable(v.aval)]

    def masked_derivative(primals, tangents):
        sizes, xs = primals
        live = [i for i, t in enumerate(tangents[1]) if not isinstance(t, SymbolicZero)]
        jvp = _jvp_of(ctx, params, tuple(live), message)
        state = ctx.state.with_sizes(names, sizes)
        live_tangents = [tangents[1][i] for i in live]
        invars = jvp.jaxpr.invars
        marked = tangent_equations(jvp.jaxpr, invars[len(invars) - len(live):])

        # in one case of a case split the primitives it binds run where the case's
        # guard holds (``_per_example``); the rest computes on their zeros
        with tangent_operands(marked):
            flat = ctx.interpreter.eval_closed(jvp, [*xs, *live_tangents], state)
        n_out = len(out_bounds)
        tangents_out = [_float0_zeros(b) for b in out_bounds]
        for i, t in zip(float_outs, flat[n_out:]):
            tangents_out[i] = t
        return tuple(flat[:n_out]), tuple(tangents_out)

    return masked_derivative


def _per_example(ctx, names, run, out_shapes):
    """``run(state, *operands)`` as a function of ``(sizes, operands)`` (the
    sizes explicit: JAX traces it again, so it must not close over the outer
    trace's values). Under ``jax.vmap`` it runs one example at a time
    (``sequential_vmap``): the implementation may hold callbacks or
    closed-over values that only the primitive's own batching rule could
    batch (lineax: "Detected batching of lineax.linear_solve with respect to a
    closed-over value"). In one case of a case split it runs only where the
    case's guard holds, zeros of ``out_shapes`` elsewhere: under vmap every
    case runs for every example, and the implementation's own checks
    (equinox's ``error_if``: a host callback) must not fire on the examples
    whose sizes chose another case."""
    @jax.custom_batching.sequential_vmap
    def call(sizes, operands):
        state = ctx.state.with_sizes(names, sizes)
        if state.guard is None:
            return run(state, *operands)
        skipped = lambda: tuple(jnp.zeros(shape, dtype) for shape, dtype in out_shapes)
        return jax.lax.cond(state.guard, lambda: run(state, *operands), skipped)
    return call


def _tangent_positions(ctx, args) -> tuple[int, ...]:
    """The operands that are tangents: marked so by the JVP rule being
    evaluated (``masked_derivative``), or unknown values of ``jax.grad``'s
    linearization."""
    marked = trace_state().tangent_operands.get(id(ctx.eqn))
    if marked:
        return marked
    return tuple(i for i, a in enumerate(args) if compat.is_linearized(a))


def _linear_in_tangents(ctx, closed, args, params, message: str, linear):
    """The primitive bound on tangents under ``jax.grad``: its masked
    implementation, linear in the tangents, with the primitive's own transpose
    rule, masked, as its transpose (``jax.custom_derivatives.linear_call``).
    Reverse mode cannot transpose the implementation itself: lineax's solves
    check their result for non-finite values, and an iterative solve loops.
    The floating outputs are the tangents; the others (a solve's status) are
    zeros."""
    prim = ctx.primitive
    # JAX's cond between the cases, batched (jax.vmap), runs every case on every
    # example; transposed in jax.grad's backward pass, with residuals that may be
    # another case's, so that the case's guard among them cannot be trusted
    guarded_in_batched_cases = ctx.state.guard is not None and trace_state().cases_batched
    rest = [i for i in range(len(args)) if i not in linear]
    names, sizes = dynamic_sizes(ctx.state)
    float_outs = [i for i, v in enumerate(ctx.eqn.outvars) if _differentiable(v.aval)]
    out_bounds = ctx.out_bounds

    def operands(residuals, linears):
        full = [None] * len(args)
        for i, x in zip(rest, residuals):
            full[i] = x
        for i, x in zip(linear, linears):
            full[i] = x
        return full

    apply_per_example = _per_example(
        ctx, names, lambda state, residuals, linears: tuple(ctx.interpreter.eval_closed(
            closed, operands(residuals, linears), state)[i] for i in float_outs),
        [(out_bounds[i], ctx.eqn.outvars[i].aval.dtype) for i in float_outs])
    transpose_per_example = _per_example(
        ctx, names, lambda state, residuals, cts: tuple(ctx.interpreter.eval_closed(
            _transpose_of(ctx, params, linear, rest, float_outs, message),
            [*residuals, *cts], state)),
        [(args[i].shape, args[i].dtype) for i in linear])

    def apply(res, linears):
        sizes, residuals = res
        return apply_per_example(sizes, (residuals, linears))

    def apply_transpose(res, cts):
        if guarded_in_batched_cases:  # forward mode (apply) keeps the true guard
            raise UnsupportedError(
                f"{message.rstrip()}\n  under jax.vmap, in one case of a case split (a "
                "size comparison splits the function; polymask.explain lists it), reverse "
                "mode cannot tell that case's examples from the others. A constraint that "
                "decides the comparison (mask(..., constraints=[...])) removes the split, "
                "or differentiate inside mask: pm.mask(jax.grad(f), ...)")
        sizes, residuals = res
        return list(transpose_per_example(sizes, (residuals, cts)))

    tangents = compat.linear_call(
        apply, apply_transpose, (sizes, [args[i] for i in rest]),
        [args[i] for i in linear])
    outs = [jnp.zeros(b, v.aval.dtype) for b, v in zip(out_bounds, ctx.eqn.outvars)]
    for i, t in zip(float_outs, tangents):
        outs[i] = t
    return outs if prim.multiple_results else outs[0]


def _transpose_of(ctx, params, linear, rest, float_outs, message: str):
    """The primitive's own transpose rule at the equation's symbolic shapes, as
    a closed jaxpr ``(*operands not in linear, *cotangents of the floating
    outputs) -> cotangents of the linear operands``."""
    prim = ctx.primitive
    rule = compat.transpose_rule(prim)
    if rule is None:
        raise UnsupportedError(f"{message}; it has no transpose rule")
    avals = _structs(ctx.in_avals)
    out_avals = ctx.out_avals

    def transpose(residuals, float_cts):
        operands = [compat.undefined_primal(ctx.in_avals[i]) for i in range(len(avals))]
        for i, x in zip(rest, residuals):
            operands[i] = x
        cts = [compat.zero_tangent(a) for a in out_avals]
        for i, ct in zip(float_outs, float_cts):
            cts[i] = ct
        cts_in = rule(cts if prim.multiple_results else cts[0], *operands, **params)
        return [jnp.zeros(avals[i].shape, avals[i].dtype)
                if cts_in[i] is None or compat.is_zero_tangent(cts_in[i]) else cts_in[i]
                for i in linear]

    return jax.make_jaxpr(transpose)([avals[i] for i in rest],
                                     _structs([out_avals[i] for i in float_outs]))


def _jvp_of(ctx, params, live: tuple[int, ...], message: str):
    """The primitive's own JVP rule at the equation's symbolic shapes, as a
    closed jaxpr ``(*operands, *tangents of live) -> (*outputs, *tangents of
    the floating outputs)``; the other operands' tangents are JAX's symbolic
    zeros, as the rule expects (lineax asserts them)."""
    prim = ctx.primitive
    rule = compat.jvp_rule(prim)
    if rule is None:
        raise UnsupportedError(f"{message}; it has no JVP rule")
    avals = _structs(ctx.in_avals)

    def jvp(primals, live_tangents):
        tangents = [compat.zero_tangent(a) for a in ctx.in_avals]
        for i, t in zip(live, live_tangents):
            tangents[i] = t
        outs, touts = rule(list(primals), tangents, **params)
        if not prim.multiple_results:
            outs, touts = [outs], [touts]
        touts = [jnp.zeros(o.shape, o.dtype) if compat.is_zero_tangent(t) else t
                 for o, t in zip(outs, touts)]
        return [*outs, *(t for o, t in zip(outs, touts) if _differentiable(o))]

    try:
        return jax.make_jaxpr(jvp)(avals, [avals[i] for i in live])
    except compat.InconclusiveDimensionOperation as e:
        # the rule decides on the sizes in Python (lineax: a tall or a wide
        # operator), which at symbolic sizes is a case split polymask's own
        # trace never saw
        comparison = display_internal_names(str(e).splitlines()[0])
        raise UnsupportedError(
            f"{message.rstrip()}\n  its JVP rule compares sizes, which polymask cannot "
            f"decide for every size at once ({comparison}). A constraint that decides it "
            f"({_deciding_constraints(comparison)}; mask, polymask.jit, ragged_map and "
            "value_and_grad take constraints=) shares one program again; else "
            "differentiate inside mask (pm.mask(jax.grad(f), ...)), where JAX "
            "differentiates the library's code, or use polymask.jit / ragged_map, "
            "which run those sizes per exact shape") from None


def _deciding_constraints(comparison: str) -> str:
    """``"constraints=['n >= 4'] or ['n <= 3']"`` for JAX's "Symbolic dimension
    comparison 'n' <= '3' is inconclusive": the comparison and its negation
    (sizes are integers); a generic example where the text does not parse."""
    m = re.search(r"'([^']+)' (<=|>=|<|>) '([^']+)'", comparison)
    if m is None:
        return "constraints=['n >= 3']"
    a, op, b = m.groups()
    negated = {"<=": (">=", 1), ">=": ("<=", -1), "<": (">=", 0), ">": ("<=", 0)}[op]
    bound = f"{int(b) + negated[1]}" if b.lstrip("-").isdigit() else (
        f"{b} + {negated[1]}" if negated[1] > 0 else f"{b} - {-negated[1]}" if negated[1] else b)
    return f"constraints=['{a} {op} {b}'] or ['{a} {negated[0]} {bound}']"


def _structs(avals) -> list:
    """``ShapeDtypeStruct``s of ``avals``, weak types kept: a library's closure-
    converted function checks that it is called with what it was traced with
    (equinox: "called with different dynamic arguments")."""
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
            for a in avals]


def _differentiable(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _float0_zeros(shape):
    """The tangent of an integer output (JAX's ``float0``)."""
    return np.zeros(shape, jax.dtypes.float0)


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
    avals = _structs(ctx.in_avals)
    jaxpr = jax.make_jaxpr(lambda *xs: prim.impl(*xs, **params))(*avals).jaxpr
    return (bool(jaxpr.effects) or compat.host_call_in(jaxpr) is not None
            or any(compat.has_python_impl(e.primitive) for e in jaxpr.eqns))


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
