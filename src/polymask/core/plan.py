"""Sizes to dim vars, dim vars to buckets: the one solver and the one policy step.

``solve_sizes`` reads each dim var's logical value off the sizes of the axes
that name it (``size = coeff * var + offset``). It works on Python ints (the
host, ``polymask.jit``) and on int32 scalars or tracers (``mask``'s prologue
under ``jax.jit``/``jax.vmap``) alike, and reports what disagrees instead of
raising, so each caller decides how to fail (the prologue stages run-time
checks; the host raises at once).

``bucket_values`` / ``padded_shape`` apply a bucket policy: every padded shape
of ``polymask.jit``, ``ragged_map``, ``stack`` and the CLI is computed here.

``plan_call`` is the host side of one ``polymask.jit`` call (or one
``ragged_map`` example): specs parsed, sizes solved and checked, buckets and
padded shapes chosen. How outputs get their exact sizes after a call is
``runners/outputs.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from .buckets import as_policy, pow2
from .errors import ShapeError, SpecError, typed_as
from .shapes import canonical_dtype, is_static
from .specs import (
    AxisSpec,
    broadcast_specs,
    parse_leaf_spec,
    scope_and_name_generator,
    spec_identifiers,
    unknown_dim_vars_error,
    with_static_vars,
)

__all__ = ["Solution", "solve_sizes", "solve_axis", "not_affine", "policy_getter",
           "bucket_values", "padded_shape", "bucket_bound", "bucket_shape",
           "LeafPlan", "CallPlan", "plan_call", "check_constraints"]

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

        def for_name(name):
            return table.get(name, default)

        for_name.named = frozenset(table)  # checked against the specs' dim vars (plan_call)
        return for_name
    p = as_policy(buckets)
    return lambda name: p


def _check_bucket_names(policy_for, var_names, spec_names) -> None:
    """A ``{dim var: policy}`` dict names only dim vars of the specs (a typo
    would silently leave that dim var at the default policy)."""
    named = getattr(policy_for, "named", frozenset())
    known = set(var_names) | set(spec_names)
    unknown = sorted(str(n) for n in named - known)
    if unknown:
        raise SpecError(f"buckets names dim vars {unknown} that no spec defines (the specs "
                        f"define {sorted(map(str, var_names))}); a dict of buckets is keyed "
                        "by dim var name, with None for the others' policy")


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
                  values: Mapping[str, int], where: Mapping[str, str] | None = None
                  ) -> dict[str, int]:
    """Each dim var's bucket: its policy applied to its logical value (a
    ``ShapeError`` for a refused size names the dim var and ``where[var]``)."""
    out = {}
    for v, n in values.items():
        try:
            out[v] = bucket_bound(policy_for(v), n)
        except ShapeError as e:
            at = f" (from {where[v]})" if where and v in where else ""
            raise ShapeError(f"dim var '{v}' = {n}{at}: {e}") from None
    return out


def padded_shape(axes: Sequence[AxisSpec], buckets: Mapping[str, int]) -> tuple[int, ...]:
    """A leaf's padded shape when each dim var is padded to its bucket."""
    return tuple(int(a.expr) if a.var is None else a.coeff * buckets[a.var] + a.offset
                 for a in axes)


def bucket_shape(buckets, shape: Sequence[int]) -> tuple[int, ...]:
    """Every size of ``shape`` rounded up by one policy spec (``stack``'s default bound)."""
    policy = as_policy(buckets)
    return tuple(bucket_bound(policy, s) for s in shape)


# ----------------------------------------------------------------------------
# Host plans: one polymask.jit call, one ragged_map example
# ----------------------------------------------------------------------------
def dtype_key(x):
    """A leaf's dtype for cache keys (the Python type of a Python scalar): the
    dtype JAX computes in, so float64 NumPy input shares float32's program
    without x64, as ``jax.jit`` canonicalises it (and is padded as float32)."""
    if isinstance(x, (bool, int, float, complex)):
        return type(x)
    dt = getattr(x, "dtype", None)
    dt = np.asarray(x).dtype if dt is None else dt
    return canonical_dtype(dt) if isinstance(dt, np.dtype) else dt


def structure_key(tree, leaves) -> tuple:
    """A cache key of a pytree of inputs: its structure (static pytree nodes'
    values included) and each leaf's shape and dtype (and a JAX array's weak
    type), what a program traced with them specialises on."""
    return tree, tuple((np.shape(x), dtype_key(x), getattr(x, "weak_type", False))
                       for x in leaves)


