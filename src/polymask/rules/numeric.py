"""``jnp.searchsorted``, ``digitize``, ``interp``, ``convolve`` and
``correlate`` over dynamic lengths.

None of them is a primitive, and JAX's implementations need the length of the
sorted array / the signals as a Python int (``searchsorted`` picks its index
dtype from it, ``interp`` and ``_conv`` call ``len(x)``). While a masked
function is traced (``compat.replace_during_trace``) they are routed to
replacements that compute the same values with symbolic sizes; outside a
masked trace, or when no length involved is symbolic, they call JAX's own:

- ``searchsorted``: JAX's binary search with the logical length
  (``random_samplers.searchsorted_symbolic``) for every ``method`` (they all
  give the same indices), ``sorter`` applied first as JAX does (a gather).
  ``digitize`` calls it through ``lax_numpy``'s module global (at size 0
  both of its branches give zeros, as JAX's early return does).
- ``interp``: the installed JAX's own ``_interp`` with ``len(xp)`` read as
  ``xp.shape[0]`` (its code, not a copy).
- ``convolve`` / ``correlate``: JAX's ``_conv`` with ``len`` read as
  ``shape[0]``: ``len(x) < len(y)`` (which operand slides) and
  ``len(x) < 1`` (JAX raises) are size comparisons that split the trace into
  cases; the rest is ``rev`` and ``conv_general_dilated`` with padding that is
  a dimension expression, both masked.
- ``pad(mode="wrap")``: JAX's ``_pad_wrap`` repeats the array ``divmod(width,
  n)`` times, a count in Python; along an axis of symbolic size (or width)
  output position ``i`` is the input's ``(i - before) mod n`` instead, one
  gather (numpy.pad's definition of wrap); size 0 raises as JAX does.
  ``mode="reflect"`` / ``"symmetric"`` likewise (JAX reflects in a Python
  loop and refuses widths it cannot prove at most the size).
- ``polyval`` with a symbolic number of coefficients: Horner's rule as a
  scan (jax 0.12 builds a Python list of them).
- ``jnp.fft``'s lengths ``n=`` / ``s=`` computed from sizes: JAX's own
  ``_fft_core`` with ``operator.index`` keeping a size.
"""

from __future__ import annotations

import operator
import types

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from .._jax_compat import numeric as compat_numeric
from .random_samplers import searchsorted_symbolic
from .util import has_symbolic_shape, in_masked_trace

__all__ = ["searchsorted_dynamic", "interp_dynamic", "conv_dynamic", "fft_core_dynamic", "polyval_dynamic",
           "pad_wrap_dynamic",
           "pad_reflect_dynamic"]

_LAX_NUMPY = compat_numeric.lax_numpy_module()
_ORIGINAL_SEARCHSORTED = _LAX_NUMPY.searchsorted
_ORIGINAL_INTERP = getattr(*compat_numeric.interp_home())
_ORIGINAL_CONV = getattr(*compat_numeric.conv_home())
_ORIGINAL_PAD_WRAP = _LAX_NUMPY._pad_wrap
_ORIGINAL_POLYVAL = jnp.polyval
_ORIGINAL_FFT_CORE = getattr(*compat_numeric.fft_core_home())
_ORIGINAL_PAD_REFLECT = _LAX_NUMPY._pad_symmetric_or_reflect


def searchsorted_dynamic(a, v, side="left", sorter=None, *, method="scan"):
    """``jnp.searchsorted`` whose sorted array ``a`` may have a symbolic length."""
    if not in_masked_trace() or not has_symbolic_shape(a) or np.ndim(a) != 1:
        return _ORIGINAL_SEARCHSORTED(a, v, side=side, sorter=sorter, method=method)
    n = np.shape(a)[0]
    if (side not in ("left", "right") or method not in compat_numeric.searchsorted_methods()
            or not compat.upper_bound(n) < 2 ** 31):
        return _ORIGINAL_SEARCHSORTED(a, v, side=side, sorter=sorter, method=method)
    if sorter is None:
        a, v = compat_numeric.ensure_arraylike("searchsorted", a, v)
    else:
        a, v, sorter = compat_numeric.ensure_arraylike("searchsorted", a, v, sorter)
    a, v = compat_numeric.promote_dtypes(a, v)
    if sorter is not None:
        a = a[sorter]
    return searchsorted_symbolic(a, v, side=side, method="scan")


def _length(x):
    """``len(x)``, a dimension expression for a symbolic leading axis (where
    the builtin needs an int)."""
    try:
        return len(x)
    except TypeError:
        shape = np.shape(x)
        if shape and compat.is_dim_expr(shape[0]):
            return shape[0]
        raise


def _interp_dynamic(*args):
    """The installed JAX's own ``_interp`` with ``len`` read as ``shape[0]``
    (its module's globals as they are now: searchsorted is replaced too).
    Not a copy of its code: its tie and non-finite handling differ by JAX
    version (jax 0.12 returns the last of repeated ``xp`` knots' values)."""
    return _with_globals(_ORIGINAL_INTERP, len=_length)(*args)


def _with_globals(fn, **names):
    """``fn`` (JAX's own code) with some of its module's globals replaced."""
    own = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return own


