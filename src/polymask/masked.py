"""The ``Masked`` pytree (padded array + logical shape), ``pad`` and ``stack``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import ShapeError

__all__ = ["Masked", "pad", "stack", "logical_shape", "Size"]

Size = Any  # a Python int (static size) or an integer scalar array (dynamic size)


def _is_static(s) -> bool:
    # Only Python ints are static; NumPy/JAX integer scalars are dynamic leaves.
    return isinstance(s, int) and not isinstance(s, bool)


class Masked:
    """A padded array plus its logical shape.

    Attributes:
      data: the padded array; its shape is the *bound*.
      shape: the logical size of each axis, ``0 <= shape[i] <= data.shape[i]``.
        A Python int is a static size; a JAX/NumPy integer array is dynamic
        (a pytree leaf, so ``jax.jit`` does not retrace when it changes and
        ``jax.vmap`` can batch it: data ``(B, ...)``, sizes ``(B,)``).

    The logical data is the leading corner ``data[:shape[0], :shape[1], ...]``;
    everything else is padding with unspecified content.
    """

    __slots__ = ("data", "shape")

    def __init__(self, data, shape: Sequence[Size] | None = None):
        self.data = data
        if shape is None:
            shape = tuple(int(d) for d in np.shape(data))
        self.shape = tuple(shape)

    @property
    def bound(self) -> tuple[int, ...]:
        """The padded shape (the physical ``data.shape``)."""
        return tuple(np.shape(self.data))

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def unpad(self) -> jax.Array | np.ndarray | list:
        """The logical data ``data[:n0, :n1, ...]`` (needs concrete sizes).

        For a ragged batch (``data`` has one more axis than ``shape`` and the
        sizes are ``(B,)`` arrays, as made by ``stack`` or returned by
        ``jax.vmap``), returns the list of the ``B`` unpadded examples.

        Raises:
          ShapeError: sizes are traced (inside ``jit``/``vmap``).
        """
        if self._is_ragged_batch():
            sizes = [np.asarray(s) for s in self.shape]
            return [self.data[i][tuple(slice(0, int(s[i])) for s in sizes)]
                    for i in range(np.shape(self.data)[0])]
        try:
            idx = tuple(slice(0, int(s)) for s in self.shape)
        except (TypeError, jax.errors.ConcretizationTypeError) as e:
            raise ShapeError(
                "Masked.unpad() needs concrete logical sizes; inside jit/vmap use "
                ".valid() with jnp.where instead") from e
        return self.data[idx]

    def _is_ragged_batch(self) -> bool:
        return (np.ndim(self.data) == len(self.shape) + 1 and len(self.shape) > 0
                and all(not _is_static(s) and np.ndim(s) == 1 for s in self.shape))

    def valid(self) -> jax.Array:
        """Boolean array of ``data.shape``: True on the logical corner."""
        bound = self.bound
        ok = jnp.ones(bound, dtype=bool)
        for axis, (s, b) in enumerate(zip(self.shape, bound)):
            if _is_static(s) and s == b:
                continue
            ok = ok & (jax.lax.broadcasted_iota(jnp.int32, bound, axis) < s)
        return ok

    def __repr__(self) -> str:
        return f"Masked(data={self.data!r}, shape={self.shape!r})"

    # pytree protocol: dynamic sizes are leaves, static sizes are aux data.
    def tree_flatten(self):
        dyn = tuple(i for i, s in enumerate(self.shape) if not _is_static(s))
        children = (self.data,) + tuple(self.shape[i] for i in dyn)
        static = tuple(None if i in dyn else s for i, s in enumerate(self.shape))
        return children, static

    @classmethod
    def tree_unflatten(cls, static, children):
        obj = object.__new__(cls)
        obj.data = children[0]
        sizes = iter(children[1:])
        obj.shape = tuple(next(sizes) if s is None else s for s in static)
        return obj


jax.tree_util.register_pytree_node(Masked, Masked.tree_flatten, Masked.tree_unflatten)


def pad(x, bound: Sequence[int] | int, *, fill: Any = 0, dynamic: bool = True) -> Masked:
    """Embed ``x`` in a buffer of shape ``bound``: ``Masked(buffer, x.shape)``.

    Args:
      x: array of shape ``S`` (any dtype).
      bound: padded shape (same rank, ``bound[i] >= S[i]``); an int pads only
        axis 0.
      fill: value of the padding (any value is allowed by the padding contract).
      dynamic: sizes become ``int32`` arrays (no retrace under ``jit``) when
        True, Python ints when False.

    Padding is done with NumPy on the host when ``x`` is a NumPy array, so it
    compiles nothing.

    Raises:
      ShapeError: rank mismatch or a size larger than its bound.
    """
    shape = tuple(np.shape(x))
    if isinstance(bound, (int, np.integer)):
        bound = (int(bound),) + shape[1:]
    bound = tuple(int(b) for b in bound)
    if len(bound) != len(shape):
        raise ShapeError(f"pad: bound {bound} has rank {len(bound)} but x has shape {shape}")
    for axis, (s, b) in enumerate(zip(shape, bound)):
        if s > b:
            raise ShapeError(f"pad: x.shape[{axis}] = {s} is larger than its bound {b}")
    widths = [(0, b - s) for s, b in zip(shape, bound)]
    if isinstance(x, np.ndarray) or np.isscalar(x):
        data = np.pad(np.asarray(x), widths, constant_values=fill)
    else:
        data = jnp.pad(x, widths, constant_values=fill)
    sizes = tuple(np.int32(s) for s in shape) if dynamic else shape
    return Masked(data, sizes)


def stack(arrays: Sequence[Any], bound: Sequence[int] | None = None,
          buckets=None, *, fill: Any = 0) -> Masked:
    """Stack examples of different shapes into a ragged batch.

    Args:
      arrays: ``B`` arrays of equal rank and dtype, shapes ``S_i``.
      bound: padded per-example shape; default: the elementwise max of the
        ``S_i``, rounded up by ``buckets`` when given.
      buckets: a bucketing policy (see ``polymask.buckets``) applied to each
        dynamic axis of the default bound.

    Returns:
      A *batched* ``Masked``: data ``(B, *bound)`` and ``shape`` a tuple of
      ``len(bound)`` int32 arrays of shape ``(B,)`` (the per-example sizes; the
      batch axis has no entry). ``jax.vmap(masked_fun)(batch)`` maps over it,
      and ``.unpad()`` returns the list of examples.

    Raises:
      ShapeError: no arrays, mixed ranks, or an example larger than ``bound``.
    """
    if len(arrays) == 0:
        raise ShapeError("stack: needs at least one array")
    nps = [np.asarray(a) for a in arrays]
    ranks = {a.ndim for a in nps}
    if len(ranks) != 1:
        raise ShapeError(f"stack: arrays have different ranks {sorted(ranks)}")
    shapes = np.array([a.shape for a in nps], dtype=np.int64).reshape(len(nps), -1)
    if bound is None:
        bound = tuple(int(m) for m in shapes.max(axis=0)) if shapes.size else ()
        if buckets is not None:
            from .plan import bucket_shape
            bound = bucket_shape(buckets, bound)
    bound = tuple(int(b) for b in bound)
    dtype = np.result_type(*nps)
    data = np.full((len(nps),) + bound, fill, dtype=dtype)
    for i, a in enumerate(nps):
        if any(s > b for s, b in zip(a.shape, bound)):
            raise ShapeError(f"stack: arrays[{i}].shape = {a.shape} exceeds the bound {bound}")
        data[(i,) + tuple(slice(0, s) for s in a.shape)] = a
    sizes = [shapes[:, k].astype(np.int32) for k in range(len(bound))]
    return _BatchedMasked(data, sizes)


def _BatchedMasked(data, sizes) -> Masked:
    # The batch axis has no logical size of its own: it is a vmap axis. We
    # represent a ragged batch as a Masked whose per-axis sizes are (B,) arrays.
    obj = object.__new__(Masked)
    obj.data = data
    obj.shape = tuple(sizes)
    return obj


def logical_shape(x) -> tuple:
    """Logical sizes of ``x`` as int32 values (or Python ints when static).

    Works on a ``Masked`` value and on a plain array (its shape), and inside a
    masked function (where ``x.shape`` is already symbolic and each size used
    as a number becomes the logical size).
    """
    if isinstance(x, Masked):
        return x.shape
    shape = np.shape(x)
    return tuple(jnp.asarray(d, jnp.int32) if not isinstance(d, int) else d for d in shape)
