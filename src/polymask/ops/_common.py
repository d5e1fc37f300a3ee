"""Shared by the data-dependent ops: fresh dim vars, padded sizes, eager fallback."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import _jax_compat as compat
from ..core.diagnostics import user_call_site
from ..core.errors import ShapeError
from ..core.shapes import DimEnv
from ..core.trace_state import current_scope


def _scope():
    return current_scope()


def _fresh(bound: int, at_most=None):
    """A fresh dim var ``_uK <= bound`` in the masked trace's scope, or 0.

    ``at_most``: a symbolic size it never exceeds (``_uK <= n``), so that
    shapes such as ``n - _uK`` trace as non-negative. JAX takes every dim var
    to be >= 1, so that constraint would also tell it ``n >= 1``, and the
    rest of the trace would drop its checks at ``n = 0`` (``x.max()`` after a
    selection of ``x``: a value where plain JAX raises). Where ``n`` may be
    0, the trace splits on ``n >= 1`` first; in the case ``n = 0`` (or a
    bound of 0) the count is the constant 0, as it is in plain JAX.
    """
    if int(bound) <= 0 or (at_most is not None and compat.upper_bound(at_most) <= 0):
        return 0
    if compat.is_dim_expr(at_most) and compat.lower_bound(at_most) < 1:
        compat.split_here(at_most - 1, f"Symbolic dimension comparison '{at_most}' >= '1' "
                                       "is inconclusive.")
        at_most = None  # (no split possible here: the bound alone)
    scope = _scope()
    name, d = compat.new_fresh_dim(scope)
    if compat.count_is_empty(scope, name):  # the case of a split where it is 0
        return compat.EmptyCount(name)
    compat.add_constraint(scope, f"{name} <= {int(bound)}")
    compat.note_fresh_bound(scope, name, bound)
    # Only when JAX's bound of `at_most` (which assumes dim vars >= 1) is its
    # true bound: `_u <= n - m` would cap _u below n when m = 0.
    if (at_most is not None and compat.is_dim_expr(at_most)
            and compat.upper_bound(at_most) >= _padded(at_most)):
        try:
            compat.add_constraint(scope, f"{name} <= {at_most}")
        except Exception:  # an expression JAX cannot use as a constraint: bound only
            pass
    return d


def _size(shape):
    """Number of elements of a (symbolic) shape, as a dimension expression or int."""
    return math.prod(shape)


def _padded(d) -> int:
    """Padded size of an operand's axis, exactly as the interpreter computes it."""
    if not compat.is_dim_expr(d):
        return int(d)
    return DimEnv(_scope(), {}, {}).padded(d)


def _bound(shape) -> int:
    """Padded number of elements of an operand of (symbolic) ``shape``."""
    return math.prod(_padded(d) for d in shape)


_CONCRETIZATION = (jax.errors.ConcretizationTypeError, jax.errors.NonConcreteBooleanIndexError,
                   jax.errors.TracerIntegerConversionError)


def _eager(name, fn, *args, hint="", **kwargs):
    """Run the ``jax.numpy`` version; explain what to do when the size is not concrete."""
    args = [jnp.asarray(a) if isinstance(a, (list, tuple)) else a for a in args]
    try:
        return fn(*args, **kwargs)
    except _CONCRETIZATION as e:
        err = ShapeError(
            f"polymask.{name} has a data-dependent output size, which needs concrete inputs "
            f"(called at {user_call_site()}). Inside jax.jit / jax.vmap call it within "
            f"polymask.mask, where the size becomes a logical size with a known bound{hint}."
            f"\n  JAX said: {str(e).splitlines()[0]}")
        err.polymask_needs_mask = True  # (a runner's per-shape fallback: not the cause)
        raise err from None


def _masking(*args) -> bool:
    """True while a masked trace is in progress (polymask.mask's make_jaxpr)."""
    return _scope() is not None
