"""Calls and control flow: recurse into inner jaxprs with the same dim env.

``jit``, ``closed_call``, ``remat`` and custom-derivative calls are
evaluated inline by the masking interpreter. ``scan``, ``while`` and ``cond``
live in this module too (see the control-flow issue).
"""

from __future__ import annotations

from ..tracing.registry import register


@register("jit")
def jit_rule(ctx, *args, jaxpr, **params):
    # Remember where the inner jaxpr's inputs come from (``size_expr_of``
    # follows a loop bound computed from sizes across the call).
    outer = ctx.state.jaxpr_stack[-1] if ctx.state.jaxpr_stack else None
    for iv, ov in zip(jaxpr.jaxpr.invars, ctx.eqn.invars):
        ctx.state.invar_links[iv] = (ov, outer)
    return ctx.eval_jaxpr(jaxpr, *args)


@register("closed_call", "eval_jaxpr")
def call_rule(ctx, *args, **params):
    """A call of a jaxpr (``closed_call`` before jax 0.11, ``eval_jaxpr``):
    evaluated inline."""
    from .. import _jax_compat as compat

    return ctx.eval_jaxpr(compat.closed_jaxpr(compat.call_jaxpr_of(params)), *args)


# at_bound: the primitive object holds functions traced at the symbolic shapes
# (custom_root's solve and linearization), which JAX's own rules would apply to
# arrays of the bound shape
@register("call_hi_primitive", at_bound=True)
def hi_primitive_rule(ctx, *args, **params):
    """A hijax primitive (jax 0.12's ``jnp.searchsorted``, ``jnp.nonzero(size=)``,
    ``lax.custom_root``): its expansion into ordinary primitives
    (``HiPrim.expand``, what JAX lowers), traced at the symbolic operand shapes
    and masked like any inner jaxpr. Where the primitive has a JVP rule of its
    own it is kept, masked the same way (as ``custom_jvp_call``'s): reverse
    mode cannot differentiate ``custom_root``'s solver loop, its rule solves
    the tangent system at the root instead."""
    import jax

    from .. import _jax_compat as compat

    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.in_avals]
    closed = jax.make_jaxpr(compat.hi_primitive_expansion(params))(*structs)
    float_in = [jnp.issubdtype(a.dtype, jnp.inexact) for a in ctx.in_avals]
    own_jvp = compat.hi_primitive_jvp(params, float_in)
    if own_jvp is None or not any(float_in):
        return ctx.eval_jaxpr(closed, *args)
    jvp_closed = jax.make_jaxpr(own_jvp)(
        *structs, *(s for s, f in zip(structs, float_in) if f))
    return _with_masked_jvp(ctx, closed, jvp_closed, float_in, args)


def _with_masked_jvp(ctx, closed, jvp_closed, float_in, args):
    """``closed`` masked, differentiated by ``jvp_closed`` masked (primals, then
    the float operands' tangents -> primal results, then the float results'
    tangents). The sizes are explicit arguments: the custom JVP must not close
    over the outer trace's values."""
    import jax
    import numpy as np

    from .util import dynamic_sizes

    interp = ctx.interpreter
    names, sizes = dynamic_sizes(ctx.state)
    n_out = len(closed.jaxpr.outvars)

    @jax.custom_jvp
    def masked(sizes, xs):
        return interp.eval_closed(closed, list(xs), ctx.state.with_sizes(names, sizes))

    @masked.defjvp
    def masked_jvp(primals, tangents):
        sizes, xs = primals
        txs = [t for t, f in zip(tangents[1], float_in) if f]
        outs = interp.eval_closed(jvp_closed, [*xs, *txs], ctx.state.with_sizes(names, sizes))
        primals_out, float_tangents = outs[:n_out], iter(outs[n_out:])
        # an integer or bool result's tangent is float0
        tangents_out = [next(float_tangents) if jnp.issubdtype(p.dtype, jnp.inexact)
                        else np.zeros(np.shape(p), jax.dtypes.float0) for p in primals_out]
        return primals_out, tangents_out

    return masked(sizes, tuple(args))


@register("remat2")
def remat_rule(ctx, *args, jaxpr, prevent_cse, differentiated, policy):
    import jax

    from .. import _jax_compat as compat

    closed = compat.closed_jaxpr(jaxpr)

    @jax.checkpoint
    def body(*xs):
        with ctx.state.scoped():
            return ctx.eval_jaxpr(closed, *xs)

    return body(*args)


