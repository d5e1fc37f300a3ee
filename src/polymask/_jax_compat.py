"""Every use of private JAX API lives here (tested range: jax 0.10.x).

polymask needs a few internals of ``jax.export``'s symbolic shapes (dimension
expressions, their scope and bounds) and of the jaxpr machinery (source info,
``dim_as_value``). Keeping them in one module means a JAX upgrade touches one
file; ``tests/test_jax_compat.py`` covers each function here.
"""

from __future__ import annotations

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


def exclude_from_user_frames(path: str) -> None:
    """Equations traced from ``path`` report their caller's line as the user's line.

    ``polymask.ops`` binds its primitives while the user's function is traced;
    with this the source line of those equations (shown by ``explain`` and in
    rule errors) is the user's call, not ``ops.py``.
    """
    _source_info_util.register_exclusion(path)


_EQ_STATE = __import__("threading").local()
_EQ_PATCHED = False


def _install_equality_hook() -> None:
    """Wrap ``DimExpr.__eq__``/``__ne__`` once; inactive unless a recorder is open."""
    global _EQ_PATCHED
    if _EQ_PATCHED:
        return
    import sys

    orig_eq = DimExpr.__eq__

    def record(a, b):
        recorders = getattr(_EQ_STATE, "stack", None)
        if not recorders:
            return
        try:
            diff = a - b
        except Exception:
            return
        if is_dim_expr(diff):  # neither provably equal nor provably different
            rec = recorders[-1]
            f = sys._getframe(2)
            if rec._is_user_frame(f.f_code.co_filename):
                rec.records.append((a, b, f"{f.f_code.co_filename}:{f.f_lineno} "
                                          f"({f.f_code.co_name})"))

    def eq(a, b):
        res = orig_eq(a, b)
        if res is False and getattr(_EQ_STATE, "stack", None):
            record(a, b)
        return res

    def ne(a, b):
        res = orig_eq(a, b)
        if res is False and getattr(_EQ_STATE, "stack", None):
            record(a, b)
        return not res

    DimExpr.__eq__, DimExpr.__ne__ = eq, ne
    _EQ_PATCHED = True


class record_unsound_equalities:
    """Context manager: record symbolic ``==``/``!=`` that JAX decided unsoundly.

    JAX answers ``n == 1`` with False (and ``n != 1`` with True) when the
    difference is not a constant, because ``__eq__`` cannot raise
    (https://docs.jax.dev/en/latest/export/shape_poly.html#comparison-of-symbolic-dimensions-is-partially-supported).
    A user's ``if x.shape[0] == 1:`` would then silently trace the wrong
    branch for ``n == 1``. While active (per thread), each such comparison made
    from a frame for which ``is_user_frame(filename)`` holds is appended to
    ``self.records`` as ``(lhs, rhs, "file:line (function)")``; the prologue
    then checks at run time that the two sides differ.
    """

    def __init__(self, is_user_frame):
        self.records: list = []
        self._is_user_frame = is_user_frame

    def __enter__(self):
        _install_equality_hook()
        if not hasattr(_EQ_STATE, "stack"):
            _EQ_STATE.stack = []
        _EQ_STATE.stack.append(self)
        return self

    def __exit__(self, *exc):
        _EQ_STATE.stack.pop()
        return False
