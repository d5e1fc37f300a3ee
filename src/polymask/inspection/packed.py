"""``explain(..., layout="packed")``: how a function runs in the packed layout.

The packed interpreter (``packing/``) evaluates the function's symbolic trace
on one row of packed examples under ``jax.make_jaxpr``, with an observer that
records, per equation, the packed rule it ran (``packing/rules/``), or that
it was bound on shared values or ``vmap``-ed over the segment slots, and what
kind each result is (packed along which axes, one value per example, or
shared). When the function cannot run packed, the explanation says why (the
primitive, the case and the user's line): that is what ``ragged_map``'s
``layout="auto"`` falls back to the padded layout for.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from ..core.dimvars import sizes_text
from ..packing import PackedUnsupported, packed_program
from ..packing.registry import PerSegment
from ..packing.segments import POSITION_FIELDS, SEGMENT_FIELDS
from ..tracing.cases.splitting import DEFAULT_MAX_CASES
from .sizetable import short_path

__all__ = ["PackedRow", "PackedExplanation", "explain_packed"]


@dataclasses.dataclass
class PackedRow:
    """One equation of the packed row program."""

    index: int
    primitive: str
    shapes: list[str]  # symbolic output shapes
    kinds: list[str]  # per output: "packed axes (0,)", "per example", "shared"
    how: str  # the packed rule (module.function), "bound (shared)", "vmap over segments"
    source: str


class PackedExplanation(str):
    """The text, plus ``runs`` (bool), ``reason`` (why not, or None),
    ``rows`` (``PackedRow``s, up to the refusal), ``padded_sizes`` (sizes
    of other traced cases: they run in the padded layout) and
    ``raising_sizes`` (sizes where the function raises, as on the exact
    arrays: a ``ShapeError`` in either layout)."""

    rows: list[PackedRow]
    runs: bool
    reason: str | None
    padded_sizes: list[int]
    raising_sizes: list[int]

    def __new__(cls, text, rows, runs, reason, padded_sizes, raising_sizes=()):
        obj = super().__new__(cls, text)
        obj.rows, obj.runs, obj.reason, obj.padded_sizes = rows, runs, reason, padded_sizes
        obj.raising_sizes = list(raising_sizes)
        return obj


def _kind(out, axes) -> str:
    if isinstance(out, PerSegment):
        return "per example"
    return f"packed axes {tuple(axes)}" if axes else "shared"


def _qualname(how: str) -> str:
    return how.replace(".<locals>", "")


def explain_packed(fun, in_specs, absargs, constraints=(), segments_per_row=None,
                   max_cases: int = DEFAULT_MAX_CASES,
                   runner: str = "ragged_map") -> PackedExplanation:
    """The packed layout's view of ``fun`` at ``absargs`` (``ShapeDtypeStruct``s
    whose ragged axes have the row size). Leading arguments whose spec is None
    are shared (``ragged_map``'s broadcast arguments); later ones without a
    dim var have one value per example.

    A ``PackedUnsupported`` is not raised but returned as ``.reason``.
    ``runner``: ``"ragged_map"`` or ``"value_and_grad"``, whose packed
    layout the text describes.

    Raises:
      ShapeError, UnsupportedError: as ``mask`` does for bad specs or
        arguments, or a primitive without a masking rule.
    """
    specs = tuple(in_specs) if isinstance(in_specs, (tuple, list)) else (in_specs,)
    n_bcast_args = next((i for i, s in enumerate(specs) if s is not None), len(specs))
    n_bcast = len(jax.tree_util.tree_leaves(absargs[:n_bcast_args]))
    rows: list[PackedRow] = []
    reason, padded_sizes, raising, R, S = None, [], [], None, None
    try:
        prog = packed_program(fun, absargs, specs, constraints, n_bcast, max_cases)
        R = prog.row_size
        S = int(segments_per_row or min(R, 128))
        others = [n for n in range(R + 1) if not prog.runs(n)]
        raising = [n for n in others if prog.raises(n)]
        padded_sizes = [n for n in others if n not in raising]

        def observe(eqn, how, outs):
            run_axes = [tuple(i for i, d in enumerate(getattr(v.aval, "shape", ()))
                              if prog.sizes.offset(d) is not None) for v in eqn.outvars]
            rows.append(PackedRow(
                len(rows), eqn.primitive.name,
                [prog.program.display(str(tuple(getattr(v.aval, "shape", ()))))
                 for v in eqn.outvars],
                [_kind(o, a) for o, a in zip(outs, run_axes)], _qualname(how),
                compat.source_line(eqn.source_info)))

        leaves = jax.tree_util.tree_leaves(absargs)
        avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves[:n_bcast]]
        for x, axes in zip(leaves[n_bcast:], prog.packed_axes):
            shape = tuple(prog.positions if i in axes else d for i, d in enumerate(np.shape(x)))
            avals.append(jax.ShapeDtypeStruct(shape if axes else (S, *shape), x.dtype))
        avals += [jax.ShapeDtypeStruct((prog.positions if f in POSITION_FIELDS else S,),
                                       jnp.int32)
                  for f in SEGMENT_FIELDS]
        jax.make_jaxpr(prog.row_fn(n_bcast, observe=observe))(*avals)
    except PackedUnsupported as e:
        reason = str(e)
    _user_lines(rows)
    runs = reason is None
    gap = prog.gap if reason is None else 0
    text = _render(fun, R, S, runs, reason, padded_sizes, rows, gap,
                   sizes_text([{prog.var: n} for n in raising]) if raising else "", runner)
    return PackedExplanation(text, rows, runs, reason, padded_sizes, raising)


def _user_lines(rows: list[PackedRow]) -> None:
    """Equations inside a library's ``jit`` (``jnp.cumsum``) have no user
    line; the enclosing equation, observed after them, has it."""
    known = None
    for r in reversed(rows):
        if "<unknown" in r.source and known is not None:
            r.source = known
        elif "<unknown" not in r.source:
            known = r.source


def _render(fun, R, S, runs, reason, padded_sizes, rows, gap=0, raising="",
            runner="ragged_map") -> str:
    name = getattr(fun, "__name__", repr(fun))
    out = [f"polymask.explain: {name}, packed layout"]
    if runs:
        out.append(f"can run packed: rows of {R} positions (the ragged axis's padded size "
                   f"in the example arguments: {runner}'s row_size), up to {S} examples per "
                   "row" + ("; ragged_map(layout='auto') packs when its cost model says "
                            "packing computes less than length buckets for the batch at hand"
                            if runner == "ragged_map" else ""))
        if gap:
            out.append(f"each example is followed by {gap} free positions (sizes n + c with "
                       "c > 0, or windows reaching past an example's ends), so a row holds "
                       f"{R + gap} positions")
        if padded_sizes:
            out.append("sizes that run in the padded layout (another traced case, or a size "
                       "like max(0, n - 1) that is not n + c there): " + str(padded_sizes))
        if raising:
            out.append("sizes where the function raises, as on the exact arrays (a ShapeError "
                       "in either layout): " + raising)
    else:
        out.append("cannot run packed (ragged_map(layout='auto') runs it in the padded "
                   "layout; layout='packed' raises PackedUnsupported):" if runner == "ragged_map"
                   else f"cannot run packed ({runner}(layout='packed') raises "
                   "PackedUnsupported; layout='padded' runs it):")
        out.extend("  " + line for line in reason.splitlines())
    if not rows:
        return "\n".join(out)
    out += ["", "equations (shape = symbolic output shape; kind: packed axes hold the row's "
                "examples end to end, per example = one value per segment, shared = the same "
                "for all; how = the packed rule, or bound / vmapped when no axis is packed):"]
    cells = [(f"{r.index:>3} {r.primitive}", ", ".join(r.shapes), ", ".join(r.kinds), r.how)
             for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    last = None
    for r, c in zip(rows, cells):
        if r.source != last:
            last = r.source
            out.append(f"  {short_path(r.source)}")
        out.append("  " + "  ".join(f"{v:<{w}}" for v, w in zip(c, widths)).rstrip())
    return "\n".join(out)
