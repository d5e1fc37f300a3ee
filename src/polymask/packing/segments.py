"""Rows of packed examples: the host's packing and the traced segment arrays.

An example of length ``n`` occupies ``n`` consecutive positions of one row
(its *segment*) and one of the row's ``S`` segment slots, followed by a
*gap* of ``G`` positions (``G`` is the program's: 0 unless it makes sizes
``n + c`` with ``c > 0``, e.g. ``jnp.pad``, or reads a window around each
position, e.g. a convolution). The segment and its gap are the example's
*region*. A value whose ragged axis has size ``n + c`` lives in the first
``n + c`` positions of each region (``Segments.at(c)``); the rest of the
region is *dead* for it. Positions after the last region are the row's
padding. Dead and padding positions have segment id ``S`` (out of range of
every segment reduction, so they never reach a result). The packed
interpreter selects every value's dead entries to 0 after each equation,
which is also the gradient gate there (``PackedRun.live_only``:
docs/packing.md, "The invariant"). The host fills padding positions with
copies of real positions (``pos`` repeats an example's, so a table indexed
by position is read in range), and slots no example uses alias a used one
(``alias``), so per-example values there are finite too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["Segments", "RowPacking", "pack_rows", "row_arrays", "phantom_source",
           "shift_along", "SEGMENT_FIELDS", "POSITION_FIELDS"]

# the per-row arrays a packed program takes, in this order
SEGMENT_FIELDS = ("seg", "region", "slot", "pos", "lengths", "starts", "alias")
# the fields with one entry per position (the others have one per slot)
POSITION_FIELDS = ("seg", "region", "slot", "pos")


@dataclasses.dataclass
class Segments:
    """One row's segments, as traced arrays (int32), for values whose ragged
    axis has size ``n + offset``.

    Attributes:
      seg: ``(R,)`` the segment slot of each live position; ``S`` for dead
        and padding positions.
      region: ``(R,)`` the slot whose region holds each position (its
        segment or its gap); ``S`` for the row's padding.
      slot: ``(R,)`` like ``region`` but padding positions name a used slot
        (gathers of per-segment values stay finite there).
      pos: ``(R,)`` position within its segment (restarts at each start);
        a dead position of a region repeats the segment's last one (a table
        read there stays in range), padding repeats the phantom's.
      rpos: ``(R,)`` position within its region, dead positions counted on.
      lengths, starts: ``(S,)`` each slot's length (``n + offset``) and first
        position.
      alias: ``(S,)`` a used slot for each slot (itself when used).
      R, S: positions per row and segment slots (Python ints).
      gap, offset: the program's gap ``G`` and this view's ``c`` (ints).
    """

    seg: jnp.ndarray
    region: jnp.ndarray
    slot: jnp.ndarray
    pos: jnp.ndarray
    lengths: jnp.ndarray
    starts: jnp.ndarray
    alias: jnp.ndarray
    R: int
    S: int
    gap: int = 0
    offset: int = 0
    rpos: jnp.ndarray | None = None
    base: Segments | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.rpos is None:
            self.rpos = self.pos

    @classmethod
    def from_arrays(cls, arrays, gap: int = 0) -> Segments:
        """From the arrays of ``SEGMENT_FIELDS`` (in that order): the view of
        values of size ``n`` (offset 0)."""
        seg, region, slot, pos, lengths, starts, alias = arrays
        return cls(seg, region, slot, pos, lengths, starts, alias, seg.shape[0],
                   lengths.shape[0], int(gap)).at(0)

    def arrays(self) -> tuple:
        """The row's arrays (``SEGMENT_FIELDS``), as ``from_arrays`` takes them."""
        base = self.base or self
        return tuple(getattr(base, f) for f in SEGMENT_FIELDS)

    def at(self, offset: int) -> Segments:
        """The view for values whose ragged axis has size ``n + offset``: their
        segments are the first ``n + offset`` positions of each region."""
        base = self.base or self
        if base.gap == 0 and offset == 0:  # no dead positions: the row's arrays
            return base
        lengths = jnp.maximum(base.lengths + offset, 0)
        in_region = base.region < base.S
        live = in_region & (base.rpos < lengths[base.slot])
        seg = jnp.where(live, base.region, base.S).astype(base.seg.dtype)
        last = jnp.maximum(lengths[base.slot] - 1, 0)
        pos = jnp.where(in_region & ~live, jnp.minimum(base.rpos, last), base.rpos)
        return Segments(seg, base.region, base.slot, pos.astype(base.pos.dtype), lengths,
                        base.starts, base.alias, base.R, base.S, base.gap, offset, base.rpos,
                        base)

    def single(self, slot) -> tuple:
        """The row's arrays (``SEGMENT_FIELDS``) seen by one example: slot
        ``slot`` (traced) is the row's only segment, every other position is
        padding (``S = 1``). A scan step along the packed axis runs its body
        in this view: packed values it reads (dynamax's ``log_likelihoods[t]``)
        are read within the step's own example."""
        base = self.base or self
        own = lambda ids: jnp.where(ids == slot, 0, 1).astype(ids.dtype)  # noqa: E731
        one = lambda v: lax.dynamic_slice_in_dim(v, slot, 1)  # noqa: E731
        return (own(base.seg), own(base.region), jnp.zeros_like(base.slot), base.pos,
                one(base.lengths), one(base.starts), jnp.zeros((1,), base.alias.dtype))

    @property
    def live(self):
        """``(R,)`` bool: the positions in a segment of this view."""
        return self.seg < self.S

    def along(self, ids, axis: int, ndim: int):
        """``ids`` (``(R,)``) shaped to broadcast along ``axis`` of a rank-``ndim`` array."""
        shape = [1] * ndim
        shape[axis] = self.R
        return ids.reshape(shape)

    def same_segment(self, axes: Sequence[int], shape: Sequence[int],
                     views: Sequence[Segments] | None = None):
        """Where every axis of ``axes`` (packed axes of an array of ``shape``)
        is in the same segment: the valid entries of a block-diagonal value
        (None for fewer than two axes: every entry is valid). ``views``: each
        axis's view when their sizes differ (``n`` and ``n - 1``), else this one."""
        axes = list(axes)
        if len(axes) < 2:
            return None
        views = list(views) if views is not None else [self] * len(axes)
        ndim = len(shape)
        ref = self.along(views[0].seg, axes[0], ndim)
        ok = None
        for a, v in zip(axes[1:], views[1:]):
            eq = ref == self.along(v.seg, a, ndim)
            ok = eq if ok is None else ok & eq
        return jnp.broadcast_to(ok, tuple(shape))

    def to_positions(self, per_segment, fill_padding: bool = False):
        """Per-segment values ``(S, ...)`` at each position: ``(R, ...)``."""
        return jnp.take(per_segment, self.seg if fill_padding else self.slot, axis=0,
                        mode="fill" if fill_padding else "clip",
                        fill_value=0 if fill_padding else None)

    def segment_reduce(self, x, kind: str):
        """Reduce ``x`` (``(R, ...)``) per segment -> ``(S, ...)``; unused slots
        take their alias's value. ``kind``: sum, max, min, prod."""
        import jax

        fns = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max,
               "min": jax.ops.segment_min, "prod": jax.ops.segment_prod}
        # a scatter-add rounds to the dtype at every update: 1000 bfloat16 ones
        # sum to 256. XLA's own reductions and dots of bfloat16 / float16
        # accumulate in float32 (what plain JAX computes), so these do too
        # (and bool, which scatters do not take: in int32, > 0 = True, so a sum or
        # max is an or and a product or min an and, an empty segment's identity
        # included, as a bool dot or reduction is)
        if kind == "prod" and jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.take(self._segment_product(x), self.alias, axis=0)
        if x.dtype == jnp.bool_:
            out = fns[kind](x.astype(jnp.int32), self.seg, num_segments=self.S) > 0
        elif kind in ("sum", "prod") and x.dtype in (jnp.bfloat16, jnp.float16):
            out = fns[kind](x.astype(jnp.float32), self.seg,
                            num_segments=self.S).astype(x.dtype)
        else:
            out = fns[kind](x, self.seg, num_segments=self.S)
        return jnp.take(out, self.alias, axis=0)

    def _segment_product(self, x):
        """The product of ``x`` (``(R, ...)``) per segment -> ``(S, ...)``: the
        segmented cumulative product at each segment's last position (1 for
        an empty one). JAX's scatter-multiply (``segment_prod``) has no
        gradient unless its indices are unique; a scan's is JAX's own. bfloat16
        and float16 multiply in float32, as ``segment_reduce`` sums them."""
        low = x.dtype in (jnp.bfloat16, jnp.float16)
        scan = self.segmented_scan(x.astype(jnp.float32) if low else x, lax.mul, 0, False)
        last = jnp.clip(self.starts + self.lengths - 1, 0, self.R - 1)
        nonempty = (self.lengths > 0).reshape((-1,) + (1,) * (x.ndim - 1))
        out = jnp.where(nonempty, jnp.take(scan, last, axis=0), jnp.ones((), scan.dtype))
        return out.astype(x.dtype)

    def segmented_scan(self, x, combine, axis: int, reverse: bool):
        """Inclusive scan of ``x`` along its packed ``axis`` that restarts at
        every segment start (``combine(a, b)``: the scan's binary op)."""
        ids = jnp.broadcast_to(self.along(self.seg, axis, x.ndim), x.shape)

        def op(a, b):
            (xa, sa), (xb, sb) = a, b
            return lax.select(sa == sb, combine(xa, xb), xb), sb

        out, _ = lax.associative_scan(op, (x, ids), reverse=reverse, axis=axis)
        return out


