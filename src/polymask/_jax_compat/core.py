"""Symbolic shapes, jaxprs, source info and JAX's rule tables (part of ``_jax_compat``)."""

from __future__ import annotations

import itertools
import os
import re
import threading
import weakref
from typing import Any

import jax
import numpy as np
from jax._src import ad_util as _ad_util
from jax._src import array as _array
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import source_info_util as _source_info_util
from jax._src.export import shape_poly as _shape_poly
from jax._src.export import shape_poly_decision as _decision
from jax._src.interpreters import ad as _ad_internal
from jax._src.interpreters import batching as _batching_internal
from jax._src.interpreters import partial_eval as _pe_internal
from jax.extend import core as _xcore
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching

DimExpr = _shape_poly._DimExpr
SymbolicScope = _shape_poly.SymbolicScope
# The public jax.extend.core names (jax 0.10.2 .. 0.12). From jax 0.11 a
# ClosedJaxpr is a Jaxpr with its constants attached (jax.extend.core.ClosedJaxpr
# is an alias of Jaxpr), and 0.12 removed jax._src.core.ClosedJaxpr.
InconclusiveDimensionOperation = _xcore.InconclusiveDimensionOperation
Literal = _xcore.Literal
Var = _xcore.Var
DropVar = _xcore.DropVar
ClosedJaxpr = _xcore.ClosedJaxpr
Jaxpr = _xcore.Jaxpr
ShapedArray = _core.ShapedArray
Primitive = _xcore.Primitive
# The concrete jax.Array class (exact type checks on the runners' fast path).
ArrayImpl = _array.ArrayImpl
dim_as_value_p = _shape_poly.dim_as_value_p


def min_dim(a, b):
    """``min`` of two sizes (ints or dimension expressions), symbolic where
    JAX cannot decide it (``min(3, n)``)."""
    return _core.min_dim(a, b)


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
    # NumPy values: an expression of a case that these sizes do not reach may
    # divide by a size of 0 (jnp.resize's ceil(k / n) at n = 0); its value is unused
    with np.errstate(divide="ignore"):
        return _SharedEvaluation(env).expr(e)


class _SharedEvaluation:
    """JAX's ``_DimExpr._evaluate``, each distinct ``min`` / ``max`` /
    ``floordiv`` / ``mod`` factor evaluated once. JAX's walks the expression as
    a tree: a size built by chained slices of concatenations
    (``jnp.concatenate([v[1:], a])[2:]`` three times) repeats its inner
    ``min``s exponentially often, and each repeat staged its ops again (and
    raised and caught an error per traced sum, from ``operator.index``)."""

    def __init__(self, env: dict[str, Any], vector: bool = False):
        self.env = env
        self.factors: dict = {}
        # vector: env's values are NumPy object arrays of Python ints (values_over)
        self.vector = vector
        self.constant = int if vector else _core.dim_constant

    def expr(self, e):
        terms = [_times(self.term(t, e.scope), self.constant(k))
                 for t, k in e._sorted_terms]
        out = terms[0]
        for v in terms[1:]:
            out = _plus(out, v)
        return out

    def term(self, t, scope):
        out = None
        for f, exp in t._factors:
            v = self.factor(f, scope)
            for _ in range(exp):
                out = v if out is None else _times(out, v)
        return self.constant(1) if out is None else out

    def factor(self, f, scope):
        if f.var is not None:
            return f.evaluate(self.env, scope)  # (JAX's, with its normalization of vars)
        hit = self.factors.get(f, _MISSING)
        if hit is _MISSING:
            hit = self.factors[f] = self._operation(f)
        return hit

    def _operation(self, f):
        from jax import lax

        a, b = (self.expr(o) for o in f.operands)
        op = f.operation
        if op == _shape_poly._DimFactor.FLOORDIV:
            return a // b if self.vector else divmod(a, b)[0]
        if op == _shape_poly._DimFactor.MOD:
            return a % b if self.vector else divmod(a, b)[1]
        is_max = op == _shape_poly._DimFactor.MAX
        if self.vector:
            return np.maximum(a, b) if is_max else np.minimum(a, b)
        if _static_int(a) is not None and _static_int(b) is not None:
            return max(a, b) if is_max else min(a, b)
        if _core.is_symbolic_dim(a) or _core.is_symbolic_dim(b):
            return _core.max_dim(a, b) if is_max else _core.min_dim(a, b)
        return lax.max(a, b) if is_max else lax.min(a, b)


_MISSING = object()


