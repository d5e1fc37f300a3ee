"""``jax.random`` samplers with dynamic shapes: ``random_gamma`` (``gamma``,
``beta``, ``dirichlet``, ``loggamma``), ``random_poisson`` (jax >= 0.12.1) and
``random_gamma_grad`` (gamma's derivative, elementwise) and the sort-based shuffle
(``permutation``, ``shuffle``, ``choice(replace=False)``), and
``permutation(key, n)`` of a symbolic ``n`` (``permutation_symbolic``).

``random_gamma(key, a)``: the keys' shape ``K`` is a prefix of ``a``'s shape
``K + S``; each key is split into ``prod(S)`` keys and element ``i`` of ``S``
samples with split key ``i`` (``jax/_src/random/core.py`` ``_gamma_impl``),
elementwise over keys and alpha otherwise. Padding alpha is replaced by 1 so
the rejection loop terminates and stays finite there (the custom derivative,
``_gamma_grad``, is then finite too, and ``select`` keeps padding cotangents
out of the logical gradient). Over ``K`` only, or when only the first axis of
``S`` is dynamic (partitionable threefry: split key ``i`` depends on ``i``
alone), the padded bind is exact. Otherwise ``S`` is laid out flat with the
logical strides, sampled, and gathered back.

JAX's internal ``jnp.searchsorted`` (``choice(p=...)``) runs its binary
search with the logical length (``searchsorted_symbolic``).

``_shuffle`` (JAX sorts by fresh random bits ``ceil(3 log(size) /
log(2**32 - 1))`` times) refuses a symbolic size in Python; while a masked
function is traced it is routed to ``shuffle_symbolic``, which compares the
size with the thresholds of that round count (a size comparison: the trace
splits into cases, e.g. ``n <= 1``, no sort, and ``n >= 2``, one sort) and
then sorts as JAX does: ``random_bits`` and ``sort`` have exact rules.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from .._jax_compat import random as compat_random
from ..core.trace_state import current_scope
from ..tracing.registry import register
from .families import defelementwise
from .random import check_partitionable, linear_index
from .util import fill_padding, in_masked_trace, masked_axes

__all__ = ["random_gamma_rule", "random_poisson_rule", "shuffle_symbolic",
           "permutation_symbolic"]


@register("random_gamma")
def random_gamma_rule(ctx, key, a, *, log_space, **params):  # (jax 0.12.1: out_sharding)
    # alpha 1 in padding: finite samples and gradients
    return _per_element_sampler(ctx, key, a, fill=1, what="gamma samples")


@register("random_poisson")  # jax >= 0.12.1
def random_poisson_rule(ctx, key, lam, *, dtype, **params):
    """``random_poisson(key, lam)`` (``jax.random.poisson`` from jax 0.12.1):
    laid out as ``random_gamma``; each key's loop (Knuth's, or the rejection
    sampler's) draws every element at its linear index, so a rate of 0 in
    padding, done at once, changes no logical draw."""
    return _per_element_sampler(ctx, key, lam, fill=0, what="poisson samples")


def _per_element_sampler(ctx, key, a, *, fill, what: str):
    """A sampler primitive ``p(key, a)`` whose keys' shape ``K`` prefixes
    ``a``'s shape ``K + S`` and which draws element ``i`` of ``S`` at linear
    index ``i``: padding of ``a`` set to ``fill`` (a parameter that samples
    finitely), then bound where the padded linear index of ``S`` is the
    logical one, else laid out flat (see the module doc)."""
    bounds, logical = ctx.in_bounds[1], ctx.in_logical[1]
    nk = key.ndim
    a = fill_padding(a, logical, fill)
    dyn = masked_axes(logical, bounds, range(nk, len(bounds)))
    if not dyn:
        return ctx.bind(key, a)  # elementwise over the keys: any key implementation
    check_partitionable(ctx, key, what)
    if dyn == [nk]:  # the padded linear index of S is the logical one
        return ctx.bind(key, a)
    size = math.prod(bounds[nk:])
    if size >= 2 ** 31:
        raise ctx.unsupported(f"{what} with a dynamic shape of 2**31 or more "
                              "elements per key")
    lead = (slice(None),) * nk
    # Flat position j holds the element whose logical linear index is j.
    j = lax.iota(np.int32, size)
    total = np.int32(1)
    coords = []
    for d in reversed(range(nk, len(bounds))):
        n = jnp.maximum(jnp.asarray(logical[d], np.int32), 1)
        coords.append((j // total) % n)
        total = total * jnp.asarray(logical[d], np.int32)
    flat = a[lead + tuple(reversed(coords))]
    flat = jnp.where(j < total, flat, jnp.full((), fill, flat.dtype))
    samples = ctx.bind(key, flat)
    out = samples[lead + (linear_index(bounds[nk:], logical[nk:], np.int32),)]
    # padding read logical samples: cut its cotangents
    return fill_padding(out, logical, fill)


# d sample / d alpha at (alpha, sample): elementwise (jax >= 0.12.1 binds it)
defelementwise("random_gamma_grad", module=__name__)

_SHUFFLE_MODULE, _SHUFFLE_NAME = compat_random.shuffle_home()
_ORIGINAL_SHUFFLE = getattr(_SHUFFLE_MODULE, _SHUFFLE_NAME)


def shuffle_symbolic(key, x, axis, *args, **kwargs):
    """JAX's ``_shuffle(key, x, axis)`` for a symbolic size inside a masked trace
    (jax 0.12.1 adds ``sort_sharding``: passed on, unused by one device's sort)."""
    size = math.prod(x.shape)
    if not compat.is_dim_expr(size) or current_scope() is None:
        return _ORIGINAL_SHUFFLE(key, x, axis, *args, **kwargs)
    rounds = 0
    while not size <= compat_random.shuffle_max_size(rounds):  # may split the trace
        rounds += 1
    for _ in range(rounds):
        key, subkey = jax.random.split(key)
        sort_keys = jax.random.bits(subkey, x.shape, np.uint32)
        _, x = lax.sort_key_val(sort_keys, x, axis)
    return x


compat.replace_during_trace("jax.random shuffle (_shuffle)", shuffle_symbolic)


_SEARCH_MODULE, _SEARCH_NAME = compat_random.searchsorted_home()
_ORIGINAL_SEARCH = getattr(_SEARCH_MODULE, _SEARCH_NAME)


def searchsorted_symbolic(a, v, side="left", sorter=None, *, method="scan"):
    """JAX-internal ``jnp.searchsorted`` (``choice(p=...)``) over a symbolic
    length inside a masked trace: JAX's binary search (``method="scan"``) with
    the logical length, ``ceil(log2(n + 1))`` levels, run to the bound's level
    count and frozen after the logical one. Indices read are below ``n``."""
    n = jnp.shape(a)[0] if jnp.ndim(a) == 1 else None
    if (not compat.is_dim_expr(n) or current_scope() is None or sorter is not None
            or method not in ("scan", "scan_unrolled") or side not in ("left", "right")
            or not compat.upper_bound(n) < 2 ** 31):
        return _ORIGINAL_SEARCH(a, v, side=side, sorter=sorter, method=method)
    a, v = compat_random.promote_dtypes(jnp.asarray(a), jnp.asarray(v))
    op = compat_random.sort_comparator(side)
    size = jnp.asarray(n, np.uint32)  # the logical length (dim_as_value)
    levels = np.uint32(32) - lax.clz(size)  # bit length of n = ceil(log2(n + 1))
    low = jnp.zeros(v.shape, np.uint32)
    high = jnp.broadcast_to(size, v.shape)
    # one entry more, never read by a live step: at n = 0 (an empty selection)
    # the reads below are of a non-empty array, as a gather must be
    a = jnp.concatenate([a, jnp.zeros((1,), a.dtype)])
    for i in range(int(compat.upper_bound(n)).bit_length()):
        mid = low + (high - low) // 2
        go_left = op(v, a[mid])
        live = np.uint32(i) < levels
        low, high = (jnp.where(live & ~go_left, mid, low),
                     jnp.where(live & go_left, mid, high))
    return high.astype(np.int32)


compat.replace_during_trace("JAX's internal jnp.searchsorted (choice(p=...))",
                           searchsorted_symbolic)


_ORIGINAL_PERMUTATION = jax.random.permutation


def permutation_symbolic(key, x, *args, **kwargs):
    """``jax.random.permutation(key, n)`` with a symbolic ``n`` inside a masked
    trace: JAX needs ``n`` as a Python int; ``permutation(key, jnp.arange(n))``
    is the same draw (plain JAX shuffles ``jnp.arange(n)`` either way)."""
    if compat.is_dim_expr(x) and in_masked_trace():
        x = jnp.arange(x)
    return _ORIGINAL_PERMUTATION(key, x, *args, **kwargs)


compat.replace_during_trace("jax.random.permutation", permutation_symbolic)
