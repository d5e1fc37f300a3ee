"""``polymask.ragged_map``: map a function over examples of different sizes.

Examples are planned one by one on the host (``plan.plan_call``), grouped by
kind (dim vars, dtypes, static leaves, and the values of static leaves a
batch cannot stack; numbers, arrays and keys that differ are stacked per
row, ``ragged_batches.stack_varying_statics``), sorted by size (largest first, like
sentence-transformers; results come back in input order) and cut into
batches of consecutive examples; a batch pads every example to the largest
bucket in it (``ragged_batches.rebucket``), so the only padding is the bucket's
rounding of the batch's longest example and no batch is partial but the
last. Batches are stacked with NumPy and run as ``jax.jit(jax.vmap(mask(fun)))``:
one program per bucket signature and row count. A final partial batch runs in
the power of two of rows that holds it (or a full-batch program already
compiled). ``batch_tokens`` sizes batches by a budget of padded elements.
``refine_buckets`` lets repeated calls run batches in tighter programs
compiled after a call (``refining.Refinement``). ``programs.ProgramCache``
keeps the compiled programs and the stats, ``programs.CallPlans`` the plans.
"""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..core.binding import runner_specs
from ..core.buckets import as_policy, int_arg
from ..core.diagnostics import at_call_site, user_call_site, with_size_names
from ..core.errors import FailsAsPlainJax, ShapeError, UnsupportedError, about_example
from ..core.masked import Masked
from ..core.plan import dtype_key, policy_getter
from ..core.shapes import native_byte_order
from ..core.specs import as_constraints
from ..tracing.cases.splitting import DEFAULT_MAX_CASES
from ..tracing.prologue import raise_run_failure
from . import ragged_batches
from .compiling import background_executor
from .fallback import ExactFallback, bucket_text, falls_back
from .hostio import handed_back, host_view, host_zeros, output_kind, slice_to
from .layout_choice import LayoutChoice
from .packed import PackedRunner, default_row_size, empty_packed_stats, row_example
from .program_store import StorableProgram, active_store, program_key, stored_program
from .programs import (
    STATS_DOC,
    CallPlans,
    ProgramCache,
    build_inner_and_cases,
    case_error_is_plain,
    checked_compiler_options,
    fallback_where,
    finish_stats,
    jit_program,
    raise_case_error,
)
from .refining import Refinement
from .static_args import StaticArgs

__all__ = ["ragged_map", "RaggedMap"]



class _PromotedAxisFails(Exception):
    """A program with an axis made dynamic by ``AxisHistory`` only cannot be
    traced: the call runs again with that axis static."""

