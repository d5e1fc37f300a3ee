"""Per-trace state: what a masked trace in progress in this thread tells the code it calls.

One ``TraceState`` per thread (``trace_state()``), written only by the
context managers that open the scope of one masked trace or run:

- ``scopes``: the ``SymbolicScope`` of each masked trace in progress,
  innermost last (``tracing/symbolic.py``; ``current_scope()``); the trace
  replacements and the data-dependent ops read it to know they run inside one;
- ``functional_checks``: ``mask(..., checks="functional")``: traced size
  checks collected as predicates instead of host callbacks
  (``tracing/prologue.py``);
- ``per_example``: ``ragged_map`` masks its function, so a ``pure_callback``
  is called per example (``rules/callbacks.py``);
- ``batched_outside``: an eager ``jax.vmap`` batches the compiled program
  being traced from outside (``tracing/eager.py``), so its operands count as
  batched where a rule asks (``rules/callbacks.py``);
- ``masks``: validity masks shared within one masked run (``core/masks.py``).
- ``cases_batched``: the switch between the cases of a case split is being
  traced with a batched index (``jax.vmap``): JAX will run every case on
  every example (``tracing/cases/dispatch.py``; read by ``rules/inlined.py``).
- ``per_size_per_shape``: ``polymask.jit`` traces a bucket whose sizes it
  would run per exact shape if each were a case of its own
  (``cases.tree.PerSizeBucket``): the trace stops before tracing them one by one.
- ``call_site``: the user's line of the masked call being run (its rules'
  run-time checks name it: ``RuleContext.require``);
- ``differentiable``: the masked function being traced may be
  differentiated (``mask(..., differentiable=False)``: the runners' forward
  programs): its custom derivative rules are traced with it
  (``rules/custom_derivatives.py``), which sets ``derivative_rule_splits``
  when one of them split the trace;
- ``tangent_operands``: while a primitive's own JVP rule runs masked, its
  equations that take tangents, by ``id``, with the operands that are
  tangents (``rules/inlined.py``): inside ``cond`` or ``vmap`` JAX linearizes
  by tracing the rule first, so those tangents do not look like tangents yet.

(The DimExpr hooks' own frames stay in ``_jax_compat/splits.py``: they belong
to the private-JAX layer; compile counters in ``runners/compiling.py`` are
per block, not per trace.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["TraceState", "trace_state", "current_scope", "scope_active", "mapped_per_example",
           "batched_outside", "tangent_operands", "cases_batched", "masked_call"]


class TraceState(threading.local):
    """The per-thread state of the masked traces in progress (see the module doc)."""

    def __init__(self):
        self.scopes: list[Any] = []
        self.functional_checks: list | None = None
        self.per_example: bool = False
        self.batched_outside: bool = False
        self.masks: dict | None = None
        self.tangent_operands: dict[int, tuple[int, ...]] = {}
        self.cases_batched: bool = False
        self.per_size_per_shape: bool = False
        self.call_site: str | None = None
        self.differentiable: bool = True
        self.derivative_rule_splits: bool = False


_STATE = TraceState()


def trace_state() -> TraceState:
    """This thread's ``TraceState``."""
    return _STATE


def current_scope():
    """The ``SymbolicScope`` of the masked trace in progress (None outside one)."""
    scopes = _STATE.scopes
    return scopes[-1] if scopes else None


@contextlib.contextmanager
def scope_active(scope) -> Iterator[None]:
    """``scope`` is the current scope for the duration (one masked trace)."""
    _STATE.scopes.append(scope)
    try:
        yield
    finally:
        _STATE.scopes.pop()


@contextlib.contextmanager
def replaced(attr: str, value) -> Iterator[Any]:
    """``trace_state().<attr> = value`` for the duration (restored after, nested
    blocks included); yields ``value``."""
    prev = getattr(_STATE, attr)
    setattr(_STATE, attr, value)
    try:
        yield value
    finally:
        setattr(_STATE, attr, prev)


def mapped_per_example():
    """While ``ragged_map`` masks its function: the ``vmap`` is polymask's own,
    standing for a loop over examples, so a ``pure_callback`` is called per
    example with that example's arrays, as ``fun(example)`` calls it (any
    ``vmap_method``; without one JAX would refuse to batch it)."""
    return replaced("per_example", True)


def batched_outside(batched: bool):
    """While ``tracing/eager.py`` traces the program an eager ``jax.vmap`` will
    batch (``jax.vmap`` of a ``jax.jit``): its operands look unbatched to the
    rules, but are batched as under ``jax.jit(jax.vmap(...))``."""
    return replaced("batched_outside", batched)


def tangent_operands(by_equation: dict[int, tuple[int, ...]]):
    """While a JVP rule's jaxpr is evaluated masked: the equations (by ``id``)
    that take tangents, each with the positions of those operands."""
    return replaced("tangent_operands", by_equation)


def masked_call(call_site: str):
    """While a masked call runs its program: the user's line of that call."""
    return replaced("call_site", call_site)


def cases_batched(batched: bool):
    """While the switch between a case split's cases is traced: whether its
    index is batched, so that every case runs on every example (nested
    switches: batched if any is)."""
    return replaced("cases_batched", batched or _STATE.cases_batched)