def _static_int(v):
    """``v`` as an int where it is one (not a tracer or a symbolic size)."""
    return int(v) if isinstance(v, (int, np.integer)) else None


def _plus(a, b):
    return b if _static_int(a) == 0 else a if _static_int(b) == 0 else a + b


def _times(a, b):
    return b if _static_int(a) == 1 else a if _static_int(b) == 1 else a * b


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
    """Best upper bound of ``e`` (may be inf): JAX's decision procedure's, or
    for a size with ``floordiv`` / ``mod`` terms its largest value over its
    dim vars' values (``_bounds_by_values``)."""
    if not is_dim_expr(e):
        return e
    return _bounds(e)[1]


def lower_bound(e) -> float:
    if not is_dim_expr(e):
        return e
    return _bounds(e)[0]


_VALUES_LIMIT = 4096  # value combinations of a size's dim vars enumerated at most
DIVIDED_SIZE = re.compile(r"\b(floordiv|mod)\(")  # a size's text with a division
_EXTREMA = re.compile(r"\b(min|max)\(")
_EXTREMA_DECIDED_BY_JAX = 3  # min / max terms of a size JAX's procedure bounds quickly
_PRODUCT_OF_SIZES = re.compile(r"[A-Za-z_]\w*(\*[A-Za-z_]|\^)")  # n*m, n^2


def costly_to_decide(text: str, scope: SymbolicScope | None = None) -> bool:
    """Whether JAX's decision procedure takes long on a size of this text (in
    ``scope``), where the values of its dim vars decide it in milliseconds:
    one with a division (nested ``floordiv``s: seconds each), with many
    ``min`` / ``max`` terms, whose bounds it takes apart term by term (chained
    slices of a concatenation, ``jnp.concatenate([v[1:], a])[2:]`` three
    times: ~20 nested ``min``s, minutes), with one beside a product of sizes
    (``min(k*m*n - ..., 1)`` under a case's conditions: seconds each), or
    with one in a scope whose constraints (a case's conditions) have more:
    JAX bounds each term against each of them, ~8x as long per condition
    with ``min``s (a slice by ``min(a.shape[0], b.shape[0])`` of a
    concatenation under three conditions: 105 s per bound)."""
    extrema = len(_EXTREMA.findall(text))
    if extrema and scope is not None:
        extrema += _scope_extrema(scope)
    return bool(DIVIDED_SIZE.search(text)) or extrema > _EXTREMA_DECIDED_BY_JAX or (
        extrema > 0 and bool(_PRODUCT_OF_SIZES.search(text)))


def _scope_extrema(scope: SymbolicScope) -> int:
    """The ``min`` / ``max`` terms of the scope's constraints."""
    hit = _SCOPE_EXTREMA.get(scope)
    if hit is None:
        hit = _SCOPE_EXTREMA[scope] = sum(
            len(_EXTREMA.findall(str(getattr(c, "diff", ""))))
            for c in getattr(scope, "_explicit_constraints", None) or ())
    return hit


_SCOPE_EXTREMA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _bounds(e) -> tuple:
    by_values = _bounds_by_values(e) if costly_to_decide(str(e), e.scope) else None
    if by_values is not None:
        return by_values
    return _decision.bounds_decision(e, _shape_poly.BoundsPrecision.BEST)


def _bounds_by_values(e) -> tuple[int, int] | None:
    """``(min, max)`` of ``e`` over the values of its dim vars (each in the
    interval JAX proves for it alone, which is cheap) that the scope's
    constraints over them allow; None where they are too many. JAX's bounds
    of nested ``floordiv``s take seconds each (jax-cfd's spectral slices
    ``u[k // 2:(-k + 1) // 2]`` of ``k = n + 2 * (n // 2)``: 25 s to trace);
    these are exact where JAX's are an over-approximation."""
    scope = e.scope
    cache = _VALUE_BOUNDS.setdefault(scope, {})
    if e in cache:
        return cache[e]
    own = dim_vars(e)
    ranges = {}
    for v in sorted(_linked_vars(own, _constraints_over(scope, None))):
        var = jax.export.symbolic_shape(v, scope=scope)[0]
        lo, hi = _decision.bounds_decision(var, _shape_poly.BoundsPrecision.BEST)
        if np.isfinite(lo) and np.isfinite(hi):
            ranges[v] = (int(lo), int(hi))
        elif v in own:
            cache[e] = None
            return None
    values = values_over(e, ranges, scope)
    cache[e] = res = None if values is None else (min(values), max(values))
    return res


_VALUE_BOUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scope -> {e: bounds}


