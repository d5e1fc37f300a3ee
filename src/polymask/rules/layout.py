"""Layout primitives: broadcast, transpose, iota, size queries."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..tracing.registry import register
from .families import defrelayout
from .util import clean, is_inexact, masked_axes


@register("dim_as_value")
def dim_as_value_rule(ctx, *, dim):
    """A size used as a number is its *logical* size (Thunder's ``prims.shape``).

    Not clamped at 0 as a shape is: on the exact arrays ``x.shape[0] - 2`` is
    a Python int, -1 at a size of 1 (``jnp.fft.ifftshift`` rolls by
    ``-(n // 2)``; ``jnp.arange(n - 3, n)`` starts below 0).
    """
    dtype = ctx.out_avals[0].dtype
    return jnp.asarray(ctx.dims.logical_value(dim), dtype)


@register("empty")  # jnp.empty binds it from jax 0.11 (a broadcast of 0 before)
def empty_rule(ctx, **params):
    """An array of unspecified contents at the padded shape (``jnp.empty``:
    its values are not part of its contract, logical or padding)."""
    return ctx.bind()


@register(lax.broadcast_in_dim_p)
def broadcast_in_dim_rule(ctx, x, *dyn, shape, broadcast_dimensions, sharding):
    """Broadcast at the bound; for float results, zero the padding of new dynamic axes.

    The transpose of a broadcast sums the cotangent over the new axes; zeroing
    that axis's padding (a ``select``) keeps NaN cotangents from padding out
    of the logical gradient.
    """
    if dyn:
        raise ctx.unsupported("dynamic-shape broadcast operands")
    out = ctx.bind(x)
    if not is_inexact(out.dtype):
        return out
    zero_in = ctx.has_zero_padding(x)
    in_shape = ctx.in_avals[0].shape
    new_axes = [ax for ax in range(len(shape))
                if ax not in broadcast_dimensions
                or in_shape[broadcast_dimensions.index(ax)] != shape[ax]]
    axes = masked_axes(ctx.out_logical[0], ctx.out_bounds[0], new_axes)
    out = clean(out, ctx.out_logical[0], axes) if axes else out
    return ctx.mark_zero_padding(out) if zero_in else out


# The reshape family (``reshape``, ``squeeze``) lives in ``rules/reshaping.py``.
defrelayout(lax.transpose_p, lax.iota_p, module=__name__)
