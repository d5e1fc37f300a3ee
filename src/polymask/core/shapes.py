"""Evaluating and bounding dimension expressions: the dim-var environment.

Each dimension variable is bound to ``(bound: int, logical: int | int32 array)``.
An expression's *padded* size is its upper bound given ``0 <= var <= bound``
(JAX's own decision procedure, so ``floordiv``/``mod``/``max``/``min`` are
handled without assuming monotonicity); its *logical* size is the expression
evaluated at the logical values, clamped at 0. Logical evaluations are cached
per distinct expression, so each size computation is emitted once per masked
program however often user code queries it (CSE of shape queries, as in
Thunder's ``prims.shape`` discussion).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from .errors import ShapeError

Size = Any

# A spec dim var ``n`` is traced as ``n__p1 - 1`` (tracing/symbolic.py: sizes may be 0).
SHIFT_SUFFIX = "__p1"


def canonical_dtype(dtype):
    """``dtype`` as JAX computes with it (``int64`` is ``int32`` without x64;
    ``>f4`` is ``float32``), so abstract arguments made from host arrays do not
    raise JAX's truncation warning; extended dtypes (PRNG keys) unchanged."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    if isinstance(dtype, np.dtype) and not dtype.isnative:
        dtype = dtype.newbyteorder("=")
    return jax.dtypes.canonicalize_dtype(dtype)


def native_byte_order(tree):
    """``tree`` with each NumPy array of a non-native byte order (``>f4``, as
    read from a big-endian file) converted to the native one: JAX copies such
    an array's bytes as they are (plain ``jax.jit`` returns garbage for it
    once the native dtype's program is cached: the same abstract value)."""
    def native(x):
        if isinstance(x, np.ndarray) and not x.dtype.isnative:
            return x.astype(x.dtype.newbyteorder("="))
        return x
    return jax.tree_util.tree_map(native, tree)


def is_static(s) -> bool:
    """A size known in Python (not a tracer or array)."""
    return isinstance(s, (int, np.integer)) and not isinstance(s, bool)


