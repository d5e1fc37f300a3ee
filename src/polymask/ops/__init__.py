"""Data-dependent-size ops: nonzero, argwhere, flatnonzero, where, boolean_mask,
compress, extract, unique, arange, dynamic_slice.

Outside ``polymask.mask`` with concrete inputs they return what NumPy returns
(they call ``jax.numpy`` eagerly; also under ``jax.grad``). Inside ``jax.jit``
but outside ``mask`` their output size is unknown, so they raise a
``ShapeError`` pointing to ``polymask.mask`` (or accept ``size=`` /
``fill_value=`` like ``jax.numpy``).

Inside ``polymask.mask`` each call creates a fresh dimension variable
(``_u1``, ``_u2``, ...) whose bound is known statically (the operand's padded
size, or ``max_size=``) and whose logical value is computed at run time (a
count, a length); later operations use it like any other size. See
``rules/data_dependent.py`` for the masking rules. ``trimming``: ``jnp.trim_zeros``
during a masked trace, built on ``boolean_mask``.

Layer: imports ``_jax_compat``, ``core``, ``tracing`` and ``rules`` (the
data-dependent primitives); nothing above.
"""

from __future__ import annotations

from . import trimming  # noqa: F401  (jnp.trim_zeros during a masked trace)
from .selection import argwhere, boolean_mask, compress, extract, flatnonzero, nonzero, where
from .sized import arange, dynamic_slice, unique

__all__ = ["nonzero", "argwhere", "flatnonzero", "where", "boolean_mask", "compress",
           "extract", "unique", "arange", "dynamic_slice"]
