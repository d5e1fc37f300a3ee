"""The ``mask`` transformation: symbolic trace, prologue, masking interpreter.

1. ``fun`` is traced once per padded signature with ``jax.make_jaxpr`` on
   ``ShapeDtypeStruct``s whose shapes are ``jax.export`` dimension expressions,
   so every size-derived value stays symbolic (``dim_as_value``).
2. The prologue checks the logical sizes (``prologue.py``).
3. The jaxpr is walked; each equation's masking rule (``rules/``) computes its
   padded outputs. The interpreter has no primitive-specific code.
"""

from __future__ import annotations

import functools
import re
import threading
import traceback as _tb
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _jax_compat as compat
from .errors import ShapeError, UnsupportedError, at_call_site, relocate, user_call_site
from .masked import Masked
from .prologue import Check, concrete_value, run_checks
from .rules import get_rule
from .rules.registry import COVERAGE_DOC, RuleContext
from .rules.util import valid_mask
from .shapes import DimEnv, is_static, needs_mask
from .specs import AxisSpec, broadcast_specs, parse_leaf_spec, scope_and_name_generator

__all__ = ["mask", "MaskedProgram", "trace_masked"]


def _is_masked(x) -> bool:
    return isinstance(x, Masked)


_TRACE_STATE = threading.local()


def current_scope():
    """The ``SymbolicScope`` of the masked trace in progress (None outside one).

    Data-dependent primitives use it to create fresh dim vars while tracing.
    """
    stack = getattr(_TRACE_STATE, "scopes", None)
    return stack[-1] if stack else None


# ----------------------------------------------------------------------------
# Tracing
# ----------------------------------------------------------------------------
class MaskedProgram:
    """One symbolic trace of ``fun`` at a padded signature."""

    def __init__(self, closed_jaxpr, scope, axis_specs, var_bounds, leaf_bounds, out_tree,
                 var_order):
        self.closed_jaxpr = closed_jaxpr
        self.scope = scope
        self.axis_specs: list[list[AxisSpec]] = axis_specs
        self.var_bounds: dict[str, int] = var_bounds
        self.leaf_bounds: list[tuple[int, ...]] = leaf_bounds
        self.out_tree = out_tree
        self.var_order = var_order

    @property
    def out_shapes(self):
        """Symbolic output shapes (dimension expressions) per output leaf."""
        return [tuple(v.aval.shape) for v in self.closed_jaxpr.jaxpr.outvars]


def _user_frame_of_exception(e: BaseException) -> str:
    frames = _tb.extract_tb(e.__traceback__)
    from .errors import _is_library_frame

    for fr in reversed(frames):
        if not _is_library_frame(fr.filename):
            return f"{fr.filename}:{fr.lineno} ({fr.name})"
    return "<unknown location>"


_REMEDIES = (
    "Remedies: state what you know as a constraint (mask(..., constraints=['n >= 3'])), "
    "or replace the Python `if` on a size with lax.cond / jnp.where.")


