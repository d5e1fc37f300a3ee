"""Rows of packed examples: the host's packing and the traced segment arrays.

An example of length ``n`` occupies ``n`` consecutive positions of one row
(its *segment*) and one of the row's ``S`` segment slots. Positions after
the last segment are the row's padding: segment id ``S`` (out of range of
every segment reduction, so they never reach a result). Their data is a copy
of real data (``fill_padding_positions``), and slots no example uses alias a
used one (``alias``): every lane of the computation then looks like a real
example, so nothing there turns into ``inf``/``nan`` that a gradient could
carry into shared parameters (``0 * inf``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["Segments", "RowPacking", "pack_rows", "row_arrays", "phantom_source",
           "SEGMENT_FIELDS"]

# the per-row arrays a packed program takes, in this order
SEGMENT_FIELDS = ("seg", "slot", "pos", "lengths", "starts", "alias")


@dataclasses.dataclass
class Segments:
    """One row's segments, as traced arrays (int32).

    Attributes:
      seg: ``(R,)`` the segment slot of each position; ``S`` for padding.
      slot: ``(R,)`` like ``seg`` but padding positions name a used slot
        (gathers of per-segment values stay finite there).
      pos: ``(R,)`` position within its segment (restarts at each start).
      lengths, starts: ``(S,)`` each slot's length and first position.
      alias: ``(S,)`` a used slot for each slot (itself when used).
      R, S: row size and segment slots (Python ints).
    """

    seg: jnp.ndarray
    slot: jnp.ndarray
    pos: jnp.ndarray
    lengths: jnp.ndarray
    starts: jnp.ndarray
    alias: jnp.ndarray
    R: int
    S: int

    @classmethod
    def from_arrays(cls, arrays) -> Segments:
        """From the arrays of ``SEGMENT_FIELDS`` (in that order)."""
        seg, slot, pos, lengths, starts, alias = arrays
        return cls(seg, slot, pos, lengths, starts, alias, seg.shape[0], lengths.shape[0])

    def arrays(self) -> tuple:
        return tuple(getattr(self, f) for f in SEGMENT_FIELDS)

    def along(self, ids, axis: int, ndim: int):
        """``ids`` (``(R,)``) shaped to broadcast along ``axis`` of a rank-``ndim`` array."""
        shape = [1] * ndim
        shape[axis] = self.R
        return ids.reshape(shape)

    def same_segment(self, axes: Sequence[int], shape: Sequence[int]):
        """Where every axis of ``axes`` (packed axes of an array of ``shape``)
        is in the same segment: the valid entries of a block-diagonal value
        (None for fewer than two axes: every entry is valid)."""
        axes = list(axes)
        if len(axes) < 2:
            return None
        ndim = len(shape)
        ref = self.along(self.seg, axes[0], ndim)
        ok = None
        for a in axes[1:]:
            eq = ref == self.along(self.seg, a, ndim)
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
        out = fns[kind](x, self.seg, num_segments=self.S)
        return jnp.take(out, self.alias, axis=0)

    def segmented_scan(self, x, combine, axis: int, reverse: bool):
        """Inclusive scan of ``x`` along its packed ``axis`` that restarts at
        every segment start (``combine(a, b)``: the scan's binary op)."""
        ids = jnp.broadcast_to(self.along(self.seg, axis, x.ndim), x.shape)

        def op(a, b):
            (xa, sa), (xb, sb) = a, b
            return lax.select(sa == sb, combine(xa, xb), xb), sb

        out, _ = lax.associative_scan(op, (x, ids), reverse=reverse, axis=axis)
        return out


@dataclasses.dataclass
class RowPacking:
    """Where each example went: ``rows[r]`` lists ``(example index, start)``;
    ``slot_of[i] = (row, slot)``; ``row_size``/``slots`` are R and S."""

    rows: list[list[tuple[int, int]]]
    slot_of: dict[int, tuple[int, int]]
    row_size: int
    slots: int

    def used_positions(self, lengths: Sequence[int]) -> int:
        return sum(lengths[i] for row in self.rows for i, _ in row)


def pack_rows(lengths: Sequence[int], row_size: int, slots: int) -> RowPacking:
    """First-fit decreasing: each example (longest first) goes to the first row
    with room for its length and a free slot (bin packing's FFD, within
    11/9 of the fewest rows). Every length must be ``<= row_size``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[tuple[int, int]]] = []
    fill: list[int] = []
    for i in order:
        n = int(lengths[i])
        for r, used in enumerate(fill):
            if used + n <= row_size and len(rows[r]) < slots:
                rows[r].append((i, used))
                fill[r] += n
                break
        else:
            rows.append([(i, 0)])
            fill.append(n)
    slot_of = {i: (r, s) for r, row in enumerate(rows) for s, (i, _) in enumerate(row)}
    return RowPacking(rows, slot_of, int(row_size), int(slots))


def phantom_source(row: Sequence[tuple[int, int]], lengths, fallback=None):
    """The example whose data the row's unused tail repeats (the phantom
    example): the row's first non-empty one, else ``fallback`` (the call's)."""
    for i, _ in row:
        if lengths[i] > 0:
            return i
    return fallback


def row_arrays(row: Sequence[tuple[int, int]], lengths: Sequence[int], R: int,
               S: int, phantom_len: int = 0) -> dict[str, np.ndarray]:
    """The segment arrays of one row (``SEGMENT_FIELDS``), NumPy int32.

    ``phantom_len``: the length of the example the unused tail repeats
    (``phantom_source``): its positions repeat that example's, so a table
    indexed by position (position embeddings) is read in range there too
    (out-of-range reads fill NaN, and ``0 * nan`` in a block-diagonal product
    would reach the real examples)."""
    seg = np.full(R, S, np.int32)
    pos = np.zeros(R, np.int32)
    lens = np.zeros(S, np.int32)
    starts = np.zeros(S, np.int32)
    end = 0
    for s, (i, start) in enumerate(row):
        n = int(lengths[i])
        seg[start:start + n] = s
        pos[start:start + n] = np.arange(n)
        lens[s], starts[s] = n, start
        end = max(end, start + n)
    pos[end:] = np.arange(R - end) % max(int(phantom_len), 1)  # the phantom's positions
    used = len(row)
    nonempty = [s for s in range(used) if lens[s] > 0]
    target = nonempty[0] if nonempty else 0
    alias = np.arange(S, dtype=np.int32)
    alias[used:] = target
    lens[used:] = lens[target]
    starts[used:] = starts[target]
    slot = np.where(seg == S, target, seg).astype(np.int32)
    return {"seg": seg, "slot": slot, "pos": pos, "lengths": lens, "starts": starts,
            "alias": alias}