class DimEnv:
    """Bounds and logical values of the dim vars of one masked trace."""

    def __init__(self, scope, bounds: dict[str, int], logical: dict[str, Size]):
        self.scope = scope
        self.bounds = dict(bounds)
        # The dim vars bound here are >= 1 (internal dim vars, see tracing/symbolic.py):
        # JAX's bounds are exact for them. Data-dependent ones (add_var) may be 0.
        self.exact_vars = frozenset(bounds)
        self.logical_values = dict(logical)
        self._padded_cache: dict[Any, int] = {}
        self.logical_cache: dict[Any, Size] = {}
        self.value_cache: dict[Any, Size] = {}  # logical_value's (sizes as numbers)
        self._unshift_cache: dict[Any, Any] = {}

    # -- data-dependent sizes -------------------------------------------------
    def add_var(self, name: str, bound: int, logical: Size) -> None:
        """Bind a fresh (data-dependent) dim var created while tracing."""
        self.bounds[name] = int(bound)
        self.logical_values[name] = logical
        # Only sizes that use this var are stale (it can be re-bound, e.g. in a loop body).
        for cache in (self.logical_cache, self.value_cache):
            for k in [k for k in cache if name in compat.dim_vars(k)]:
                del cache[k]

    # -- evaluation -------------------------------------------------------------
    def padded(self, d) -> int:
        """Padded (physical) size of a dimension: its upper bound."""
        if not compat.is_dim_expr(d):
            return int(d)
        hit = self._padded_cache.get(d)
        if hit is not None:
            return hit
        hi = compat.upper_bound(d)
        if not np.isfinite(hi):
            hi = _upper_where_jax_has_none(d, self.bounds)
        if not np.isfinite(hi):
            raise ShapeError(f"cannot bound the dimension expression {d}: "
                             "add a constraint such as 'n <= 128'")
        # JAX's bounds assume every dim var >= 1, but sizes (and counts) may be
        # 0 at run time: `n - u` with u = 0 exceeds the bound JAX proves.
        if not compat.dim_vars(d) <= self.exact_vars:
            hi = max(hi, _zero_corners_upper(d, self.bounds, self.exact_vars))
        else:
            hi = min(hi, _unshifted_upper(d, self.bounds))
        res = max(int(hi), 0)
        self._padded_cache[d] = res
        return res

    def logical(self, d) -> Size:
        """Logical size of a dimension: a Python int or an int32 scalar."""
        if not compat.is_dim_expr(d):
            return int(d)
        hit = self.logical_cache.get(d)
        if hit is not None:
            return hit
        raw = self.logical_value(d)  # shared with the size used as a number
        val = max(raw, 0) if is_static(raw) else jnp.maximum(raw, 0)
        self.logical_cache[d] = val
        return val

    def logical_value(self, d) -> Size:
        """A size used as a number (``x.shape[0] - 2``): ``logical_raw``, not
        clamped at 0, computed once per expression (``value_cache``)."""
        if not compat.is_dim_expr(d):
            return int(d)
        hit = self.value_cache.get(d)
        if hit is None:
            hit = self.value_cache[d] = self.logical_raw(d)
        return hit

    def logical_raw(self, d) -> Size:
        """Like ``logical`` but not clamped at 0 (for checking constraints)."""
        if not compat.is_dim_expr(d):
            return int(d)
        env = {v: self.logical_values[v] for v in compat.dim_vars(d)}
        if all(is_static(x) for x in env.values()):
            return int(compat.evaluate_dim(d, {k: int(x) for k, x in env.items()}))
        # in the dtype of JAX's own size constants (int64 under jax_enable_x64:
        # its min/max of sizes take operands of one dtype), then int32
        dtype = jax.dtypes.canonicalize_dtype(np.int64)
        env = {k: jnp.asarray(x, dtype) for k, x in env.items()}
        d, env = self._unshifted(d, env)
        return jnp.asarray(compat.evaluate_dim(d, env), jnp.int32)

    def _unshifted(self, d, env):
        """``d`` over ``n`` instead of the shifted ``n__p1`` (``n + 1``), when it has any.

        ``(n__p1 - 1)*(m__p1 - 1)`` is ``n__p1*m__p1 - n__p1 - m__p1 + 1`` in
        JAX's normal form (three products at run time); over ``n, m`` it is
        ``n*m`` again. Polynomials only: the new scope's ``n`` is >= 1 for JAX,
        which would simplify ``min(n, 1)`` to 1.
        """
        names = {v: v.removesuffix(SHIFT_SUFFIX) for v in env}
        if (names == {v: v for v in env} or len(set(names.values())) < len(names)
                or any(op in str(d) for op in ("min(", "max(", "floordiv(", "mod("))):
            return d, env  # JAX simplifies those assuming n >= 1: polynomials only
        hit = self._unshift_cache.get(d)
        if hit is None:
            try:
                syms = jax.export.symbolic_shape(", ".join(names.values()))
                sub = {v: s + (1 if v != names[v] else 0) for v, s in zip(names, syms)}
                hit = self._unshift_cache[d] = compat.evaluate_dim(d, sub)
            except Exception:
                hit = self._unshift_cache[d] = d
        if hit is d:
            return d, env
        return hit, {names[v]: (x - 1 if v != names[v] else x) for v, x in env.items()}

    def padded_shape(self, shape) -> tuple[int, ...]:
        return tuple(self.padded(d) for d in shape)

    def logical_shape(self, shape) -> tuple:
        return tuple(self.logical(d) for d in shape)


def _upper_where_jax_has_none(d, bounds: dict[str, int]) -> float:
    """An upper bound of ``d`` where JAX's procedure gives none (a count times a
    shifted size, ``_u1*m__p1 - _u1``), one for padded sizes and rules alike:
    its values' largest (exact), else its largest at the corners of the box."""
    by_values = compat.bounds_by_values(d)
    return by_values[1] if by_values is not None else _interval_upper(d, bounds)


def _interval_upper(d, bounds: dict[str, int]) -> float:
    """Upper bound by evaluating at each corner of the box [0, bound]^vars."""
    names = sorted(compat.dim_vars(d))
    if len(names) > 8:
        return float("inf")
    hi = _var_bounds(d, names, bounds)
    if any(b is None or not np.isfinite(b) for b in hi.values()):
        return float("inf")
    best = -float("inf")
    for mask in range(1 << len(names)):
        env = {v: (int(hi[v]) if (mask >> i) & 1 else 0) for i, v in enumerate(names)}
        best = max(best, int(compat.evaluate_dim(d, env)))
    return best


def _var_bounds(d, names, bounds: dict[str, int]) -> dict[str, float]:
    """Each var's bound: ``bounds``'s, else JAX's in ``d``'s scope (a data-dependent
    count's ``_u1 <= 6``, bound in a ``DimEnv`` only once its rule ran: an output
    shape's padded size is asked before, to compare the cases of a split)."""
    return {v: bounds[v] if v in bounds else compat.upper_bound(compat.fresh_dim(v, d.scope))
            for v in names}