def _translate_trace_error(e: BaseException) -> BaseException | None:
    where = _user_frame_of_exception(e)
    msg = str(e).split("\n\n")[0].strip()
    from .ops import translate_trace_error as _data_dependent_error

    dd = _data_dependent_error(e, where)  # jnp.nonzero, x[m], jnp.unique, ...: polymask ops
    if dd is not None:
        return dd
    if isinstance(e, compat.InconclusiveDimensionOperation):
        msg = re.split(r"\n(?:Using symbolic scope|This error arises)", msg)[0].strip()
        extra = ""
        if "requires a constant" in msg:
            extra = ("\n  A size was needed as a Python constant (int(x.shape[0]), range(n), "
                     "np.zeros(n), ...): keep it symbolic (jnp/lax ops accept symbolic sizes) "
                     "or use polymask.logical_shape(x) for its value.")
        if "divide evenly" in msg:
            extra = ("\n  Write the axis in the spec as a multiple (e.g. '2*k') so that the "
                     "division is exact for every logical size.")
        m = re.search(r"comparison '(.+?)' (\S+) '(.+?)' is inconclusive", msg)
        remedies = _REMEDIES
        if m:
            lhs, op, rhs = m.groups()
            if op in (">", "<=") and rhs.lstrip("-").isdigit():
                rhs = str(int(rhs) + 1)
            remedies = remedies.replace("'n >= 3'", f"'{lhs} >= {rhs}'")
        return ShapeError(
            f"a comparison of symbolic sizes is inconclusive while tracing at {where}:\n"
            f"  {msg}{extra}\n  {remedies}")
    if isinstance(e, TypeError) and re.search(
            r"incompatible shapes|must have (the )?same shape|same shape|shapes must", msg):
        return ShapeError(
            f"incompatible symbolic shapes at {where}: {msg}\n  Axes named by different "
            "dim vars are different sizes while tracing; if they are always equal, give "
            "them the same name in in_specs (e.g. ('n', 'n')).")
    if (isinstance(e, TypeError) and "_DimExpr" in msg) or (
            isinstance(e, ValueError) and "shape polymorphism" in msg):
        return ShapeError(
            f"JAX cannot trace this with a symbolic size at {where}:\n  {msg}\n  The JAX "
            "function needs a size as a Python int (len(x), int(x.shape[0]), a Python "
            "branch on it) or does not support symbolic shapes (e.g. jnp.convolve, "
            "jnp.array_split, jnp.cov): use the lax form (lax.conv_general_dilated, "
            "lax.slice, ...) or make that axis static with '_' in the spec. "
            "See docs/coverage.md.")
    if isinstance(e, jax.errors.NonConcreteBooleanIndexError):
        return ShapeError(
            f"boolean indexing has a data-dependent size at {where}; inside polymask.mask "
            "use polymask.boolean_mask(x, m) (or polymask.compress) instead.")
    if isinstance(e, jax.errors.ConcretizationTypeError):
        text = str(e)
        if "nonzero" in text or "argwhere" in text or "size argument" in text:
            return ShapeError(
                f"an op with a data-dependent output size (jnp.nonzero / one-argument "
                f"jnp.where / argwhere / unique) was called at {where}; inside polymask.mask "
                "use polymask.nonzero, polymask.where, polymask.argwhere, "
                "polymask.flatnonzero or polymask.unique.\n  JAX said: "
                + next((ln for ln in text.splitlines() if "size argument" in ln), msg.split("\n")[0]))
    return None


def trace_masked(fun: Callable, args: Sequence[Any], in_specs=None, constraints=()):
    """Trace ``fun`` symbolically at the padded signature of ``args``.

    Returns ``(program, leaves)`` where ``leaves`` are the flat input leaves.
    """
    leaves, in_tree = jax.tree_util.tree_flatten(tuple(args), is_leaf=_is_masked)
    paths = [
        "args" + jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(tuple(args), is_leaf=_is_masked)[0]
    ]
    spec_leaves = broadcast_specs(in_specs, list(args), _is_masked)
    scope, gen_name = scope_and_name_generator(spec_leaves, constraints)

    axis_specs = []
    for leaf, spec, path in zip(leaves, spec_leaves, paths):
        data = leaf.data if _is_masked(leaf) else leaf
        padded = tuple(int(d) for d in np.shape(data))
        axis_specs.append(parse_leaf_spec(spec, path, padded, scope,
                                          default_dynamic=_is_masked(leaf), name_gen=gen_name))

    # Constraint variables must be spec variables.
    spec_vars = {a.var for axes in axis_specs for a in axes if a.var}
    for _, e1, e2, text in compat.explicit_constraints(scope):
        unknown = (compat.dim_vars(e1) | compat.dim_vars(e2)) - spec_vars
        if unknown:
            raise ShapeError(f"constraint '{text}' names unknown dim vars {sorted(unknown)}; "
                             f"the specs define {sorted(spec_vars)}")

    var_bounds: dict[str, int] = {}
    var_order: list[str] = []
    for leaf, axes in zip(leaves, axis_specs):
        shape = np.shape(leaf.data if _is_masked(leaf) else leaf)
        for a in axes:
            if a.var is None:
                continue
            data_bound = (int(shape[a.axis]) - a.offset) // a.coeff
            if a.var not in var_bounds:
                var_order.append(a.var)
                var_bounds[a.var] = data_bound
            else:
                var_bounds[a.var] = min(var_bounds[a.var], data_bound)
    for v, b in var_bounds.items():
        if b < 1:
            raise ShapeError(f"dim var '{v}' has bound {b}: padded sizes must leave room for "
                             "at least one element (bound >= 1)")
        compat.add_constraint(scope, f"{v} <= {b}")

    env = DimEnv(scope, var_bounds, {})
    leaf_bounds = [tuple(env.padded(a.expr) for a in axes) for axes in axis_specs]
    avals = []
    for leaf, axes in zip(leaves, axis_specs):
        data = leaf.data if _is_masked(leaf) else leaf
        avals.append(jax.ShapeDtypeStruct(tuple(a.expr for a in axes), _dtype_of(data)))

    out_tree_box = []

    def flat_fun(*flat):
        rebuilt = jax.tree_util.tree_unflatten(in_tree, list(flat))
        out = fun(*rebuilt)
        out_flat, out_tree = jax.tree_util.tree_flatten(out, is_leaf=_is_masked)
        out_tree_box.append(out_tree)
        return [o.data if _is_masked(o) else o for o in out_flat]

    if not hasattr(_TRACE_STATE, "scopes"):
        _TRACE_STATE.scopes = []
    _TRACE_STATE.scopes.append(scope)
    from .errors import _is_library_frame

    equalities = compat.record_unsound_equalities(lambda f: not _is_library_frame(f))
    try:
        with equalities:
            closed = jax.make_jaxpr(flat_fun)(*avals)
    except (ShapeError, UnsupportedError):
        raise
    except Exception as e:
        translated = _translate_trace_error(e)
        if translated is not None:
            raise translated from None
        raise
    finally:
        _TRACE_STATE.scopes.pop()
    prog = MaskedProgram(closed, scope, axis_specs, var_bounds, leaf_bounds,
                         out_tree_box[-1], var_order)
    prog.assumed_unequal = _dedupe(equalities.records)
    return prog, leaves