def bounds_by_values(e) -> tuple[int, int] | None:
    """``(min, max)`` of a size over its dim vars' values (each var's range its
    own bound in the scope, the scope's constraints over them applied): exact
    where JAX's procedure gives no finite bound (a count times a shifted size,
    ``_u1*m__p1 - _u1``); None where the values are too many or unbounded."""
    return _bounds_by_values(e) if is_dim_expr(e) else (int(e), int(e))


def values_over(e, ranges: dict, scope) -> frozenset | None:
    """The values of ``e`` at every combination of its dim vars' values in
    ``ranges`` (var -> (lowest, highest)) that the scope's constraints allow,
    None where the combinations are more than ``_VALUES_LIMIT``, none is
    allowed, or ``e`` cannot be evaluated at one (a divisor of 0).

    The vars of ``ranges`` that constraints link to ``e``'s are enumerated
    too, where their combinations are few enough, so those constraints apply
    (a case's ``n - m - k + min(m + k, 2) <= -1`` decides a size over ``m``
    and ``k`` alone: without ``n`` the values were a superset, which JAX's
    procedure had to decide, and at some hash seeds could not); else only
    constraints over ``e``'s vars apply (a superset of the values)."""
    return _values_over(e, ranges, scope)[0]


def exact_values_over(e, ranges: dict, scope) -> frozenset | None:
    """``values_over`` where every constraint of the scope on those dim vars
    applied (no constraint on a var outside ``ranges``, a count, was left
    out, and each could be evaluated): the values of ``e`` in the scope,
    exactly. A comparison they do not decide, JAX's procedure cannot either."""
    values, exact = _values_over(e, ranges, scope)
    return values if exact else None


def _values_over(e, ranges: dict, scope) -> tuple[frozenset | None, bool]:
    """``(values_over, whether those values are exact)``."""
    own = dim_vars(e)
    constraints = _constraints_over(scope, set(ranges))
    linked = _linked_vars(own, constraints) & set(ranges)
    names = sorted(linked)
    if _combinations(names, ranges) > _VALUES_LIMIT:
        names = sorted(own)
    if _combinations(names, ranges) > _VALUES_LIMIT:
        return None, False
    # exact: no constraint on these vars was left out (one on a var of no range)
    exact = all(dim_vars(c.diff) <= set(names)
                for c in _constraints_over(scope, None) if dim_vars(c.diff) & set(names))
    env, allowed, evaluated = _allowed_combinations(names, ranges, constraints)
    if not allowed.any():
        return None, False
    try:
        values = _SharedEvaluation({v: col[allowed] for v, col in env.items()},
                                   vector=True).expr(e)
    except Exception:  # a divisor of 0 at an allowed combination
        return None, False
    out = frozenset(int(x) for x in np.broadcast_to(values, (int(allowed.sum()),)))
    if any(abs(x) > _INT64_MAX for x in out):  # (no size is)
        return None, False
    return out, exact and evaluated


def _allowed_combinations(names: list[str], ranges: dict, constraints):
    """``(env, allowed, evaluated)``: every combination of the values of
    ``names`` in ``ranges`` as NumPy object columns of Python ints (exact: JAX's
    NumPy constants would wrap past int64, ``n ** 2 * 1000003`` "fitting"
    int32 at n = 47), where the ``constraints`` over those names hold, and
    whether each of them could be evaluated (one that cannot holds
    everywhere: a superset)."""
    combos = list(itertools.product(*(range(ranges[v][0], ranges[v][1] + 1) for v in names)))
    env = {v: np.array(col, dtype=object) for v, col in zip(names, zip(*combos))}
    allowed, evaluated = np.ones(len(combos), bool), True
    for c in constraints:
        if dim_vars(c.diff) <= set(names):
            held = _holds(c, env)
            evaluated &= held is not True
            allowed &= held
    return env, allowed, evaluated


def _combinations(names, ranges: dict) -> int:
    total = 1
    for v in names:
        total *= max(ranges[v][1] - ranges[v][0] + 1, 0)
    return total


def _linked_vars(names, constraints) -> set[str]:
    """``names`` and the dim vars that constraints link to them, transitively."""
    out, grew = set(names), True
    while grew:
        grew = False
        for c in constraints:
            vs = dim_vars(c.diff)
            if vs & out and not vs <= out:
                out |= vs
                grew = True
    return out


_INT64_MAX = 2 ** 63 - 1


