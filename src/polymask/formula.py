"""``shape_formula``: the symbolic output shapes of a masked program.

``shape_formula`` traces ``fun`` symbolically (as ``mask`` does) and returns
the output shapes as ``jax.export`` dimension expressions: the shape rule of
the whole program, in terms of the dim vars of the input specs. The argument
helpers here (``_abstractify``, ``_args_from_specs``) are shared with
``polymask.explain``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_compat as compat
from .errors import ShapeError
from .masked import Masked
from .prologue import solve_dim_vars
from .rules.registry import has_inner_jaxpr, substitute_dims
from .shapes import DimEnv
from .trace import trace as trace_masked

__all__ = ["shape_formula", "ShapeFormula"]

def _is_masked(x) -> bool:
    return isinstance(x, Masked)


# ----------------------------------------------------------------------------
# Arguments: example arrays, Masked values, ShapeDtypeStructs or padded shapes
# ----------------------------------------------------------------------------
def _is_shape_tuple(x) -> bool:
    return (isinstance(x, (tuple, list)) and
            all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in x))


def _abstractify(args, in_specs, dtype):
    """Replace data by ``ShapeDtypeStruct``s; bare shape tuples become padded inputs.

    Example arrays are kept abstract (nothing is computed). With
    ``in_specs=None`` every axis of every input is dynamic (its own dim var),
    so the formulas are in terms of all input sizes.
    """
    def one(x):
        if _is_masked(x):
            return Masked(jax.ShapeDtypeStruct(np.shape(x.data), x.data.dtype), x.shape)
        if _is_shape_tuple(x):
            sds = jax.ShapeDtypeStruct(tuple(int(d) for d in x), dtype)
            return Masked(sds) if in_specs is None else sds
        if isinstance(x, jax.ShapeDtypeStruct) or hasattr(x, "shape"):
            sds = jax.ShapeDtypeStruct(tuple(np.shape(x)), x.dtype)
            return Masked(sds) if in_specs is None else sds
        return x

    return tuple(jax.tree_util.tree_map(one, a, is_leaf=lambda v: _is_masked(v) or
                                        _is_shape_tuple(v)) for a in args)


# ----------------------------------------------------------------------------
# shape_formula
# ----------------------------------------------------------------------------
def _py_expr(s: str) -> str:
    """jax's printed form of a dimension expression -> Python syntax.

    ``floordiv(n + 1, 2)`` -> ``(n + 1) // 2``; ``mod(n, 3)`` -> ``n % 3``;
    ``max``/``min`` stay calls. Nested quotients get parentheses.
    """
    def conv(s: str, top: bool) -> str:
        out, i = "", 0
        while i < len(s):
            m = re.match(r"(floordiv|mod)\(", s[i:])
            if m and (i == 0 or not (s[i - 1].isalnum() or s[i - 1] == "_")):
                j = i + len(m.group(0))
                depth, k, parts, cur = 1, j, [], ""
                while k < len(s) and depth:
                    ch = s[k]
                    if ch == "(":
                        depth += 1
                    elif ch == ")":
                        depth -= 1
                        if depth == 0:
                            break
                    if ch == "," and depth == 1:
                        parts.append(cur)
                        cur = ""
                    else:
                        cur += ch
                    k += 1
                parts.append(cur)
                a, b = (conv(p.strip(), False) for p in parts)
                op = "//" if m.group(1) == "floordiv" else "%"
                a = a if re.fullmatch(r"-?\s*[\w.]+|\(.*\)", a) else f"({a})"
                b = b if re.fullmatch(r"[\w.]+", b) else f"({b})"
                whole = f"{a} {op} {b}"
                whole_top = top and i == 0 and k == len(s) - 1
                out += whole if whole_top else f"({whole})"
                i = k + 1
            else:
                out += s[i]
                i += 1
        return out

    return conv(s, True)


def _dim_str(d) -> str:
    return str(d) if compat.is_dim_expr(d) else str(int(d))


@dataclasses.dataclass(frozen=True, eq=False)
class ShapeFormula:
    """The symbolic shape of one output.

    Attributes:
      exprs: one ``jax.export`` dimension expression (or int) per axis.
      bound: the padded shape (each expression's upper bound); None when no
        example arguments were given.
      dtype: the output dtype.
      scope: the ``SymbolicScope`` the expressions live in.

    ``str(f)`` is Python syntax, e.g. ``((n + 1) // 2,)``; ``f.jax_str`` is
    jax's own form (``(floordiv(n + 1, 2),)``). Formulas compare equal when
    their expressions are equal after JAX's normalisation (``m*n == n*m``),
    also against tuples of strings/ints (parsed in this formula's scope).
    """

    exprs: tuple
    bound: tuple[int, ...] | None
    dtype: Any
    scope: Any = dataclasses.field(repr=False, default=None)

    @property
    def strs(self) -> tuple[str, ...]:
        """Each axis in Python syntax."""
        return tuple(_py_expr(_dim_str(d)) for d in self.exprs)

    @property
    def jax_str(self) -> str:
        return _tuple_str(_dim_str(d) for d in self.exprs)

    @property
    def dim_vars(self) -> set[str]:
        return set().union(*(compat.dim_vars(d) for d in self.exprs)) if self.exprs else set()

    @property
    def ndim(self) -> int:
        return len(self.exprs)

    def evaluate(self, **sizes) -> tuple[int, ...]:
        """The logical shape at the given dim var values (``f.evaluate(n=7)``)."""
        out = []
        for d in self.exprs:
            need = compat.dim_vars(d)
            missing = need - set(sizes)
            if missing:
                raise ShapeError(f"ShapeFormula.evaluate: no value for dim vars "
                                 f"{sorted(missing)} (formula {self})")
            out.append(max(int(compat.evaluate_dim(d, {k: int(sizes[k]) for k in need})), 0))
        return tuple(out)

    def _parse(self, text: str):
        """A dimension expression from jax syntax or Python syntax (``//``, ``%``)."""
        try:
            (e,) = jax.export.symbolic_shape(text, scope=self.scope)
            return e
        except Exception:
            pass
        names = set(re.findall(r"[A-Za-z_]\w*", text)) - {"floordiv", "mod"}
        try:
            env = {v: jax.export.symbolic_shape(v, scope=self.scope)[0] for v in names}
            env.update(floordiv=lambda a, b: a // b, mod=lambda a, b: a % b)
            return eval(text, {"__builtins__": {}}, env)  # noqa: S307 (names are dim vars)
        except Exception:
            return None

    def _key(self):
        return tuple(_dim_str(d) for d in self.exprs)

    def _coerce(self, other):
        if isinstance(other, ShapeFormula):
            return other._key()
        if isinstance(other, (tuple, list)):
            key = []
            for d in other:
                if isinstance(d, (int, np.integer)):
                    key.append(str(int(d)))
                elif compat.is_dim_expr(d):
                    key.append(str(d))
                elif isinstance(d, str):
                    e = self._parse(d)
                    if e is None:
                        return None
                    key.append(_dim_str(e))
                else:
                    return None
            return tuple(key)
        return None

    def __eq__(self, other):
        key = self._coerce(other)
        if key is None:
            return NotImplemented
        return key == self._key()

    def __hash__(self):
        return hash(self._key())

    def __len__(self):
        return len(self.exprs)

    def __getitem__(self, i):
        return self.exprs[i]

    def __iter__(self):
        return iter(self.exprs)

    def __str__(self) -> str:
        return _tuple_str(self.strs)

    def __repr__(self) -> str:
        return f"ShapeFormula({self}, bound={self.bound}, dtype={np.dtype(self.dtype).name})"


def _tuple_str(parts) -> str:
    parts = list(parts)
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def shape_formula(fun, in_specs=None, *args, constraints=(), dtype=jnp.float32):
    """Symbolic output shapes of ``fun`` as dimension expressions.

    Args:
      fun: the function (as given to ``polymask.mask``).
      in_specs: as for ``mask``; with None every axis of every input gets its
        own dim var (``s0``, ``s1``, ...).
      *args: example arguments: arrays, ``Masked`` values,
        ``jax.ShapeDtypeStruct``s, or padded shapes given as tuples of ints
        (``dtype``, default float32). Only shapes and dtypes are used. Without
        them, every input is built from its spec string (``"n, 64"``).
      constraints: as for ``mask``.

    Returns:
      ``fun``'s output pytree with a ``ShapeFormula`` per array leaf, e.g.
      ``shape_formula(lambda x: x[::2], "n", (10,))`` gives ``((n + 1) // 2,)``.
    """
    no_args = not args
    if no_args:
        args = _args_from_specs(in_specs, dtype)
    absargs = _abstractify(args, in_specs, dtype)
    prog, _ = trace_masked(fun, absargs, in_specs, constraints)
    dims = DimEnv(prog.scope, prog.var_bounds, {})
    out = []
    for v in prog.closed_jaxpr.jaxpr.outvars:
        shape = tuple(getattr(v.aval, "shape", ()))
        bound = None if no_args else tuple(dims.padded(d) for d in shape)
        out.append(ShapeFormula(tuple(shape), bound, v.aval.dtype, prog.scope))
    return jax.tree_util.tree_unflatten(prog.out_tree, out)


_PLACEHOLDER_BOUND = 1024


def _args_from_specs(in_specs, dtype):
    """Abstract arguments from spec strings alone (``shape_formula(fun, specs)``).

    Each dim var gets a placeholder bound; the formulas do not depend on it
    (``ShapeFormula.bound`` is None then).
    """
    if in_specs is None:
        raise ShapeError("shape_formula(fun, in_specs) without example arguments needs "
                         "in_specs with a spec string for every argument")
    specs = (in_specs,) if isinstance(in_specs, str) else tuple(in_specs)

    def one(spec, where):
        if not isinstance(spec, str):
            raise ShapeError(f"{where}: without example arguments every spec must be a "
                             f"string (got {spec!r}); pass example arguments or shapes")
        try:
            exprs = jax.export.symbolic_shape(spec)
        except Exception as e:
            raise ShapeError(f"{where}: cannot parse shape spec '{spec}': {e}") from None
        shape = []
        for e in exprs:
            names = compat.dim_vars(e)
            shape.append(int(compat.evaluate_dim(e, {v: _PLACEHOLDER_BOUND for v in names})))
        return jax.ShapeDtypeStruct(tuple(shape), dtype)

    out = []
    for i, spec in enumerate(specs):
        out.append(jax.tree_util.tree_map(lambda s, i=i: one(s, f"in_specs[{i}]"), spec,
                                          is_leaf=lambda s: s is None or isinstance(s, str)))
    return tuple(out)


def _concrete_sizes(prog, leaves) -> dict | None:
    """Dim var values from example ``Masked`` sizes, when all are concrete."""
    values, _ = solve_dim_vars(prog, leaves, checks_on=False)
    if any(compat.is_tracer(v) for v in values.values()):
        return None
    return {k: int(np.asarray(v)) for k, v in values.items()}


# ----------------------------------------------------------------------------
# The size expressions of a traced program (explain's sizes table)
# ----------------------------------------------------------------------------
def _all_exprs(shapes_and_dims):
    for d in shapes_and_dims:
        if compat.is_dim_expr(d):
            yield d


def _size_table(prog, concrete) -> dict[str, dict]:
    dims = DimEnv(prog.scope, prog.var_bounds, {})
    cdims = DimEnv(prog.scope, prog.var_bounds, concrete) if concrete else None
    table: dict[str, dict] = {}

    def add(d, where, query):
        key = _dim_str(d)
        if key not in table:
            try:
                bound = dims.padded(d)
            except Exception:
                bound = "?"
            logical = None
            if cdims is not None:
                try:
                    logical = cdims.logical(d)
                except Exception:
                    logical = None
            table[key] = {"bound": bound, "logical": logical, "queries": 0,
                          "first_use": where, "expr": d}
        if query:
            table[key]["queries"] += 1

    for v in prog.var_order:
        (e,) = jax.export.symbolic_shape(v, scope=prog.scope)
        add(e, "input", False)
    eqns = _walk_eqns(prog.closed_jaxpr.jaxpr)
    for eqn in eqns:
        src = _short_path(compat.source_line(eqn.source_info))
        if eqn.primitive is compat.dim_as_value_p:
            add(eqn.params["dim"], src, True)
        for v in eqn.outvars:
            for d in _all_exprs(getattr(v.aval, "shape", ())):
                add(d, src, False)
        if not _has_inner(eqn):  # sizes in params: SAME padding, slice limits, ...
            found: list = []
            substitute_dims(dict(eqn.params), lambda d: found.append(d) or d)
            for d in found:
                add(d, src + f" ({eqn.primitive.name} param)", False)
    return table


def _walk_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for x in (p if isinstance(p, (tuple, list)) else (p,)):
                if isinstance(x, compat.ClosedJaxpr):
                    yield from _walk_eqns(x.jaxpr)
                elif isinstance(x, compat.Jaxpr):
                    yield from _walk_eqns(x)


def _has_inner(eqn) -> bool:
    return has_inner_jaxpr(eqn.params)


def _short_path(src: str) -> str:
    m = re.match(r"(.*):(\d+) \((.*)\)$", src)
    if not m:
        return src
    path = m.group(1)
    try:
        rel = os.path.relpath(path)
        if len(rel) < len(path):
            path = rel
    except ValueError:
        pass
    return f"{path}:{m.group(2)} ({m.group(3)})"
