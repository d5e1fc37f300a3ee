"""Validity masks: the logical corner of a padded shape as a boolean array.

Built once per distinct (trace, shape, sizes) within a masked run
(``shared_masks``), so rules that need the same mask share it (CSE). The
interpreter zeroes float inputs' padding with them; the rules neutralise
padding with them (``rules/util.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax

from .. import _jax_compat as compat
from .shapes import needs_mask
from .trace_state import replaced, trace_state

_STATE = trace_state()


def masked_axes(logical: Sequence, padded: Sequence[int], axes=None) -> list[int]:
    """Axes (of ``axes``, default all) whose logical size may differ from the bound."""
    cand = range(len(padded)) if axes is None else axes
    return [a for a in cand if needs_mask(logical[a], padded[a])]


# Validity masks built during one masked run, shared by every rule that needs
# the same one (CSE): key (current JAX trace, padded shape, (axis, size object)),
# in ``trace_state().masks``.
def shared_masks():
    """Within the block, ``valid_mask`` builds each distinct mask once per trace."""
    return replaced("masks", {})


def _current_trace():
    return compat.current_trace()  # None: no sharing


def valid_mask(logical: Sequence, padded: Sequence[int], axes=None):
    """Boolean array of shape ``padded``, True on the logical corner of ``axes``.

    Returns None when no axis needs a mask (static fast path). Inside
    ``shared_masks()`` (each masked run) an equal mask is built once per trace:
    the cache keeps the size objects and the trace alive so their ids stay unique.
    """
    axes = masked_axes(logical, padded, axes)
    if not axes:
        return None
    padded = tuple(int(p) for p in padded)
    cache = _STATE.masks
    trace = _current_trace() if cache is not None else None
    key = None
    if trace is not None:
        key = (id(trace), padded, tuple((a, id(logical[a])) for a in axes))
        hit = cache.get(key)
        if hit is not None:
            return hit[0]
    ok = None
    for a in axes:
        m = lax.broadcasted_iota(jnp.int32, padded, a) < jnp.asarray(logical[a], jnp.int32)
        ok = m if ok is None else (ok & m)
    if key is not None:
        cache[key] = (ok, trace, [logical[a] for a in axes])
    return ok
