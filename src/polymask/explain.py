"""Inspection: ``shape_formula`` (symbolic output shapes) and ``explain`` (the masked trace).

``shape_formula`` traces ``fun`` symbolically (as ``mask`` does) and returns
the output shapes as ``jax.export`` dimension expressions: the shape rule of
the whole program, in terms of the dim vars of the input specs.

``explain`` runs the masking interpreter under ``jax.make_jaxpr`` with the
logical sizes as traced values, so every mask a rule inserts is visible, and
reports each equation with its symbolic output shape, its padded bound, what
its masking rule emitted and the user source line it came from. Size
computations are listed once per distinct dimension expression: the masked
program computes each one once (``DimEnv.logical`` caches per expression),
however many times user code queries it.
"""

from __future__ import annotations

import collections
import dataclasses
import linecache
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_compat as compat
from .cases import trace_cases
from .errors import ShapeError
from .interpreter import Interpreter, all_sizes_at_bound, run_program
from .masked import Masked
from .prologue import solve_dim_vars
from .rules import get_rule
from .rules.registry import substitute_dims
from .shapes import DimEnv, is_static
from .state import RunState
from .trace import _translate, display_text

__all__ = ["shape_formula", "explain", "ShapeFormula", "Explanation"]


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
    internal: dict = dataclasses.field(repr=False, default_factory=dict)
    cases: tuple = dataclasses.field(repr=False, default=())

    def _str(self, d) -> str:
        return display_text(_dim_str(d), self.internal)

    @property
    def strs(self) -> tuple[str, ...]:
        """Each axis in Python syntax."""
        return tuple(_py_expr(_dim_str(d)) for d in self.exprs)

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
        """The logical shape at the given dim var values (``f.evaluate(n=7)``)."""
        out = []
        for d in self.exprs:
            back = {n: v for v, (n, _) in self.internal.items()}
            need = {back.get(n, n) for n in compat.dim_vars(d)}
            missing = need - set(sizes)
            if missing:
                raise ShapeError(f"ShapeFormula.evaluate: no value for dim vars "
                                 f"{sorted(missing)} (formula {self})")
            vals = {self.internal.get(k, (k, 0))[0]: int(x) + self.internal.get(k, (k, 0))[1]
                    for k, x in sizes.items()}
            out.append(max(int(compat.evaluate_dim(d, {k: vals[k] for k in
                                                       compat.dim_vars(d)})), 0))
        return tuple(out)

    def _parse(self, text: str):
        """A dimension expression from jax syntax or Python syntax (``//``, ``%``)."""
        text = _translate(text, self.internal)
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
        return tuple(self._str(d) for d in self.exprs)

    def _coerce(self, other):
        if isinstance(other, ShapeFormula):
            return other._key()
        if isinstance(other, (tuple, list)):
            key = []
            for d in other:
                if isinstance(d, (int, np.integer)):
                    key.append(str(int(d)))
                elif compat.is_dim_expr(d):
                    key.append(self._str(d))
                elif isinstance(d, str):
                    e = self._parse(d)
                    if e is None:
                        return None
                    key.append(self._str(e))
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
    tree, _ = trace_cases(fun, absargs, in_specs, constraints)
    live = [c for c in tree.cases if c.program is not None and c.reachable]

    def formulas(prog, bounds=None):
        dims = DimEnv(prog.scope, prog.dim_bounds, {})
        out = []
        for i, v in enumerate(prog.closed_jaxpr.jaxpr.outvars):
            shape = tuple(getattr(v.aval, "shape", ()))
            bound = None if no_args else (
                bounds[i] if bounds else tuple(dims.padded(d) for d in shape))
            out.append(ShapeFormula(tuple(shape), bound, v.aval.dtype, prog.scope,
                                    prog.internal))
        return out

    prog = tree.base
    out = formulas(prog, None if tree.single else tree.out_bounds)
    if len(live) > 1:  # piecewise: each case's formula, with its conditions
        per_case = [(tree.describe_conditions(c), formulas(c.program)) for c in live]
        out = [dataclasses.replace(f, cases=tuple((cond, fs[i]) for cond, fs in per_case))
               if len({fs[i].strs for _, fs in per_case}) > 1 else f
               for i, f in enumerate(out)]
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


