"""Refined buckets for ``ragged_map``: after a call, tighter batch programs
compile in the background, and later calls run in them.

A batch pads its longest example up to a bucket of the ``buckets`` policy
(coarse: few programs, so a first pass compiles little). ``refine_buckets``
is a finer policy: once a call has run a batch whose longest example has a
tighter refined bucket (the smaller of the two policies' bounds), that
batch's refined program is queued on the background compiler when the call
returns. Later calls that cut the same batch run it in the refined program
once it is compiled, and in the coarse one until then: no call waits for a
refined compile, and results are the same either way (the masked program
is exact in every bucket that holds the sizes).

This is the tiered-bucket idea of ``polymask.jit`` (``tiering.py``) applied
across calls: the first pass pays for the coarse programs only, repeated
passes run in tight buckets. It pays when the same corpus shape comes back
(serving, several epochs); a one-shot pass gains nothing and the CLI turns
it off. With the program store (``program_store.py``), a refined program an
earlier process stored runs from the first call.
"""

from __future__ import annotations

import dataclasses
import warnings

from ..core.errors import ShapeError
from ..core.plan import bucket_bound, policy_getter
from .compiling import background_executor
from .program_store import active_store
from .programs import checked_compiler_options
from .ragged_batches import rebucket

REFINED_OPTIONS = "refined_compiler_options"

__all__ = ["RefinedBuckets"]


class RefinedBuckets:
    """Refined batch programs (a mixin of ``RaggedMap``: uses its ``_cache``,
    ``_lock``, ``_pending``, ``_stats``, ``_entry``, ``_program_and_avals``,
    ``_prepare`` and ``_precompile_entry``)."""

    def _init_refine(self, refine_buckets, refined_compiler_options) -> None:
        self._refine_for = None if refine_buckets is None else policy_getter(refine_buckets)
        self._refine_failed: set = set()  # keys whose refined compile failed: not retried
        if refined_compiler_options is not None and refine_buckets is None:
            raise ValueError("refined_compiler_options applies to refined programs: "
                             "pass refine_buckets too (e.g. buckets.multiple(8))")
        self._refined_options = (
            self.compiler_options if refined_compiler_options is None
            else checked_compiler_options(refined_compiler_options, "refined_compiler_options"))
        # Refined programs with options of their own are programs of their own,
        # also at a batch's coarse buckets: the tag in their signature keys them.
        self._refined_tag = (None if self._refined_options == self.compiler_options else
                             (REFINED_OPTIONS, tuple(sorted(self._refined_options.items()))))

    def _compiler_options_for(self, key) -> dict:
        signature = key[1] if isinstance(key, tuple) and len(key) > 1 else ()
        if self._refined_tag is not None and signature and signature[-1] == self._refined_tag:
            return self._refined_options
        return self.compiler_options

    def _refined_plan(self, plan, chunk, infos):
        """The plan of a batch padded to its longest sizes' refined buckets (each
        at most its coarse bucket), or None when no bucket gets tighter (and
        refined programs have the same compiler options)."""
        names = plan.var_names
        buckets = {}
        for v, coarse in plan.buckets.items():
            k = names.index(v)
            longest = max(infos[i][0].values[k] for i in chunk)
            try:
                buckets[v] = min(coarse, bucket_bound(self._refine_for(v), longest))
            except ShapeError:  # past the refined policy's largest bucket: stay coarse
                buckets[v] = coarse
        if self._refined_tag is not None:
            fine = rebucket(plan, buckets)
            return dataclasses.replace(fine, signature=fine.signature + (self._refined_tag,))
        return None if buckets == plan.buckets else rebucket(plan, buckets)

    def _refine_batches(self, batches, infos, call):
        """``(batches, wanted)``: each batch in its refined program when that is
        compiled or in the program store (else as it was), and the refined
        batches still to compile. ``call``: ``(broadcast, bcast_leaves,
        bcast_tree, bcast_key, in_specs, spec_key)``."""
        if self._refine_for is None:
            return batches, []
        out, wanted = [], []
        for tree, plan, chunk, rows in batches:
            fine = self._refined_plan(plan, chunk, infos)
            if fine is not None:
                if self._program_ready(tree, fine, chunk, rows, infos, call):
                    plan = fine
                else:
                    wanted.append((tree, fine, chunk, rows))
            out.append((tree, plan, chunk, rows))
        return out, wanted

    def _program_ready(self, tree, fine, chunk, rows, infos, call) -> bool:
        """The program of ``fine`` (a batch's plan) at ``rows`` is compiled, or
        stored on disk: a warm process then runs refined batches, and partial
        batches in full-batch programs, from its first call (a load costs
        about a trace)."""
        broadcast, bcast_leaves, bcast_tree, bcast_key, in_specs, spec_key = call
        key = (tree, fine.signature, rows, bcast_key, spec_key)
        e = self._cache.get(key)
        if e is not None and e.live:
            return True
        store = active_store()
        if store is None:
            return False
        entry = self._entry(key, hit=False)
        if not entry.lock.acquire(blocking=False):
            return False  # compiling in the background now
        try:
            if entry.fn is not None:
                return True
            if entry.prepared is None:
                make, avals = self._program_and_avals(tree, fine, infos[chunk[0]][1], rows,
                                                      in_specs, broadcast, bcast_leaves,
                                                      bcast_tree)
                entry.prepared = self._prepare(entry, make, avals, store)
            return store.has(entry.prepared[2])
        finally:
            entry.lock.release()

    def _queue_refined(self, wanted, infos, broadcast, bcast_leaves, bcast_tree, bcast_key,
                       in_specs, spec_key) -> None:
        """Queue the refined programs of ``wanted`` on the background compiler
        (``wait()`` waits for them; ``stats()["refined_compiles"]`` counts them)."""
        for tree, plan, chunk, rows in wanted:
            key = (tree, plan.signature, rows, bcast_key, spec_key)
            with self._lock:
                if key in self._pending or key in self._refine_failed:
                    continue
            entry = self._entry(key, hit=False)
            if entry.live:
                continue
            make, avals = self._program_and_avals(tree, plan, infos[chunk[0]][1], rows,
                                                  in_specs, broadcast, bcast_leaves, bcast_tree)

            def work(entry=entry, make=make, avals=avals, key=key):
                try:
                    return self._precompile_entry(entry, make, avals, "refined_compiles")
                except Exception as e:  # the coarse program keeps serving these batches
                    self._refine_failed.add(key)
                    warnings.warn(
                        "polymask.ragged_map: a refined program could not be compiled "
                        f"(refined_compiler_options={self._refined_options}); calls keep "
                        f"running its batches in the coarse program:\n  {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}", RuntimeWarning,
                        stacklevel=2)
                    return False
                finally:
                    with self._lock:
                        self._pending.pop(key, None)

            with self._lock:
                self._pending[key] = background_executor().submit(work)
