"""``debug_callback`` (``jax.debug.callback`` / ``jax.debug.print``).

The callback receives the padded operands as they are (it has no results, so
nothing padded leaks into the program). A nested ``polymask.mask`` stages its
size checks as a debug callback under a ``lax.cond`` whose predicate is a
masked reduction, so the callback only runs when a logical size is bad, and
its first bad batch element is a logical one (padding comes last).
"""

from __future__ import annotations

from .registry import register


@register("debug_callback")
def debug_callback_rule(ctx, *args, **_):
    return ctx.bind(*args)
