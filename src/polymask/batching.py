"""How ``ragged_map`` forms batches: which examples may share a batch, and the
plan of a batch padded to its largest example's buckets."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping

import jax
import numpy as np

from .errors import ShapeError
from .plan import CallPlan, padded_shape

__all__ = ["kind_key", "static_values_key", "rebucket", "batch_bucket", "auto_specs"]


def kind_key(plan: CallPlan) -> tuple:
    """What examples must share to be batched together: everything in the
    signature but the buckets (dim vars, static leaves, ranks, dtypes)."""
    return (tuple(plan.var_names),
            tuple((p.static, p.shape if p.static else len(p.shape), p.dtype)
                  for p in plan.leaves))


def static_values_key(plan: CallPlan, leaves) -> tuple:
    """The values of an example's static leaves (no dim var), hashable. A batch
    passes one example's static leaves to all its rows, so examples whose
    values differ there (a per-example scale, a per-example PRNG key) must not
    share a batch: ``ragged_map`` adds this to the kind of an example."""
    return tuple(_value_key(x) for x, p in zip(leaves, plan.leaves) if p.static)


def _value_key(x):
    if isinstance(x, (bool, int, float, complex)):
        return (type(x), x)
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        x = jax.random.key_data(x)  # typed keys: their words
    a = np.asarray(x)
    return (a.shape, a.dtype.str, hashlib.blake2b(a.tobytes(), digest_size=16).digest())


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
    return dataclasses.replace(plan, leaves=leaves, buckets=dict(buckets),
                               signature=tuple(signature), padded=padded)


def batch_bucket(policy: Callable[[int], int], n: int, most: int) -> int:
    """Rows of a batch of ``n`` examples: the policy's bound for ``n``, at least ``n``,
    at most ``most`` (``ragged_map``'s partial batches)."""
    return min(most, max(n, int(policy(n))))


def auto_specs(arg_lists) -> tuple:
    """``ragged_map``'s specs when ``in_specs=None``: the axes whose sizes differ
    across the examples (tuples of arguments) are dynamic.

    Raises:
      ShapeError: examples of different pytree structures or leaf ranks.
    """
    trees = {jax.tree_util.tree_structure(a) for a in arg_lists}
    if len(trees) != 1:
        raise ShapeError("ragged_map: examples have different pytree structures "
                         f"({len(trees)} kinds)")
    per_ex = [jax.tree_util.tree_leaves(a) for a in arg_lists]
    n_leaves = len(per_ex[0])
    leaf_specs = []
    for li in range(n_leaves):
        shapes = [np.shape(ex[li]) for ex in per_ex]
        if len({len(sh) for sh in shapes}) != 1:
            raise ShapeError(f"ragged_map: leaf {li} of the examples has different ranks")
        first = shapes[0]
        varying = [any(sh[k] != first[k] for sh in shapes) for k in range(len(first))]
        if not any(varying):
            leaf_specs.append(None)
            continue
        leaf_specs.append(", ".join(f"l{li}_{k}" if v else str(first[k])
                                    for k, v in enumerate(varying)))
    specs, it = [], iter(leaf_specs)
    for a in arg_lists[0]:
        sub = jax.tree_util.tree_structure(a)
        vals = [next(it) for _ in range(sub.num_leaves)]
        specs.append(vals[0] if sub.num_leaves == 1 and sub == jax.tree_util.tree_structure(
            0) else jax.tree_util.tree_unflatten(sub, vals))
    return tuple(specs)
