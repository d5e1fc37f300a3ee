"""``shape_formula``: the symbolic output shapes of a masked program.

``shape_formula`` traces ``fun`` symbolically (as ``mask`` does) and returns
the output shapes as ``jax.export`` dimension expressions: the shape rule of
the whole program, in terms of the dim vars of the input specs. The argument
helpers here (``abstractify``; ``specs.args_from_specs``) are shared with
``polymask.explain``. With case splits (``tracing/cases/``) a formula that differs
between cases is piecewise (``ShapeFormula.cases``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from ..core.dimvars import display_expr, to_internal
from ..core.errors import ShapeError
from ..core.plan import check_constraints
from ..core.shapes import DimEnv
from ..core.specs import args_from_specs
from ..tracing.cases.splitting import trace_function_cases
from .arguments import abstractify, dim_str, what_to_trace

__all__ = ["shape_formula", "ShapeFormula"]

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
    internal: dict = dataclasses.field(repr=False, default_factory=dict)
    # piecewise: ((conditions in words, formula, conditions over internal dim vars), ...)
    cases: tuple = dataclasses.field(repr=False, default=())
    # sizes where the plain function raises: ((conditions in words, conditions, error), ...)
    error_cases: tuple = dataclasses.field(repr=False, default=())
    # spec dim var -> the largest size the trace assumed (the example's bucket)
    size_bounds: dict = dataclasses.field(repr=False, default_factory=dict)
    user_scope: Any = dataclasses.field(repr=False, default=None)  # the user's constraints

    def _str(self, d) -> str:
        return display_expr(d, self.internal)

    @property
    def strs(self) -> tuple[str, ...]:
        """Each axis in Python syntax."""
        return tuple(_py_expr(self._str(d)) for d in self.exprs)

    @property
    def jax_str(self) -> str:
        return _tuple_str(self._str(d) for d in self.exprs)

    @property
    def dim_vars(self) -> set[str]:
        names = set().union(*(compat.dim_vars(d) for d in self.exprs)) if self.exprs else set()
        back = {n: v for v, (n, _) in self.internal.items()}
        return {back.get(n, n) for n in names}

    @property
    def ndim(self) -> int:
        return len(self.exprs)

    def evaluate(self, **sizes) -> tuple[int, ...]:
        """The logical shape at the given dim var values (``f.evaluate(n=7)``).

        Raises:
          TypeError: a size is not an int (``bool``, ``float``, ``str``).
          ShapeError: the plain function raises at these sizes (``top_k`` with
            ``k > n``: the message is its error), a dim var is unknown or has
            no value, a constraint does not hold, or a size is negative or
            above the bound the formula was traced with (its size comparisons
            were decided for sizes up to that bound).
        """
        self._check_sizes(sizes)
        vals = self._values(sizes)
        for text, conditions, error in self.error_cases:
            missing = self._missing([_parse_condition(c)[0] for c in conditions], sizes)
            if missing:
                raise ShapeError(f"ShapeFormula.evaluate: no value for dim vars {missing} "
                                 f"(needed to tell whether the sizes reach a case where "
                                 f"the function raises: {text})")
            if all(_holds(c, vals) for c in conditions):
                raise ShapeError(f"ShapeFormula.evaluate: at {sizes} ({text}) the function "
                                 f"raises: {error}")
        if self.cases:  # piecewise: the case whose conditions hold at these sizes
            for _, formula, conditions in self.cases:
                if all(_holds(c, vals) for c in conditions):
                    return formula.evaluate(**sizes)
            raise ShapeError(f"ShapeFormula.evaluate: no case of {self} holds at {sizes}")
        return self._base_evaluate(**sizes)

    def _check_sizes(self, sizes: dict) -> None:
        known = set(self.size_bounds)  # the function's dim vars (a case's formula: unset)
        for k, x in sizes.items():
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                raise TypeError(f"ShapeFormula.evaluate: {k}={x!r} is not an int")
            if known and k not in known:
                raise ShapeError(f"ShapeFormula.evaluate: unknown dim var {k!r} (the formula's "
                                 f"dim vars are {sorted(known)})")
            if x < 0:
                raise ShapeError(f"ShapeFormula.evaluate: {k}={x}: sizes are >= 0")
            if x > self.size_bounds.get(k, x):
                raise ShapeError(f"ShapeFormula.evaluate: {k}={x} is above {self.size_bounds[k]}, "
                                 "the largest size the formula was traced for; trace it with "
                                 "larger example arguments")
        if self.user_scope is not None:  # (m == 2*k leaves k only: skip what names m)
            check_constraints(self.user_scope, {k: int(x) for k, x in sizes.items()}, True)

    def _values(self, sizes: dict) -> dict:
        """Dim var values (spec names) -> values of the internal names."""
        return {self.internal.get(k, (k, 0))[0]: int(x) + self.internal.get(k, (k, 0))[1]
                for k, x in sizes.items()}

    def _missing(self, exprs, sizes: dict) -> list[str]:
        """The spec names of dim vars in ``exprs`` that ``sizes`` gives no value."""
        back = {n: v for v, (n, _) in self.internal.items()}
        return sorted({back.get(n, n) for e in exprs for n in compat.dim_vars(e)} - set(sizes))

    def _base_evaluate(self, **sizes) -> tuple[int, ...]:
        """``evaluate`` of this formula's own expressions (not its cases)."""
        out = []
        vals = self._values(sizes)
        for d in self.exprs:
            missing = self._missing([d], sizes)
            if missing:
                raise ShapeError(f"ShapeFormula.evaluate: no value for dim vars "
                                 f"{missing} (formula {self})")
            out.append(max(int(compat.evaluate_dim(d, {k: vals[k] for k in
                                                       compat.dim_vars(d)})), 0))
        return tuple(out)

    def _parse(self, text: str):
        """A dimension expression from jax syntax or Python syntax (``//``, ``%``)."""
        try:
            return to_internal(text, self.internal, self.scope)
        except Exception:
            pass
        names = set(re.findall(r"[A-Za-z_]\w*", text)) - {"floordiv", "mod"}
        try:
            env = {v: to_internal(v, self.internal, self.scope) for v in names}
            env.update(floordiv=lambda a, b: a // b, mod=lambda a, b: a % b)
            return eval(text, {"__builtins__": {}}, env)  # noqa: S307 (names are dim vars)
        except Exception:
            return None

    def _key(self):  # internal form: JAX's normal form of each expression
        return tuple(dim_str(d) for d in self.exprs)

    def _coerce(self, other):
        if isinstance(other, ShapeFormula):
            return other._key()
        if isinstance(other, (tuple, list)):
            key = []
            for d in other:
                if isinstance(d, (int, np.integer)):
                    key.append(str(int(d)))
                elif compat.is_dim_expr(d):
                    key.append(dim_str(d))
                elif isinstance(d, str):
                    e = self._parse(d)
                    if e is None:
                        return None
                    key.append(dim_str(e))
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
        if self.cases:
            return "; ".join(f"{f} if {text}" for text, f, _ in self.cases)
        return _tuple_str(self.strs)

    @property
    def errors(self) -> tuple[tuple[str, str], ...]:
        """Where the plain function (and ``evaluate``) raises: ``(sizes in words, error)``."""
        return tuple((text, error) for text, _, error in self.error_cases)

    def __repr__(self) -> str:
        raises = " or ".join(t for t, _, _ in self.error_cases)
        raises = f", raises when {raises}" if raises else ""
        return f"ShapeFormula({self}, bound={self.bound}, dtype={np.dtype(self.dtype).name}{raises})"


def _differs(i: int, per_case, live) -> bool:
    """Output ``i``'s formula differs between cases: as text, and (where the
    sizes reaching each case are known) in value: ``(n + 1) // 2`` for n >= 1
    and ``0`` for n = 0 are one formula."""
    if len({fs[i].strs for _, fs, _ in per_case}) == 1:
        return False
    first = per_case[0][1][i]
    for (_, fs, _), case in zip(per_case, live):
        if case.reached_by is None:
            return True
        for sizes in case.reached_by:
            try:
                if first._base_evaluate(**sizes) != fs[i].evaluate(**sizes):
                    return True
            except Exception:
                return True
    return False


def _parse_condition(condition: str):
    """``"n__p1 - 3 >= 0"`` -> (dimension expression, ``">="`` or ``"<="``, 0)."""
    head, _, rhs = condition.rpartition(" ")
    expr, _, op = head.rpartition(" ")
    (e,) = jax.export.symbolic_shape(expr)
    return e, op, int(rhs)


def _holds(condition: str, values: dict[str, int]) -> bool:
    """A case condition over internal dim vars (``"n__p1 - 3 >= 0"``) at their values."""
    e, op, rhs = _parse_condition(condition)
    v = int(compat.evaluate_dim(e, {k: values[k] for k in compat.dim_vars(e)}))
    return v >= rhs if op == ">=" else v <= rhs


def _tuple_str(parts) -> str:
    parts = list(parts)
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def shape_formula(fun, in_specs=None, *args, constraints=(), dtype=jnp.float32):
    """Symbolic output shapes of ``fun`` as dimension expressions.

    Args:
      fun: the function (as given to ``polymask.mask``), or a masked function
        (its function, specs and constraints).
      in_specs: as for ``mask``; with None every axis of every input gets its
        own dim var (``s0``, ``s1``, ...). An example argument here (no spec
        string) is the first of ``args``.
      *args: example arguments: arrays, ``Masked`` values,
        ``jax.ShapeDtypeStruct``s, or padded shapes given as tuples of ints
        (``dtype``, default float32). Only shapes and dtypes are used. Without
        them, every input is built from its spec string (``"n, 64"``).
      constraints: as for ``mask``.

    Returns:
      ``fun``'s output pytree with a ``ShapeFormula`` per array leaf, e.g.
      ``shape_formula(lambda x: x[::2], "n", (10,))`` gives ``((n + 1) // 2,)``.
    """
    fun, in_specs, args, constraints = what_to_trace(fun, in_specs, args, constraints)
    no_args = not args
    if no_args:
        args = args_from_specs(in_specs, dtype)
    absargs = abstractify(args, in_specs, dtype)
    tree, _ = trace_function_cases(fun, absargs, in_specs, constraints)

    def formulas(prog, bounds=None):
        dims = DimEnv(prog.scope, prog.dim_bounds, {})
        out = []
        for i, v in enumerate(prog.closed_jaxpr.jaxpr.outvars):
            shape = tuple(getattr(v.aval, "shape", ()))
            bound = None if no_args else (
                bounds[i] if bounds else tuple(dims.padded(d) for d in shape))
            out.append(ShapeFormula(shape, bound, v.aval.dtype, prog.scope, prog.internal))
        return out

    out = formulas(tree.base, None if tree.single else tree.out_bounds)
    live = [c for c in tree.cases if c.program is not None and c.reachable]
    if len(live) > 1:  # piecewise: each case's formula, with its conditions
        per_case = [(tree.describe_conditions(c), formulas(c.program), c.conditions)
                    for c in live]
        out = [dataclasses.replace(f, cases=tuple((text, fs[i], conds)
                                                  for text, fs, conds in per_case))
               if _differs(i, per_case, live) else f
               for i, f in enumerate(out)]
    errors = tuple((tree.describe_conditions(c), c.conditions, c.error.splitlines()[0])
                   for c in tree.cases if c.error is not None and c.reachable)
    bounds = dict(getattr(tree.base, "var_bounds", {}))
    out = [dataclasses.replace(f, error_cases=errors, size_bounds=bounds,
                               user_scope=getattr(tree.base, "user_scope", None)) for f in out]
    return jax.tree_util.tree_unflatten(tree.base.out_tree, out)
