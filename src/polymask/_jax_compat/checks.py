"""``checkify.check``: the error value its ``check`` primitive carries.

``checkify.check(pred, msg)`` binds ``check`` on the flattened
``checkify.Error`` (per error effect: a predicate that is True where the check
failed, a code, a payload); the structure is the ``err_tree`` param. Its
fields are private to JAX (``Error._pred``, ``Error._replace``), the same on
every supported version.
"""

from __future__ import annotations

from jax import numpy as jnp
from jax import tree_util
from jax._src import checkify as _checkify

__all__ = ["check_p", "check_operands_where"]

check_p = _checkify.check_p


def check_operands_where(args, err_tree, where) -> list:
    """The ``check`` equation's operands with each failure predicate and-ed
    with ``where`` (a traced bool): the check fails only where it holds."""
    error = tree_util.tree_unflatten(err_tree, list(args))
    preds = {effect: jnp.logical_and(pred, where) for effect, pred in error._pred.items()}
    return tree_util.tree_leaves(error._replace(_pred=preds))
