"""Tiered buckets for ``polymask.jit``: serve a size from a compiled bucket
that holds it while its own (tighter) bucket compiles in the background.

A first pass over many sizes then costs about one compile in the foreground
(the largest bucket, when the policy has one: ``Policy.largest``), and the
steady state runs in tight buckets. ``PolyJit`` holds a ``Tiering``; the calls
themselves are in ``polyjit.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from ..core.plan import padded_shape
from .programs import Entry, ProgramCache

__all__ = ["Tiering", "cover_key"]


def cover_key(tree, plan):
    """What a covering bucket must share: tree, static leaves, dtypes, dim vars."""
    return (tree, tuple(p.padded if p.static else None for p in plan.leaves),
            tuple(p.dtype for p in plan.leaves), tuple(plan.var_names))


class Tiering:
    """Cover lookup in ``cache``, the largest bucket first, background compiles.

    ``policy_for(var)``: the runner's bucket policy of a dim var;
    ``compile_ahead(args) -> bool``: compile the bucket of ``args`` now (no
    run; True when compiled by this call).
    """

    def __init__(self, cache: ProgramCache, policy_for: Callable,
                 compile_ahead: Callable[[tuple], bool]):
        self.cache = cache
        self.policy_for = policy_for
        self.compile_ahead = compile_ahead

    def find_cover(self, plan, key, own: Entry | None) -> Entry | None:
        """The smallest live entry other than ``own`` with cover key ``key``
        whose buckets hold every size of ``plan`` (or None)."""
        values = dict(zip(plan.var_names, plan.values))
        best = None
        for e in self.cache.entries():
            if not e.live or e.cover_key != key or e is own:
                continue
            if all(e.buckets[v] >= n for v, n in values.items()):
                if best is None or e.padded < best.padded:
                    best = e
        return best

    def compile_largest(self, tree, plan, leaves) -> bool | None:
        """Compile the bucket of every dim var's largest bucket (``Policy.largest``)
        now, so that this and later sizes run in it while their own buckets
        compile in the background: a first pass costs one compile in the
        foreground. None when a policy has no largest bucket or the call's
        buckets are the largest already; else whether this call compiled it."""
        largest = {v: getattr(self.policy_for(v), "largest", None) for v in plan.var_names}
        if not largest or any(b is None for b in largest.values()):
            return None
        if all(plan.buckets[v] >= b for v, b in largest.items()):
            return None
        if any(self.policy_for(v)(b) != b for v, b in largest.items()):
            return None  # a policy whose largest bucket is not a fixed point
        args = list(leaves)
        for i, p in enumerate(plan.leaves):
            if not p.static:
                args[i] = jax.ShapeDtypeStruct(padded_shape(p.axes, largest), p.dtype)
        return self.compile_ahead(jax.tree_util.tree_unflatten(tree, args))

    def compile_in_background(self, key, entry: Entry, make,
                              flat_args: Callable[[], list]) -> None:
        """Compile (and run once, on ``flat_args()``: padded copies) ``entry``'s
        program in the background, once per key."""
        if self.cache.is_pending(key):
            return
        flat = flat_args()
        self.cache.submit_once(
            key, lambda: self.cache.compile_run(entry, make, flat, background=True))
