"""How ``ragged_map`` forms batches: which examples may share a batch, and the
plan of a batch padded to its largest example's buckets."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from .plan import CallPlan, padded_shape

__all__ = ["kind_key", "rebucket", "batch_bucket"]


def kind_key(plan: CallPlan) -> tuple:
    """What examples must share to be batched together: everything in the
    signature but the buckets (dim vars, static leaves, ranks, dtypes)."""
    return (tuple(plan.var_names),
            tuple((p.static, p.shape if p.static else len(p.shape), p.dtype)
                  for p in plan.leaves))


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