# ----------------------------------------------------------------------------
# scan / while / cond
# ----------------------------------------------------------------------------
# Loops over a dynamic axis run to the bound; a step is *valid* when its row
# (or trip) index is below the logical length. Invalid steps keep the carry
# and zero their stacked outputs with ``select``, so their cotangents are
# exactly 0. Their body still runs (and is differentiated), so it is fed real
# data: the frozen carry, and instead of a padding row (garbage, NaN) the last
# logical row. Its derivatives there are as finite as in a valid step, and
# ``0 * finite = 0`` keeps the constants' gradients exact. (An empty scan
# feeds zeros.) Multiplying by a 0/1 mask instead would give ``0 * nan``.
# The body runs under ``state.guard`` narrowed to the step's validity, so host
# callbacks (``jax.debug.print``, ``pure_callback``, ``io_callback``) and run-time
# checks only act on logical steps, as on exact shapes.

import contextlib  # noqa: E402
import functools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from .. import _jax_compat as compat  # noqa: E402
from ..core.shapes import is_static, needs_mask  # noqa: E402
from .util import gate_gradients, is_inexact, valid_mask  # noqa: E402


def _pick(valid, new, old):
    """``new`` on valid steps, ``old`` otherwise (a select: NaN-safe both ways)."""
    if valid is None:
        return new
    old = jnp.broadcast_to(jnp.asarray(old, new.dtype), new.shape)
    return lax.select(jnp.broadcast_to(valid, new.shape), new, old)


@contextlib.contextmanager
def _guarded(state, valid):
    """Narrow ``state.guard`` to ``valid`` (a traced bool) while a loop body is traced."""
    old = state.guard
    if valid is not None:
        state.guard = valid if old is None else jnp.logical_and(old, valid)
    try:
        yield
    finally:
        state.guard = old


def _as_dtype(vals, avals):
    return [jnp.asarray(v, a.dtype) if hasattr(a, "dtype") else v for v, a in zip(vals, avals)]


@register(lax.scan_p)
def scan_rule(ctx, *args, reverse, length, jaxpr, unroll=1, **params):
    """``lax.scan`` over a (possibly dynamic) axis: run to the bound, freeze after the end.

    Row ``i`` of the padded ``xs`` is a valid step when ``i < length``
    (logical). With ``reverse=True`` the padded scan visits the padding rows
    first, while the carry stays frozen at ``init``, so the logical scan
    starts at the logical end. Stacked outputs are valid on the logical
    prefix. The body is masked recursively (its avals may carry dim vars of
    the same scope: dynamic inner axes of carries and rows).
    """
    num_consts, num_carry = compat.scan_counts(params)
    args = _as_dtype(args, ctx.in_avals)
    consts = args[:num_consts]
    init = args[num_consts:num_consts + num_carry]
    xs = args[num_consts + num_carry:]
    n_pad = ctx.padded(length)
    n_log = ctx.logical(length)
    dynamic = needs_mask(n_log, n_pad)
    carry_avals = ctx.out_avals[:num_carry]
    safe_rows = [_last_row(x, n_log) if dynamic and is_inexact(x.dtype) else None for x in xs]

    def body(carry, inp):
        if dynamic:
            i, row = inp[0], inp[1:]
            valid = i < n_log
            row = [r if s is None else _pick(valid, r, s) for r, s in zip(row, safe_rows)]
        else:
            valid, row = None, inp
        # a step past the end runs but is discarded: no gradient through it
        gated = gate_gradients(None if ctx.state.forward_only else valid,
                               [*consts, *carry, *row])
        with ctx.state.scoped(), _guarded(ctx.state, valid):
            outs = ctx.eval_jaxpr(jaxpr, *gated)
        new = _as_dtype(outs[:num_carry], carry_avals)
        new = [_pick(valid, a, b) for a, b in zip(new, carry)]
        ys = [_pick(valid, y, jnp.zeros((), y.dtype)) if is_inexact(y.dtype) else y
              for y in outs[num_carry:]]
        return new, ys

    if compat.is_dim_expr(unroll):  # unroll=True is recorded as the (symbolic) length
        unroll = True
    seq = ([lax.iota(jnp.int32, n_pad)] if dynamic else []) + list(xs)
    # (inside shard_map the carry varies as the steps make it vary)
    init = compat.as_varying(list(init), compat.varying_axes(args))
    carry, ys = lax.scan(body, init, seq, length=n_pad, reverse=reverse,
                         unroll=unroll)
    return [*carry, *ys]


