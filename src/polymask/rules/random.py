"""``jax.random`` with dynamic shapes: key primitives and ``random_bits``.

Keys have static shapes in practice (one key, or a static number of split
keys): ``random_seed``, ``random_wrap``, ``random_unwrap``, ``random_split``,
``random_fold_in`` and ``random_clone`` on static shapes take the
interpreter's static fast path (bound unchanged); their rules only see keys
of a dynamic shape, and refuse them with the remedy.

``random_bits`` with a dynamic shape follows JAX's partitionable threefry
scheme (``jax_threefry_partitionable``, the default since JAX 0.5): element
``i`` of the bits is ``threefry2x32(key, linear index of i)``
(``jax/_src/random/threefry2x32.py`` ``_threefry_random_bits_partitionable``,
``prng.iota_2x32_shape``). The rule takes the linear index with the
*logical* strides, so the logical region holds exactly the bits plain JAX
draws for the exact shape, and samplers built on the bits (``uniform``,
``normal``, ``bernoulli``, dropout) follow. The original threefry scheme and
the ``rbg`` keys draw bits that depend on the total size: refused, naming the
flag to set.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from .registry import register
from .util import masked_axes

_KEY_PRIMITIVES = ("random_seed", "random_wrap", "random_unwrap", "random_split",
                   "random_fold_in", "random_clone")


@register(*_KEY_PRIMITIVES)
def key_rule(ctx, *args, **params):
    raise ctx.unsupported("PRNG keys with a dynamic shape (split or fold keys with "
                          "static counts; draw numbers with dynamic shapes instead)")


@register("random_bits")
def random_bits_rule(ctx, keys, *, bit_width, shape):
    if not masked_axes(ctx.out_logical[0], ctx.out_bounds[0]):  # sizes pinned at the bound
        return ctx.bind(keys)
    if keys.shape != ():
        raise ctx.unsupported("random bits with a dynamic shape from an array of keys "
                              "(draw from one key, or vmap over the keys)")
    if str(jax.random.key_impl(keys)) != "threefry2x32" or not jax.config.jax_threefry_partitionable:
        raise ctx.unsupported("random bits with a dynamic shape need the partitionable "
                              "threefry keys, whose bits do not depend on the total size "
                              "(jax.random.key, with jax_threefry_partitionable=True)")
    bounds, logical = ctx.out_bounds[0], ctx.out_logical[0]
    if math.prod(bounds) >= 2 ** 32:
        raise ctx.unsupported("random bits with a dynamic shape of 2**32 or more elements")
    lo = _linear_index(bounds, logical)
    k = jax.random.key_data(keys)
    # Every operand derives from lo: under vmap (lo batched by the sizes) JAX's
    # threefry2x32 batching gives an unbatched operand a batch of 1, which its
    # CPU lowering (a rolled loop) rejects.
    zero = lo ^ lo
    bits1, bits2 = compat.threefry2x32(zero + k[0], zero + k[1], zero, lo)
    dtype = np.dtype(f"uint{bit_width}")
    if bit_width == 64:
        hi = lax.convert_element_type(bits1, dtype)
        return lax.shift_left(hi, np.array(32, dtype)) | lax.convert_element_type(bits2, dtype)
    return lax.convert_element_type(bits1 ^ bits2, dtype)


def _linear_index(bounds, logical):
    """uint32 row-major index of every position, with the logical strides (the
    position's index in the exact array; padding gets some index, unused)."""
    lin = lax.full(bounds, 0, np.uint32)
    stride = np.uint32(1)
    for d in reversed(range(len(bounds))):
        lin = lin + lax.broadcasted_iota(np.uint32, bounds, d) * stride
        stride = stride * lax.convert_element_type(logical[d], np.uint32)
    return lin