@dataclasses.dataclass
class LeafPlan:
    """One input leaf of a host call.

    Attributes:
      path: where the leaf is (``args[0]['x']``).
      shape: its exact shape.
      dtype: its ``dtype_key``.
      axes: the ``AxisSpec`` of each axis, or None for a static leaf (passed
        unchanged; its exact shape is part of the cache key).
      padded: the shape it is padded to (``shape`` for a static leaf).
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    axes: list[AxisSpec] | None
    padded: tuple[int, ...]
    # a weakly typed dynamic JAX array (jnp.broadcast_to(2.0, (n,))): padding on
    # the host makes it strong, so the program makes it weak again (its dtype
    # yields in promotion, as under jax.jit)
    weak: bool = False

    @property
    def static(self) -> bool:
        return self.axes is None

    @property
    def axis_forms(self) -> tuple | None:
        """A dynamic leaf's axes as the specs write them: each static size (a
        ``"_"`` axis takes each call's own size, so two calls whose ``"_"``
        sizes differ never share a batch or a covering bucket), or each dim
        var expression (``"n"``, ``"2*n"``); None for a static leaf.
        Two plans of one tree with equal forms name the same axes alike (the
        default specs name equal sizes of a call alike, so ``(n, n)`` after
        ``(n, m)`` is another form)."""
        if self.axes is None:
            return None
        return tuple(str(a.expr) if a.var is not None else int(a.expr) for a in self.axes)


@dataclasses.dataclass
class CallPlan:
    """Everything the host decides for one call's exact input shapes.

    Attributes:
      leaves: one ``LeafPlan`` per input leaf, in flattening order.
      var_names: the dim vars in order of first appearance (the order of the
        logical-size vector the compiled program gets).
      values: their logical values, in that order.
      buckets: dim var -> bucket (its policy's bound for its value).
      signature: the hashable bucket signature, per leaf ``(static, padded
        shape, dtype)``: calls with equal signatures share a compiled program.
      logical, padded: element counts of the dynamic leaves, exact and padded.
      stacked: ``ragged_map`` only: per static leaf, whether a batch stacks the
        rows' values (arrays that differ across the batch's examples) instead
        of passing one value to every row; ``()`` when none is stacked (then
        not part of ``signature``).
    """

    leaves: list[LeafPlan]
    var_names: list[str]
    values: list[int]
    buckets: dict[str, int]
    signature: tuple
    logical: int
    padded: int
    stacked: tuple[bool, ...] = ()

    def var_axes(self) -> dict[str, str]:
        """Each dim var's first input axis named by it alone (``args[0].shape[1]``)."""
        axes: dict[str, str] = {}
        for leaf in self.leaves:
            for a in leaf.axes or ():
                if a.var is not None and str(a.expr) == a.var:
                    axes.setdefault(a.var, a.where)
        return axes


def _raise_violations(sol: Solution) -> None:
    for a, size in sol.affine:
        if not_affine(size, a):
            raise ShapeError(f"{a.where}: size {size} is not of the form {a.expr} for an "
                             f"integer {a.var} >= 0")
    for var, prev, prev_where, value, where in sol.conflicts:
        raise ShapeError(f"dim var '{var}' has different sizes: {prev} at {prev_where} and "
                         f"{value} at {where}")


def check_constraints(scope, env: Mapping[str, int], partial: bool = False,
                      fixed: frozenset = frozenset()) -> None:
    """``ShapeError`` when a user constraint of ``scope`` fails at the sizes ``env``
    (``partial``: skip the constraints that name a dim var ``env`` lacks;
    ``fixed``: spec dim vars an equality constraint made constants, ``'n == 5'``,
    which the spec's parse checked against the array)."""
    for kind, e1, e2, text in compat.explicit_constraints(scope):
        names = compat.dim_vars(e1) | compat.dim_vars(e2)
        missing = names - set(env)
        if missing and (partial or missing <= fixed):
            continue
        if missing:
            raise unknown_dim_vars_error(text, missing, env)
        v1, v2 = int(compat.evaluate_dim(e1, env)), int(compat.evaluate_dim(e2, env))
        if (kind == "==" and v1 != v2) or (kind == ">=" and v1 < v2):
            raise ShapeError(f"constraint '{text}' does not hold for "
                             + ", ".join(f"{k}={env[k]}" for k in sorted(names)))


def fits_jax_int(i: int) -> bool:
    """A Python int JAX converts without ``OverflowError`` (int32, or int64 with x64)."""
    info = np.iinfo(jax.dtypes.canonicalize_dtype(np.int64))
    return info.min <= i <= info.max


