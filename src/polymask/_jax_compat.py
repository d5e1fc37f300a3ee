"""Every use of private JAX API lives here (tested range: jax 0.10.x).

polymask needs a few internals of ``jax.export``'s symbolic shapes (dimension
expressions, their scope and bounds) and of the jaxpr machinery (source info,
``dim_as_value``). Keeping them in one module means a JAX upgrade touches one
file; ``tests/test_jax_compat.py`` covers each function here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax._src import core as _core
from jax._src import source_info_util as _source_info_util
from jax._src.export import shape_poly as _shape_poly
from jax._src.export import shape_poly_decision as _decision

DimExpr = _shape_poly._DimExpr
SymbolicScope = _shape_poly.SymbolicScope
InconclusiveDimensionOperation = _core.InconclusiveDimensionOperation
Literal = _core.Literal
Var = _core.Var
DropVar = _core.DropVar
ClosedJaxpr = _core.ClosedJaxpr
Jaxpr = _core.Jaxpr
ShapedArray = _core.ShapedArray
Primitive = _core.Primitive
dim_as_value_p = _shape_poly.dim_as_value_p


def is_dim_expr(d: Any) -> bool:
    """True for a symbolic dimension expression (not a Python int)."""
    return isinstance(d, DimExpr)


def is_symbolic_shape(shape) -> bool:
    return any(is_dim_expr(d) for d in shape)


def dim_vars(e) -> set[str]:
    """Names of the dimension variables in ``e`` (empty for an int)."""
    return set(e._get_vars()) if is_dim_expr(e) else set()


def evaluate_dim(e, env: dict[str, Any]):
    """Evaluate a dimension expression; ``env`` values are ints or traced ints."""
    if not is_dim_expr(e):
        return e
    return e._evaluate(env)


def add_constraint(scope: SymbolicScope, constraint: str) -> None:
    """Add a constraint (e.g. ``"n <= 16"``) to an existing scope.

    Used for upper bounds of dim vars, which are known only once the padded
    signature (or a data-dependent size's bound) is known.
    """
    scope._parse_and_process_explicit_constraint(constraint)
    scope._bounds_cache.clear()
    scope._decision_initial_state = None


def explicit_constraints(scope: SymbolicScope) -> list[tuple[str, Any, Any, str]]:
    """The scope's constraints as ``(kind, e1, e2, text)``, kind in {"==", ">="}."""
    out = []
    for c in scope._explicit_constraints:
        kind = "==" if c.cmp == _shape_poly.Comparator.EQ else ">="
        out.append((kind, c.e1, c.e2, c.debug_str))
    return out


def upper_bound(e) -> float:
    """Best upper bound JAX's decision procedure proves for ``e`` (may be inf)."""
    if not is_dim_expr(e):
        return e
    _, hi = _decision.bounds_decision(e, _shape_poly.BoundsPrecision.BEST)
    return hi


def lower_bound(e) -> float:
    if not is_dim_expr(e):
        return e
    lo, _ = _decision.bounds_decision(e, _shape_poly.BoundsPrecision.BEST)
    return lo


def fresh_dim(name: str, scope: SymbolicScope):
    """A new dimension variable in ``scope`` (for data-dependent sizes)."""
    return jax.export.symbolic_shape(name, scope=scope)[0]


def source_line(source_info) -> str:
    """``file:line (function)`` of the user frame of an equation's source info."""
    try:
        frame = _source_info_util.user_frame(source_info.traceback)
    except Exception:  # pragma: no cover - defensive
        frame = None
    if frame is None:
        return "<unknown location>"
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def new_jaxpr_eqn_source(eqn):
    return eqn.source_info


def is_jaxpr_literal(v) -> bool:
    return isinstance(v, Literal)


def literal_value(v):
    return v.val


def user_context(source_info):
    """Context manager: ops bound inside carry the equation's user traceback."""
    return _source_info_util.user_context(source_info.traceback)


def is_tracer(x) -> bool:
    return isinstance(x, _core.Tracer)


def instantiate_zero(x, aval=None):
    """Turn JAX's symbolic ``Zero`` cotangent into an array (else return ``x``)."""
    import jax.numpy as _jnp
    from jax._src.interpreters import ad as _ad

    if isinstance(x, _ad.Zero):
        a = x.aval
        return _jnp.zeros(a.shape, a.dtype)
    return x


def call_wrapped(wrapped_fun, *args):
    """Call a ``linear_util.WrappedFun`` (custom-derivative thunks)."""
    return wrapped_fun.call_wrapped(*args)


# Modules whose module-level ``core.Primitive`` instances make up "every lax
# primitive JAX defines" for the coverage table (tools/coverage.py). Packages
# are walked; Pallas / Mosaic / Triton kernels are out of scope.
_PRIMITIVE_PACKAGES = ("jax._src.lax", "jax._src.random")
_PRIMITIVE_MODULES = (
    "jax._src.core", "jax._src.ad_util", "jax._src.pjit", "jax._src.custom_derivatives",
    "jax._src.ad_checkpoint", "jax._src.export.shape_poly", "jax._src.callback",
    "jax._src.debugging", "jax._src.dispatch", "jax._src.checkify", "jax._src.custom_batching",
    "jax._src.custom_partitioning", "jax._src.shard_map", "jax._src.shard_alike",
    "jax._src.compute_on", "jax._src.xla_metadata", "jax._src.state.primitives",
)


def all_primitives() -> dict[str, str]:
    """Every primitive JAX defines in lax, control flow, calls, random, etc.

    Returns ``{primitive name: defining module}`` from the module-level
    ``core.Primitive`` instances of the modules above (private API: the
    module layout changes between JAX versions; missing modules are skipped).
    """
    import importlib
    import pkgutil

    modules = []
    for pkg_name in _PRIMITIVE_PACKAGES:
        try:
            pkg = importlib.import_module(pkg_name)
        except ImportError:
            continue
        modules.append(pkg)
        for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
            try:
                modules.append(importlib.import_module(info.name))
            except Exception:  # optional backends (GPU/TPU plugins) may not import
                continue
    for name in _PRIMITIVE_MODULES:
        try:
            modules.append(importlib.import_module(name))
        except Exception:
            continue
    found: dict[str, str] = {}
    for mod in modules:
        for value in vars(mod).values():
            if isinstance(value, _core.Primitive):
                found.setdefault(value.name, mod.__name__)
    return dict(sorted(found.items()))


# The hooks are installed while at least one masked trace runs (in any thread)
# and removed when the last one ends; a hook only acts for the thread whose
# trace is in progress (its frame on ``_HOOK_TLS.stack``).
_HOOK_LOCK = threading.Lock()
_HOOK_USERS = 0
_HOOK_ORIG: tuple = ()
_HOOK_TLS = threading.local()


class SplitNeeded(InconclusiveDimensionOperation):
    """A size comparison JAX cannot decide in the trace in progress.

    ``cond`` is a dimension expression: the trace must be repeated once with
    ``cond >= 0`` and once with ``cond <= -1`` added to the scope. It derives
    from JAX's ``InconclusiveDimensionOperation`` so that JAX code that falls
    back on an inconclusive comparison (``max``/``min``, ``divmod``) still does.
    """

    def __init__(self, message: str, cond):
        super().__init__(message)
        self.cond = cond


@dataclasses.dataclass
class _HookFrame:
    split_vars: dict  # internal dim var -> (lowest, highest) value
    is_user_frame: Any
    busy: bool = False
    everywhere: dict = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def trace_hooks(excluded_paths: Sequence[str], is_user_frame,
                split_vars: dict | None = None) -> Iterator[None]:
    """The JAX hooks a masked trace needs, installed for its duration only.

    - Equations bound from ``excluded_paths`` (polymask's own ops) report
      their caller's line as the user's line (``source_info_util``).
    - Size comparisons in ``split_vars`` (``{name: (lowest, highest)}``)
      that JAX cannot decide raise
      ``SplitNeeded`` (instead of JAX's inconclusive error, or, for ``==``,
      instead of JAX's unsound ``False``), so the tracer can trace each
      outcome under a constraint (see ``_split_geq`` and ``_split_eq``).

    Both hooks are removed when the last trace in progress (in any thread) ends.
    """
    global _HOOK_USERS, _HOOK_ORIG
    with _HOOK_LOCK:
        if _HOOK_USERS == 0:
            _HOOK_ORIG = (DimExpr.__eq__, DimExpr.__ne__, _shape_poly._geq_decision,
                          list(_source_info_util._exclude_paths))
            eq = _split_eq(_HOOK_ORIG[0])
            DimExpr.__eq__ = eq
            DimExpr.__ne__ = lambda a, b: not eq(a, b)
            _shape_poly._geq_decision = _split_geq(_HOOK_ORIG[2])
        for p in excluded_paths:
            if p not in _source_info_util._exclude_paths:
                _source_info_util.register_exclusion(p)
        _HOOK_USERS += 1
    stack = _HOOK_TLS.__dict__.setdefault("stack", [])
    stack.append(_HookFrame(dict(split_vars or {}), is_user_frame))
    try:
        yield None
    finally:
        stack.pop()
        with _HOOK_LOCK:
            _HOOK_USERS -= 1
            if _HOOK_USERS == 0:
                DimExpr.__eq__, DimExpr.__ne__, _shape_poly._geq_decision, paths = _HOOK_ORIG
                _source_info_util._exclude_paths[:] = paths
                _source_info_util._exclude_path_regex.cache_clear()
                _source_info_util.is_user_filename.cache_clear()


def hooks_installed() -> bool:
    """True while a masked trace is in progress (tests check the hooks are removed)."""
    return _HOOK_USERS > 0


def _active_frame(expr) -> _HookFrame | None:
    """The hook frame of this thread's trace when ``expr`` is a splittable size."""
    stack = getattr(_HOOK_TLS, "stack", None)
    if not stack or not is_dim_expr(expr):
        return None
    frame = stack[-1]
    if frame.busy or not dim_vars(expr) <= set(frame.split_vars):
        return None
    return frame


def _split_geq(orig_geq):
    """``_geq_decision`` that raises ``SplitNeeded(e1 - e2)`` when inconclusive."""

    def geq(e1, e2, cmp_str):
        try:
            return orig_geq(e1, e2, cmp_str)
        except InconclusiveDimensionOperation as e:
            diff = e1 - e2
            if _active_frame(diff) is None:
                raise
            raise SplitNeeded(str(e).split("\n")[0], diff) from None

    return geq


_EVERYWHERE_LIMIT = 4096


def _zero_everywhere(diff, frame: _HookFrame) -> bool:
    """``diff`` is 0 for every value of its dim vars in their ranges (few values only)."""
    hit = frame.everywhere.get(diff)
    if hit is not None:
        return hit
    names = sorted(dim_vars(diff))
    ranges = [range(frame.split_vars[v][0], frame.split_vars[v][1] + 1) for v in names]
    total = 1
    for r in ranges:
        total *= len(r)
    res = False
    if total <= _EVERYWHERE_LIMIT:
        try:
            res = all(int(diff._evaluate(dict(zip(names, combo)))) == 0
                      for combo in itertools.product(*ranges))
        except Exception:
            res = False
    frame.everywhere[diff] = res
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

    def eq(a, b):
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
        frame = _active_frame(diff)
        if frame is None:
            return res
        frame.busy = True
        try:
            lo, hi = _decision.bounds_decision(diff, _shape_poly.BoundsPrecision.BEST)
            if lo > 0 or hi < 0:
                return False
            if (lo == hi == 0) or _zero_everywhere(diff, frame):
                return True
            caller = sys._getframe(1)
            while caller is not None and caller.f_code.co_filename == __file__:
                caller = caller.f_back
            user = caller is not None and frame.is_user_frame(caller.f_code.co_filename)
        finally:
            frame.busy = False
        message = f"Symbolic dimension comparison '{a}' == '{b}' is inconclusive."
        if not isinstance(b, DimExpr) or user:
            # Split where it narrows: below/at-or-above 0, then at/above 0.
            raise SplitNeeded(message, -diff if lo >= 0 else diff)
        return res

    return eq


class _QuietCallbackErrors(logging.Filter):
    """Drop JAX's "callback failed" log record for one exception type.

    The error still propagates (as ``JaxRuntimeError`` with its message); the
    log record only duplicated it as a long traceback on stderr.
    """

    def __init__(self, exc_type: type):
        super().__init__()
        self.exc_type = exc_type

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, self.exc_type)


_QUIETED: set = set()


def quiet_callback_errors(exc_type: type) -> None:
    """Silence JAX's log of host-callback failures raised as ``exc_type`` (once)."""
    if exc_type in _QUIETED:
        return
    _QUIETED.add(exc_type)
    for name in ("jax._src.debugging", "jax._src.callback"):
        logging.getLogger(name).addFilter(_QuietCallbackErrors(exc_type))