# ----------------------------------------------------------------------------
# explain
# ----------------------------------------------------------------------------
_MASK_PRIMS = {"iota", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not",
               "select_n", "broadcast_in_dim", "convert_element_type"}


@dataclasses.dataclass
class Row:
    """One masked equation in ``Explanation.rows``."""

    index: int
    depth: int
    primitive: str
    rule: str
    shapes: list[str]          # symbolic output shapes, e.g. "f32[floordiv(n + 1, 2)]"
    bounds: list[tuple]        # padded output shapes
    logical: list[tuple] | None  # logical output shapes at the example sizes
    inserted: dict[str, int]   # primitives the rule emitted besides the op itself
    size_query: str | None     # the dimension expression of a dim_as_value
    source: str                # user file:line (function)
    code: str                  # the user's source text at that line
    nested: bool = False       # has inner jaxprs (their equations follow, indented)

    @property
    def selects(self) -> int:
        return self.inserted.get("select_n", 0)


class Explanation(str):
    """The text of ``polymask.explain`` (a ``str``), plus structured data.

    Attributes:
      rows: one ``Row`` per masked equation (nested ones have ``depth > 0``).
      sizes: ``{expr: {"bound", "logical", "queries", "first_use"}}`` for
        each distinct dimension expression of the program.
      masked_jaxpr: the whole masked program (sizes traced).
    """

    rows: list[Row]
    sizes: dict[str, dict]
    masked_jaxpr: Any

    def __new__(cls, text, rows, sizes, masked_jaxpr, header):
        self = super().__new__(cls, text)
        self.rows, self.sizes, self.masked_jaxpr, self._header = rows, sizes, masked_jaxpr, header
        return self

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        sizes = Table(title="sizes (one computation each)", show_edge=False)
        for col in ("expression", "bound", "logical", "queries", "first use"):
            sizes.add_column(col)
        for e, s in self.sizes.items():
            sizes.add_row(e, str(s["bound"]), _opt(s["logical"]), str(s["queries"]),
                          s["first_use"])
        eqns = Table(title="masked equations", show_edge=False)
        for col in ("#", "primitive", "shape", "bound", "rule", "inserted", "source"):
            eqns.add_column(col)
        for r in self.rows:
            eqns.add_row(str(r.index), "  " * r.depth + r.primitive, ", ".join(r.shapes),
                         ", ".join(_bound_str(b) for b in r.bounds), r.rule,
                         _inserted_str(r), f"{_short_path(r.source)}\n{r.code}")
        return Group(Text(self._header), sizes, eqns)


def _opt(x) -> str:
    return "-" if x is None else str(x)


def _bound_str(b) -> str:
    return "[" + ",".join(str(int(d)) for d in b) + "]"


def _inserted_str(r: Row) -> str:
    if r.size_query is not None:
        return f"size {r.size_query}"
    if r.nested:
        return "(inner equations below)"
    if not r.inserted:
        return "-"
    return " ".join(f"{k}\u00d7{v}" if v > 1 else k for k, v in r.inserted.items())


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


def _source_code(src: str) -> str:
    m = re.match(r"(.*):(\d+) \(", src)
    if not m:
        return ""
    return linecache.getline(m.group(1), int(m.group(2))).strip()


def _is_traced_array(x) -> bool:
    return compat.is_tracer(x) or isinstance(x, jax.Array)