def shift_along(x, s: int, axis: int):
    """``out[p] = x[p + s]`` along ``axis`` (a row's positions), positions
    past either end reading the edge (real, finite data). Slices and
    concatenations, no gather."""
    R = x.shape[axis]
    if s == 0 or R == 0:
        return x
    s = max(-(R - 1), min(R - 1, s))  # further, every position reads the edge
    if s > 0:
        body = lax.slice_in_dim(x, s, R, axis=axis)
        edge = lax.slice_in_dim(x, R - 1, R, axis=axis)
        return lax.concatenate([body, jnp.repeat(edge, s, axis=axis)], axis)
    body = lax.slice_in_dim(x, 0, R + s, axis=axis)
    edge = lax.slice_in_dim(x, 0, 1, axis=axis)
    return lax.concatenate([jnp.repeat(edge, -s, axis=axis), body], axis)


@dataclasses.dataclass
class RowPacking:
    """Where each example went: ``rows[r]`` lists ``(example index, start)``;
    ``slot_of[i] = (row, slot)``; ``row_size``/``slots`` are R and S."""

    rows: list[list[tuple[int, int]]]
    slot_of: dict[int, tuple[int, int]]
    row_size: int
    slots: int
    gap: int = 0

    def used_positions(self, lengths: Sequence[int]) -> int:
        return sum(lengths[i] for row in self.rows for i, _ in row)


