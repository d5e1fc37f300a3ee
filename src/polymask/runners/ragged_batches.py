"""How ``ragged_map`` forms batches: which examples may share a batch, and the
plan of a batch padded to its largest example's buckets."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from ..core.diagnostics import at_call_site, user_call_site, user_stacklevel
from ..core.errors import ShapeError
from ..core.plan import (
    CallPlan,
    check_program_input,
    fits_jax_int,
    padded_shape,
    structure_key,
)

__all__ = ["broadcast_inputs", "kind_key", "static_values_key", "stack_varying_statics", "static_batch_leaves",
           "stacked_weak_inputs", "example_avals",
           "static_batch_avals", "batch_in_axes", "specs_hint", "rebucket", "batch_bucket", "auto_specs", "AxisHistory"]


def broadcast_inputs(broadcast: tuple) -> tuple:
    """``(leaves, treedef, cache key)`` of ``ragged_map``'s broadcast arguments.

    Raises:
      ShapeError: a leaf a compiled program cannot take (a ``str``).
    """
    flat = jax.tree_util.tree_flatten_with_path(tuple(broadcast))[0]
    for path, x in flat:
        try:
            check_program_input(x, "broadcast" + jax.tree_util.keystr(path))
        except ShapeError as e:
            raise at_call_site(e, user_call_site()) from None
    leaves, tree = jax.tree_util.tree_flatten(tuple(broadcast))
    return leaves, tree, structure_key(tree, leaves)


def kind_key(plan: CallPlan) -> tuple:
    """What examples must share to be batched together: everything in the
    signature but the buckets (dim vars and the axes they name, static
    leaves, ranks, the sizes of static axes — a ``"_"`` axis is its example's
    own size — and dtypes)."""
    return (tuple(plan.var_names),
            tuple((p.static, p.shape if p.static else p.axis_forms, p.dtype)
                  for p in plan.leaves))


def static_values_key(plan: CallPlan, leaves) -> tuple:
    """What of an example's static leaves (no dim var) decides which examples
    may share a batch, hashable: the values of leaves a batch cannot stack
    (one value passes to all its rows, so examples whose values differ must
    not share a batch), and whether each stackable leaf is weakly typed (rows
    of a stacked leaf share its weak type). ``ragged_map`` adds this to the
    kind of an example. Stackable leaves (numbers, arrays, typed PRNG keys)
    whose values differ are stacked per row (``stack_varying_statics``)."""
    return tuple(("weak", compat.is_weakly_typed(x)) if _stackable(x) else _value_key(x)
                 for x, p in zip(leaves, plan.leaves) if p.static)


def _stackable(x) -> bool:
    """Whether rows' values of a static leaf can be stacked as a batched input
    without changing what ``fun`` sees: Python numbers (in the range of JAX's
    dtype for them; they reach each row weakly typed again,
    ``stacked_weak_inputs``), NumPy numeric arrays and scalars, JAX arrays
    and typed PRNG keys."""
    if isinstance(x, (bool, int, float, complex)):
        return not isinstance(x, int) or fits_jax_int(x)
    if isinstance(x, (np.ndarray, np.generic)):
        return x.dtype.kind in "biufc"
    return isinstance(x, jax.Array)


def _stack_flag(x):
    """``plan.stacked`` entry of a stacked leaf: ``"weak"`` for a weakly typed
    one (a Python number, a weak JAX array), else True."""
    return "weak" if compat.is_weakly_typed(x) else True


def _value_key(x):
    if isinstance(x, (bool, int, float, complex)):
        return (type(x), x)
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        x = jax.random.key_data(x)  # typed keys: their words
    a = np.asarray(x)
    return (a.shape, a.dtype.str, hashlib.blake2b(a.tobytes(), digest_size=16).digest())


def stack_varying_statics(infos: list, idxs: list[int]) -> None:
    """Mark the static leaves whose values differ across the examples ``idxs``
    (one kind) as stacked: their ``(plan, leaves)`` entries of ``infos`` get,
    in place, a plan whose ``stacked`` flags (and so signature) say so. Their
    batches pass each row its own value (a per-example scale, PRNG key or
    weight array) instead of running in batches of one."""
    plans_and_leaves = [infos[i] for i in idxs]
    plan0, leaves0 = plans_and_leaves[0]
    statics = [i for i, p in enumerate(plan0.leaves) if p.static]
    first = {i: _value_key(leaves0[i]) for i in statics if _stackable(leaves0[i])}
    varying = set()
    for _, leaves in plans_and_leaves[1:]:
        varying |= {i for i, key in first.items()
                    if i not in varying and _value_key(leaves[i]) != key}
    if not varying:
        return
    flags = tuple(_stack_flag(leaves0[i]) if i in varying else False for i in statics)
    for k, (plan, leaves) in zip(idxs, plans_and_leaves):
        infos[k] = (_with_stacked(plan, flags), leaves)


def _with_stacked(plan: CallPlan, flags: tuple) -> CallPlan:
    return dataclasses.replace(plan, stacked=flags,
                               signature=plan.signature + (("stacked", flags),))


def static_batch_leaves(plan: CallPlan, rows_leaves: list) -> list:
    """The static inputs of a batch program: the first row's value, or for a
    stacked leaf every row's value stacked on a new axis 0 (NumPy; typed
    keys stacked as key data and wrapped again)."""
    out, flags = [], iter(plan.stacked or ())
    for i, p in enumerate(plan.leaves):
        if not p.static:
            continue
        if not next(flags, False):
            out.append(rows_leaves[0][i])
            continue
        vals = [leaves[i] for leaves in rows_leaves]
        if jax.dtypes.issubdtype(_stack_dtype(vals[0]), jax.dtypes.prng_key):
            data = np.stack([np.asarray(jax.random.key_data(v)) for v in vals])
            out.append(jax.random.wrap_key_data(data, impl=jax.random.key_impl(vals[0])))
        else:
            out.append(np.stack([np.asarray(v, _stack_dtype(v)) for v in vals]))
    return out


def _stack_dtype(x):
    """The dtype a stacked leaf has: JAX's for a Python number, else its own."""
    return jnp.result_type(x) if isinstance(x, (bool, int, float, complex)) else x.dtype


