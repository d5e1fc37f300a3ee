"""Eager calls of a masked program: one compiled program, not an interpretation.

A masked program called on concrete arrays (no ``jax.jit`` around it), or
under eager ``jax.vmap``, ``jax.jvp`` or ``jax.grad`` only, would be
interpreted equation by equation,
every rule's operations dispatched (and, the first time, compiled) one at a
time: many dispatches per call where ``jax.jit`` of the same masked
function makes one, and a compile per operation on the first call. So it
runs as one ``jax.jit`` program whose arguments are the padded data and the
dim var values (int32 scalars): one compile serves every logical size under
the bound, as under the user's own ``jax.jit``. An eager derivative
differentiates that program, so its values are those of ``jax.grad`` of the
user's ``jax.jit`` (a computation that leads only to the derivative with
respect to an empty array is dropped by XLA, as in plain JAX, rather than
run on concrete values one operation at a time).

What the caller sees does not change: output logical sizes that follow from
the input sizes are evaluated on the host as the interpreter does (a static
size stays a Python int), only data-dependent ones (``nonzero``'s count) come
out of the program; a size check that fails inside the program raises its
``ShapeError``; a program the compiled path cannot trace (a rule that needs
a concrete value) is interpreted, that call and the later ones.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from ..core.masked import Masked
from ..core.shapes import DimEnv
from ..core.trace_state import batched_outside
from .cases.dispatch import run_cases, static_out_sizes
from .interpreter import run_program
from .prologue import raise_run_failure
from .symbolic import MaskedProgram, is_masked

__all__ = ["run_program_eagerly", "run_cases_eagerly", "runs_eagerly"]


class _CallSite:
    """The call site a compiled program's run-time size checks name: the
    current call's (its checks format it when they fail), so one program
    serves calls from every line."""

    now = ""

    def __str__(self) -> str:
        return self.now

    def __format__(self, spec: str) -> str:
        return format(self.now, spec)


@dataclasses.dataclass
class _EagerState:
    calls: int = 0  # eager calls, compiled or interpreted
    compiled: Callable | None = None
    interpreted_only: bool = False  # the compiled path failed to trace: why not again
    call_site: _CallSite = dataclasses.field(default_factory=_CallSite)


def runs_eagerly(leaves, values: dict) -> bool:
    """Whether the call is eager: its leaf data and dim var values are
    concrete, or tracers of eager ``jax.vmap``, ``jax.jvp`` or ``jax.grad``
    only (no ``jax.jit`` around, which traces the interpretation once
    anyway). Under an eager ``jax.grad`` the program is differentiated as
    ``jax.grad`` of ``jax.jit`` would, with the sizes traced: one compiled
    program for every size, and what XLA drops (the derivatives of
    computations on zero-size arrays) dropped as plain JAX drops it."""
    return all(compat.eager_transforms(x) is not None for x in _call_values(leaves, values))


def _call_values(leaves, values: dict) -> list:
    return [leaf.data if is_masked(leaf) else leaf for leaf in leaves] + list(values.values())


def run_program_eagerly(prog: MaskedProgram, leaves, values: dict, zero_padded: bool = False,
                        forward_only: bool = False, guard=None) -> list[Masked]:
    """``run_program`` for an eager call (``runs_eagerly``; see the module doc).
    With a ``guard`` (a case's branch of ``lax.switch``, traced into a jaxpr
    once per call anyway) it is ``run_program``."""
    if guard is not None:
        return run_program(prog, leaves, values, zero_padded=zero_padded,
                           forward_only=forward_only, guard=guard)
    masked = tuple(is_masked(leaf) for leaf in leaves)
    state = _state_of(prog.eager_states, (zero_padded, forward_only, masked, tuple(sorted(values)),
                                          _under_vmap(leaves, values)))
    if state.interpreted_only:
        return run_program(prog, leaves, values, zero_padded=zero_padded,
                           forward_only=forward_only)
    if state.compiled is None:
        state.compiled = jax.jit(_flat_program(prog, zero_padded, forward_only, masked))
    try:
        out_datas, out_sizes = _call_compiled(state.compiled, leaves, masked, values)
    except _TraceFailed:
        state.interpreted_only = True
        return run_program(prog, leaves, values, zero_padded=zero_padded,
                           forward_only=forward_only)
    return _outputs(prog, values, out_datas, out_sizes)


def run_cases_eagerly(tree, leaves, values: dict, call_site: str, checks_on: bool,
                      zero_padded: bool = False, forward_only: bool = False) -> list[Masked]:
    """``run_cases`` for an eager ``jax.vmap`` call of a case split (``values``
    batched): the switch between the cases in one compiled program, batched
    once, instead of the cases' branches traced again on every call."""
    masked = tuple(is_masked(leaf) for leaf in leaves)
    state = _state_of(tree.eager_states, (zero_padded, forward_only, masked,
                                          tuple(sorted(values)), checks_on,
                                          _under_vmap(leaves, values)))
    run = functools.partial(run_program, zero_padded=zero_padded, forward_only=forward_only)
    if state.interpreted_only:
        return run_cases(tree, leaves, values, call_site, run, checks_on=checks_on)
    state.call_site.now = call_site  # the failing size check's message names this call
    if state.compiled is None:
        def program(datas, values):
            inner = [Masked(d, ()) if m else d for d, m in zip(datas, masked)]
            return _as_arrays(run_cases(tree, inner, values, state.call_site, run,
                                        checks_on=checks_on))

        state.compiled = jax.jit(program)
    try:
        datas, sizes = _call_compiled(state.compiled, leaves, masked, values)
    except _TraceFailed:
        state.interpreted_only = True
        return run_cases(tree, leaves, values, call_site, run, checks_on=checks_on)
    return [Masked(d, tuple(st if st is not None else sz for sz, st in zip(ss, sts)))
            for d, ss, sts in zip(datas, sizes, static_out_sizes(tree))]


