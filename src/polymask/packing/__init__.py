"""The packed layout: examples of one ragged axis concatenated into fixed rows.

``ragged_map(..., layout="packed")`` runs a function written for one example
on rows of ``row_size`` positions that hold several examples end to end, with
segment ids (MaxText's packed datasets, jraph's graph batching, PyTorch's
jagged nested tensors). Nothing is padded to a bucket: the only padding is
the unused tail of each row. The user's code is not rewritten by hand: the
same symbolic trace as ``mask`` gives the jaxpr, and the packed interpreter
(``interpreter.py``) evaluates it with a second rule table keyed by primitive
(``rules/``), where each primitive gets its per-segment meaning: reductions
along the packed axis are segment reductions, products of two packed axes
are block-diagonal (attention scores), positions restart at segment starts,
scans reset at segment starts.

Data flow: ``segments.py`` packs examples into rows on the host and gives
the traced per-row segment arrays; ``interpreter.py`` walks the jaxpr;
``rules/`` holds one module per rule family; ``runners/packed.py`` compiles
and runs the rows and unpacks each example's outputs.

Layer: imports ``_jax_compat``, ``core``, ``tracing`` and ``rules`` (the
family of each primitive); never ``ops``, ``inspection`` or the packages above.
"""

from . import rules  # noqa: F401  (registers the packed rules)
from .interpreter import PackedProgram, packed_program
from .registry import PackedUnsupported, PerSegment, packed_primitives
from .segments import RowPacking, Segments, pack_rows

__all__ = ["PackedProgram", "packed_program", "PackedUnsupported", "PerSegment",
           "packed_primitives", "RowPacking", "Segments", "pack_rows"]
