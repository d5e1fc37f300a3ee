"""``polymask.jit`` and ``polymask.ragged_map``: exact arrays in, exact arrays out.

Each dynamic axis is padded to its *bucket* on the host with NumPy (no
per-shape device program: see DESIGN.md's performance notes), one
``jax.jit(mask(fun))`` program is compiled per bucket signature, and the
logical sizes travel as one int32 vector (runtime data: a new size inside a
known bucket never recompiles). Sizes are validated on the host, so the masked
program runs with ``checks=False`` (no host callback in the compiled code).
"""

from __future__ import annotations

import collections
import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_compat as compat
from .buckets import as_policy, pow2
from .errors import ShapeError
from .masked import Masked
from .specs import broadcast_specs, parse_leaf_spec, scope_and_name_generator
from .transform import mask

__all__ = ["jit", "ragged_map", "PolyJit", "RaggedMap"]


# ----------------------------------------------------------------------------
# Plans: which axes are dynamic, how sizes map to dim vars (host side, cached)
# ----------------------------------------------------------------------------
class _LeafPlan:
    __slots__ = ("path", "static", "axes", "shape")

    def __init__(self, path, static, axes, shape):
        self.path = path
        self.static = static  # True: passed unchanged (exact shape is part of the key)
        self.axes = axes  # per axis: ("s", size) or ("d", var_index, coeff, offset)
        self.shape = shape


class _Plan:
    """Spec analysis for one tree structure and one set of exact input shapes."""

    def __init__(self, leaf_plans, var_names, var_values, bound_fns):
        self.leaves: list[_LeafPlan] = leaf_plans
        self.var_names: list[str] = var_names
        self.var_values: list[int] = var_values
        self.bound_fns = bound_fns


def _make_plan(args, in_specs, constraints, policy_for) -> _Plan:
    leaves = jax.tree_util.tree_leaves(tuple(args))
    paths = ["args" + jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(tuple(args))[0]]
    spec_leaves = broadcast_specs(in_specs, list(args), None)
    scope, gen_name = scope_and_name_generator(spec_leaves, constraints)

    var_index: dict[str, int] = {}
    var_values: list[int] = []
    var_where: list[str] = []
    leaf_plans = []
    for leaf, spec, path in zip(leaves, spec_leaves, paths):
        shape = tuple(int(d) for d in np.shape(leaf))
        is_scalar_py = isinstance(leaf, (bool, int, float, complex))
        dynamic_default = in_specs is None and len(shape) > 0 and not is_scalar_py
        if (spec is None and not dynamic_default) or is_scalar_py:
            leaf_plans.append(_LeafPlan(path, True, None, shape))
            continue
        axes_specs = parse_leaf_spec(spec, path, shape, scope, default_dynamic=True,
                                     name_gen=gen_name)
        axes = []
        for a, size in zip(axes_specs, shape):
            if a.var is None:
                axes.append(("s", size))
                continue
            if size < a.offset or (size - a.offset) % a.coeff:
                raise ShapeError(f"{a.where}: size {size} is not of the form {a.expr} for an "
                                 f"integer {a.var} >= 0")
            value = (size - a.offset) // a.coeff
            if a.var not in var_index:
                var_index[a.var] = len(var_values)
                var_values.append(value)
                var_where.append(a.where)
            elif var_values[var_index[a.var]] != value:
                i = var_index[a.var]
                raise ShapeError(f"dim var '{a.var}' has different sizes: {var_values[i]} at "
                                 f"{var_where[i]} and {value} at {a.where}")
            axes.append(("d", var_index[a.var], a.coeff, a.offset))
        if all(ax[0] == "s" for ax in axes):
            leaf_plans.append(_LeafPlan(path, True, None, shape))
        else:
            leaf_plans.append(_LeafPlan(path, False, axes, shape))
    names = list(var_index)
    env = dict(zip(names, var_values))
    for kind, e1, e2, text in compat.explicit_constraints(scope):
        missing = (compat.dim_vars(e1) | compat.dim_vars(e2)) - set(env)
        if missing:
            raise ShapeError(f"constraint '{text}' names unknown dim vars {sorted(missing)}")
        v1, v2 = int(compat.evaluate_dim(e1, env)), int(compat.evaluate_dim(e2, env))
        if (kind == "==" and v1 != v2) or (kind == ">=" and v1 < v2):
            raise ShapeError(f"constraint '{text}' does not hold for "
                             + ", ".join(f"{k}={env[k]}" for k in sorted(
                                 compat.dim_vars(e1) | compat.dim_vars(e2))))
    bound_fns = [policy_for(n) for n in names]
    return _Plan(leaf_plans, names, var_values, bound_fns)