def pack_rows(lengths: Sequence[int], row_size: int, slots: int, gap: int = 0) -> RowPacking:
    """First-fit decreasing: each example (longest first) goes to the first row
    with room for its region (its length and ``gap`` positions) and a free
    slot (bin packing's FFD, within 11/9 of the fewest rows). Rows have
    ``row_size + gap`` positions; every length must be ``<= row_size``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[tuple[int, int]]] = []
    fill: list[int] = []
    room = row_size + gap
    free = _FirstFit()  # each row's free positions (-1 once its slots are taken)
    for i in order:
        n = int(lengths[i]) + gap
        r = free.first(n)
        if r is None:
            r = len(rows)
            rows.append([])
            fill.append(0)
        rows[r].append((i, fill[r]))
        fill[r] += n
        free.set(r, room - fill[r] if len(rows[r]) < slots else -1)
    slot_of = {i: (r, s) for r, row in enumerate(rows) for s, (i, _) in enumerate(row)}
    return RowPacking(rows, slot_of, int(row_size), int(slots), int(gap))


class _FirstFit:
    """The first row with at least ``n`` free positions, in O(log rows): a max
    segment tree over the rows' free positions (many short examples made the
    scan of every row for every example quadratic: 8 s for 20,000)."""

    def __init__(self) -> None:
        self.size = 1
        self.tree = [-1, -1]  # tree[size + r]: row r's free positions

    def set(self, r: int, free: int) -> None:
        while r >= self.size:  # double the leaves
            leaves = self.tree[self.size:] + [-1] * self.size
            self.size *= 2
            self.tree = [-1] * self.size + leaves
            for k in range(self.size - 1, 0, -1):
                self.tree[k] = max(self.tree[2 * k], self.tree[2 * k + 1])
        k = self.size + r
        self.tree[k] = free
        k //= 2
        while k:
            self.tree[k] = max(self.tree[2 * k], self.tree[2 * k + 1])
            k //= 2

    def first(self, n: int) -> int | None:
        if self.tree[1] < n:
            return None
        k = 1
        while k < self.size:
            k = 2 * k if self.tree[2 * k] >= n else 2 * k + 1
        return k - self.size


def phantom_source(row: Sequence[tuple[int, int]], lengths, fallback=None):
    """The example whose data the row's unused tail repeats (the phantom
    example): the row's first non-empty one, else ``fallback`` (the call's)."""
    for i, _ in row:
        if lengths[i] > 0:
            return i
    return fallback


def row_arrays(row: Sequence[tuple[int, int]], lengths: Sequence[int], R: int,
               S: int, phantom_len: int = 0, gap: int = 0) -> dict[str, np.ndarray]:
    """The segment arrays of one row of ``R`` positions (``SEGMENT_FIELDS``),
    NumPy int32; each example's region is its length and ``gap`` positions.

    ``phantom_len``: the length of the example the unused tail repeats
    (``phantom_source``): its positions repeat that example's, so a table
    indexed by position (position embeddings) is read in range there too
    (out-of-range reads fill NaN, and ``0 * nan`` in a block-diagonal product
    would reach the real examples)."""
    seg = np.full(R, S, np.int32)
    region = np.full(R, S, np.int32)
    pos = np.zeros(R, np.int32)
    lens = np.zeros(S, np.int32)
    starts = np.zeros(S, np.int32)
    end = 0
    for s, (i, start) in enumerate(row):
        n = int(lengths[i])
        seg[start:start + n] = s
        region[start:start + n + gap] = s
        pos[start:start + n + gap] = np.arange(n + gap)
        lens[s], starts[s] = n, start
        end = max(end, start + n + gap)
    pos[end:] = np.arange(R - end) % max(int(phantom_len), 1)  # the phantom's positions
    used = len(row)
    nonempty = [s for s in range(used) if lens[s] > 0]
    target = nonempty[0] if nonempty else 0
    alias = np.arange(S, dtype=np.int32)
    alias[used:] = target
    lens[used:] = lens[target]
    starts[used:] = starts[target]
    slot = np.where(region == S, target, region).astype(np.int32)
    return {"seg": seg, "region": region, "slot": slot, "pos": pos, "lengths": lens, "starts": starts,
            "alias": alias}
