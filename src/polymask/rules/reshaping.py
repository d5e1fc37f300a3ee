"""Masking rules: the reshape family (``reshape``, ``squeeze``).

``squeeze`` drops unit axes, which are never padded: the logical corner stays
a corner. A reshape keeps the row-major order of the *logical* elements. When
the logical data stays a row-major prefix in every group of merged/split axes
(``is_prefix_reshape``) the reshape is free. Otherwise
(``(a, b) -> (a*b,)`` with ``b`` padded, ``(2, n) -> (2n,)``, splits of a
padded axis into a padded inner axis, ...) the data is re-laid out with one
gather: for every padded output position, its logical flat index (from the
logical output sizes), then the input position holding that element (from the
logical input sizes). Output padding is selected to 0 for float dtypes, so the
gather's transpose (a scatter-add) cannot carry padding cotangents (possibly
NaN) into the logical input gradient.

``split`` (``jnp.split`` and friends, sizes may be dimension expressions) is
masked in ``rules/slicing.py``: it cuts pieces at logical offsets along one
axis, like ``slice``, and never changes the row-major layout;
``tests/test_reshape.py`` covers the size-derived sections.
"""

from __future__ import annotations

import copy
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from .._jax_compat import numeric as compat_numeric
from ..core.shapes import is_static
from ..tracing.registry import register
from .families import defrelayout
from .util import clean_float, in_masked_trace, masked_axes


def _prod(sizes):
    out = 1
    for s in sizes:
        out = out * s
    return out


def _int(s):
    return int(s) if is_static(s) else jnp.asarray(s, jnp.int32)


def _same_count(in_shape, out_shape) -> bool:
    """True when the symbolic element counts are provably equal."""
    try:
        return bool(_prod(in_shape) == _prod(out_shape))
    except compat.InconclusiveDimensionOperation:
        return False


def check_element_count(ctx, in_logical, out_logical) -> None:
    """A reshape like ``(n,) -> (n // 2, 2)`` is only valid when the logical
    element counts agree (``n`` even); JAX cannot check it while tracing."""
    if _same_count(ctx.in_avals[0].shape, ctx.out_avals[0].shape):
        return
    a, b = _prod([_int(s) for s in in_logical]), _prod([_int(s) for s in out_logical])
    bad = (a != b) if is_static(a) and is_static(b) else jnp.asarray(a) != jnp.asarray(b)
    shapes = f"{ctx.in_avals[0].shape} -> {ctx.out_avals[0].shape}".replace(
        "{", "{{").replace("}", "}}")
    ctx.require(bad, (
        f"reshape {shapes} changes the number of logical elements at these sizes "
        "({0} elements into {1}), so plain JAX cannot reshape them either; where "
        "every size you pass divides, state it in the spec (e.g. '2*k') or as a "
        "constraint (e.g. 'mod(n, 2) == 0')"), (a, b), error_type=TypeError)


def relayout_indices(in_logical, in_bounds, out_logical, out_bounds):
    """Flat padded input index for every padded output position (int32, ``out_bounds``).

    Positions outside the logical output get some in-range index.
    """
    out_bounds = tuple(int(b) for b in out_bounds)
    in_bounds = tuple(int(b) for b in in_bounds)
    # Logical row-major flat index of each output position.
    flat = None
    stride = 1
    for ax in reversed(range(len(out_bounds))):
        term = lax.broadcasted_iota(jnp.int32, out_bounds, ax)
        if not (is_static(stride) and stride == 1):
            term = term * stride
        flat = term if flat is None else flat + term
        stride = stride * _int(out_logical[ax])
    if flat is None:  # rank-0 output
        flat = jnp.zeros((), jnp.int32)
    # The input position of that element, from the logical input sizes.
    idx = None
    pstride = 1
    rest = flat
    for ax in reversed(range(len(in_bounds))):
        if ax == 0:
            coord = rest
        else:
            size = _int(in_logical[ax])
            size = max(size, 1) if is_static(size) else jnp.maximum(size, 1)
            coord, rest = rest % size, rest // size
        term = coord * pstride if pstride != 1 else coord
        idx = term if idx is None else idx + term
        pstride *= in_bounds[ax]
    if idx is None:
        idx = jnp.zeros(out_bounds, jnp.int32)
    total = int(np.prod(in_bounds))
    return jnp.clip(idx, 0, max(total - 1, 0))


