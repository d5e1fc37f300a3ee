"""``ragged_map``'s packed layout: examples packed into rows, one program.

Examples whose ragged axis fits a row (``row_size`` positions) are packed
first-fit decreasing into rows (``packing.pack_rows``), ``rows_per_call``
rows per call of one compiled program ``jit(vmap(packed row function))``;
each example's outputs are cut out of its row (packed outputs) or its
segment slot (per-example outputs) and returned in input order. Examples
longer than a row are left to the caller (the padded layout).

With the persistent compilation cache on, the row program comes from the
program store (``program_store.py``), keyed by the packed trace's case tree
and the row shape: a warm process skips tracing the row program through the
packed interpreter, lowering it and JAX's cache lookup (about 0.3 s of a
warm MiniLM ``polymask embed``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from ..core.plan import CallPlan, structure_key
from ..core.trace_state import replaced
from ..packing import PackedProgram, pack_rows, packed_program
from ..packing.interpreter import ROWS_AXIS
from ..packing.segments import POSITION_FIELDS, SEGMENT_FIELDS, phantom_source, row_arrays
from .compiling import compile_counter
from .hostio import handed_back, host_view, host_zeros, output_kind
from .program_store import StoredProgram, active_store, compile_to_store, tree_fingerprint

__all__ = ["PackedRunner", "default_row_size", "row_example", "spare_rows"]


def _call_first(rows, lengths):
    return next((i for row in rows for i, _ in row if lengths[i] > 0), None)


def spare_rows(rows: list, B: int) -> list:
    """``rows`` filled up to ``B`` rows per call with copies of the first row:
    a spare row computes on real data (finite everywhere, so a gradient's
    zero cotangents never meet a 0/0) and its outputs are never read."""
    return rows + [rows[0]] * (B - len(rows))


_KEPT_PROGRAMS = 8  # packed programs a runner keeps besides the current one


def default_row_size(longest: int) -> int:
    """The row size when none is given: the power of two that holds the
    longest example, at least 64 (short examples share rows)."""
    return max(64, 1 << max(int(longest) - 1, 0).bit_length())


def row_example(plan: CallPlan, leaves, tree, row_size: int, make):
    """One example's arguments with its ragged axes at the row size:
    ``make(shape, dtype, weak)`` builds each non-static leaf (zeros to trace,
    ``ShapeDtypeStruct`` to explain; ``weak``: a weakly typed JAX array's, which
    promotes as jax.jit sees it); static leaves are kept."""
    var = plan.var_names[0]
    out = []
    for leaf, p in zip(leaves, plan.leaves):
        if p.static:
            out.append(leaf)
            continue
        shape = tuple(row_size if a.var == var else int(s) for a, s in zip(p.axes, p.shape))
        out.append(make(shape, _dtype(leaf), p.weak))
    return jax.tree_util.tree_unflatten(tree, out)


def _zeros(shape, dtype, weak: bool):
    """A row example's leaf to trace the packed program with."""
    return compat.as_weakly_typed(jnp.zeros(shape, dtype)) if weak else np.zeros(shape, dtype)


def _dtype(leaf):
    return leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def _repeat_into(buf, x, axis: int, lo: int, hi: int) -> None:
    """``buf[lo:hi]`` along ``axis`` filled with ``x``'s entries repeated (real,
    finite data for positions no example owns)."""
    if x is None or hi <= lo or x.shape[axis] == 0:
        return
    idx = [slice(None)] * buf.ndim
    idx[axis] = slice(lo, hi)
    buf[tuple(idx)] = np.take(x, np.arange(hi - lo) % x.shape[axis], axis=axis)


@dataclasses.dataclass
class _Leaf:
    packed_axes: tuple[int, ...]  # () for a per-example value without the ragged axis
    dtype: Any
    shape: tuple  # an example's shape with the ragged axes at row size