def _constraints_over(scope, names: set | None) -> list:
    """The scope's constraints (a case's conditions, the user's, the bounds)
    whose dim vars are all among ``names`` (None: all of them)."""
    out = []
    for c in getattr(scope, "_explicit_constraints", None) or ():
        diff = getattr(c, "diff", None)
        if is_dim_expr(diff) and (names is None or dim_vars(diff) <= names):
            out.append(c)
    return out


def _holds(constraint, env: dict) -> np.ndarray | bool:
    """Where a scope constraint holds at these values (``values_over``'s
    columns); True where it cannot be evaluated: the values stay a superset."""
    try:
        v = _SharedEvaluation(env, vector=True).expr(constraint.diff)
    except Exception:
        return True
    held = v == 0 if constraint.cmp == _shape_poly.Comparator.EQ else v >= 0
    return np.asarray(held, dtype=bool)


def allows_no_values(scope, ranges: dict) -> bool:
    """Whether the scope's constraints over the dim vars of ``ranges`` (var ->
    (lowest, highest)) hold at no combination of their values: a case of a
    split whose conditions contradict each other where JAX's procedure cannot
    tell (``m*n - m <= -1`` beside ``n >= 1``, ``m >= 1``). Its trace answers
    every comparison by JAX's procedure (``values_over`` has no value to
    give), which took minutes on such a case. Decided per group of vars the
    constraints link; a group of more than ``_VALUES_LIMIT`` combinations
    counts as allowed (False: not known)."""
    constraints = _constraints_over(scope, set(ranges))
    for names in _linked_groups(constraints):
        if _combinations(names, ranges) > _VALUES_LIMIT:
            continue
        if not _allowed_combinations(names, ranges, constraints)[1].any():
            return True
    return False


def _linked_groups(constraints) -> list[list[str]]:
    """The dim vars of ``constraints`` in groups that some constraint links
    (sorted names): each group's combinations are counted on their own."""
    groups: list[set[str]] = []
    for c in constraints:
        if not any(dim_vars(c.diff) <= g for g in groups):
            groups.append(_linked_vars(dim_vars(c.diff), constraints))
    return [sorted(g) for g in groups]


# The names of the dim vars of data-dependent sizes (``_u1``, ``_u2``, ...).
FRESH_DIM_PREFIX = "_u"


def fresh_dim(name: str, scope: SymbolicScope):
    """The dimension variable ``name`` of ``scope``, new or not (a data-dependent
    size's is named ``FRESH_DIM_PREFIX`` + a number)."""
    return jax.export.symbolic_shape(name, scope=scope)[0]


_FRESH_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scope -> vars made
_FRESH_LOCK = threading.Lock()


_OWN_BOUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scope -> {var: bound}


def note_fresh_bound(scope: SymbolicScope, name: str, bound: int) -> None:
    """The bound a data-dependent size has by its op (``max_size=``, the
    operand's size), before a case's conditions narrow it (``_u1 <= 2``)."""
    _OWN_BOUNDS.setdefault(scope, {})[name] = int(bound)


def own_bound(scope: SymbolicScope, name: str, default: int) -> int:
    """``note_fresh_bound``'s bound of ``name`` (``default`` where none was noted)."""
    return _OWN_BOUNDS.get(scope, {}).get(name, default)


def new_fresh_dim(scope: SymbolicScope):
    """``(name, dim)``: a new data-dependent size's dim var in ``scope``, named
    ``_u1``, ``_u2``, ... in the order the trace creates them. A trace repeated
    under a condition on a count (``_u1 - 2 >= 0``, a case of
    ``tracing/cases/splitting.py``) thus names its counts as the first trace
    did, and the condition, in the new scope from the start, applies to them.
    (One scope per trace: the counts are kept per scope, not on JAX's object.)"""
    with _FRESH_LOCK:
        n = _FRESH_COUNTS.get(scope, 0) + 1
        _FRESH_COUNTS[scope] = n
    name = f"{FRESH_DIM_PREFIX}{n}"
    return name, fresh_dim(name, scope)


# The two sides of a split on whether a count is 0 (``_u1 - 1`` >= 0 or <= -1):
# JAX assumes every dim var >= 1, so the side of 0 is no constraint but the
# count made the constant 0 (``ops._fresh``), as in plain JAX's trace of an
# empty selection
_EMPTY_COUNT = re.compile(rf"^({FRESH_DIM_PREFIX}\d+) - 1 <= -1$")
_NONEMPTY_COUNT = re.compile(rf"^({FRESH_DIM_PREFIX}\d+) - 1 >= 0$")
_COUNT_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scope -> (0, >= 1)


