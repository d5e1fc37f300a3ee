"""jax.numpy.linalg internals (part of ``_jax_compat``; import it as
``from polymask._jax_compat import linalg as compat_linalg``).

``jnp.linalg.pinv`` and ``jnp.linalg.lstsq`` call module-global helpers
(``_pinv``, the custom-JVP core, and ``_jit_lstsq``) after checking their
arguments; polymask's trace patches (``rules/linalg_lstsq.py``) replace those
helpers, so a reference to ``jnp.linalg.pinv`` taken before the trace is
routed too.
"""

from __future__ import annotations

__all__ = ["pinv_home", "lstsq_home", "thin_qr_jvp"]


def _module():
    from jax._src.numpy import linalg as _jnp_linalg

    return _jnp_linalg


def pinv_home():
    """``(module, name)`` of ``_pinv(a, rtol, hermitian)`` (``rtol`` resolved
    from ``rcond`` already; ``None`` for JAX's default)."""
    return _module(), "_pinv"


def lstsq_home():
    """``(module, name)`` of ``_jit_lstsq(a, b, rcond)`` (``numpy_resid=False``)."""
    return _module(), "_jit_lstsq"


def thin_qr_jvp(q, r, dx):
    """JAX's tangents ``(dq, dr)`` of a thin QR ``x = q r`` (``m >= n``, ``r``
    invertible): ``jax._src.lax.linalg._thin_qr_jvp``."""
    from jax._src.lax import linalg as _lax_linalg

    return _lax_linalg._thin_qr_jvp(q, r, dx)