def reshape_relayout(ctx, x):
    """General reshape: a gather that re-lays out the logical elements."""
    in_l, in_b = ctx.in_logical[0], ctx.in_bounds[0]
    out_l, out_b = ctx.out_logical[0], ctx.out_bounds[0]
    check_element_count(ctx, in_l, out_l)
    out_b = tuple(int(b) for b in out_b)
    if int(np.prod(out_b)) == 0 or x.size == 0:
        return jnp.zeros(out_b, x.dtype)
    idx = relayout_indices(in_l, in_b, out_l, out_b)
    out = jnp.take(x.reshape(-1), idx, mode="clip", unique_indices=False)
    return clean_float(out, out_l)


defrelayout(lax.squeeze_p, module=__name__)


def _groups(in_shape, out_shape):
    """Split a reshape into groups of axes with equal symbolic size products."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [i], [j]
        pi = in_shape[i] if i < len(in_shape) else 1
        pj = out_shape[j] if j < len(out_shape) else 1
        i, j = i + 1, j + 1
        for _ in range(64):
            try:
                if pi == pj and (not (i < len(in_shape) and _is_one(in_shape[i])) and
                                 not (j < len(out_shape) and _is_one(out_shape[j]))):
                    break
            except compat.InconclusiveDimensionOperation:
                pass
            if (i < len(in_shape)) and (j >= len(out_shape) or _smaller(pi, pj)):
                pi = pi * in_shape[i]
                gi.append(i)
                i += 1
            elif j < len(out_shape):
                pj = pj * out_shape[j]
                gj.append(j)
                j += 1
            else:
                return None
        else:
            return None
        groups.append(([a for a in gi if a < len(in_shape)], [b for b in gj if b < len(out_shape)]))
    return groups


def _is_one(d) -> bool:
    return not compat.is_dim_expr(d) and int(d) == 1


def _smaller(a, b) -> bool:
    try:
        return bool(a < b) if not (compat.is_dim_expr(a) or compat.is_dim_expr(b)) else \
            compat.upper_bound(a) < compat.upper_bound(b) or (
                compat.upper_bound(a) == compat.upper_bound(b) and a != b and
                len(str(a)) < len(str(b)))
    except compat.InconclusiveDimensionOperation:
        return True


def is_prefix_reshape(ctx) -> bool:
    """True when the logical data stays a row-major prefix in every axis group.

    That holds when, in each group of axes with equal size products, only the
    group's first axis may be padded, on both sides, and the padded products
    agree. Such reshapes are free (one ``reshape`` at the bound).
    """
    in_shape = ctx.in_avals[0].shape
    out_shape = ctx.out_avals[0].shape
    groups = _groups(in_shape, out_shape)
    if groups is None:
        return False
    in_l, in_b = ctx.in_logical[0], ctx.in_bounds[0]
    out_l, out_b = ctx.out_logical[0], ctx.out_bounds[0]
    for gi, gj in groups:
        if any(a in masked_axes(in_l, in_b) for a in gi[1:]):
            return False
        if any(b in masked_axes(out_l, out_b) for b in gj[1:]):
            return False
        if int(np.prod([in_b[a] for a in gi])) != int(np.prod([out_b[b] for b in gj])):
            return False
    return True


def _with_transposed_operand(ctx, perm):
    """A view of ``ctx`` whose operand is ``transpose(operand, perm)``."""
    view = copy.copy(ctx)
    aval = ctx.in_avals[0]
    view.in_avals = [aval.update(shape=tuple(aval.shape[p] for p in perm)), *ctx.in_avals[1:]]
    view.in_bounds = [tuple(ctx.in_bounds[0][p] for p in perm), *ctx.in_bounds[1:]]
    view.in_logical = [tuple(ctx.in_logical[0][p] for p in perm), *ctx.in_logical[1:]]
    return view


@register(lax.reshape_p)
def reshape_rule(ctx, x, *dyn, new_sizes, dimensions, sharding):
    """Prefix-preserving reshapes are free; fragmenting ones re-lay out the data.

    A fragmenting reshape (the logical elements are not a row-major prefix in
    some axis group, e.g. ``(a, b) -> (a*b,)`` with ``b`` padded) is one gather
    (``reshape_relayout``).
    """
    if dyn:
        raise ctx.unsupported("reshape with dynamic shape operands")
    if dimensions is not None:  # a transpose first (vmap of conv, order="F")
        zero = ctx.has_zero_padding(x)
        x, ctx = lax.transpose(x, dimensions), _with_transposed_operand(ctx, dimensions)
        if zero:
            ctx.mark_zero_padding(x)
    if is_prefix_reshape(ctx):
        out = lax.reshape(x, tuple(ctx.out_bounds[0]))
        return ctx.mark_zero_padding(out) if ctx.has_zero_padding(x) else out
    return reshape_relayout(ctx, x)


_ORIGINAL_NEWSHAPE = getattr(*compat_numeric.newshape_home())


def compute_newshape_symbolic(arr, newshape):
    """JAX's ``-1`` inference of ``x.reshape(..., -1, ...)``, where a product of
    the other sizes that may be 0 splits the trace: plain JAX raises
    ``ZeroDivisionError`` there (``size % 0``), while the symbolic quotient
    cancels to a size (``a*b // b = a``) and would give a value."""
    shape = tuple(newshape) if isinstance(newshape, (tuple, list)) else (newshape,)
    if in_masked_trace() and any(type(d) is int and d == -1 for d in shape):
        others = math.prod(d for d in shape if not (type(d) is int and d == -1))
        try:
            empty = compat.is_dim_expr(others) and not others >= 1  # may split the trace
        except compat.SplitNeeded:
            raise
        except compat.InconclusiveDimensionOperation:  # not a splittable size
            empty = False
        if empty:
            raise ZeroDivisionError(f"integer modulo by zero: reshape of {arr.shape} into "
                                    f"{shape}, whose other sizes multiply to 0")
    return _ORIGINAL_NEWSHAPE(arr, newshape)


compat.replace_during_trace("x.reshape(-1, ...) (_compute_newshape)", compute_newshape_symbolic)


_ORIGINAL_SQUEEZE = compat_numeric.lax_numpy_module()._squeeze


def squeeze_symbolic(a, axis):
    """``jnp.squeeze(x)`` / ``x.squeeze()`` without ``axis``: JAX refuses symbolic
    shapes there (the output rank depends on which sizes are 1). Each
    symbolic size's ``== 1`` splits the trace instead (``n == 1`` and ``n != 1``
    are cases; where their ranks differ, ``mask`` keeps the rank of most sizes
    and the runners run the others per exact shape: ``cases/tree.py``'s
    ``common_outputs``)."""
    if axis is None and in_masked_trace() and any(map(compat.is_dim_expr, np.shape(a))):
        axis = []
        for i, d in enumerate(np.shape(a)):
            if compat.is_dim_expr(d):
                one = d >= 1 and not d >= 2  # (each comparison may split the trace)
            else:
                one = d == 1
            if one:
                axis.append(i)
        axis = tuple(axis)
    return _ORIGINAL_SQUEEZE(a, axis)


compat.replace_during_trace("jnp.squeeze (_squeeze)", squeeze_symbolic)
