"""Masking rules: fragmenting reshapes and splits.

A reshape keeps the row-major order of the *logical* elements. When the
logical data stays a row-major prefix in every group of merged/split axes
(``rules/layout.py``: ``is_prefix_reshape``) the reshape is free. Otherwise
(``(a, b) -> (a*b,)`` with ``b`` padded, ``(2, n) -> (2n,)``, splits of a
padded axis into a padded inner axis, ...) the data is re-laid out with one
gather: for every padded output position, its logical flat index (from the
logical output sizes), then the input position holding that element (from the
logical input sizes). Output padding is selected to 0 for float dtypes, so the
gather's transpose (a scatter-add) cannot carry padding cotangents (possibly
NaN) into the logical input gradient.

``split`` (``jnp.split`` and friends, sizes may be dimension expressions) is
masked in ``rules/slicing.py`` (pieces cut at logical offsets);
``tests/test_reshape.py`` covers the size-derived sections.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from ..shapes import is_static
from . import layout
from .util import is_inexact, valid_mask


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
    ctx.require(bad, (
        f"reshape {ctx.in_avals[0].shape} -> {ctx.out_avals[0].shape} changes the number "
        f"of logical elements for these sizes; state the divisibility in the spec "
        f"(e.g. '2*k') or as a constraint (e.g. 'mod(n, 2) == 0')"))


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
    if is_inexact(out.dtype):
        m = valid_mask(out_l, out_b)
        if m is not None:
            out = lax.select(m, out, jnp.zeros_like(out))
    return out


layout._RELAYOUT["reshape"] = reshape_relayout