def _dedupe(records):
    seen, out = set(), []
    for a, b, where in records:
        key = (str(a), str(b), where)
        if key not in seen:
            seen.add(key)
            out.append((a, b, where))
    return out



def _dtype_of(x):
    if hasattr(x, "dtype"):
        return x.dtype
    return jnp.asarray(x).dtype


# ----------------------------------------------------------------------------
# Prologue: logical values of the dim vars, and their checks
# ----------------------------------------------------------------------------
def _leaf_sizes(leaf) -> tuple:
    if _is_masked(leaf):
        return leaf.shape
    return tuple(int(d) for d in np.shape(leaf))


def _validate_size_type(size, where: str):
    if isinstance(size, bool) or isinstance(size, (float, complex)):
        raise ShapeError(f"{where}: logical size {size!r} must be an integer")
    if is_static(size):
        return
    dtype = getattr(size, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ShapeError(f"{where}: logical size must be an integer scalar; got {size!r}"
                         f" of dtype {dtype}")
    if np.ndim(size) != 0:
        raise ShapeError(
            f"{where}: logical size must be a scalar; got shape {np.shape(size)} "
            "(for a ragged batch, jax.vmap over the Masked value)")


def solve_dim_vars(prog: MaskedProgram, leaves, checks_on: bool):
    """Logical values of the dim vars from the input sizes, plus the prologue checks."""
    checks: list[Check] = []
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for leaf, axes in zip(leaves, prog.axis_specs):
        sizes = _leaf_sizes(leaf)
        data = leaf.data if _is_masked(leaf) else leaf
        if len(sizes) != len(axes):
            raise ShapeError(f"{axes[0].path if axes else 'argument'}: logical shape "
                             f"{sizes} does not match the rank of data {np.shape(data)}")
        for a, size in zip(axes, sizes):
            _validate_size_type(size, a.where)
            bound = np.shape(data)[a.axis]
            if checks_on or is_static(size):
                named = f"{a.where} (dim var '{a.var}')" if a.var else a.where
                checks.append(Check(_out_of_range(size, bound),
                                    f"{named}: logical size {{0}} is outside "
                                    f"[0, {bound}] (the bound of that axis)", (size,)))
            if a.var is None:
                if not (is_static(size) and int(size) == int(a.expr)):
                    checks.append(Check(_ne(size, a.expr),
                                        f"{a.where}: static axis of size {a.expr} got logical "
                                        "size {0}", (size,)))
                continue
            value = size if (a.coeff == 1 and a.offset == 0) else _solve(size, a)
            if a.coeff != 1 or a.offset != 0:
                checks.append(Check(_not_affine(size, a),
                                    f"{a.where}: logical size {{0}} is not of the form "
                                    f"{a.expr} for an integer {a.var} >= 0", (size,)))
            if a.var not in values:
                values[a.var], sources[a.var] = value, a.where
            else:
                prev = values[a.var]
                checks.append(Check(_ne(prev, value),
                                    f"dim var '{a.var}' has different logical values: "
                                    f"{{0}} at {sources[a.var]} and {{1}} at "
                                    f"{a.where}", (prev, value)))
                if is_static(value) and not is_static(prev):
                    values[a.var] = value
    auto = {f"{v} <= {b}" for v, b in prog.var_bounds.items()}  # bounds: range-checked above
    for kind, e1, e2, text in compat.explicit_constraints(prog.scope):
        if not (compat.dim_vars(e1) | compat.dim_vars(e2)) <= set(values):
            continue  # a data-dependent dim var's bound: its rule guarantees it
        if text in auto:
            continue
        names = sorted(compat.dim_vars(e1) | compat.dim_vars(e2))
        env = DimEnv(prog.scope, prog.var_bounds, values)
        v1, v2 = env.logical_raw(e1), env.logical_raw(e2)
        bad = _ne(v1, v2) if kind == "==" else _lt(v1, v2)
        checks.append(Check(bad, f"constraint '{text}' does not hold for "
                                 + ", ".join(f"{k}={{{i}}}" for i, k in enumerate(names)),
                            tuple(values[k] for k in names)))
    for a, b, where in getattr(prog, "assumed_unequal", ()):
        if not (compat.dim_vars(a) | compat.dim_vars(b)) <= set(values):
            continue
        env = DimEnv(prog.scope, prog.var_bounds, values)
        va, vb = env.logical_raw(a), env.logical_raw(b)
        checks.append(Check(
            _eq(va, vb),
            f"the masked function compared sizes `{a} == {b}` at {where} while tracing; JAX "
            f"decides a symbolic `==` as False unless it is provable, so the traced program "
            f"assumes {a} != {b}, but at run time both are {{0}}. {_REMEDIES}",
            (va,)))
    if not checks_on:  # checks=False: keep only the checks decidable in Python
        checks = [c for c in checks if concrete_value(c.bad) is not None]
    return values, checks


def _fmt(x) -> str:
    v = concrete_value(x)
    return str(v.tolist()) if v is not None else "<traced>"


def _out_of_range(size, bound):
    if is_static(size):
        return not (0 <= int(size) <= bound)
    return (size < 0) | (size > bound)


def _ne(a, b):
    if is_static(a) and is_static(b):
        return int(a) != int(b)
    return jnp.asarray(a) != jnp.asarray(b)


def _eq(a, b):
    if is_static(a) and is_static(b):
        return int(a) == int(b)
    return jnp.asarray(a) == jnp.asarray(b)


def _lt(a, b):
    if is_static(a) and is_static(b):
        return int(a) < int(b)
    return jnp.asarray(a) < jnp.asarray(b)


def _solve(size, a: AxisSpec):
    if is_static(size):
        return (int(size) - a.offset) // a.coeff
    return (jnp.asarray(size, jnp.int32) - a.offset) // a.coeff


def _not_affine(size, a: AxisSpec):
    if is_static(size):
        s = int(size)
        return s < a.offset or (s - a.offset) % a.coeff != 0
    s = jnp.asarray(size, jnp.int32)
    return (s < a.offset) | ((s - a.offset) % a.coeff != 0)


# ----------------------------------------------------------------------------
# The masking interpreter
# ----------------------------------------------------------------------------
def _has_inner_jaxpr(params) -> bool:
    for v in params.values():
        vs = v if isinstance(v, (tuple, list)) else (v,)
        for x in vs:
            if isinstance(x, (compat.ClosedJaxpr, compat.Jaxpr)):
                return True
    return False


class Interpreter:
    """Walks a jaxpr applying masking rules (no primitive-specific code)."""

    def __init__(self):
        self.trace_log: list[dict] | None = None  # filled by polymask.explain

    def eval_closed(self, closed, args: list, dims: DimEnv) -> list:
        return self.eval_jaxpr(closed.jaxpr, closed.consts, args, dims)

    def eval_jaxpr(self, jaxpr, consts, args, dims: DimEnv) -> list:
        env: dict[Any, Any] = {}

        def read(v):
            if compat.is_jaxpr_literal(v):
                return compat.literal_value(v)
            return env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        # The jaxprs being walked, innermost last: rules may look up how an
        # operand was computed (e.g. a loop bound derived from sizes).
        stack = dims.__dict__.setdefault("jaxpr_stack", [])
        stack.append(jaxpr)
        try:
            for eqn in jaxpr.eqns:
                invals = [read(v) for v in eqn.invars]
                outs = self.apply(eqn, invals, dims)
                for v, o in zip(eqn.outvars, outs):
                    if not isinstance(v, compat.DropVar):
                        env[v] = o
        finally:
            stack.pop()
        return [read(v) for v in jaxpr.outvars]

    def apply(self, eqn, invals, dims: DimEnv) -> list:
        prim = eqn.primitive
        with compat.user_context(eqn.source_info):
            if self._static_fast_path(eqn, dims):
                out = prim.bind(*invals, **eqn.params)
                rule_name = "static"
            else:
                rule = get_rule(prim.name)
                if rule is None:
                    raise UnsupportedError(
                        f"polymask has no masking rule for primitive '{prim.name}' "
                        f"(used at {compat.source_line(eqn.source_info)}); "
                        f"see {COVERAGE_DOC} for the covered primitives")
                ctx = RuleContext(eqn, dims, self)
                try:
                    out = rule(ctx, *invals, **eqn.params)
                except (ShapeError, UnsupportedError) as e:
                    # Equations of inner jaxprs (jnp functions are jitted) have no
                    # user frame: name the enclosing equation's user line instead.
                    raise relocate(e, compat.source_line(eqn.source_info)) from None
                rule_name = getattr(rule, "__name__", "rule")
        outs = list(out) if prim.multiple_results else [out]
        self._check_out_shapes(eqn, outs, dims)
        if self.trace_log is not None:
            self.trace_log.append({"eqn": eqn, "rule": rule_name})
        return outs

    @staticmethod
    def _static_fast_path(eqn, dims: DimEnv) -> bool:
        """No dynamic size touches this equation: bind the primitive unchanged."""
        if _has_inner_jaxpr(eqn.params):
            return False
        exprs = []
        for v in list(eqn.invars) + list(eqn.outvars):
            exprs.extend(d for d in getattr(v.aval, "shape", ()) if compat.is_dim_expr(d))
        from .rules.registry import substitute_dims

        substitute_dims(dict(eqn.params), lambda d: exprs.append(d) or d)
        for d in exprs:
            if not compat.dim_vars(d) <= set(dims.logical_values):
                return False
            val = dims.logical(d)
            if not is_static(val) or int(val) != dims.padded(d):
                return False
        return not exprs

    @staticmethod
    def _check_out_shapes(eqn, outs, dims: DimEnv):
        for v, o in zip(eqn.outvars, outs):
            want = tuple(dims.padded(d) for d in getattr(v.aval, "shape", ()))
            got = tuple(np.shape(o))
            if got != want:
                raise AssertionError(
                    f"polymask internal error: rule for '{eqn.primitive.name}' returned "
                    f"padded shape {got}, expected {want} (symbolic {v.aval.shape})")


_INTERPRETER = Interpreter()


def run_program(prog: MaskedProgram, leaves, values: dict, interpreter=None) -> list[Masked]:
    """Evaluate a traced program on padded leaves with dim var values ``values``."""
    interp = interpreter or _INTERPRETER
    dims = DimEnv(prog.scope, prog.var_bounds, values)
    args = []
    for leaf, axes, lb in zip(leaves, prog.axis_specs, prog.leaf_bounds):
        data = leaf.data if _is_masked(leaf) else leaf
        data = jnp.asarray(data)
        if tuple(data.shape) != lb:  # a shared dim var with a smaller bound elsewhere
            data = lax.slice(data, (0,) * data.ndim, lb)
        arg = _entry_mask(data, [dims.logical(a.expr) for a in axes])
        if arg is not data or not valid_mask_needed(data, axes, dims):
            dims.mark_zero_padding(arg)
        args.append(arg)
    outs = interp.eval_closed(prog.closed_jaxpr, args, dims)
    result = []
    for v, o in zip(prog.closed_jaxpr.jaxpr.outvars, outs):
        shape = tuple(dims.logical(d) for d in getattr(v.aval, "shape", ()))
        result.append(Masked(jnp.asarray(o), shape))
    return result


def valid_mask_needed(data, axes, dims) -> bool:
    return any(needs_mask(dims.logical(a.expr), n) for a, n in zip(axes, data.shape))


def _entry_mask(data, logical):
    """Zero float padding once on entry: gradients w.r.t. padding are then exactly 0."""
    if not jnp.issubdtype(data.dtype, jnp.inexact):
        return data
    m = valid_mask(logical, data.shape)
    if m is None:
        return data
    return lax.select(m, data, jnp.zeros_like(data))


def mask(fun: Callable, in_specs=None, *, constraints: Sequence[str] = (),
         checks: bool = True) -> Callable:
    """Transform ``fun`` (written for exact arrays) to run on padded arrays.

    Args:
      fun: a JAX-traceable function of arrays (pytrees allowed).
      in_specs: None (every axis of a ``Masked`` input gets its own dim var;
        plain arrays are unpadded and static), or one entry per positional
        argument: a ``jax.export.symbolic_shape`` spec string (``"b, n, 64"``,
        ``"_"`` = static, same name = equal sizes, ``"2*k"`` = affine), None,
        or a pytree of specs matching the argument.
      constraints: extra ``jax.export`` constraints (``"n >= 3"``), checked in
        the prologue and used while tracing.
      checks: run the prologue checks (sizes in ``[0, bound]``, equal sizes for
        equal names, constraints). Concrete sizes are always range-checked.

    Returns:
      ``masked_fun(*args)``: array leaves may be ``Masked`` (padded data plus
      logical shape) or plain arrays (unpadded). Returns ``fun``'s output
      pytree with each array leaf a ``Masked`` whose logical shape is the
      symbolic output shape evaluated at the logical sizes and whose padded
      shape is that expression's upper bound.

    Raises:
      ShapeError: bad spec, sizes out of range or inconsistent, a constraint
        violated, or an inconclusive size comparison while tracing. With
        concrete sizes it is raised at the call. Inside ``jax.jit`` (traced
        sizes) the same message is raised when the result is computed, wrapped
        by JAX as ``jax.errors.JaxRuntimeError`` (``polymask.jit`` checks sizes
        on the host and raises ``ShapeError`` itself).
      UnsupportedError: a primitive without a masking rule.

    Composes with ``jax.jit`` (one trace per padded signature: sizes are
    runtime data), ``jax.vmap`` (ragged batches) and ``jax.grad``.
    """
    cache: dict[Any, MaskedProgram] = {}
    lock = threading.Lock()

    @functools.wraps(fun)
    def masked_fun(*args):
        call_site = user_call_site()
        key = _signature(args, in_specs, constraints)
        with lock:
            prog = cache.get(key) if key is not None else None
        try:
            if prog is None:
                prog, leaves = trace_masked(fun, args, in_specs, constraints)
                if key is not None:
                    with lock:
                        cache[key] = prog
            else:
                leaves = jax.tree_util.tree_leaves(tuple(args), is_leaf=_is_masked)
            values, prologue_checks = solve_dim_vars(prog, leaves, checks)
        except ShapeError as e:
            raise at_call_site(e, call_site) from None
        run_checks(prologue_checks, call_site)
        outs = run_program(prog, leaves, values)
        return jax.tree_util.tree_unflatten(prog.out_tree, outs)

    masked_fun._polymask_cache = cache  # type: ignore[attr-defined]
    masked_fun._polymask_fun = fun  # type: ignore[attr-defined]
    masked_fun._polymask_in_specs = in_specs  # type: ignore[attr-defined]
    return masked_fun


def _signature(args, in_specs, constraints):
    leaves, tree = jax.tree_util.tree_flatten(tuple(args), is_leaf=_is_masked)
    sig = []
    for leaf in leaves:
        if _is_masked(leaf):
            sig.append(("M", tuple(np.shape(leaf.data)), str(_dtype_of(leaf.data))))
        else:
            sig.append(("A", tuple(np.shape(leaf)), str(_dtype_of(leaf)),
                        isinstance(leaf, (int, float, bool, complex))))
    try:
        spec_key = repr(in_specs)
        hash(spec_key)
    except Exception:
        return None
    return (tree, tuple(sig), spec_key, tuple(constraints))