def _policy_getter(buckets):
    if isinstance(buckets, dict):
        default = as_policy(buckets.get(None, pow2()))
        table = {k: as_policy(v) for k, v in buckets.items() if k is not None}
        return lambda name: table.get(name, default)
    p = as_policy(buckets)
    return lambda name: p


def _dtype_key(x):
    if isinstance(x, (bool, int, float, complex)):
        return type(x)
    dt = getattr(x, "dtype", None)
    return np.asarray(x).dtype if dt is None else dt


def _leaf_key(x):
    try:
        return (x.shape, x.dtype)
    except AttributeError:
        return (np.shape(x), _dtype_key(x))


def _pad_host(x, bound: tuple[int, ...]):
    """Pad ``x`` to ``bound`` with zeros on the host (NumPy: compiles nothing)."""
    shape = np.shape(x)
    if tuple(shape) == bound:
        return x  # nothing to pad: pass the array through unchanged
    a = np.asarray(x)
    out = np.zeros(bound, dtype=a.dtype)
    out[tuple(slice(0, s) for s in shape)] = a
    return out


# ----------------------------------------------------------------------------
# One compiled program per bucket signature
# ----------------------------------------------------------------------------
class _Entry:
    """One compiled program: a ``jax.jit`` of the masked function at one signature."""

    __slots__ = ("lock", "fn", "box", "compile_s")

    def __init__(self):
        self.lock = threading.Lock()
        self.fn = None
        self.box: dict = {}
        self.compile_s = 0.0


def _build_inner(fun, n_bcast, in_tree, leaf_plans, in_specs, constraints, box,
                 bcast_tree=None, n_bcast_leaves=0, host_sizes=False):
    """The traced function: rebuild ``Masked`` inputs from a size vector, run ``mask(fun)``.

    Returns the output data leaves and the dynamic output sizes as one int32
    vector; static output sizes and the output tree go to ``box`` at trace time.
    """
    mask_specs = None if in_specs is None else (None,) * n_bcast + tuple(in_specs)
    masked = mask(fun, mask_specs, constraints=constraints, checks=False)

    n_static = sum(1 for p in leaf_plans if p.static)

    def inner(*flat_in):
        bcast_leaves = flat_in[:n_bcast_leaves]
        static_it = iter(flat_in[n_bcast_leaves:n_bcast_leaves + n_static])
        dyn_it = iter(flat_in[n_bcast_leaves + n_static:-1])
        sizes = flat_in[-1]
        box["traces"] = box.get("traces", 0) + 1
        flat = []
        for p in leaf_plans:
            if p.static:
                flat.append(next(static_it))
                continue
            data = next(dyn_it)
            shp = []
            for ax in p.axes:
                if ax[0] == "s":
                    shp.append(ax[1])
                else:
                    _, i, a, b = ax
                    s = sizes[i]
                    if a != 1:
                        s = s * a
                    if b:
                        s = s + b
                    shp.append(s)
            flat.append(Masked(data, tuple(shp)))
        args = jax.tree_util.tree_unflatten(in_tree, flat)
        if n_bcast:
            args = tuple(jax.tree_util.tree_unflatten(bcast_tree, list(bcast_leaves))) + args
        out = masked(*args)
        out_leaves, out_tree = jax.tree_util.tree_flatten(
            out, is_leaf=lambda x: isinstance(x, Masked))
        # Output sizes that are dimension expressions of the input dim vars are
        # computed on the host from the exact input shapes (no device round trip);
        # only data-dependent sizes (polymask.nonzero, ...) come back from the device.
        progs = list(getattr(masked, "_polymask_cache", {}).values())
        prog = progs[-1] if progs and host_sizes else None
        sym_out = prog.out_shapes if prog is not None else None
        in_vars = set(prog.var_bounds) if prog is not None else set()
        datas, dyn_sizes, out_axes = [], [], []
        for li, o in enumerate(out_leaves):
            if not isinstance(o, Masked):
                o = Masked(jnp.asarray(o))
            datas.append(o.data)
            axes = []
            for k, s in enumerate(o.shape):
                expr = sym_out[li][k] if sym_out is not None and li < len(sym_out) else None
                if isinstance(s, (int, np.integer)):
                    axes.append(("s", int(s)))
                elif (expr is not None and compat.is_dim_expr(expr)
                      and compat.dim_vars(expr) <= in_vars):
                    axes.append(("h", expr))
                else:
                    axes.append(("d", len(dyn_sizes)))
                    dyn_sizes.append(jnp.asarray(s, jnp.int32).reshape(()))
            out_axes.append(tuple(axes))
        box["out_tree"] = out_tree
        box["out_axes"] = out_axes
        box["in_axes"] = prog.axis_specs if prog is not None else None
        box["has_sizes"] = bool(dyn_sizes)
        if not dyn_sizes:
            return datas
        return datas, jnp.stack(dyn_sizes)

    return inner