def check_program_input(leaf, path: str) -> None:
    """A ``ShapeError`` that is also a ``TypeError`` (``jax.jit``'s) for a leaf
    a compiled program cannot take (a ``str`` mode, a generator, an object
    array); a ``ValueError``-typed one for a NumPy masked array (``jax.jit``
    refuses it: its mask would be dropped); ``OverflowError`` for a Python int
    outside JAX's int dtype, as ``jax.jit``."""
    if isinstance(leaf, np.ma.MaskedArray):
        raise ShapeError(
            f"{path} is a NumPy masked array: as jax.jit, polymask does not take one (its "
            "mask would be dropped). Pass arr.filled(fill_value) (or arr.data), or the "
            "logical size as in polymask's own padded arrays (polymask.Masked).")
    if isinstance(leaf, int) and not isinstance(leaf, bool):
        if not fits_jax_int(leaf):
            raise OverflowError(f"{path}: Python int {leaf} too large to convert to "
                                f"{jax.dtypes.canonicalize_dtype(np.int64)} (as jax.jit)")
        return
    if isinstance(leaf, (bool, float, complex)):
        return
    dt = getattr(leaf, "dtype", None)
    if dt is None:
        try:
            dt = np.asarray(leaf).dtype
        except Exception:  # noqa: BLE001 - any object NumPy cannot hold
            dt = np.dtype(object)
    if isinstance(dt, np.dtype) and dt.kind not in "biufcV":  # V: bfloat16 and kin
        shown = repr(leaf)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        remedy = ("Declare it static as for jax.jit (polymask.jit(f, static_argnums=... or "
                  "static_argnames=...); ragged_map(f, ..., static_argnums=...) for a "
                  "broadcast argument), or bind it with functools.partial(f, <its "
                  "parameter>=...)." if _hashable(leaf) else
                  "Pass an array of numbers (a static argument must be hashable).")
        raise typed_as(ShapeError(
            f"{path} is a {type(leaf).__name__} ({shown}), which a compiled "
            "program cannot take as an input: every argument of polymask.jit / ragged_map "
            "becomes an input of the compiled program, as with jax.jit. " + remedy), TypeError)


def _hashable(leaf) -> bool:
    try:
        hash(leaf)
    except TypeError:
        return False
    return not isinstance(leaf, np.ndarray)


def _related_base(related_axes, path, k, size, shape_at, static_axes,
                  depth: int = 8) -> tuple | None:
    """``(size of the base axis, offset)`` where axis ``k`` of ``path`` is
    planned as another axis plus a constant (``related_axes``) and this call's
    sizes keep that relation (the base axis is dynamic here), else None. A
    base axis related in turn gives its own base (``c`` of ``T + 2`` related
    to ``b`` of ``T + 1``, related to ``a`` of ``T``: ``a``'s size, 2)."""
    rel = (related_axes or {}).get((path, k))
    if rel is None or depth == 0:
        return None
    base_path, base_k, offset = rel
    base_shape = shape_at.get(base_path, ())
    if base_k >= len(base_shape) or base_shape[base_k] + offset != size:
        return None
    base_size = base_shape[base_k]
    if (base_path, base_k) in static_axes or (base_path, base_k, base_size) in static_axes:
        return None
    further = _related_base(related_axes, base_path, base_k, base_size, shape_at, static_axes,
                            depth - 1)
    if further is not None:
        return further[0], further[1] + offset
    return base_size, offset