def _last_row(x, n):
    """Row ``n - 1`` of ``x`` (zeros when ``n == 0``): real data for invalid steps."""
    k = jnp.maximum(jnp.asarray(n, jnp.int32) - 1, 0)
    row = lax.dynamic_index_in_dim(x, k, 0, keepdims=False)
    return lax.select(jnp.broadcast_to(jnp.asarray(n) > 0, row.shape), row,
                      jnp.zeros_like(row))


def _producer(var, jaxpr):
    for eqn in jaxpr.eqns:
        if any(o is var for o in eqn.outvars):
            return eqn
    return None


_INT_BINOPS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b,
               "mul": lambda a, b: a * b}


def size_expr_of(var, jaxpr, depth=0, links=None):
    """The dimension expression an integer scalar ``var`` was computed from, or None.

    Follows ``dim_as_value`` (``x.shape[0]`` used as a number), literals,
    integer casts, ``add``/``sub``/``mul`` and ``neg`` in ``jaxpr``.
    """
    if compat.is_jaxpr_literal(var):
        val = compat.literal_value(var)
        try:
            return int(val)
        except Exception:
            return None
    if depth > 32 or jaxpr is None:
        return None
    eqn = _producer(var, jaxpr)
    if eqn is None:
        if links and var in links:  # an input of a jitted function: follow the call
            outer_var, outer = links[var]
            return size_expr_of(outer_var, outer, depth + 1, links)
        return None
    name = eqn.primitive.name
    if name == "dim_as_value":
        return eqn.params["dim"]
    if name == "convert_element_type":
        if not jnp.issubdtype(eqn.params["new_dtype"], jnp.integer):
            return None
        return size_expr_of(eqn.invars[0], jaxpr, depth + 1, links)
    if name == "neg":
        e = size_expr_of(eqn.invars[0], jaxpr, depth + 1, links)
        return None if e is None else -e
    if name in _INT_BINOPS:
        a = size_expr_of(eqn.invars[0], jaxpr, depth + 1, links)
        b = size_expr_of(eqn.invars[1], jaxpr, depth + 1, links)
        if a is None or b is None:
            return None
        return _INT_BINOPS[name](a, b)
    return None


