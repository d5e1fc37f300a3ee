"""``polymask.jit``: exact arrays in, exact arrays out.

Each dynamic axis is padded to its *bucket* on the host with NumPy (no
per-shape device program: see DESIGN.md's performance notes), one
``jax.jit(mask(fun))`` program is compiled per bucket signature, and the
logical sizes travel as one int32 vector (runtime data: a new size inside a
known bucket never recompiles). Sizes are validated on the host, so the masked
program runs with ``checks=False`` (no host callback in the compiled code).

This module keeps the caches and makes the calls; what a call means (specs,
sizes, buckets, output layouts) is decided in ``plan.py``. ``_Runner`` is
shared with ``ragged_map`` (``ragged.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .cases import host_error
from .errors import ShapeError
from .masked import Masked
from .plan import CallPlan, OutputPlan, dtype_key, output_plan, plan_call, policy_getter
from .transform import mask

__all__ = ["jit", "PolyJit"]


def _leaf_key(x):
    try:
        return (x.shape, x.dtype)
    except AttributeError:
        return (np.shape(x), dtype_key(x))


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


# ----------------------------------------------------------------------------
# One compiled program per bucket signature
# ----------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Entry:
    """One compiled program: a ``jax.jit`` of the masked function at one signature.

    ``outputs`` is filled in while the program is traced (from the masked
    program's symbolic output shapes).
    """

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    fn: Callable | None = None
    outputs: OutputPlan | None = None
    compile_s: float = 0.0
    tree: Any = None  # the CaseTree (cases.py), known once traced


def _raise_case_error(entry: _Entry, plan: CallPlan) -> None:
    """Sizes for which the function fails (an error case) raise ``ShapeError`` on the host."""
    msg = None if entry.tree is None else host_error(
        entry.tree, dict(zip(plan.var_names, plan.values)))
    if msg is not None:
        raise ShapeError(msg)


def _build_inner(fun, entry: _Entry, in_tree, plan: CallPlan, in_specs, constraints,
                 n_bcast=0, bcast_tree=None, n_bcast_leaves=0):
    """The traced function: rebuild ``Masked`` inputs from a size vector, run ``mask(fun)``.

    Its arguments are the broadcast leaves, the static leaves, the padded
    dynamic leaves and the logical-size vector (``plan.var_names`` order). It
    returns the output data leaves, plus the data-dependent output sizes as
    one int32 vector when there are any (``entry.outputs.device_axes``).
    """
    mask_specs = None if in_specs is None else (None,) * n_bcast + tuple(in_specs)
    masked = mask(fun, mask_specs, constraints=constraints, checks=False)
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
        tree, _ = masked.cases(*args)  # the tracer's symbolic output shapes
        outputs = entry.outputs = output_plan(tree.base, tree.single)
        entry.tree = tree
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
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._stats = dict(calls=0, compiles=0, cache_hits=0, evictions=0,
                           compile_time_s=0.0, logical_elements=0, padded_elements=0)

    # -- plans -----------------------------------------------------------------
    def _plan(self, args, in_specs=None, spec_key=None) -> tuple[CallPlan, list, Any]:
        """The ``CallPlan`` of ``args`` (cached by tree, exact shapes and dtypes, specs)."""
        if spec_key is None:
            in_specs = self.in_specs
        leaves, tree = jax.tree_util.tree_flatten(tuple(args))
        key = (tree, tuple((np.shape(x), dtype_key(x)) for x in leaves), spec_key)
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
        if plan is None:
            plan = plan_call(args, in_specs, self.constraints, self._policy_for)
            with self._lock:
                self._plans[key] = plan
                while len(self._plans) > 4096:
                    self._plans.popitem(last=False)
        return plan, leaves, tree

    # -- cache -------------------------------------------------------------------
    def _count(self, logical: int, padded: int) -> None:
        with self._lock:
            st = self._stats
            st["calls"] += 1
            st["logical_elements"] += logical
            st["padded_elements"] += padded

    def _entry(self, key) -> _Entry:
        with self._lock:
            e = self._cache.get(key)
            if e is not None:
                self._cache.move_to_end(key)
                self._stats["cache_hits"] += 1
                return e
            e = _Entry()
            self._cache[key] = e
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
                self._stats["evictions"] += 1
            return e

    def _entry_counted(self, key, logical: int, padded: int) -> _Entry:
        """``_count`` plus ``_entry``, under one lock acquisition on a cache hit."""
        with self._lock:
            st = self._stats
            st["calls"] += 1
            st["logical_elements"] += logical
            st["padded_elements"] += padded
            e = self._cache.get(key)
            if e is not None:
                self._cache.move_to_end(key)
                st["cache_hits"] += 1
                return e
        return self._entry(key)

    def _call_entry(self, entry: _Entry, make_fn, flat_args):
        """Run ``entry`` (tracing and compiling it on first use, once, under its lock).

        ``make_fn(entry)`` builds the function to ``jax.jit``.
        """
        fn = entry.fn
        if fn is not None:
            return fn(*flat_args)
        with entry.lock:
            if entry.fn is None:
                t0 = time.perf_counter()
                fn = jax.jit(make_fn(entry))
                out = fn(*flat_args)
                jax.block_until_ready(out)
                entry.compile_s = time.perf_counter() - t0
                entry.fn = fn
                with self._lock:
                    self._stats["compiles"] += 1
                    self._stats["compile_time_s"] += entry.compile_s
                return out
        return entry.fn(*flat_args)

    def stats(self) -> dict:
        """Calls, compiles, cache hits, evictions, compile time and padding fraction."""
        with self._lock:
            s = dict(self._stats)
            s["cache_size"] = len(self._cache)
        padded = s.pop("padded_elements")
        logical = s.pop("logical_elements")
        s["padding_fraction"] = (1.0 - logical / padded) if padded else 0.0
        return s

    def clear_cache(self) -> None:
        """Drop every compiled program (stats are kept)."""
        with self._lock:
            self._cache.clear()
            self._plans.clear()


@dataclasses.dataclass(eq=False)
class _CallInfo:
    """Everything a ``PolyJit`` call needs for one (tree, exact shapes): the fast path.

    ``out_shapes`` caches the exact output shapes of ``out_entry`` when none
    comes from the device.
    """

    plan: CallPlan
    static_idx: tuple[int, ...]
    dyn_idx: tuple[int, ...]
    bounds: tuple[tuple[int, ...], ...]
    sizes: Any  # the logical-size vector, on the device
    key: tuple
    in_shapes: list[tuple[int, ...]]
    out_shapes: list | None = None
    out_entry: _Entry | None = None


class PolyJit(_Runner):
    """The callable returned by ``polymask.jit`` (see there)."""

    def __init__(self, fun, in_specs=None, *, buckets=None, constraints=(), cache_size=64,
                 numpy_outputs=False, slice_after=4):
        super().__init__(fun, in_specs, buckets, constraints, cache_size)
        self.numpy_outputs = numpy_outputs
        self.slice_after = slice_after
        self._slicers: dict = {}
        self._slice_seen: dict = {}
        self._stats["slice_compiles"] = 0
        self._infos: dict = {}
        functools.update_wrapper(self, fun)

    def _info(self, args, tree, fast_key) -> _CallInfo:
        plan, _, _ = self._plan(args)
        dyn_idx = tuple(i for i, p in enumerate(plan.leaves) if not p.static)
        info = _CallInfo(plan, tuple(i for i, p in enumerate(plan.leaves) if p.static), dyn_idx,
                         tuple(plan.leaves[i].padded for i in dyn_idx),
                         jax.device_put(np.asarray(plan.values, np.int32)),
                         (tree, plan.signature), [p.shape for p in plan.leaves])
        with self._lock:
            if len(self._infos) > 4096:
                self._infos.clear()
            self._infos[fast_key] = info
        return info

    def __call__(self, *args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        fast_key = (tree, tuple(map(_leaf_key, leaves)))
        info = self._infos.get(fast_key)
        if info is None:
            info = self._info(args, tree, fast_key)
        flat = [leaves[i] for i in info.static_idx]
        flat += [_pad_host(leaves[i], b) for i, b in zip(info.dyn_idx, info.bounds)]
        flat.append(info.sizes)
        entry = self._entry_counted(info.key, info.plan.logical, info.plan.padded)
        make = None if entry.fn is not None else functools.partial(self._make, tree, info.plan)
        _raise_case_error(entry, info.plan)
        try:
            out = self._call_entry(entry, make, flat)
        except Exception:
            _raise_case_error(entry, info.plan)  # first call: the tree is known now
            raise
        outputs = entry.outputs
        if outputs.device_axes:
            datas, out_sizes = out
            shapes = outputs.shapes(info.in_shapes, np.asarray(out_sizes))
        else:
            datas = out
            shapes = info.out_shapes
            if shapes is None or info.out_entry is not entry:
                shapes = info.out_shapes = outputs.shapes(info.in_shapes)
                info.out_entry = entry
        outs = []
        for d, shape in zip(datas, shapes):
            if d.shape == shape:
                outs.append(np.asarray(d) if self.numpy_outputs else d)
            elif self.numpy_outputs:
                outs.append(_slice(np.asarray(d), shape))
            else:
                outs.append(self._unpad_device(d, shape))
        return jax.tree_util.tree_unflatten(outputs.tree, outs)

    def _make(self, tree, plan, entry):
        return _build_inner(self.fun, entry, tree, plan, self.in_specs, self.constraints)

    def _unpad_device(self, d, shape):
        """Exact ``jax.Array`` of a padded output.

        The first ``slice_after - 1`` times an output shape is seen it is sliced on
        the host and uploaded (no compile); from then on a compiled slice for that
        shape is used (one tiny program per recurring shape, counted in
        ``stats()["slice_compiles"]``), which is much cheaper per call.
        """
        key = (d.shape, d.dtype, shape)
        fn = self._slicers.get(key)
        if fn is None:
            if self.slice_after is not None:
                with self._lock:
                    c = self._slice_seen[key] = self._slice_seen.get(key, 0) + 1
                    if c >= self.slice_after and len(self._slicers) < 1024:
                        fn = self._slicers[key] = jax.jit(functools.partial(_slice, shape=shape))
                        self._stats["slice_compiles"] += 1
            if fn is None:
                return jnp.asarray(_slice(np.asarray(d), shape))
        return fn(d)


def jit(fun: Callable, in_specs=None, *, buckets=None, constraints: Sequence[str] = (),
        cache_size: int = 64, numpy_outputs: bool = False,
        slice_after: int | None = 4) -> PolyJit:
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
      slice_after: an exact output shape seen this many times gets a compiled
        slice (a tiny program, ``stats()["slice_compiles"]``); before that, and
        always when None, padded outputs are sliced on the host and uploaded.

    Returns:
      A ``PolyJit`` callable; ``.stats()`` gives calls, compiles, cache hits,
      evictions, compile time and the padding fraction of the inputs.

    Inputs are padded on the host with NumPy (an input already at its bucket
    is passed through), logical sizes are runtime arguments (a new size in a
    known bucket never recompiles), and outputs are sliced to their logical
    shapes. Raises ``ShapeError`` for inconsistent sizes (before running).
    """
    return PolyJit(fun, in_specs, buckets=buckets, constraints=constraints,
                   cache_size=cache_size, numpy_outputs=numpy_outputs, slice_after=slice_after)
