"""Sorting: padding sorts last, using validity as the leading sort key."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .. import _jax_compat as compat
from ..tracing.registry import register
from .util import masked_axes, valid_mask


@register(lax.sort_p)
def sort_rule(ctx, *operands, dimension, is_stable, num_keys):
    lg, bd = ctx.in_logical[0], ctx.in_bounds[0]
    if not masked_axes(lg, bd, [dimension]):
        return ctx.bind(*operands)
    padding_key = (~valid_mask(lg, bd, [dimension])).astype(jnp.int32)
    outs = lax.sort((padding_key, *operands), dimension=dimension, is_stable=is_stable,
                    num_keys=num_keys + 1)
    return list(outs[1:])


def nan_sign_key(x):
    """A sort key before the value that puts -NaN first and +NaN last: XLA's
    TopK orders floats totally (-NaN < -inf < ... < +inf < +NaN), while
    ``lax.sort`` puts every NaN last; zeros for ints."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros(x.shape, jnp.int32)
    nan = jnp.isnan(x)
    return jnp.where(nan & jnp.signbit(x), 0, jnp.where(nan, 2, 1)).astype(jnp.int32)


def signed_zero_key(x):
    """A sort key after the value that puts -0.0 before +0.0 (``lax.sort``
    ranks them equal; XLA's TopK ranks +0.0 above -0.0); zeros for ints."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros(x.shape, jnp.int32)
    return (~jnp.signbit(x)).astype(jnp.int32)


def check_symbolic_k(ctx, k, n, name: str) -> None:
    """Where ``k`` is a dimension expression (``x.shape[-1] - 1``), raise
    ``ShapeError`` at the sizes where plain JAX rejects it (negative, or
    above the size ``n`` of the sorted axis)."""
    if compat.is_dim_expr(k):
        k_raw = ctx.dims.logical_raw(k)
        ctx.require(k_raw < 0, f"{name}: k = {k} is {{0}} at these sizes; "
                    "k must be nonnegative", values=(k_raw,))
        ctx.require(k_raw > n, f"{name}: k = {k} is {{0}}, larger than the size "
                    "{1} of the sorted axis", values=(k_raw, n))


@register(lax.top_k_p)
def top_k_rule(ctx, x, *, k, axis=-1, **params):
    """Top ``k`` of the logical prefix of ``axis``, ties broken by the lower index.

    A stable sort on (padding, value, -index) puts the logical values in
    ascending order with equal values by descending index; the top ``k`` are
    then the last ``k`` logical positions read backwards. (Filling padding with
    -inf instead would let padding win ties against logical -inf values.)

    ``k`` may be a dimension expression (``x.shape[-1] - 1``): the output's
    padded size is its bound and its logical size ``k`` at the logical sizes;
    sizes where plain JAX rejects ``k`` (negative, or above the axis size)
    raise ``ShapeError``.
    """
    axis = axis % x.ndim
    lg, bd = ctx.in_logical[0], ctx.in_bounds[0]
    kb = ctx.out_bounds[0][axis]
    check_symbolic_k(ctx, k, lg[axis], "top_k")
    if not masked_axes(lg, bd, [axis]) and kb <= bd[axis]:
        return ctx.bind(x)
    padding_key = (~valid_mask(lg, bd, [axis])).astype(jnp.int32)
    neg_index = -lax.broadcasted_iota(jnp.int32, x.shape, axis)
    _, _, values, _, neg_idx = lax.sort(
        (padding_key, nan_sign_key(x), x, signed_zero_key(x), neg_index),
        dimension=axis, is_stable=True, num_keys=5)
    n = jnp.asarray(lg[axis], jnp.int32)
    # Output position i (of the padded bound of k) reads sorted position
    # n - 1 - i; positions past the logical k are padding (free).
    pos = jnp.clip(n - 1 - lax.iota(jnp.int32, kb), 0, max(bd[axis] - 1, 0))
    values = jnp.take(values, pos, axis=axis)
    indices = -jnp.take(neg_idx, pos, axis=axis)
    return [values, indices.astype(ctx.out_avals[1].dtype)]