class RaggedMap:
    """The callable returned by ``polymask.ragged_map`` (see there).

    ``cache``: its compiled programs and stats (``ProgramCache``); ``plans``:
    the examples' call plans; ``refinement``: refined batch programs
    (``refine_buckets``). ``program_id`` (polymask's own models only): a name
    that determines ``fun``, so the program store loads its programs by name
    without a trace (``program_store.py``)."""

    FORWARD_ONLY = True  # its programs are never differentiated (explain shows that program)

    def __init__(self, fun, in_specs=None, *, buckets=None, batch_size=32, batch_buckets=None,
                 constraints=(), cache_size=64, progress=False, numpy_outputs=False,
                 sort=True, batch_tokens=None, compile_ahead=True, refine_buckets=None,
                 compiler_options=None, refined_compiler_options=None, program_id=None,
                 max_cases=DEFAULT_MAX_CASES, layout="auto", row_size=None,
                 rows_per_call=None, segments_per_row=None, fallback=True, static_argnums=None):
        statics = None if static_argnums is None else StaticArgs(fun, static_argnums, None)
        self.static_args = statics if statics and statics.argnums else None
        if self.static_args is not None:  # static arguments arrive as StaticArgs
            fun = self.static_args.unwrapping(fun)
        self.layouts = LayoutChoice(fun, constraints, layout, row_size, rows_per_call,
                                    segments_per_row, max_cases, numpy_outputs,
                                    lambda: self.refinement.refined_options)
        self.fun = fun
        self.in_specs = runner_specs(fun, in_specs, "ragged_map", accepts_dict=False)
        self.constraints = as_constraints(constraints)
        self.max_cases = int_arg(max_cases, "max_cases", 0)  # (4.0: never truncated)
        self.compiler_options = checked_compiler_options(compiler_options)
        self.plans = CallPlans(self.in_specs, self.constraints, policy_getter(buckets))
        self._axis_history = ragged_batches.AxisHistory()  # auto specs over the calls
        self.cache = ProgramCache(cache_size, self.compiler_options,
                                  build_program=self._stored_or_jit_program,
                                  options_for=self._options_for,
                                  extra_stats=("refined_compiles", "stored_loads",
                                               "exact_compiles", "exact_calls"))
        name = getattr(fun, "__name__", type(fun).__name__)
        # (without specs the dim vars are named for where ragged_map read them off)
        hint = "" if self.in_specs is not None else (
            "\n  (l0_0, l1_0 ...: the dim vars read off the examples, lK_A = axis A of "
            "each example's K-th array; in_specs names them)")
        self._fallback = (ExactFallback(fun, f"ragged_map({name})", self.cache.add,
                                        self.compiler_options, hint=hint)
                          if fallback else None)
        self._unshared: dict = {}  # bucket signature -> why its trace failed
        self.program_id = None if program_id is None else str(program_id)
        self.refinement = Refinement(refine_buckets, self.compiler_options,
                                     refined_compiler_options, cache=self.cache,
                                     program_and_avals=self._program_and_avals,
                                     ready=self._program_ready)
        self.compile_ahead = bool(compile_ahead)
        self.batch_size = int_arg(batch_size, "batch_size", 1)  # (2.5: never truncated)
        self._batch_policy = None if batch_buckets is None else as_policy(batch_buckets)
        self.sort = bool(sort)
        if batch_tokens is not None and int(batch_tokens) < 1:
            raise ValueError("batch_tokens must be >= 1")
        self.batch_tokens = None if batch_tokens is None else int(batch_tokens)
        self.progress = progress
        self.numpy_outputs = numpy_outputs
        functools.update_wrapper(self, fun)

    def __call__(self, examples: Sequence[Any], *broadcast, progress=None, refine: bool = True):
        """Map over ``examples``; ``broadcast`` arguments are passed unbatched first.
        ``refine=False``: this call neither runs in nor queues refined programs
        (``refine_buckets``; a one-shot pass).

        Raises:
          ShapeError: ``examples`` is not a list (or another sequence) of
            examples; an example does not fit the specs (naming it)."""
        try:
            try:
                return self._map(examples, broadcast, progress, refine)
            except _PromotedAxisFails:
                self._axis_history.pin_promoted()  # static again, as the examples read alone
                return self._map(examples, broadcast, progress, refine)
        except (ShapeError, UnsupportedError) as e:
            if self.in_specs is not None:
                raise
            axes = ragged_batches.auto_spec_axes(examples)
            raise with_size_names(e, axes) from e.__cause__

    def _map(self, examples, broadcast, progress, refine):
        examples = _as_example_list(examples)
        if any(isinstance(a, np.ndarray) and not a.dtype.isnative  # (big-endian data)
               for ex in examples for a in (ex if isinstance(ex, tuple) else (ex,))):
            examples = native_byte_order(examples)
        ragged_batches.warn_parallel_lists(examples, broadcast)
        broadcast = self._with_statics(broadcast)
        if not examples:
            return []
        arg_lists = [ex if isinstance(ex, tuple) else (ex,) for ex in examples]
        ragged_batches.warn_batch_drawn_keys(arg_lists)
        if self.in_specs is None:
            # (the packed layout packs one ragged axis: examples of one length too)
            packed = self.layout == "packed"  # (packs one ragged axis, so no history)
            in_specs = ragged_batches.auto_specs(
                arg_lists, leading_if_uniform=packed,
                history=None if packed else self._axis_history)
        else:
            in_specs = self.in_specs
        spec_key = repr(in_specs)
        bcast_leaves, bcast_tree, bcast_key = ragged_batches.broadcast_inputs(broadcast)
        kinds: dict = collections.defaultdict(list)
        infos = []
        for i, args in enumerate(arg_lists):
            try:
                plan, leaves, tree = self.plans.plan(args, in_specs, spec_key)
            except ShapeError as e:  # say which example
                raise about_example(i, e, ragged_batches.specs_hint(e)) from None
            kinds[(tree, ragged_batches.kind_key(plan), ragged_batches.static_values_key(plan, leaves))].append(i)
            infos.append((plan, leaves))
        results: list[Any] = [None] * len(examples)
        self.layouts.last = ({"padded": len(examples), "packed": 0, "reason": "layout='padded'"}
                             if self.layout == "padded" else  # said by run_packed
                             {"padded": 0, "packed": 0, "reason": "the call raised before "
                              "its examples ran"})
        if self.layout != "padded":
            left = set(self.layouts.run_packed(kinds, infos, in_specs, broadcast, bcast_leaves,
                                               results, self.plans.policy_for, self.batch_size))
            kinds = {k: [i for i in idxs if i in left] for k, idxs in kinds.items()}
            kinds = {k: idxs for k, idxs in kinds.items() if idxs}
            self.layouts.last["padded"] = len(left)
            self.layouts.last["packed"] = len(examples) - len(left)
            if not left:
                return results
        batches = []
        for (tree, *_), idxs in kinds.items():
            ragged_batches.stack_varying_statics(infos, idxs)
            if self.sort:  # largest first (sentence-transformers); results in input order
                idxs.sort(key=lambda i: (-infos[i][0].padded, -infos[i][0].logical))
            batches += self._cut_batches(tree, idxs, infos)
        call = (broadcast, bcast_leaves, bcast_tree, bcast_key, in_specs, spec_key)
        batches = self._rows_of_partial_batches(batches, infos, call)
        batches, wanted = (self.refinement.refine_batches(batches, infos, call) if refine
                           else (batches, []))
        if self.sort:
            batches.sort(key=lambda b: -b[1].padded)
        show = self.progress if progress is None else progress
        bar = None
        if show:
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(examples), desc="polymask", unit="ex")
            except ImportError:  # pragma: no cover - tqdm is optional
                bar = None
        self._compile_ahead(batches, infos, broadcast, bcast_leaves, bcast_tree, bcast_key,
                            in_specs, spec_key)
        try:
            for tree, plan, chunk, rows in batches:
                self._run_batch(tree, plan, chunk, infos, results, broadcast,
                                bcast_leaves, bcast_tree, bcast_key, in_specs, spec_key, rows)
                if bar is not None:
                    bar.update(len(chunk))
        except FailsAsPlainJax as e:
            if not broadcast:
                raise
            e.args = (f"{e}\n  (if the argument order is the cause: ragged_map calls "
                      "fun(*broadcast, *example), the broadcast arguments first)",)
            raise
        finally:
            if bar is not None:
                bar.close()
        self.refinement.queue_refined(wanted, infos, *call)
        return results

    def _with_statics(self, broadcast: tuple) -> tuple:
        """``broadcast`` with its static arguments as ``StaticArg``s (``static_argnums``).

        Raises:
          ValueError: ``static_argnums`` names an example argument's position.
        """
        if self.static_args is None:
            return tuple(broadcast)
        late = sorted(i for i in self.static_args.argnums if i >= len(broadcast))
        if late:
            raise ValueError(
                f"ragged_map: static_argnums names argument {late[0]} of "
                f"{self.static_args.fun_name}, but this call passes "
                f"{len(broadcast)} broadcast argument{'s' if len(broadcast) != 1 else ''} "
                "(fun(*broadcast, *example)): only broadcast arguments can be static, as an "
                "example's arguments are batched")
        return self.static_args.wrap(tuple(broadcast), {})[0]

    def positional_arguments(self, args: tuple) -> tuple:
        """``(*broadcast, *example)`` as this map passes them to ``fun``
        (static arguments as ``StaticArg``s; ``polymask.explain``)."""
        if self.static_args is None:
            return tuple(args)
        return self.static_args.wrap(tuple(args), {})[0]

    def specs_for(self, n_args: int):
        """``fun``'s specs for ``n_args`` arguments as ``polymask.mask`` takes
        them: the broadcast arguments (first) get None, then ``in_specs``
        (``polymask.explain(rm, *broadcast, example)`` uses this)."""
        if self.in_specs is None or n_args <= len(self.in_specs):
            return self.in_specs
        return (None,) * (n_args - len(self.in_specs)) + tuple(self.in_specs)

    def explain(self, example, *broadcast, print_output: bool = True, file=None):
        """How this map runs ``example`` (one example, as passed in the list)
        with these ``broadcast`` arguments in the packed layout, before anything
        runs: ``polymask.explain(..., layout="packed")`` with this map's specs
        and row size (``row_size``, else the default for this example's length).
        Returns a ``PackedExplanation`` (``.runs``, ``.reason``, ``.rows``);
        ``stats()["layout"]`` says what a call then did (the cost model
        decides between the layouts per call).

        Raises:
          ShapeError: the example does not match the specs.
        """
        from ..inspection.explain import explain

        broadcast = self._with_statics(broadcast)
        args = example if isinstance(example, tuple) else (example,)
        in_specs = self.in_specs if self.in_specs is not None else \
            ragged_batches.auto_specs([args])
        plan, leaves, tree = self.plans.plan(args, in_specs, repr(in_specs))
        if len(plan.var_names) != 1:
            return explain(self.fun, (None,) * len(broadcast) + tuple(in_specs), *broadcast,
                           *args, layout="packed", print_output=print_output, file=file)
        R = self.row_size or default_row_size(int(plan.values[0]))
        example_args = row_example(plan, leaves, tree, R, lambda shape, dtype, weak:
                                   jax.ShapeDtypeStruct(shape, dtype, weak_type=weak))
        return explain(self.fun, (None,) * len(broadcast) + tuple(in_specs), *broadcast,
                       *example_args, layout="packed", print_output=print_output, file=file)

    # -- the layout choice (``layout_choice.py``) ------------------------------------
    @property
    def layout(self) -> str:
        return self.layouts.layout

    @property
    def row_size(self) -> int | None:
        return self.layouts.row_size

    @property
    def rows_per_call(self) -> int | None:
        return self.layouts.rows_per_call

    @property
    def last_layout(self) -> dict:
        """What the last call ran in each layout and why (``stats()["layout"]``)."""
        return self.layouts.last

    @property
    def _packed(self) -> PackedRunner | None:
        return self.layouts.runner

    def _options_for(self, key) -> dict:
        return self.refinement.options_for(key)

    def stats(self) -> dict:
        s = self.cache.stats()
        if self._packed is not None:  # both layouts' programs, calls and padding
            ps = self._packed.stats_snapshot()
            for k in ("calls", "compiles", "xla_compiles", "persistent_cache_hits",
                      "stored_loads", "compile_time_s", "logical_elements", "padded_elements"):
                s[k] += ps[k]
            s["packed"] = dict(ps, row_size=self._packed.row_size,
                               rows_per_call=self._packed.rows_per_call)
        elif self.layout != "padded":  # the same keys before the first call
            s["packed"] = dict(empty_packed_stats(), row_size=self.layouts.row_size,
                               rows_per_call=self.layouts.rows_per_call)
        s = finish_stats(s)
        s["layout"] = dict(self.last_layout)
        return s

    stats.__doc__ = STATS_DOC

    def wait(self) -> None:
        """Wait for the background compiles started so far (refined programs)."""
        self.cache.wait()

    def clear_cache(self) -> None:
        """Drop every compiled program (stats are kept)."""
        self.cache.clear()
        self.plans.clear()

    def _cut_batches(self, tree, idxs, infos) -> list[tuple]:
        """Consecutive examples of one kind as batches ``(tree, plan, chunk, rows)``
        (``rows`` is None for a partial batch: see ``_rows_of_partial_batches``).

        A batch takes examples until the next one would exceed its rows
        (``batch_size``, or ``batch_tokens`` over the batch's padded size); its
        plan pads every example to the largest bucket in it. On examples sorted
        largest first this is sentence-transformers' batching (sort, cut, pad
        to the longest) with the longest rounded up to its bucket: no partial
        batch but the last, and only the bucket's rounding as padding.
        """
        out, start = [], 0
        while start < len(idxs):
            plan = infos[idxs[start]][0]
            end = start + 1
            while end < len(idxs):
                merged = ragged_batches.rebucket(plan, {v: max(b, infos[idxs[end]][0].buckets[v])
                                         for v, b in plan.buckets.items()})
                if end - start + 1 > self._rows(merged):
                    break
                plan, end = merged, end + 1
            chunk = idxs[start:end]
            full = self._rows(plan)
            out.append((tree, plan, chunk, full if len(chunk) >= full else None))
            start = end
        return out

    def precompile(self, example, *broadcast) -> RaggedMap:
        """Compile the full-batch program of ``example``'s bucket now (no run).

        ``example`` is one example (a tuple for several arguments) whose arrays
        may be ``jax.ShapeDtypeStruct`` (a size picks its bucket); ``broadcast``
        are the broadcast arguments (values or structs). Needs ``in_specs``.
        Returns ``self``.

        Raises:
          ValueError: the ``ragged_map`` has no ``in_specs``.
          ShapeError: the example does not fit the specs.
        """
        if self.in_specs is None:
            raise ValueError("ragged_map.precompile needs in_specs")
        broadcast = self._with_statics(broadcast)
        args = example if isinstance(example, tuple) else (example,)
        in_specs, spec_key = self.in_specs, repr(self.in_specs)
        bcast_leaves, bcast_tree, bcast_key = ragged_batches.broadcast_inputs(broadcast)
        plan, leaves, tree = self.plans.plan(args, in_specs, spec_key)
        B = self._rows(plan)
        entry = self.cache.entry((tree, plan.signature, B, bcast_key, spec_key), hit=False)
        make, avals = self._program_and_avals(tree, plan, leaves, B, in_specs, broadcast,
                                              bcast_leaves, bcast_tree)
        self.cache.precompile_entry(entry, make, avals)
        return self

    def precompile_packed(self, example, *broadcast) -> RaggedMap:
        """Compile the packed layout's row program now (no run), for
        ``layout="auto"``/``"packed"`` with ``row_size`` and ``rows_per_call``
        given. ``example``: one example (arrays or ``jax.ShapeDtypeStruct``s; its
        sizes do not matter). Returns ``self``.

        Raises:
          ValueError: ``layout="padded"``, or no ``row_size``/``rows_per_call``.
          PackedUnsupported: the function cannot run packed.
        """
        if self.layout == "padded" or self.row_size is None or self.rows_per_call is None:
            raise ValueError("precompile_packed needs layout 'auto' or 'packed', row_size "
                             "and rows_per_call")
        broadcast = self._with_statics(broadcast)
        args = example if isinstance(example, tuple) else (example,)
        in_specs, spec_key = self.in_specs, repr(self.in_specs)
        bcast_leaves, _, _ = ragged_batches.broadcast_inputs(broadcast)
        plan, leaves, tree = self.plans.plan(args, in_specs, spec_key)
        runner = self.layouts.runner_for(self.row_size)
        runner.prepare(plan, leaves, tree, broadcast, in_specs)
        runner.precompile((plan, leaves), bcast_leaves)
        return self

    def _compile_ahead(self, batches, infos, broadcast, bcast_leaves, bcast_tree, bcast_key,
                       in_specs, spec_key) -> None:
        """Queue the programs of the batches after the first on the background
        compiler while this thread compiles and runs the first: two compiles at
        a time (XLA compiles one program on one core). A program this thread
        reaches first is compiled here (the entry's lock), and the queued job
        then skips it."""
        if not self.compile_ahead or not batches:
            return
        tree, plan, _, B = batches[0]
        queued = {(tree, plan.signature, B, bcast_key, spec_key)}
        for tree, plan, chunk, B in batches[1:]:
            key = (tree, plan.signature, B, bcast_key, spec_key)
            e = self.cache.get(key)
            if key in queued or (e is not None and e.fn is not None):
                continue
            queued.add(key)
            make, avals = self._program_and_avals(tree, plan, infos[chunk[0]][1], B, in_specs,
                                                  broadcast, bcast_leaves, bcast_tree)
            entry = self.cache.entry(key, hit=False)
            background_executor().submit(functools.partial(
                self.cache.precompile_entry, entry, make, avals, "background_compiles"))

    def _program_and_avals(self, tree, plan, leaves, B, in_specs, broadcast, bcast_leaves,
                           bcast_tree):
        """``make`` and the abstract arguments of the ``B``-row program of ``plan``."""
        static_leaves = ragged_batches.static_batch_avals(plan, leaves, B)
        dyn = [jax.ShapeDtypeStruct((B,) + p.padded, p.dtype) for p in plan.leaves if not p.static]
        make = self._batch_program(tree, plan, in_specs, len(broadcast), bcast_tree,
                                   len(bcast_leaves), len(static_leaves), len(dyn))
        avals = [*bcast_leaves, *static_leaves, *dyn,
                 jax.ShapeDtypeStruct((B, len(plan.values) + 1), np.int32)]  # + row guard
        return make, avals

    def _batch_program(self, tree, plan, in_specs, n_broadcast, bcast_tree, nb, ns, nd):
        """``make(entry)``: one bucket signature's ``vmap(mask(fun))``, keyed for the store."""
        axes = ragged_batches.batch_in_axes(plan, nb, ns, nd)

        def make(entry) -> StorableProgram:
            inner, cases = build_inner_and_cases(self.fun, entry, tree, plan, in_specs,
                                                 self.constraints, n_broadcast, bcast_tree, nb,
                                                 row_guard=True, max_cases=self.max_cases)

            def case_tree(avals):
                jax.eval_shape(lambda *a: cases(*a) and 0, *ragged_batches.example_avals(avals, axes, plan, nb))
                return entry.tree

            batched = ragged_batches.stacked_weak_inputs(jax.vmap(inner, in_axes=axes), plan, nb)
            return StorableProgram(batched, case_tree, (
                str(tree), str(bcast_tree), repr(in_specs), repr(self.constraints),
                repr(self.max_cases),
                repr(plan.var_names), repr(plan.stacked),
                repr(sorted(entry.compiler_options.items()))))

        return make

    def _stored_or_jit_program(self, entry, make_fn, args, compile_now=False):
        """The cache's ``build_program``: from the program store when the
        persistent cache is on (see ``program_store``): a warm process skips
        masking and lowering."""
        store = active_store()
        if store is None:
            return jit_program(entry, lambda e: make_fn(e).fn, args, compile_now)
        prog, avals, key = entry.prepared or self._prepare(entry, make_fn, args, store)
        entry.prepared = None
        fn, loaded = stored_program(store, prog, key, avals, entry, self.program_id,
                                    self.cache.count_compiles)
        if loaded:
            self.cache.add(stored_loads=1)
        return fn

    def _prepare(self, entry, make_fn, args, store) -> tuple:
        """``(program, avals, store key)`` of an entry (traces its cases)."""
        prog = make_fn(entry)
        key, avals = program_key(store, prog, args, self.program_id)
        return prog, avals, key

    def _program_ready(self, tree, fine, chunk, rows, infos, call) -> bool:
        """The program of ``fine`` (a batch's plan) at ``rows`` is compiled, or
        stored on disk: a warm process then runs refined batches, and partial
        batches in full-batch programs, from its first call (a load costs
        about a trace)."""
        broadcast, bcast_leaves, bcast_tree, bcast_key, in_specs, spec_key = call
        key = (tree, fine.signature, rows, bcast_key, spec_key)
        e = self.cache.get(key)
        if e is not None and e.live:
            return True
        store = active_store()
        if store is None:
            return False
        entry = self.cache.entry(key, hit=False)
        if not entry.lock.acquire(blocking=False):
            return False  # compiling in the background now
        try:
            if entry.fn is not None:
                return True
            if entry.prepared is None:
                make, avals = self._program_and_avals(tree, fine, infos[chunk[0]][1], rows,
                                                      in_specs, broadcast, bcast_leaves,
                                                      bcast_tree)
                entry.prepared = self._prepare(entry, make, avals, store)
            return store.has(entry.prepared[2])
        finally:
            entry.lock.release()

    def _rows(self, plan) -> int:
        """Rows of a full batch of this bucket: ``batch_size``, or from ``batch_tokens``."""
        if self.batch_tokens is None:
            return self.batch_size
        return max(1, self.batch_tokens // max(1, plan.padded))

    def _rows_of_partial_batches(self, batches, infos, call) -> list[tuple]:
        """Rows of the program each partial batch runs in: the ``batch_buckets``
        bound when given; else the full-batch program when this call uses it
        or it is compiled or stored (e.g. ``precompile``, ``polymask warmup``),
        no new compile; else the power of two that holds the batch (a few
        examples do not pay for a full batch of padding rows)."""
        used = {(tree, plan.signature, rows) for tree, plan, _, rows in batches if rows}
        out = []
        for tree, plan, chunk, rows in batches:
            if rows is None:
                full, n = self._rows(plan), len(chunk)
                if self._batch_policy is not None:
                    rows = ragged_batches.batch_bucket(self._batch_policy, n, full)
                elif ((tree, plan.signature, full) in used
                      or self._program_ready(tree, plan, chunk, full, infos, call)):
                    rows = full
                else:
                    rows = min(full, 1 << max(0, n - 1).bit_length())
            out.append((tree, plan, chunk, rows))
        return out

    def _run_batch(self, tree, plan0, chunk, infos, results, broadcast, bcast_leaves, bcast_tree,
                   bcast_key, in_specs, spec_key, B):
        # Spare rows: zeros with the first example's sizes (valid, and discarded;
        # their row guard is 0, so host callbacks and checks skip them).
        rows = chunk + [chunk[0]] * (B - len(chunk))
        static_leaves = ragged_batches.static_batch_leaves(plan0, [infos[ex][1] for ex in rows])
        dyn = []
        for li, p in enumerate(plan0.leaves):
            if p.static:
                continue
            buf = host_zeros((B,) + p.padded, p.dtype)
            for r, ex in enumerate(chunk):
                x = np.asarray(infos[ex][1][li])
                buf[(r,) + tuple(slice(0, n) for n in x.shape)] = x
            dyn.append(buf)
        sizes = np.asarray([(*infos[ex][0].values, r < len(chunk)) for r, ex in enumerate(rows)],
                           np.int32)
        bucket = (tree, plan0.signature, bcast_key, spec_key)
        if bucket in self._unshared:
            return self._rerun_in_own_buckets(tree, plan0, chunk, infos, results, broadcast,
                                              bcast_leaves, bcast_tree, bcast_key, in_specs,
                                              spec_key, bucket)
        entry = self.cache.entry((tree, plan0.signature, B, bcast_key, spec_key))
        make = self._batch_program(tree, plan0, in_specs, len(broadcast), bcast_tree,
                                   len(bcast_leaves), len(static_leaves), len(dyn))
        try:
            out = self.cache.call_entry(entry, make, [*bcast_leaves, *static_leaves, *dyn, sizes])
        except Exception as e:
            try:
                raise_run_failure(e)
            except ShapeError as err:  # the batch's row, as the user's example index
                raise _named_example(err, rows) from None
            if self._fallback is None or not falls_back(e):
                raise
            if self._axis_history.promoted:
                raise _PromotedAxisFails from e
            self._unshared[bucket] = self._fallback.refused(
                bucket_text(plan0.buckets), e, None if self.in_specs is not None
                else plan0.var_axes())
            return self._rerun_in_own_buckets(tree, plan0, chunk, infos, results, broadcast,
                                              bcast_leaves, bcast_tree, bcast_key, in_specs,
                                              spec_key, bucket)
        self.cache.count_call(sum(infos[ex][0].logical for ex in chunk), len(chunk) * plan0.padded)
        ran_plain = set()
        for ex in chunk:
            try:
                raise_case_error(entry, infos[ex][0].var_names, infos[ex][0].values,
                                 f"examples[{ex}]: ")
            except ShapeError as e:  # checked against plain jax.jit (once per shape)
                if self._fallback is None:
                    raise
                try:
                    results[ex] = self._exact_example(tree, ex, infos, broadcast, bcast_key,
                                                      None)
                except ShapeError:
                    raise e from None  # plain JAX fails too: the trace's message says where
                ran_plain.add(ex)
                bug = case_error_is_plain(entry, infos[ex][0].var_names, infos[ex][0].values)
                self._fallback.refused(
                    fallback_where(entry, infos[ex][0].var_names, infos[ex][0].values,
                                   plan0.buckets),
                    ShapeError(f"the masked trace takes these sizes to an error case, but "
                               f"plain jax.jit runs them (a polymask bug; please report "
                               f"it):\n{e}") if bug else e,
                    None if self.in_specs is not None else plan0.var_axes())
                self._fallback.warn_pending()
        outputs = entry.outputs
        if outputs.device_axes:
            datas, out_sizes = out
            out_sizes = np.asarray(out_sizes)
        else:
            datas, out_sizes = out, None
        kinds = [output_kind(d) for d in datas]
        datas = [host_view(d) for d in datas]
        bcast_shapes = [np.shape(x) for x in bcast_leaves]
        for r, ex in enumerate(chunk):
            if ex in ran_plain:
                continue
            in_shapes = bcast_shapes + [p.shape for p in infos[ex][0].leaves]
            shapes = outputs.shapes(in_shapes, None if out_sizes is None else out_sizes[r])
            outs = [handed_back(np.array(slice_to(d[r], shape)), kind, self.numpy_outputs)
                    for d, shape, kind in zip(datas, shapes, kinds)]
            results[ex] = jax.tree_util.tree_unflatten(outputs.tree, outs)


    def _rerun_in_own_buckets(self, tree, plan0, chunk, infos, results, broadcast, bcast_leaves,
                              bcast_tree, bcast_key, in_specs, spec_key, bucket) -> None:
        """A batch whose bucket cannot trace: its examples of smaller buckets
        run as batches of their own bucket (which may still share a program:
        ``len(x)`` traces per size up to bucket 32), the rest one by one
        under ``jax.jit``."""
        own: dict = collections.defaultdict(list)
        for ex in chunk:
            own[infos[ex][0].signature].append(ex)
        for signature, group in own.items():
            plan = infos[group[0]][0]
            if signature == plan0.signature:
                self._run_exact(tree, group, infos, results, broadcast, bcast_key, bucket)
            else:
                rows = 1 << max(0, len(group) - 1).bit_length()
                self._run_batch(tree, plan, group, infos, results, broadcast, bcast_leaves,
                                bcast_tree, bcast_key, in_specs, spec_key, rows)

    def _run_exact(self, tree, chunk, infos, results, broadcast, bcast_key, bucket) -> None:
        """Each example of ``chunk`` under plain ``jax.jit`` (its bucket cannot
        share a program: ``fallback.ExactFallback``), one compile per distinct shape."""
        for ex in chunk:
            results[ex] = self._exact_example(tree, ex, infos, broadcast, bcast_key,
                                              self._unshared[bucket])

    def _exact_example(self, tree, ex, infos, broadcast, bcast_key, reason):
        """``fun(*broadcast, *example)`` under plain ``jax.jit``.

        Raises:
          ShapeError: plain JAX fails on it too (naming the example)."""
        plan, leaves = infos[ex]
        args = (*broadcast, *jax.tree_util.tree_unflatten(tree, list(leaves)))
        key = (tree, bcast_key, tuple((np.shape(x), dtype_key(x)) for x in leaves))
        try:
            out = self._fallback.call(key, args, reason)
        except ShapeError as e:  # (plain JAX's type and args kept: about_example)
            raise at_call_site(about_example(ex, e), user_call_site()) from e.__cause__
        self.cache.count_call(plan.logical, plan.logical)
        self.cache.add(exact_calls=1)
        return jax.tree_util.tree_map(np.asarray if self.numpy_outputs else (lambda a: a), out)

    def fallbacks(self) -> dict[str, str]:
        """``{bucket: reason}``: the buckets whose examples run one by one
        under ``jax.jit`` because their masked trace failed, and why."""
        return {} if self._fallback is None else self._fallback.fallbacks()


def ragged_map(fun: Callable, in_specs=None, *, buckets=None, batch_size: int = 32,
               batch_buckets=None, constraints: Sequence[str] = (), cache_size: int = 64,
               progress: bool = False, numpy_outputs: bool = False, sort: bool = True,
               batch_tokens: int | None = None, compile_ahead: bool = True,
               refine_buckets=None, compiler_options: dict | None = None,
               refined_compiler_options: dict | None = None,
               max_cases: int = DEFAULT_MAX_CASES, layout: str = "auto",
               row_size: int | None = None, rows_per_call: int | None = None,
               segments_per_row: int | None = None, fallback: bool = True,
               program_id: str | None = None,
               static_argnums: int | Sequence[int] | None = None) -> RaggedMap:
    """Map ``fun`` over a list of examples of different sizes, in ragged batches.

    ``ragged_map(fun, ...)(examples, *broadcast)`` returns
    ``[fun(*broadcast, *ex) for ex in examples]`` (an example that is not a tuple
    is one argument), computed as ``jit(vmap(mask(fun)))`` over batches of
    examples that share a bucket signature. With the persistent compilation
    cache on (``polymask.enable_compilation_cache``; the CLI's default) the
    batch programs are kept in a program store beside it, and a later process
    loads each after one symbolic trace of ``fun`` (``program_store.py``;
    ``stats()["stored_loads"]``).

    Args:
      fun: a function written for exact arrays.
      in_specs: specs of the example arguments (as for ``polymask.jit``);
        broadcast arguments take no spec and are passed unpadded (e.g. model
        parameters). None: read off each call's examples (an axis whose
        size differs across them is dynamic, others static, and axes whose
        sizes are equal in every example share one dim var: ``(x, y)`` of
        shapes ``(n, 16)`` and ``(n,)`` is ``("n, 16", "n")``; an axis
        longer than another by the same constant in every example is that
        one's dim var plus it: ``(r, v)`` of ``(n,)`` and ``(n + 1,)`` is
        ``("l0_0", "l0_0 + 1")``, for ``r + v[1:]``). A leading
        axis whose size changed between calls stays dynamic in a call of
        one length (a length-bucketed loader's batches share programs),
        unless the function needs it static (``W @ x`` of ``x (C, n)``: then
        that call and later ones keep it static). Every argument is a traced program input, as under
        ``jax.jit``: a number cannot be used as a shape or in a Python
        ``if`` (bind such constants with ``functools.partial``). An argument
        without a dim var that differs across examples (a Python number, an
        array, a PRNG key) is stacked per row, and each row sees its own
        value (a Python number weakly typed: it promotes as the scalar does;
        numbers of different types, int and float, go to separate batches).
      buckets: bucketing policy for the dim vars (default ``pow2()``).
      batch_size: most examples per batch.
      batch_buckets: policy for the rows of a partial batch (then one more
        program per partial-batch size). Default None: a partial final batch
        runs in the full-batch program of its bucket when the call (or an
        earlier one) uses it, else in the power of two of rows that holds it
        (spare rows are zeros; see the module doc).
      sort: sort the examples largest first before cutting batches, as
        sentence-transformers does (results are always returned in input
        order). ``False``: batches of consecutive examples in input order,
        each padded to its largest example's buckets.
      batch_tokens: size batches by padded elements instead of ``batch_size``:
        a bucket whose examples pad to ``P`` elements gets
        ``max(1, batch_tokens // P)`` rows (more rows for short buckets).
      progress: show a tqdm progress bar.
      numpy_outputs: return NumPy arrays instead of ``jax.Array``.
      compile_ahead: compile the programs of the later batches on a
        background thread while the first batch compiles and runs (two
        compiles at a time: a cold first pass over many buckets takes about
        half the compile time on two or more cores).
      refine_buckets: a finer bucket policy (e.g. ``buckets.multiple(8)``) for
        repeated calls. A batch whose longest example has a tighter bound
        under it (at most its ``buckets`` bound) runs in the coarse program;
        the tighter program compiles in the background after the call, and
        later calls that cut the same batch run in it (``refining.py``).
        Default None: off. ``wait()`` waits for these compiles.
      compiler_options: XLA options for the batch programs, as for
        ``jax.jit(compiler_options=...)`` (XLA's ``DebugOptions`` names; a
        name XLA does not know raises when a program compiles); part of the
        program store's key.
      refined_compiler_options: XLA options for the refined programs (needs
        ``refine_buckets``; default: ``compiler_options``). When they differ,
        every batch of a repeated call gets a refined program, also where its
        buckets are already tight: e.g. options that compile slower and run
        faster. A refined program that fails to compile (an unknown option)
        gives one ``RuntimeWarning``; its batches keep the coarse program.
      max_cases: as for ``polymask.mask``: the most split cases per bucket
        signature; code that needs a size as a Python int is traced once per
        size up to a bucket of ``2 * max_cases`` (32 by default).
      layout: ``"auto"`` (default), ``"packed"`` or ``"padded"``. Packed:
        examples of one ragged dim var are laid end to end in rows of
        ``row_size`` positions with segment ids (MaxText's packed
        sequences), ``rows_per_call`` rows per call of one compiled program;
        ``fun`` keeps its per-example meaning (attention within each example,
        positions restarting, reductions per example: ``docs/packing.md``).
        No bucket padding: only the rows' unused tails. Examples longer than
        a row, or of sizes where the function takes another traced case,
        run padded. ``"auto"`` packs when every primitive of ``fun`` has a
        packed rule and the cost model (``packing/cost.py``: elements and dot
        FLOPs at the padded sizes) says packing computes less; anything the
        packed layout cannot run falls back to padded. ``"packed"`` raises
        ``PackedUnsupported`` instead. ``stats()["layout"]`` says what ran
        and why; ``stats()["packed"]`` counts rows and positions.
      fallback: where a bucket's masked trace fails (a size needed as a Python
        value past the per-size limit, a primitive without a masking rule),
        its examples run one by one under plain ``jax.jit`` (one compile per
        distinct shape, as ``jax.jit``): warned once
        (``polymask.FallbackWarning``), counted (``stats()["exact_compiles"]``,
        ``["exact_calls"]``), listed by ``.fallbacks()``. ``False``: raise
        the trace's error.
      row_size: positions per packed row (default: the power of two that
        holds the first call's longest example, at least 64).
      rows_per_call: rows per call of the packed program (default: about
        2048 positions per call, chosen at the first call).
      segments_per_row: most examples in one row (default ``min(row_size,
        128)``).
      program_id: with ``polymask.enable_compilation_cache``, key the stored
        programs by this name instead of the function's symbolic trace (a
        warm process then loads them without tracing). Keep it in step with
        the function (``"encoder-v3"``): a stale name loads a stale program.
      static_argnums: positions of broadcast arguments that are Python values
        (a mode string, a flag), passed to ``fun`` as they are, as
        ``jax.jit``'s: each distinct hashable value (of a distinct type) gets
        its own programs. Example arguments cannot be static (``ValueError``
        at the call); an unhashable value is a ``ValueError``, as in ``jax.jit``.

    Returns:
      A ``RaggedMap`` callable with ``.stats()`` (calls = batches or packed
      calls run).

    Raises:
      ShapeError: an example does not fit the specs, or the function fails
        on it as plain JAX does (names the example).
      PackedUnsupported: ``layout="packed"`` and ``fun`` cannot run packed
        (names the primitive and the line).
      TypeError / ValueError: here, ``row_size``, ``rows_per_call`` or
        ``segments_per_row`` is not an int / is below 1; ``layout`` is not
        one of ``"auto"``, ``"padded"``, ``"packed"``.
    """
    return RaggedMap(fun, in_specs, buckets=buckets, batch_size=batch_size,
                     batch_buckets=batch_buckets, constraints=constraints,
                     cache_size=cache_size, progress=progress, numpy_outputs=numpy_outputs,
                     sort=sort, batch_tokens=batch_tokens, compile_ahead=compile_ahead,
                     refine_buckets=refine_buckets, compiler_options=compiler_options,
                     refined_compiler_options=refined_compiler_options, max_cases=max_cases,
                     layout=layout, row_size=row_size, rows_per_call=rows_per_call,
                     segments_per_row=segments_per_row, fallback=fallback,
                     program_id=program_id, static_argnums=static_argnums)


def _as_example_list(examples) -> list:
    """``examples`` (a list, tuple, other iterable, or 1-D NumPy object array
    of examples) as a list; a lone numeric array or number is a
    ``ShapeError`` (an array would be read as a batch of its rows, which
    ``ragged_map`` never means: its examples differ in size)."""
    if isinstance(examples, np.ndarray) and examples.dtype == object and examples.ndim == 1:
        return list(examples)  # a NumPy object array holds examples of any shapes
    if (isinstance(examples, (str, bytes, Mapping)) or hasattr(examples, "shape")
            or not hasattr(examples, "__iter__")):
        what = (f"an array of shape {tuple(np.shape(examples))}" if hasattr(examples, "shape")
                else f"a value of type {type(examples).__name__}")
        hint = ("; a dict (parameters?) is a broadcast argument, passed after the "
                "examples: ragged_map(...)(examples, *broadcast)"
                if isinstance(examples, Mapping) else "; for one example, pass [x]")
        if isinstance(examples, Masked):  # (its shape is the sizes: say what it is)
            what = f"a padded batch (polymask.Masked of data shape {np.shape(examples.data)})"
            hint = ("; pass the exact arrays ([x0, x1, ...]), or run a padded batch with "
                    "jax.vmap(polymask.mask(f, specs))")
        raise at_call_site(ShapeError(
            f"ragged_map(...)(examples): examples must be a list of examples (each one "
            f"example's argument, or a tuple of its arguments), got {what}{hint}"),
            user_call_site())
    return list(examples)


def _named_example(err: ShapeError, rows) -> ShapeError:
    """A check that failed in row ``r`` of a batch program (``(batch element
    r)``) names the example of that row (``examples[k]``): rows are sorted and
    bucketed, so ``r`` is not the user's index."""
    def name(m):
        r = int(m.group(1))
        return f"(examples[{rows[r]}])" if r < len(rows) else m.group(0)

    new = ShapeError(re.sub(r"\(batch element (\d+)\)", name, str(err)))
    new.jax_error = getattr(err, "jax_error", None)
    return new