def count_emptiness_conditions(conditions) -> tuple[list[str], set[str], set[str]]:
    """``(conditions for the scope, counts that are 0, counts that are >= 1)``."""
    rest, empty, nonempty = [], set(), set()
    for c in conditions:
        if m := _EMPTY_COUNT.match(c):
            empty.add(m.group(1))
        else:
            if m := _NONEMPTY_COUNT.match(c):
                nonempty.add(m.group(1))
            rest.append(c)
    return rest, empty, nonempty


def set_count_emptiness(scope: SymbolicScope, empty: set[str], nonempty: set[str]) -> None:
    _COUNT_FACTS[scope] = (frozenset(empty), frozenset(nonempty))


class EmptyCount(int):
    """The size 0 of the count ``name`` in the case of a split where it is 0:
    a constant to JAX (its trace is plain JAX's at 0), named for the rule that
    computes the count, which checks the case's conditions on it and binds
    its value (``rules/data_dependent._bind_fresh``)."""

    def __new__(cls, name: str):
        obj = super().__new__(cls, 0)
        obj.count_name = name
        return obj


def count_is_empty(scope: SymbolicScope, name: str) -> bool:
    """Whether this trace is the case where the count ``name`` is 0."""
    return name in _COUNT_FACTS.get(scope, ((), ()))[0]


def count_is_nonempty(scope: SymbolicScope, name: str) -> bool:
    """Whether this trace is the case where the count ``name`` is >= 1."""
    return name in _COUNT_FACTS.get(scope, ((), ()))[1]


def names_a_count(e) -> bool:
    """Whether the dimension expression ``e`` has a data-dependent size's dim var."""
    return is_dim_expr(e) and any(is_fresh_dim_name(v) for v in dim_vars(e))


def is_fresh_dim_name(name: str) -> bool:
    """Whether a dim var is a data-dependent size's (``fresh_dim``): the prefix
    and a number only, so a spec's ``_units`` (internally ``_units__p1``) is not."""
    return name.startswith(FRESH_DIM_PREFIX) and name[len(FRESH_DIM_PREFIX):].isdigit()


_POLYMASK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


UNKNOWN_LOCATION = "<unknown location>"


def source_line(source_info) -> str:
    """``file:line (function)`` of the user frame of an equation's source info.

    The innermost frame outside JAX (JAX's own filter) and outside polymask:
    polymask's ops bind primitives while the user's function is traced, and
    their equations should report the user's call.
    """
    try:
        frames = _source_info_util.user_frames(source_info.traceback)
        frame = next((f for f in frames
                      if not os.path.abspath(f.file_name).startswith(_POLYMASK_DIR)), None)
    except Exception:  # pragma: no cover - defensive
        frame = None
    if frame is None:
        return UNKNOWN_LOCATION
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def line_outside_packages(source_info) -> str | None:
    """``file:line (function)`` of the innermost frame of an equation's
    traceback that is the user's own code: outside installed packages
    (``site-packages``), JAX and polymask; None when there is none (an
    equation of a library's jitted function: its traceback stops at the jit)."""
    try:
        frames = _source_info_util.user_frames(source_info.traceback)
        frame = next((f for f in frames if not in_installed_package(f.file_name) and
                      not os.path.abspath(f.file_name).startswith(_POLYMASK_DIR)), None)
    except Exception:  # pragma: no cover - defensive
        return None
    return None if frame is None else f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def source_line_with_caller(source_info) -> str:
    """``source_line``, with ``, called from <the user's own line>`` when that
    line is inside an installed library (``line_outside_packages``)."""
    line = source_line(source_info)
    if not in_installed_package(line):
        return line
    caller = line_outside_packages(source_info)
    return line if caller is None else f"{line}, called from {caller}"


def in_installed_package(location: str) -> bool:
    """Whether a file, or a ``file:line (function)`` location, is inside an
    installed package (a ``site-packages`` or ``dist-packages`` folder)."""
    parts = location.replace("\\", "/").split("/")
    return "site-packages" in parts or "dist-packages" in parts


def is_jaxpr_literal(v) -> bool:
    return isinstance(v, Literal)


def literal_value(v):
    return v.val


def user_context(source_info):
    """Context manager: ops bound inside carry the equation's user traceback."""
    return _source_info_util.user_context(source_info.traceback)


def name_scopes(source_info) -> tuple[str, ...]:
    """The ``jax.named_scope`` names on an equation's name stack, outermost first.

    Transforms (``jvp(...)``, ``transpose(...)``) are left out. Inner jaxprs
    (jit, scan bodies) are traced under a fresh name stack, so their
    equations carry only the scopes entered inside that trace.
    """
    return tuple(s.name for s in source_info.name_stack.stack
                 if isinstance(s, _source_info_util.Scope))


