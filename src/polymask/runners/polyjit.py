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
can compile (first calls, ``precompile``, tiered background compiles, device
padding): ``stats()["xla_compiles"]``. The steady-state call path compiles nothing.

This module makes the calls; ``core/plan.py`` decides what a call means (specs,
sizes, buckets, output layouts); ``programs.ProgramCache`` keeps the compiled
programs and the stats, ``programs.CallPlans`` the plans, and
``tiering.Tiering`` picks a covering bucket while a tight one compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .. import _jax_compat as compat
from ..core.binding import (
    KeywordWithoutSpec,
    check_arity,
    check_function_first,
    keywords_as_positional,
    runner_specs,
)
from ..core.buckets import int_arg
from ..core.diagnostics import with_note, with_size_names
from ..core.errors import (
    FailsAsPlainJax,
    ShapeError,
    TooManyCases,
    UnsupportedError,
    plain_type_of,
    typed_as,
    with_plain_state,
)
from ..core.masked import Masked
from ..core.plan import CallPlan, dtype_key, padded_shape, policy_getter
from ..core.shapes import canonical_dtype, native_byte_order
from ..core.specs import as_constraints
from ..tracing.cases.splitting import DEFAULT_MAX_CASES
from ..tracing.prologue import raise_run_failure
from ..tracing.trace_warnings import say_case_warnings
from .compiling import COMPILE_TICK, background_executor, compile_counter
from .envvars import env_switch
from .fallback import ExactFallback, bucket_text, falls_back, refusal_text
from .hostio import (
    FAST_TYPES,
    PAD_DEVICE_PROGRAMS,
    AliasedPadBuffers,
    HostPadBuffers,
    as_numpy_output,
    device_pad_fn,
    host_backend,
    unpad_output,
)
from .programs import (
    STATS_DOC,
    CallPlans,
    Entry,
    PerSizeBucket,
    ProgramCache,
    at_call_site_error,
    build_inner,
    case_error_is_plain,
    checked_compiler_options,
    count_value,
    fallback_where,
    finish_stats,
    needs_a_value,
    raise_case_error,
    reaches_error_case,
    reaches_untraced_case,
    specs_of_plan,
)
from .static_args import StaticArg, StaticArgs
from .tiering import Tiering, cover_key

__all__ = ["jit", "PolyJit", "compile_counter"]


def _leaf_key(x):
    try:
        return (type(x), x.shape, x.dtype, getattr(x, "weak_type", False))
    except AttributeError:
        return (type(x), np.shape(x), dtype_key(x))


def _weak_array(a) -> bool:
    """A weakly typed JAX array (its programs differ: it takes the general
    path, whose key says so, not the fast one keyed by shape and dtype)."""
    return type(a) is compat.ArrayImpl and a.weak_type


@dataclasses.dataclass(eq=False)
class _ValueAxis:
    """An input axis made static because the function needs its size as a
    Python value: the size it was first seen at, where it is, why."""
    size: int
    where: str
    var: str  # its dim var in the plan that found it (the error's name for it)
    error: BaseException
    said: bool = False


@dataclasses.dataclass(eq=False)
class _CallInfo:
    """Everything a ``PolyJit`` call needs for one (tree, exact shapes): the fast
    path. ``entry``: the bucket's program; ``calls``: a lock-free counter;
    ``out_shapes``: exact output shapes of ``out_entry`` (when none come from the device)."""

    plan: CallPlan
    tree: Any
    static_idx: tuple[int, ...]
    dyn: tuple  # (leaf index, bound, exact shape == bound, pad on device)
    sizes: Any  # the logical-size vector, on the device
    key: tuple
    in_shapes: list[tuple[int, ...]]
    entry: Entry | None = None
    calls: Any = dataclasses.field(default_factory=itertools.count)
    out_shapes: list | None = None
    out_exact: bool = False
    out_entry: Entry | None = None
    build: Callable | None = None
    single_out: bool = False
    error: ShapeError | None = None  # these sizes reach an error case (plain JAX's error)
    covered: bool = False  # served by a covering bucket before (tiered)
    shape_key: Any = None  # the exact shapes and dtypes (the fallback's cache key)
    unshared: str | None = None  # the bucket cannot share a program: why (per-shape fallback)
    # ``leaf -> padded array`` where the program's arguments are one padded
    # array and the sizes (the common case), else None; set with ``build``
    pad_one: Callable | None = None
    # ``(program, leaves) -> outputs`` of that case through an aliased buffer
    # (``AliasedPadBuffers``), else None; set with ``build``
    call_one: Callable | None = None
    # ``(program, leaf) -> outputs``: call_one for its one dynamic leaf (the steady state's)
    call_leaf: Callable | None = None


def _non_native(x) -> bool:
    """A NumPy array of a non-native byte order (``>f4``: ``native_byte_order``)."""
    return isinstance(x, np.ndarray) and not x.dtype.isnative


_STALE = object()  # a steady-state call found its program evicted or replaced


def _steady_call(info: _CallInfo, entry: Entry) -> Callable:
    """``leaf -> output`` of the steady state (one array in, one exact output
    back): the per-call work only (count the call, mark the program used for
    the eviction order, pad, run), with every attribute it needs bound once;
    ``_STALE`` once ``entry`` is evicted or no longer the info's program."""
    fn, calls, ticks, sizes = entry.fn, info.calls, COMPILE_TICK, info.sizes
    pad_one, build, call_leaf = info.pad_one, info.build, info.call_leaf

    if call_leaf is not None:
        def run(a):
            if entry.live and info.entry is entry:
                next(calls)
                entry.tick = next(ticks)
                return call_leaf(fn, a)[0]
            return _STALE
    elif pad_one is not None:
        def run(a):
            if entry.live and info.entry is entry:
                next(calls)
                entry.tick = next(ticks)
                return fn(pad_one(a), sizes)[0]
            return _STALE
    else:
        def run(a):
            if entry.live and info.entry is entry:
                next(calls)
                entry.tick = next(ticks)
                return fn(*build((a,)))[0]
            return _STALE

    return run


_DEFAULT_SPECS_HINT = (
    "\n  (without in_specs every axis of every array argument is a dim var, a model's "
    "parameters' too, whose shapes a library may check as Python values: give in_specs "
    "with None for the arguments whose shapes never change, e.g. "
    "polymask.jit(model.apply, (None, 'n, _')) for apply(params, x))")


class _BucketUnshared(Exception):
    """The call's bucket failed to trace before: run per exact shape."""


class _CaseReached(Exception):
    """The call's sizes reach an error case of ``entry`` (``error``), found
    between its trace and its compile (``PolyJit._case_reached_first``)."""

    def __init__(self, entry: Entry, error: ShapeError):
        super().__init__(str(error))
        self.entry, self.error = entry, error


_LEAF_TREE = jax.tree_util.tree_structure(0)
_under_transformation = compat.under_transformation


TIERED_MIN_CACHE = 4  # the smallest cache_size that keeps tiered buckets on by default


