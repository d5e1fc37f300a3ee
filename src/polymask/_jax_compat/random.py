"""jax.random internals (part of ``_jax_compat``; import it as
``from polymask._jax_compat import random as compat_random``).

``jax.random.permutation`` / ``shuffle`` / ``choice(replace=False)`` sort by
random bits in ``jax._src.random.core._shuffle``, and ``choice(p=...)``
searches with ``jnp.searchsorted``; both need a concrete size in Python
before binding any primitive. polymask routes them through trace patches
(``rules/random_samplers.py``) that need the functions' homes, JAX's number
of sort rounds, its type promotion and its sort comparators.
"""

from __future__ import annotations

import numpy as np

__all__ = ["shuffle_home", "shuffle_rounds", "shuffle_max_size", "searchsorted_home",
           "promote_dtypes", "sort_comparator"]


def shuffle_home():
    """``(module, name)`` of JAX's ``_shuffle(key, x, axis)``, the sort-based
    shuffle that ``permutation`` and ``choice`` call by module-global name."""
    from jax._src.random import core as _random_core

    return _random_core, "_shuffle"


def shuffle_rounds(size: int) -> int:
    """JAX's number of sort rounds for ``size`` elements (``_shuffle``'s static
    stop criterion: ``ceil(3 * log(max(1, size)) / log(2**32 - 1))``)."""
    uint32max = np.iinfo(np.uint32).max
    return int(np.ceil(3 * np.log(max(1, size)) / np.log(uint32max)))


def shuffle_max_size(rounds: int) -> int:
    """The largest size that ``shuffle_rounds`` gives at most ``rounds`` rounds."""
    lo, hi = 1, 2 ** 62  # shuffle_rounds(lo) <= rounds < shuffle_rounds(hi) for rounds < 6
    if shuffle_rounds(hi) <= rounds:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if shuffle_rounds(mid) <= rounds:
            lo = mid
        else:
            hi = mid
    return lo


def searchsorted_home():
    """``(module, name)`` of the ``searchsorted`` that JAX's own modules call as
    ``jnp.searchsorted`` (``jax._src.numpy``; ``jax.random.choice(p=...)``
    draws with it). User code calls ``jax.numpy.searchsorted``, a separate
    binding that a patch here leaves alone."""
    from jax._src import numpy as _jnp

    return _jnp, "searchsorted"


def promote_dtypes(*args):
    """``jnp``'s type promotion of the operands (weak types included)."""
    from jax._src.numpy import util as _util

    return _util.promote_dtypes(*args)


def sort_comparator(side: str):
    """``searchsorted``'s comparison (``lax.sort``'s total order: NaNs last,
    ``-0.0 < 0.0``): go left where ``query <= a[mid]`` (``side="left"``) or
    ``query < a[mid]`` (``side="right"``)."""
    from jax._src.lax import lax as _lax

    return _lax._sort_le_comparator if side == "left" else _lax._sort_lt_comparator
