"""Case splits: one masked program per outcome of a size comparison JAX cannot decide.

``tree``: the ``CaseTree`` of ``Case``s (conditions, outputs, error cases);
``splitting``: ``trace_cases``, tracing each outcome; ``refine``: error cases
refined per size; ``dispatch``: the sizes choose the case at run time
(Python eagerly, ``lax.switch`` when traced, per example under ``vmap``).

Layer: part of ``tracing``; imports ``_jax_compat``, ``core`` and
``tracing.symbolic`` / ``tracing.prologue``.
"""