def is_tracer(x) -> bool:
    return isinstance(x, _core.Tracer)


def tracer_iteration_home():
    """``(class, name)`` of ``iter(tracer)`` (``for v in x``, ``sum(x)``): JAX
    unstacks the first axis into a Python tuple of that many values."""
    return _core.Tracer, "__iter__"


_auto_insert_reshard = getattr(_core, "auto_insert_reshard", None)


def with_matching_varying_axes(args):
    """``args`` with every array cast to the union of their ``shard_map``
    varying manual axes (``pvary``), as ``jax.lax``'s n-ary functions cast
    them before binding (``core.auto_insert_reshard``); ``args`` unchanged
    outside ``shard_map`` or where JAX has no such typing."""
    if _auto_insert_reshard is None or not any(map(_varying, args)):
        return args
    return _auto_insert_reshard(*args)


def _varying(x) -> frozenset:
    aval = getattr(x, "aval", None)
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def context_mesh():
    """The mesh of the tracing context (``jax.set_mesh``, a ``shard_map``'s):
    its axis types type the values a trace makes, so traces made under one are
    not reused under another (hashable)."""
    return jax.sharding.get_abstract_mesh()


def varying_axes(tree) -> frozenset:
    """The union of the ``shard_map`` varying manual axes of ``tree``'s arrays
    (empty outside ``shard_map``)."""
    return frozenset().union(*map(_varying, jax.tree_util.tree_leaves(tree)))


def as_varying(tree, axes: frozenset):
    """``tree`` with each array varying over ``axes`` too (``pvary``): the
    branches of a ``lax.switch`` inside ``shard_map`` must return one type,
    and a branch that returns constants varies over none."""
    if not axes:
        return tree

    def cast(x):
        missing = tuple(sorted(axes - _varying(x)))
        return _core.pvary(x, missing) if missing else x

    return jax.tree_util.tree_map(cast, tree)


def is_weakly_typed(x) -> bool:
    """Whether ``x`` is weakly typed (a Python scalar, or an array or tracer made
    from one): its dtype yields to the other operand's in type promotion."""
    return bool(_dtypes.is_weakly_typed(x))


def as_weakly_typed(x, weak_type: bool = True):
    """``x`` (an array or tracer) as a weakly typed value of the same dtype
    (strongly typed with ``weak_type=False``): how a stacked batch of Python
    scalars reaches each row as the scalar did."""
    from jax._src.lax import lax as _lax

    return _lax._convert_element_type(x, x.dtype, weak_type=weak_type)


def current_trace():
    """The trace JAX binds primitives to now (an object identifying the trace
    being built), or None where the private API moved."""
    try:
        return _core.trace_ctx.trace
    except AttributeError:  # pragma: no cover - private API moved
        return None


def is_jax_value(x) -> bool:
    """Whether a function traced by ``jax.jit`` may return ``x`` (an array, a
    tracer, a number; not a ``str`` or an arbitrary object)."""
    return isinstance(x, _core.Tracer) or _core.valid_jaxtype(x)


def under_transformation() -> bool:
    """Whether JAX is tracing now (inside ``jit``, ``grad``, ``vmap``,
    ``eval_shape`` of an outer function): what runs now is recorded into that
    trace, not computed, and closed-over values may be its tracers."""
    try:
        return not isinstance(_core.trace_ctx.trace, _core.EvalTrace)
    except AttributeError:  # pragma: no cover - private API moved
        return False


def under_staging() -> bool:
    """Whether an enclosing trace stages out a program (``jit``, ``scan``,
    ``eval_shape``; also beneath ``grad`` or ``vmap``): Python values there
    are constants of the compiled program, one program per value. Eager
    ``grad`` or ``vmap`` alone compiles nothing per value."""
    try:
        t = _core.trace_ctx.trace
        for _ in range(256):  # (the chain of enclosing traces, innermost first)
            if t is None or isinstance(t, _core.EvalTrace):
                return False
            if isinstance(t, _pe_internal.DynamicJaxprTrace):
                return True
            t = getattr(t, "parent_trace", None)
        return True  # pragma: no cover
    except AttributeError:  # pragma: no cover - private API moved
        return under_transformation()


def instantiate_zero(x, aval=None):
    """Turn JAX's symbolic ``Zero`` cotangent into an array (else return ``x``)."""
    import jax.numpy as _jnp
    from jax._src.interpreters import ad as _ad

    if isinstance(x, _ad.Zero):
        a = x.aval
        return _jnp.zeros(a.shape, a.dtype)
    return x


