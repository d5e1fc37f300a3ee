"""Tiered buckets for ``polymask.jit``: serve a size from a compiled bucket
that holds it while its own (tighter) bucket compiles in the background.

A first pass over many sizes then costs about one compile in the foreground
(the largest bucket, when the policy has one: ``Policy.largest``), and the
steady state runs in tight buckets. ``PolyJit`` mixes this in; the calls
themselves are in ``runner.py``.
"""

from __future__ import annotations

import jax

from ..core.plan import padded_shape
from .compiling import background_executor

__all__ = ["TieredBuckets"]


class TieredBuckets:
    """Cover lookup, the largest bucket first, background compiles (a mixin of
    ``PolyJit``: uses its ``_lock``, ``_cache``, ``_pending``, ``_policy_for``,
    ``_compile_ahead``, ``_compile_run``, ``_flat``,
    ``_fg_compiles_in_calls``)."""

    def _cover_key(self, info):
        """What a covering bucket must share: tree, static leaves, dtypes, dim vars."""
        plan = info.plan
        return (info.tree, tuple(p.padded if p.static else None for p in plan.leaves),
                tuple(p.dtype for p in plan.leaves), tuple(plan.var_names))

    def _find_cover(self, info, cover_key):
        """The smallest live entry whose buckets hold every size of ``info`` (or None)."""
        values = dict(zip(info.plan.var_names, info.plan.values))
        best = None
        with self._lock:
            for e in self._cache.values():
                if not e.live or e.cover_key != cover_key or e is info.entry:
                    continue
                if all(e.buckets[v] >= n for v, n in values.items()):
                    if best is None or e.padded < best.padded:
                        best = e
        return best

    def _compile_largest(self, info, leaves) -> bool:
        """Compile the bucket of every dim var's largest bucket (``Policy.largest``)
        now, so that this and later sizes run in it while their own buckets
        compile in the background: a first pass costs one compile in the
        foreground. False when a policy has no largest bucket or the call's
        buckets are the largest already."""
        plan = info.plan
        largest = {v: getattr(self._policy_for(v), "largest", None) for v in plan.var_names}
        if not largest or any(b is None for b in largest.values()):
            return False
        if all(plan.buckets[v] >= b for v, b in largest.items()):
            return False
        if any(self._policy_for(v)(b) != b for v, b in largest.items()):
            return False  # a policy whose largest bucket is not a fixed point
        args = list(leaves)
        for i, p in enumerate(plan.leaves):
            if not p.static:
                args[i] = jax.ShapeDtypeStruct(padded_shape(p.axes, largest), p.dtype)
        if self._compile_ahead(jax.tree_util.tree_unflatten(info.tree, args), None):
            with self._lock:
                self._fg_compiles_in_calls += 1
        return True

    def _submit_background(self, info, entry, make, leaves) -> None:
        key = info.key
        with self._lock:
            if key in self._pending:
                return
            flat = self._flat(info, leaves)  # padded copies for the background run

            def work():
                try:
                    self._compile_run(entry, make, flat, background=True)
                finally:
                    with self._lock:
                        self._pending.pop(key, None)

            self._pending[key] = background_executor().submit(work)
