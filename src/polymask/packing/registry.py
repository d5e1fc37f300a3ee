"""The packed rule table (keyed by primitive) and what a packed rule may ask.

A value of the packed interpretation is one of three kinds, told apart by
its aval and its Python type:

- *packed*: its aval has axes of the ragged size ``n``; its data has ``R``
  (the row size) there, each position belonging to ``Segments.seg``. A value
  with two or more packed axes is block-diagonal (attention scores): entries
  whose packed axes lie in different segments are kept at 0, so products
  and sums over a packed axis see only their own segment.

  Every packed value's *dead* entries (past ``n + c`` in a region, the
  row's tail, another segment's block) are selected to 0 by the interpreter
  after every equation, whatever the rule computed there
  (``PackedRun.live_only``): a rule may assume its operands are 0 there and
  need not clean its results; it must compute each live result from live
  operand entries only. (In forward-only runs the select of a value with
  two or more packed axes waits for its first reader that is not
  elementwise, ``PackedRun.settle``: elementwise rules get the unmasked
  data, every other rule the masked one.)
- *per segment* (``PerSegment``): no packed axis but a value per example,
  e.g. a reduction over the packed axis; data ``(S, *shape)``.
- *shared*: the same for every example (parameters, constants): plain data.

A packed rule has the signature of a masking rule,
``rule(ctx, *invals, **params)`` with a ``PackedContext``, and returns the
outputs in these kinds. Equations that touch no packed axis need no rule:
shared operands bind the primitive, per-segment ones ``vmap`` it over the
slots (``interpreter.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from .. import _jax_compat as compat
from ..core.errors import UnsupportedError
from ..tracing.registry import substitute_dims
from .segments import Segments

__all__ = ["PerSegment", "PackedUnsupported", "PackedContext", "register_packed",
           "packed_rule", "packed_primitives", "register_packed_halo", "packed_halo"]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class PerSegment:
    """A value per example (no packed axis): ``data`` is ``(S, *shape)``."""

    data: Any

    def tree_flatten(self):
        return (self.data,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


class PackedUnsupported(UnsupportedError):
    """The packed layout has no rule for this primitive or case (``ragged_map``
    with ``layout="auto"`` then runs the function in the padded layout)."""


_RULES: dict[str, Callable] = {}
_HALOS: dict[str, Callable] = {}


def register_packed(*prims):
    """Decorator: the packed rule of these primitives (objects or names; a name
    the installed JAX lacks is skipped). A second rule is an error."""

    def deco(fn):
        for p in prims:
            name = p if isinstance(p, str) else p.name
            if isinstance(p, str) and not compat.has_primitive(p):
                continue
            if name in _RULES:
                raise ValueError(f"a packed rule for primitive '{name}' is already registered "
                                 f"({_RULES[name].__module__}.{_RULES[name].__qualname__})")
            _RULES[name] = fn
        return fn

    return deco


def packed_rule(name: str) -> Callable | None:
    return _RULES.get(name)


def register_packed_halo(*prims):
    """Decorator: ``halo(eqn, offset) -> int``, the free positions a windowed
    primitive (a convolution, a pooling window) needs after each example's
    values so that no window reaches the next example (``offset(d)``: the
    ``c`` of a ragged size ``n + c``, None for other sizes). The packer leaves
    that gap after every example."""

    def deco(fn):
        for p in prims:
            name = p if isinstance(p, str) else p.name
            if isinstance(p, str) and not compat.has_primitive(p):
                continue
            _HALOS[name] = fn
        return fn

    return deco


def packed_halo(name: str) -> Callable | None:
    return _HALOS.get(name)


def packed_primitives() -> list[str]:
    """The primitives with a packed rule (sorted)."""
    return sorted(_RULES)


class PackedContext:
    """What a packed rule may ask about its equation.

    Attributes:
      eqn, primitive: the equation (symbolic avals) and its primitive.
      seg: the row's ``Segments`` for the size of the first packed axis of
        the operands (else of the results): ``n`` unless the equation works
        on sizes ``n + c`` (``axis_segments`` gives any axis's).
      in_packed / out_packed: per operand / result, its packed axes.
      in_avals / out_avals: symbolic avals.
      run: the ``PackedRun`` (``eval_jaxpr`` recurses through it).
    """

    def __init__(self, eqn, run, in_packed, out_packed):
        self.eqn = eqn
        self.primitive = eqn.primitive
        self.run = run
        self.in_avals = [v.aval for v in eqn.invars]
        self.out_avals = [v.aval for v in eqn.outvars]
        self.in_packed = in_packed
        self.out_packed = out_packed
        first = next(((aval, axes[0]) for aval, axes in
                      [*zip(self.in_avals, in_packed), *zip(self.out_avals, out_packed)]
                      if axes), None)
        self.seg: Segments = run.seg if first is None else run.axis_segments(*first)

    def axis_segments(self, aval, axis: int) -> Segments:
        """The segments of ``aval``'s packed ``axis`` (its size ``n + c``)."""
        return self.run.axis_segments(aval, axis)

    def offset(self, d) -> int:
        """``c`` of a ragged size ``n + c``."""
        return self.run.offset(d)

    @property
    def source_line(self) -> str:
        return compat.source_line(self.eqn.source_info)

    def shape(self, aval) -> tuple[int, ...]:
        """``aval``'s shape in a row: ``n`` is ``R``."""
        return tuple(self.run.size(d) for d in getattr(aval, "shape", ()))

    def params(self, **overrides) -> dict:
        params = dict(self.eqn.params)
        params.update(overrides)
        return substitute_dims(params, self.run.size)

    def bind(self, *args, **overrides):
        """Bind the primitive on row data, ``n`` in params as ``R``."""
        return self.primitive.bind(*args, **self.params(**overrides))

    def segment_size(self, d):
        """A size (dimension expression) per segment: ``(S,)`` int32."""
        return self.run.segment_size(d)

    def eval_jaxpr(self, closed_jaxpr, *args) -> list:
        return self.run.eval_closed(closed_jaxpr, list(args))

    def lift(self, x, out_aval, out_axes, operand_dims=None):
        """A per-segment operand at the positions of a packed result: gathered at
        the first packed axis of ``out_axes`` and broadcast to ``out_aval``'s
        row shape; ``operand_dims``: where ``x``'s own axes go (default: the
        trailing ones, numpy broadcasting)."""
        if not isinstance(x, PerSegment):
            return x
        shape = self.shape(out_aval)
        k = out_axes[0]
        g = self.seg.to_positions(x.data)  # (R, *x_shape)
        rank = g.ndim - 1
        dims = (tuple(range(len(shape) - rank, len(shape))) if operand_dims is None
                else tuple(operand_dims))
        return broadcast_with_new_axis(g, k, dims, shape)

    def unsupported(self, reason: str) -> PackedUnsupported:
        return PackedUnsupported(
            f"the packed layout has no rule for primitive '{self.primitive.name}' here: "
            f"{reason}\n  at {self.source_line}")


def broadcast_with_new_axis(g, k: int, dims, shape):
    """``g`` (``(R, *rest)``) broadcast to ``shape``: its axis 0 at ``k``, the
    rest at ``dims`` (lax wants increasing dims: the axes are moved first)."""
    dims = list(dims)
    if k in dims:  # the packed axis is one of the operand's (size-1) axes: drop that one
        i = dims.index(k)
        g = lax.squeeze(g, (i + 1,))
        dims.pop(i)
    order = sorted(range(len(dims) + 1), key=lambda j: ([k] + dims)[j])
    g = lax.transpose(g, tuple(order))
    return lax.broadcast_in_dim(g, tuple(shape), tuple(sorted([k] + dims)))
