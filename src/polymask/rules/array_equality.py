"""``jnp.array_equal`` and ``jnp.array_equiv`` on arrays whose sizes are
different dim vars.

``array_equal`` turns a shape comparison into a *value* (False when
``a1.shape != a2.shape``); ``array_equiv`` broadcasts, which JAX's symbolic
shapes refuse for two different dim vars. With symbolic shapes JAX answers ``n == m`` structurally (False
for two different dim vars), so plain JAX's code would return False even when
the sizes are equal at run time: a silent wrong result. While a masked
function is traced (``compat.replace_during_trace``) the shape comparison is
made as a comparison in the user's code (``compat.sizes_compared_as_user``):
undecidable, it splits the trace into cases (``n == m`` or not), in each of
which JAX's own function then runs with decidable shapes. Outside a masked
trace JAX's own run.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from .._jax_compat import numeric as compat_numeric
from .util import has_symbolic_shape, in_masked_trace

__all__ = ["array_equal_dynamic", "array_equiv_dynamic"]

_LAX_NUMPY = compat_numeric.lax_numpy_module()
_ORIGINAL_EQUAL = _LAX_NUMPY.array_equal
_ORIGINAL_EQUIV = _LAX_NUMPY.array_equiv


def array_equal_dynamic(a1, a2, equal_nan: bool = False):
    """``jnp.array_equal`` whose shape test splits the trace when undecidable.

    Returns a bool scalar, as JAX's."""
    if in_masked_trace() and has_symbolic_shape(a1, a2):
        with compat.sizes_compared_as_user():
            same = np.shape(a1) == np.shape(a2)
        if not same:
            return jnp.array(False)
    return _ORIGINAL_EQUAL(a1, a2, equal_nan=equal_nan)


def array_equiv_dynamic(a1, a2):
    """``jnp.array_equiv`` whose broadcast test splits the trace when undecidable
    (JAX's own then runs: it raises where the sizes cannot broadcast, as on the
    exact arrays, where its ``except ValueError`` misses the ``TypeError``).

    Returns a bool scalar; raises ``TypeError`` (a ``ShapeError`` case inside
    ``mask``) for shapes that do not broadcast."""
    if in_masked_trace() and has_symbolic_shape(a1, a2):
        with compat.sizes_compared_as_user():
            for d1, d2 in zip(reversed(np.shape(a1)), reversed(np.shape(a2))):
                _ = d1 == d2 or d1 == 1 or d2 == 1  # decided per case (a split)
    return _ORIGINAL_EQUIV(a1, a2)


compat.replace_during_trace("jnp.array_equal", array_equal_dynamic)
compat.replace_during_trace("jnp.array_equiv", array_equiv_dynamic)
compat.replace_during_trace("jax._src.numpy array_equal", array_equal_dynamic)
compat.replace_during_trace("jax._src.numpy array_equiv", array_equiv_dynamic)
