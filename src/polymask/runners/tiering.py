"""Tiered buckets for ``polymask.jit``: serve a size from a compiled bucket
that holds it while its own (tighter) bucket compiles in the background.

When no compiled bucket holds a call's sizes, ``Tiering.compile_first``
compiles a *covering* bucket in the foreground instead of the call's own one:

- a dim var whose policy has a largest bucket (``Policy.largest``:
  ``pow2(16, maximum=512)``, ``explicit``) gets that bucket;
- a dim var whose policy has no largest bucket but a headroom
  (``Policy.headroom``; the default ``pow2()`` has 16) gets the policy's
  bucket of ``headroom`` times its own bucket (``pow2()``: a first size of 5,
  bucket 8, gets 128), capped by the dim var's upper bound when the
  constraints give one (``"n <= 100"``: the bucket of 100), and shrunk (by
  halving the headroom) until the padded dynamic inputs of the covering bucket
  take at most ``headroom_bytes()`` (64 KiB on CPU, 16 MiB on an accelerator)
  or no more than the own bucket's. Larger data gets less headroom: there a
  program's run time, not its compile, is what padding costs;
- any other dim var (``exact()``, a plain callable) keeps its own bucket.

A first pass over many sizes then costs about one compile in the foreground,
and the steady state runs in tight buckets. A size larger than every compiled
bucket gets a covering bucket of its own the same way.

Background compiles yield to the caller (``compiling.BackgroundCompiler``): one
starts once no call has waited for a compile for ``YIELD_QUIET_S`` (50 ms), at
the latest ``YIELD_MAX_S`` (1 s) after it was requested, at once under
``wait()``, and at once when a shape that waits for it is called again. So a
burst of calls over new sizes is not slowed by compiles on the same cores,
while a size that repeats gets its own bucket soon.

``PolyJit`` holds a ``Tiering``; the calls themselves are in ``polyjit.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from .. import _jax_compat as compat
from ..core.errors import ShapeError
from ..core.plan import padded_shape
from ..core.shapes import canonical_dtype
from .fallback import refusal_text
from .hostio import host_backend
from .programs import Entry, PerSizeBucket, ProgramCache

__all__ = ["Tiering", "cover_key", "headroom_bytes", "HEADROOM_BYTES_CPU",
           "HEADROOM_BYTES_ACCELERATOR"]

# Most bytes of padded dynamic inputs a headroom bucket may take (unless the
# size's own bucket takes more). On CPU a program over a few tens of KiB is
# dominated by dispatch, so padding it is nearly free while a compile costs
# 0.1-1 s; an accelerator runs far larger padded programs in about the same
# time and compiles more slowly.
HEADROOM_BYTES_CPU = 64 << 10
HEADROOM_BYTES_ACCELERATOR = 16 << 20


def headroom_bytes() -> int:
    """The byte budget of a headroom bucket on this machine's default backend."""
    return HEADROOM_BYTES_CPU if host_backend() else HEADROOM_BYTES_ACCELERATOR


def cover_key(tree, plan):
    """What a covering bucket must share: tree, static leaves, the sizes of
    static axes (a ``"_"`` axis is the call's own size), dtypes, and which dim
    var each dynamic axis is (without ``in_specs`` the names follow each
    call's equal sizes: the same names may sit on other axes), and which
    dynamic leaves are weakly typed."""
    return (tree, tuple(p.padded if p.static else p.axis_forms for p in plan.leaves),
            tuple(p.dtype for p in plan.leaves), tuple(plan.var_names),
            tuple(p.weak for p in plan.leaves))


def _itemsize(dtype) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 8


def _fixed_bucket(policy, size) -> int | None:
    """``policy``'s bucket of ``size`` when it is its own bucket (else None)."""
    try:
        b = int(policy(int(size)))
        return b if b >= size and int(policy(b)) == b else None
    except (ShapeError, TypeError, ValueError):
        return None


