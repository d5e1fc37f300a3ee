"""Lowering and transposition helpers for polymask's own primitives that stay
in the padded program (part of ``_jax_compat``)."""

from __future__ import annotations

from collections.abc import Callable

from jax.interpreters import ad as _ad
from jax.interpreters import mlir as _mlir

__all__ = ["def_lowering_as", "is_undefined_primal"]


def def_lowering_as(prim, fun: Callable) -> None:
    """Lower ``prim`` on every platform as the JAX function ``fun(*args, **params)``
    (``mlir.lower_fun``): the primitives ``fun`` binds keep their own
    per-platform lowerings (e.g. a native kernel on GPU / TPU)."""
    _mlir.register_lowering(prim, _mlir.lower_fun(fun, multiple_results=prim.multiple_results))


def is_undefined_primal(x) -> bool:
    """In a transpose rule: True for the linear operand(s) being transposed
    (then ``x.aval`` is its abstract value)."""
    return _ad.is_undefined_primal(x)
