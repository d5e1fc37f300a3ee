"""The ``Masked`` pytree (padded array + logical shape), ``pad`` and ``stack``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .diagnostics import at_user_line, names_the_user_line
from .errors import ShapeError, counted
from .plan import bucket_shape

__all__ = ["Masked", "pad", "stack", "logical_shape", "Size"]

Size = Any  # a Python int (static size) or an integer scalar array (dynamic size)


def _is_static(s) -> bool:
    # Only Python ints are static; NumPy/JAX integer scalars are dynamic leaves.
    return isinstance(s, int) and not isinstance(s, bool)


def _concrete(s):
    """NumPy value of a size, or None when it is traced (inside jit/vmap)."""
    if _is_static(s):
        return np.asarray(s)
    if isinstance(s, jax.core.Tracer):
        return None
    try:
        return np.asarray(s)
    except Exception:
        return None


def _check_size_value(s, what: str) -> None:
    """A size must be an integer (Python int or integer array), not bool/float."""
    if isinstance(s, (bool, np.bool_)) or isinstance(s, (float, complex, np.inexact)):
        raise TypeError(f"{what}: a logical size must be an integer; got {s!r}")
    dtype = getattr(s, "dtype", None)
    if not _is_static(s) and not isinstance(s, np.integer):
        if dtype is None or not np.issubdtype(np.dtype(dtype), np.integer):
            raise TypeError(f"{what}: a logical size must be an integer (a Python int or an "
                            f"integer array); got {s!r}")


def _validate_sizes(sizes: tuple, bound: tuple, what: str) -> None:
    """Rank, type and range ``0 <= size <= bound`` of concrete logical sizes.

    Traced sizes are left to the prologue of ``mask`` (which checks them at
    run time). A batch (``k = len(bound) - len(sizes)`` leading batch axes,
    sizes static or arrays of per-example sizes) is checked per example.
    """
    k = len(bound) - len(sizes)
    if k < 0:
        raise ShapeError(f"{what}: logical shape {sizes} has {counted(len(sizes), 'axis')} but the data "
                         f"has shape {bound} (rank {len(bound)})")
    per_axis = bound[k:]
    for axis, (s, b) in enumerate(zip(sizes, per_axis)):
        _check_size_value(s, f"{what}: shape[{axis}]")
        v = _concrete(s)
        if v is None:
            continue
        if v.size and (v.min() < 0 or v.max() > b):
            bad = v.min() if v.min() < 0 else v.max()
            raise ShapeError(f"{what}: shape[{axis}] = {v.tolist()} is outside [0, {b}] "
                             f"(the padded size of axis {axis}); sizes count elements from "
                             "the start, they are not Python slice ends"
                             + (" (negative)" if bad < 0 else "")
                             + ("; -1 marks the result of a masked call whose size check "
                                "failed (mask(..., checks='functional'))" if bad == -1 else ""))


_INT32 = np.iinfo(np.int32)


def _check_fits_int32(sizes: tuple, bound: tuple) -> None:
    """A NumPy size of a wider type (int64, uint32, uint64) must fit int32.

    Raises:
      ShapeError: it does not (``jax.jit`` converts such an argument to int32,
        wrapping it: a size of 2**32 + 3 would run as 3).
    """
    k = len(bound) - len(sizes)  # (a batch's leading axes; sizes of the others)
    for axis, s in enumerate(sizes):
        if isinstance(s, (np.integer, np.ndarray)) and s.dtype.kind in "iu" and (
                s.dtype.itemsize > 4 or s.dtype.kind == "u" and s.dtype.itemsize == 4):
            v = np.asarray(s)
            if v.size and (v.max() > _INT32.max or v.min() < _INT32.min):
                bad = v.max() if v.max() > _INT32.max else v.min()
                within = f"is outside [0, {bound[k + axis]}] (the padded size) and " \
                    if k >= 0 else ""
                raise at_user_line(ShapeError(
                    f"Masked: shape[{axis}] = {bad} ({s.dtype}) {within}does not fit int32, "
                    "to which jax.jit converts a size (wrapping it)"))


def _sizes_of_array(sizes, data) -> tuple:
    """A logical shape given as one integer array: its last axis runs over the
    data's axes (``(r,)`` for one example of rank ``r``, ``(B, r)`` for a
    batch of ``B``: one ``(B,)`` size array per axis, which ``jax.vmap``
    maps); a 0-d array is the size of a rank-1 example."""
    if sizes.ndim == 0:
        return (sizes,)
    rank = len(np.shape(data)) if not hasattr(data, "ndim") else data.ndim
    r = sizes.shape[-1]
    # (r,) is one example's shape: all its axes. Fewer sizes would be a batch
    # sharing them, which vmap cannot map: most likely a batch's sizes meant
    # as (sizes,).
    if r > rank or (sizes.ndim == 1 and r != rank):
        raise at_user_line(ShapeError(
            f"Masked: the logical shape is an array of shape {tuple(sizes.shape)}, read as "
            f"{r} sizes (its last axis, one per axis of the example), but the data has rank "
            f"{rank}; a ragged batch takes its sizes as a tuple with one array per axis, "
            f"e.g. Masked(data, (sizes,)) for a batch of rank-1 examples, or as one "
            f"(B, r) array for examples of rank r"))
    out = (tuple(sizes[i] for i in range(r)) if sizes.ndim == 1
           else tuple(sizes[..., i] for i in range(r)))
    try:  # concrete sizes are checked here: an out-of-range one is likely a batch's sizes
        _validate_sizes(out, tuple(np.shape(data)), "Masked")
    except ShapeError as e:
        raise at_user_line(ShapeError(
            f"{e}; the logical shape is an array of shape {tuple(sizes.shape)}, read as one "
            f"size per axis of the example on its last axis: a ragged batch of rank-1 "
            f"examples takes its sizes as a tuple, Masked(data, (sizes,))")) from None
    return out


class Masked:
    """A padded array plus its logical shape (``unpad()`` gives the exact array;
    reading a Masked value as an array, ``np.asarray``, ``float``, ``bool``,
    arithmetic, raises TypeError, except a rank-0 value, which has no padding).

    Attributes:
      data: the padded array; its shape is the *bound*.
      shape: the logical size of each axis, ``0 <= shape[i] <= data.shape[i]``.
        A Python int is a static size; a JAX/NumPy integer array is dynamic
        (a pytree leaf, so ``jax.jit`` does not retrace when it changes and
        ``jax.vmap`` can batch it: data ``(B, ...)``, sizes ``(B,)``). The
        shape may also be given as one integer array whose last axis runs over
        the data's axes: ``(r,)``, or ``(B, r)`` for a batch.

    Raises:
      ShapeError: an array-valued shape has more sizes than the data has
        axes, or is one-dimensional with fewer (a batch's sizes belong in a
        tuple: ``Masked(data, (sizes,))``).

    The logical data is the leading corner ``data[:shape[0], :shape[1], ...]``;
    everything else is padding with unspecified content.
    """

    __slots__ = ("data", "shape", "_size_leaves")

    def __init__(self, data, shape: Sequence[Size] | None = None):
        self.data = data
        if shape is None:
            shape = tuple(int(d) for d in np.shape(data))
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
            shape = (shape,)
        elif hasattr(shape, "ndim") and hasattr(shape, "shape"):  # NumPy/JAX array, traced too
            shape = _sizes_of_array(shape, data)
        self.shape = tuple(shape)
        # Sizes are validated where they are used: ``unpad`` here, and the
        # prologue of ``mask`` (which names the argument and the dim var);
        # except a NumPy size past int32, which jax.jit would wrap into range
        # before the prologue sees it (np.int64(2**32 + 3) runs as 3)
        _check_fits_int32(self.shape, np.shape(data))

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

    @names_the_user_line
    def unpad(self) -> jax.Array | np.ndarray | list:
        """The logical data ``data[:n0, :n1, ...]`` (needs concrete sizes).

        For a batch (``data`` has ``k`` more leading axes than ``shape``, as made
        by ``stack`` or returned by ``jax.vmap``), returns the list (nested ``k``
        deep) of the unpadded examples. Each size may be static (a Python int:
        the same for every example), an array of the batch shape (one size per
        example) or a scalar array; any mix works, e.g. ``(n, 8)`` out of a
        vmapped ``"n, 8"`` function.

        Raises:
          ShapeError: sizes are traced (inside ``jit``/``vmap``), a size is
            outside ``[0, bound]`` (e.g. negative), the logical shape has more
            axes than the data, or a size array's shape does not fit the batch
            axes.
          TypeError: a size that is not an integer.
        """
        _validate_sizes(self.shape, self.bound, "Masked.unpad()")
        k = np.ndim(self.data) - len(self.shape)
        if k > 0:
            return self._unpad_batch(k)
        try:
            idx = tuple(slice(0, int(s)) for s in self.shape)
        except (TypeError, jax.errors.ConcretizationTypeError) as e:
            raise ShapeError(
                "Masked.unpad() needs concrete logical sizes; inside jit/vmap use "
                ".valid() with jnp.where instead") from e
        return self.data[idx]

    def _unpad_batch(self, k: int) -> list:
        batch = tuple(np.shape(self.data)[:k])
        try:
            sizes = [np.broadcast_to(np.asarray(s), batch) for s in self.shape]
        except (TypeError, jax.errors.ConcretizationTypeError) as e:
            raise ShapeError("Masked.unpad() needs concrete logical sizes; inside jit/vmap "
                             "use .valid() with jnp.where instead") from e
        except ValueError as e:
            raise ShapeError(f"Masked.unpad(): sizes of shapes {[np.shape(s) for s in self.shape]}"
                             f" do not fit the batch axes {batch} of data "
                             f"{tuple(np.shape(self.data))}") from e

        def build(prefix):
            if len(prefix) == k:
                return self.data[prefix + tuple(slice(0, int(s[prefix])) for s in sizes)]
            return [build(prefix + (i,)) for i in range(batch[len(prefix)])]

        return build(())

    def filled(self, value=0) -> jax.Array:
        """``data`` with the padding replaced by ``value`` (works under jit/vmap/grad).

        ``out.filled(0).sum()`` is the sum over the logical region, the way to
        turn a masked output into a loss.
        """
        return jnp.where(self.valid(), self.data, jnp.asarray(value, self.data.dtype))

    @names_the_user_line
    def valid(self) -> jax.Array:
        """Boolean array of ``data.shape``: True on the logical corner (of each
        example, for a batch).

        Raises:
          ShapeError: a concrete size outside ``[0, bound]``, or more sizes
            than axes (traced sizes are not checked).
        """
        bound = self.bound
        _validate_sizes(self.shape, bound, "Masked.valid()")
        k = len(bound) - len(self.shape)  # leading batch axes (a ragged batch)
        ok = jnp.ones(bound, dtype=bool)
        for axis, (s, b) in enumerate(zip(self.shape, bound[k:]), start=k):
            if _is_static(s) and s == b:
                continue
            s = jnp.asarray(s)
            if k and s.ndim:  # one size per example: (B,) -> (B, 1, ..., 1)
                s = s.reshape(s.shape + (1,) * (len(bound) - s.ndim))
            ok = ok & (jax.lax.broadcasted_iota(jnp.int32, bound, axis) < s)
        return ok

    def __repr__(self) -> str:
        return f"Masked(data={self.data!r}, shape={self.shape!r})"

    # A Masked is no array: reading it as one reads the padding as data (a
    # forgotten ``unpad()``). NumPy would make an object array of it and
    # ``bool()`` say True whatever the value; a rank-0 value (a scalar output:
    # no axis, no padding) converts as its data does.
    def _scalar(self, what: str):
        if not self.shape and np.ndim(self.data) == 0:
            return self.data
        raise TypeError(
            f"{what} of a Masked value (padded data of shape {self.bound} and logical shape "
            f"{self.shape}): call .unpad() for the exact array (concrete sizes), or use "
            ".data, the padded array (its padding holds anything)")

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._scalar("np.asarray"), dtype=dtype)

    def __float__(self):
        return float(self._scalar("float()"))

    def __int__(self):
        return int(self._scalar("int()"))

    def __complex__(self):
        return complex(self._scalar("complex()"))

    def __bool__(self):
        return bool(self._scalar("bool()"))

    # ``out == 2`` fell back to identity (silently False): only another Masked
    # compares, by identity as before (a Masked stays hashable)
    def __eq__(self, other):
        if isinstance(other, Masked):
            return NotImplemented
        return _no_arithmetic("__eq__")(self, other)

    def __ne__(self, other):
        if isinstance(other, Masked):
            return NotImplemented
        return _no_arithmetic("__ne__")(self, other)

    __hash__ = object.__hash__

    def __getattr__(self, name: str):
        # (only for names Masked lacks: an array method is a forgotten unpad();
        # AttributeError keeps hasattr() working)
        if name not in Masked.__slots__ and not name.startswith("__") and hasattr(
                jax.Array, name):
            raise AttributeError(
                f"'Masked' object has no attribute {name!r}: a Masked value is padded data "
                f"of shape {self.bound} and logical shape {self.shape}; call .unpad() for "
                "the exact array (concrete sizes), or use .data, the padded array (its "
                "padding holds anything)")
        raise AttributeError(f"'Masked' object has no attribute {name!r}")

    # pytree protocol: dynamic sizes are leaves, static sizes are aux data. A
    # value rebuilt from a structure keeps that structure's leaves, whatever
    # their new values are (jax.tree.map(lambda _: 0, m) as vmap's in_axes puts a
    # Python 0 where a size array was: still a leaf, so it stays a tree prefix)
    def tree_flatten(self):
        dyn = getattr(self, "_size_leaves", None)
        if dyn is None:
            dyn = tuple(i for i, s in enumerate(self.shape) if not _is_static(s))
        else:  # (rebuilt by tree_unflatten / tree.map: __init__'s check did not run)
            _check_fits_int32(self.shape, np.shape(self.data))
        children = (self.data,) + tuple(self.shape[i] for i in dyn)
        static = tuple(None if i in dyn else s for i, s in enumerate(self.shape))
        return children, static

    @classmethod
    def tree_unflatten(cls, static, children):
        obj = object.__new__(cls)
        obj.data = children[0]
        sizes = iter(children[1:])
        obj.shape = tuple(next(sizes) if s is None else s for s in static)
        obj._size_leaves = tuple(i for i, s in enumerate(static) if s is None)
        return obj


jax.tree_util.register_pytree_node(Masked, Masked.tree_flatten, Masked.tree_unflatten)


def _no_arithmetic(name: str):
    def op(self, *_):
        raise TypeError(
            f"operator {name} on a Masked value (padded data of shape {self.bound} and "
            f"logical shape {self.shape}): call .unpad() for the exact array (concrete "
            "sizes), or use .data, the padded array (its padding holds anything)")
    op.__name__ = name
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
              "or", "xor", "lt", "le", "gt", "ge"):
    setattr(Masked, f"__{_name}__", _no_arithmetic(f"__{_name}__"))
    if _name not in ("lt", "le", "gt", "ge"):
        setattr(Masked, f"__r{_name}__", _no_arithmetic(f"__r{_name}__"))
for _name in ("neg", "pos", "abs", "invert", "getitem"):
    setattr(Masked, f"__{_name}__", _no_arithmetic(f"__{_name}__"))


def _serialize_aux(static) -> bytes:
    import json
    return json.dumps(list(static)).encode()


def _deserialize_aux(data: bytes):
    import json
    return tuple(json.loads(data.decode()))


try:  # so that jax.export can serialize functions taking/returning Masked values
    jax.export.register_pytree_node_serialization(
        Masked, serialized_name="polymask.Masked", serialize_auxdata=_serialize_aux,
        deserialize_auxdata=_deserialize_aux)
except Exception:  # pragma: no cover - registered twice (module reload) or old JAX
    pass


def ragged_batch_hint(sizes, data_shape) -> str:
    """A parenthesised hint when a ``Masked`` value's logical sizes are arrays
    (a batch's sizes given to a call that is not vmapped), else ``""``.

    With one size per axis of ``data_shape`` the sizes should be scalars;
    with a leading batch axis of the sizes' length, ``jax.vmap`` is the way
    to run the batch; with another leading length the two disagree.
    """
    batched = [np.shape(s) for s in sizes if np.ndim(s) >= 1]
    if not batched:
        return ""
    lead, data_shape = batched[0], tuple(data_shape)
    if len(data_shape) == len(sizes):
        return (f" (its logical sizes are arrays of shape {lead}; one example takes a "
                "scalar size per axis, e.g. jnp.int32(3) or int(s[0]) of such an array s)")
    if len(data_shape) == len(sizes) + len(lead) and data_shape[:len(lead)] != lead:
        return (f" (its logical sizes are arrays of shape {lead} but the data's leading "
                f"axes are {data_shape[:len(lead)]}: a ragged batch has one size per example)")
    return (f" (its logical sizes are arrays of shape {lead}: for a ragged batch, "
            "jax.vmap over the Masked value)")


def _as_bound_entry(b, what: str) -> int:
    if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)):
        raise TypeError(f"{what}: a bound must be a non-negative int; got {b!r}")
    if b < 0:
        raise ShapeError(f"{what}: a bound must be a non-negative int; got {int(b)}")
    return int(b)


def check_fill(fill, dtype, what: str):
    """``fill`` as a NumPy scalar of ``dtype``, or TypeError if it does not fit.

    Integer and bool buffers reject NaN, infinities, non-integral floats and
    values out of the dtype's range (NumPy would write INT_MIN or wrap around);
    real buffers reject complex fills.
    """
    dtype = np.dtype(dtype)
    if isinstance(fill, (jax.Array, np.ndarray)) and np.ndim(fill) == 0:
        fill = np.asarray(fill).item()
    if not isinstance(fill, (int, float, complex, bool, np.generic)):
        raise TypeError(f"{what}: fill must be a scalar; got {fill!r}")
    if isinstance(fill, (complex, np.complexfloating)) and not np.issubdtype(
            dtype, np.complexfloating):
        raise TypeError(f"{what}: fill={fill!r} is complex but the arrays are {dtype}")
    if dtype == np.bool_:
        if fill not in (0, 1) or (isinstance(fill, float) and not float(fill).is_integer()):
            raise TypeError(f"{what}: fill={fill!r} is not a bool (arrays are bool)")
        return np.bool_(bool(fill))
    if np.issubdtype(dtype, np.integer):
        f = complex(fill).real if isinstance(fill, (complex, np.complexfloating)) else fill
        if isinstance(f, (float, np.floating)) and not (np.isfinite(f) and float(f).is_integer()):
            raise TypeError(f"{what}: fill={fill!r} cannot be stored in a {dtype} array "
                            "(integer arrays have no NaN/inf); pass an integer fill")
        info = np.iinfo(dtype)
        if not info.min <= int(f) <= info.max:
            raise TypeError(f"{what}: fill={fill!r} is out of range for {dtype} "
                            f"[{info.min}, {info.max}]")
        return dtype.type(int(f))
    return np.asarray(fill).astype(dtype)[()]


@names_the_user_line
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
      ShapeError: rank mismatch, a negative bound, a size larger than its
        bound, or an int ``bound`` for a 0-d ``x``.
      TypeError: a bound that is not an int (``3.7``, ``True``), or a ``fill``
        that the dtype of ``x`` cannot hold (NaN for an integer array).
    """
    if isinstance(x, (list, tuple)):  # an array-like, as NumPy reads it
        x = np.asarray(x)
    shape = tuple(np.shape(x))
    if not isinstance(bound, (tuple, list)):
        b0 = _as_bound_entry(bound, "pad(bound=...)")
        if not shape:
            raise ShapeError("pad: x is 0-d (a scalar), it has no axis to pad; pass "
                             "bound=() or use a 1-d array")
        bound = (b0,) + shape[1:]
    bound = tuple(_as_bound_entry(b, f"pad(bound={tuple(bound)!r})") for b in bound)
    if len(bound) != len(shape):
        raise ShapeError(f"pad: bound {bound} has rank {len(bound)} but x has shape {shape}")
    for axis, (s, b) in enumerate(zip(shape, bound)):
        if s > b:
            raise ShapeError(f"pad: x.shape[{axis}] = {s} is larger than its bound {b}")
    widths = [(0, b - s) for s, b in zip(shape, bound)]
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    fill = check_fill(fill, dtype, "pad")
    if not widths:  # a 0-d array with bound ()
        data = np.array(x, dtype=dtype) if isinstance(x, np.ndarray) or np.isscalar(x) \
            else jnp.asarray(x)
    elif isinstance(x, np.ndarray) or np.isscalar(x):
        data = np.pad(np.asarray(x), widths, constant_values=fill)
    else:
        data = jnp.pad(x, widths, constant_values=fill)
    sizes = tuple(np.int32(s) for s in shape) if dynamic else shape
    return Masked(data, sizes)


@names_the_user_line
def stack(arrays: Sequence[Any], bound: Sequence[int] | None = None,
          buckets=None, *, fill: Any = 0) -> Masked:
    """Stack examples of different shapes into a ragged batch.

    Args:
      arrays: ``B`` arrays of equal rank and dtype, shapes ``S_i``.
      bound: padded per-example shape; default: the elementwise max of the
        ``S_i``, rounded up by ``buckets`` when given.
      buckets: a bucketing policy (see ``polymask.buckets``) applied to every
        axis of the default bound (``stack`` knows no specs: an axis of a
        constant size is rounded up too, ``(n, 4)`` to ``(8, 8)``; give
        ``bound`` to keep it, as ``value_and_grad(buckets=...)`` does).
      fill: value of the padding; must fit the dtype (no NaN for ints).

    The result has the dtype of ``arrays[0]``; every other array must cast to
    it within its kind (``np.can_cast(..., "same_kind")``: float64 examples
    stack into a float32 batch, but float examples do not silently turn an
    int32 batch into floats, nor ints into float64), else TypeError.

    Returns:
      A *batched* ``Masked``: data ``(B, *bound)`` and ``shape`` a tuple of
      ``len(bound)`` int32 arrays of shape ``(B,)`` (the per-example sizes; the
      batch axis has no entry). ``jax.vmap(masked_fun)(batch)`` maps over it,
      and ``.unpad()`` returns the list of examples.

    Raises:
      ShapeError: no arrays, mixed ranks, a bound of the wrong rank or
        negative, or an example larger than ``bound``.
      TypeError: mixed dtypes that do not cast to ``arrays[0]``'s, a bound
        entry that is not an int, or a ``fill`` the dtype cannot hold.
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
            bound = bucket_shape(buckets, bound)
    if isinstance(bound, (int, np.integer)) and not isinstance(bound, bool):
        bound = (bound,)
    if not isinstance(bound, (tuple, list)):
        raise TypeError(f"stack: bound must be a tuple of ints; got {bound!r}")
    bound = tuple(_as_bound_entry(b, f"stack(bound={tuple(bound)!r})") for b in bound)
    rank = nps[0].ndim
    if len(bound) != rank:
        raise ShapeError(f"stack: bound {bound} has rank {len(bound)} but the arrays have "
                         f"rank {rank} (the bound is per example, without the batch axis)")
    dtype = nps[0].dtype
    for i, a in enumerate(nps[1:], 1):
        if a.dtype != dtype and not np.can_cast(a.dtype, dtype, "same_kind"):
            raise TypeError(f"stack: arrays[{i}] has dtype {a.dtype} but arrays[0] has "
                            f"{dtype}; the batch takes the dtype of arrays[0]: cast the "
                            "examples to one dtype first")
    fill = check_fill(fill, dtype, "stack")
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