class Tiering:
    """Cover lookup in ``cache``, the covering bucket first, background compiles.

    ``policy_for(var)``: the runner's bucket policy of a dim var;
    ``compile_ahead(args, plan) -> bool``: compile the bucket of ``args`` (planned
    with the dim vars of the call's ``plan``) now (no
    run; True when compiled by this call); ``constraints``: the runner's
    ``jax.export`` constraints (upper bounds of dim vars cap the headroom);
    ``replans(plan, error) -> bool``: whether the runner plans a call again
    after ``error`` (an axis met a fixed size: ``CallPlans.may_adapt_to``),
    which a failed covering bucket then raises to it.
    """

    def __init__(self, cache: ProgramCache, policy_for: Callable,
                 compile_ahead: Callable[..., bool], constraints: Sequence[str] = (),
                 replans: Callable[..., bool] = lambda plan, error: False):
        self.cache = cache
        self.policy_for = policy_for
        self.compile_ahead = compile_ahead
        self.replans = replans
        self.constraints = tuple(constraints)
        self._upper: dict[str, float] = {}
        self._off = False  # a covering bucket failed to trace: own buckets only

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

    # -- the covering bucket compiled first -------------------------------------------
    def upper_bound(self, var: str) -> float:
        """The largest size the constraints allow ``var`` (inf when unbounded)."""
        hi = self._upper.get(var)
        if hi is None:
            try:
                scope = jax.export.SymbolicScope(self.constraints)
                (e,) = jax.export.symbolic_shape(var, scope=scope)
                hi = compat.upper_bound(e)
                hi = math.inf if hi is None else hi
            except Exception:  # a name JAX does not parse alone: no bound known
                hi = math.inf
            self._upper[var] = hi
        return hi

    def _padded_bytes(self, plan, buckets) -> int:
        return sum(math.prod(padded_shape(p.axes, buckets)) * _itemsize(p.dtype)
                   for p in plan.leaves if not p.static)

    def first_sizes(self, plan) -> dict[str, int] | None:
        """Sizes whose buckets are the covering bucket to compile first for
        ``plan`` (see the module doc; a size is the bucket itself unless a
        constraint's upper bound is smaller), or None when that is the call's
        own bucket."""
        if self._off:
            return None
        own = {v: int(plan.buckets[v]) for v in plan.var_names}
        sizes = dict(own)
        factors: dict[str, int] = {}
        for v in plan.var_names:
            policy = self.policy_for(v)
            largest = getattr(policy, "largest", None)
            if largest is not None:
                if _fixed_bucket(policy, largest) != largest:
                    return None  # a policy whose largest bucket is not a fixed point
                sizes[v] = max(own[v], int(min(int(largest), self.upper_bound(v))))
            elif getattr(policy, "headroom", 1) > 1:
                factors[v] = int(policy.headroom)
        if factors:
            budget = max(headroom_bytes(), self._padded_bytes(plan, own))
            while True:
                for v, f in factors.items():
                    size = min(own[v] * f, self.upper_bound(v))
                    sizes[v] = own[v] if _fixed_bucket(self.policy_for(v), size) is None \
                        else max(own[v], int(size))
                if self._padded_bytes(plan, self._buckets(sizes)) <= budget or all(
                        f == 1 for f in factors.values()):
                    break
                factors = {v: max(1, f // 2) for v, f in factors.items()}
        return None if self._buckets(sizes) == own else sizes

    def _buckets(self, sizes) -> dict[str, int]:
        return {v: int(self.policy_for(v)(n)) for v, n in sizes.items()}

    def first_buckets(self, plan) -> dict[str, int] | None:
        """The buckets of ``first_sizes(plan)`` (None: the call's own)."""
        sizes = self.first_sizes(plan)
        return None if sizes is None else self._buckets(sizes)

    def compile_first(self, tree, plan, leaves) -> bool | None:
        """Compile the covering bucket of ``first_sizes(plan)`` now, so that
        this and later sizes run in it while their own buckets compile in the
        background: a first pass costs one compile in the foreground. None when
        there is none (the call compiles its own bucket); else whether this call
        compiled it. A covering bucket that cannot be traced (a size limit such
        as ``max_cases``, a primitive without a rule) turns covering buckets
        off for this runner: calls compile their own buckets (which fall back
        to exact shapes where they fail too)."""
        sizes = self.first_sizes(plan)
        if sizes is None:
            return None
        args = list(leaves)
        for i, p in enumerate(plan.leaves):
            if not p.static:
                args[i] = jax.ShapeDtypeStruct(padded_shape(p.axes, sizes),
                                                canonical_dtype(p.dtype))
        try:
            return self.compile_ahead(jax.tree_util.tree_unflatten(tree, args), plan)
        except Exception as e:  # noqa: BLE001 - the call's own bucket raises (or falls back)
            if self.replans(plan, e):  # the runner plans the call again
                raise
            self._off = True
            return None

    def compile_in_background(self, key, entry: Entry, make,
                              flat_args: Callable[[], list], repeated: bool = False) -> None:
        """Compile ``entry``'s program for ``flat_args()`` (the call's padded
        arguments: lowered, never run, so that the program's host callbacks,
        ``io_callback`` and ``jax.debug.print``, fire once per call as under
        ``jax.jit``) in the background, once per key, yielding to calls (see
        the module doc) unless ``repeated``: a shape called again while it
        waits for this compile (a shape that repeats gains from its own bucket
        at once, a burst of new shapes does not)."""
        if self.cache.is_pending(key):
            if repeated:
                self.cache.urge(key)
            return
        flat = flat_args()

        def job():
            try:
                return self.cache.precompile_entry(entry, make, flat, "background_compiles")
            except PerSizeBucket as e:  # (its sizes run per exact shape: no failure)
                entry.unshared = refusal_text(e)
                return False
            except Exception as e:  # calls keep the cover; never retried
                entry.unshared = refusal_text(e)
                raise

        self.cache.submit_once(key, job, defer=not repeated)