def _weak_positions(plan: CallPlan, n_broadcast: int) -> list[int]:
    """Positions of a batch program's stacked weakly typed static inputs."""
    return [n_broadcast + j for j, f in enumerate(plan.stacked or ()) if f == "weak"]


def example_avals(avals, axes, plan: CallPlan, n_broadcast: int) -> list:
    """One example's view of a batch program's abstract arguments: batched
    ones without their row axis, stacked weak ones weakly typed again."""
    weak = _weak_positions(plan, n_broadcast)
    return [a if ax is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype, weak_type=i in weak)
            for i, (a, ax) in enumerate(zip(avals, axes))]


def stacked_weak_inputs(fn: Callable, plan: CallPlan, n_broadcast: int) -> Callable:
    """``fn`` (a batch program over broadcast, static, ... arguments) with its
    stacked weakly typed static inputs made weakly typed again inside the
    program: NumPy stacks Python numbers as strong arrays, and each row must
    promote as the scalar did (``x * 2.0`` keeps a bfloat16 ``x`` bfloat16)."""
    weak = _weak_positions(plan, n_broadcast)
    if not weak:
        return fn

    @functools.wraps(fn)
    def with_weak(*args):
        args = list(args)
        for i in weak:
            args[i] = compat.as_weakly_typed(args[i])
        return fn(*args)

    return with_weak


def static_batch_avals(plan: CallPlan, leaves, rows: int) -> list:
    """Abstract static inputs of a ``rows``-row batch program (``precompile``)."""
    out, flags = [], iter(plan.stacked or ())
    for x, p in zip(leaves, plan.leaves):
        if p.static:
            stacked = next(flags, False)
            out.append(jax.ShapeDtypeStruct((rows,) + np.shape(x), _stack_dtype(x))
                       if stacked else x)
    return out


