"""Sizes to dim vars, dim vars to buckets: the one solver and the one policy step.

``solve_sizes`` reads each dim var's logical value off the sizes of the axes
that name it (``size = coeff * var + offset``). It works on Python ints (the
host, ``polymask.jit``) and on int32 scalars or tracers (``mask``'s prologue
under ``jax.jit``/``jax.vmap``) alike, and reports what disagrees instead of
raising, so each caller decides how to fail (the prologue stages run-time
checks; the host raises at once).

``bucket_values`` / ``padded_shape`` apply a bucket policy: every padded
shape that ``polymask.jit``, ``ragged_map``, ``stack`` and the CLI build is
computed here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .buckets import as_policy, pow2
from .errors import ShapeError
from .shapes import is_static
from .specs import AxisSpec

__all__ = ["Solution", "solve_sizes", "solve_axis", "not_affine", "policy_getter",
           "bucket_values", "padded_shape", "bucket_bound"]

Size = Any


@dataclasses.dataclass
class Solution:
    """What the input sizes say about the dim vars.

    Attributes:
      values: dim var -> logical value (a Python int when any axis naming it
        has a static size, else an int32 scalar/tracer).
      sources: dim var -> the axis it was first read from (``args[0].shape[1]``).
      conflicts: ``(var, value_a, where_a, value_b, where_b)`` for each axis
        whose size gives ``var`` another value than the first axis did (decided
        at run time when either value is traced).
      affine: ``(AxisSpec, size)`` for each axis of the form ``a*k + c`` other
        than ``k``: its size must be ``>= c`` and divisible.
    """

    values: dict[str, Size] = dataclasses.field(default_factory=dict)
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    conflicts: list[tuple[str, Size, str, Size, str]] = dataclasses.field(default_factory=list)
    affine: list[tuple[AxisSpec, Size]] = dataclasses.field(default_factory=list)


def solve_axis(size: Size, a: AxisSpec) -> Size:
    """The dim var's value from one axis's size: ``(size - offset) // coeff``."""
    if a.coeff == 1 and a.offset == 0:
        return size
    if is_static(size):
        return (int(size) - a.offset) // a.coeff
    return (jnp.asarray(size, jnp.int32) - a.offset) // a.coeff


def not_affine(size: Size, a: AxisSpec):
    """True (bool or bool array) when ``size`` is not ``coeff * k + offset`` for a k >= 0."""
    if is_static(size):
        s = int(size)
        return s < a.offset or (s - a.offset) % a.coeff != 0
    s = jnp.asarray(size, jnp.int32)
    return (s < a.offset) | ((s - a.offset) % a.coeff != 0)


def _differ(a: Size, b: Size) -> bool:
    """False only when both values are static and equal (a traced pair is checked later)."""
    return not (is_static(a) and is_static(b) and int(a) == int(b))


def solve_sizes(axis_specs: Sequence[Sequence[AxisSpec]],
                leaf_sizes: Sequence[Sequence[Size]]) -> Solution:
    """Solve the dim vars from the sizes of every input axis (see the module doc)."""
    sol = Solution()
    for axes, sizes in zip(axis_specs, leaf_sizes):
        for a, size in zip(axes, sizes):
            if a.var is None:
                continue
            if a.coeff != 1 or a.offset != 0:
                sol.affine.append((a, size))
            value = solve_axis(size, a)
            if a.var not in sol.values:
                sol.values[a.var], sol.sources[a.var] = value, a.where
                continue
            prev = sol.values[a.var]
            if _differ(prev, value):
                sol.conflicts.append((a.var, prev, sol.sources[a.var], value, a.where))
            if is_static(value) and not is_static(prev):
                sol.values[a.var] = value  # a static reading makes downstream shapes static
    return sol


# ----------------------------------------------------------------------------
# Bucket policies
# ----------------------------------------------------------------------------
def policy_getter(buckets) -> Callable[[str], Callable[[int], int]]:
    """``dim var name -> policy`` from a policy spec or a ``{name: spec}`` dict.

    A dict's ``None`` key is the default for the names it does not list
    (``pow2()`` when absent).
    """
    if isinstance(buckets, Mapping):
        default = as_policy(buckets.get(None, pow2()))
        table = {k: as_policy(v) for k, v in buckets.items() if k is not None}
        return lambda name: table.get(name, default)
    p = as_policy(buckets)
    return lambda name: p


def bucket_bound(policy: Callable[[int], int], size: int) -> int:
    """The bound a policy gives a logical size.

    Raises:
      TypeError: the policy returned something other than an int.
      ShapeError: the policy returned a bound smaller than the size.
    """
    bound = policy(int(size))
    if isinstance(bound, bool) or not isinstance(bound, (int, np.integer)):
        raise TypeError(f"bucket policy {policy!r} returned {bound!r} for size {size}; "
                        "a policy must return an int bound")
    if int(bound) < int(size):
        raise ShapeError(f"bucket policy {policy!r} returned bound {int(bound)} for size "
                         f"{size}; a bound must be >= the size it holds")
    return int(bound)


def bucket_values(policy_for: Callable[[str], Callable[[int], int]],
                  values: Mapping[str, int]) -> dict[str, int]:
    """Each dim var's bucket: its policy applied to its logical value."""
    return {v: bucket_bound(policy_for(v), n) for v, n in values.items()}


def padded_shape(axes: Sequence[AxisSpec], buckets: Mapping[str, int]) -> tuple[int, ...]:
    """A leaf's padded shape when each dim var is padded to its bucket."""
    return tuple(int(a.expr) if a.var is None else a.coeff * buckets[a.var] + a.offset
                 for a in axes)
