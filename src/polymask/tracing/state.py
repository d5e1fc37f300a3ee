"""Per-run state that masking rules share while one masked program is evaluated."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..core.shapes import DimEnv

__all__ = ["RunState", "GUARD", "holds_zero"]


@functools.cache
def holds_zero(dtype) -> bool:
    """Whether ``dtype`` represents 0: float8_e8m0fnu (an exponent-only scale
    type) has no zero, a 0 stored there is NaN, so padding "zeroed" in it is
    NaN (a sum of its float32 conversion was NaN)."""
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):  # (PRNG keys: no NumPy form)
        return True
    with np.errstate(all="ignore"):
        return bool(np.array(0, np.float32).astype(dtype) == 0)


GUARD = "__polymask_guard__"  # RunState.guard passed as a size (with_sizes)


@dataclasses.dataclass
class RunState:
    """What the rules of one masked run share, passed explicitly (``ctx.state``).

    Attributes:
      dims: bounds and logical values of the dim vars, and size evaluation.
      interpreter: the interpreter evaluating the program (rules recurse
        into inner jaxprs through it).
      jaxpr_stack: the jaxprs being walked, innermost last: a rule may look up
        how an operand was computed (a loop bound derived from sizes).
      eqn_stack: the equations being applied, innermost last (a message of
        an equation inside a library's jitted function names the user's
        enclosing line too).
      invar_links: inner jaxpr input var -> ``(outer var, outer jaxpr)``
        across ``pjit`` calls, for the same lookups.
      zero_padded: ``id(value) -> value`` for values whose padding is known to
        be exactly 0 (the value is kept alive so its id is not reused).
      forward_only: the masked program is never differentiated (the runners):
        rules may skip the selects that only keep the backward pass finite.
      guard: a traced bool when the program is one case of a case split
        (``tracing/cases/dispatch.py``): true where this case is the one the sizes choose;
        loop rules narrow it in a body run to the bound to the logical steps.
        Rules' run-time checks and host callbacks act only there (under
        ``vmap`` every case runs for every example).
      assumed_nonempty: ``MaskedProgram.assumed_nonempty`` of the program run.
      count_checks: ``MaskedProgram.count_checks`` of the program run.
    """

    dims: DimEnv
    interpreter: Any
    jaxpr_stack: list = dataclasses.field(default_factory=list)
    eqn_stack: list = dataclasses.field(default_factory=list)
    invar_links: dict = dataclasses.field(default_factory=dict)
    zero_padded: dict[int, Any] = dataclasses.field(default_factory=dict)
    forward_only: bool = False
    guard: Any = None
    assumed_nonempty: dict = dataclasses.field(default_factory=dict)
    count_checks: tuple = ()

    @property
    def logical_cache(self) -> dict:
        """The logical size of each dimension expression computed so far."""
        return self.dims.logical_cache

    def mark_zero_padding(self, x) -> None:
        if holds_zero(getattr(x, "dtype", None)):
            self.zero_padded[id(x)] = x

    def has_zero_padding(self, x) -> bool:
        return id(x) in self.zero_padded

    @contextmanager
    def scoped(self) -> Iterator[RunState]:
        """Isolate what an inner trace (a scan/while/cond body, remat) computes.

        Sizes and zero-padding facts computed inside the body are values of the
        inner trace; left in the per-run caches, the outer code would read them
        after the body is done (an escaped tracer).
        """
        dims = self.dims
        saved = (dict(dims.logical_cache), dict(dims.logical_values), dict(dims.bounds),
                 dict(self.zero_padded), dict(dims.value_cache))
        try:
            yield self
        finally:
            cache, values, bounds, zero, value_cache = saved
            dims.logical_cache.clear()
            dims.logical_cache.update(cache)
            dims.value_cache.clear()
            dims.value_cache.update(value_cache)
            dims.logical_values = values
            dims.bounds = bounds
            self.zero_padded.clear()
            self.zero_padded.update(zero)

    def with_sizes(self, names, sizes) -> RunState:
        """A fresh state whose dim vars ``names`` take the values ``sizes``.

        Custom-derivative rules evaluate their jaxprs inside ``jax.custom_jvp``
        / ``custom_vjp`` functions whose sizes are explicit arguments; the
        ``guard`` travels among them as the size named ``GUARD`` (a value of
        the outer trace must not be closed over: JAX traces those functions
        again for differentiation).
        """
        values = dict(self.dims.logical_values)
        guard = None
        for name, size in zip(names, sizes):
            if name == GUARD:
                guard = size != 0
            else:
                values[name] = size
        return RunState(DimEnv(self.dims.scope, self.dims.bounds, values), self.interpreter,
                        eqn_stack=list(self.eqn_stack), forward_only=self.forward_only,
                        guard=guard, assumed_nonempty=self.assumed_nonempty,
                        count_checks=self.count_checks)
