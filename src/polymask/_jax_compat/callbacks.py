"""Host callbacks: ``jax.debug.print``'s host formatting and the debug effects.

``jax.debug.print`` binds its own primitive (``debug_print``) whose host
function is built from its params at lowering time; polymask rebinds it as a
``debug_callback`` whose host function first slices the operands to their
logical shapes, then formats exactly as ``jax.debug.print`` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jax._src import debugging as _debugging

from .versions import inner_jaxprs

__all__ = ["debug_callback_p", "debug_effect", "debug_print_host_function", "host_call_in",
           "effectful_eqn_in"]

debug_callback_p = _debugging.debug_callback_p


def debug_effect(ordered: bool):
    """The effect ``jax.debug.callback(..., ordered=ordered)`` records."""
    return _debugging.ordered_debug_effect if ordered else _debugging.debug_effect


def debug_print_host_function(*, fmt, in_tree, static_args, np_printoptions,
                              has_placeholders, logging_record, **_) -> Callable:
    """The host function ``jax.debug.print`` calls with its flat operands
    (built from the ``debug_print`` equation's params, as its lowering does)."""
    fn = functools.partial(_debugging._format_print_callback, fmt, dict(np_printoptions),
                           has_placeholders, logging_record)
    return _debugging._make_flat_callback(in_tree, fn, static_args)


def _first_eqn_in(jaxpr, wanted):
    """The first equation of ``jaxpr`` (a ``Jaxpr``), at any depth (``cond``
    branches, loop bodies, nested calls), for which ``wanted(eqn)``, else None."""
    for eqn in jaxpr.eqns:
        if wanted(eqn):
            return eqn
        for inner, _ in inner_jaxprs(eqn.params):
            found = _first_eqn_in(inner, wanted)
            if found is not None:
                return found
    return None


def effectful_eqn_in(jaxpr):
    """The first equation of ``jaxpr``, at any depth, with effects of its own
    (``debug_print`` of jax 0.12, ``debug_callback`` before, an ordered
    callback; not one holding an inner jaxpr), else None."""
    return _first_eqn_in(jaxpr, lambda eqn: bool(eqn.effects) and not any(
        True for _ in inner_jaxprs(eqn.params)))


def host_call_in(jaxpr):
    """The first equation of ``jaxpr``, at any depth, whose primitive calls the
    host (a callback), else None."""
    return _first_eqn_in(jaxpr, lambda eqn: "callback" in eqn.primitive.name)