class _ExplainInterpreter(Interpreter):
    """Logs every equation and traces each rule application on its own to see what it emits."""

    def __init__(self, concrete_sizes: dict | None):
        super().__init__()
        self.rows: list[Row] = []
        self.depth = 0
        self.concrete = concrete_sizes
        self._plain = Interpreter()
        self._src_stack: list[str] = []

    def eval_jaxpr(self, jaxpr, consts, args, state):
        self.depth += 1
        try:
            return super().eval_jaxpr(jaxpr, consts, args, state)
        finally:
            self.depth -= 1

    def _emitted(self, eqn, invals, state) -> dict[str, int] | None:
        """Primitives the rule emits for ``eqn`` (besides the op and size arithmetic)."""
        arr_idx = [i for i, x in enumerate(invals) if _is_traced_array(x)]
        dims = state.dims
        names = [k for k, v in dims.logical_values.items() if not is_static(v)]

        def sub(arrs, lvals):
            vals = list(invals)
            for i, a in zip(arr_idx, arrs):
                vals[i] = a
            lv = dict(dims.logical_values)
            lv.update(zip(names, lvals))
            env = RunState(DimEnv(dims.scope, dims.bounds, lv), self._plain,
                           list(state.jaxpr_stack), dict(state.invar_links))
            return self._plain.apply(eqn, vals, env)

        try:
            closed = jax.make_jaxpr(sub)([invals[i] for i in arr_idx],
                                         [dims.logical_values[k] for k in names])
        except Exception:
            return None
        jaxpr = closed.jaxpr
        size_vars = set(jaxpr.invars[len(arr_idx):])
        counts: collections.Counter = collections.Counter()
        op_seen = False
        for e in jaxpr.eqns:
            ins = [v for v in e.invars if not compat.is_jaxpr_literal(v)]
            if all(v in size_vars for v in ins) and \
                    all(getattr(v.aval, "shape", None) == () for v in e.outvars):
                size_vars.update(e.outvars)
                continue
            if e.primitive is eqn.primitive and not op_seen:
                op_seen = True
                continue
            counts[e.primitive.name] += 1
        return dict(counts)

    def apply(self, eqn, invals, state):
        dims = state.dims
        size_query = None
        nested = _has_inner(eqn)
        if eqn.primitive is compat.dim_as_value_p:
            size_query = _dim_str(eqn.params["dim"])
            inserted: dict | None = {}
        elif nested:
            inserted = {}
        else:
            inserted = self._emitted(eqn, invals, state)
        src = compat.source_line(eqn.source_info)
        if src.startswith("<unknown") and self._src_stack:
            src = self._src_stack[-1]
        avals = [v.aval for v in eqn.outvars]
        name = eqn.primitive.name
        if nested and isinstance(eqn.params.get("name"), str):
            name = f"{name}({eqn.params['name']})"
        row = Row(index=len(self.rows) + 1, depth=self.depth - 1, primitive=name,
                  rule="?", shapes=[_aval_str(a) for a in avals], bounds=[], logical=None,
                  inserted=inserted if inserted is not None else {"?": 1},
                  size_query=size_query, source=src, code=_source_code(src), nested=nested)
        self.rows.append(row)  # before the rule runs: nested equations come after it
        self._src_stack.append(src)
        try:
            outs = super().apply(eqn, invals, state)
        finally:
            self._src_stack.pop()
        rule = get_rule(eqn.primitive.name)
        static = rule is None or all_sizes_at_bound(eqn, dims)
        row.rule = "static" if static else getattr(rule, "__name__", "rule")
        row.bounds = [tuple(dims.padded(d) for d in getattr(a, "shape", ())) for a in avals]
        if self.concrete is not None:
            try:
                cd = DimEnv(dims.scope, dims.bounds, self.concrete)
                row.logical = [tuple(cd.logical(d) for d in getattr(a, "shape", ()))
                               for a in avals]
            except Exception:
                row.logical = None
        return outs


def _has_inner(eqn) -> bool:
    for p in eqn.params.values():
        for x in (p if isinstance(p, (tuple, list)) else (p,)):
            if isinstance(x, (compat.ClosedJaxpr, compat.Jaxpr)):
                return True
    return False


def _aval_str(aval) -> str:
    try:
        return aval.str_short(short_dtypes=True)
    except Exception:
        return str(aval)


def _concrete_sizes(prog, leaves) -> dict | None:
    """Dim var values from example ``Masked`` sizes, when all are concrete."""
    try:
        values, _ = solve_dim_vars(prog, leaves, checks_on=False)
    except Exception:
        return None
    out = {}
    for k, v in values.items():
        if compat.is_tracer(v):
            return None
        out[k] = int(np.asarray(v))
    return out