class _Runner:
    """Shared machinery of ``PolyJit`` and ``RaggedMap``: plans, cache, stats."""

    def __init__(self, fun, in_specs, buckets, constraints, cache_size):
        if isinstance(in_specs, str):
            in_specs = (in_specs,)
        self.fun = fun
        self.in_specs = None if in_specs is None else tuple(in_specs)
        self.constraints = tuple(constraints)
        self._policy_for = _policy_getter(buckets)
        self.cache_size = int(cache_size)
        self._lock = threading.Lock()
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._spec_key = repr(self.in_specs)
        self._stats = dict(calls=0, compiles=0, cache_hits=0, evictions=0,
                           compile_time_s=0.0, logical_elements=0, padded_elements=0)

    # -- plans -----------------------------------------------------------------
    def _plan(self, args, in_specs=None, spec_key=None):
        if spec_key is None:
            in_specs, spec_key = self.in_specs, None
        leaves, tree = jax.tree_util.tree_flatten(tuple(args))
        shapes = tuple((np.shape(x), _dtype_key(x)) for x in leaves)
        key = (tree, shapes, spec_key)
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
        if plan is None:
            plan = _make_plan(args, in_specs, self.constraints, self._policy_for)
            with self._lock:
                self._plans[key] = plan
                while len(self._plans) > 4096:
                    self._plans.popitem(last=False)
        return plan, leaves, tree

    def _buckets(self, plan):
        return [fn(v) for fn, v in zip(plan.bound_fns, plan.var_values)]

    @staticmethod
    def _padded_shape(p: _LeafPlan, bucket_vals):
        return tuple(ax[1] if ax[0] == "s" else ax[2] * bucket_vals[ax[1]] + ax[3]
                     for ax in p.axes)

    # -- cache -------------------------------------------------------------------
    def _entry(self, key):
        with self._lock:
            e = self._cache.get(key)
            if e is not None:
                self._cache.move_to_end(key)
                self._stats["cache_hits"] += 1
                return e, False
            e = _Entry()
            self._cache[key] = e
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
                self._stats["evictions"] += 1
            return e, True

    def _entry_counted(self, info):
        """``_entry`` plus the per-call stats, under one lock acquisition."""
        with self._lock:
            st = self._stats
            st["calls"] += 1
            st["logical_elements"] += info.logical
            st["padded_elements"] += info.padded
            e = self._cache.get(info.key)
            if e is not None:
                self._cache.move_to_end(info.key)
                st["cache_hits"] += 1
                return e
        return self._entry(info.key)[0]

    def _call_entry(self, entry, make_fn, flat_args):
        """Run ``entry`` (tracing and compiling it on first use, once, under its lock)."""
        fn = entry.fn
        if fn is not None:
            return fn(*flat_args)
        with entry.lock:
            if entry.fn is None:
                t0 = time.perf_counter()
                fn = jax.jit(make_fn(entry.box))
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