def _state_of(states: dict, key) -> _EagerState:
    """The eager state of one call structure, its call counted."""
    state = states.get(key)
    if state is None:
        state = states.setdefault(key, _EagerState())
    state.calls += 1
    return state


def _as_arrays(outs: list[Masked]) -> tuple[list, list]:
    """A compiled program's results: the outputs' data and their logical
    sizes as int32 arrays."""
    return ([o.data for o in outs],
            [[jnp.asarray(s, jnp.int32) for s in o.shape] for o in outs])


class _TraceFailed(Exception):
    """The compiled path failed before it ran (a trace failure)."""


def _call_compiled(compiled, leaves, masked, values):
    """``compiled(datas, values)``; a failure while it ran raised as the user
    reads it (its ``ShapeError``, else JAX's ``JaxRuntimeError``), one before
    it ran as ``_TraceFailed``."""
    datas = [leaf.data if m else leaf for leaf, m in zip(leaves, masked)]
    dyn_values = {k: v if isinstance(v, jax.Array) or compat.is_tracer(v) else np.int32(v)
                  for k, v in values.items()}
    try:
        with batched_outside(_under_vmap(leaves, values)):  # as jit(vmap(...)) would see it
            return compiled(datas, dyn_values)
    except Exception as e:
        raise_run_failure(e)  # it traced and ran: its own failure
        raise _TraceFailed() from e


def _under_vmap(leaves, values: dict) -> bool:
    """Whether the eager call is under ``jax.vmap`` (its values batched)."""
    return any("batch" in (compat.eager_transforms(x) or ()) for x in _call_values(leaves, values))


def _flat_program(prog: MaskedProgram, zero_padded: bool, forward_only: bool,
                  masked: tuple[bool, ...]) -> Callable:
    """``(datas, values) -> (output datas, output logical sizes as int32)``."""
    def program(datas, values):
        # run_program reads a leaf's data, and whether it is Masked (its padding)
        leaves = [Masked(d, ()) if m else d for d, m in zip(datas, masked)]
        return _as_arrays(run_program(prog, leaves, values, zero_padded=zero_padded,
                                      forward_only=forward_only))

    return program


def _outputs(prog: MaskedProgram, values: dict, datas, sizes) -> list[Masked]:
    """Masked outputs whose logical sizes over the input dim vars are evaluated
    here as the interpreter would (a static size a Python int); the others
    (data-dependent) are the program's."""
    dims = DimEnv(prog.scope, prog.dim_bounds, values)
    known = set(values)
    outs = []
    for data, shape, got in zip(datas, prog.out_shapes, sizes):
        outs.append(Masked(data, tuple(
            dims.logical(d) if not compat.is_dim_expr(d) or compat.dim_vars(d) <= known else s
            for d, s in zip(shape, got))))
    return outs