def interp_dynamic(x, xp, fp, left=None, right=None, period=None):
    """``jnp.interp``'s ``_interp`` whose ``xp``/``fp`` may have a symbolic length."""
    if not in_masked_trace() or not has_symbolic_shape(xp, fp):
        return _ORIGINAL_INTERP(x, xp, fp, left, right, period)
    return _interp_dynamic(x, xp, fp, left, right, period)


def conv_dynamic(x, y, mode, op, precision, preferred_element_type=None):
    """JAX's ``_conv`` (``convolve`` / ``correlate``, jax 0.10) with ``len``
    read as ``shape[0]``: comparisons of symbolic lengths split the trace."""
    if not in_masked_trace() or not has_symbolic_shape(x, y):
        return _ORIGINAL_CONV(x, y, mode, op, precision, preferred_element_type)
    if np.ndim(x) != 1 or np.ndim(y) != 1:
        raise ValueError(f"{op}() only support 1-dimensional inputs.")
    if preferred_element_type is None:
        x, y = compat_numeric.promote_dtypes_inexact(x, y)
    else:
        x, y = compat_numeric.promote_dtypes(x, y)
    # ``<`` (not ``==``, which is False when undecided) splits the trace at size 0
    if x.shape[0] < 1 or y.shape[0] < 1:
        raise ValueError(f"{op}: inputs cannot be empty, got shapes {x.shape} and {y.shape}.")
    reverse = False
    if op == "correlate":
        y = jnp.conj(y)
        if x.shape[0] < y.shape[0]:
            x, y = y, x
            reverse = True
    elif op == "convolve":
        if x.shape[0] < y.shape[0]:
            x, y = y, x
        y = jnp.flip(y)
    # Explicit conv padding must be Python ints; string padding and lax.pad
    # take dimension expressions. "SAME_LOWER" at stride 1 pads
    # (k // 2, k - 1 - k // 2), JAX's "same"; "full" pads x by k - 1 first.
    k = y.shape[0]
    if mode in ("full", "same") and compat.is_symbolic_shape((k,)) \
            and not compat.is_symbolic_shape(x.shape):
        result = _conv_padding_the_data(x, y, mode, precision, preferred_element_type)
        return lax.rev(result, (0,)) if reverse else result
    if mode == "valid":
        padding = "VALID"
    elif mode == "same":
        padding = "SAME_LOWER"
    elif mode == "full":
        x = lax.pad(x, jnp.zeros((), x.dtype), [(k - 1, k - 1, 0)])
        padding = "VALID"
    else:
        raise ValueError("mode must be one of ['full', 'same', 'valid']")
    result = lax.conv_general_dilated(x[None, None, :], y[None, None, :], (1,), padding,
                                      precision=precision,
                                      preferred_element_type=preferred_element_type)
    result = result[0, 0]
    return lax.rev(result, (0,)) if reverse else result