def _slice(a, shape):
    return a[tuple(slice(0, int(n)) for n in shape)]


def _out_shapes(box, sizes_np, fast_key):
    """Exact output shapes: static, host-evaluated from the input shapes, or from the device."""
    env = None
    shapes = []
    for axes in box["out_axes"]:
        shape = []
        for ax in axes:
            if ax[0] == "s":
                shape.append(ax[1])
            elif ax[0] == "d":
                shape.append(int(sizes_np[ax[1]]))
            else:
                if env is None:
                    env = {}
                    for (shp, _), specs in zip(fast_key[1], box["in_axes"]):
                        for a in specs:
                            if a.var is not None:
                                env[a.var] = (int(shp[a.axis]) - a.offset) // a.coeff
                shape.append(max(0, int(compat.evaluate_dim(ax[1], env))))
        shapes.append(tuple(shape))
    return shapes


class _CallInfo:
    """Everything a call needs for one (tree, exact shapes): the host fast path."""

    __slots__ = ("static_idx", "dyn_idx", "bounds", "sizes", "logical", "padded", "key",
                 "out_shapes", "out_entry")

    def __init__(self, static_idx, dyn_idx, bounds, sizes, logical, padded, key):
        self.static_idx = static_idx
        self.dyn_idx = dyn_idx
        self.bounds = bounds
        self.sizes = sizes
        self.logical = logical
        self.padded = padded
        self.key = key
        self.out_shapes = None
        self.out_entry = None


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

    def _info(self, args, leaves, tree, fast_key):
        plan, _, _ = self._plan(args)
        bvals = self._buckets(plan)
        static_idx, dyn_idx, bounds, sig = [], [], [], []
        logical = padded = 0
        for i, (x, p) in enumerate(zip(leaves, plan.leaves)):
            if p.static:
                static_idx.append(i)
                sig.append(("S", p.shape, _dtype_key(x)))
                continue
            bound = self._padded_shape(p, bvals)
            dyn_idx.append(i)
            bounds.append(bound)
            sig.append(("D", bound, _dtype_key(x)))
            logical += math.prod(p.shape)
            padded += math.prod(bound)
        info = _CallInfo(tuple(static_idx), tuple(dyn_idx), tuple(bounds),
                         jax.device_put(np.asarray(plan.var_values, np.int32)), logical, padded,
                         (tree, tuple(sig)))
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
            info = self._info(args, leaves, tree, fast_key)
        flat = [leaves[i] for i in info.static_idx]
        flat += [_pad_host(leaves[i], b) for i, b in zip(info.dyn_idx, info.bounds)]
        flat.append(info.sizes)
        entry = self._entry_counted(info)
        if entry.fn is None:
            plan, _, _ = self._plan(args)
            make = lambda box: _build_inner(self.fun, 0, tree, plan.leaves, self.in_specs,
                                            self.constraints, box, host_sizes=True)
        else:
            make = None
        out = self._call_entry(entry, make, flat)
        box = entry.box
        if box["has_sizes"]:
            datas, out_sizes = out
            shapes = _out_shapes(box, np.asarray(out_sizes), fast_key)
        else:
            datas = out
            shapes = info.out_shapes
            if shapes is None or info.out_entry is not entry:
                shapes = info.out_shapes = _out_shapes(box, (), fast_key)
                info.out_entry = entry
        outs = []
        for d, shape in zip(datas, shapes):
            if d.shape == shape:
                outs.append(np.asarray(d) if self.numpy_outputs else d)
            elif self.numpy_outputs:
                outs.append(_slice(np.asarray(d), shape))
            else:
                outs.append(self._unpad_device(d, shape))
        return jax.tree_util.tree_unflatten(box["out_tree"], outs)

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


