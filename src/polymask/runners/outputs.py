"""How each output of a traced program gets its exact size after a call.

``output_plan`` reads a traced ``MaskedProgram``'s symbolic output shapes:
an axis is static, a dimension expression of the input dim vars (evaluated
on the host from the exact input sizes, no device round trip), or
data-dependent (``polymask.nonzero``, ...: the compiled program returns it
in a size vector). ``OutputPlan.shapes`` gives the exact shapes of a call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .. import _jax_compat as compat
from ..core.plan import solve_sizes
from ..core.specs import AxisSpec

__all__ = ["StaticSize", "HostSize", "DeviceSize", "OutputLayout", "OutputPlan", "output_plan"]


@dataclasses.dataclass(frozen=True)
class StaticSize:
    """An output axis of a fixed size."""

    size: int

    def value(self, env, device_sizes) -> int:
        return self.size


@dataclasses.dataclass(frozen=True)
class HostSize:
    """An output axis whose size is a dimension expression of the input dim
    vars: evaluated on the host from the exact input sizes (no device round trip)."""

    expr: Any

    def value(self, env, device_sizes) -> int:
        return max(0, int(compat.evaluate_dim(self.expr, env)))


@dataclasses.dataclass(frozen=True)
class DeviceSize:
    """A data-dependent output axis (``polymask.nonzero``, ...): its size is
    entry ``index`` of the size vector the compiled program returns."""

    index: int

    def value(self, env, device_sizes) -> int:
        return int(device_sizes[self.index])


@dataclasses.dataclass(frozen=True)
class OutputLayout:
    """How one output leaf gets its exact shape: one size source per axis."""

    axes: tuple[StaticSize | HostSize | DeviceSize, ...]

    def shape(self, env, device_sizes) -> tuple[int, ...]:
        return tuple(a.value(env, device_sizes) for a in self.axes)


@dataclasses.dataclass
class OutputPlan:
    """The outputs of one traced program, as the host reassembles them.

    Attributes:
      tree: the output treedef.
      leaves: one ``OutputLayout`` per output leaf.
      device_axes: ``(output leaf, axis)`` of each ``DeviceSize``, in index
        order: the compiled program returns these sizes as one int32 vector.
      in_axis_specs: the program's input specs, to solve the dim vars of
        ``HostSize`` expressions from the exact input shapes.
      has_host: some axis is a ``HostSize``.
      internal: spec dim var -> ``(internal name, offset)`` (``MaskedProgram.internal``).
    """

    tree: Any
    leaves: list[OutputLayout]
    device_axes: list[tuple[int, int]]
    in_axis_specs: list[list[AxisSpec]]
    has_host: bool
    internal: dict = dataclasses.field(default_factory=dict)

    def shapes(self, in_shapes: Sequence[Sequence[int]], device_sizes=None) -> list[tuple]:
        """Exact output shapes, given the exact input leaf shapes and the device sizes."""
        specs = self.in_axis_specs
        if len(in_shapes) < len(specs):
            # A pytree callee (a module) adds its own leaves first; they are static.
            specs = specs[len(specs) - len(in_shapes):]
        env = None
        if self.has_host:
            env = {self.internal.get(v, (v, 0))[0]: int(x) + self.internal.get(v, (v, 0))[1]
                   for v, x in solve_sizes(specs, in_shapes).values.items()}
        return [leaf.shape(env, device_sizes) for leaf in self.leaves]


def output_plan(prog, single: bool = True) -> OutputPlan:
    """The ``OutputPlan`` of a ``MaskedProgram`` (from its symbolic ``out_shapes``).

    With several cases (``tracing/cases/``, ``single=False``) the sizes choose the
    case on the device, so every output size comes from the device.
    """
    in_vars = {prog.internal.get(v, (v, 0))[0] for v in prog.var_bounds}
    leaves, device_axes, has_host = [], [], False
    for li, shape in enumerate(prog.out_shapes):
        axes: list[StaticSize | HostSize | DeviceSize] = []
        for k, d in enumerate(shape):
            if single and not compat.is_dim_expr(d):
                axes.append(StaticSize(int(d)))
            elif single and compat.dim_vars(d) <= in_vars:
                axes.append(HostSize(d))
                has_host = True
            else:
                axes.append(DeviceSize(len(device_axes)))
                device_axes.append((li, k))
        leaves.append(OutputLayout(tuple(axes)))
    return OutputPlan(prog.out_tree, leaves, device_axes, prog.axis_specs, has_host,
                      prog.internal)