def batch_in_axes(plan: CallPlan, n_broadcast: int, n_static: int, n_dynamic: int) -> tuple:
    """``vmap`` in_axes of a batch program: broadcast leaves unbatched, static
    leaves batched where stacked, padded leaves and the size vector batched."""
    stacked = plan.stacked or (False,) * n_static
    return ((None,) * n_broadcast + tuple(0 if f else None for f in stacked)
            + (0,) * (n_dynamic + 1))


def specs_hint(e: Exception) -> str:
    """A hint for an ``in_specs`` count error of ``ragged_map`` (whose specs
    describe the example arguments only)."""
    if "in_specs has" not in str(e):
        return ""
    return ("\n  (ragged_map's in_specs describe the arguments of one example; the "
            "broadcast arguments of a call, ragged_map(...)(examples, *broadcast), take "
            "no spec)")


def rebucket(plan: CallPlan, buckets: Mapping[str, int]) -> CallPlan:
    """``plan`` with its dim vars padded to ``buckets`` (each >= its own bucket):
    the plan of a batch whose examples all pad to the batch's largest buckets."""
    if dict(buckets) == plan.buckets:
        return plan
    leaves, signature, padded = [], [], 0
    for p in plan.leaves:
        bound = p.shape if p.static else padded_shape(p.axes, buckets)
        leaves.append(dataclasses.replace(p, padded=bound))
        signature.append((p.static, bound, p.dtype))
        padded += 0 if p.static else math.prod(bound)
    if plan.stacked:  # the signature says which static leaves are stacked
        signature.append(("stacked", plan.stacked))
    return dataclasses.replace(plan, leaves=leaves, buckets=dict(buckets),
                               signature=tuple(signature), padded=padded)


def batch_bucket(policy: Callable[[int], int], n: int, most: int) -> int:
    """Rows of a batch of ``n`` examples: the policy's bound for ``n``, at least ``n``,
    at most ``most`` (``ragged_map``'s partial batches)."""
    return min(most, max(n, int(policy(n))))


def warn_parallel_lists(examples: Sequence[Any], broadcast: tuple) -> None:
    """Warn where a broadcast argument looks like a second list of examples:
    a list of arrays, one per example, each as long as its example
    (``rm(xs, ys)`` meant as pairs): it is passed whole to every example,
    first, where ``rm(list(zip(xs, ys)))`` maps over the pairs."""
    for i, b in enumerate(broadcast):
        if not (isinstance(b, list) and len(b) == len(examples) > 1):
            continue
        if all(hasattr(y, "shape") and np.ndim(y) >= 1 and hasattr(x, "shape")
               and np.ndim(x) >= 1 and np.shape(y)[0] == np.shape(x)[0]
               for x, y in zip(examples, b)):
            warnings.warn(
                f"ragged_map: broadcast argument {i} is a list of {len(b)} arrays, one as "
                "long as each example: it is passed whole, first, to every example. To map "
                "over pairs of examples, pass them as one list of tuples: "
                "rm(list(zip(xs, ys))) calls f(x, y) on each pair", UserWarning,
                stacklevel=user_stacklevel())
            return


# PRNG implementations whose batched random bits are not each key's own: JAX
# draws a vmap's batch from one key (jax-ml/jax#20094, rng_bit_generator)
_BATCH_DRAWN_IMPLS = ("rbg", "unsafe_rbg")


