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
import jax.numpy as jnp
from jax import lax

from .. import _jax_compat as compat
from ..core.errors import UnsupportedError
from ..tracing.registry import substitute_dims
from .segments import Segments

__all__ = ["PerSegment", "PackedUnsupported", "PackedContext", "register_packed",
           "packed_rule", "reads_unmasked", "propagates_nan", "nan_poison", "packed_primitives",
           "register_packed_halo", "packed_halo", "register_nan_keeper", "nan_keeper",
           "register_cross_value", "cross_value"]


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
_READS_UNMASKED: set[str] = set()
_NAN_PROPAGATING: dict[str, Callable[[dict], bool]] = {}
_HALOS: dict[str, Callable] = {}
_NAN_KEEPERS: dict[str, Callable] = {}
_CROSS_VALUES: dict[str, Callable] = {}


def _installed(prims):
    """The names of ``prims`` (primitive objects or names) that the installed
    JAX has: a registration by name of a primitive it lacks is skipped."""
    for p in prims:
        if isinstance(p, str):
            if compat.has_primitive(p):
                yield p
        else:
            yield p.name


def register_packed(*prims, reads_unmasked: bool = False,
                    nan_propagating: bool | Callable[[dict], bool] = False):
    """Decorator: the packed rule of these primitives (objects or names; a name
    the installed JAX lacks is skipped). A second rule is an error.

    ``reads_unmasked``: in forward-only runs the rule receives a
    block-diagonal operand whose cross-segment entries are not yet selected
    to 0 as ``Unmasked``, and masks it itself (``masked_by_arithmetic`` in a
    speculative program, else ``settled``) or passes it to an inlined body
    (``eval_inline``).

    ``nan_propagating``: the primitive's result is NaN at every position an
    operand is NaN at (True, or a predicate of the equation's params), so a
    NaN check pending on an operand may wait for the result
    (``PackedRun.rerun_if_nan``); a predicate returning ``"poison"``: the
    result carries it once the operand's ``x * 0 * -0.0`` is added
    (``PackedRun.poisoned``: XLA:CPU's max and min may drop a NaN)."""

    def deco(fn):
        for name in _installed(prims):
            if name in _RULES:
                raise ValueError(f"a packed rule for primitive '{name}' is already registered "
                                 f"({_RULES[name].__module__}.{_RULES[name].__qualname__})")
            _RULES[name] = fn
            if reads_unmasked:
                _READS_UNMASKED.add(name)
            if nan_propagating:
                _NAN_PROPAGATING[name] = (nan_propagating if callable(nan_propagating)
                                          else lambda params: True)
        return fn

    return deco


def packed_rule(name: str) -> Callable | None:
    return _RULES.get(name)


def reads_unmasked(name: str) -> bool:
    """Whether primitive ``name``'s packed rule takes ``Unmasked`` operands."""
    return name in _READS_UNMASKED


def nan_poison(x):
    """``x * 0 * -0.0``: ``-0.0`` (the exact identity of addition) where ``x``
    is finite, NaN where it is not; added to a result (or summed first), it
    reports a non-finite ``x`` through arithmetic alone (XLA:CPU's max and
    min may drop a NaN)."""
    return x * jnp.zeros((), x.dtype) * jnp.asarray(-0.0, x.dtype)


def propagates_nan(eqn) -> bool | str:
    """Whether ``eqn``'s result is NaN wherever an operand is NaN
    (``register_packed(nan_propagating=...)``): True, False, or ``"poison"``
    (once a poison term of the operand is added)."""
    pred = _NAN_PROPAGATING.get(eqn.primitive.name)
    return False if pred is None else pred(eqn.params)


def register_packed_halo(*prims):
    """Decorator: ``halo(eqn, offset) -> int``, the free positions a windowed
    primitive (a convolution, a pooling window) needs after each example's
    values so that no window reaches the next example (``offset(d)``: the
    ``c`` of a ragged size ``n + c``, None for other sizes). The packer leaves
    that gap after every example."""

    def deco(fn):
        for name in _installed(prims):
            _HALOS[name] = fn
        return fn

    return deco


def packed_halo(name: str) -> Callable | None:
    return _HALOS.get(name)


def register_nan_keeper(*prims):
    """Decorator: ``keeper(out, operand, params) -> out``, applied where the
    interpreter binds the primitive itself on per-segment values (``vmap``
    over the segment slots): a max or min there reduces a batch of examples,
    wide enough for XLA:CPU to drop a NaN (``rules.util.keep_nan``)."""

    def deco(fn):
        for name in _installed(prims):
            _NAN_KEEPERS[name] = fn
        return fn

    return deco


def nan_keeper(name: str) -> Callable | None:
    return _NAN_KEEPERS.get(name)


def packed_primitives() -> list[str]:
    """The primitives with a packed rule (sorted)."""
    return sorted(_RULES)


