"""The hooks a masked trace installs in JAX's symbolic shapes (private JAX API).

While a masked trace is in progress, a size comparison that JAX cannot decide
(``_shape_poly._geq_decision`` inconclusive, or ``DimExpr.__eq__`` answering
False without a proof) raises ``SplitNeeded`` so that ``tracing/cases/splitting.py`` can trace
each outcome under a constraint. Part of ``_jax_compat``;
``tests/test_jax_compat.py`` covers it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import linecache
import os
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src.export import shape_poly as _shape_poly
from jax._src.export import shape_poly_decision as _decision
from jax._src.interpreters import partial_eval as _pe

from .core import (
    _POLYMASK_DIR,
    DIVIDED_SIZE,
    DimExpr,
    InconclusiveDimensionOperation,
    costly_to_decide,
    count_is_nonempty,
    dim_vars,
    exact_values_over,
    is_dim_expr,
    is_fresh_dim_name,
    values_over,
)
from .indexing import (
    INDEXING,
    NDINDEXER,
    SCATTER,
    dynamic_slice_of_whole_symbolic_axes,
    sizes_as_indices,
    sizes_as_update_indices,
    static_slice_of_static_axes,
)
from .versions import _hi_primitive_staging_home, inline_hi_primitive_staging

__all__ = ["SplitNeeded", "SplitBeforeRaise", "trace_hooks", "hooks_installed",
           "sizes_compared_as_user", "split_here", "set_entry_reads"]

# The hooks are installed while at least one masked trace runs (in any thread)
# and removed when the last one ends; a hook only acts for the thread whose
# trace is in progress (its frame on ``_HOOK_TLS.stack``).
_HOOK_LOCK = threading.Lock()
_HOOK_USERS = 0
_HOOK_ORIG: tuple = ()
_HOOK_TLS = threading.local()
_PROCESS_PRIMITIVE: Any = None  # JAX's own staging rule, while the hooks are installed
_DYNAMIC_SLICE_ORIG: Any = None  # JAX's NDIndexer.to_dynamic_slice, while they are
_SCATTER_UPDATE_ORIG: Any = None  # JAX's scatter._scatter_update, while they are


class SplitNeeded(InconclusiveDimensionOperation):
    """A size comparison JAX cannot decide in the trace in progress.

    ``cond`` is a dimension expression: the trace must be repeated once with
    ``cond >= 0`` and once with ``cond <= -1`` added to the scope. It derives
    from JAX's ``InconclusiveDimensionOperation`` so that JAX code that falls
    back on an inconclusive comparison (``max``/``min``, ``divmod``) still does.
    ``only_yes``: a split that lets JAX prove two shapes of a data-dependent
    size equal (``cond >= 0``): the other outcome is refused, not traced.
    ``where``: the user's line, where the exception's traceback has none.
    """

    def __init__(self, message: str, cond, only_yes: bool = False, where: str | None = None):
        super().__init__(message)
        self.cond = cond
        self.only_yes = only_yes
        self.polymask_where = where


class SplitBeforeRaise(Exception):
    """A ``SplitNeeded`` that JAX's ``core.definitely_equal`` does not swallow:
    raised where its ``False`` would skip a check that raises in plain JAX."""

    def __init__(self, message: str, cond):
        super().__init__(message)
        self.cond = cond


@dataclasses.dataclass
class _HookFrame:
    split_vars: dict  # internal dim var -> (lowest, highest) value
    scope: Any  # the trace's SymbolicScope (None: any)
    is_user_frame: Any
    busy: bool = False
    everywhere: dict = dataclasses.field(default_factory=dict)
    # data-dependent dim var -> the user's line of a size comparison whose
    # outcome holds only because JAX assumes it >= 1 (``_note_nonempty``)
    assumed_nonempty: dict = dataclasses.field(default_factory=dict)
    user_files: dict = dataclasses.field(default_factory=dict)  # file name -> is the user's
    # the dim vars of each size read as a value (``dim_as_value``), latest last
    sizes_as_values: list = dataclasses.field(default_factory=list)
    # ``max(0, e)`` kept where e has a data-dependent size -> e (``_kept_where_a_count_may_be_0``)
    kept_clamps: dict = dataclasses.field(default_factory=dict)


def _params_mention_sizes(params: dict) -> bool:
    """Whether a primitive's params hold a symbolic size (``iota``'s shape,
    ``broadcast_in_dim``'s, ``dim_as_value``'s ``dim``)."""
    for v in params.values():
        if is_dim_expr(v) or (isinstance(v, (tuple, list))
                              and any(is_dim_expr(d) for d in v)):
            return True
    return False


def _stage_symbolic_constants(orig):
    """``DynamicJaxprTrace.process_primitive`` during a masked trace.

    ``jax.ensure_compile_time_eval`` (numpyro's distribution checks,
    ``MultivariateNormal``'s validation) evaluates operations without tracer
    operands eagerly. With symbolic sizes some of those build arrays of a
    symbolic shape or read a size as a value (``jnp.eye(x.shape[0])``,
    ``jnp.asarray(x.shape[0])``), which cannot be evaluated ("shape
    polymorphism outside jax.export"), where plain ``jax.jit`` sees Python
    ints. Those operations are staged instead (eager folding off for that one
    primitive), as they are outside the block; everything else still folds.
    """
    def process_primitive(self, primitive, tracers, params, /):
        if primitive is _shape_poly.dim_as_value_p:
            _check_fits_int(params["dim"])
            stack = getattr(_HOOK_TLS, "stack", None)
            if stack:
                stack[-1].sizes_as_values.append(dim_vars(params["dim"]))
        if (_config.eager_constant_folding.value and getattr(_HOOK_TLS, "stack", None)
                and _params_mention_sizes(params)):
            with _config.eager_constant_folding(False):
                return orig(self, primitive, tracers, params)
        return orig(self, primitive, tracers, params)

    return process_primitive


# ``fn(primitive_name)`` -> None or ``reads(avals, params)`` -> ``[(size, rows), ...]``:
# the axes whose entries a primitive reads at run-time positions, with the dims
# of its index rows. Filled by the rule registry (``tracing/registry.py``,
# ``register_entry_reads``), as the primitives' own rules know their operands.
_ENTRY_READS: Any = None


def set_entry_reads(fn) -> None:
    """Install the registry's lookup of the axes a primitive reads entries of
    (``_split_before_reads_of_counts``)."""
    global _ENTRY_READS
    _ENTRY_READS = fn


def _split_before_reads_of_counts(orig):
    """``DynamicJaxprTrace.process_primitive`` that splits on a count's
    emptiness before a primitive reads entries from an axis of that size (a
    gather: the registry says which, ``set_entry_reads``).

    A gather of index rows from an empty axis is plain JAX's own path there
    (``jnp.take`` raises, ``jnp.nanmedian`` of no entries is NaN through
    jnp's code for an empty operand); the one program traced with the count
    >= 1 cannot follow it (the gather rule raises at run time). Traced with
    the count the constant 0 (``ops._fresh``), the case of 0 is plain JAX's."""

    def process_primitive(self, primitive, tracers, params, /):
        reads = _ENTRY_READS and getattr(_HOOK_TLS, "stack", None) and _ENTRY_READS(primitive.name)
        if reads:
            for size, rows in reads([t.aval for t in tracers], params):
                _split_on_a_read_count(size, rows)
        return orig(self, primitive, tracers, params)

    return process_primitive


def _split_on_a_read_count(size, rows) -> None:
    """Split on the emptiness of each count in ``size`` (an axis read at
    run-time positions by index rows of dims ``rows``), unless the count is
    known non-empty or there are no rows where it is 0."""
    stack = getattr(_HOOK_TLS, "stack", None)
    if not stack or stack[-1].busy or not is_dim_expr(size):
        return
    frame = stack[-1]
    for v in sorted(u for u in dim_vars(size) if is_fresh_dim_name(u)):
        if count_is_nonempty(size.scope, v) or _empty_at_zero_count(rows, v):
            continue
        count = _shape_poly.symbolic_shape(v, scope=size.scope)[0]
        if _active_frame(count - 1, counts=True) is None:
            continue
        split = SplitBeforeRaise(
            f"Symbolic dimension comparison '{count}' >= '1' is inconclusive.", count - 1)
        split.polymask_where = _user_line(frame)
        raise split


def _empty_at_zero_count(dims, v: str) -> bool:
    """Whether a product of ``dims`` is 0 where the count ``v`` is 0 (no index
    rows: a gather of nothing, plain JAX's value at 0 too)."""
    return any(_empty_at_zero(d, (v,)) if is_dim_expr(d) else int(d) == 0 for d in dims)


def _check_fits_int(dim) -> None:
    """A size used as a number (``dim_as_value``) is JAX's int dtype at run
    time; on the exact arrays it is a Python int, which JAX converts with
    ``OverflowError`` when it does not fit (``x * (x.shape[0] ** 2 * 10**6)``
    at n = 1000), where the program would wrap around. Where the bounds allow
    both: an expression of one dim var that fits up to some size and not past
    it splits the trace there (``n <= 46``: a comparison that cannot wrap
    around itself), and the case past it raises as plain JAX; any other is
    needed as a Python int: traced size by size (``tracing/cases/refine.py``),
    each trace plain JAX's own."""
    frame = _active_frame(dim)
    if frame is None:
        return
    info = np.iinfo(_dtypes.canonicalize_dtype(np.int64))
    values = _values_while_busy(dim, frame)
    if values is not None and info.min <= min(values) and max(values) <= info.max:
        return  # (JAX's bounds of nested floordivs took seconds per size: jax-cfd's FFTs)
    lo, hi = _decision.bounds_decision(dim, _shape_poly.BoundsPrecision.BEST)
    if info.min <= lo and hi <= info.max:
        return
    if lo > info.max or hi < info.min:
        raise _overflow(dim, info)
    frame.busy = True
    try:
        fits = _fits_up_to(dim, info)
    finally:
        frame.busy = False
    if fits is None:
        raise InconclusiveDimensionOperation(
            f"the size expression '{dim}' is used as a number that fits {info.dtype} at some "
            "sizes within the bounds and not at others (plain JAX raises OverflowError "
            "there), in a context that requires a constant")
    var, last, everywhere = fits
    if everywhere is True:
        return
    if everywhere is False:
        raise _overflow(dim, info)
    raise SplitNeeded(f"Symbolic dimension comparison '{var}' <= {last} is inconclusive.",
                      last - var)


def _overflow(dim, info) -> OverflowError:
    return OverflowError(f"Python int {dim} too large to convert to {info.dtype} (the size "
                         "expression, as a number at these sizes)")


_FIT_SCAN_LIMIT = 4096


def _fits_up_to(dim, info):
    """For ``dim`` of one dim var ``v`` whose values fit ``info``'s range
    exactly for ``v`` up to some value (within its current bounds, every value
    evaluated): ``(v, the last value that fits, True / False where all / none
    fit, else None)``; None for any other ``dim``."""
    names = dim_vars(dim)
    if len(names) != 1:
        return None
    (name,) = names
    (var,) = _shape_poly.symbolic_shape(name, scope=dim.scope)
    lo_v, hi_v = _decision.bounds_decision(var, _shape_poly.BoundsPrecision.BEST)
    if hi_v - lo_v > _FIT_SCAN_LIMIT:
        return None
    # (floats: JAX's coefficients are NumPy ints of the int dtype, whose
    # products would wrap around here too; exact up to 2**53)
    fits = [info.min <= float(dim._evaluate({name: float(k)})) <= info.max
            for k in range(int(lo_v), int(hi_v) + 1)]
    count = sum(fits)
    if fits != [True] * count + [False] * (len(fits) - count):
        return None
    everywhere = True if count == len(fits) else False if count == 0 else None
    return var, int(lo_v) + count - 1, everywhere


@contextlib.contextmanager
def trace_hooks(is_user_frame, split_vars: dict | None = None,
                scope=None) -> Iterator[_HookFrame]:
    """The JAX hooks a masked trace needs, installed for its duration only.

    Size comparisons in ``split_vars`` (``{name: (lowest, highest)}``) that
    JAX cannot decide raise ``SplitNeeded`` (instead of JAX's inconclusive
    error, or, for ``==``, instead of JAX's unsound ``False``), so the tracer
    can trace each outcome under a constraint (see ``_split_geq`` and
    ``_split_eq``). ``is_user_frame(filename)`` tells a comparison made in
    user code from one made inside JAX. Only sizes of ``scope`` (when given)
    split: JAX compares sizes of earlier traces too (its caches' keys).

    Yields the trace's record: ``.assumed_nonempty`` maps each data-dependent
    dim var (``fresh_dim``) to the user's line of a comparison decided only
    by JAX's assumption that it is >= 1 (the program must not run at 0).

    The hooks are removed when the last trace in progress (in any thread) ends.
    """
    global _HOOK_USERS, _HOOK_ORIG
    with _HOOK_LOCK:
        if _HOOK_USERS == 0:
            _HOOK_ORIG = (DimExpr.__eq__, DimExpr.__ne__, _shape_poly._geq_decision,
                          NDINDEXER.to_static_slice,
                          _hi_primitive_staging_home()[0].get(_hi_primitive_staging_home()[1]),
                          DimExpr.__hash__, *(getattr(DimExpr, n) for n in _DIVISIONS),
                          INDEXING.rewriting_take,
                          DimExpr.__pow__, DimExpr.max, DimExpr.rmax, DimExpr.min,
                          DimExpr.rmin)
            eq = _split_eq(_HOOK_ORIG[0])
            DimExpr.__eq__ = eq
            DimExpr.__ne__ = lambda a, b: not eq(a, b)
            # Python's default truth of an object is True: `if x.shape[0]:` took the
            # true branch at n = 0. Truth is `!= 0`, decided or split like __eq__
            DimExpr.__bool__ = lambda a: not eq(a, 0, truth=True)
            _shape_poly._geq_decision = _split_geq(_HOOK_ORIG[2])
            NDINDEXER.to_static_slice = _in_masked_trace(
                static_slice_of_static_axes(_HOOK_ORIG[3]), _HOOK_ORIG[3])
            global _DYNAMIC_SLICE_ORIG, _SCATTER_UPDATE_ORIG
            _DYNAMIC_SLICE_ORIG = NDINDEXER.to_dynamic_slice
            NDINDEXER.to_dynamic_slice = _in_masked_trace(
                dynamic_slice_of_whole_symbolic_axes(_DYNAMIC_SLICE_ORIG), _DYNAMIC_SLICE_ORIG)
            _SCATTER_UPDATE_ORIG = SCATTER._scatter_update
            SCATTER._scatter_update = _in_masked_trace_call(
                sizes_as_update_indices(_SCATTER_UPDATE_ORIG), _SCATTER_UPDATE_ORIG)
            DimExpr.__hash__ = _hashed_in_user_code(_HOOK_ORIG[5])
            for name, orig in zip(_DIVISIONS, _HOOK_ORIG[6:]):
                setattr(DimExpr, name, _python_division(orig, reflected=name.startswith("__r")))
            DimExpr.__pow__ = _python_power(_HOOK_ORIG[-5])
            INDEXING.rewriting_take = _in_masked_trace_call(
                sizes_as_indices(_HOOK_ORIG[-6]), _HOOK_ORIG[-6])
            for i, (name, factor) in enumerate((("max", _shape_poly._DimFactor.MAX),
                                                 ("rmax", _shape_poly._DimFactor.MAX),
                                                 ("min", _shape_poly._DimFactor.MIN),
                                                 ("rmin", _shape_poly._DimFactor.MIN))):
                setattr(DimExpr, name, _kept_where_a_count_may_be_0(
                    _HOOK_ORIG[i - 4], factor, reflected=name.startswith("r")))
            # Python's float(n), math.sqrt(n) of a size: its value, as __int__ gives
            # it (JAX's class has none: a bare TypeError, "must be real number")
            DimExpr.__float__ = lambda a: float(a.__int__())
            for name in _NUMPY_MATH:  # np.sqrt(n): NumPy's object loop calls n.sqrt()
                setattr(DimExpr, name, _numpy_math_of_value(getattr(np, name)))
            rules, hi_p = _hi_primitive_staging_home()
            rules[hi_p] = _in_masked_trace_call(
                functools.partial(inline_hi_primitive_staging, orig=rules.get(hi_p)),
                rules.get(hi_p))
            global _PROCESS_PRIMITIVE
            _PROCESS_PRIMITIVE = _pe.DynamicJaxprTrace.process_primitive
            _pe.DynamicJaxprTrace.process_primitive = _split_before_reads_of_counts(
                _stage_symbolic_constants(_PROCESS_PRIMITIVE))
        _HOOK_USERS += 1
    stack = _HOOK_TLS.__dict__.setdefault("stack", [])
    frame = _HookFrame(dict(split_vars or {}), scope, is_user_frame)
    stack.append(frame)
    try:
        yield frame
    except _core.ConcretizationTypeError as e:
        # A traced value used as a Python bool or int (initializers' ``if fan_in
        # != 0`` of a size read as a value): the size read last is the likely
        # source; a runner planning its own specs tries it static
        # (``ShapeError.fixed_size_vars``; if it is not, the next try names another).
        if frame.sizes_as_values and not getattr(e, "fixed_size_vars", ()):
            e.fixed_size_vars = tuple(sorted(frame.sizes_as_values[-1]))
        raise
    finally:
        stack.pop()
        with _HOOK_LOCK:
            _HOOK_USERS -= 1
            if _HOOK_USERS == 0:
                (DimExpr.__eq__, DimExpr.__ne__, _shape_poly._geq_decision,
                 NDINDEXER.to_static_slice, hi_staging) = _HOOK_ORIG[:5]
                NDINDEXER.to_dynamic_slice = _DYNAMIC_SLICE_ORIG
                SCATTER._scatter_update = _SCATTER_UPDATE_ORIG
                del DimExpr.__bool__, DimExpr.__float__  # JAX's class has none
                for name in _NUMPY_MATH:
                    delattr(DimExpr, name)
                DimExpr.__hash__ = _HOOK_ORIG[5]
                for name, orig in zip(_DIVISIONS, _HOOK_ORIG[6:]):
                    setattr(DimExpr, name, orig)
                (INDEXING.rewriting_take, DimExpr.__pow__, DimExpr.max, DimExpr.rmax,
                 DimExpr.min, DimExpr.rmin) = _HOOK_ORIG[-6:]
                rules, hi_p = _hi_primitive_staging_home()
                rules[hi_p] = hi_staging
                _pe.DynamicJaxprTrace.process_primitive = _PROCESS_PRIMITIVE


def _in_masked_trace(patched, orig):
    """``patched`` while this thread runs a masked trace, else ``orig`` (the
    class attribute is shared by every thread)."""

    def method(self, **kwargs):
        if getattr(_HOOK_TLS, "stack", None):
            return patched(self, **kwargs)
        return orig(self, **kwargs)

    return method


def _in_masked_trace_call(patched, orig):
    """``patched(*args, **kwargs)`` while this thread runs a masked trace, else ``orig``."""

    def call(*args, **kwargs):
        if getattr(_HOOK_TLS, "stack", None):
            return patched(*args, **kwargs)
        return orig(*args, **kwargs)

    return call


def hooks_installed() -> bool:
    """True while a masked trace is in progress (tests check the hooks are removed)."""
    return _HOOK_USERS > 0


@contextlib.contextmanager
def sizes_compared_as_user() -> Iterator[None]:
    """Size comparisons inside split the masked trace as the user's own do.

    For JAX functions that turn a shape comparison into a *value*
    (``jnp.array_equal``: ``if a1.shape != a2.shape: return False``), where
    JAX's structural False for two different dim vars would be a wrong
    result whenever the sizes are equal at run time."""
    old = getattr(_HOOK_TLS, "as_user", False)
    _HOOK_TLS.as_user = True
    try:
        yield
    finally:
        _HOOK_TLS.as_user = old


def split_here(cond, message: str) -> None:
    """Raise ``SplitNeeded(message, cond)`` where the masked trace in
    progress can split on ``cond >= 0`` (its dim vars are the trace's spec
    dim vars); return where it cannot."""
    if _active_frame(cond) is not None:
        raise SplitNeeded(message, cond)


def _active_frame(expr, counts: bool = False) -> _HookFrame | None:
    """The hook frame of this thread's trace when ``expr`` is a splittable size.

    ``counts``: data-dependent sizes (``_u1``) may be in ``expr`` too. A
    comparison of a count splits the trace like one of the spec's sizes, but
    the count is known only while the program runs: ``cases/splitting.py``
    keeps one outcome, where the other fails in plain JAX, with a run-time
    check (``lax.top_k(s, 2)``'s ``k <= s.shape[0]``)."""
    stack = getattr(_HOOK_TLS, "stack", None)
    if not stack or not is_dim_expr(expr):
        return None
    frame = stack[-1]
    names = {v for v in dim_vars(expr) if not (counts and is_fresh_dim_name(v))}
    if frame.busy or not names <= set(frame.split_vars):
        return None
    if frame.scope is not None and expr.scope is not frame.scope:
        return None  # a size of another trace (a JAX cache key compared on lookup)
    return frame


def _split_geq(orig_geq):
    """``_geq_decision`` that raises ``SplitNeeded(e1 - e2)`` when inconclusive."""

    def geq(e1, e2, cmp_str):
        if is_dim_expr(e1) != is_dim_expr(e2) and _is_float(e2 if is_dim_expr(e1) else e1):
            return _geq_of_a_float(geq, e1, e2, cmp_str)
        decided = _divided_geq_by_values(e1, e2)
        if decided is UNDECIDED:  # (exact values: JAX's procedure cannot decide it)
            raise SplitNeeded(f"Symbolic dimension comparison {cmp_str()} is inconclusive.",
                              e1 - e2)
        if decided is not None:
            return decided
        try:
            res = orig_geq(e1, e2, cmp_str)
        except InconclusiveDimensionOperation as e:
            message = str(e).split("\n")[0]
            # A size may be 0 under mask (jax.export assumes >= 1): the bounds of
            # `a // n` are unknown until the trace splits on n >= 1.
            divisor = _possible_zero_divisor(message)
            diff = e1 - e2 if divisor is None else divisor - 1
            frame = _active_frame(diff, counts=True)
            if frame is None:
                raise
            if divisor is None:
                frame.busy = True  # (its cache looks the size up by hash: no split there)
                try:
                    decided = _decided_by_values(diff, frame)
                finally:
                    frame.busy = False
                if decided is not None:
                    return decided
            raise SplitNeeded(message, diff) from None
        if _has_fresh(e1, e2) and (_branch_differs_at_zero() or _count_pinned(e1, e2)):
            _note_nonempty(e1, e2, lambda d: _geq_zero(orig_geq, d), res)
        return res

    return geq


def _divided_geq_by_values(e1, e2):
    """``e1 >= e2`` for sizes JAX's procedure takes long on (a division, many
    ``min`` / ``max``s), where the values of their dim vars in this case
    decide it (before JAX's bounds, which take seconds for nested
    ``floordiv``s); ``UNDECIDED`` where those values are exact (every
    condition of the case applied) and decide neither side: JAX's procedure,
    sound and weaker, cannot either (it took 127 s to say so for the
    ``arange`` of a ``mod`` of a ``min`` of a product, under a case's
    conditions); else None."""
    if not (is_dim_expr(e1) or is_dim_expr(e2)) or not costly_to_decide(
            f"{e1} {e2}", (e1 if is_dim_expr(e1) else e2).scope):
        return None
    try:
        diff = e1 - e2
    except Exception:
        return None
    frame = _active_frame(diff)
    if frame is None or _has_fresh(diff):
        return None
    values = _values_while_busy(diff, frame)
    if values is None:
        return None
    if min(values) >= 0:
        return True
    if max(values) < 0:
        return False
    return UNDECIDED if _values_are_exact(diff, frame) else None


def _values_are_exact(dim, frame: _HookFrame) -> bool:
    """Whether ``_values_everywhere(dim)`` are exactly its values in this case."""
    busy, frame.busy = frame.busy, True
    try:
        return exact_values_over(dim, frame.split_vars, frame.scope) is not None
    finally:
        frame.busy = busy


def _is_float(v) -> bool:
    return isinstance(v, (float, np.floating))


def _geq_of_a_float(geq, e1, e2, cmp_str) -> bool:
    """``e1 >= e2`` where one side is a size and the other a float: as Python
    compares the int size with the float (``n > 2.5`` is ``n >= 3``), a
    comparison of integers that decides or splits like any other (JAX's own
    turns the size into an array: a traced bool no Python ``if`` can take).

    Every comparison with NaN is False; JAX's ``>`` and ``<`` are ``not`` of
    this decision (its ``cmp_str`` says which operator the user wrote)."""
    f = float(e2 if is_dim_expr(e1) else e1)
    if np.isnan(f):
        return re.search(r"' [<>] '", cmp_str()) is not None
    if np.isinf(f):
        return (f < 0) if is_dim_expr(e1) else (f > 0)
    if is_dim_expr(e1):  # n >= f  <=>  n >= ceil(f)
        return geq(e1, int(np.ceil(f)), cmp_str)
    return geq(int(np.floor(f)), e2, cmp_str)  # f >= n  <=>  floor(f) >= n


def _in_user_code(caller, frame: _HookFrame) -> bool:
    """Whether Python frame ``caller`` runs the user's code. Code compiled
    from a string (``python -c``, ``exec(src)``) has the file name
    ``<string>``, as have the ``__eq__`` / ``__hash__`` / ``__init__`` that
    dataclasses and namedtuples generate (a structural comparison, not a
    branch of the user's): only the latter are not the user's."""
    code = caller.f_code
    if code.co_filename == "<string>":
        return not code.co_name.startswith("__")
    return frame.is_user_frame(code.co_filename)


def _count_pinned(*exprs) -> bool:
    """A data-dependent size in ``exprs`` that JAX takes to be the constant 1
    (a bound of 1, with its assumption >= 1): every decision on it, JAX's own
    broadcasting included (``arange(count) * sel`` as ``(1,)``), holds at 1
    only, so one that differs at 0 must not run at a count of 0."""
    for e in exprs:
        if is_dim_expr(e):
            for v in dim_vars(e):
                if is_fresh_dim_name(v) and _decision.bounds_decision(
                        _shape_poly.symbolic_shape(v, scope=e.scope)[0],
                        _shape_poly.BoundsPrecision.BEST)[1] <= 1:
                    return True
    return False


def _has_fresh(*exprs) -> bool:
    return any(is_fresh_dim_name(v) for e in exprs if is_dim_expr(e) for v in dim_vars(e))


def _geq_zero(orig_geq, d) -> bool | None:
    """``d >= 0`` as JAX decides it, None where it cannot."""
    if not is_dim_expr(d):
        return int(d) >= 0
    try:
        return orig_geq(d, 0, ">=")
    except InconclusiveDimensionOperation:
        return None


def _eq_zero(d) -> bool | None:
    """``d == 0`` decided by the bounds, None where they do not decide it."""
    if not is_dim_expr(d):
        return int(d) == 0
    lo, hi = _decision.bounds_decision(d, _shape_poly.BoundsPrecision.BEST)
    if lo > 0 or hi < 0:
        return False
    return True if lo == hi == 0 else None


def _note_nonempty(e1, e2, decide, res: bool) -> None:
    """Record a data-dependent size whose comparison ``decide(e1 - e2)``
    (answered ``res``) is answered otherwise, or not at all, where that size
    is 0.

    JAX's decision procedure assumes every dim var >= 1. A spec dim var is
    traced shifted so that its 0 is in range (``MaskedProgram``); a
    data-dependent size (``nonzero``'s count) is created in the middle of the
    trace, where no case split can be chosen ahead of the run. So ``x.max()``
    of a selection decides "not empty" and ``jnp.argmax`` "not size 0" where
    plain JAX raises at 0, and a program traced on that answer must not
    return a value at 0: the rule binding the size checks it at run time.

    Where the trace can split, it does (``SplitBeforeRaise(_u1 - 1)``): the
    case of a count of 0 is traced with the count the constant 0 (plain
    JAX's own trace there, ``ops._fresh``), and the count chooses between
    the two while the program runs (``cases/splitting.py``). The note stays
    for a split that JAX's code swallows.
    """
    stack = getattr(_HOOK_TLS, "stack", None)
    if not stack:
        return
    frame = stack[-1]
    names = set().union(*(dim_vars(e) for e in (e1, e2) if is_dim_expr(e)))
    fresh = sorted(v for v in names if is_fresh_dim_name(v) and v not in frame.assumed_nonempty)
    if frame.busy or not fresh:
        return
    noted = []
    frame.busy = True  # the arithmetic below compares sizes too: no split there
    try:
        diff = e1 - e2
        if not is_dim_expr(diff) or (frame.scope is not None and diff.scope is not frame.scope):
            return
        for v in fresh:
            if count_is_nonempty(diff.scope, v):  # (the case of a count >= 1)
                continue
            try:
                at_zero = decide(_at_zero(diff, (v,)))
            except Exception:  # a form JAX cannot decide at 0: assumed
                at_zero = None
            if at_zero is not res:
                frame.assumed_nonempty[v] = _user_line(frame)
                noted.append(_shape_poly.symbolic_shape(v, scope=diff.scope)[0])
    finally:
        frame.busy = False
    for count in noted:
        if _active_frame(count - 1, counts=True) is not None:
            split = SplitBeforeRaise(
                f"Symbolic dimension comparison '{count}' >= '1' is inconclusive.", count - 1)
            split.polymask_where = frame.assumed_nonempty[str(count)]
            raise split


def _kept_where_a_count_may_be_0(orig, factor: str, reflected: bool):
    """``max(e, c)`` / ``min(e, c)`` (``DimExpr.max``, ``rmax``, ``min``,
    ``rmin``; a constant ``c``, 0 for ``max``) kept as it is where ``e`` has a
    data-dependent size and ``e - c`` may be negative where that size is 0.

    JAX's bounds assume every dim var >= 1: they simplify ``sel[1:]``'s size
    ``max(_u1 - 1, 0)`` to ``_u1 - 1`` and ``sel[:1]``'s stop ``min(_u1, 1)``
    to 1. A size the user computes as ``sel.shape[0] - 1`` is the same
    expression, negative at a count of 0 where plain JAX raises
    (``jnp.zeros``: "must be nonnegative"), and a slice of one entry of an
    empty selection is none. Kept, the clamp tells them apart (lax's
    non-negative shape check is then a decision of the count like any
    other), as a spec dim var's ``x[:3]`` is ``min(n, 3)``."""
    is_max = factor == _shape_poly._DimFactor.MAX

    def keep(self, other):
        stack = getattr(_HOOK_TLS, "stack", None)
        if stack and not stack[-1].busy and is_dim_expr(self):
            decided = _max_min_by_values(self, other, is_max, stack[-1])
            if decided is UNDECIDED:
                return _shape_poly._DimExpr._from_operation(
                    factor, *((other, self) if reflected else (self, other)), scope=self.scope)
            if decided is not None:
                return decided
        if (not stack or stack[-1].busy or not is_dim_expr(self) or is_dim_expr(other)
                or (is_max and other != 0) or not _has_fresh(self)):
            return orig(self, other)
        frame = stack[-1]
        frame.busy = True  # (the dict's == below compares sizes: no split there)
        try:
            e = _unclamped(self, frame.kept_clamps) if is_max else self
            if not _negative_at_zero_count(e - other):
                return orig(self, other)
            out = _shape_poly._DimExpr._from_operation(
                factor, *((other, e) if reflected else (e, other)), scope=self.scope)
            if is_max:
                frame.kept_clamps[out] = e
            return out
        finally:
            frame.busy = False

    return keep


def _unclamped(e, kept: dict):
    """``e`` with a clamp kept earlier, ``max(0, f) + c`` (``c <= 0``), read as
    ``f + c``: the same size once clamped again (``sel[1:][1:]`` is
    ``max(0, _u1 - 2)``, not a nested max JAX's bounds cannot compare)."""
    for clamp, inner in kept.items():
        shift = e - clamp
        if not is_dim_expr(shift) and int(shift) <= 0:
            return inner + int(shift)
    return e


def _negative_at_zero_count(e) -> bool:
    """Whether ``e`` may be negative where its data-dependent sizes are 0 (a
    size the case's conditions keep >= 2, ``_u1 - 2 >= 0``, is never 0)."""
    fresh = [v for v in dim_vars(e) if is_fresh_dim_name(v) and _decision.bounds_decision(
        _shape_poly.symbolic_shape(v, scope=e.scope)[0], _shape_poly.BoundsPrecision.BEST)[0] <= 1]
    if not fresh:
        return False
    try:
        at_zero = _at_zero(e, fresh)
    except Exception:  # noqa: BLE001 - a form JAX cannot evaluate there: kept
        return True
    if not is_dim_expr(at_zero):
        return int(at_zero) < 0
    return _decision.bounds_decision(at_zero, _shape_poly.BoundsPrecision.BEST)[0] < 0


def _user_line(frame: _HookFrame) -> str:
    """``file:line (function)`` of the innermost user frame of the comparison."""
    caller = sys._getframe(1)
    while caller is not None and not _in_user_code(caller, frame):
        caller = caller.f_back
    if caller is None:
        return "an unknown line"
    return f"{caller.f_code.co_filename}:{caller.f_lineno} ({caller.f_code.co_name})"


# A hash in user code at one of these opcodes looks a size up: `n in {4, 8}`,
# `table[n]`, a dict or set display; at a call only where the line calls a
# lookup (a jax.jit static argument is hashed at a call too, and may stay symbolic)
_CALL_OPCODES = frozenset(op for name, op in dis.opmap.items()
                          if name.startswith(("CALL", "PRECALL")))
_LOOKUP_CALLS = (".get(", ".pop(", ".setdefault(", ".__contains__(", ".add(", ".discard(",
                 ".remove(", ".index(", ".count(", "hash(")


def _hashed_in_user_code(orig_hash):
    """``DimExpr.__hash__`` that stops the trace where the user's code looks a
    size up by its hash (``TABLE.get(x.shape[0], 1.0)``, ``n in {4, 8}``,
    ``x.shape in table``). On the exact arrays the size is an int and
    finds its entry; the symbolic size hashes as itself and would silently
    miss. Raised as JAX's "needs a concrete value" error, the case is traced
    size by size (``tracing/cases/refine.py``), each trace plain JAX's own.
    JAX's own hashing (its caches, a tuple of shapes) is left alone."""

    def hash_(a):
        stack = getattr(_HOOK_TLS, "stack", None)
        if stack:
            frame = stack[-1]
            caller = sys._getframe(1)
            user = frame.user_files.get(caller.f_code.co_filename)
            if user is None:  # (JAX's own hashing never: its terms, its caches)
                user = frame.user_files[caller.f_code.co_filename] = (
                    _in_user_code(caller, frame)
                    and "jax/_src/" not in caller.f_code.co_filename.replace("\\", "/"))
            # (a data-dependent size too: its lookup would miss at every count)
            if user and _active_frame(a, counts=True) is frame and _looks_up(caller):
                raise InconclusiveDimensionOperation(
                    f"the size '{a}' is looked up by its hash (a dict key, a set member, "
                    "`in` a dict or set): that needs its value as a Python int")
        return orig_hash(a)

    return hash_


def _looks_up(caller) -> bool:
    code = caller.f_code
    try:
        op = code.co_code[caller.f_lasti]
    except IndexError:
        return False
    if op not in _CALL_OPCODES:
        return True
    line = linecache.getline(code.co_filename, caller.f_lineno)
    return any(t in line for t in _LOOKUP_CALLS)


# Python's divisions of (or by) a size: /, //, % and divmod, both ways round
_DIVISIONS = ("__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__",
              "__mod__", "__rmod__", "__divmod__", "__rdivmod__")


def _python_division(orig, reflected: bool):
    """``DimExpr``'s ``/``, ``//``, ``%`` and ``divmod`` that divide as Python does.

    On the exact arrays a size is a Python int, so ``1.0 / x.shape[0]``,
    ``7 // n``, ``k % n`` (or ``n / m`` of two sizes) raise ``ZeroDivisionError``
    at a size of 0, while JAX's symbolic division is an array division
    (``inf``) or a symbolic ``floordiv`` (``0``). Where the divisor
    is a size that may be 0, the trace splits on it (``divisor >= 1``); in the
    case where it is 0 the division raises as Python's does, and polymask
    reports it as a ``ShapeError`` at those sizes (at run time under ``jit``).
    A traced dividend (``x.sum() / n``) divides as an array, as in plain JAX.
    """

    def divide(self, other):
        divisor, dividend = (self, other) if reflected else (other, self)
        if isinstance(dividend, (int, float)) or is_dim_expr(dividend):
            _check_python_divisor(divisor)
        return orig(self, other)

    return divide


# NumPy ufuncs whose object loop calls the method of that name (np.sqrt(d) of a
# size in initialisers and attention scales): none is a DimExpr method in JAX
_NUMPY_MATH = ("sqrt", "cbrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p",
               "sin", "cos", "tan", "tanh", "arctan")


def _numpy_math_of_value(ufunc):
    """``n.sqrt()`` for NumPy's object loop: the ufunc of the size's value
    (``float(n)``: needing a concrete value where the size is symbolic)."""
    return lambda a: ufunc(float(a))


def _python_power(orig):
    """``DimExpr ** p`` that needs the size's value where Python's int power is
    a float (``x.shape[-1] ** -0.5``, a negative or fractional ``p``): JAX's
    raises a ``ValueError``; this is its "requires a constant" error, so the
    trace goes size by size (or, without ``in_specs``, the axis is static)."""

    def power(self, p, modulo=None):
        if (modulo is None and not is_dim_expr(p) and isinstance(p, (int, float))
                and (p < 0 or p != int(p)) and _active_frame(self) is not None):
            raise InconclusiveDimensionOperation(
                f"Symbolic dimension '{self}' used in a context that requires a constant "
                f"('{self}' ** {p!r} is a Python float of its value)")
        return orig(self, p, modulo)

    return power


def _check_python_divisor(divisor) -> None:
    if not is_dim_expr(divisor):
        if isinstance(divisor, (int, float)) and divisor == 0:
            raise ZeroDivisionError("division by zero")
        return
    if _has_fresh(divisor) and not _called_by_polymask(_outside_this_module()):
        # a data-dependent count (1.0 / sel.shape[0]): JAX assumes it >= 1;
        # where it is 0, Python's division raises: checked at run time
        _note_nonempty(divisor, 0, lambda d: None if _eq_zero(d) is None
                       else not _eq_zero(d), True)
    frame = _active_frame(divisor)
    if frame is None:
        return
    lo, hi = _decision.bounds_decision(divisor, _shape_poly.BoundsPrecision.BEST)
    if lo > 0 or hi < 0:
        return
    if lo == hi == 0:
        raise ZeroDivisionError(f"division by zero (the size {divisor} is 0)")
    # split off the side of 0 the divisor can reach: >= 1 | 0, or <= -1 | 0
    # (``n - 1`` is -1 at n = 0: both sides, first at 0 | not)
    cond = divisor - 1 if lo >= 0 else -divisor - 1 if hi <= 0 else divisor
    raise SplitNeeded(f"Possible division by 0 in division by {divisor}", cond)


def _outside_this_module():
    """The innermost Python frame whose code is not this module's."""
    caller = sys._getframe(1)
    while caller is not None and caller.f_code.co_filename == __file__:
        caller = caller.f_back
    return caller


_ZERO_DIVISOR = "Possible division by 0 in division by "


def _possible_zero_divisor(message: str):
    """The divisor named by JAX's "possible division by 0" (a DimExpr of this
    thread's trace), or None."""
    stack = getattr(_HOOK_TLS, "stack", None)
    if not message.startswith(_ZERO_DIVISOR) or not stack:
        return None
    try:
        (d,) = _shape_poly.symbolic_shape(message[len(_ZERO_DIVISOR):],
                                          scope=stack[-1].scope)
    except Exception:  # a form the parser does not read back: no split
        return None
    return d if is_dim_expr(d) else None


def _values_everywhere(dim, frame: _HookFrame) -> frozenset | None:
    """The values ``dim`` takes over every value of its dim vars in their
    ranges that this case's conditions allow (``values_over``), None where
    unknown. What holds over all of them holds in this case."""
    if dim in frame.everywhere:
        return frame.everywhere[dim]
    names = sorted(dim_vars(dim))
    res = None
    if all(v in frame.split_vars for v in names):
        res = values_over(dim, frame.split_vars, frame.scope)
    frame.everywhere[dim] = res
    return res


def _values_while_busy(dim, frame: _HookFrame) -> frozenset | None:
    """``_values_everywhere`` where no size comparison may split (its cache
    compares sizes with ``==``)."""
    busy, frame.busy = frame.busy, True
    try:
        return _values_everywhere(dim, frame)
    finally:
        frame.busy = busy


def _max_min_by_values(a, b, is_max: bool, frame: _HookFrame):
    """``max(a, b)`` / ``min(a, b)`` of sizes JAX takes long to decide
    (``costly_to_decide``: nested ``floordiv``s, many ``min`` / ``max``s) where
    their values decide it (one of them at every value); ``UNDECIDED`` where
    the values are known and decide neither (JAX's procedure, weaker than
    them, would not either: the caller keeps both), else None."""
    if not costly_to_decide(f"{a} {b}", a.scope) or _has_fresh(a) or (
            is_dim_expr(b) and _has_fresh(b)):
        return None
    values = _values_while_busy(a - b, frame)
    if values is None:
        return None
    if min(values) >= 0:
        return a if is_max else b
    if max(values) <= 0:
        return b if is_max else a
    return UNDECIDED


UNDECIDED = object()  # a max / min its operands' values do not decide


def _signs_everywhere(diff, frame: _HookFrame) -> frozenset | None:
    """The signs (-1, 0, 1) ``diff`` takes over every value of its dim vars in
    their ranges (``_values_everywhere``), None where that is unknown."""
    values = _values_everywhere(diff, frame)
    return None if values is None else frozenset(int(np.sign(v)) for v in values)


def _equal_by_values(diff, frame: _HookFrame) -> bool | None:
    """``diff == 0`` where the values of ``diff``'s dim vars decide it: True
    where it is 0 at each (``jnp.diff(x[1:])``'s two shapes, structurally
    different ``min``s), False where it is 0 at none (not for ``floordiv`` /
    ``mod`` sizes: see ``_decided_by_values``), else None."""
    if _has_fresh(diff):
        return None
    signs = _signs_everywhere(diff, frame)
    if signs == {0}:
        return True
    if signs and 0 not in signs and not DIVIDED_SIZE.search(str(diff)):
        return False
    return None


def _decided_by_values(diff, frame: _HookFrame) -> bool | None:
    """``diff >= 0`` where the values of ``diff``'s dim vars decide it (the same
    answer at each of them), else None. Sizes of a stencil's shifted slices
    (``u[1:-2]``: ``max(0, max(0, n - 2) - min(1, n))``) are equal or ordered
    at every size, which JAX's decision procedure cannot prove from their
    ``max`` / ``min`` terms: each such comparison was a case split, and a
    4-point stencil needed more than ``max_cases``. Sizes with a ``floordiv``
    / ``mod`` are decided by their values before JAX's procedure runs
    (``_divided_geq_by_values``); one that reaches here is left to split."""
    if _has_fresh(diff) or DIVIDED_SIZE.search(str(diff)):
        return None
    signs = _signs_everywhere(diff, frame)
    if not signs:
        return None
    if min(signs) >= 0:
        return True
    return False if max(signs) < 0 else None


_EQ_TOKENS = ("==", "!=", " in ", ".index(", ".count(")
# JAX's user-level libraries branch on sizes with plain ``==`` (``jnp.linalg``'s
# det JVP: ``a.shape[-1] == 1``; ``jnp.linspace``: ``num == 1``).
_SPLIT_IN_JAX = ("jax/_src/numpy/", "jax/_src/scipy/", "jax/_src/nn/", "jax/_src/image/",
                 "jax/_src/export/")
# core.divide_shape_sizes: is a size divisible (reshape with -1)
_SPLIT_FUNCTIONS = ("divide_shape_sizes",)


def _is_shape_decision(caller) -> bool:
    """A comparison written in JAX's Python code (``a.shape[-1] == 1``), as opposed
    to ``core.definitely_equal`` or a cache lookup: JAX's C++ caches compare keys (shapes among them) with
    ``==`` when 7 bits of their hashes match, and objects' ``__eq__`` compare
    avals; splitting there would make the cases depend on what the process
    traced before (and on the hash seed)."""
    if caller is None or caller.f_code.co_name in ("__eq__", "__ne__", "__hash__"):
        return False
    if caller.f_code.co_name.startswith("definitely_"):
        # core.definitely_equal: its callers are correct when it answers False
        # for an unknown (its contract), e.g. broadcasting's "is this dim 1?";
        # except a check that raises, as plain JAX does on the exact arrays
        # (``x.at[1].set(v)`` on an empty axis: IndexError)
        return _guards_a_raise(caller.f_back)
    if caller.f_code.co_name in _SPLIT_FUNCTIONS:
        return True
    if not any(d in caller.f_code.co_filename.replace("\\", "/") for d in _SPLIT_IN_JAX):
        # lax/core shape rules and fast paths (``aval.shape == shape``: skip an
        # op) are correct with False; splitting there only multiplies programs
        return False
    line = linecache.getline(caller.f_code.co_filename, caller.f_lineno)
    return any(t in line for t in _EQ_TOKENS)


_EMPTY_TEST = re.compile(r"[!=]= 0\b")


def _emptiness_check(b, caller) -> bool:
    """``size == 0`` written in JAX's lax or core (``if np.size(g) == 0:``): an
    empty operand's own path, taken by plain JAX on the exact arrays at size
    0. The conv's kernel gradient returns zeros there instead of forming a
    convolution with an empty window, which raises; ``bool(x)`` of an empty
    array raises; a reduction tree returns its init values. False (JAX's
    answer for an unknown size) would take the general path at 0 too."""
    if b != 0 or caller is None or caller.f_code.co_name in ("__eq__", "__ne__", "__hash__"):
        return False
    if caller.f_code.co_name.startswith("definitely_"):
        return False  # (core.is_empty_shape and the like: see _is_shape_decision)
    if "jax/_src/" not in caller.f_code.co_filename.replace("\\", "/"):
        return False
    return bool(_EMPTY_TEST.search(linecache.getline(caller.f_code.co_filename,
                                                     caller.f_lineno)))


# lax's broadcasting rule: ``definitely_equal(d, 1)`` False for an unknown d
# takes d as a size to match, and the shapes then fail to match
_BROADCAST_RULES = ("_try_broadcast_shapes",)
# only max / min (slices near size 0): a split on floordiv / mod sizes (strided
# convolutions) gives constraints JAX's decision procedure cannot take
# (bounds_decision raised AttributeError on 'floordiv(h - 1, 2) <= -1')
_COMPUTED_SIZE = re.compile(r"\b(max|min)\(")


def _broadcast_match(a, b, caller, frame: _HookFrame) -> bool:
    """``a == b`` asked by lax's broadcasting rule where a side is a computed
    size (``max(0, l - 1) + 1``, ``min(16, n)``: a slice near size 0 or past
    a table's end) and ``b`` is 1 or a size of the same dim vars: on the exact
    arrays the two are equal at some sizes, where plain JAX broadcasts them
    (optax's ctc_loss adds shapes ``(1, l)`` and ``(1, max(0, l - 1) + 1)``;
    ``x + pos[:n]`` with a table of 16 rows adds ``(n, d)`` and ``(min(16,
    n), d)``). Operands of different dim vars, or of a dim var's own size
    (``n`` against ``1``), keep their error: their specs say the sizes are
    independent."""
    if caller is None or not caller.f_code.co_name.startswith("definitely_"):
        return False
    if isinstance(b, DimExpr):
        if not (dim_vars(b) & dim_vars(a)) or _has_fresh(a, b):
            return False
    elif b != 1:
        return False
    outer = caller.f_back
    while outer is not None and outer.f_code.co_name in ("<genexpr>", "<listcomp>"):
        outer = outer.f_back
    if outer is None or outer.f_code.co_name not in _BROADCAST_RULES:
        return False
    text = f"{a} {b}"
    if not _COMPUTED_SIZE.search(text) or DIVIDED_SIZE.search(text):
        return False
    # sizes of this axis equal at every value (a stencil's shifted slices): which
    # of them is 1 changes nothing, the result is their size
    return not _all_equal_by_values(outer.f_locals.get("ds"), a, frame)


def _all_equal_by_values(ds, a, frame: _HookFrame) -> bool:
    """Whether the sizes ``ds`` of one axis (lax's broadcasting rule's local)
    are all equal to ``a`` at every value of their dim vars."""
    if not isinstance(ds, tuple) or not any(d is a for d in ds):
        return False
    try:  # (asked inside _eq_decided: the frame is busy, no split in the subtraction)
        return all(d is a or (is_dim_expr(d) and d.scope is a.scope
                              and _equal_by_values(d - a, frame) is True) for d in ds)
    except Exception:
        return False


def _guards_a_raise(caller) -> bool:
    """``if core.definitely_equal(size, 0): raise IndexError(...)`` in jnp's code."""
    if caller is None or not any(
            d in caller.f_code.co_filename.replace("\\", "/") for d in _SPLIT_IN_JAX):
        return False
    return _raises_below(caller)


def _branch_differs_at_zero() -> bool:
    """Whether the size comparison being answered picks a path that plain JAX
    would not take at a size of 0: one in user code (``if x.shape[0] == 0:``),
    or one in JAX guarding a ``raise`` (``jnp.max``'s "zero-size array",
    ``x[0]``'s ``IndexError``). jnp's fast paths for empty arrays
    (``jnp.take``: ``if indices.size == 0: return zeros``) give what the
    general path gives at 0, and JAX's structural comparisons (caches,
    avals) choose no path."""
    stack = getattr(_HOOK_TLS, "stack", None)
    if not stack:
        return False
    caller = sys._getframe(1)
    while caller is not None and (
            caller.f_code.co_filename == __file__
            or "jax/_src/export/" in caller.f_code.co_filename.replace("\\", "/")
            or caller.f_code.co_name.startswith("definitely_")):
        caller = caller.f_back
    if caller is None:
        return False
    if getattr(_HOOK_TLS, "as_user", False) or _in_user_code(caller, stack[-1]):
        return True
    if (_called_by_polymask(caller) or _raise_also_needs_an_array_empty_at_zero(caller)
            or _enclosing_function(caller) in _CLAMPED_SIZE_CHECKS):
        return False
    return _raises_below(caller) or _empty_path_in_jnp(caller)


def _enclosing_function(caller) -> str:
    """The name of the function at ``caller``, past generator expressions."""
    while caller.f_back is not None and caller.f_code.co_name in ("<genexpr>", "<listcomp>"):
        caller = caller.f_back
    return caller.f_code.co_name


# lax's check that a shape is non-negative: at a count of 0 the derived size it
# sees (``_u1 - 1`` of ``sel[1:]``, simplified from ``max(_u1 - 1, 0)`` on JAX's
# assumption ``_u1 >= 1``) is negative only symbolically; the program's sizes
# are clamped at 0, as plain JAX's slicing computes them
_CLAMPED_SIZE_CHECKS = ()


def _empty_path_in_jnp(caller) -> bool:
    """``if X.shape[1] == 0:`` in jnp's own code: an empty operand's own path
    (``jnp.cov``'s NaNs, ``jnp.pad``'s check), which plain JAX takes at 0.
    A fast path that returns zeros (``jnp.take``: ``if indices.size == 0:
    return lax.full_like(a, 0, ...)``) gives what the general path gives."""
    if not any(d in caller.f_code.co_filename.replace("\\", "/") for d in _SPLIT_IN_JAX):
        return False
    line = linecache.getline(caller.f_code.co_filename, caller.f_lineno)
    if not (line.lstrip().startswith(("if ", "elif ")) and _EMPTY_TEST.search(line)):
        return False
    return not any(_ZEROS_RETURNED.search(text) for _, text in _block_of(caller))


# ``return lax.full(shape, 0, ...)``, ``return zeros(...)``, ``full_like(a, 0, ...)``
_ZEROS_RETURNED = re.compile(r"^return .*(\bzeros(_like)?\(|\bfull(_like)?\([^,]*,\s*0\b)")


def _block_of(caller) -> list[tuple[int, str]]:
    """``(indentation, stripped text)`` of the lines of the block below the
    line at ``caller``."""
    name, lineno = caller.f_code.co_filename, caller.f_lineno
    here = linecache.getline(name, lineno)
    indent = len(here) - len(here.lstrip())
    out = []
    for offset in range(1, _BLOCK_LINES + 1):
        line = linecache.getline(name, lineno + offset)
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if len(line) - len(line.lstrip()) <= indent:
            break
        out.append((len(line) - len(line.lstrip()), text))
    return out


# ``<name>.size != 0`` / ``> 0`` in a condition (``and ...``, or a nested ``if``):
# the raise needs that array non-empty
_NONEMPTY_TERM = re.compile(r"\b(\w+)\.size\s*(?:!=|>)\s*0\b")


def _raise_also_needs_an_array_empty_at_zero(caller) -> bool:
    """``if size == 0 and indices.size != 0: raise`` (jax 0.12.1's
    ``jnp.take``; 0.10.2 nests it, ``if size == 0: if indices.size != 0:
    raise``, then returns the empty operand): the raise also needs an array
    that is empty where the data-dependent sizes are 0 (``indices`` of
    ``jnp.arange(s.shape[0])``), so plain JAX does not raise there and the
    comparison picks no other path."""
    lines = [linecache.getline(caller.f_code.co_filename, caller.f_lineno)]
    lines += [text for _, text in _block_of(caller)]
    for name in (m for line in lines for m in _NONEMPTY_TERM.findall(line)):
        size = getattr(caller.f_locals.get(name), "size", None)
        if not isinstance(size, DimExpr):
            continue
        fresh = [v for v in dim_vars(size) if is_fresh_dim_name(v)]
        if fresh and _empty_at_zero(size, fresh):
            return True
    return False


def _empty_at_zero(size, fresh) -> bool:
    """Whether the size expression ``size`` is 0 where its ``fresh`` vars are 0."""
    try:
        return int(_at_zero(size, fresh)) == 0
    except Exception:  # noqa: BLE001 - not a constant: it may be non-empty
        return False


def _at_zero(e, counts):
    """``e`` where the data-dependent sizes ``counts`` are 0, its other dim
    vars symbolic: an int or a dimension expression. Raises where JAX cannot
    evaluate its form there."""
    env = {n: 0 if n in counts else _shape_poly.symbolic_shape(n, scope=e.scope)[0]
           for n in dim_vars(e)}
    with np.errstate(all="ignore"):  # (``n // _u1`` at 0)
        return e._evaluate(env)


# the code of every replace_during_trace replacement (patches.py adds them):
# code that stands for JAX's own in a masked trace
TRACE_REPLACEMENT_CODES: set = set()


def _called_by_polymask(caller) -> bool:
    """Whether JAX code at ``caller`` runs for polymask's own (a rule's
    ``a[mid]`` in its searchsorted, whose result is unused at size 0), not
    for the user's: the first frame outside JAX is polymask's (past this
    package's own hooks into JAX's tracing: its staging of the user's
    ``lax.top_k`` is the user's call)."""
    if caller is not None and caller.f_code in TRACE_REPLACEMENT_CODES:
        return False  # (jnp.convolve's own "inputs cannot be empty", rewritten)
    here = os.path.dirname(os.path.abspath(__file__))
    while caller is not None and (
            "/jax/" in caller.f_code.co_filename.replace("\\", "/")
            or caller.f_code.co_filename.startswith(here)):
        caller = caller.f_back
    return caller is not None and caller.f_code.co_filename.startswith(_POLYMASK_DIR)


def _raises_below(caller) -> bool:
    """``if <comparison>: raise ...`` (on the line, or in the ``if``'s block:
    lax's shape rules build the message first, ``msg = (...)`` then ``raise``)."""
    if " raise " in linecache.getline(caller.f_code.co_filename, caller.f_lineno):
        return True
    block = _block_of(caller)  # (a raise under a further ``if`` needs more than this)
    return any(text.startswith("raise ") and indent == block[0][0] for indent, text in block)


_BLOCK_LINES = 8  # lines of an ``if`` block searched for its ``raise``


def _eq_decided(a, b, diff, res: bool, truth: bool) -> bool:
    """``a == b`` (``diff = a - b``) decided by the scope's bounds, or JAX's
    structural ``res``; raises ``SplitNeeded`` where the trace splits on it
    (``_split_eq``)."""
    frame = _active_frame(diff, counts=True)
    if frame is None:
        return res
    frame.busy = True
    try:
        # (the values first where they decide: JAX's bounds of nested floordivs
        # took seconds per comparison, jax-cfd's spectral slices)
        values = _values_everywhere(diff, frame) if not _has_fresh(diff) else None
        if values is not None:  # (exact over the case's values: bounds as good as JAX's)
            lo, hi = min(values), max(values)
        else:
            lo, hi = _decision.bounds_decision(diff, _shape_poly.BoundsPrecision.BEST)
        if lo > 0 or hi < 0:
            return False
        if lo == hi == 0:
            return True
        equal = _equal_by_values(diff, frame)
        if equal is not None:
            return equal
        caller = sys._getframe(1)
        while caller is not None and caller.f_code.co_filename == __file__:
            caller = caller.f_back
        user = getattr(_HOOK_TLS, "as_user", False) or (
            caller is not None and _in_user_code(caller, frame))
        broadcast = _broadcast_match(a, b, caller, frame)
        decision = (truth or user or broadcast or _is_shape_decision(caller)
                    or _emptiness_check(b, caller))
    finally:
        frame.busy = False
    message = f"Symbolic dimension comparison '{a}' == '{b}' is inconclusive."
    if (decision and (broadcast or not isinstance(b, DimExpr))) or user:
        # Split where it narrows: below/at-or-above 0, then at/above 0.
        cond = -diff if lo >= 0 else diff
        if caller is not None and caller.f_code.co_name.startswith("definitely_"):
            raise SplitBeforeRaise(message, cond)
        raise SplitNeeded(message, cond)
    return res


def _split_eq(orig_eq):
    """``DimExpr.__eq__`` that decides with the scope's bounds, or splits.

    JAX answers ``a == b`` structurally and says False when ``a - b`` is not a
    constant, because ``__eq__`` cannot raise
    (https://docs.jax.dev/en/latest/export/shape_poly.html#comparison-of-symbolic-dimensions-is-partially-supported),
    so ``if x.shape[0] == 1:`` would silently trace the wrong branch at 1.
    Here the bounds decide it when they can, and two sizes equal at every
    value of the dim vars within their bounds are equal (``jnp.diff(x[1:])``'s
    two shapes, structurally different ``min``s); otherwise the trace splits
    on ``a - b`` when ``b`` is a constant or the comparison is in user code.
    Else (two different sizes compared inside JAX) it stays False: JAX then
    reports incompatible shapes, or takes its general path, as before.
    """

    def eq(a, b, truth: bool = False):
        # truth: `if size:` (``__bool__``), a decision wherever it is written
        # (jnp.packbits' `if remainder:` padded at n % 8 == 0, n = 0 included)
        if isinstance(a, DimExpr) and isinstance(b, (float, np.floating)):
            # an int size equals a float as Python compares them: n == 2.0 is
            # n == 2 (JAX answers False), never 2.5 nor NaN
            if not float(b).is_integer():
                return False
            b = int(b)
        res = orig_eq(a, b)
        if res is True or not isinstance(a, DimExpr):
            return res
        if isinstance(b, DimExpr):
            if a.scope is not b.scope:
                return res
        elif not _core.is_constant_dim(b):
            return res
        try:
            diff = a - b
        except Exception:
            return res
        # a count's comparison holds where the count is not 0 (JAX assumes >= 1):
        # noted with the answer it gets here (``_note_nonempty``)
        counted = any(is_fresh_dim_name(v) for v in dim_vars(diff)) and (
            _branch_differs_at_zero() or _count_pinned(a, b))
        answer = _eq_decided(a, b, diff, res, truth)
        if counted:
            _note_nonempty(a, b, _eq_zero, answer)
        return answer

    return eq