def warn_batch_drawn_keys(arg_lists) -> None:
    """Warn where the examples carry typed PRNG keys of an ``rbg`` implementation:
    a batch of examples runs under ``vmap``, where JAX draws their random bits
    from one key of the batch (jax-ml/jax#20094), so the draws differ from
    ``f`` on each example alone (``threefry2x32``, the default, is exact)."""
    for args in arg_lists[:1]:
        for leaf in jax.tree_util.tree_leaves(args):
            dtype = getattr(leaf, "dtype", None)
            if dtype is None or isinstance(dtype, np.dtype) or not jax.dtypes.issubdtype(
                    dtype, jax.dtypes.prng_key):
                continue
            impl = str(jax.random.key_impl(leaf))
            if impl in _BATCH_DRAWN_IMPLS:
                warnings.warn(
                    f"ragged_map: the examples carry {impl!r} PRNG keys; a batch of examples "
                    "runs under vmap, where JAX draws the random bits of an rbg key batch "
                    "from one key (jax-ml/jax#20094), so the draws differ from f on each "
                    "example alone (as under jax.vmap). Keys of the default implementation "
                    "(threefry2x32) draw each example's own bits", UserWarning,
                    stacklevel=user_stacklevel())
                return


def auto_specs(arg_lists, *, leading_if_uniform: bool = False,
               empty_dynamic: bool = False, history: AxisHistory | None = None) -> tuple:
    """``ragged_map``'s specs when ``in_specs=None``: the axes whose sizes differ
    across the examples (tuples of arguments) are dynamic, and axes whose sizes
    are equal in every example share one dim var (``x`` of ``(n, 16)`` and
    ``y`` of ``(n,)``: ``x @ W - y`` traces as it does on each example).
    ``leading_if_uniform``: where no axis differs (examples of one length), the
    leading axes are dynamic (the packed layout packs one ragged axis);
    ``empty_dynamic``: an axis empty in every example is dynamic too (a stacked
    batch pads it to at least 1); ``history``: a runner's ``AxisHistory``
    (updated here), so a leading axis whose size differed between calls stays
    dynamic in a call of one length.

    Raises:
      ShapeError: examples of different pytree structures or leaf ranks.
    """
    if history is not None:
        history.start_call()
    trees = {jax.tree_util.tree_structure(a) for a in arg_lists}
    if len(trees) != 1:
        raise ShapeError("ragged_map: examples have different pytree structures "
                         f"({len(trees)} kinds)")
    per_ex = [jax.tree_util.tree_leaves(a) for a in arg_lists]
    n_leaves = len(per_ex[0])
    leaf_specs = []
    all_shapes = []
    for li in range(n_leaves):
        shapes = [np.shape(ex[li]) for ex in per_ex]
        if len({len(sh) for sh in shapes}) != 1:
            raise ShapeError(f"ragged_map: leaf {li} of the examples has different ranks")
        all_shapes.append(shapes)
    uniform = not any(sh[k] != shapes[0][k] for shapes in all_shapes for sh in shapes
                      for k in range(len(sh)))
    tree = trees.pop()
    varying_of = []
    for li, shapes in enumerate(all_shapes):
        first = shapes[0]
        varying_of.append([_varies(history, (tree, li, k), {sh[k] for sh in shapes})
                           or (empty_dynamic and first[k] == 0)
                           or (leading_if_uniform and uniform and k == 0)
                           for k in range(len(first))])
    name_of_sizes = _axis_names(all_shapes, varying_of)
    for shapes, varying in zip(all_shapes, varying_of):
        if not any(varying):
            leaf_specs.append(None)
            continue
        leaf_specs.append(", ".join(name_of_sizes[tuple(sh[k] for sh in shapes)] if v
                                    else str(shapes[0][k]) for k, v in enumerate(varying)))
    specs, it = [], iter(leaf_specs)
    for a in arg_lists[0]:
        sub = jax.tree_util.tree_structure(a)
        vals = [next(it) for _ in range(sub.num_leaves)]
        specs.append(vals[0] if sub.num_leaves == 1 and sub == jax.tree_util.tree_structure(
            0) else jax.tree_util.tree_unflatten(sub, vals))
    return tuple(specs)


