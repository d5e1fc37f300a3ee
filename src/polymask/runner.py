"""``polymask.jit``: exact arrays in, exact arrays out.

Each dynamic axis is padded to its *bucket* on the host with NumPy (no
per-shape device program: see DESIGN.md's performance notes), one
``jax.jit(mask(fun))`` program is compiled per bucket signature, and the
logical sizes travel as one int32 vector (runtime data: a new size inside a
known bucket never recompiles). Sizes are validated on the host, so the masked
program runs with ``checks=False`` (no host callback in the compiled code).
Outputs are sliced to their exact shapes on the host (NumPy) and uploaded with
``jax.device_put``: nothing is compiled per output shape.

Compiles are counted with ``jax.monitoring`` listeners around every path that
can compile (a bucket's first call, ``precompile``, background compiles of
tiered buckets, device-side padding): ``stats()["xla_compiles"]`` is every XLA
compile those paths caused. The steady-state call path compiles nothing.

This module keeps the caches and makes the calls; what a call means (specs,
sizes, buckets, output layouts) is decided in ``plan.py``. ``_Runner`` is
shared with ``ragged_map`` (``ragged.py``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_compat as compat
from .masked import Masked
from .plan import (
    CallPlan,
    OutputPlan,
    dtype_key,
    output_plan,
    padded_shape,
    plan_call,
    policy_getter,
)
from .transform import mask

__all__ = ["jit", "PolyJit", "compile_counter"]


def _leaf_key(x):
    try:
        return (type(x), x.shape, x.dtype)
    except AttributeError:
        return (type(x), np.shape(x), dtype_key(x))


# ----------------------------------------------------------------------------
# Counting compiles (jax.monitoring listeners, active per thread)
# ----------------------------------------------------------------------------
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_tls = threading.local()
_listeners_lock = threading.Lock()
_listeners_installed = False


def _on_duration(name, secs, **kw):
    if name == _COMPILE_EVENT:
        c = getattr(_tls, "counter", None)
        if c is not None:
            c[0] += 1


def _on_event(name, **kw):
    if name == _CACHE_HIT_EVENT:
        c = getattr(_tls, "counter", None)
        if c is not None:
            c[1] += 1


def _install_listeners() -> None:
    global _listeners_installed
    with _listeners_lock:
        if not _listeners_installed:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _listeners_installed = True


class compile_counter:
    """Count the XLA compiles (and persistent-cache hits) this thread causes.

    ``with compile_counter() as c: ...`` then ``c.compiles``, ``c.cache_hits``
    (programs loaded from the persistent compilation cache).
    Nested counters each see the compiles of their block.
    """

    def __enter__(self):
        _install_listeners()
        self._prev = getattr(_tls, "counter", None)
        self._c = _tls.counter = [0, 0]
        return self

    def __exit__(self, *exc):
        _tls.counter = self._prev
        if self._prev is not None:
            self._prev[0] += self._c[0]
            self._prev[1] += self._c[1]
        return False

    @property
    def compiles(self) -> int:
        """XLA compiles (a program loaded from the persistent cache is not one)."""
        return self._c[0] - self._c[1]

    @property
    def cache_hits(self) -> int:
        return self._c[1]


# ----------------------------------------------------------------------------
# Padding and unpadding (nothing compiled per shape on the host path)
# ----------------------------------------------------------------------------
def _pad_host(x, bound: tuple[int, ...]):
    """Pad ``x`` to ``bound`` with zeros on the host (NumPy: compiles nothing)."""
    shape = np.shape(x)
    if tuple(shape) == bound:
        return x  # nothing to pad: pass the array through unchanged
    a = np.asarray(x)
    out = np.zeros(bound, dtype=a.dtype)
    out[tuple(slice(0, s) for s in shape)] = a
    return out


def _slice(a, shape):
    return a[tuple(slice(0, int(n)) for n in shape)]


def _unpad(d, shape, numpy_outputs: bool):
    """Exact output from a padded one: a NumPy slice, uploaded unless ``numpy_outputs``."""
    a = np.asarray(d)
    if a.shape != tuple(shape):
        a = _slice(a, shape)
    if numpy_outputs:
        return a
    return compat.upload(np.array(a))


_ArrayImpl = type(jax.numpy.zeros(()))
_FAST_TYPES = (np.ndarray, _ArrayImpl)
_PAD_DEVICE: dict = {}


def _host_backend() -> bool:
    return jax.default_backend() == "cpu"


def _device_pad_fn(shape, bound, dtype):
    """A jitted zero-pad for one (exact shape, bound) on an accelerator (counted)."""
    key = (shape, bound, dtype)
    fn = _PAD_DEVICE.get(key)
    if fn is None:
        widths = [(0, b - s, 0) for s, b in zip(shape, bound)]
        fn = _PAD_DEVICE[key] = jax.jit(
            lambda x: jax.lax.pad(x, jnp.zeros((), x.dtype), widths))
    return fn


# ----------------------------------------------------------------------------
# One compiled program per bucket signature
# ----------------------------------------------------------------------------
_TICK = itertools.count()


class _BackgroundCompiler:
    """One daemon thread per process that runs background compiles in order.

    A daemon thread (not ``concurrent.futures``' pool) so that compiles still
    queued at interpreter exit are dropped instead of delaying the exit.
    """

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fn, fut))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="polymask-compile",
                                                daemon=True)
                self._thread.start()
        return fut

    def _run(self):
        while True:
            fn, fut = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported by Future.result() (PolyJit.wait)
                fut.set_exception(e)


_BACKGROUND = _BackgroundCompiler()


def _executor() -> _BackgroundCompiler:
    return _BACKGROUND


def _count_value(c) -> int:
    """The next value of an ``itertools.count`` without advancing it (lock-free counters)."""
    r = repr(c)
    return int(r[r.index("(") + 1:-1])


@dataclasses.dataclass(eq=False)
class _Entry:
    """One compiled program: a ``jax.jit`` of the masked function at one signature.

    ``outputs`` is filled in while the program is traced (from the masked
    program's symbolic output shapes). ``live`` is True once compiled and until
    evicted; ``tick`` is the last use (approximate LRU, written without a lock).
    ``buckets``/``cover_key`` describe it to tiered lookups.
    """

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    fn: Callable | None = None
    outputs: OutputPlan | None = None
    compile_s: float = 0.0
    live: bool = False
    tick: int = 0
    cover_key: Any = None
    buckets: dict | None = None
    padded: int = 0


def _build_inner(fun, entry: _Entry, in_tree, plan: CallPlan, in_specs, constraints,
                 n_bcast=0, bcast_tree=None, n_bcast_leaves=0):
    """The traced function: rebuild ``Masked`` inputs from a size vector, run ``mask(fun)``.

    Its arguments are the broadcast leaves, the static leaves, the padded
    dynamic leaves and the logical-size vector (``plan.var_names`` order). It
    returns the output data leaves, plus the data-dependent output sizes as
    one int32 vector when there are any (``entry.outputs.device_axes``).
    Dynamic inputs are padded with zeros by the runner, so the masked program
    skips its entry select (``zero_padded=True``).
    """
    mask_specs = None if in_specs is None else (None,) * n_bcast + tuple(in_specs)
    masked = mask(fun, mask_specs, constraints=constraints, checks=False, zero_padded=True,
                  differentiable=False)
    var_index = {v: i for i, v in enumerate(plan.var_names)}
    n_static = sum(1 for p in plan.leaves if p.static)

    def size(a, sizes):
        if a.var is None:
            return a.expr
        s = sizes[var_index[a.var]]
        s = s * a.coeff if a.coeff != 1 else s
        return s + a.offset if a.offset else s

    def logical(axes, sizes):
        return tuple(size(a, sizes) for a in axes)

    def inner(*flat_in):
        bcast_leaves = flat_in[:n_bcast_leaves]
        static_it = iter(flat_in[n_bcast_leaves:n_bcast_leaves + n_static])
        dyn_it = iter(flat_in[n_bcast_leaves + n_static:-1])
        sizes = flat_in[-1]
        flat = [next(static_it) if p.static else Masked(next(dyn_it), logical(p.axes, sizes))
                for p in plan.leaves]
        args = jax.tree_util.tree_unflatten(in_tree, flat)
        if n_bcast:
            args = tuple(jax.tree_util.tree_unflatten(bcast_tree, list(bcast_leaves))) + args
        prog, _ = masked.program(*args)  # the tracer's symbolic output shapes
        outputs = entry.outputs = output_plan(prog)
        out_leaves = jax.tree_util.tree_leaves(masked(*args),
                                               is_leaf=lambda x: isinstance(x, Masked))
        datas = [o.data if isinstance(o, Masked) else jnp.asarray(o) for o in out_leaves]
        if not outputs.device_axes:
            return datas
        return datas, jnp.stack([jnp.asarray(out_leaves[li].shape[k], jnp.int32).reshape(())
                                 for li, k in outputs.device_axes])

    return inner


class _Runner:
    """Shared machinery of ``PolyJit`` and ``RaggedMap``: plans, cache, stats."""

    def __init__(self, fun, in_specs, buckets, constraints, cache_size):
        if isinstance(in_specs, str):
            in_specs = (in_specs,)
        self.fun = fun
        self.in_specs = None if in_specs is None else tuple(in_specs)
        self.constraints = tuple(constraints)
        self._policy_for = policy_getter(buckets)
        self.cache_size = int(cache_size)
        self._lock = threading.Lock()
        self._plans: dict = {}
        self._cache: dict = {}
        self._pending: dict = {}  # key -> Future of a background compile
        self._stats = dict(calls=0, compiles=0, cache_hits=0, evictions=0,
                           compile_time_s=0.0, logical_elements=0, padded_elements=0,
                           xla_compiles=0, persistent_cache_hits=0, background_compiles=0,
                           precompiles=0, tiered_calls=0, pad_compiles=0)
        _install_listeners()

    # -- plans -----------------------------------------------------------------
    def _plan(self, args, in_specs=None, spec_key=None) -> tuple[CallPlan, list, Any]:
        """The ``CallPlan`` of ``args`` (cached by tree, exact shapes and dtypes, specs)."""
        if spec_key is None:
            in_specs = self.in_specs
        leaves, tree = jax.tree_util.tree_flatten(tuple(args))
        key = (tree, tuple((np.shape(x), dtype_key(x)) for x in leaves), spec_key)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_call(args, in_specs, self.constraints, self._policy_for)
            with self._lock:
                if len(self._plans) > 4096:
                    self._plans.clear()
                self._plans[key] = plan
        return plan, leaves, tree

    # -- cache -------------------------------------------------------------------
    def _count(self, logical: int, padded: int) -> None:
        with self._lock:
            st = self._stats
            st["calls"] += 1
            st["logical_elements"] += logical
            st["padded_elements"] += padded

    def _entry(self, key, hit: bool = True) -> _Entry:
        """The entry of ``key`` (created, and the least recently used evicted, if absent)."""
        with self._lock:
            e = self._cache.get(key)
            if e is not None:
                if e.live and hit:
                    self._stats["cache_hits"] += 1
                e.tick = next(_TICK)
                return e
            e = _Entry(tick=next(_TICK))
            self._cache[key] = e
            while len(self._cache) > self.cache_size:
                old_key = min(self._cache, key=lambda k: self._cache[k].tick)
                old = self._cache.pop(old_key)
                old.live = False
                self._stats["evictions"] += 1
            return e

    def _compile_run(self, entry: _Entry, make_fn, flat_args, *, background=False):
        """Trace, compile and run ``entry`` on ``flat_args`` once (under its lock).

        Returns the outputs, or None when another thread compiled it first.
        """
        with entry.lock:
            if entry.fn is not None:
                return None
            t0 = time.perf_counter()
            with compile_counter() as cc:
                fn = jax.jit(make_fn(entry))
                out = fn(*flat_args)
                jax.block_until_ready(out)
            entry.compile_s = time.perf_counter() - t0
            entry.fn = fn
            entry.live = True
            with self._lock:
                st = self._stats
                st["compiles"] += 1
                st["compile_time_s"] += entry.compile_s
                st["xla_compiles"] += cc.compiles
                st["persistent_cache_hits"] += cc.cache_hits
                if background:
                    st["background_compiles"] += 1
            return out

    def _call_entry(self, entry: _Entry, make_fn, flat_args):
        """Run ``entry`` (tracing and compiling it on first use, once, under its lock)."""
        if entry.fn is None:
            out = self._compile_run(entry, make_fn, flat_args)
            if out is not None:
                return out
        return entry.fn(*flat_args)

    def _precompile_entry(self, entry: _Entry, make_fn, avals) -> bool:
        """Lower and compile ``entry`` for abstract arguments (no run). True if compiled now."""
        with entry.lock:
            if entry.fn is not None:
                return False
            t0 = time.perf_counter()
            with compile_counter() as cc:
                fn = jax.jit(make_fn(entry))
                fn.lower(*avals).compile()  # jax.jit's cache keeps it for the calls
            entry.compile_s = time.perf_counter() - t0
            entry.fn = fn
            entry.live = True
            with self._lock:
                st = self._stats
                st["compiles"] += 1
                st["precompiles"] += 1
                st["compile_time_s"] += entry.compile_s
                st["xla_compiles"] += cc.compiles
                st["persistent_cache_hits"] += cc.cache_hits
            return True

    def wait(self) -> None:
        """Wait for the background compiles started so far (tiered buckets)."""
        while True:
            with self._lock:
                futs = list(self._pending.values())
            if not futs:
                return
            for f in futs:
                f.result()

    def _extra_stats(self, s: dict) -> None:
        pass

    def stats(self) -> dict:
        """Calls, compiles, cache hits, evictions, compile time and padding fraction.

        ``compiles``: bucket programs compiled (foreground, background and
        precompiled); ``xla_compiles``: every XLA compile those caused
        (``jax.monitoring``), ``persistent_cache_hits``: programs loaded from
        the persistent compilation cache instead.
        """
        with self._lock:
            s = dict(self._stats)
            s["cache_size"] = len(self._cache)
        self._extra_stats(s)
        padded = s.pop("padded_elements")
        logical = s.pop("logical_elements")
        s["padding_fraction"] = (1.0 - logical / padded) if padded else 0.0
        s["slice_compiles"] = 0  # outputs are unpadded on the host: never compiled
        return s

    def clear_cache(self) -> None:
        """Drop every compiled program (stats are kept)."""
        with self._lock:
            for e in self._cache.values():
                e.live = False
            self._cache.clear()
            self._plans.clear()


@dataclasses.dataclass(eq=False)
class _CallInfo:
    """Everything a ``PolyJit`` call needs for one (tree, exact shapes): the fast path.

    ``entry`` is the compiled program of the call's bucket signature (one
    attribute read from the signature to the program). ``calls`` is a
    lock-free counter. ``out_shapes``/``out_slices`` cache the exact output
    shapes of ``out_entry`` when none comes from the device.
    """

    plan: CallPlan
    tree: Any
    static_idx: tuple[int, ...]
    dyn: tuple  # (leaf index, bound, exact shape == bound, pad on device)
    sizes: Any  # the logical-size vector, on the device
    key: tuple
    in_shapes: list[tuple[int, ...]]
    entry: _Entry | None = None
    calls: Any = dataclasses.field(default_factory=itertools.count)
    out_shapes: list | None = None
    out_exact: bool = False
    out_entry: _Entry | None = None
    build: Callable | None = None
    single_out: bool = False


_LEAF_TREE = jax.tree_util.tree_structure(0)


class PolyJit(_Runner):
    """The callable returned by ``polymask.jit`` (see there)."""

    def __init__(self, fun, in_specs=None, *, buckets=None, constraints=(), cache_size=64,
                 numpy_outputs=False, slice_after=None, tiered=None):
        super().__init__(fun, in_specs, buckets, constraints, cache_size)
        self.numpy_outputs = numpy_outputs
        self.slice_after = slice_after  # accepted for compatibility: nothing is compiled per shape
        if tiered is None:
            tiered = os.environ.get("POLYMASK_TIERED", "1").strip().lower() not in (
                "0", "false", "no", "off", "")
        self.tiered = bool(tiered)
        self._infos: dict = {}
        self._fast: dict = {}
        self._retired = [0, 0, 0]  # calls, logical, padded of dropped infos
        self._fg_compiles_in_calls = 0
        functools.update_wrapper(self, fun)

    # -- call infos ----------------------------------------------------------------
    def _info(self, args, tree, key, fast: bool) -> _CallInfo:
        plan, leaves, _ = self._plan(args)
        device_pad = not _host_backend()
        dyn = tuple((i, plan.leaves[i].padded, plan.leaves[i].shape == plan.leaves[i].padded,
                     device_pad and isinstance(leaves[i], jax.Array))
                    for i, p in enumerate(plan.leaves) if not p.static)
        info = _CallInfo(plan, tree, tuple(i for i, p in enumerate(plan.leaves) if p.static),
                         dyn, jax.device_put(np.asarray(plan.values, np.int32)),
                         (tree, plan.signature), [p.shape for p in plan.leaves])
        with self._lock:
            table = self._fast if fast else self._infos
            if len(table) > 4096:
                for old in table.values():
                    n = _count_value(old.calls)
                    self._retired[0] += n
                    self._retired[1] += n * old.plan.logical
                    self._retired[2] += n * old.plan.padded
                table.clear()
            return table.setdefault(key, info)  # two threads: one info, one counter

    def _extra_stats(self, s):
        calls, logical, padded = self._retired
        for table in (self._infos, self._fast):
            for info in list(table.values()):
                n = _count_value(info.calls)
                calls += n
                logical += n * info.plan.logical
                padded += n * info.plan.padded
        s["calls"] = calls
        s["logical_elements"] = logical
        s["padded_elements"] = padded
        s["cache_hits"] = calls - self._fg_compiles_in_calls

    def _flat(self, info: _CallInfo, leaves, dyn=None):
        """The compiled program's arguments: static leaves, padded dynamic leaves, sizes."""
        if dyn is None:
            build = info.build
            if build is None:
                build = info.build = self._builder(info.static_idx, info.dyn, info.sizes)
            return build(leaves)
        return self._builder(info.static_idx, dyn, info.sizes)(leaves)

    def _builder(self, static_idx, dyn, sizes):
        """A function ``leaves -> flat arguments`` specialised to one call signature."""
        if not static_idx and len(dyn) == 1 and not dyn[0][3]:
            i, bound, exact, _ = dyn[0]
            if exact:
                return lambda leaves: [leaves[i], sizes]

            cache: dict = {}

            def one(leaves):  # the common case: one dynamic array, padded with NumPy
                a = np.asarray(leaves[i])
                out = np.zeros(bound, a.dtype)
                idx = cache.get(a.shape)
                if idx is None:
                    idx = cache[a.shape] = tuple(slice(0, s) for s in a.shape)
                out[idx] = a
                return [out, sizes]

            return one

        def general(leaves):
            flat = [leaves[i] for i in static_idx]
            for i, bound, exact, on_device in dyn:
                x = leaves[i]
                if exact:
                    flat.append(x)
                elif on_device:
                    flat.append(self._pad_device(x, bound))
                else:
                    a = np.asarray(x)
                    out = np.zeros(bound, a.dtype)
                    out[tuple([slice(0, s) for s in a.shape])] = a
                    flat.append(out)
            flat.append(sizes)
            return flat

        return general

    def _pad_device(self, x, bound):
        key = (x.shape, bound, x.dtype)
        fn = _PAD_DEVICE.get(key)
        if fn is not None:
            return fn(x)
        with compile_counter() as cc:
            out = _device_pad_fn(x.shape, bound, x.dtype)(x)
        with self._lock:
            self._stats["pad_compiles"] += 1
            self._stats["xla_compiles"] += cc.compiles
        return out

    # -- calls ---------------------------------------------------------------------
    def __call__(self, *args):
        fast = True
        for a in args:
            if type(a) not in _FAST_TYPES:
                fast = False
                break
        if fast:  # every argument is one array: no pytree flattening
            leaves = args
            key = tuple([(type(a), a.shape, a.dtype) for a in args])
            info = self._fast.get(key)
            if info is None:
                info = self._info(args, jax.tree_util.tree_structure(args), key, True)
        else:
            leaves, tree = jax.tree_util.tree_flatten(args)
            key = (tree, tuple(map(_leaf_key, leaves)))
            info = self._infos.get(key)
            if info is None:
                info = self._info(args, tree, key, False)
        next(info.calls)
        entry = info.entry
        if entry is not None and entry.live:
            entry.tick = next(_TICK)
            build = info.build
            out = entry.fn(*(build(leaves) if build is not None else self._flat(info, leaves)))
            if info.out_entry is entry and info.single_out:
                return out[0]  # one exact output (the steady state of most functions)
        else:
            entry, out = self._slow_call(info, leaves)
        return self._outputs(info, entry, out)

    def _outputs(self, info: _CallInfo, entry: _Entry, out):
        outputs = entry.outputs
        if outputs.device_axes:
            datas, out_sizes = out
            shapes = outputs.shapes(info.in_shapes, np.asarray(out_sizes))
            exact = False
        else:
            datas = out
            if info.out_entry is not entry:
                info.out_shapes = outputs.shapes(info.in_shapes)
                info.out_exact = all(d.shape == s for d, s in zip(datas, info.out_shapes))
                info.single_out = (info.out_exact and not self.numpy_outputs
                                   and outputs.tree.num_leaves == 1
                                   and outputs.tree == _LEAF_TREE)
                info.out_entry = entry
            shapes, exact = info.out_shapes, info.out_exact
        if exact and not self.numpy_outputs:
            return jax.tree_util.tree_unflatten(outputs.tree, datas)
        outs = [(np.asarray(d) if self.numpy_outputs else d) if d.shape == shape
                else _unpad(d, shape, self.numpy_outputs) for d, shape in zip(datas, shapes)]
        return jax.tree_util.tree_unflatten(outputs.tree, outs)

    def _make(self, tree, plan, entry):
        return _build_inner(self.fun, entry, tree, plan, self.in_specs, self.constraints)

    def _cover_key(self, info: _CallInfo):
        """What a covering bucket must share: tree, static leaves, dtypes, dim vars."""
        plan = info.plan
        return (info.tree, tuple(p.padded if p.static else None for p in plan.leaves),
                tuple(p.dtype for p in plan.leaves), tuple(plan.var_names))

    def _find_cover(self, info: _CallInfo, cover_key):
        """The smallest live entry whose buckets hold every size of ``info`` (or None)."""
        values = dict(zip(info.plan.var_names, info.plan.values))
        best = None
        with self._lock:
            for e in self._cache.values():
                if not e.live or e.cover_key != cover_key or e is info.entry:
                    continue
                if all(e.buckets[v] >= n for v, n in values.items()):
                    if best is None or e.padded < best.padded:
                        best = e
        return best

    def _slow_call(self, info: _CallInfo, leaves):
        """First call of a signature, an evicted program, or a tiered bucket still compiling."""
        entry = self._entry(info.key, hit=False)
        info.entry = entry
        if entry.live:
            return entry, entry.fn(*self._flat(info, leaves))
        plan = info.plan
        cover_key = self._cover_key(info)
        if entry.cover_key is None:
            entry.cover_key, entry.buckets = cover_key, dict(plan.buckets)
            entry.padded = plan.padded
        make = functools.partial(self._make, info.tree, plan)
        if self.tiered:
            cover = self._find_cover(info, cover_key)
            if cover is not None:
                self._submit_background(info, entry, make, leaves)
                dyn = tuple((i, b2, np.shape(leaves[i]) == b2, od) for (i, _, _, od), b2 in zip(
                    info.dyn, [padded_shape(plan.leaves[i].axes, cover.buckets)
                               for i, *_ in info.dyn]))
                with self._lock:
                    self._stats["tiered_calls"] += 1
                cover.tick = next(_TICK)
                return cover, cover.fn(*self._flat(info, leaves, dyn))
        out = self._compile_run(entry, make, self._flat(info, leaves))
        if out is None:
            return entry, entry.fn(*self._flat(info, leaves))
        with self._lock:
            self._fg_compiles_in_calls += 1
        return entry, out

    def _submit_background(self, info, entry, make, leaves) -> None:
        key = info.key
        with self._lock:
            if key in self._pending:
                return
            flat = self._flat(info, leaves)  # padded copies for the background run

            def work():
                try:
                    self._compile_run(entry, make, flat, background=True)
                finally:
                    with self._lock:
                        self._pending.pop(key, None)

            self._pending[key] = _executor().submit(work)

    # -- ahead of time -------------------------------------------------------------
    def precompile(self, *args) -> PolyJit:
        """Compile the bucket of ``args`` now (no run): arrays may be ``jax.ShapeDtypeStruct``.

        ``f.precompile(jax.ShapeDtypeStruct((100, 64), jnp.float32))`` compiles
        the bucket that holds 100 rows (pass a bucket's size to pick it). Static
        arguments (``None`` specs) take their real values or structs. With the
        persistent compilation cache on, a later process loads it from disk.
        Returns ``self``.
        """
        plan, leaves, tree = self._plan(args)
        key = (tree, plan.signature)
        entry = self._entry(key, hit=False)
        if entry.cover_key is None:
            dummy = _CallInfo(plan, tree, (), (), None, key, [])
            entry.cover_key, entry.buckets = self._cover_key(dummy), dict(plan.buckets)
            entry.padded = plan.padded
        avals = [x for x, p in zip(leaves, plan.leaves) if p.static]
        avals += [jax.ShapeDtypeStruct(p.padded, p.dtype) for p in plan.leaves if not p.static]
        avals.append(jax.ShapeDtypeStruct((len(plan.values),), np.int32))
        self._precompile_entry(entry, functools.partial(self._make, tree, plan), avals)
        return self


def jit(fun: Callable, in_specs=None, *, buckets=None, constraints: Sequence[str] = (),
        cache_size: int = 64, numpy_outputs: bool = False,
        slice_after: int | None = None, tiered: bool | None = None) -> PolyJit:
    """Compile ``fun`` once per bucket: exact (unpadded) arrays in, exact arrays out.

    Args:
      fun: a function written for exact arrays (pytrees allowed).
      in_specs: None: every axis of every array argument is dynamic with its own
        dim var. Otherwise one entry per positional argument: a
        ``jax.export.symbolic_shape`` spec string (``"n, 64"``; same name =
        equal sizes; ``"_"``/constants = static), a pytree of specs, or None
        (that argument is static: its exact shape is part of the cache key,
        e.g. model parameters).
      buckets: bucketing policy for every dynamic dim var (default
        ``polymask.buckets.pow2()``), or a dict ``{dim var: policy}`` (key
        ``None`` = the default). See ``polymask.buckets``.
      constraints: ``jax.export`` constraints (``"n >= 3"``), checked on the host.
      cache_size: most compiled programs kept (least recently used dropped).
      numpy_outputs: return NumPy arrays instead of ``jax.Array``.
      slice_after: ignored (kept for compatibility): padded outputs are always
        sliced on the host with NumPy and uploaded with ``jax.device_put``, so
        nothing is compiled per output shape (``stats()["slice_compiles"]`` is 0).
      tiered: serve a size whose bucket is not compiled yet from the smallest
        compiled bucket that holds it, while its own bucket compiles in a
        background thread (later calls switch to it; ``f.wait()`` waits for
        those compiles). Default: on, unless the environment variable
        ``POLYMASK_TIERED=0`` (the test suite sets it, so compile counts are
        deterministic there).

    Returns:
      A ``PolyJit`` callable; ``.stats()`` gives calls, compiles, cache hits,
      evictions, compile time, XLA compiles (counted with ``jax.monitoring``),
      tiered calls and the padding fraction of the inputs; ``.precompile(...)``
      compiles a bucket ahead of time; ``.wait()`` waits for background compiles.

    Inputs are padded on the host with NumPy (an input already at its bucket
    is passed through), logical sizes are runtime arguments (a new size in a
    known bucket never recompiles), and outputs are sliced to their logical
    shapes. Raises ``ShapeError`` for inconsistent sizes (before running).
    """
    return PolyJit(fun, in_specs, buckets=buckets, constraints=constraints,
                   cache_size=cache_size, numpy_outputs=numpy_outputs, slice_after=slice_after,
                   tiered=tiered)
