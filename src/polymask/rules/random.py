"""``jax.random`` with dynamic shapes: key primitives and ``random_bits``.

Under JAX's partitionable threefry scheme (``jax_threefry_partitionable``, the
default since JAX 0.5) a split key or a word of random bits depends only on
its own position: split key ``i`` of ``key`` and bits element ``i`` are both
``threefry2x32(key, linear index of i)`` (``jax/_src/random/threefry2x32.py``
``_threefry_split_foldlike``, ``_threefry_random_bits_partitionable``,
``prng.iota_2x32_shape``). Over the axes that ``random_split`` /
``random_bits`` add (``shape``), the rules take that linear index with the
*logical* strides, so the logical region holds exactly the keys / bits plain
JAX makes for the exact shape, and everything built on them (``uniform``,
``normal``, dropout, ``gamma``'s per-element keys, ``vmap`` over split keys)
follows. The original threefry scheme and the ``rbg`` keys split and draw
bits that depend on the total size: refused, naming the flag to set.

Over the axes of an *array of keys*, every key primitive is elementwise
(``prng.py`` applies the key implementation per key with
``iterated_vmap_unary`` / ``iterated_vmap_binary_bcast``): ``random_seed``,
``random_wrap``, ``random_unwrap``, ``random_fold_in``, ``random_clone``, and
``random_split`` / ``random_bits`` whose added axes are static, are bound on
the padded arrays, for any key implementation. Keys in padding are then
garbage keys (any bits are a key); rules that move positions never bring
padding into the logical region, so no logical output depends on them.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from ..tracing.registry import register
from .util import masked_axes


@register("random_seed", "random_wrap", "random_unwrap", "random_fold_in", "random_clone")
def elementwise_key_rule(ctx, *args, **params):
    # Elementwise over the key axes (and fold_in's broadcast messages); the
    # trailing key-data axes of wrap/unwrap are static (the impl's key shape).
    return ctx.bind(*args)


@register("random_split")
def random_split_rule(ctx, keys, *, shape, **params):  # (jax 0.12.1: out_sharding)
    nk = len(ctx.in_bounds[0])
    if not masked_axes(ctx.out_logical[0], ctx.out_bounds[0], range(nk, nk + len(shape))):
        return ctx.bind(keys)  # new axes at their bound: elementwise over the keys
    check_partitionable(ctx, keys, "split keys")
    bits1, bits2 = threefry_counts(ctx, keys)
    data = lax.concatenate([bits1[..., None], bits2[..., None]], bits1.ndim)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(keys))


@register("raw_bits")  # jax >= 0.12.1
def raw_bits_rule(ctx, keys, *, shape, **params):
    """Threefry's two raw 32-bit words at the logical linear index of every
    position (the streams of ``random_bits``, before any XOR)."""
    nk = len(ctx.in_bounds[0])
    if not masked_axes(ctx.out_logical[0], ctx.out_bounds[0], range(nk, nk + len(shape))):
        return ctx.bind(keys)
    check_partitionable(ctx, keys, "raw random bits")
    return list(threefry_counts(ctx, keys))


@register("random_bits")
def random_bits_rule(ctx, keys, *, bit_width, shape, num_streams=None, **params):
    """Bits at the logical linear index of every position. From jax 0.12.1 the
    primitive returns ``num_streams`` arrays (``prng._raw_bits_to_random_bits``):
    threefry's two raw words are the streams, or XORed into one, and more
    words than two come from keys split off per pair of words."""
    nk = len(ctx.in_bounds[0])
    if not masked_axes(ctx.out_logical[0], ctx.out_bounds[0], range(nk, nk + len(shape))):
        return ctx.bind(keys)  # sizes pinned at the bound, or dynamic key axes only
    check_partitionable(ctx, keys, "random bits")
    streams = 1 if num_streams is None else num_streams
    total = streams * (2 if bit_width == 64 else 1)
    if total <= 2:
        bits1, bits2 = threefry_counts(ctx, keys)
        words = [bits1 ^ bits2] if total == 1 else [bits1, bits2]
    else:  # a key split off per pair of words, as threefry's split (index j)
        k = jax.random.key_data(keys)
        words = []
        for j in range(total // 2):
            j_ = np.full(keys.shape, j, np.uint32)
            zero = np.zeros(keys.shape, np.uint32)
            sub = compat.threefry2x32(k[..., 0], k[..., 1], zero, j_)
            words += threefry_counts(ctx, jax.random.wrap_key_data(
                lax.concatenate([sub[0][..., None], sub[1][..., None]], keys.ndim),
                impl=jax.random.key_impl(keys)))
    dtype = np.dtype(f"uint{bit_width}")
    if bit_width == 64:
        out = [lax.shift_left(lax.convert_element_type(words[2 * i], dtype), np.array(32, dtype))
               | lax.convert_element_type(words[2 * i + 1], dtype) for i in range(streams)]
    else:
        out = [lax.convert_element_type(w, dtype) for w in words]
    return out if num_streams is not None else out[0]


def check_partitionable(ctx, keys, what: str) -> None:
    """Refuse (naming the remedy) unless ``keys`` are partitionable threefry keys."""
    if (str(jax.random.key_impl(keys)) != "threefry2x32"
            or not jax.config.jax_threefry_partitionable):
        raise ctx.unsupported(
            f"{what} with a dynamic shape need the partitionable threefry keys, whose "
            "values do not depend on the total size (jax.random.key, with "
            "jax_threefry_partitionable=True)")


def threefry_counts(ctx, keys):
    """``threefry2x32`` of every key (axes ``K``) at the linear index of every
    position of the added axes ``S`` (output ``K + S``), with the logical
    strides of ``S``: JAX's partitionable split / bits for the exact shape."""
    bounds, logical = ctx.out_bounds[0], ctx.out_logical[0]
    nk = keys.ndim
    if math.prod(bounds[nk:]) >= 2 ** 32:
        raise ctx.unsupported("split keys or random bits with a dynamic shape of 2**32 or "
                              "more elements per key")
    lo = linear_index(bounds[nk:], logical[nk:], np.uint32)
    lo = lax.broadcast_in_dim(lo, bounds, tuple(range(nk, len(bounds))))
    k = jax.random.key_data(keys)
    k1, k2 = (lax.broadcast_in_dim(k[..., w], bounds, tuple(range(nk))) for w in (0, 1))
    # Every operand derives from both lo and the keys: under vmap (lo batched
    # by the sizes, or the keys batched) JAX's threefry2x32 batching gives an
    # unbatched operand a batch of 1, which its CPU lowering rejects.
    zero = (lo ^ lo) ^ (k1 ^ k1)
    return compat.threefry2x32(zero + k1, zero + k2, zero, zero + lo)


def linear_index(bounds, logical, dtype=np.uint32):
    """Row-major index of every position, with the logical strides (the
    position's index in the exact array; padding gets some index below
    ``prod(bounds)``, unused)."""
    lin = lax.full(bounds, 0, dtype)
    stride = np.array(1, dtype)
    for d in reversed(range(len(bounds))):
        lin = lin + lax.broadcasted_iota(dtype, bounds, d) * stride
        stride = stride * lax.convert_element_type(logical[d], dtype)
    return lin
