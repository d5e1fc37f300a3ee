"""Private JAX the tests need to build what ecosystem code builds, kept here
with the rest of polymask's private JAX use (not imported by polymask itself):
a primitive whose eager implementation is XLA's own (as JAX's primitives
have), LAPACK-form QR (lineax and optimistix call it), ``random_bits``'s raw
streams."""

from __future__ import annotations

import functools

from jax._src import dispatch as _dispatch
from jax._src.lax import linalg as _lax_linalg
from jax._src.random import prng as _prng

__all__ = ["xla_impl", "geqrf", "ormqr", "raw_bits"]


def xla_impl(prim):
    """An eager implementation for ``prim`` that compiles it with XLA
    (``prim.def_impl(xla_impl(prim))``), as JAX's own primitives run."""
    return functools.partial(_dispatch.apply_primitive, prim)


geqrf = _lax_linalg.geqrf  # (no public alias)
ormqr = _lax_linalg.ormqr
raw_bits = getattr(_prng, "raw_bits", None)  # (new in jax 0.12.1; None before)
