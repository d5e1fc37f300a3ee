"""``jax.numpy`` numeric internals (part of ``_jax_compat``; import it as
``from polymask._jax_compat import numeric as compat_numeric``).

``jnp.searchsorted``, ``jnp.digitize``, ``jnp.interp``, ``jnp.convolve`` and
``jnp.correlate`` need a concrete length in Python (``len(x)``, the index
dtype); ``rules/numeric.py`` routes them through trace patches that need their
home module and ``jnp``'s argument checks and type promotion.
"""

from __future__ import annotations

__all__ = ["lax_numpy_module", "array_methods_module", "interp_home", "conv_home", "fft_core_home",
           "newshape_home", "ensure_arraylike", "promote_dtypes",
           "promote_dtypes_inexact", "searchsorted_methods"]


def lax_numpy_module():
    """The module defining ``jnp.searchsorted`` / ``digitize`` / ``interp`` /
    ``convolve``; its module globals ``searchsorted``, ``_interp`` and
    ``_conv`` are what ``digitize``, ``interp``, ``convolve`` and
    ``correlate`` call."""
    from jax._src.numpy import lax_numpy

    return lax_numpy


def array_methods_module():
    """``jax._src.numpy.array_methods`` (``_compute_newshape``: ``x.reshape(-1, ...)``)."""
    from jax._src.numpy import array_methods

    return array_methods


def interp_home():
    """``(module, name)`` of ``jnp.interp``'s core ``_interp`` (reads ``len(xp)``)."""
    return lax_numpy_module(), "_interp"


def conv_home():
    """``(module, name)`` of ``jnp.convolve``/``correlate``'s core ``_conv``."""
    return lax_numpy_module(), "_conv"


def fft_core_home():
    """``(module, name)`` of ``jnp.fft``'s core ``_fft_core`` (``operator.index``
    of the lengths ``n`` / ``s``)."""
    from jax._src.numpy import fft

    return fft, "_fft_core"


def newshape_home():
    """``(module, name)`` of the ``-1`` inference of ``x.reshape``."""
    return array_methods_module(), "_compute_newshape"


def ensure_arraylike(fun_name: str, *args):
    from jax._src.numpy import util as _util

    return _util.ensure_arraylike(fun_name, *args)


def promote_dtypes(*args):
    from jax._src.numpy import util as _util

    return _util.promote_dtypes(*args)


def promote_dtypes_inexact(*args):
    from jax._src.numpy import util as _util

    return _util.promote_dtypes_inexact(*args)


def searchsorted_methods() -> tuple[str, ...]:
    """The ``method=`` values ``jnp.searchsorted`` accepts."""
    from jax._src.numpy import hijax as _hijax

    return tuple(_hijax.SearchSorted.valid_methods)