# Rules of polymask's own primitives (``rules/data_dependent.py``), written to
# the tables JAX's own primitives use (``jax.interpreters.ad`` / ``batching``).
def def_jvp(prim: Primitive, jvp) -> None:
    """``jvp(primals, tangents, **params) -> (primal_out, tangent_out)``."""
    _ad.primitive_jvps[prim] = jvp


def jvp_rule(prim: Primitive):
    """``prim``'s own JVP rule, ``rule(primals, tangents, **params) ->
    (primal_out, tangent_out)`` with ``zero_tangent`` for zero tangents; None
    where it has none."""
    return _ad.primitive_jvps.get(prim)


def zero_tangent(aval) -> Any:
    """JAX's symbolic zero tangent for a value of ``aval`` (what a primitive's
    JVP rule receives for an operand that is not differentiated)."""
    return _ad.Zero(aval.to_tangent_aval())


def is_zero_tangent(t) -> bool:
    """Whether ``t`` is JAX's symbolic zero tangent (or cotangent), as a JVP or
    transpose rule may return for an output or operand it does not touch."""
    return isinstance(t, _ad.Zero)


def transpose_rule(prim: Primitive):
    """``prim``'s own transpose rule, ``rule(cts, *operands, **params) ->
    cotangent per operand`` (``undefined_primal`` marks the linear operands;
    None or a symbolic zero: no cotangent); None where it has none."""
    return _ad.primitive_transposes.get(prim)


def undefined_primal(aval) -> Any:
    """A linear operand of a transpose rule: known by its ``aval`` only."""
    return _ad.UndefinedPrimal(aval)


def def_transpose(prim: Primitive, transpose) -> None:
    """``transpose(ct, *operands, **params) -> cotangent per operand (None: none)``."""
    _ad.primitive_transposes[prim] = transpose


def def_linear(prim: Primitive, transpose) -> None:
    """A linear primitive (``ad.deflinear2``): ``transpose(ct, out, *operands, **params)``."""
    _ad.deflinear2(prim, transpose)


def def_batching(prim: Primitive, batcher) -> None:
    """``batcher(args, dims, **params) -> (out, out_dim)``."""
    _batching.primitive_batchers[prim] = batcher


def is_symbolic_zero(x) -> bool:
    """True for JAX's symbolic ``Zero`` tangent / cotangent."""
    return type(x) is _ad.Zero


def symbolic_zero_like(primal):
    """The symbolic ``Zero`` tangent of ``primal`` (a value with no derivative).

    (``Zero.from_primal_value`` of older JAX is gone in 0.10; ``p2tz`` replaces it.)
    """
    return _ad_util.p2tz(primal)


def call_wrapped(wrapped_fun, *args):
    """Call a ``linear_util.WrappedFun`` (custom-derivative thunks)."""
    return wrapped_fun.call_wrapped(*args)


_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))


def defined_in_jax_nn(wrapped_fun) -> bool:
    """Whether a ``WrappedFun``'s function (a custom rule's thunk) is one of
    ``jax.nn``'s (``jax.nn.softmax``'s JVP: elementwise rules that compare no
    sizes), by the source its debug info names. (Not JAX's other rules:
    ``jnp.linalg.det``'s JVP compares a batch size.)"""
    info = getattr(getattr(wrapped_fun, "debug_info", None), "func_src_info", None) or ""
    return os.path.join(_JAX_DIR, "_src", "nn", "") in info


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


def has_python_impl(prim) -> bool:
    """Whether ``prim``'s eager implementation is a Python function of other
    JAX operations (equinox's ``filter_primitive``: lineax's ``linear_solve``),
    not XLA's ``apply_primitive`` of the primitive itself."""
    impl = getattr(prim, "impl", None)
    if impl is None:
        return False
    func = getattr(impl, "func", impl)
    return not (getattr(func, "__name__", "") == "apply_primitive"
                or getattr(func, "__module__", "").startswith("jax._src"))


def is_batched(x) -> bool:
    """Whether ``x`` is a tracer of a ``jax.vmap`` (at any level of nesting)."""
    seen = 0
    while isinstance(x, _core.Tracer) and seen < 64:
        if isinstance(x, _batching_internal.BatchTracer):
            return True
        x = getattr(x, "primal", None) if hasattr(x, "primal") else getattr(x, "val", None)
        seen += 1
    return False


