"""Total-order comparisons (``eq_to``, ``le_to``, ``lt_to``): elementwise.

JAX binds them in ``jnp.searchsorted`` (and so ``jnp.digitize`` and
``jnp.histogram``). Like ``lt``/``le``/``eq`` they read one position of each
operand: the padded result is the primitive on the padded operands.
"""

from __future__ import annotations

from jax import lax

from .families import defelementwise

defelementwise(lax.eq_to_p, lax.le_to_p, lax.lt_to_p, module=__name__)