def explain(fun, in_specs=None, *args, constraints=(), dtype=jnp.float32, file=None,
            print_output: bool = True, width: int | None = None) -> Explanation:
    """Print and return the masked trace of ``fun``, annotated.

    Args:
      fun, in_specs, constraints: as for ``polymask.mask``.
      *args: example arguments: ``Masked`` values (their logical sizes, when
        concrete, are shown as the "logical" column), arrays,
        ``jax.ShapeDtypeStruct``s or padded shapes (tuples of ints, ``dtype``).
      file: where to print (default stdout); ``print_output=False`` only returns.

    The masked program is traced with the logical sizes as *traced* values
    (as under ``jax.jit``), so every mask the rules insert is shown. For each
    equation: its symbolic output shape, padded bound, the masking rule used,
    what the rule inserted (``select_n``, ``iota``/compare masks, dynamic
    slices, ...; ``static`` = bound unchanged, no mask), and the user source
    line. Size computations are listed once per distinct dimension expression.

    Returns:
      An ``Explanation``: a ``str`` with ``.rows``, ``.sizes``,
      ``.masked_jaxpr`` and a rich renderable (``rich.print(explanation)``).
    """
    placeholder = not args
    if placeholder:
        args = _args_from_specs(in_specs, dtype)
    absargs = _abstractify(args, in_specs, dtype)
    tree, absleaves = trace_cases(fun, absargs, in_specs, constraints)
    prog = tree.base
    leaves_in = jax.tree_util.tree_leaves(tuple(args), is_leaf=lambda v: _is_masked(v) or
                                          _is_shape_tuple(v))
    ex_leaves = []
    for a, b in zip(leaves_in, absleaves):
        if _is_masked(a):
            ex_leaves.append(Masked(b.data if _is_masked(b) else b, a.shape))
        else:
            ex_leaves.append(b)
    concrete = _concrete_sizes(prog, ex_leaves) if any(map(_is_masked, leaves_in)) else None

    # Every dynamic axis gets a traced int32 size so the masks become visible.
    dyn_pos = []
    for li, axes in enumerate(prog.axis_specs):
        for a in axes:
            if a.var is not None:
                dyn_pos.append((li, a.axis))

    interp = _ExplainInterpreter(concrete)

    def masked_program(datas, sizes):
        it = iter(sizes)
        leaves = []
        for li, (d, axes) in enumerate(zip(datas, prog.axis_specs)):
            shape = [int(np.shape(d)[a.axis]) if a.var is None else next(it) for a in axes]
            leaves.append(Masked(d, tuple(shape)))
        values, _ = solve_dim_vars(prog, leaves, checks_on=False)
        outs = run_program(prog, leaves, values, interpreter=interp)
        return [o.data for o in outs], [o.shape for o in outs]

    datas = [jax.ShapeDtypeStruct(tuple(np.shape(leaf.data if _is_masked(leaf) else leaf)),
                                  leaf.dtype) for leaf in absleaves]
    sizes = [jax.ShapeDtypeStruct((), jnp.int32) for _ in dyn_pos]
    masked_jaxpr = jax.make_jaxpr(masked_program)(datas, sizes)

    size_table = _size_table(prog, interp.rows, concrete)
    header = _header(fun, prog, concrete, masked_jaxpr)
    if not tree.single:
        header += ("\ncases (a size comparison JAX cannot decide; the sizes choose one at run "
                   "time; the trace below is case " f"{tree.cases.index(next(c for c in tree.cases if c.program is prog))}):\n"
                   + "\n".join("  " + ln for ln in tree.summary().splitlines()))
    if placeholder:
        header += (f"\n(no example arguments: every dim var has the placeholder bound "
                   f"{_PLACEHOLDER_BOUND})")
    text = display_text(_render_text(header, size_table, interp.rows, prog), prog.internal)
    result = Explanation(text, interp.rows, size_table, masked_jaxpr, header)
    if print_output:
        print(text, file=file)
    return result


def _all_exprs(shapes_and_dims):
    for d in shapes_and_dims:
        if compat.is_dim_expr(d):
            yield d


def _size_table(prog, rows, concrete) -> dict[str, dict]:
    dims = DimEnv(prog.scope, prog.dim_bounds, {})
    cdims = DimEnv(prog.scope, prog.dim_bounds, concrete) if concrete else None
    table: dict[str, dict] = {}

    def add(d, where, query):
        key = prog.display(_dim_str(d))
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
        e = prog.spec_var_expr(v)
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