@dataclasses.dataclass(eq=False)
class OwedReport:
    """The NaN report a masked max or min owes (XLA:CPU's max and min
    reductions may drop a NaN, so their own result cannot carry it), made
    only where nothing carried it instead: a softmax's sum over the same axes
    of a value computed elementwise from the max's masked operand (its
    ``witness``) is NaN wherever that operand held a NaN, and the value that
    divides by it carries the report for free. ``report()``: an array of the
    max's result shape, NaN where the operand held a NaN (or an infinity that
    met the mask's opposite one), computed only where the report is made
    without a witness (``reductions._nan_poison``)."""

    report: Callable[[], Any]
    aval: Any  # the max's or min's result
    axes: tuple[int, ...]  # its packed axes
    reduced: tuple[int, ...]  # the axes it reduced (the witness sum's too)
    witness: Any = None  # the witness sum's pending check (the interpreter's)


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
        # the rule's results carry its operands' pending NaN checks (an
        # arithmetic mask's reader, an inlined call): ``PackedRun.apply``
        self.carries_nan_checks = False
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
        return compat.source_line_with_caller(self.eqn.source_info)

    def shape(self, aval) -> tuple[int, ...]:
        """``aval``'s shape in a row: ``n`` is ``R``."""
        return tuple(self.run.size(d) for d in getattr(aval, "shape", ()))

    def params(self, **overrides) -> dict:
        params = dict(self.eqn.params)
        params.update(overrides)
        return substitute_dims(params, self.run.size)

    def bind(self, *args, **overrides):
        """Bind the primitive on row data, ``n`` in params as ``R``. Where an
        operand is a ``PerSegment`` and no operand or result has a packed axis
        (a reshape of ``x[0:1]``, a per-example value), the primitive runs per
        example: vmapped over the segments' leading axis."""
        params = self.params(**overrides)
        if (any(isinstance(a, PerSegment) for a in args) and not any(self.in_packed)
                and not any(self.out_packed)):
            per = [0 if isinstance(a, PerSegment) else None for a in args]
            out = jax.vmap(lambda *a: self.primitive.bind(*a, **params), in_axes=per)(
                *[a.data if isinstance(a, PerSegment) else a for a in args])
            return ([PerSegment(o) for o in out] if self.primitive.multiple_results
                    else PerSegment(out))
        return self.primitive.bind(*args, **params)

    def segment_size(self, d, as_value: bool = False):
        """A size (dimension expression) per segment: ``(S,)`` int32, clamped
        at 0 unless it is ``as_value`` (a number in the program: not clamped,
        as Python's arithmetic on the exact sizes)."""
        return self.run.segment_size(d, as_value)

    def eval_jaxpr(self, closed_jaxpr, *args) -> list:
        return self.run.eval_closed(closed_jaxpr, list(args))

    def eval_inline(self, closed_jaxpr, *args) -> list:
        """A call's body at the call site; ``Unmasked`` values and pending NaN
        checks pass through (forward-only runs; ``PackedRun.eval_inline``)."""
        self.carries_nan_checks = True
        return self.run.eval_inline(closed_jaxpr, list(args))

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

    def settled(self, i: int, x):
        """Operand ``i`` with its cross-segment and dead entries selected to 0
        (a rule that ``reads_unmasked`` calls this where it needs the invariant)."""
        return self.run.settle(x, self.eqn.invars[i])

    def masked_by_arithmetic(self, i: int, x, kind: str):
        """Operand ``i``'s data for a reader that reduces with ``kind`` (sum,
        max, min), entries outside its segment blocks made the reduction's
        identity by arithmetic (``PackedRun.arithmetic_mask``); None where the
        operand is not ``Unmasked`` in a speculative program, or not floating."""
        return self.run.arithmetic_mask(x, self.in_avals[i], kind)

    def rerun_if_nan(self, out, j: int = 0, *, owes=None, sums=None):
        """Result ``j`` of a reader of ``masked_by_arithmetic`` operands: a NaN
        at a live entry of it (the sign that the mask met a non-finite entry)
        reruns the call in the exact program (``PackedRun.rerun_if_nan``).
        The operands' pending checks pass to it: the reduction or product of
        a NaN is NaN. ``owes`` ``(operand, report)``: a max or min, whose own
        result may drop a NaN of its masked ``operand``, owes ``report()``
        (NaN where it did) unless a sum witnesses it; ``sums`` ``(operand,
        axes)``: a sum, the witness of the maxes over ``axes`` whose operand's
        NaN ``operand`` holds (``interpreter.OwedReport``)."""
        self.carries_nan_checks = True
        self.run.rerun_if_nan(out, self.out_avals[j], self.out_packed[j], owes=owes, sums=sums)
        return out

    def owed_report(self, report, reduced) -> Any:
        """An ``OwedReport`` of result 0: ``report()`` computed only where no
        sum over ``reduced`` witnessed it."""
        return OwedReport(report, self.out_avals[0], tuple(self.out_packed[0]), tuple(reduced))

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


def register_cross_value(*prims):
    """Decorator: ``fn(crosses, params) -> float | None`` for elementwise primitives.
    ``crosses[i]`` is what operand ``i`` holds at every cross-segment entry of
    a block-diagonal value (``Unmasked.cross``), or None where that is not
    known (a plain operand, another example's data): ``fn`` gives what the
    result holds there whatever the unknown operands are, NaN aside (a NaN
    between examples reaches a reader's live result and reruns the call:
    ``PackedRun.rerun_if_nan``), or None. ``-inf - m`` is ``-inf`` for every
    finite ``m`` and NaN otherwise, so a softmax's ``exp(s + B - m)`` is known
    to hold 0 between examples and its sum and product read it unmasked."""

    def deco(fn):
        for name in _installed(prims):
            _CROSS_VALUES[name] = fn
        return fn

    return deco


def cross_value(eqn, crosses) -> float | None:
    """The result's value between examples (``register_cross_value``), or None."""
    fn = _CROSS_VALUES.get(eqn.primitive.name)
    return None if fn is None else fn(crosses, eqn.params)