class PolyJit:
    """The callable returned by ``polymask.jit`` (see there).

    ``cache``: its compiled programs and stats (``ProgramCache``); ``plans``:
    its call plans; ``tiering``: the covering-bucket strategy (None when
    ``tiered`` is off)."""

    FORWARD_ONLY = True  # its programs are never differentiated (explain shows that program)

    def __init__(self, fun, in_specs=None, *, buckets=None, constraints=(), cache_size=64,
                 numpy_outputs=False, tiered=None, compiler_options=None,
                 max_cases=None, fallback=True, static_argnums=None,
                 static_argnames=None):
        # (a runner of fun with static keyword arguments bound: _bound_runner)
        self._options = dict(buckets=buckets, constraints=constraints, cache_size=cache_size,
                             numpy_outputs=numpy_outputs, tiered=tiered,
                             compiler_options=compiler_options, max_cases=max_cases,
                             fallback=fallback, static_argnums=static_argnums)
        self._given_specs, self._static_argnames = in_specs, static_argnames
        self._bound: dict = {}  # static keywords -> the runner of fun with them bound
        statics = (StaticArgs(fun, static_argnums, static_argnames)
                   if static_argnums is not None or static_argnames is not None else None)
        self.static_args = statics if statics and (statics.argnums or statics.argnames) else None
        # fun as the runner calls it: static arguments arrive as StaticArgs
        self.fun = fun if self.static_args is None else self.static_args.unwrapping(fun)
        self._user_fun = fun
        self._plain_jit = None  # jax.jit of fun as written: .lower, .trace, .eval_shape
        self.in_specs = runner_specs(self.fun, in_specs, "polymask.jit")
        if self.static_args is not None:
            self.in_specs = self.static_args.specs(self.in_specs)
        self.constraints = as_constraints(constraints)
        # a bucket of per-size cases runs per exact shape, unless the user asked
        # for them in one program (max_cases given, or no fallback)
        self._per_size_per_shape = bool(fallback) and max_cases is None
        self.max_cases = int_arg(DEFAULT_MAX_CASES if max_cases is None else max_cases,
                                 "max_cases", 0)  # (4.0: never truncated)
        self.compiler_options = checked_compiler_options(compiler_options)
        self.numpy_outputs = numpy_outputs
        policy_for = policy_getter(buckets)
        self.plans = CallPlans(self.in_specs, self.constraints, policy_for,
                               equal_sizes_share=self.in_specs is None)
        # traced_calls: calls under jax.grad/jit/vmap (plain JAX's trace)
        self.cache = ProgramCache(cache_size, self.compiler_options,
                                  extra_stats=("traced_calls", "exact_compiles"))
        name = getattr(fun, "__name__", type(fun).__name__)
        # axes made static for their sizes as Python values: (leaf path, axis) -> _ValueAxis
        self._value_axes: dict[tuple, _ValueAxis] = {}
        self._fallback = (ExactFallback(self.fun, f"polymask.jit({name})", self.cache.add,
                                        self.compiler_options,
                                        hint=_DEFAULT_SPECS_HINT if in_specs is None else "")
                          if fallback else None)
        if tiered is None:  # a covering bucket and those it serves must fit the cache
            tiered = env_switch("POLYMASK_TIERED") and cache_size >= TIERED_MIN_CACHE
        tiered = bool(tiered)
        self.tiering = (Tiering(self.cache, policy_for, self._compile_first_ahead, self.constraints,
                                replans=lambda plan, e: self.plans.may_adapt_to(plan, e))
                        if tiered else None)
        self._infos: dict = {}
        self._fast: dict = {}
        self._steady: dict = {}  # _fast's key -> its steady-state call (_steady_call)
        self._pads = HostPadBuffers()  # large inputs' padded host buffers, reused
        self._aliased = AliasedPadBuffers()  # small ones, as jax.Arrays (XLA:CPU)
        self._last_new = None  # (tree, leaf structs) of the last call with new shapes
        self._n_specs = 0 if self.in_specs is None else len(self.in_specs)
        self._retired = [0, 0, 0]  # calls, logical, padded of dropped infos
        self._retired_exact = 0  # calls run per exact shape, of dropped infos
        self._keyword_calls = itertools.count()  # calls with keywords no spec covers
        self._fg_compiles_in_calls = 0
        self._this_call = threading.local()  # .compiles: this thread's call's foreground compiles
        self._cover_extra_padded = 0  # padded elements tiered calls ran beyond their own bucket's
        functools.update_wrapper(self, fun)

    def __get__(self, obj, objtype=None):
        # a method decorated as with jax.jit (functools.partial(polymask.jit,
        # static_argnums=0)): the instance is the first argument
        return self if obj is None else types.MethodType(self, obj)

    @property
    def tiered(self) -> bool:
        return self.tiering is not None

    @property
    def cache_size(self) -> int:
        return self.cache.cache_size

    @property
    def per_size_buckets_per_shape(self) -> bool:
        """Whether a bucket whose every size is a case of its own runs per exact
        shape (``cases.tree.per_size_reason``; the fallback on, ``max_cases``
        not given), as explain says."""
        return self._per_size_per_shape

    # -- call infos ----------------------------------------------------------------
    def _info(self, args, tree, key, fast: bool) -> _CallInfo:
        check_arity(self.fun, args)  # (once per call signature)
        plan, leaves, _ = self.plans.plan(args)
        if self._value_axes:
            self._check_value_axes(plan)
        self._last_new = (tree, [jax.ShapeDtypeStruct(np.shape(x),
                                                      canonical_dtype(x.dtype))
                                 if hasattr(x, "dtype") else x for x in leaves])
        device_pad = not host_backend()
        dyn = tuple((i, plan.leaves[i].padded, plan.leaves[i].shape == plan.leaves[i].padded,
                     device_pad and isinstance(leaves[i], jax.Array))
                    for i, p in enumerate(plan.leaves) if not p.static)
        info = _CallInfo(plan, tree, tuple(i for i, p in enumerate(plan.leaves) if p.static),
                         dyn, compat.upload(np.asarray(plan.values, np.int32)),
                         (tree, plan.signature), [p.shape for p in plan.leaves],
                         shape_key=key)
        with self.cache.lock:
            table = self._fast if fast else self._infos
            if len(table) > 4096:
                for old in table.values():
                    n = count_value(old.calls)
                    self._retired[0] += n
                    self._retired[1] += n * old.plan.logical
                    if old.unshared is None:
                        self._retired[2] += n * old.plan.padded
                    else:
                        self._retired[2] += n * old.plan.logical
                        self._retired_exact += n
                table.clear()
                if fast:  # its steady calls would count into retired infos
                    self._steady.clear()
            return table.setdefault(key, info)  # two threads: one info, one counter

    def example_arguments(self) -> tuple | None:
        """The shapes and dtypes (``jax.ShapeDtypeStruct``s; other leaves as
        given) of the most recent call whose shapes were new, as a tuple of
        positional arguments; None before the first call. ``polymask.explain``
        of this runner without example arguments explains them."""
        if self._last_new is None:
            return None
        tree, leaves = self._last_new
        return tuple(jax.tree_util.tree_unflatten(tree, leaves))

    def positional_arguments(self, args: tuple, kwargs: dict | None = None) -> tuple:
        """A call's arguments as this runner plans them (``polymask.explain``,
        ``precompile``): static arguments as ``StaticArg``s, keywords at their
        positions (parameters skipped before one take their defaults; later
        ones are left to ``fun``'s).

        Raises:
          TypeError: the arguments do not fit ``fun``'s signature.
          ValueError: an unhashable static argument (as ``jax.jit``).
        """
        kwargs = kwargs or {}
        if self.static_args is not None:
            args, kwargs = self.static_args.wrap(tuple(args), kwargs)
        if kwargs or len(args) < self._n_specs:
            args = keywords_as_positional(self.fun, self.in_specs, tuple(args), kwargs)
        return tuple(args)

    def explained_runner(self, args: tuple, kwargs: dict) -> tuple[PolyJit, tuple]:
        """``(runner, positional arguments)`` that ``polymask.explain`` explains
        for a call with keyword arguments: static keywords without a position
        (flax's ``apply(params, x, train=False)``) in the runner they are
        bound into, as a call binds them (``_bound_runner``).

        Raises:
          TypeError: a keyword that is not static and has no position (a call
            runs it per exact shape, as ``jax.jit``: nothing shared to explain),
            or arguments that do not fit ``fun``'s signature.
        """
        if self.static_args is not None:
            args, kwargs = self.static_args.wrap(tuple(args), dict(kwargs))
        try:
            return self, keywords_as_positional(self.fun, self.in_specs, tuple(args), kwargs)
        except KeywordWithoutSpec:
            static = {k: v for k, v in kwargs.items() if type(v) is StaticArg}
            rest = sorted(k for k in kwargs if k not in static)
            if rest:
                raise TypeError(
                    f"explain: keyword argument(s) {rest} have no position in the specs of "
                    f"{getattr(self._user_fun, '__name__', 'fun')}: a call with them runs per "
                    "exact shape (as jax.jit), so no shared program explains it; make them "
                    "static (static_argnames=) or pass them positionally") from None
            return self._bound_runner(static), tuple(args)

    def explained_specs(self, args):
        """The specs this runner traces ``args`` with (``polymask.explain``):
        its ``in_specs`` (with the dim vars it made static written as the
        call's sizes), or without them the call's own dim vars (equal
        sizes named alike; axes found meeting a fixed size in earlier calls
        static): a tuple of per-argument spec pytrees (strings, None for a
        static leaf).

        Raises:
          ShapeError: ``args`` do not fit the specs (as a call would)."""
        if self.in_specs is not None and not self.plans.static_vars:
            return self.in_specs
        plan, _, tree = self.plans.plan(tuple(args))
        return specs_of_plan(tree, plan)

    def explained_constraints(self) -> tuple[str, ...]:
        """The constraints of the program ``explained_specs`` names: those of
        dim vars made static (``CallPlans.static_vars``) are checked where
        the call is planned, not in the program."""
        return self.plans.constraints_of_static_plans()

    def padded_example(self, args) -> tuple:
        """``args`` as this runner pads them, abstract: each dynamic array leaf a
        ``Masked`` of a ``jax.ShapeDtypeStruct`` of its bucket's padded shape
        with the leaf's logical shape; other leaves as given
        (``polymask.explain`` shows the bucket's program at these sizes).

        Raises:
          ShapeError: ``args`` do not fit the specs (as a call would).
        """
        plan, leaves, tree = self.plans.plan(tuple(args))
        out = [leaf if p.static else Masked(jax.ShapeDtypeStruct(p.padded, canonical_dtype(
            leaf.dtype)), tuple(p.shape)) for p, leaf in zip(plan.leaves, leaves)]
        return tuple(jax.tree_util.tree_unflatten(tree, out))

    def stats(self) -> dict:
        s = self._counts()
        for runner in list(self._bound.values()):
            for k, v in runner._counts().items():
                if type(v) in (int, float) and k in s:
                    s[k] += v
        return finish_stats(s)

    stats.__doc__ = STATS_DOC

    def _counts(self) -> dict:
        """``stats()`` before the padding fraction, of this runner alone."""
        s = self.cache.stats()
        calls, logical, padded = self._retired
        exact = self._retired_exact
        for table in (self._infos, self._fast):
            for info in list(table.values()):
                n = count_value(info.calls)
                calls += n
                logical += n * info.plan.logical
                if info.unshared is None:
                    padded += n * info.plan.padded
                else:  # run per exact shape: nothing padded
                    padded += n * info.plan.logical
                    exact += n
        kw = count_value(self._keyword_calls)
        s["calls"] = calls + kw
        s["exact_calls"] = exact + kw
        s["logical_elements"] = logical
        s["padded_elements"] = padded + self._cover_extra_padded
        s["cache_hits"] = calls + kw - self._fg_compiles_in_calls
        return s

    def wait(self) -> None:
        """Wait for the background compiles started so far (tiered buckets)."""
        self.cache.wait()
        for runner in list(self._bound.values()):
            runner.wait()

    def clear_cache(self) -> None:
        """Drop every compiled program (stats are kept)."""
        for runner in list(self._bound.values()):
            runner.clear_cache()
        self.cache.clear()
        self.plans.clear()
        self._pads.clear()
        self._aliased.clear()
        self._steady.clear()

    def _flat(self, info: _CallInfo, leaves, dyn=None):
        """The compiled program's arguments: static leaves, padded dynamic leaves, sizes."""
        if dyn is None:
            build = info.build
            if build is None:
                info.pad_one = self._one_padder(info.static_idx, info.dyn, leaves)
                info.call_leaf = self._leaf_caller(info, leaves)
                if info.call_leaf is not None:
                    i, call_leaf = info.dyn[0][0], info.call_leaf
                    info.call_one = lambda fn, leaves: call_leaf(fn, leaves[i])
                build = info.build = self._builder(info.static_idx, info.dyn, info.sizes, leaves,
                                                   info.pad_one)
            return build(leaves)
        return self._builder(info.static_idx, dyn, info.sizes, leaves,
                             self._one_padder(info.static_idx, dyn, leaves))(leaves)

    def _one_padder(self, static_idx, dyn, leaves) -> Callable | None:
        """``leaf -> padded array`` where the program's arguments are one
        dynamic array, padded on the host, and the sizes; else None."""
        if static_idx or len(dyn) != 1 or dyn[0][3]:
            return None
        i, bound, exact, _ = dyn[0]
        if exact:
            return native_byte_order if _non_native(leaves[i]) else (lambda a: a)
        index = tuple(slice(0, s) for s in np.shape(leaves[i]))
        pad, ndarray, asarray = self._pads.padder(bound, dtype_key(leaves[i])), np.ndarray, np.asarray

        def pad_one(a):
            return pad(a if type(a) is ndarray else asarray(a), index)

        return pad_one

    def _leaf_caller(self, info: _CallInfo, leaves) -> Callable | None:
        """``(program, leaf) -> outputs`` where ``pad_one`` applies and the
        padded array is small on XLA:CPU: the one dynamic leaf is written into
        a buffer that a ``jax.Array`` aliases (``AliasedPadBuffers``), else
        padded by ``pad_one``; None where that does not apply."""
        if info.pad_one is None:
            return None
        i, bound, exact, _ = info.dyn[0]
        dtype = dtype_key(leaves[i])
        if exact or not AliasedPadBuffers.applies(bound, dtype):
            return None
        return self._aliased.runner(bound, dtype, tuple(np.shape(leaves[i])), info.pad_one,
                                    info.sizes)

    def _builder(self, static_idx, dyn, sizes, leaves, pad_one):
        """A function ``leaves -> flat arguments`` specialised to one call
        signature: the shapes and dtypes of ``leaves``; ``pad_one`` is
        ``_one_padder``'s."""
        if pad_one is not None:  # the common case: one dynamic array
            i = dyn[0][0]
            return lambda leaves: (pad_one(leaves[i]), sizes)

        host_pads = {i: (self._pads.padder(bound, dtype_key(leaves[i])),
                         tuple(slice(0, s) for s in np.shape(leaves[i])))
                     for i, bound, exact, on_device in dyn if not (exact or on_device)}

        def general(leaves):
            flat = [leaves[i] for i in static_idx]
            for i, bound, exact, on_device in dyn:
                x = leaves[i]
                if exact:
                    flat.append(native_byte_order(x))
                elif on_device:
                    flat.append(self._pad_device(x, bound))
                else:
                    pad, index = host_pads[i]
                    flat.append(pad(np.asarray(x), index))
            flat.append(sizes)
            return flat

        return general

    def _pad_device(self, x, bound):
        key = (x.shape, bound, x.dtype)
        fn = PAD_DEVICE_PROGRAMS.get(key)
        if fn is not None:
            return fn(x)
        with compile_counter() as cc:
            out = device_pad_fn(x.shape, bound, x.dtype)(x)
        self.cache.add(pad_compiles=1, xla_compiles=cc.compiles)
        return out

    # -- calls ---------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.static_args is not None:  # their values join the call's tree structure
            args, kwargs = self.static_args.wrap(args, kwargs)
        traced = _under_transformation()
        if not kwargs and len(args) == 1 and not traced:
            a = args[0]
            if type(a) in FAST_TYPES and not _weak_array(a):
                run = self._steady.get((type(a), a.shape, a.dtype))
                if run is not None:
                    try:
                        out = run(a)
                    except Exception as e:
                        raise_run_failure(e)
                        raise
                    if out is not _STALE:
                        return out
        if kwargs or len(args) < self._n_specs:  # by fun's signature, defaults filled in
            try:
                args = keywords_as_positional(self.fun, self.in_specs, args, kwargs)
            except KeywordWithoutSpec as e:  # no spec position for it: as jax.jit
                if self._fallback is None:
                    raise
                return self._keywords_call(args, kwargs, e)
        if traced:  # inside the caller's jit/grad/vmap: fun is traced into it (as jax.jit)
            return self._traced_call(args)
        if len(args) == 1 and type(args[0]) in FAST_TYPES and not _weak_array(args[0]):
            key = (type(args[0]), args[0].shape, args[0].dtype)  # the common case: one array
        elif all(type(a) in FAST_TYPES and not _weak_array(a) for a in args):
            key = tuple([(type(a), a.shape, a.dtype) for a in args])
        else:
            key = None
        if key is not None:  # every argument is one array: no pytree flattening
            leaves = args
            info = self._fast.get(key)
            if info is None:
                info = self._info(args, jax.tree_util.tree_structure(args), key, True)
        else:
            leaves, tree = jax.tree_util.tree_flatten(args)
            if any(map(compat.is_tracer, leaves)):
                return self._traced_call(args)
            key = (tree, tuple(map(_leaf_key, leaves)))
            info = self._infos.get(key)
            if info is None:
                info = self._info(args, tree, key, False)
        next(info.calls)
        if info.error is not None:  # (a shape whose first call raised)
            error = info.error if self.in_specs is not None else with_size_names(
                info.error, info.plan.var_axes())
            raise with_plain_state(at_call_site_error(error),
                                   info.error.__cause__) from info.error.__cause__
        if info.unshared is not None:
            return self._exact_call(info, args)
        entry = info.entry
        if entry is not None and entry.live:
            entry.tick = next(COMPILE_TICK)
            build, call_one = info.build, info.call_one
            try:
                if call_one is not None:
                    out = call_one(entry.fn, leaves)
                else:
                    out = entry.fn(*(build(leaves) if build is not None
                                     else self._flat(info, leaves)))
            except Exception as e:
                raise_run_failure(e)
                raise
            if info.out_entry is entry and info.single_out:
                if build is not None and leaves is args and len(args) == 1 and self._n_specs <= 1:
                    self._steady[key] = _steady_call(info, entry)  # the next call takes it
                return out[0]  # one exact output (the steady state of most functions)
        else:
            try:
                return self._first_call(info, args, leaves)
            except (ShapeError, UnsupportedError) as e:
                if self.in_specs is None:
                    raise with_size_names(e, info.plan.var_axes()) from e.__cause__
                raise
        return self._outputs(info, entry, out)

    def _first_call(self, info: _CallInfo, args, leaves):
        """A call whose bucket has no live program: trace, compile and run it,
        or reach its error case or the per-shape fallback."""
        self._this_call.compiles = 0
        try:
            entry, out = self._slow_call(info, leaves)
        except _CaseReached as reached:  # before its bucket compiled
            return self._reached_error_case(info, reached.entry, args, reached.error)
        except Exception as e:
            raise_run_failure(e)
            if self._fallback is not None and isinstance(e, FailsAsPlainJax):
                return self._plain_or_its_error(info, None, args, e)
            if falls_back(e) and self._adapt(info.plan, e):
                return self._planned_again(info, args)
            if self._fallback is None or not falls_back(e):
                raise
            return self._fall_back(info, args, e)
        try:
            raise_case_error(entry, info.plan.var_names, info.plan.values)
        except ShapeError as e:
            return self._reached_error_case(info, entry, args, e)
        return self._outputs(info, entry, out)

    def _reached_error_case(self, info: _CallInfo, entry: Entry, args, error: ShapeError):
        """The call's sizes reach an error case of ``entry``'s case tree: planned
        again where an axis met a fixed size, else plain ``jax.jit``'s outputs
        or error (``_plain_or_its_error``), else the error."""
        if self._adapt(info.plan, error):  # their case met a fixed size
            return self._planned_again(info, args)
        if self._fallback is not None:
            return self._plain_or_its_error(info, entry, args, error)
        info.error = error
        raise at_call_site_error(error) from None

    def _adapt(self, plan: CallPlan, error: BaseException) -> bool:
        """``plans.adapt_to``: later calls planned around what ``error`` found.
        An axis made static because the function needs its size as a Python
        value (``TooManyCases`` naming it), not because it met a fixed size
        (``x @ W``), is noted: it is said as a per-shape fallback once it is
        seen at a second size (``_check_value_axes``): a parameter's axis
        (flax's initialisers read ``fan_in`` as a Python value) has one size,
        and is static for free."""
        names = getattr(error, "fixed_size_vars", ()) if needs_a_value(error) else ()
        if not self.plans.adapt_to(plan, error):
            return False
        if names:
            with self.cache.lock:
                for leaf in plan.leaves:
                    for k, a in enumerate(leaf.axes or ()):
                        if a.var in names:
                            self._value_axes.setdefault(
                                (leaf.path, k), _ValueAxis(leaf.shape[k], a.where, a.var, error))
        return True

    def _check_value_axes(self, plan: CallPlan) -> None:
        """A call whose plan has an axis made static for its size as a Python
        value (``_adapt``) at a size other than the one it was first seen at:
        each size of it compiles its own program, as jax.jit does. Said once
        per axis (``FallbackWarning``, ``.fallbacks()``); with
        ``fallback=False``, a ``ShapeError`` (the masked trace's) instead."""
        for leaf in plan.leaves:
            for k, size in enumerate(leaf.shape):
                axis = self._value_axes.get((leaf.path, k))
                if axis is None or axis.size == size or (
                        leaf.axes is not None and leaf.axes[k].var is not None):
                    continue  # (static at one size only: symbolic again at this one)
                if self._fallback is None:
                    raise at_call_site_error(with_size_names(with_note(
                        axis.error, f"(fallback=False: {axis.where} was static at size "
                        f"{axis.size}; this call's size {size} would compile its own program, "
                        "as jax.jit does)"), {axis.var: axis.where}))
                if not axis.said:
                    axis.said = True
                    self._fallback.made_static(axis.where, axis.error,
                                               {axis.var: axis.where})

    def _planned_again(self, info: _CallInfo, args):
        """The call again, once its plan made axes static that met a fixed size
        (``CallPlans.adapt_to``): its old plan's info is dropped, and later
        calls of every shape plan with those axes static."""
        with self.cache.lock:
            for table in (self._fast, self._infos):
                if table.get(info.shape_key) is info:
                    del table[info.shape_key]
            self._steady.clear()
            # (the old info's calls go with it, and so do the compiles of this
            # call's first try: cache_hits is calls less foreground compiles)
            self._fg_compiles_in_calls -= getattr(self._this_call, "compiles", 0)
        return self(*args)

    def _plain_or_its_error(self, info: _CallInfo, entry: Entry | None, args,
                            error: ShapeError):
        """These exact arrays reach an error of the masked trace (an error case
        of ``entry``, or every size failing: ``entry`` None): plain ``jax.jit``'s
        outputs where it runs them (``_error_case_run_plain``), else the
        masked trace's error (its sizes and remedies; plain JAX's own where
        the masked one is polymask's limit, ``TooManyCases``), of plain JAX's type
        (``errors.typed_as``) and chained to plain JAX's own exception on
        these arrays; where both are the same failure, the message adds plain
        JAX's line, which has the call's exact shapes (a bucket's trace has
        the bucket's: ``x (8, 3)`` for the ``(5, 3)`` passed)."""
        try:
            return self._error_case_run_plain(info, entry, args, error)
        except ShapeError as failure:
            plain = failure.__cause__
            if isinstance(error, TooManyCases):  # polymask's limit: plain JAX's words
                error = failure
        if plain is None:
            raise at_call_site_error(error) from None
        line = f"{type(plain).__name__}: {str(plain).strip().splitlines()[0]}" \
            if str(plain).strip() else type(plain).__name__
        text = str(error)
        if plain_type_of(error) is type(plain) and line not in text:
            at = text.find("\n  in the masked call at")
            at = len(text) if at < 0 else at
            error = type(error)(f"{text[:at]}\n  plain jax.jit on these exact arrays: "
                                f"{line}{text[at:]}")
        info.error = typed_as(error, type(plain))
        info.error.__cause__ = plain
        raise with_plain_state(at_call_site_error(info.error), plain) from plain

    def _error_case_run_plain(self, info: _CallInfo, entry: Entry | None, args,
                              error: ShapeError):
        """An error case of the masked trace (``entry`` None: every size
        fails), checked against plain ``jax.jit`` on the exact arrays (once per
        shape): plain JAX's outputs where it runs them.

        Raises:
          ShapeError: plain JAX fails on them too (``ExactFallback.plain_failure``).

        A case polymask could not trace symbolically (``np.arange(n)`` past the
        per-size limit) is its own limit; a case traced at these sizes that
        plain JAX runs is a polymask bug, warned as one. Served by a covering
        bucket (tiered) that could not trace these sizes, the shape is not
        marked: it runs in its own bucket once compiled."""
        out = self._fallback.call(info.shape_key, args)
        bug = entry is None or case_error_is_plain(entry, info.plan.var_names, info.plan.values)
        reason = (ShapeError("the masked trace takes these sizes to an error case, but plain "
                             f"jax.jit runs them (a polymask bug; please report it):\n{error}")
                  if bug else error)
        unshared = self._fallback.refused(fallback_where(entry, info.plan.var_names,
                                                         info.plan.values,
                                                         (entry or info.plan).buckets), reason,
                                          self._given_names(info.plan))
        self._fallback.warn_pending()
        # its own bucket, or an error its own bucket has too (outputs that differ at
        # these sizes; not the covering bucket's per-size limit): these shapes run per shape
        if entry is None or entry is info.entry or not reaches_untraced_case(
                entry, info.plan.var_names, info.plan.values):
            info.unshared = unshared
        return self._user_outputs(out)

    def _fall_back(self, info: _CallInfo, args, error: Exception):
        """The bucket of ``info`` cannot share a program (its trace failed now,
        or before: ``_BucketUnshared``): record why, and run per exact shape."""
        if isinstance(error, _BucketUnshared):  # (said once: a background trace's too)
            info.unshared = self._fallback.refused(bucket_text(info.plan.buckets),
                                                   ShapeError(str(error)),
                                                   self._given_names(info.plan))
            out = self._exact_call(info, args)
            self._fallback.warn_pending()
            return out
        info.unshared = refusal_text(error)
        try:
            out = self._exact_call(info, args, counted=True)  # _slow_call counted the failure
        except ShapeError as failed:
            # plain jax.jit fails on these arrays too: the call's error, no
            # fallback (fallbacks(), exact_calls); this shape raises it again
            info.unshared, info.error = None, failed
            raise
        info.unshared = self._fallback.refused(bucket_text(info.plan.buckets), error,
                                               self._given_names(info.plan))
        self._fallback.warn_pending()
        if info.entry is not None:
            info.entry.unshared = info.unshared
        return out

    def _given_names(self, plan: CallPlan) -> dict[str, str] | None:
        """The input axis of each dim var the runner named itself (no
        in_specs: ``s0`` -> ``args[0].shape[0]``), for its messages."""
        return plan.var_axes() if self.in_specs is None else None

    def _exact_call(self, info: _CallInfo, args, counted: bool = False):
        """``fun`` under ``jax.jit`` on the exact arrays (``fallback.ExactFallback``)."""
        fb = self._fallback
        if not counted and not fb.seen(info.shape_key):
            self._count_foreground_compile()
        try:
            out = fb.call(info.shape_key, args, info.unshared)
        except ShapeError as e:
            raise at_call_site_error(e) from e.__cause__
        return self._user_outputs(out)

    def _user_outputs(self, out):
        """Outputs of a per-shape program as the caller asked for them."""
        return jax.tree_util.tree_map(as_numpy_output, out) if self.numpy_outputs else out

    def _keywords_call(self, args, kwargs, error: ShapeError):
        """A call whose keyword arguments have no place in ``in_specs``
        (keyword-only parameters, ``**kwargs``): static ones (``static_argnames``)
        are bound into ``fun`` (``_bound_runner``: flax's ``apply(params, x,
        train=False)``, whose ``train`` goes to ``**kwargs``); with others
        left, ``jax.jit(fun)(*args, **kwargs)`` per exact shape, as ``jax.jit``
        runs it, warned once."""
        static = {k: v for k, v in kwargs.items() if type(v) is StaticArg}
        if static:
            rest = {k: v for k, v in kwargs.items() if k not in static}
            return self._bound_runner(static)(*args, **rest)
        next(self._keyword_calls)
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        key = ("keywords", tree, tuple(map(_leaf_key, leaves)))
        reason = self._fallback.refused("of calls with keyword arguments " + ", ".join(
            repr(k) for k in sorted(kwargs) if type(kwargs[k]) is not StaticArg), error)
        if not self._fallback.seen(key):
            self._count_foreground_compile()
        try:
            out = self._fallback.call(key, tuple(args), reason, kwargs=kwargs)
        except ShapeError as e:
            raise at_call_site_error(e) from e.__cause__
        return self._user_outputs(out)

    def _bound_runner(self, static: dict) -> PolyJit:
        """The runner of ``functools.partial(fun, **static)``, one per distinct
        static keyword values (as ``jax.jit`` keys a program on them), with
        this runner's options; its stats and fallbacks are this runner's."""
        key = tuple(sorted(static.items()))
        with self.cache.lock:
            runner = self._bound.get(key)
            if runner is None:
                fun = functools.partial(self._user_fun, **{k: v.value for k, v in key})
                fun.__name__ = getattr(self._user_fun, "__name__", "fun")  # (messages)
                names = self._static_argnames
                names = ([n for n in ((names,) if isinstance(names, str) else names)
                          if n not in static] if names is not None else None)
                runner = PolyJit(fun, self._given_specs, static_argnames=names or None,
                                 **self._options)
                self._bound[key] = runner
        return runner

    def _exact_jit(self):
        if self._plain_jit is None:
            statics = self.static_args
            self._plain_jit = jax.jit(
                self._user_fun,
                static_argnums=None if statics is None else tuple(sorted(statics.argnums)),
                static_argnames=None if statics is None else tuple(sorted(statics.argnames)),
                compiler_options=self.compiler_options or None)
        return self._plain_jit

    def _checked_exact_jit(self, args, kwargs):
        """``jax.jit`` of ``fun`` after the sizes of ``args`` are checked as a
        call checks them."""
        self.plans.plan(self.positional_arguments(args, kwargs))
        return self._exact_jit()

    def eval_shape(self, *args, **kwargs):
        """The outputs' shapes and dtypes for these arguments (arrays or
        ``jax.ShapeDtypeStruct``s), as ``jax.jit(fun).eval_shape``: exact
        shapes (a call's outputs are unpadded). Raises ``ShapeError`` where
        the sizes do not fit the specs, as a call would."""
        return self._checked_exact_jit(args, kwargs).eval_shape(*args, **kwargs)

    def trace(self, *args, **kwargs):
        """``jax.jit(fun).trace(...)`` for these exact shapes: the program
        plain ``jax.jit`` traces, which is also what a call of this runner
        inside a caller's ``jax.jit`` becomes. The bucket programs a call runs
        are shown by ``polymask.explain`` and compiled ahead by
        ``precompile``. Raises ``ShapeError`` as ``eval_shape``."""
        return self._checked_exact_jit(args, kwargs).trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """``jax.jit(fun).lower(...)`` for these exact shapes (see ``trace``):
        ahead-of-time code that calls ``.lower(x).compile()`` gets plain
        JAX's program for ``x``'s shapes, one per shape. Raises
        ``ShapeError`` as ``eval_shape``."""
        return self._checked_exact_jit(args, kwargs).lower(*args, **kwargs)

    def fallbacks(self) -> dict[str, str]:
        """``{bucket: reason}``: the buckets whose sizes run per exact shape
        (as ``jax.jit``) because their masked trace failed, and why (the
        message names the user's line and the rewrite that gets sharing
        back). Empty when every call shares programs."""
        out = {} if self._fallback is None else self._fallback.fallbacks()
        for key, runner in list(self._bound.items()):
            where = ", ".join(f"{k}={v.value!r}" for k, v in key)
            out.update({f"{bucket} ({where})": why for bucket, why in runner.fallbacks().items()})
        return out

    def _traced_call(self, args):
        """Under ``jax.grad``/``jit``/``vmap`` of the caller (tracer inputs, or
        concrete ones while ``fun`` may close over the caller's tracers: exact
        shapes known at trace time; or an outer ``polymask.jit``'s masked trace,
        symbolic sizes): exact sizes are checked as for any call
        (``ShapeError`` for a spec, constraint or bucket they break), then
        ``fun`` itself is traced into the caller's program, as ``jax.jit``
        nested in a transformation is. The outer transformation already
        specialises on the exact shapes, so padding could not save a compile,
        and the result is plain JAX's, derivatives included. (Running a bucket
        program here would also record its padded input, a host buffer a later
        call rewrites, as a constant of the caller's program.)"""
        if not any(compat.is_dim_expr(d) for x in jax.tree_util.tree_leaves(args)
                   for d in np.shape(x)):
            # (symbolic sizes: called inside a masked trace, an outer polymask.jit's,
            # where a bucket needs the size as an int; the outer call checks its own)
            self.plans.plan(args)
        self.cache.add(traced_calls=1)
        # (numpy_outputs does not apply: a traced output cannot be a NumPy array)
        return self.fun(*args)

    def _outputs(self, info: _CallInfo, entry: Entry, out):
        if info.out_entry is not entry and entry.tree is not None:
            # a shape's first outputs from this program: what its trace warned
            # for these sizes, as jax.jit's trace of this shape would
            say_case_warnings(entry.tree, dict(zip(info.plan.var_names,
                                                   map(int, info.plan.values))))
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
        outs = [d if d.shape == shape and not self.numpy_outputs
                else unpad_output(d, shape, self.numpy_outputs) for d, shape in zip(datas, shapes)]
        return jax.tree_util.tree_unflatten(outputs.tree, outs)

    def _make(self, tree, plan, entry):
        # (a bucket whose every size is a case of its own runs per exact shape:
        # its trace raises PerSizeBucket, a failure the fallback takes)
        # (the plan's specs where some of the user's dim vars are static in it:
        # CallPlans.static_vars)
        if self.plans.static_vars - set(plan.var_names):
            specs, constraints = None, self.plans.constraints_of_static_plans()
        else:
            specs, constraints = self.in_specs, self.constraints
        return build_inner(self.fun, entry, tree, plan, specs, constraints,
                           max_cases=self.max_cases,
                           per_size_per_shape=self._per_size_per_shape)

    def _slow_call(self, info: _CallInfo, leaves):
        """First call of a signature, an evicted program, or a tiered bucket still compiling."""
        tiering = self.tiering
        if tiering is not None and self.cache.has_evicted:
            # more buckets in use than the cache holds: a covering bucket and the
            # own bucket compiled behind it would each evict another (more compiles
            # than calls); calls compile their own buckets only
            tiering = None
        if tiering is not None:  # a new shape, or one waiting for its bucket: compiles wait
            background_executor().note_call()
        entry = self.cache.entry(info.key, hit=False)
        info.entry = entry
        if entry.live:
            return entry, entry.fn(*self._flat(info, leaves))
        if entry.unshared is not None and tiering is None:
            raise _BucketUnshared(entry.unshared)
        plan = info.plan
        ckey = cover_key(info.tree, plan)
        if entry.cover_key is None:
            entry.cover_key, entry.buckets = ckey, dict(plan.buckets)
            entry.padded = plan.padded
        make = functools.partial(self._make, info.tree, plan)
        if tiering is not None:
            cover = tiering.find_cover(plan, ckey, entry)
            if cover is None:
                compiled = tiering.compile_first(info.tree, plan, leaves)
                if compiled:
                    self._count_foreground_compile()
                if compiled is not None:
                    cover = tiering.find_cover(plan, ckey, entry)
            if cover is not None and reaches_untraced_case(cover, plan.var_names, plan.values):
                # the covering bucket could not trace these sizes (np.arange(n) past its
                # per-size limit): their own bucket may, so it compiles now rather than
                # the call running per exact shape (more compiles than jax.jit)
                cover = None
            elif cover is not None:
                # (sizes of an error case run plain, in their own bucket too: it waits
                # for a call of another size rather than compiling for none)
                if entry.unshared is None and not reaches_error_case(
                        cover, plan.var_names, plan.values):
                    tiering.compile_in_background(info.key, entry, make,
                                                  lambda: self._flat(info, leaves), info.covered)
                info.covered = True
                dyn = tuple((i, b2, np.shape(leaves[i]) == b2, od) for (i, _, _, od), b2 in zip(
                    info.dyn, [padded_shape(plan.leaves[i].axes, cover.buckets)
                               for i, *_ in info.dyn]))
                # padding_fraction counts what ran: the covering bucket's padded elements
                extra = (sum(math.prod(b2) for _, b2, _, _ in dyn)
                         - sum(math.prod(plan.leaves[i].padded) for i, *_ in info.dyn))
                with self.cache.lock:
                    self._cover_extra_padded += extra
                self.cache.add(tiered_calls=1)
                cover.tick = next(COMPILE_TICK)
                return cover, cover.fn(*self._flat(info, leaves, dyn))
            if entry.unshared is not None:
                raise _BucketUnshared(entry.unshared)
        out = None
        try:
            out = self.cache.compile_run(entry, make, self._flat(info, leaves),
                                         self._case_reached_first(plan))
        finally:  # a call that compiled its program, or failed to, is no cache hit
            if out is not None or entry.fn is None:
                self._count_foreground_compile()
        return (entry, out) if out is not None else (entry, entry.fn(*self._flat(info, leaves)))

    @staticmethod
    def _case_reached_first(plan: CallPlan):
        """A ``before_compile`` check for the own bucket of a call of ``plan``:
        where the call's sizes reach an error case, its program is not
        compiled for this call (which raises, is planned again or runs plain
        ``jax.jit``: ``_reached_error_case``), but by the next call of a size
        that runs in it."""
        def check(entry: Entry) -> None:
            try:
                raise_case_error(entry, plan.var_names, plan.values)
            except ShapeError as e:
                raise _CaseReached(entry, e) from None
        return check

    def _case_planned_again(self, plan: CallPlan):
        """A ``before_compile`` check for the covering bucket of a call of
        ``plan``: where the call's own case is an error the runner plans
        around (an axis met a fixed size: ``CallPlans.may_adapt_to``), that
        error is raised before XLA compiles the bucket, which the call would
        not use (flax's first ``apply`` compiled twice)."""
        def check(entry: Entry) -> None:
            try:
                raise_case_error(entry, plan.var_names, plan.values)
            except ShapeError as e:
                if self.plans.may_adapt_to(plan, e):
                    raise
        return check

    def _count_foreground_compile(self) -> None:
        """A call compiled (or failed to compile) a program: no cache hit."""
        with self.cache.lock:
            self._fg_compiles_in_calls += 1
        self._this_call.compiles = getattr(self._this_call, "compiles", 0) + 1

    # -- ahead of time -------------------------------------------------------------
    def precompile(self, *args, **kwargs) -> PolyJit:
        """Compile the bucket of ``args`` now (no run): arrays may be ``jax.ShapeDtypeStruct``.

        ``f.precompile(jax.ShapeDtypeStruct((100, 64), jnp.float32))`` compiles
        the bucket that holds 100 rows (pass a bucket's size to pick it). Static
        arguments (``None`` specs) take their real values or structs, and
        ``static_argnums`` / ``static_argnames`` their values; arguments are
        passed as to a call (keywords too). With the persistent compilation
        cache on, a later process loads it from disk. Returns ``self``.

        Raises:
          ShapeError: the shapes do not fit the specs (as a call would).
        """
        args = self.positional_arguments(args, kwargs)
        while True:
            try:
                self._compile_ahead(args, "precompiles")
                return self
            except PerSizeBucket as e:
                plan, _, tree = self.plans.plan(args)
                if self._adapt(plan, e):  # (no in_specs: that axis static, as a call would)
                    continue
                # its calls compile per exact shape: nothing ahead, said now
                self.cache.entry((tree, plan.signature), hit=False).unshared = refusal_text(e)
                self._fallback.refused(bucket_text(plan.buckets), e, self._given_names(plan))
                self._fallback.warn_pending()
                return self
            except Exception as e:
                # an axis met a fixed size (x @ W): planned static, as a call would
                if not (falls_back(e) and self._adapt(self.plans.plan(args)[0], e)):
                    raise

    def _compile_first_ahead(self, args, like: CallPlan) -> bool:
        """``Tiering``'s foreground compile of a covering bucket (no extra
        counter), planned with the dim vars of ``like``, the call's plan:
        without ``in_specs`` the covering sizes' own equalities (all 128)
        would name them otherwise, and the call could not use the bucket."""
        return self._compile_ahead(args, None, like)

    def _compile_ahead(self, args, kind: str | None, like: CallPlan | None = None) -> bool:
        """Compile the bucket of ``args`` (no run); True if compiled now."""
        if like is not None and self.in_specs is None:
            specs = specs_of_plan(jax.tree_util.tree_structure(tuple(args)), like)
            plan, leaves, tree = self.plans.plan(args, specs, ("like", repr(specs)))
        else:
            plan, leaves, tree = self.plans.plan(args)
        key = (tree, plan.signature)
        entry = self.cache.entry(key, hit=False)
        if entry.cover_key is None:
            entry.cover_key, entry.buckets = cover_key(tree, plan), dict(plan.buckets)
            entry.padded = plan.padded
        avals = [x for x, p in zip(leaves, plan.leaves) if p.static]
        avals += [jax.ShapeDtypeStruct(p.padded, canonical_dtype(p.dtype))
                  for p in plan.leaves if not p.static]
        avals.append(jax.ShapeDtypeStruct((len(plan.values),), np.int32))
        return self.cache.precompile_entry(entry, functools.partial(self._make, tree, plan),
                                           avals, kind, None if like is None
                                           else self._case_planned_again(like))