# ----------------------------------------------------------------------------
# ragged_map
# ----------------------------------------------------------------------------
class RaggedMap(_Runner):
    """The callable returned by ``polymask.ragged_map`` (see there)."""

    def __init__(self, fun, in_specs=None, *, buckets=None, batch_size=32, batch_buckets=None,
                 constraints=(), cache_size=64, progress=False, numpy_outputs=False):
        super().__init__(fun, in_specs, buckets, constraints, cache_size)
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.batch_size = int(batch_size)
        if batch_buckets is None:
            batch_buckets = pow2(minimum=max(1, self.batch_size // 4))
        self._batch_policy = as_policy(batch_buckets)
        self.progress = progress
        self.numpy_outputs = numpy_outputs
        functools.update_wrapper(self, fun)

    def _auto_specs(self, arg_lists):
        """in_specs=None: the axes whose sizes differ across examples are dynamic."""
        trees = {jax.tree_util.tree_structure(a) for a in arg_lists}
        if len(trees) != 1:
            raise ShapeError("ragged_map: examples have different pytree structures "
                             f"({len(trees)} kinds)")
        per_ex = [jax.tree_util.tree_leaves(a) for a in arg_lists]
        n_leaves = len(per_ex[0])
        leaf_specs = []
        for li in range(n_leaves):
            shapes = [np.shape(ex[li]) for ex in per_ex]
            if len({len(sh) for sh in shapes}) != 1:
                raise ShapeError(f"ragged_map: leaf {li} of the examples has different ranks")
            first = shapes[0]
            varying = [any(sh[k] != first[k] for sh in shapes) for k in range(len(first))]
            if not any(varying):
                leaf_specs.append(None)
                continue
            leaf_specs.append(", ".join(f"l{li}_{k}" if v else str(first[k])
                                        for k, v in enumerate(varying)))
        specs, it = [], iter(leaf_specs)
        for a in arg_lists[0]:
            sub = jax.tree_util.tree_structure(a)
            vals = [next(it) for _ in range(sub.num_leaves)]
            specs.append(vals[0] if sub.num_leaves == 1 and sub == jax.tree_util.tree_structure(
                0) else jax.tree_util.tree_unflatten(sub, vals))
        return tuple(specs)

    def __call__(self, examples: Sequence[Any], *broadcast, progress=None):
        """Map over ``examples``; ``broadcast`` arguments are passed unbatched first."""
        examples = list(examples)
        if not examples:
            return []
        arg_lists = [ex if isinstance(ex, tuple) else (ex,) for ex in examples]
        if self.in_specs is None:
            in_specs = self._auto_specs(arg_lists)
        else:
            in_specs = self.in_specs
        spec_key = repr(in_specs)
        bcast_leaves, bcast_tree = jax.tree_util.tree_flatten(tuple(broadcast))
        bcast_key = (bcast_tree, tuple((np.shape(x), _dtype_key(x)) for x in bcast_leaves))
        groups: dict = collections.defaultdict(list)
        infos = []
        for i, args in enumerate(arg_lists):
            plan, leaves, tree = self._plan(args, in_specs, spec_key)
            bvals = self._buckets(plan)
            sig = []
            for x, p in zip(leaves, plan.leaves):
                if p.static:
                    sig.append(("S", p.shape, _dtype_key(x)))
                else:
                    sig.append(("D", self._padded_shape(p, bvals), _dtype_key(x)))
            groups[(tree, tuple(sig))].append(i)
            infos.append((plan, leaves))
        results: list[Any] = [None] * len(examples)
        show = self.progress if progress is None else progress
        bar = None
        if show:
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(examples), desc="polymask", unit="ex")
            except ImportError:  # pragma: no cover - tqdm is optional
                bar = None
        try:
            for (tree, sig), idxs in groups.items():
                for start in range(0, len(idxs), self.batch_size):
                    chunk = idxs[start:start + self.batch_size]
                    self._run_batch(tree, sig, chunk, infos, results, broadcast,
                                    bcast_leaves, bcast_tree, bcast_key, in_specs, spec_key)
                    if bar is not None:
                        bar.update(len(chunk))
        finally:
            if bar is not None:
                bar.close()
        return results

    def _run_batch(self, tree, sig, chunk, infos, results, broadcast, bcast_leaves, bcast_tree,
                   bcast_key, in_specs, spec_key):
        B = min(self.batch_size, max(len(chunk), self._batch_policy(len(chunk))))
        rows = chunk + [chunk[0]] * (B - len(chunk))
        plan0, leaves0 = infos[chunk[0]]
        static_leaves = [x for x, p in zip(leaves0, plan0.leaves) if p.static]
        dyn = []
        logical = padded = 0
        for li, p in enumerate(plan0.leaves):
            if p.static:
                continue
            bound = sig[li][1]
            buf = np.zeros((B,) + bound, dtype=sig[li][2])
            for r, ex in enumerate(rows):
                x = np.asarray(infos[ex][1][li])
                buf[(r,) + tuple(slice(0, n) for n in x.shape)] = x
                if r < len(chunk):
                    logical += x.size
            padded += math.prod(bound) * len(chunk)
            dyn.append(buf)
        sizes = np.asarray([infos[ex][0].var_values for ex in rows], np.int32).reshape(B, -1)
        entry, _ = self._entry((tree, sig, B, bcast_key, spec_key))
        with self._lock:
            st = self._stats
            st["calls"] += 1
            st["logical_elements"] += logical
            st["padded_elements"] += padded
        nb, ns, nd = len(bcast_leaves), len(static_leaves), len(dyn)

        def make(box):
            inner = _build_inner(self.fun, len(broadcast), tree, plan0.leaves, in_specs,
                                 self.constraints, box, bcast_tree, nb)
            return jax.vmap(inner, in_axes=(None,) * (nb + ns) + (0,) * (nd + 1))

        out = self._call_entry(entry, make, [*bcast_leaves, *static_leaves, *dyn, sizes])
        box = entry.box
        if box["has_sizes"]:
            datas, out_sizes = out
            out_sizes = np.asarray(out_sizes)
        else:
            datas, out_sizes = out, None
        datas = [np.asarray(d) for d in datas]
        for r, ex in enumerate(chunk):
            outs = []
            for d, axes in zip(datas, box["out_axes"]):
                shape = tuple(ax[1] if ax[0] == "s" else int(out_sizes[r, ax[1]])
                              for ax in axes)
                a = _slice(d[r], shape)
                outs.append(np.array(a) if self.numpy_outputs else jnp.asarray(a))
            results[ex] = jax.tree_util.tree_unflatten(box["out_tree"], outs)


def ragged_map(fun: Callable, in_specs=None, *, buckets=None, batch_size: int = 32,
               batch_buckets=None, constraints: Sequence[str] = (), cache_size: int = 64,
               progress: bool = False, numpy_outputs: bool = False) -> RaggedMap:
    """Map ``fun`` over a list of examples of different sizes, in ragged batches.

    ``ragged_map(fun, ...)(examples, *broadcast)`` returns
    ``[fun(*broadcast, *ex) for ex in examples]`` (an example that is not a tuple
    is one argument), computed as ``jit(vmap(mask(fun)))`` over batches of
    examples that share a bucket signature.

    Args:
      fun: a function written for exact arrays.
      in_specs: specs of the example arguments (as for ``polymask.jit``);
        broadcast arguments are always static (e.g. model parameters).
      buckets: bucketing policy for the dim vars (default ``pow2()``).
      batch_size: most examples per batch.
      batch_buckets: policy for the batch size of a partial batch (default:
        powers of two from ``batch_size // 4``; rows are filled with copies).
      progress: show a tqdm progress bar.
      numpy_outputs: return NumPy arrays instead of ``jax.Array``.

    Returns:
      A ``RaggedMap`` callable with ``.stats()`` (calls = batches run).
    """
    return RaggedMap(fun, in_specs, buckets=buckets, batch_size=batch_size,
                     batch_buckets=batch_buckets, constraints=constraints,
                     cache_size=cache_size, progress=progress, numpy_outputs=numpy_outputs)