def empty_packed_stats() -> dict:
    """A packed runner's counters before its first call
    (``ragged_map(...).stats()["packed"]``)."""
    return {"calls": 0, "compiles": 0, "xla_compiles": 0, "persistent_cache_hits": 0,
            "compile_time_s": 0.0, "real_positions": 0, "computed_positions": 0,
            "examples": 0, "logical_elements": 0, "padded_elements": 0, "exact_reruns": 0,
            "stored_loads": 0}


class PackedRunner:
    """One traced packed program per row shape, and the host packing around it.

    ``program``: the ``PackedProgram`` (traced at bound ``row_size``);
    ``stats``: ``calls``, ``compiles``, ``xla_compiles``, ``real_positions``
    and ``computed_positions`` (rows x row size, empty rows included),
    ``exact_reruns`` (calls rerun in the exact program: a row met a rule's
    rare path, ``PackedRun.rare_path``).
    """

    def __init__(self, fun: Callable, constraints: Sequence[str], row_size: int,
                 slots: int, rows_per_call: int | None, max_cases: int, numpy_outputs: bool,
                 compiler_options: dict | None = None, differentiable: bool = False):
        self.fun = fun
        self.differentiable = differentiable  # (value_and_grad's: custom rules traced with it)
        self.compiler_options = dict(compiler_options or {})
        self.constraints = tuple(constraints)
        self.row_size = int(row_size)
        self.slots = int(slots)
        self.rows_per_call = None if rows_per_call is None else int(rows_per_call)
        self.max_cases = max_cases
        self.numpy_outputs = numpy_outputs
        self.program: PackedProgram | None = None
        self._fn = None
        self._aot = None  # the precompiled row program
        self._exact = None  # the row program with the rules' rare paths (``_exact_program``)
        self._key = None
        # other traces' (program, _fn, _aot, _exact), by key, least recently used first
        self._programs: dict = {}
        # Threads calling one ragged_map at once (a server's callers) share this
        # runner. Without a lock each traced the packed program, reset ``_fn`` and
        # compiled its own copy (8 threads: 8 XLA compiles of one program). The
        # lock makes tracing, choosing ``rows_per_call`` and the first call of
        # each program (where jax.jit compiles) happen once; later calls of a
        # compiled program run concurrently, without it.
        self._lock = threading.RLock()
        self._warm: set = set()  # (program, broadcast signature) already compiled
        # compiles: programs made ready, compiled by XLA (xla_compiles) or
        # loaded from the persistent compilation cache (persistent_cache_hits)
        self.stats = empty_packed_stats()

    # -- tracing ---------------------------------------------------------------
    def choose_rows_per_call(self, rows: int) -> int:
        """Rows per call (a program shape, fixed at the first call): given, or
        the count in ``[P/2, P]`` (``P`` rows of about 2048 positions) that
        leaves the fewest empty rows in this call's last call (the power of
        two that holds them when they are fewer than ``P``)."""
        with self._lock:
            return self._choose_rows_per_call(rows)

    def _choose_rows_per_call(self, rows: int) -> int:
        if self.rows_per_call is None:
            P = max(1, 2048 // self.row_size)
            if rows <= P:
                self.rows_per_call = min(P, 1 << max(rows - 1, 0).bit_length())
            else:
                cands = range(max(1, P // 2), P + 1)
                self.rows_per_call = min(cands, key=lambda b: ((-rows) % b, -b))
        return self.rows_per_call

    def prepare(self, plan: CallPlan, leaves, tree, broadcast, in_specs) -> PackedProgram:
        """Trace the packed program (once per example tree and dtypes and
        broadcast structure and shapes).

        Raises:
          PackedUnsupported: the function cannot run packed.
        """
        with self._lock:  # one trace, whatever the number of threads calling
            return self._prepare(plan, leaves, tree, broadcast, in_specs)

    def _prepare(self, plan, leaves, tree, broadcast, in_specs) -> PackedProgram:
        # the broadcast arguments' structure and shapes too: the trace bakes them in
        # (a parameter's shape read as a number, a dict key tested in Python)
        bleaves, btree = jax.tree_util.tree_flatten(tuple(broadcast))
        key = (tree, tuple((p.static, p.dtype, p.shape if p.static else p.axis_forms)
                           for p in plan.leaves), structure_key(btree, bleaves))
        if self.program is not None and key == self._key:
            return self.program
        if self.program is not None:  # kept: calls that alternate come back to it
            self._programs[self._key] = (self.program, self._fn, self._aot, self._exact)
            while len(self._programs) > _KEPT_PROGRAMS:
                self._programs.pop(next(iter(self._programs)))
        kept = self._programs.pop(key, None)
        if kept is None:
            example = row_example(plan, leaves, tree, self.row_size, _zeros)
            n_bcast = len(broadcast)
            specs = (None,) * n_bcast + tuple(in_specs)
            with replaced("differentiable", self.differentiable):
                prog = packed_program(self.fun, (*broadcast, *example), specs, self.constraints,
                                      len(jax.tree_util.tree_leaves(broadcast)), self.max_cases)
            kept = (prog, None, None, None)
        self.program, self._fn, self._aot, self._exact = kept
        self._key = key
        return self.program

    def precompile(self, info, bcast_leaves) -> None:
        """Compile the row program now (``rows_per_call`` rows; ``info`` is one
        example's ``(plan, leaves)``, leaves may be ``ShapeDtypeStruct``s); calls
        of that shape then run in it."""
        if self.rows_per_call is None:
            raise ValueError("precompiling the packed program needs rows_per_call")
        avals = self._avals(info, bcast_leaves)
        with self._lock:
            if active_store() is not None:
                self._aot = self._from_store(avals, len(bcast_leaves))
                return
            start = time.perf_counter()
            with compile_counter() as cc:
                self._aot = self._compiled(len(bcast_leaves)).lower(*avals).compile()
        self._count({"compiles": 1, "xla_compiles": cc.compiles,
                     "persistent_cache_hits": cc.cache_hits,
                     "compile_time_s": time.perf_counter() - start})

    def _avals(self, info, bcast_leaves) -> list:
        """The row program's abstract arguments for calls like ``info``'s example
        (``rows_per_call`` rows): broadcast leaves, example leaves, segment arrays."""
        B, R, S = self.rows_per_call, self.program.positions, self.slots
        avals = [jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in bcast_leaves]
        for sp in self._leaf_specs(info):
            avals.append(jax.ShapeDtypeStruct((B,) + (sp.shape if sp.packed_axes
                                                      else (S,) + sp.shape), sp.dtype))
        avals += [jax.ShapeDtypeStruct((B, R if f in POSITION_FIELDS else S), np.int32)
                  for f in SEGMENT_FIELDS]
        return avals

    def _from_store(self, avals, n_bcast: int, speculative: bool = True) -> StoredProgram:
        """The speculative (or the exact) row program from the program store:
        loaded, or compiled now and written there (under the lock). The key is
        the packed trace's case tree (every case's jaxpr and constants) with the
        row layout (packed axes, gap, row size, compile options); the batch's
        shapes and polymask's source are in every key (``ProgramStore.key``)."""
        prog, store = self.program, active_store()
        fn = self._rows_fn(n_bcast, speculative=speculative)
        kind = "speculative" if speculative else "exact"
        key = store.key((*tree_fingerprint(prog.tree), "packed row program", kind,
                         prog.var, prog.case_index, prog.row_size, prog.gap,
                         repr(prog.packed_axes), repr(self.constraints), n_bcast,
                         repr(sorted(self.compiler_options.items()))), avals)
        start = time.perf_counter()
        hit = store.load(key)
        loaded = hit is not None and isinstance(hit[1], list)
        with compile_counter() as cc:
            if loaded:  # the row program's output kinds come with it (no row trace)
                compiled, prog.out_kinds = hit
            else:
                compiled, _ = compile_to_store(store, key, fn, avals, self.compiler_options,
                                               lambda: list(prog.out_kinds))  # set by the trace
        self._count({"compiles": 1, "xla_compiles": cc.compiles, "stored_loads": int(loaded),
                     "compile_time_s": time.perf_counter() - start})
        return StoredProgram(compiled, fn, self.compiler_options,
                             lambda c: self._count({"xla_compiles": c.compiles}))

    def _program(self, info, bcast_leaves):
        """The speculative row program for calls like ``info``'s: precompiled,
        else from the program store where the persistent cache is on (first
        call of this traced program), else ``jax.jit``'s."""
        with self._lock:
            if self._aot is None and self._fn is None and active_store() is not None:
                self._aot = self._from_store(self._avals(info, bcast_leaves), len(bcast_leaves))
            return self._make_compiled(len(bcast_leaves))

    def _compiled(self, n_bcast: int):
        with self._lock:  # one jax.jit function for every thread
            return self._make_compiled(n_bcast)

    def _make_compiled(self, n_bcast: int):
        if self._aot is not None:
            return self._aot
        if self._fn is None:
            self._fn = self._jit_rows(n_bcast, speculative=True)
        return self._fn

    def _jit_rows(self, n_bcast: int, speculative: bool):
        """``jit(vmap(row program))`` over the call's rows. The speculative one
        (every call's) leaves the rules' rare paths out and returns one more
        output, whether a row needed one; the exact one (``_exact_program``)
        reruns those calls."""
        return jax.jit(self._rows_fn(n_bcast, speculative),
                       compiler_options=self.compiler_options or None)

    def _rows_fn(self, n_bcast: int, speculative: bool):
        """``vmap(row program)`` over the call's rows (not jitted)."""
        row = self.program.row_fn(n_bcast, forward_only=True, rows_axis=ROWS_AXIS,
                                  speculative=speculative)
        n_in = len(self.program.packed_axes) + len(SEGMENT_FIELDS)
        return jax.vmap(row, in_axes=(None,) * n_bcast + (0,) * n_in, axis_name=ROWS_AXIS)

    def _exact_program(self, bcast_leaves, inputs):
        """The row program with its rare paths (a NaN or inf of one example
        before an attention product): made on the first call that needs it,
        from the program store where it is on (a later process then loads it
        instead of compiling it)."""
        with self._lock:
            if self._exact is None:
                n_bcast = len(bcast_leaves)
                if active_store() is not None:
                    avals = [jax.ShapeDtypeStruct(np.shape(x), _dtype(x))
                             for x in (*bcast_leaves, *inputs)]
                    self._exact = self._from_store(avals, n_bcast, speculative=False)
                else:
                    self._exact = self._jit_rows(n_bcast, speculative=False)
            return self._exact

    # -- running -----------------------------------------------------------------
    def run(self, idxs: Sequence[int], infos, bcast_leaves, results: list, out_tree) -> None:
        """Run examples ``idxs`` (``infos[i] = (plan, leaves)``) packed; write
        each one's outputs (a pytree of ``out_tree``) to ``results[i]``."""
        lengths = {i: int(infos[i][0].values[0]) for i in idxs}
        order = list(idxs)
        packing = pack_rows([lengths[i] for i in order], self.row_size, self.slots,
                            self.program.gap)
        R = self.program.positions
        B = self.choose_rows_per_call(len(packing.rows))
        leaf_specs = self._leaf_specs(infos[order[0]])
        fn = self._program(infos[order[0]], bcast_leaves)
        packed_leaves = [li for li, sp in enumerate(leaf_specs) if sp.packed_axes]
        for b0 in range(0, len(packing.rows), B):
            rows = packing.rows[b0:b0 + B]
            rows = [[(order[j], start) for j, start in row] for row in rows]
            run_rows = spare_rows(rows, B)
            inputs = self._inputs(run_rows, infos, lengths, leaf_specs)
            seg = self.segment_arrays(run_rows, lengths)
            seg_in = [np.stack([s[f] for s in seg]) for f in SEGMENT_FIELDS]
            start = time.perf_counter()
            programs = []  # per program run: (XLA compiles, persistent-cache hits)
            with compile_counter() as cc:
                (*outs, rare), (*kinds, _) = self._call(fn, bcast_leaves, inputs + seg_in)
            programs.append((cc.compiles, cc.cache_hits))
            if rare.any():  # a row met a rule's rare path: the exact program
                exact = self._exact_program(bcast_leaves, inputs + seg_in)  # (counts a store's)
                with compile_counter() as cc:
                    outs, kinds = self._call(exact, bcast_leaves, inputs + seg_in)
                programs.append((cc.compiles, cc.cache_hits))
            done = [i for row in rows for i, _ in row]  # counted once they ran
            counts = {"calls": 1, "examples": len(done),
                      "real_positions": sum(lengths[i] for i in done),
                      "logical_elements": sum(np.size(infos[i][1][li]) for i in done
                                              for li in packed_leaves),
                      "computed_positions": B * R, "exact_reruns": len(programs) - 1,
                      "padded_elements": B * sum(int(np.prod(leaf_specs[li].shape))
                                                 for li in packed_leaves)}
            made = [p for p in programs if p[0] or p[1]]  # compiled, or loaded from the cache
            if made:
                counts.update(compiles=len(made), xla_compiles=sum(p[0] for p in made),
                              persistent_cache_hits=sum(p[1] for p in made),
                              compile_time_s=time.perf_counter() - start)
            self._count(counts)
            self._unpack(rows, seg, outs, kinds, lengths, results, out_tree)

    def stats_snapshot(self) -> dict:
        """A consistent copy of ``stats`` (taken under the lock)."""
        with self._lock:
            return dict(self.stats)

    def _count(self, counts: dict) -> None:
        """Add ``counts`` to ``stats`` under the lock: threads calling one runner
        (``DynamicBatcher``, a server) never lose an update."""
        with self._lock:
            for k, v in counts.items():
                self.stats[k] += v

    def _call(self, fn, bcast_leaves, inputs) -> tuple[list[np.ndarray], list]:
        """``fn(*bcast_leaves, *inputs)`` on the host (``hostio.host_view``) and
        each output's ``hostio.output_kind``; the first call of a program (per
        broadcast signature: where jax.jit compiles) holds the lock, so
        concurrent first callers wait for one compile instead of each
        compiling their own."""
        sig = (id(fn), tuple((np.shape(x), str(_dtype(x))) for x in bcast_leaves))
        if sig in self._warm:
            outs = fn(*bcast_leaves, *inputs)
        else:
            with self._lock:
                outs = fn(*bcast_leaves, *inputs)
                self._warm.add(sig)
        return [host_view(o) for o in outs], [output_kind(o) for o in outs]

    def _leaf_specs(self, info) -> list[_Leaf]:
        plan, leaves = info
        out = []
        for p, axes in zip(plan.leaves, self.program.packed_axes):
            shape = tuple(self.program.positions if i in axes else int(s)
                          for i, s in enumerate(p.shape))
            out.append(_Leaf(axes, _dtype(leaves[len(out)]), shape))
        return out

    def segment_arrays(self, rows, lengths) -> list[dict]:
        """``row_arrays`` of each row, the phantom's positions those of the
        example its data repeats (``_inputs``)."""
        call_first = _call_first(rows, lengths)
        out = []
        for row in rows:
            src = phantom_source(row, lengths, call_first)
            out.append(row_arrays(row, lengths, self.program.positions, self.slots,
                                  0 if src is None else lengths[src], self.program.gap))
        return out

    def _inputs(self, rows, infos, lengths, leaf_specs) -> list[np.ndarray]:
        R, S, G = self.program.positions, self.slots, self.program.gap
        # a row's unused tail repeats its first non-empty example, else the
        # call's (every lane finite: no 0/0 or NaN for a product or gradient to meet)
        call_first = _call_first(rows, lengths)
        out = []
        for li, spec in enumerate(leaf_specs):
            if not spec.packed_axes:  # one value per example: stacked per slot
                if jax.dtypes.issubdtype(spec.dtype, jax.dtypes.prng_key):
                    out.append(_stacked_keys(rows, infos, li, S))
                    continue
                buf = host_zeros((len(rows), S) + spec.shape, spec.dtype)
                for r, row in enumerate(rows):
                    for s, (i, _) in enumerate(row):
                        buf[r, s] = np.asarray(infos[i][1][li])
                    if row:
                        buf[r, len(row):] = buf[r, 0]
                out.append(buf)
                continue
            buf = host_zeros((len(rows),) + spec.shape, spec.dtype)
            for r, row in enumerate(rows):
                end = 0
                src = phantom_source(row, lengths, call_first)
                first = None if src is None else np.asarray(infos[src][1][li])
                one_axis = len(spec.packed_axes) == 1
                for i, start in row:
                    n = lengths[i]
                    x = np.asarray(infos[i][1][li])
                    idx = [slice(None)] * x.ndim
                    for a in spec.packed_axes:
                        idx[a] = slice(start, start + n)
                    buf[(r, *idx)] = x
                    if G and one_axis:  # the gap repeats the example (or the phantom)
                        _repeat_into(buf[r], x if n else first, spec.packed_axes[0],
                                     start + n, start + n + G)
                    end = max(end, start + n + G)
                if first is not None and end < R and one_axis:
                    # padding positions repeat real data (finite everywhere)
                    _repeat_into(buf[r], first, spec.packed_axes[0], end, R)
            out.append(buf)
        return out

    def _unpack(self, rows, seg, outs, out_kinds, lengths, results, out_tree) -> None:
        """Each example's outputs from the call's host outputs ``outs``
        (``out_kinds``: ``hostio.output_kind`` of each)."""
        kinds = self.program.out_kinds
        ragged = self.program.sizes
        out_axes = [tuple(i for i, d in enumerate(s) if ragged.offset(d) is not None)
                    for s in self.program.out_shapes]
        sizes: dict[int, list] = {}
        for r, row in enumerate(rows):
            for s, (i, start) in enumerate(row):
                n = lengths[i]
                if n not in sizes:
                    sizes[n] = self.program.out_lengths(n)
                leaves = []
                for o, kind, axes, size, out_kind in zip(outs, kinds, out_axes, sizes[n],
                                                         out_kinds):
                    if kind == "segment":
                        a = o[r, s]
                    elif kind == "packed":  # its own length along each packed axis (n + c)
                        idx = [slice(None)] * (o.ndim - 1)
                        for ax in axes:
                            idx[ax] = slice(start, start + size[ax])
                        a = o[r][tuple(idx)]
                    else:
                        a = o[r]
                    leaves.append(handed_back(np.array(a), out_kind, self.numpy_outputs))
                results[i] = jax.tree_util.tree_unflatten(out_tree, leaves)


def _stacked_keys(rows, infos, li: int, slots: int):
    """Per-example typed PRNG keys (leaf ``li``) stacked per row and slot, as
    ``_inputs`` stacks any per-example value: NumPy has no key dtype, so
    their key data is stacked and wrapped again (a spare slot repeats its
    row's first key)."""
    keys = [infos[i][1][li] for row in rows for i, _ in row]
    impl = jax.random.key_impl(keys[0])
    words = np.asarray(jax.random.key_data(keys[0]))
    buf = np.zeros((len(rows), slots) + words.shape, words.dtype)
    for r, row in enumerate(rows):
        for s, (i, _) in enumerate(row):
            buf[r, s] = np.asarray(jax.random.key_data(infos[i][1][li]))
        if row:
            buf[r, len(row):] = buf[r, 0]
    return jax.random.wrap_key_data(buf, impl=impl)
