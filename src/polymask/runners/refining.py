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
from .programs import checked_compiler_options
from .ragged_batches import rebucket

REFINED_OPTIONS = "refined_compiler_options"

__all__ = ["Refinement"]


class Refinement:
    """Refined batch programs of a ``RaggedMap``.

    ``refine_buckets``: the finer policy (None: off). ``cache``: the runner's
    ``ProgramCache`` (whose ``options_for`` should be ``options_for``). ``program_and_avals(tree, plan, leaves, rows, in_specs,
    broadcast, bcast_leaves, bcast_tree)`` gives a batch program's ``make``
    and abstract arguments; ``ready(tree, plan, chunk, rows, infos, call)``
    whether a batch's program is compiled or stored (both the runner's).
    """

    def __init__(self, refine_buckets, compiler_options: dict, refined_compiler_options, *,
                 cache, program_and_avals, ready):
        self.refine_for = None if refine_buckets is None else policy_getter(refine_buckets)
        self.compiler_options = compiler_options
        self.cache = cache
        self.program_and_avals = program_and_avals
        self.ready = ready
        self._failed: set = set()  # keys whose refined compile failed: not retried
        if refined_compiler_options is not None and refine_buckets is None:
            raise ValueError("refined_compiler_options applies to refined programs: "
                             "pass refine_buckets too (e.g. buckets.multiple(8))")
        self.refined_options = (
            compiler_options if refined_compiler_options is None
            else checked_compiler_options(refined_compiler_options, "refined_compiler_options"))
        # Refined programs with options of their own are programs of their own,
        # also at a batch's coarse buckets: the tag in their signature keys them.
        self.tag = (None if self.refined_options == compiler_options else
                    (REFINED_OPTIONS, tuple(sorted(self.refined_options.items()))))

    def options_for(self, key) -> dict:
        """XLA options of the program of ``key`` (refined programs may have their own)."""
        signature = key[1] if isinstance(key, tuple) and len(key) > 1 else ()
        if self.tag is not None and signature and signature[-1] == self.tag:
            return self.refined_options
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
                buckets[v] = min(coarse, bucket_bound(self.refine_for(v), longest))
            except ShapeError:  # past the refined policy's largest bucket: stay coarse
                buckets[v] = coarse
        if self.tag is not None:
            fine = rebucket(plan, buckets)
            return dataclasses.replace(fine, signature=fine.signature + (self.tag,))
        return None if buckets == plan.buckets else rebucket(plan, buckets)

    def refine_batches(self, batches, infos, call):
        """``(batches, wanted)``: each batch in its refined program when that is
        compiled or in the program store (else as it was), and the refined
        batches still to compile. ``call``: ``(broadcast, bcast_leaves,
        bcast_tree, bcast_key, in_specs, spec_key)``."""
        if self.refine_for is None:
            return batches, []
        out, wanted = [], []
        for tree, plan, chunk, rows in batches:
            fine = self._refined_plan(plan, chunk, infos)
            if fine is not None:
                if self.ready(tree, fine, chunk, rows, infos, call):
                    plan = fine
                else:
                    wanted.append((tree, fine, chunk, rows))
            out.append((tree, plan, chunk, rows))
        return out, wanted

    def queue_refined(self, wanted, infos, broadcast, bcast_leaves, bcast_tree, bcast_key,
                      in_specs, spec_key) -> None:
        """Queue the refined programs of ``wanted`` on the background compiler
        (``wait()`` waits for them; ``stats()["refined_compiles"]`` counts them)."""
        for tree, plan, chunk, rows in wanted:
            key = (tree, plan.signature, rows, bcast_key, spec_key)
            if self.cache.is_pending(key) or key in self._failed:
                continue
            entry = self.cache.entry(key, hit=False)
            if entry.live:
                continue
            make, avals = self.program_and_avals(tree, plan, infos[chunk[0]][1], rows,
                                                 in_specs, broadcast, bcast_leaves, bcast_tree)

            def work(entry=entry, make=make, avals=avals, key=key):
                try:
                    return self.cache.precompile_entry(entry, make, avals, "refined_compiles")
                except Exception as e:  # the coarse program keeps serving these batches
                    self._failed.add(key)
                    warnings.warn(
                        "polymask.ragged_map: a refined program could not be compiled "
                        f"(refined_compiler_options={self.refined_options}); calls keep "
                        f"running its batches in the coarse program:\n  {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}", RuntimeWarning,
                        stacklevel=2)
                    return False

            self.cache.submit_once(key, work)