def eager_transforms(x) -> frozenset[str] | None:
    """The transformations an eager call's value is traced by: ``frozenset()``
    for a concrete value; ``{"batch"}``, ``{"jvp"}`` or both for tracers of
    ``jax.vmap`` and of ``jax.jvp`` / ``jax.grad``'s linearization whose base
    is evaluation (nested in any order); None under anything else
    (``jax.jit``, ``make_jaxpr``, a custom rule's trace)."""
    if not isinstance(x, _core.Tracer):
        return frozenset()
    kinds = set()
    trace = getattr(x, "_trace", None)
    for _ in range(64):
        if isinstance(trace, _core.EvalTrace):
            return frozenset(kinds)
        if isinstance(trace, _batching_internal.BatchTrace):
            kinds.add("batch")
        elif isinstance(trace, _AD_TRACES):
            kinds.add("jvp")
        else:
            return None
        trace = getattr(trace, "parent_trace", None)
    return None


# jax.jvp's trace, and jax.grad's linearization (direct linearize, 0.10.2+)
_AD_TRACES = tuple(t for t in (getattr(_ad_internal, "JVPTrace", None),
                               getattr(_ad_internal, "LinearizeTrace", None)) if t is not None)


def is_linearized(x) -> bool:
    """Whether ``x`` is an unknown value of ``jax.linearize``'s partial
    evaluation (``jax.grad``'s tangents, at any level of ``vmap`` nesting): what
    is computed from it must be transposed for the backward pass."""
    seen = 0
    while isinstance(x, _core.Tracer) and seen < 64:
        if isinstance(x, _pe_internal.JaxprTracer):
            return not x.pval.is_known()
        x = getattr(x, "primal", None) if hasattr(x, "primal") else getattr(x, "val", None)
        seen += 1
    return False


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


def threefry2x32(k1, k2, counts_hi, counts_lo):
    """JAX's ``threefry2x32`` primitive: two uint32 bit arrays from a key's two
    words and a 64-bit counter split in two uint32 arrays (``jax/_src/random/
    threefry2x32.py``; how ``random_bits`` makes bits under the partitionable
    scheme)."""
    from jax._src.random import threefry2x32 as _threefry

    return _threefry.threefry2x32_p.bind(k1, k2, counts_hi, counts_lo)


def linear_call(fun, fun_transpose, residual_args, linear_args):
    """``jax.custom_derivatives.linear_call`` (a linear function with its own
    transpose), batchable: JAX has no batching rule for it (through jax 0.12),
    so one is registered on first use where none is. ``jax.vmap`` of
    ``jax.grad`` then batches it: operands moved or broadcast to axis 0, the
    function and, when transposed, its transpose batched alike."""
    from jax._src import custom_derivatives as _cd

    prim = _cd.linear_call_p
    if prim not in _batching_internal.fancy_primitive_batchers:
        _batching_internal.fancy_primitive_batchers[prim] = _batch_linear_call
    return _cd.linear_call(fun, fun_transpose, residual_args, linear_args)


def _batch_linear_call(axis_data, args, dims, *, callee, transpose_thunk,
                       num_callee_consts, num_res):
    """Batching rule of ``linear_call``: the linear operands and the outputs are
    batched at axis 0 (a linear operand not batched is broadcast), the consts
    and residuals where they are; the transpose (traced lazily, as JAX does)
    takes the residuals as batched as here and batched cotangents."""
    from jax._src import custom_derivatives as _cd

    bi = _batching_internal
    n_fixed = num_callee_consts + num_res
    mesh_axis = getattr(axis_data, "explicit_mesh_axis", None)
    ops, batched = [], []
    for k, (x, d) in enumerate(zip(args, dims)):
        if k >= n_fixed or d is not None:
            ops.append(bi.bdim_at_front(x, d, axis_data.size, mesh_axis))
            batched.append(True)
        else:
            ops.append(x)
            batched.append(False)
    callee_b, _ = bi.batch_jaxpr(callee, axis_data, batched, True)
    res_batched = batched[num_callee_consts:n_fixed]
    n_out = len(callee.out_avals)

    @_pe_internal._memoize
    def transpose_b():
        transpose, t_consts = transpose_thunk()
        in_batched = [False] * len(t_consts) + res_batched + [True] * n_out
        return bi.batch_jaxpr(transpose, axis_data, in_batched, True)[0], t_consts

    outs = _cd.linear_call_p.bind(*ops, callee=callee_b, transpose_thunk=transpose_b,
                                  num_callee_consts=num_callee_consts, num_res=num_res)
    return outs, [0] * len(outs)