def _header(fun, prog, concrete, masked_jaxpr) -> str:
    name = getattr(fun, "__name__", repr(fun))
    lines = [f"polymask.explain: {name}"]
    ins = []
    for axes, lb, aval in zip(prog.axis_specs, prog.leaf_bounds,
                              prog.closed_jaxpr.in_avals):
        path = axes[0].path if axes else "arg"
        ins.append(f"  {path}: {_aval_str(aval)}  bound {_bound_str(lb)}")
    lines.append("inputs:")
    lines.extend(ins)
    dv = []
    for v in prog.var_order:
        src = next((a.where for axes in prog.axis_specs for a in axes if a.var == v), "?")
        name, off = prog.internal.get(v, (v, 0))
        val = f" = {int(concrete[name]) - off}" if concrete and name in concrete else ""
        dv.append(f"{v} in [0, {prog.var_bounds[v]}] from {src}{val}")
    if dv:
        lines.append("dim vars: " + "; ".join(dv))
    cons = [t for _, _, _, t in compat.explicit_constraints(prog.scope)
            if not re.fullmatch(r"\s*\w+\s*<=\s*\d+\s*", t)]
    if cons:
        lines.append("constraints: " + ", ".join(cons))
    outs = ", ".join(_aval_str(v.aval) for v in prog.closed_jaxpr.jaxpr.outvars)
    lines.append(f"outputs: {outs}")
    n_eqns = sum(1 for _ in _walk_eqns(masked_jaxpr.jaxpr))
    n_sel = sum(1 for e in _walk_eqns(masked_jaxpr.jaxpr) if e.primitive.name == "select_n")
    n_user = sum(1 for _ in _walk_eqns(prog.closed_jaxpr.jaxpr))
    lines.append(f"masked program: {n_eqns} equations ({n_sel} select_n) for {n_user} "
                 "user equations, sizes traced (as under jax.jit)")
    return "\n".join(lines)


def _render_text(header, size_table, rows: list[Row], prog) -> str:
    out = [header, "", "sizes (each computed once in the masked program, however often queried):"]
    w = max([len(k) for k in size_table] + [10])
    out.append(f"  {'expression':<{w}}  {'bound':>5}  {'logical':>7}  {'queries':>7}  first use")
    for k, s in size_table.items():
        out.append(f"  {k:<{w}}  {s['bound']!s:>5}  {_opt(s['logical']):>7}  "
                   f"{s['queries']:>7}  {s['first_use']}")
    out.append("")
    out.append("equations (shape = symbolic output shape, bound = padded shape; "
               "[masking rule]; inserted = what the rule added:")
    out.append("  select_n = padding neutralised by a select, iota/lt/and = validity masks, "
               "pad/dynamic_slice/gather = moves to logical offsets; static = no mask needed):")
    seen_queries: dict[str, int] = {}
    cells = []
    any_logical = any(r.logical is not None for r in rows)
    for r in rows:
        ind = "  " * r.depth
        if r.size_query is not None:
            first = seen_queries.get(r.size_query)
            if first is None:
                seen_queries[r.size_query] = r.index
                ins = f"size query {r.size_query} (computed once)"
            else:
                ins = f"size query {r.size_query}: reuses #{first} (CSE)"
        else:
            ins = "inserted: " + _inserted_str(r)
        logical = "?" if any_logical else ""  # "?": a data-dependent size
        if r.logical is not None:
            logical = ", ".join("(" + ",".join(str(int(d)) for d in lg) + ")"
                                for lg in r.logical)
        cells.append((f"{r.index:>3} {ind}{r.primitive}", ", ".join(r.shapes),
                       ", ".join(_bound_str(b) for b in r.bounds), logical,
                       f"[{r.rule.removesuffix('_rule')}]", ins))
    widths = [max([len(c[i]) for c in cells] + [0]) for i in range(5)]
    last_src = None
    for r, c in zip(rows, cells):
        if r.source != last_src:
            last_src = r.source
            out.append(f"  {_short_path(r.source)}" + (f":  {r.code}" if r.code else ""))
        line = (f"  {c[0]:<{widths[0]}}  {c[1]:<{widths[1]}}  bound {c[2]:<{widths[2]}}  "
                + (f"logical {c[3]:<{widths[3]}}  " if widths[3] else "")
                + f"{c[4]:<{widths[4]}}  {c[5]}")
        out.append(line.rstrip())
    return "\n".join(out)
