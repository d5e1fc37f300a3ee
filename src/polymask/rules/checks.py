"""``checkify.check``: a check fails only where the program it is in runs.

``checkify.check(pred, msg)`` inside a masked function binds the ``check``
primitive on a scalar failure predicate computed by the masked program (a
reduction over a padded array reduces its logical elements only), so it is
bound unchanged. What it needs is the guard: under ``jax.vmap`` every case of a
case split runs for every example, and the examples whose sizes chose another
case hand this one garbage (the ``n == 2`` case reads two entries of a size-0
example's padding). Its failure predicates are and-ed with ``RunState.guard``
(which also covers a loop body's steps past the logical length), so it fails
exactly where plain JAX's check fails on the exact arrays.
(``checkify.checkify`` of the masked function discharges it as usual.)

Formatting arguments with a dynamic size would print their padding in the
message, so they are refused (``UnsupportedError``); format a reduction of
them, or a scalar, instead.
"""

from __future__ import annotations

from .. import _jax_compat as compat
from ..core.shapes import is_static
from ..tracing.registry import register


@register(compat.check_p, sees_guard=True)
def check_rule(ctx, *args, err_tree, debug):
    padded = [i for i, (shape, bound) in enumerate(zip(ctx.in_logical, ctx.in_bounds))
              if not all(is_static(s) and int(s) == b for s, b in zip(shape, bound))]
    if padded:
        raise ctx.unsupported(
            "checkify.check with a formatting argument of dynamic size would print its "
            "padding; format a scalar (a reduction of it) instead")
    if ctx.state.guard is not None:
        args = compat.check_operands_where(args, err_tree, ctx.state.guard)
    return ctx.bind(*args, err_tree=err_tree, debug=debug)