def _conv_padding_the_data(x, y, mode, precision, preferred_element_type):
    """``_conv``'s product for a data operand ``y`` (symbolic length ``k``, the
    shorter one, already flipped / conjugated) against a constant ``x`` of
    length ``L``. JAX pads ``x`` by ``k - 1`` (a symbolic padding is an
    explicit ``lax.pad``), whose zeros would multiply ``y``: ``0 * inf`` is
    NaN where plain JAX's implicit conv padding makes no term. The same full
    product with the roles swapped pads the data by the constant ``L - 1``
    instead: ``full[i] = sum_t pad(flip(y))[i + t] * flip(x)[t]``; "same" is
    its ``L`` entries from ``(k - 1) // 2``."""
    L = x.shape[0]
    data = lax.pad(jnp.flip(y), jnp.zeros((), y.dtype), [(L - 1, L - 1, 0)])
    full = lax.conv_general_dilated(data[None, None, :], jnp.flip(x)[None, None, :], (1,),
                                    "VALID", precision=precision,
                                    preferred_element_type=preferred_element_type)[0, 0]
    if mode == "full":
        return full
    return lax.dynamic_slice_in_dim(full, (y.shape[0] - 1) // 2, L)


def fft_core_dynamic(func_name, fft_type, a, s, axes, norm):
    """``jnp.fft``'s ``_fft_core`` whose lengths ``s`` (``n=`` of the 1-D
    functions) may be dimension expressions: the installed JAX's own code
    (cropping, zero padding, ``irfft``'s ``n // 2 + 1`` input, the norm) with
    ``operator.index`` keeping a size; ``n < 1`` splits the trace and raises
    JAX's error there."""
    if s is None or not in_masked_trace() or not any(compat.is_dim_expr(n) for n in s):
        return _ORIGINAL_FFT_CORE(func_name, fft_type, a, s, axes, norm)
    if any(n < 1 for n in s):  # (``<``: undecided, it splits the trace)
        raise ValueError("Shape should be positive.")
    return _with_globals(_ORIGINAL_FFT_CORE, operator=_INDEX_KEEPING_SIZES)(
        func_name, fft_type, a, s, axes, norm)


_INDEX_KEEPING_SIZES = types.SimpleNamespace(
    index=lambda v: v if compat.is_dim_expr(v) else operator.index(v))


def polyval_dynamic(p, x, *, unroll=16):
    """``jnp.polyval`` whose coefficients ``p`` have a symbolic count: Horner's
    rule as a ``lax.scan`` over them (JAX's own form up to jax 0.11; jax 0.12
    builds a Python list of the coefficients for ``lax.polynomial``)."""
    if not in_masked_trace() or not has_symbolic_shape(p) or np.ndim(p) == 0 \
            or not compat.is_dim_expr(np.shape(p)[0]):
        return _ORIGINAL_POLYVAL(p, x, unroll=unroll)
    p, x = compat_numeric.ensure_arraylike("polyval", p, x)
    p, x = compat_numeric.promote_dtypes(p, x)
    shape = lax.broadcast_shapes(p.shape[1:], x.shape)
    y = lax.full_like(x, 0, shape=shape, dtype=x.dtype)
    y, _ = lax.scan(lambda y, c: (y * x + c, None), y, p, unroll=unroll)
    return y


def pad_wrap_dynamic(array, pad_width):
    """``jnp.pad(array, pad_width, mode="wrap")`` (JAX's ``_pad_wrap``, called
    with one ``(before, after)`` pair per axis) where a size or width is
    symbolic: output position ``i`` of such an axis reads input position
    ``(i - before) mod n`` (JAX's repeats and remainders, as one gather)."""
    if not _symbolic_padding(array, pad_width):
        return _ORIGINAL_PAD_WRAP(array, pad_width)
    return _pad_by_gather(array, pad_width, "wrap", jnp.remainder, _ORIGINAL_PAD_WRAP)


def pad_reflect_dynamic(array, pad_width, mode, reflect_type):
    """``jnp.pad(mode="reflect" / "symmetric")`` (JAX's
    ``_pad_symmetric_or_reflect``) where a size or width is symbolic: JAX
    reflects in a Python loop, as often as the width needs, and refuses a
    width it cannot prove at most the size. Its result is the periodic even
    extension (numpy.pad's): position ``j = (i - before) mod p`` of period
    ``p = 2n`` (symmetric: ``j`` or ``2n - 1 - j``) or ``2n - 2`` (reflect:
    ``j`` or ``2n - 2 - j``; a size of 1 repeats its element), one gather.
    ``reflect_type="odd"`` (values, not positions) stays JAX's."""
    if reflect_type != "even" or not _symbolic_padding(array, pad_width):
        return _ORIGINAL_PAD_REFLECT(array, pad_width, mode, reflect_type)

    def source(positions, size):
        if mode == "symmetric":
            j = jnp.remainder(positions, 2 * size)
            return jnp.where(j < size, j, 2 * size - 1 - j)
        period = jnp.maximum(2 * size - 2, 1)
        j = jnp.remainder(positions, period)
        return jnp.where(j < size, j, period - j)

    return _pad_by_gather(array, pad_width, mode, source,
                          lambda a, w: _ORIGINAL_PAD_REFLECT(a, w, mode, reflect_type))


def _symbolic_padding(array, pad_width) -> bool:
    return in_masked_trace() and (has_symbolic_shape(array) or any(
        compat.is_dim_expr(w) for pair in pad_width for w in pair))


def _pad_by_gather(array, pad_width, mode: str, source_index, static_pad):
    """Pad each axis whose size or width is symbolic by a gather: output
    position ``i`` reads ``source_index(i - before, n)``; an axis of static
    size and widths by JAX's own ``static_pad``. An empty axis with padding
    raises JAX's error (the trace splits at size 0: ``<`` is undecided)."""
    for axis, (before, after) in enumerate(pad_width):
        size = array.shape[axis]
        if not any(compat.is_dim_expr(d) for d in (size, before, after)):
            widths = [(0, 0)] * array.ndim
            widths[axis] = (before, after)
            array = static_pad(array, widths)
            continue
        if size < 1:
            # (JAX's _check_no_padding; ``>=`` splits where ``==`` would not)
            if before >= 1 or after >= 1:
                raise ValueError(f"Cannot apply '{mode}' padding to empty axis")
            continue
        positions = jnp.arange(size + before + after) - before
        array = jnp.take(array, source_index(positions, size), axis=axis, mode="clip")
    return array


compat.replace_during_trace("jnp.fft's n= / s= (_fft_core)", fft_core_dynamic)
compat.replace_during_trace("jnp.polyval", polyval_dynamic)
compat.replace_during_trace("jnp.pad(mode='wrap') (_pad_wrap)", pad_wrap_dynamic)
compat.replace_during_trace("jnp.pad(mode='reflect' / 'symmetric') (_pad_symmetric_or_reflect)",
                            pad_reflect_dynamic)
compat.replace_during_trace("jnp.searchsorted", searchsorted_dynamic)
compat.replace_during_trace("jax._src.numpy searchsorted (digitize)", searchsorted_dynamic)
compat.replace_during_trace("jnp.interp (_interp)", interp_dynamic)
compat.replace_during_trace("jnp.convolve / correlate (_conv)", conv_dynamic)