def jit(fun: Callable | None = None, in_specs=None, *, buckets=None, constraints: Sequence[str] = (),
        cache_size: int = 64, numpy_outputs: bool = False, tiered: bool | None = None,
        compiler_options: dict | None = None, max_cases: int | None = None,
        fallback: bool = True, static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Sequence[str] | None = None, keep_unused: bool = False,
        inline: bool = False, in_shardings=None, out_shardings=None, device=None,
        backend: str | None = None) -> PolyJit:
    """Compile ``fun`` once per bucket: exact (unpadded) arrays in, exact arrays out.

    Args:
      fun: a function written for exact arrays (pytrees allowed). Left out
        (``@polymask.jit(in_specs="n")``, ``@polymask.jit()``), ``jit``
        returns a decorator taking the other arguments, as ``jax.jit`` does.
      in_specs: None: every axis of every array argument is dynamic, and axes
        of equal size in a call share one dim var (``x + y`` of two length-5
        vectors, a square matrix: traced as plain JAX sees them; a call whose
        sizes are equal in another pattern gets its own programs). An axis
        that meets a fixed size (``x @ W`` or ``x + b`` with ``W``, ``b``
        closed over) cannot be dynamic: the call whose trace finds it plans
        that axis static (as ``"_"``) and traces again, and so do later calls
        (at that size only where the call's sizes merely coincided). An axis
        that must be another's plus a constant (``v`` of ``r + v[1:]``) is
        planned so (``s0 + 1``) in calls whose sizes keep the relation
        (docs/runners.md). Otherwise one entry per positional argument: a
        ``jax.export.symbolic_shape`` spec string (``"n, 64"``; same name =
        equal sizes; ``"_"``/constants = static), a pytree of specs, or None
        (that argument is static: its exact shape is part of the cache key,
        e.g. model parameters). A string alone is the spec of the one
        argument; a dict is keyed by parameter name or position, as
        ``mask``'s (the specs of one pytree argument go in a tuple of one:
        ``({"a": "n", "b": "m"},)``).
      buckets: bucketing policy for every dynamic dim var (default
        ``polymask.buckets.pow2()``: 8, 16, 32, ... with ``headroom=16``), or
        a dict ``{dim var: policy}`` (key ``None`` = the default). See
        ``polymask.buckets``.
      constraints: ``jax.export`` constraints (``"n >= 3"``), checked on the host.
      cache_size: most compiled programs kept (least recently used dropped).
      numpy_outputs: return NumPy arrays instead of ``jax.Array``.
      tiered: serve a size whose bucket is not compiled yet from the smallest
        compiled bucket that holds it (a covering bucket), while its own
        bucket compiles in a background thread (later calls switch to it;
        ``f.wait()`` waits for those compiles). When no compiled bucket holds
        a size, the call compiles a covering bucket in the foreground instead
        of its own, so a first pass over many sizes costs about one
        foreground compile: per dim var, its policy's largest bucket
        (``pow2(16, maximum=512)``, ``explicit``), else its headroom bucket
        (``Policy.headroom``, 16 for ``pow2``/``multiple``: with the default
        ``pow2()`` a first size of 5, bucket 8, compiles bucket 128), capped
        by the dim var's upper bound when ``constraints`` give one and
        shrunk until the padded dynamic inputs take at most 64 KiB on CPU
        (16 MiB on an accelerator) or no more than the own bucket's
        (``runners/tiering.py``); ``exact()``, plain callables and
        ``headroom=1`` compile the own bucket. Background compiles yield to
        calls: one starts once no call has waited for a compile for 50 ms, at
        the latest 1 s after it was requested, at once under ``f.wait()``,
        and at once when a shape that waits for it is called again.
        Default: on, unless the environment variable ``POLYMASK_TIERED=0``
        (the test suite sets it, so compile counts are deterministic there)
        or ``cache_size`` is below 4 (a covering bucket and the buckets it
        serves would evict each other: twice the compiles, measured with
        ``cache_size=1``). Once the cache has evicted a program (more
        buckets in use than it holds), calls compile their own buckets only:
        42 argument signatures at 3 sizes in ``cache_size=64`` took 234
        compiles for 126 calls with covering buckets, 122 without.
      compiler_options: XLA options for every bucket program, as for
        ``jax.jit(compiler_options=...)`` (XLA's ``DebugOptions`` names; an
        unknown name raises at the first compile). Traced calls (under
        ``jax.jit``/``grad``) compile in the caller's program.
      max_cases: as for ``polymask.mask``: the most split cases per bucket
        signature; code that needs a size as a Python int is traced once per
        size up to a bucket of ``2 * max_cases`` (None: 16, so 32). By default a
        bucket of more than 4 such sizes runs per exact shape (one program
        would hold a copy of the function per size, compiled at its first
        call, and gain little per call); a ``max_cases`` given asks for that one
        program (and ``fallback=False`` keeps it).
      fallback: where a bucket's masked trace fails (a size needed as a Python
        value past that limit, a primitive without a masking rule, sizes JAX
        cannot prove equal), run its sizes per exact shape under plain
        ``jax.jit`` (one compile per distinct shape, what ``jax.jit`` does):
        warned once (``polymask.FallbackWarning``, with the reason and the
        rewrite that gets sharing back), counted (``stats()["exact_compiles"]``,
        ``["exact_calls"]``) and listed by ``.fallbacks()``. Where plain
        ``jax.jit`` fails on the exact arrays too, the call raises
        ``ShapeError`` with its reason. ``False``: raise the masked trace's
        error instead (a function that must share programs).

      static_argnums: as ``jax.jit``'s: positions of arguments that are
        Python values (a mode string, ``k`` of ``top_k``, a flag), passed to
        ``fun`` as they are.
      static_argnames: as ``jax.jit``'s: the same by parameter name. Either
        of the two derives the other from ``fun``'s signature, so a static
        parameter may be passed either way (also where both are given;
        ``jax.jit`` then derives neither). Their values must be hashable;
        each distinct value (of a distinct type: ``1`` and ``True`` differ)
        gets its own programs, bucketed as any call. Their ``in_specs``
        entries are None (or left out). Keyword-only static parameters share
        programs too. Raises ``ValueError`` for a position or name ``fun``
        does not take and for an unhashable value, as ``jax.jit`` does.

      donate_argnums: accepted as ``jax.jit`` accepts it, with no effect on
        the values: inputs are copied into padded buffers, so nothing is
        donated (a donated array stays valid, where ``jax.jit`` would
        delete it). A position ``fun`` does not take, or one also static,
        raises ``ValueError`` here, as ``jax.jit`` raises it.
      donate_argnames: the same, by name.
      keep_unused: accepted, no effect (unused inputs are padded as any).
      inline: accepted, no effect (a call inside a caller's ``jax.jit`` is
        always traced inline).
      in_shardings: not supported: raises ``NotImplementedError`` saying what
        to use instead. ``polymask.jit`` runs its bucket programs on the
        default device (``with jax.default_device(d):`` picks it, as for
        ``jax.jit`` of NumPy inputs); an input committed to another device,
        or sharded, is gathered there, and outputs are uncommitted arrays on
        it (docs/limitations.md). Shard with ``jax.jit(polymask.mask(f),
        in_shardings=...)`` on padded inputs (docs/distributed.md).
      out_shardings: the same.
      device: the same (use ``jax.default_device``).
      backend: the same.

    Returns:
      A ``PolyJit`` callable; ``.stats()`` gives calls, compiles, cache hits,
      evictions, compile time, XLA compiles (counted with ``jax.monitoring``),
      tiered calls and the padding fraction of the inputs; ``.precompile(...)``
      compiles a bucket ahead of time; ``.wait()`` waits for background compiles.

    Raises ``TypeError`` where ``fun`` is not callable (a spec passed first:
    ``polymask.jit("n")``) and, as ``jax.jit``, ``ValueError`` for static
    arguments ``fun`` does not take.

    Inputs are padded on the host with NumPy (an input already at its bucket
    is passed through), logical sizes are runtime arguments (a new size in a
    known bucket never recompiles), and outputs are sliced to their logical
    shapes. Raises ``ShapeError`` for inconsistent sizes (before running)
    and where the function fails at these sizes as plain JAX does.

    Keyword arguments take their parameter's position in ``fun``'s signature
    (``f(x, mask=m)`` is ``f(x, m)``; ``in_specs`` applies by position), and
    parameters with an in_specs entry left out take their defaults.
    A keyword argument with no position in ``in_specs`` (keyword-only
    parameters, ``**kwargs``) runs the call per exact shape under ``jax.jit``
    (the fallback, warned; bind it with ``functools.partial`` to share).

    Under ``jax.grad``, ``jax.jit`` or ``jax.vmap`` (traced inputs) the sizes
    are checked the same way and ``fun`` is traced into the caller's program
    (the outer transformation specialises on exact shapes anyway): values and
    derivatives are plain JAX's.
    """
    placement = {"in_shardings": in_shardings, "out_shardings": out_shardings,
                 "device": device, "backend": backend}
    asked = [name for name, value in placement.items() if value is not None]
    if asked:
        raise NotImplementedError(
            f"polymask.jit(..., {asked[0]}=...): polymask.jit runs its bucket programs on "
            "the default device (pick it with `with jax.default_device(d):`) and does not "
            "shard them. For a sharded program use "
            "jax.jit(polymask.mask(f, in_specs), in_shardings=..., out_shardings=...) on "
            "padded inputs (docs/distributed.md); a call inside your own jax.jit is traced "
            "into it, so jax.jit(lambda x: runner(x), in_shardings=...) runs per exact shape.")
    if fun is None:  # a decorator factory: @polymask.jit(in_specs=..., ...)
        return functools.partial(
            jit, in_specs=in_specs, buckets=buckets, constraints=constraints,
            cache_size=cache_size, numpy_outputs=numpy_outputs, tiered=tiered,
            compiler_options=compiler_options, max_cases=max_cases, fallback=fallback,
            static_argnums=static_argnums, static_argnames=static_argnames,
            donate_argnums=donate_argnums, donate_argnames=donate_argnames,
            keep_unused=keep_unused, inline=inline)
    check_function_first(fun, "polymask.jit")
    if donate_argnums is not None or donate_argnames is not None:
        # jax.jit's own checks of the argument numbers and names (raised here, as
        # jax.jit raises them when it decorates)
        jax.jit(fun, static_argnums=static_argnums, static_argnames=static_argnames,
                donate_argnums=donate_argnums, donate_argnames=donate_argnames)
    return PolyJit(fun, in_specs, buckets=buckets, constraints=constraints,
                   cache_size=cache_size, numpy_outputs=numpy_outputs, tiered=tiered,
                   compiler_options=compiler_options, max_cases=max_cases, fallback=fallback,
                   static_argnums=static_argnums, static_argnames=static_argnames)
