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
wrong gradient), and so does ``jax.vmap`` over it (the implementation may hold
callbacks or closures that only the primitive's batching rule handles):
``polymask.jit``, ``ragged_map`` and ``value_and_grad`` then run those sizes
per exact shape under ``jax.jit`` (``runners/fallback.py``), where the
primitive's own rules apply. A primitive whose implementation is XLA's own
(``apply_primitive``) is never inlined.
"""

from __future__ import annotations

import jax

from .. import _jax_compat as compat
from ..core.errors import UnsupportedError
from ..tracing.registry import register_default


@register_default(compat.has_python_impl)
def inlined_impl_rule(ctx, *args, **params):
    prim = ctx.primitive
    sizes = [d for shape in ctx.in_logical for d in shape]
    if any(compat.is_batched(v) for v in (*args, *sizes)):
        raise ctx.unsupported(
            f"'{prim.name}' has no masking rule; its Python implementation is masked "
            "instead, but not under jax.vmap (only the primitive's own batching rule knows "
            "how to batch it)")
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.in_avals]
    closed = jax.make_jaxpr(lambda *xs: prim.impl(*xs, **params))(*avals)
    if any(e.primitive is prim for e in closed.jaxpr.eqns):
        raise ctx.unsupported(f"'{prim.name}' has no masking rule and its implementation "
                              "binds itself")
    message = (f"polymask cannot differentiate primitive '{prim.name}' here: it has no "
               "masking rule, so its Python implementation was masked, and its own "
               f"derivative rule works at exact shapes only\n  at {ctx.source_line}")

    @jax.custom_jvp
    def run(*xs):
        return tuple(ctx.eval_jaxpr(closed, *xs))

    @run.defjvp
    def _no_derivative(primals, tangents):
        raise UnsupportedError(message)

    outs = list(run(*args))
    return outs if prim.multiple_results else outs[0]
