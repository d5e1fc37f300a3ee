"""``ragged_map``'s layout choice: which examples of a call run packed, and why.

``layout="padded"`` runs every example in length buckets (``ragged.py``);
``"packed"`` packs the examples that fit a row (``packed.py``) and raises
``PackedUnsupported`` when the function cannot run packed; ``"auto"`` packs
when the function has a packed rule for every primitive and the cost model
(``packing/cost.py``) says packing computes less for the call's lengths,
else pads. Examples longer than a row, or of a size the row program does not
serve (another traced case, ``x[1:]`` at ``n = 0``), run padded either way.
``last`` records what the last call did and why (``stats()["layout"]``).
"""

from __future__ import annotations

import threading
import traceback
import warnings
from collections.abc import Callable

from ..core.buckets import int_arg
from ..core.diagnostics import is_library_frame, user_frame_of_exception, user_stacklevel
from ..core.errors import PackedLayoutWarning, ShapeError, UnsupportedError, counted
from ..core.specs import as_constraints
from ..packing import PackedUnsupported, pack_rows
from ..packing.cost import packed_cost, padded_cost
from .packed import PackedRunner, default_row_size

LAYOUTS = ("padded", "packed", "auto")

__all__ = ["LAYOUTS", "LayoutChoice"]


class LayoutChoice:
    """The packed layout of one ``ragged_map`` and the choice per call.

    Attributes:
      layout: ``"padded"``, ``"packed"`` or ``"auto"``.
      row_size, rows_per_call, segments_per_row: as ``ragged_map``'s (None:
        chosen at the first call).
      runner: the ``PackedRunner`` (its one row program), once a call packed.
      refusals: why this function never runs packed with the specs of a
        call (``repr`` of them -> the reason; found once, kept). Without
        ``in_specs`` each call's specs are read off its examples, so a first
        call of equal lengths (no dim var) does not refuse later calls.
      last: ``{"padded": count, "packed": count, "reason": text}`` of the
        last call.
    """

    def __init__(self, fun: Callable, constraints, layout: str, row_size: int | None,
                 rows_per_call: int | None, segments_per_row: int | None, max_cases: int,
                 numpy_outputs: bool, compiler_options: Callable[[], dict | None]):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.fun, self.constraints = fun, as_constraints(constraints)
        self.layout = layout
        # a float or a string is a mistake, never truncated (100.5 ran rows of 100)
        self.row_size, self.rows_per_call, self.segments_per_row = (
            None if v is None else int_arg(v, name, 1)
            for v, name in ((row_size, "row_size"), (rows_per_call, "rows_per_call"),
                            (segments_per_row, "segments_per_row")))
        self.max_cases, self.numpy_outputs = max_cases, numpy_outputs
        self._compiler_options = compiler_options
        self.runner: PackedRunner | None = None
        self._lock = threading.Lock()
        self.refusals: dict[str, str] = {}
        self.last: dict = {}
        self._warned_padded = False

    def runner_for(self, longest: int) -> PackedRunner:
        """The packed runner (made at the first call: rows of ``row_size``,
        else the default for the longest example)."""
        with self._lock:  # threads' first calls share one runner (one program)
            return self._runner_for(longest)

    def _runner_for(self, longest: int) -> PackedRunner:
        if self.runner is None:
            R = self.row_size or default_row_size(longest)
            S = self.segments_per_row or min(R, 128)
            # one long-lived program: the refined programs' options (those that
            # compile slower and run faster) when given
            self.runner = PackedRunner(self.fun, self.constraints, R, S, self.rows_per_call,
                                       self.max_cases, self.numpy_outputs,
                                       self._compiler_options())
        return self.runner

    def run_packed(self, kinds, infos, in_specs, broadcast, bcast_leaves, results,
                   policy_for: Callable, batch_size: int) -> list[int]:
        """Run the examples that fit a row packed, writing their outputs to
        ``results``; return the indices left to the padded layout.

        Raises:
          PackedUnsupported: ``layout="packed"`` and the call cannot run packed.
        """
        every = [i for idxs in kinds.values() for i in idxs]
        specs = repr(in_specs)  # (a refusal holds for the specs it was found with)
        if specs in self.refusals:
            return self._refuse(self.refusals[specs], every)
        if len(kinds) != 1:
            return self._refuse(_several_kinds(kinds, infos), every)
        ((tree, *_), idxs), = kinds.items()
        plan0 = infos[idxs[0]][0]
        if not plan0.var_names:
            return self._refuse(
                "no axis of this call's examples has a dim var (without in_specs, an axis "
                "is ragged where the examples' sizes differ, or differed in an earlier "
                "call): nothing to pack", every, permanent=specs)
        if len(plan0.var_names) != 1:
            return self._refuse(
                f"the specs name {len(plan0.var_names)} dim vars "
                f"({', '.join(plan0.var_names)}); the packed layout packs one ragged axis "
                "(give the other axes their constant sizes, e.g. 'n, 4' for 'n, d')",
                every, permanent=specs)
        lengths = {i: int(infos[i][0].values[0]) for i in idxs}
        runner = self.runner_for(max(lengths.values()))
        try:
            prog = runner.prepare(plan0, infos[idxs[0]][1], tree, broadcast, in_specs)
        except PackedUnsupported as e:
            return self._refuse(str(e), every, permanent=specs)
        except Exception as e:  # noqa: BLE001 - auto: the padded layout is the reference
            if self.layout == "packed" and (isinstance(e, (ShapeError, UnsupportedError))
                                            or getattr(e, "polymask_call_signature", False)):
                raise  # the user's call is wrong (specs, arguments), not a layout question
            why = _first_line(e, "while tracing packed")
            if _raised_by_the_function(e):  # its own line: maybe its own error
                why += (f" (raised at {user_frame_of_exception(e)}, in the function or a "
                        "library it calls, on the packed trace's symbolic sizes: a check that "
                        "sizes are Python ints fails so; layout='auto' or 'padded' runs it "
                        "where plain JAX does and names the sizes where plain JAX fails too; "
                        "ragged_map calls fun(*broadcast, *example), the broadcast arguments "
                        "first)")
            return self._refuse(why, every, permanent=specs)
        fits = [i for i in idxs if lengths[i] <= runner.row_size and prog.runs(lengths[i])]
        if not fits:  # the function packs; these sizes do not: padded, in any layout
            self.last["reason"] = ("padded: no example of this call runs packed ("
                                   f"{_why_padded(every, lengths, runner.row_size)})")
            self._warn_padded(every, lengths, runner.row_size)
            return every
        rows = len(pack_rows([lengths[i] for i in fits], runner.row_size, runner.slots,
                             prog.gap).rows)
        B = runner.choose_rows_per_call(rows)
        if self.layout == "auto":
            var = prog.var
            try:
                packed = packed_cost(prog.program, var, -(-rows // B) * B, prog.positions)
                padded = padded_cost(prog.program, var, [lengths[i] for i in fits],
                                     policy_for(plan0.var_names[0]), batch_size)
            except Exception as e:  # noqa: BLE001 - a size the model cannot evaluate
                return self._refuse(f"the cost model failed: {type(e).__name__}: {e}", every)
            if packed > padded:
                return self._refuse(f"the cost model gives packed {packed:.3g} > padded "
                                    f"{padded:.3g} (elements and dot FLOPs)", every)
            reason = f"cost model: packed {packed:.3g} <= padded {padded:.3g}"
        else:
            reason = "layout='packed'"
        fitting = set(fits)
        left = [i for i in every if i not in fitting]
        self._warn_padded(left, lengths, runner.row_size)  # before running: it may raise
        try:
            runner.run(fits, infos, bcast_leaves, results, prog.program.out_tree)
        except PackedUnsupported as e:  # met while tracing the row program
            return self._refuse(str(e), every, permanent=specs)
        except Exception as e:  # noqa: BLE001 - auto: the padded layout is the reference
            if runner.stats["calls"] or (self.layout == "packed"
                                         and isinstance(e, (ShapeError, UnsupportedError))):
                raise  # a failure after packed rows ran is not a layout question
            return self._refuse(_first_line(e, "while tracing packed"), every, permanent=specs)
        if left:
            reason += (f"; {counted(len(left), 'example')} ran padded "
                       f"({_why_padded(left, lengths, runner.row_size)})")
        self.last["reason"] = reason
        return left

    def _warn_padded(self, left: list[int], lengths: dict, row_size: int) -> None:
        """``layout="packed"`` asked for rows: say once, before the call runs, that
        examples longer than a row run padded (``"auto"`` chooses per call and
        says it in ``last``; the few sizes of another traced case, such as
        ``n = 0``, are said there). Where warnings are errors, every such call
        raises, and none runs."""
        longer = [lengths[i] for i in left if lengths[i] > row_size]
        if self.layout != "packed" or self._warned_padded or not longer:
            return
        if self.row_size is None:
            advice = (f"row_size was chosen from the first call's longest example; pass "
                      f"row_size={default_row_size(max(longer))} or more to pack them")
        else:
            advice = "a larger row_size packs them"
        verb = "runs" if len(longer) == 1 else "run"
        warnings.warn(PackedLayoutWarning(
            f"ragged_map(layout='packed'): {counted(len(longer), 'example')} of this call "
            f"{verb} padded, in length buckets: longer than row_size={row_size} (the "
            f"longest: {max(longer)}; {advice}). Their values are right; each bucket "
            "compiles once. Warned once; stats()['layout']['reason'] says it per call."),
            stacklevel=user_stacklevel())
        self._warned_padded = True

    def _refuse(self, reason: str, idxs: list[int], permanent: str | None = None) -> list[int]:
        """Send ``idxs`` to the padded layout for ``reason`` (``"packed"``: raise),
        kept for later calls of the specs ``permanent`` (their ``repr``) when given."""
        if self.layout == "packed":
            raise PackedUnsupported(f"ragged_map(layout='packed'): {reason}; "
                                    "layout='auto' or 'padded' runs it in the padded layout")
        if permanent is not None:
            self.refusals[permanent] = reason
        self.last["reason"] = f"padded: {reason}"
        return idxs


def _why_padded(left: list[int], lengths: dict, R: int) -> str:
    """Which of the examples ``left`` are longer than a row and which are of a
    size the row program does not serve, with their sizes."""
    longer = sorted({lengths[i] for i in left if lengths[i] > R})
    other = sorted({lengths[i] for i in left if lengths[i] <= R})
    parts = []
    if longer:
        parts.append(f"longer than row_size={R}: sizes {_listed(longer)}")
    if other:
        parts.append(f"sizes the row program does not serve: {_listed(other)} (where the "
                     "function raises or takes another case, or jnp's clamps like x[1:] "
                     "at n = 0)")
    return "; ".join(parts)


def _listed(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")


def _raised_by_the_function(e: BaseException) -> bool:
    """Whether ``e`` came out of the user's function (a frame of it is in the
    traceback), not out of polymask's packing code around it."""
    return any(not is_library_frame(fr.filename)
               for fr in traceback.extract_tb(e.__traceback__))


def _first_line(e: Exception, what: str) -> str:
    text = str(e).strip()
    return f"{type(e).__name__} {what}: {text.splitlines()[0] if text else ''}"


def _several_kinds(kinds, infos) -> str:
    """Why examples cannot share one packed program, naming the first example
    of two kinds and their leaves (dtype, shape)."""
    (a, *_), (b, *_) = list(kinds.values())[:2]

    def leaves(i):
        return ", ".join(f"{p.path} {p.dtype} {tuple(p.shape)}" for p in infos[i][0].leaves)

    return (f"examples of several kinds (trees, dtypes, dim vars or static axis sizes): "
            f"examples[{a}] has {leaves(a)}, examples[{b}] has {leaves(b)}; one packed "
            "program takes one kind (cast them to one dtype, or use layout='padded', which "
            "runs each kind in its own batches)")