def _unshifted_upper(d, bounds: dict[str, int]) -> float:
    """A tighter sound upper bound of an expression over shifted dim vars.

    ``n__p1*m__p1 - n__p1 - m__p1 + 1`` (that is ``n*m``) over ``n__p1`` in
    [1, 4], ``m__p1`` in [1, 5] gets 19 from JAX's term-wise bounds, 12 over
    ``n, m``. Each face of the box where some spec vars are 0 is bounded by
    JAX in a scope where the others are >= 1 (sound: every value is on a face,
    and on its face each live var is >= 1, as JAX assumes, so ``min`` and
    ``max`` simplify soundly there). Expressions JAX proves equal then get the
    same padded size: ``jnp.arange(n * m)``'s ``max(0, n*m)`` as
    ``x.reshape(-1)``'s ``n*m`` (pgx's Go board). Not for sizes JAX takes
    long to decide (``costly_to_decide``: ``floordiv`` / ``mod``, whose
    symbolic division of such a substitution takes seconds, a segment op's
    ``bucket_size`` from a shape; many nested ``min`` / ``max``): JAX's
    ``upper_bound`` of those is already their largest value over the box.
    """
    shifted = sorted(v for v in compat.dim_vars(d) if v.endswith(SHIFT_SUFFIX))
    text = str(d)
    if not shifted or len(shifted) > 4 or compat.costly_to_decide(text, d.scope):
        return float("inf")
    key = (text, tuple(bounds.get(v) for v in sorted(compat.dim_vars(d))))
    hit = _UNSHIFTED_CACHE.get(key)
    if hit is None:
        if len(_UNSHIFTED_CACHE) > 4096:
            _UNSHIFTED_CACHE.clear()
        hit = _UNSHIFTED_CACHE[key] = _faces_upper(d, shifted, bounds)
    return hit


_UNSHIFTED_CACHE: dict = {}


def _faces_upper(d, shifted, bounds) -> float:
    best = -float("inf")
    try:
        for zeros in range(1 << len(shifted)):
            live = [v for i, v in enumerate(shifted) if not (zeros >> i) & 1]
            scope = jax.export.SymbolicScope(
                tuple(f"{v[:-len(SHIFT_SUFFIX)]} <= {bounds[v] - 1}" for v in live))
            env = {v: 1 for i, v in enumerate(shifted) if (zeros >> i) & 1}
            for v in live:
                (x,) = jax.export.symbolic_shape(v[:-len(SHIFT_SUFFIX)], scope=scope)
                env[v] = x + 1
            for v in compat.dim_vars(d) - set(shifted):  # unshifted vars stay as they are
                (env[v],) = jax.export.symbolic_shape(v, scope=scope)
            face = compat.evaluate_dim(d, env)
            best = max(best, compat.upper_bound(face) if compat.is_dim_expr(face)
                       else int(face))
    except Exception:
        return float("inf")
    return best if np.isfinite(best) else float("inf")



def _zero_corners_upper(d, bounds: dict[str, int], exact=frozenset()) -> float:
    """Largest value of ``d`` at the corners of [0, bound]^vars where some var is 0.

    Vars in ``exact`` range over [1, bound] instead.
    """
    names = sorted(compat.dim_vars(d))
    if len(names) > 6:
        return -float("inf")
    hi = _var_bounds(d, names, bounds)
    if any(b is None or not np.isfinite(b) for b in hi.values()):
        return -float("inf")
    best = -float("inf")
    for mask in range((1 << len(names)) - 1):  # the all-bounds corner is JAX's case
        env = {v: (int(hi[v]) if (mask >> i) & 1 else int(v in exact))
               for i, v in enumerate(names)}
        try:
            best = max(best, int(compat.evaluate_dim(d, env)))
        except (ZeroDivisionError, ValueError, ArithmeticError):
            continue
    return best


def needs_mask(logical: Size, padded: int) -> bool:
    """False only when the size is statically known to equal its bound."""
    return not (is_static(logical) and int(logical) == padded)


def upper_bound_int(e) -> int:
    """Upper bound of a dimension expression (or int) from JAX's decision procedure.

    Raises:
      ValueError: the expression is unbounded.
    """
    if not compat.is_dim_expr(e):
        return int(e)
    hi = compat.upper_bound(e)
    if not np.isfinite(hi):
        hi = _upper_where_jax_has_none(e, {})
    if not np.isfinite(hi):
        raise ValueError(f"unbounded dimension expression {e}")
    return int(hi)


def lower_bound_int(e) -> int:
    """Lower bound of a dimension expression (or int); see ``upper_bound_int``."""
    if not compat.is_dim_expr(e):
        return int(e)
    lo = compat.lower_bound(e)
    if not np.isfinite(lo):
        raise ValueError(f"unbounded dimension expression {e}")
    return int(lo)