def plan_call(args: Sequence[Any], in_specs, constraints: Sequence[str],
              policy_for: Callable[[str], Callable[[int], int]],
              arg_names: Sequence[str] | None = None,
              equal_sizes_share: bool = False,
              static_axes: frozenset[tuple] = frozenset(),
              related_axes: Mapping[tuple, tuple] | None = None,
              static_vars: frozenset[str] = frozenset()) -> CallPlan:
    """Plan one call on exact arrays ``args`` (host side; see ``CallPlan``).

    ``in_specs=None`` makes every axis of every non-scalar array leaf dynamic;
    otherwise a leaf whose spec is None, or whose axes are all static, is
    static (no dim var). Python scalars are always static. ``arg_names``:
    how messages name each argument (default ``args[i]``), where ``args``
    are not the user's whole call (``value_and_grad``'s examples without
    the parameters). ``equal_sizes_share`` (``polymask.jit`` without
    ``in_specs``): axes of equal size in this call share one dim var, so that
    ``x + y`` or a square matrix traces as plain JAX sees it; the var names
    are part of the plan's signature (calls with other equalities plan
    apart); there, an axis in ``static_axes`` (``(leaf path, axis)``, e.g.
    ``("args[0]", 1)``: one that met a fixed size in a trace; or ``(leaf path,
    axis, size)``: static at that size, a size-1 axis that must broadcast) is
    static, and an axis in ``related_axes`` (``(leaf path, axis) -> (leaf
    path, axis, offset)``: one a trace found equal to another axis plus a
    constant, ``v`` of ``r + v[1:]``) is named by that axis's dim var plus
    the offset (``s0 + 1``) where this call's sizes keep the relation.
    ``static_vars``: dim vars of ``in_specs`` whose axes are static, each at
    its size in this call (the function needs them as Python values).

    Raises:
      ShapeError: a bad spec, a size not of its affine form, different sizes
        for one dim var, or a constraint that does not hold.
    """
    names = list(arg_names) if arg_names is not None else [f"args[{i}]" for i in range(len(args))]
    flat = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    spec_leaves = broadcast_specs(in_specs, list(args), None,
                                  labels=[(f"in_specs[{i}]", n) for i, n in enumerate(names)])
    scope, gen_name = scope_and_name_generator(spec_leaves, constraints)
    name_of_size: dict[int, str] = {}
    parsed = []
    paths = [names[key_path[0].idx] + jax.tree_util.keystr(key_path[1:]) for key_path, _ in flat]
    shape_at = {path: tuple(int(d) for d in np.shape(leaf)) for path, (_, leaf) in zip(paths, flat)}
    leaf_of = {path: leaf for path, (_, leaf) in zip(paths, flat)}
    for path, (_, leaf), spec in zip(paths, flat, spec_leaves):
        shape = shape_at[path]
        is_scalar_py = isinstance(leaf, (bool, int, float, complex))
        check_program_input(leaf, path)
        axes = None
        if static_vars:
            spec = with_static_vars(spec, shape, static_vars)
        if spec is None and in_specs is None and equal_sizes_share and shape and not is_scalar_py:
            dynamic = [(path, k) not in static_axes and (path, k, d) not in static_axes
                       for k, d in enumerate(shape)]
            forms = []
            for k, (d, dyn) in enumerate(zip(shape, dynamic)):
                base = dyn and _related_base(related_axes, path, k, d, shape_at, static_axes)
                if base:
                    d = base[0]
                else:
                    base = None
                if dyn and d not in name_of_size:  # (a name only for a size not seen
                    name_of_size[d] = gen_name()   # before: s0, s1, ...)
                forms.append(str(d) if not dyn else name_of_size[d] if base is None
                             else f"{name_of_size[d]} + {base[1]}")
            spec = ", ".join(forms)
        # a Python scalar's spec is checked too ('n' on 3.0 is a rank error, as on
        # np.float32(3.0)), but the scalar stays static
        if spec is not None or (in_specs is None and shape and not is_scalar_py):
            axes = parse_leaf_spec(spec, path, shape, scope, default_dynamic=True,
                                   name_gen=gen_name)
            if is_scalar_py or all(a.var is None for a in axes):
                axes = None
        parsed.append((path, shape, dtype_key(leaf), axes))
    sol = solve_sizes([axes or () for _, _, _, axes in parsed],
                      [shape for _, shape, _, _ in parsed])
    _raise_violations(sol)
    spec_names = {n for sp in spec_leaves if isinstance(sp, str) for n in spec_identifiers(sp)}
    check_constraints(scope, sol.values, fixed=frozenset(spec_names - set(sol.values)))
    where = {a.var: a.where for *_, axes in reversed(parsed)  # first axis naming a var
             for a in reversed(axes or ()) if a.var is not None}
    _check_bucket_names(policy_for, sol.values, spec_names)
    buckets = bucket_values(policy_for, sol.values, where)
    leaves, signature, logical, padded = [], [], 0, 0
    for path, shape, dtype, axes in parsed:
        bound = shape if axes is None else padded_shape(axes, buckets)
        weak = axes is not None and compat.is_weakly_typed(leaf_of[path])
        leaves.append(LeafPlan(path, shape, dtype, axes, bound, weak))
        signature.append((axes is None, bound, dtype,
                          None if axes is None else tuple(a.var and str(a.expr) for a in axes),
                          weak))
        if axes is not None:
            logical += math.prod(shape)
            padded += math.prod(bound)
    return CallPlan(leaves, list(sol.values), [int(v) for v in sol.values.values()], buckets,
                    tuple(signature), logical, padded)