def _fori_pattern(cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
    """True for the ``while`` that ``fori_loop`` emits: carry ``(i, upper, *x)``,
    ``i < upper``, ``i += 1``, ``upper`` unchanged."""
    cj, bj = cond_jaxpr.jaxpr, body_jaxpr.jaxpr
    if len(cj.invars) < cond_nconsts + 2 or len(bj.outvars) < 2:
        return False
    i_c, up_c = cj.invars[cond_nconsts], cj.invars[cond_nconsts + 1]
    if len(cj.eqns) != 1:
        return False
    e = cj.eqns[0]
    if e.primitive.name != "lt" or list(e.invars) != [i_c, up_c] or cj.outvars[0] is not e.outvars[0]:
        return False
    i_b, up_b = bj.invars[body_nconsts], bj.invars[body_nconsts + 1]
    if bj.outvars[1] is not up_b:
        return False
    inc = _producer(bj.outvars[0], bj)
    if inc is None or inc.primitive.name != "add":
        return False
    a, b = inc.invars
    one = [v for v in (a, b) if compat.is_jaxpr_literal(v)]
    other = [v for v in (a, b) if not compat.is_jaxpr_literal(v)]
    return (len(one) == 1 and len(other) == 1 and other[0] is i_b
            and int(compat.literal_value(one[0])) == 1)


def _trip_bound(ctx, lower_var, upper_var):
    """Static bound of ``upper - lower`` when both are computed from sizes."""
    jaxpr = ctx.state.jaxpr_stack[-1] if ctx.state.jaxpr_stack else None
    links = ctx.state.invar_links
    lo = size_expr_of(lower_var, jaxpr, links=links)
    hi = size_expr_of(upper_var, jaxpr, links=links)
    if lo is None or hi is None:
        return None
    trip = hi - lo
    if not compat.is_dim_expr(trip):
        return max(int(trip), 0)
    try:
        return ctx.padded(trip)
    except Exception:
        return None


@register(lax.while_p)
def while_rule(ctx, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
    """``lax.while_loop`` with a masked body and predicate.

    A ``fori_loop`` whose bounds are computed from sizes (``fori_loop(0,
    x.shape[0], ...)``: the trip count is a logical size, traced) becomes a
    ``scan`` to the trip count's bound with the carry frozen after the
    logical trip count, so it stays reverse-differentiable as it is on exact
    shapes. Other loops run as a ``while_loop`` on the padded carries (carried
    shapes may have dynamic axes; the body is masked recursively).
    """
    args = _as_dtype(args, ctx.in_avals)
    cconsts = args[:cond_nconsts]
    bconsts = args[cond_nconsts:cond_nconsts + body_nconsts]
    init = args[cond_nconsts + body_nconsts:]
    carry_avals = ctx.out_avals
    n0 = cond_nconsts + body_nconsts

    if _fori_pattern(cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
        bound = _trip_bound(ctx, ctx.eqn.invars[n0], ctx.eqn.invars[n0 + 1])
        if bound is not None:
            lower, upper = init[0], init[1]
            trip = jnp.maximum(jnp.asarray(upper) - jnp.asarray(lower), 0)

            last = jnp.maximum(jnp.asarray(upper) - 1, jnp.asarray(lower))

            def step(carry, k):
                valid = k < trip
                # Invalid steps see the last valid index, not one past the end.
                fed = [jnp.minimum(carry[0], last).astype(carry[0].dtype), *carry[1:]]
                gated = gate_gradients(None if ctx.state.forward_only else valid,
                                       [*bconsts, *fed])  # see scan_rule
                with ctx.state.scoped(), _guarded(ctx.state, valid):
                    outs = ctx.eval_jaxpr(body_jaxpr, *gated)
                outs = _as_dtype(outs, carry_avals)
                return [_pick(valid, a, b) for a, b in zip(outs, carry)], None

            carry, _ = lax.scan(step, list(init), lax.iota(jnp.int32, bound), length=bound)
            return carry

    # Where the loop's result is discarded (a scan step past the logical end, a
    # case the sizes do not choose) it runs no iteration: its carry there is not
    # data plain JAX ever loops on, and such a loop may never end (optax's
    # hungarian_algorithm on a padded cost matrix did not).
    guard = ctx.state.guard
    # ``jax.vmap`` of a while_loop in the user's function gives one predicate per
    # row (the primitive loops while any holds; rows done keep their carry):
    # rows of padding never hold, whatever data they have
    pred_shape = cond_jaxpr.out_avals[0].shape
    rows_valid = None
    if pred_shape:
        rows_valid = valid_mask([ctx.logical(d) for d in pred_shape],
                                [ctx.padded(d) for d in pred_shape])

    def row_predicates(carry):
        with ctx.state.scoped():
            pred = ctx.eval_jaxpr(cond_jaxpr, *cconsts, *carry)[0]
        if rows_valid is not None:
            pred = jnp.logical_and(pred, rows_valid)
        return pred if guard is None else jnp.logical_and(pred, guard)

    def cond_fun(carry):
        pred = row_predicates(carry)
        return jnp.any(pred) if pred_shape else pred

    def body_fun(carry):
        # Under vmap a batched predicate runs the body for every row until the
        # last one is done: rows already done are guarded off (without vmap the
        # predicate holds; XLA drops it where nothing uses the guard).
        rows = row_predicates(carry) if pred_shape else None
        active = None if cond_jaxpr.effects else (
            jnp.any(rows) if pred_shape else cond_fun(carry))
        with ctx.state.scoped(), _guarded(ctx.state, active):
            new = _as_dtype(ctx.eval_jaxpr(body_jaxpr, *bconsts, *carry), carry_avals)
        if rows is None:
            return new
        return [lax.select(jnp.broadcast_to(rows.reshape(rows.shape + (1,) * (n.ndim - rows.ndim)),
                                            n.shape), n, o) for n, o in zip(new, carry)]

    return list(lax.while_loop(cond_fun, body_fun, list(init)))


@register(lax.cond_p)
def cond_rule(ctx, index, *ops, branches, **params):
    """``lax.cond``/``lax.switch``: each branch masked recursively.

    Branch outputs share their symbolic avals, so their logical shapes are
    the same expressions; the padded outputs have equal bounds. Under
    ``vmap`` with a batched index JAX turns the switch into a select.
    """

    def run(branch, *xs):
        with ctx.state.scoped():
            return _as_dtype(ctx.eval_jaxpr(branch, *xs), ctx.out_avals)

    fns = [functools.partial(run, br) for br in branches]
    if is_static(index) or (not compat.is_tracer(index) and jnp.ndim(index) == 0):
        k = min(max(int(index), 0), len(branches) - 1)
        return fns[k](*ops)
    return list(lax.switch(index, fns, *ops))