def _axis_names(all_shapes, varying_of) -> dict[tuple[int, ...], str]:
    """The spec of each dynamic axis, keyed by its sizes over the examples: one
    dim var per distinct sizes (``l{leaf}_{axis}`` of its first axis), except
    sizes that exceed another axis's by the same constant in every example
    (``v`` one longer than ``r`` for ``r + v[1:]``): ``"l0_0 + 1"``, as
    ``in_specs=("T", "T + 1")`` would give and ``polymask.jit`` finds by
    tracing. (A constant relation needs sizes that vary: two axes of one
    example differ by some constant whatever the function.)"""
    first_axis = {}
    for li, (shapes, varying) in enumerate(zip(all_shapes, varying_of)):
        for k, v in enumerate(varying):
            if v:
                first_axis.setdefault(tuple(sh[k] for sh in shapes), f"l{li}_{k}")
    names: dict[tuple[int, ...], str] = {}
    for sizes in sorted(first_axis, key=sum):  # (the smallest of a relation is its base)
        names[sizes] = first_axis[sizes]
        if len(set(sizes)) < 2:
            continue
        for base, name in names.items():
            shift = {a - b for a, b in zip(sizes, base)}
            if len(shift) == 1 and (c := shift.pop()) > 0 and "+" not in name:
                names[sizes] = f"{name} + {c}"
                break
    return names


def auto_spec_axes(examples) -> dict[str, str]:
    """What each name ``auto_specs`` may give is, in each example: ``l1_0``
    -> ``"example[1].shape[0]"`` (leaf 1 of an example, axis 0;
    ``"example.shape[0]"`` where an example is one array); {} for
    ``examples`` that are not a list of examples."""
    if not isinstance(examples, (list, tuple)) or not examples:
        return {}
    one = not isinstance(examples[0], tuple)
    flat = jax.tree_util.tree_flatten_with_path((examples[0],) if one else examples[0])[0]
    axes = {}
    for li, (path, leaf) in enumerate(flat):
        where = "example" + jax.tree_util.keystr(path[1:] if one else path)
        for k in range(np.ndim(leaf)):
            axes[f"l{li}_{k}"] = f"{where}.shape[{k}]"
    return axes


class AxisHistory:
    """Each leading axis' size over a runner's calls without specs, so a batch
    of one length (a length-bucketed loader) keeps an axis that changed size
    between calls dynamic, instead of compiling a program per length.

    Only leading axes are promoted (the ragged axis of per-example data;
    trailing ones are features). An axis promoted so whose program cannot be
    traced dynamically (a size ``x @ W`` needs) is pinned static again
    (``pin_promoted``) and the call runs again, as before the promotion.

    Threads share the sizes seen (under a lock); each thread's call has its
    own promoted axes, so one call never pins or drops another's."""

    def __init__(self):
        self._sizes: dict = {}  # (tree, leaf, axis) -> its one size, or None once it varied
        self._pinned: set = set()
        self._lock = threading.Lock()
        self._this_call = threading.local()  # .promoted: this thread's call's axes

    @property
    def promoted(self) -> set:
        """The axes that this thread's last ``auto_specs`` made dynamic from
        history only."""
        promoted = getattr(self._this_call, "promoted", None)
        if promoted is None:
            promoted = self._this_call.promoted = set()
        return promoted

    def start_call(self) -> None:
        self._this_call.promoted = set()

    def varies(self, axis: tuple, sizes: set) -> bool:
        """Whether ``axis`` has several ``sizes`` in this call's examples or
        (a leading axis, not pinned) another size in an earlier call."""
        within = len(sizes) > 1
        with self._lock:
            seen = self._sizes.setdefault(axis, next(iter(sizes)))
            if seen is not None and (within or seen not in sizes):
                self._sizes[axis] = seen = None
            if within or seen is not None or axis[2] != 0 or axis in self._pinned:
                return within
        self.promoted.add(axis)
        return True

    def pin_promoted(self) -> bool:
        """Pin this call's promoted axes static; whether there were any."""
        promoted = self.promoted
        with self._lock:
            self._pinned |= promoted
        self._this_call.promoted = set()
        return bool(promoted)


def _varies(history: AxisHistory | None, axis: tuple, sizes: set) -> bool:
    return len(sizes) > 1 if history is None else history.varies(axis, sizes)
