"""Private JAX the tests need to build what ecosystem code builds, kept here
with the rest of polymask's private JAX use (not imported by polymask itself):
a primitive whose eager implementation is XLA's own (as JAX's primitives
have), LAPACK-form QR (lineax and optimistix call it), ``random_bits``'s raw
streams, a count of JAX's size decision procedure's calls."""

from __future__ import annotations

import contextlib
import functools

from jax._src import dispatch as _dispatch
from jax._src.export import shape_poly as _shape_poly
from jax._src.export import shape_poly_decision as _decision
from jax._src.lax import linalg as _lax_linalg
from jax._src.random import prng as _prng

__all__ = ["xla_impl", "geqrf", "ormqr", "raw_bits", "decision_calls"]


def xla_impl(prim):
    """An eager implementation for ``prim`` that compiles it with XLA
    (``prim.def_impl(xla_impl(prim))``), as JAX's own primitives run."""
    return functools.partial(_dispatch.apply_primitive, prim)


geqrf = _lax_linalg.geqrf  # (no public alias)
ormqr = _lax_linalg.ormqr
raw_bits = getattr(_prng, "raw_bits", None)  # (new in jax 0.12.1; None before)


@contextlib.contextmanager
def decision_calls(pattern: str = ""):
    """Yield a list that gets the text of every size expression JAX's decision
    procedure bounds meanwhile (its own calls and polymask's), those whose
    text contains ``pattern``."""
    seen: list[str] = []
    orig_module, orig_poly = _decision.bounds_decision, _shape_poly._bounds_decision

    def counted(orig):
        def bounds(e, prec):
            if pattern in str(e):
                seen.append(str(e))
            return orig(e, prec)
        return bounds

    _decision.bounds_decision = counted(orig_module)
    _shape_poly._bounds_decision = counted(orig_poly)
    try:
        yield seen
    finally:
        _decision.bounds_decision, _shape_poly._bounds_decision = orig_module, orig_poly
