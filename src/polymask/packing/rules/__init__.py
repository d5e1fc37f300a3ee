"""Packed rules, one module per family; importing this package registers them.

Each module registers packed rules in ``packing.registry`` for the members
of a rule family (``rules.families.FAMILIES`` names the members, so a
primitive gets its packed meaning from the family it already belongs to).
"""

from . import (  # noqa: F401  (imported for their registrations)
    calls,
    contractions,
    control_flow,
    cumulative,
    elementwise,
    indexing,
    layout,
    reductions,
    sorting,
    windows,
)
