"""``jnp`` indexing on arrays with symbolic sizes, during a masked trace.

- Static indexing (``x[:, 1]``, ``x[..., :2]``, ``qkv[0]``) of an array whose
  shape has a dim var is lowered as a ``gather`` (``NDIndexer.to_static_slice``
  refuses any symbolic shape), where concrete shapes give a ``slice``. An index
  that touches only static axes, every symbolic axis taken whole (``:`` or
  ``...``), is built as the static slice it is for concrete shapes: the same
  values, a smaller program without gathers (``static_slice_of_static_axes``).
- A scalar integer index (a traced int, ``y[i]`` of ``(n, m)``) with every
  other symbolic axis taken whole is built as the ``dynamic_slice`` it is for
  concrete shapes (``NDIndexer.to_dynamic_slice`` cannot compute a symbolic
  axis' slice), not a ``gather``: they differ at an index out of bounds,
  which ``dynamic_slice`` clamps in the gradient too, where a gather's
  transpose drops it (``dynamic_slice_of_whole_symbolic_axes``); next to a
  slice of part of a symbolic axis (``y[i, 1:]``) the integers are
  dynamically sliced first, the rest indexed after (``_scalar_indices_first``).
- A size as an integer index (``s[s.shape[0] - 1]``, ``x.at[n - 1].set(v)``),
  which JAX rejects, indexes as a traced int (``sizes_as_indices``,
  ``sizes_as_update_indices``).

(jax ``_src/numpy/indexing.py``, ``rewriting_take``.)
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax import lax
from jax import numpy as jnp
from jax._src import core
from jax._src.numpy import indexing as _indexing
from jax._src.ops import scatter as _scatter

__all__ = ["static_slice_of_static_axes", "dynamic_slice_of_whole_symbolic_axes",
           "sizes_as_indices", "sizes_as_update_indices", "INDEXING", "SCATTER"]

# a stand-in for each symbolic size: larger than any static index or slice
# bound the index can hold, so JAX's own computation gives (0, SENTINEL, 1)
# for a whole axis, recognisably
_SENTINEL = 2**62 + 7
# the same for a dynamic slice, within int32 (JAX picks the start indices'
# dtype by the largest static size: the program's, not int64)
_SENTINEL32 = 2**31 - 17


def _symbolic_axes_taken_whole(indexer) -> bool:
    sym = {i for i, s in enumerate(indexer.shape) if core.is_symbolic_dim(s)}
    for p in indexer.indices:
        if not sym.intersection(p.consumed_axes):
            continue
        if p.typ == _indexing.IndexType.ELLIPSIS:
            continue
        if p.typ == _indexing.IndexType.SLICE and p.index == slice(None):
            continue
        return False
    return True


def static_slice_of_static_axes(orig):
    """``NDIndexer.to_static_slice`` (``orig``) that also accepts symbolic
    shapes when only static axes are indexed; any other index goes to
    ``orig``. ``splits.trace_hooks`` installs it for a masked trace only. An
    unexpected result raises ``ValueError``, which ``rewriting_take`` takes as
    "no static slice" and falls back to its gather."""

    def to_static_slice(self, **kwargs):
        sym = [i for i, s in enumerate(self.shape) if core.is_symbolic_dim(s)]
        if not sym or not _symbolic_axes_taken_whole(self):
            return orig(self, **kwargs)
        fake = tuple(_SENTINEL if i in sym else s for i, s in enumerate(self.shape))
        res = orig(dataclasses.replace(self, shape=fake), **kwargs)
        starts, limits = list(res.start_indices), list(res.limit_indices)
        for i in sym:  # each symbolic axis: the whole axis, (0, size) with stride 1
            if (starts[i], limits[i]) != (0, _SENTINEL) or (res.strides and res.strides[i] != 1):
                raise ValueError("polymask: unexpected static slice of a symbolic axis")
            limits[i] = self.shape[i]
        return res._replace(limit_indices=limits)

    return to_static_slice


def _whole_axes(indexer, axes) -> set:
    """Those of ``axes`` that ``indexer`` takes whole (``:`` or ``...``), or
    None where one of them is indexed otherwise."""
    whole = set()
    for p in indexer.indices:
        hit = set(axes).intersection(p.consumed_axes)
        if not hit:
            continue
        if p.typ == _indexing.IndexType.ELLIPSIS or (
                p.typ == _indexing.IndexType.SLICE and p.index == slice(None)):
            whole |= hit
        else:
            return None
    return whole | (set(axes) - {a for p in indexer.indices for a in p.consumed_axes})


def dynamic_slice_of_whole_symbolic_axes(orig):
    """``NDIndexer.to_dynamic_slice`` (``orig``) that also accepts symbolic
    sizes on the axes taken whole (``y[i]``, ``y[:, i]`` of ``(n, m)``):
    those get a stand-in size for JAX's computation and their own size back
    in the slice. An axis indexed by an integer keeps its size (JAX's check
    that it is not empty is a comparison the masked trace decides or splits
    on); any other index goes to ``orig`` (its gather)."""

    def to_dynamic_slice(self, **kwargs):
        sym = [i for i, s in enumerate(self.shape) if core.is_symbolic_dim(s)]
        scalar = [i for p in self.indices if p.typ in (_indexing.IndexType.INTEGER,
                                                       _indexing.IndexType.ARRAY)
                  for i in p.consumed_axes]
        whole = _whole_axes(self, [i for i in sym if i not in scalar]) if sym else None
        if not whole:
            return orig(self, **kwargs)
        fake = tuple(_SENTINEL32 if i in whole else s for i, s in enumerate(self.shape))
        res = orig(dataclasses.replace(self, shape=fake), **kwargs)
        sizes = list(res.slice_sizes)
        for i in whole:  # the whole axis (from 0: a size of the stand-in), its own size
            if sizes[i] != _SENTINEL32:
                raise ValueError("polymask: unexpected dynamic slice of a symbolic axis")
            sizes[i] = self.shape[i]
        return res._replace(slice_sizes=sizes)

    return to_dynamic_slice


NDINDEXER = _indexing.NDIndexer


INDEXING = _indexing  # (its rewriting_take: ``sizes_as_indices`` replaces it in a trace)
SCATTER = _scatter  # (its _scatter_update: ``sizes_as_update_indices``)


def sizes_as_indices(orig):
    """``indexing.rewriting_take`` (``orig``) that takes a size as an integer
    index: ``s[s.shape[0] - 1]``, ``jnp.sort(s)[s.shape[0] // 2]``,
    ``x[..., x.shape[-1] - 1]``. JAX rejects a symbolic size there ("only
    integers ... are valid indices"); plain JAX, given the exact arrays, has
    an int, which it normalizes and clamps as it does a traced int, except on
    an empty axis (an ``IndexError``, where JAX validates static indices:
    ``mode`` None or ``"promise_in_bounds"``): that is checked here (a
    comparison of sizes, which a masked trace decides or splits on), then the
    size indexes as a traced int."""

    def rewriting_take(arr, idx, *args, **kwargs):
        mode = str(kwargs.get("mode")).lower()
        check = mode == "none" or mode.endswith("promise_in_bounds")
        idx = _size_indices_as_values(np.shape(arr), idx, check)
        if check or mode.endswith("clip"):
            arr, idx = _scalar_indices_first(arr, idx)
        return orig(arr, idx, *args, **kwargs)

    return rewriting_take


def _scalar_int(i) -> bool:
    if isinstance(i, (bool, np.bool_)):
        return False
    if isinstance(i, (int, np.integer)):
        return True
    dtype = getattr(i, "dtype", None)
    return dtype is not None and np.ndim(i) == 0 and np.issubdtype(dtype, np.integer)


def _scalar_indices_first(arr, idx):
    """``(arr, idx)``, or where ``idx`` holds scalar integers next to a slice
    of a symbolic axis that is not the whole axis (``y[i, 1:]``, ``y[1:, -1]``
    of ``(n, m)``): ``arr`` dynamically sliced at those integers first, as
    the ``dynamic_slice`` plain JAX builds for them with concrete shapes
    (normalized, clamped into the axis, in the gradient too), and ``idx``
    with 0 in their place. JAX gathers there instead (it cannot compute a
    symbolic axis' slice for a ``dynamic_slice``), whose gradient drops an
    index out of bounds that plain JAX clamps."""
    shape = np.shape(arr)
    items = idx if isinstance(idx, tuple) else (idx,)
    if not any(core.is_symbolic_dim(d) for d in shape) or any(
            not (_scalar_int(i) or isinstance(i, slice) or i is None or i is Ellipsis)
            for i in items):
        return arr, idx
    axes = _axes_indexed(items, len(shape))
    if axes is None or not any(_scalar_int(i) for i in items) or not any(
            isinstance(i, slice) and i != slice(None) and core.is_symbolic_dim(shape[a])
            for a, i in zip(axes, items)):
        return arr, idx
    out = []
    for axis, i in zip(axes, items):
        if _scalar_int(i):
            size = shape[axis]
            if size == 0:  # (plain JAX: no dynamic slice of an empty axis)
                raise IndexError(f"index is out of bounds for axis {axis} with size 0")
            i = jnp.asarray(i)
            n = core.dimension_as_value(size) if core.is_symbolic_dim(size) else size
            n = jnp.asarray(n, i.dtype)
            # normalized once, then clamped into the axis (lax.dynamic_slice would
            # wrap a still negative start again: y[-4] of 3 rows is row 0)
            i = lax.clamp(jnp.zeros((), i.dtype), lax.select(i < 0, i + n, i), n - 1)
            arr = lax.dynamic_slice_in_dim(arr, i, 1, axis)
            i = 0
        out.append(i)
    return arr, tuple(out) if isinstance(idx, tuple) else out[0]


def sizes_as_update_indices(orig):
    """``scatter._scatter_update`` (``orig``, behind ``x.at[idx].set/add/...``)
    that takes a size as an integer index, as ``sizes_as_indices``; plain JAX
    drops an update out of bounds, on an empty axis too (no check)."""

    def scatter_update(x, idx, *args, **kwargs):
        return orig(x, _size_indices_as_values(np.shape(x), idx, False), *args, **kwargs)

    return scatter_update


def _size_indices_as_values(shape, idx, check_empty: bool):
    items = idx if isinstance(idx, tuple) else (idx,)
    if not any(core.is_symbolic_dim(i) for i in items):
        return idx
    axes = _axes_indexed(items, len(shape))
    if axes is None:
        return idx  # (more indices than axes: JAX's own error stands)
    out = []
    for axis, i in zip(axes, items):
        if core.is_symbolic_dim(i):
            if check_empty and shape[axis] == 0:
                # (plain JAX clamps a static index, except on an empty axis)
                raise IndexError(f"index is out of bounds for axis {axis} with size 0")
            i = core.dimension_as_value(i)
        out.append(i)
    return tuple(out) if isinstance(idx, tuple) else out[0]


def _axes_indexed(items, ndim: int):
    """The array axis each index item starts at (NumPy's rules: ``None``
    takes none, ``...`` the axes the others leave, a boolean array as many
    as its rank, anything else one), or None where they exceed ``ndim``."""
    def taken(i):
        if i is None or i is Ellipsis:
            return 0
        return np.ndim(i) if _is_bool_array(i) else 1

    rest = ndim - sum(taken(i) for i in items)
    if rest < 0 or sum(i is Ellipsis for i in items) > 1:
        return None
    axes, at = [], 0
    for i in items:
        axes.append(at)
        at += rest if i is Ellipsis else taken(i)
    return axes


def _is_bool_array(i) -> bool:
    dtype = getattr(i, "dtype", None)
    return dtype is not None and np.issubdtype(dtype, np.bool_)
