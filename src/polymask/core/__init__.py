"""The masking core: what a padded value and its sizes are, independent of tracing.

Errors (``errors``), shape specs (``specs``), dim var names and conditions
(``dimvars``), dimension expressions at their bound or logical value
(``shapes``), validity masks (``masks``), the per-thread state of the masked
traces in progress (``trace_state``), the ``Masked`` pytree (``masked``), bucket policies
(``buckets``), the one dim-var solver and call plans (``plan``), how a
function's arguments bind to specs (``binding``), the user's frames and JAX's
errors translated (``diagnostics``).

Layer: imports ``_jax_compat`` only (and JAX/NumPy); every other package may
import it.
"""
