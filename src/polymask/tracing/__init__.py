"""The masked trace: from ``mask(f)`` to padded outputs.

``transform`` (``mask()``, cache per padded signature) traces ``f`` on symbolic
shapes (``symbolic``), splits the trace into cases where JAX cannot decide a
size comparison (``cases/``), checks the sizes (``prologue``) and runs the
masking interpreter (``interpreter``) over the jaxpr with the per-run facts of
``state``; the interpreter finds each primitive's rule in the table of
``registry``, which the ``rules`` package fills (as JAX's interpreters hold
the rule tables that ``lax`` fills).

Layer: imports ``_jax_compat`` and ``core``; never ``rules``, ``ops`` or the
packages above them.
"""
