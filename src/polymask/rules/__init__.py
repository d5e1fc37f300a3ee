"""Masking rules, one module per family; importing this package registers them.

Each module registers its primitives' rules in ``tracing.registry`` (the
rule table the interpreter reads) and, for JAX functions that refuse symbolic
sizes, a replacement during the trace (a row of ``_jax_compat/patches.py``).

Layer: imports ``_jax_compat``, ``core`` and ``tracing``; never ``ops`` or the
packages above.
"""

from ..tracing.registry import RuleContext, get_rule, register, registered_primitives
from . import (  # noqa: F401  (imported for their registrations)
    approx_topk,
    array_equality,
    callbacks,
    checks,
    comparisons,
    contractions,
    control_flow,
    cumulative,
    custom_batching,
    custom_derivatives,
    data_dependent,
    elementwise,
    indexing,
    inlined,
    layout,
    linalg,
    linalg_lstsq,
    numeric,
    ragged_dot,
    random,
    random_samplers,
    reductions,
    reshaping,
    scans,
    slicing,
    sorting,
    windows,
)

__all__ = ["RuleContext", "get_rule", "register", "registered_primitives"]
