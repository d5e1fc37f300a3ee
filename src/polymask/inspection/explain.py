"""``explain``: the masked trace of a program, annotated equation by equation.

The masking interpreter runs once under ``jax.make_jaxpr`` with the logical
sizes traced, so every mask a rule inserts is visible. An interpreter
observer evaluates each user equation inside its own ``jax.named_scope``; the
equations of the masked jaxpr are attributed to user equations by their name
stack (nothing is traced twice). Size computations are listed once per
distinct dimension expression (``DimEnv.logical`` caches per expression).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import linecache
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from ..core.binding import specs_of_passed, split_specs
from ..core.diagnostics import refusal_line
from ..core.dimvars import describe_conditions, display_text
from ..core.errors import FailsAsPlainJax, ShapeError, SpecError, UnsupportedError, counted
from ..core.masked import Masked
from ..core.shapes import DimEnv
from ..core.specs import PLACEHOLDER_BOUND, args_from_specs, as_constraints, broadcast_specs
from ..tracing.cases.dispatch import case_program
from ..tracing.cases.splitting import trace_function_cases
from ..tracing.cases.tree import aval_text, per_size_reason
from ..tracing.interpreter import Interpreter, run_program, runs_rule
from ..tracing.prologue import solve_dim_vars
from ..tracing.registry import get_rule
from .arguments import (
    abstractify,
    dim_str,
    is_masked,
    is_shape_tuple,
    is_spec_tree,
    what_to_trace,
)
from .packed import explain_packed
from .sizetable import concrete_sizes, has_inner, short_path, sizes_table, walk_eqns

__all__ = ["explain", "Explanation", "Row"]


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

    def __new__(cls, text, rows, sizes, masked_jaxpr, header, internal=None):
        self = super().__new__(cls, text)
        self.rows, self.sizes, self.masked_jaxpr, self._header = rows, sizes, masked_jaxpr, header
        self._internal = internal or {}
        return self

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        def cell(text: str) -> Text:  # the spec's names; literal text ('[n]' is no markup)
            return Text(display_text(text, self._internal) if self._internal else text)

        sizes = Table(title="sizes (one computation each)", show_edge=False)
        for col in ("expression", "bound", "logical", "queries", "first use"):
            sizes.add_column(col)
        for e, s in self.sizes.items():
            sizes.add_row(*map(cell, (e, str(s["bound"]), _opt(s["logical"]),
                                      str(s["queries"]), s["first_use"])))
        eqns = Table(title="masked equations", show_edge=False)
        for col in ("#", "primitive", "shape", "bound", "rule", "inserted", "source"):
            eqns.add_column(col)
        for r in self.rows:
            eqns.add_row(*map(cell, (str(r.index), "  " * r.depth + r.primitive,
                                     ", ".join(r.shapes),
                                     ", ".join(_bound_str(b) for b in r.bounds), r.rule,
                                     _inserted_str(r), f"{short_path(r.source)}\n{r.code}")))
        return Group(cell(self._header), sizes, eqns)


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


def _source_code(src: str) -> str:
    m = re.match(r"(.*):(\d+) \(", src)
    if not m:
        return ""
    return linecache.getline(m.group(1), int(m.group(2))).strip()


def _tag(index: int) -> str:
    return f"polymask_eqn{index}"


class _Recorder:
    """Interpreter observer: one ``Row`` per user equation, evaluated in its own name scope."""

    def __init__(self, concrete: dict | None, internal: dict):
        self.show = lambda text: display_text(text, internal)  # spec dim var names
        self.rows: list[Row] = []
        self.prims: dict[str, tuple[Row, str]] = {}  # tag -> (row, primitive name)
        self.open: list[Row] = []  # rows being evaluated, innermost last
        self.concrete = concrete

    @contextlib.contextmanager
    def observe(self, eqn, state):
        dims = state.dims
        src = compat.source_line(eqn.source_info)
        if src.startswith("<unknown") and self.open:
            src = self.open[-1].source
        nested = has_inner(eqn)
        name = eqn.primitive.name
        if nested and isinstance(eqn.params.get("name"), str):
            name = f"{name}({eqn.params['name']})"
        rule = get_rule(eqn.primitive.name)
        static = rule is None or not runs_rule(eqn, state)
        size_query = (self.show(dim_str(eqn.params["dim"])) if eqn.primitive is compat.dim_as_value_p
                      else None)
        row = Row(index=len(self.rows) + 1, depth=len(self.open), primitive=name,
                  rule="static" if static else rule.__name__,
                  shapes=[self.show(aval_text(v.aval)) for v in eqn.outvars], bounds=[], logical=None,
                  inserted={}, size_query=size_query, source=src, code=_source_code(src),
                  nested=nested)
        self.rows.append(row)  # before the rule runs: nested equations come after it
        self.prims[_tag(row.index)] = (row, eqn.primitive.name)
        self.open.append(row)
        try:
            with jax.named_scope(_tag(row.index)):
                yield
        finally:
            self.open.pop()
        # After the rule: a data-dependent size gets its bound from the rule.
        shapes = [getattr(v.aval, "shape", ()) for v in eqn.outvars]
        row.bounds = [dims.padded_shape(s) for s in shapes]
        if self.concrete is not None and all(compat.dim_vars(d) <= set(self.concrete)
                                             for s in shapes for d in s):
            cd = DimEnv(dims.scope, dims.bounds, self.concrete)
            row.logical = [tuple(cd.logical(d) for d in s) for s in shapes]

    def attribute(self, masked_jaxpr, n_sizes: int) -> None:
        """Count, per row, the primitives of ``masked_jaxpr`` its rule inserted.

        An equation belongs to the innermost user equation on its name stack,
        or to the equation whose inner jaxpr holds it. Not counted: the
        equation's own primitive (once) and scalar size arithmetic (in the
        sizes table).
        """
        jaxpr = masked_jaxpr.jaxpr
        own_seen: set[int] = set()

        def walk(jaxpr, sizes: set, owner: Row | None):
            for eqn in jaxpr.eqns:
                tags = [self.prims[t] for t in compat.name_scopes(eqn.source_info)
                        if t in self.prims]
                row, prim = tags[-1] if tags else (owner, None)
                ins = [v for v in eqn.invars if not compat.is_jaxpr_literal(v)]
                if all(v in sizes for v in ins) and \
                        all(getattr(v.aval, "shape", None) == () for v in eqn.outvars):
                    sizes.update(eqn.outvars)
                    continue
                inner_owner = None
                if row is not None:
                    if prim is not None and row.index not in own_seen and \
                            eqn.primitive.name == prim:
                        own_seen.add(row.index)
                        inner_owner = row  # e.g. a scan body: the rule's masks in it
                    else:
                        row.inserted[eqn.primitive.name] = \
                            row.inserted.get(eqn.primitive.name, 0) + 1
                for sub, sub_sizes in _inner_jaxprs(eqn, sizes):
                    walk(sub, sub_sizes, inner_owner)

        walk(jaxpr, set(jaxpr.invars[len(jaxpr.invars) - n_sizes:]), None)


def _inner_jaxprs(eqn, sizes: set):
    """``(jaxpr, its input vars known to be sizes)`` for each inner jaxpr of ``eqn``.

    Only loop-invariant inputs are mapped: consts of a scan / while, operands
    of a cond, jit and other call-like primitives.
    """
    p = eqn.params
    for key, val in p.items():
        for x in (val if isinstance(val, (tuple, list)) else (val,)):
            if not compat.is_jaxpr(x):
                continue
            j = compat.open_jaxpr(x)
            outer = list(eqn.invars)
            if eqn.primitive.name == "scan":
                outer = outer[:compat.scan_counts(p)[0]]
            elif eqn.primitive.name == "while":
                nc = p["cond_nconsts"]
                outer = outer[:nc] if key == "cond_jaxpr" else outer[nc:nc + p["body_nconsts"]]
            elif eqn.primitive.name == "cond":
                outer = outer[1:]
            elif len(outer) != len(j.invars):
                outer = []
            yield j, {iv for ov, iv in zip(outer, j.invars)
                      if not compat.is_jaxpr_literal(ov) and ov in sizes}


def _runner_arguments(runner, in_specs, args, constraints, dtype=jnp.float32):
    """``(in_specs, args, constraints)`` for explaining ``runner``: its own
    specs (fitted to the arguments: parameters and broadcast arguments get
    None) and constraints unless given; an argument in the spec slot that is
    no spec is the first example argument (``explain(f, params, x)``);
    without arguments, a ``polymask.jit`` runner's last new call."""
    if not args and hasattr(runner, "example_arguments"):
        args = runner.example_arguments() or ()  # what the runner last compiled for
    elif hasattr(runner, "positional_arguments"):  # static arguments, defaults
        try:
            args = runner.positional_arguments(tuple(args))
        except TypeError as e:  # a forgotten params: the user's call, said as such
            fun = runner.fun
            raise ShapeError(f"explain: the example arguments do not fit "
                             f"{getattr(fun, '__name__', 'fun')}: {e} (pass them as you "
                             "would call the runner)") from None
    if in_specs is None and args and hasattr(runner, "explained_specs"):
        try:  # (a padded shape tuple is an array of that shape, not a tuple of ints)
            in_specs = runner.explained_specs(tuple(
                jax.ShapeDtypeStruct(tuple(a), dtype) if is_shape_tuple(a) else a
                for a in args))
        except ShapeError:  # the arguments do not fit: reported below, as a call would
            in_specs = runner.in_specs
    elif in_specs is None:
        in_specs = (runner.specs_for(len(args)) if hasattr(runner, "specs_for")
                    else getattr(runner, "in_specs", None))
    if args:
        in_specs = specs_of_passed(in_specs, len(args))
    constraints = as_constraints(constraints) or tuple(
        runner.explained_constraints() if hasattr(runner, "explained_constraints")
        else getattr(runner, "constraints", ()))
    return in_specs, tuple(args), constraints


def _placeholder_arguments(runner, in_specs, dtype) -> tuple:
    """Arguments built from spec strings (a placeholder bound per dim var).

    Raises:
      ShapeError: a spec that is not a string; for a runner, what to pass
        instead (``value_and_grad`` and ``ragged_map`` always need arguments:
        their specs leave out parameters and broadcast arguments).
    """
    try:
        if runner is not None and not hasattr(runner, "example_arguments"):
            raise ShapeError("it needs them (its specs leave out parameters and "
                             "broadcast arguments)")
        return args_from_specs(in_specs, dtype)
    except ShapeError as e:
        if runner is None:
            raise
        reason = str(e).split("; pass example")[0]
        if hasattr(runner, "example_arguments"):  # polymask.jit
            how = ("them as you call the runner, explain(runner, *args) (arrays or "
                   "jax.ShapeDtypeStructs); or call the runner first: it is then explained "
                   "at its last new call's shapes")
        else:
            how = f"example arguments (arrays or jax.ShapeDtypeStructs): {_ONE_EXAMPLE}"
        raise ShapeError(
            f"explain({type(runner).__name__}) without example arguments: {reason}. Pass "
            f"{how}") from None


# what a ragged_map / value_and_grad runner is explained at (said where it was not)
_ONE_EXAMPLE = ("explain(runner, *args) takes one example's arguments, not the batch: for "
                "ragged_map the broadcast arguments, then one example's (explain(rm, xs[0])); "
                "for value_and_grad params, then one example's (explain(vg, params, xs[0]))")


def _refuse_a_batch(runner, in_specs, args) -> None:
    """A list of arrays where a ``ragged_map`` / ``value_and_grad`` spec is one
    spec string: the batch, given where one example goes (tracing it would
    report the user's function as failing on a list)."""
    if hasattr(runner, "example_arguments") or not isinstance(in_specs, (tuple, list)):
        return
    for i, (spec, a) in enumerate(zip(in_specs, args)):
        if isinstance(spec, str) and isinstance(a, (list, tuple)) and a and all(
                hasattr(v, "shape") for v in a):
            raise SpecError(
                f"explain: args[{i}] is a {type(a).__name__} of {counted(len(a), 'array')} where "
                f"in_specs[{i}] is one spec {spec!r}: {_ONE_EXAMPLE}")


def _at_runner_buckets(runner, args) -> tuple:
    """Example arrays at the runner's bucket (``PolyJit.padded_example``);
    arguments given as padded shapes or ``Masked`` values, or that do not fit
    the specs (reported below, as a call would), are explained as given."""
    given = jax.tree_util.tree_leaves(tuple(args), is_leaf=lambda v: is_masked(v) or
                                      is_shape_tuple(v))
    if any(is_masked(v) or is_shape_tuple(v) for v in given):
        return tuple(args)
    try:
        return runner.padded_example(args)
    except ShapeError:
        return tuple(args)


def _check_signature(fun, args) -> None:
    """Example arguments that ``fun`` cannot take (a forgotten ``params``)
    are the user's call, said as such (a trace would report it as a function
    that fails at every size)."""
    try:
        sig = inspect.signature(fun)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args)
    except TypeError as e:
        raise ShapeError(f"explain: the example arguments do not fit "
                         f"{getattr(fun, '__name__', 'fun')}{sig}: {e} (pass them as you "
                         "would call the function or runner)") from None


def explain(fun, in_specs=None, *args, constraints=(), dtype=jnp.float32, file=None,
            print_output: bool = True, layout: str | None = None, **kwargs):
    """Print and return the masked trace of ``fun``, annotated.

    Args:
      fun: as for ``polymask.mask``, a masked function (its function, specs
        and constraints), or a runner (``polymask.jit``,
        ``ragged_map``, ``value_and_grad``): its function, specs and
        constraints are explained; for ``polymask.jit`` and ``ragged_map``
        the program they compile (forward only, zero-padded inputs; for
        ``polymask.jit`` example arrays padded to the runner's bucket).
      in_specs: as for ``polymask.mask`` (default for a runner or a masked
        function: its own). An argument here that is no spec, an array or a
        pytree of them, is taken as the first example argument
        (``explain(f, params, x)``; for a plain function, default specs).
      constraints: as for ``polymask.mask``.
      *args: example arguments: ``Masked`` values (their logical sizes, when
        concrete, are shown as the "logical" column), arrays,
        ``jax.ShapeDtypeStruct``s or padded shapes (tuples of ints of dtype
        ``dtype``, default float32). Only shapes and dtypes are used; nothing
        is computed on the data. Without them: for a ``polymask.jit`` runner
        that has run, the shapes and dtypes of its most recent call with new
        shapes (``runner.example_arguments()``); else every input is built
        from its spec string with a placeholder bound per dim var (float32).
      file: where to print (default stdout); ``print_output=False`` only returns.
      **kwargs: for a ``polymask.jit`` runner, a call's keyword arguments
        (static ones without a position, ``train=False`` of flax's ``apply``,
        explain the runner they bind, as a call does).
      layout: ``"padded"`` (default, except for a ``ragged_map`` or
        ``value_and_grad`` made with ``layout="packed"``; a ragged_map's is
        explained with its row size: the masked program below) or
        ``"packed"``: how ``ragged_map`` (``value_and_grad``) would run ``fun``
        in the packed layout
        (``inspection/packed.py``): whether it can and why not (the primitive,
        the case, the user's line), the row size (the ragged axis's padded
        size in ``args``), and per equation its packed rule or that it was
        bound on shared values or ``vmap``-ed per example. Leading arguments
        whose spec is None are shared (``ragged_map``'s broadcast arguments).
        Returns a ``PackedExplanation`` (``.runs``, ``.reason``, ``.rows``,
        ``.padded_sizes``, ``.raising_sizes``: sizes where the function raises, as on
        the exact arrays).

    The masked program is traced once, with the logical sizes as *traced*
    int32 values (as under ``jax.jit``), so every mask the rules insert is
    shown. For each equation: its symbolic output shape, padded bound, the
    masking rule used, what the rule inserted (``select_n``, ``iota``/compare
    masks, dynamic slices, ...; ``static`` = bound unchanged, no mask), and
    the user source line. Size computations are listed once per distinct
    dimension expression.

    Returns:
      An ``Explanation``: a ``str`` with ``.rows``, ``.sizes``,
      ``.masked_jaxpr`` and a rich renderable (``rich.print(explanation)``).

    For a runner (``polymask.jit``, ``ragged_map``, ``value_and_grad``) the
    text also lists the buckets that have run per exact shape so far
    (``fun.fallbacks()``); where the masked trace fails at these sizes (a size
    needed as a Python value, a primitive without a rule), the runner runs
    them per exact shape as ``jax.jit`` does, and explain returns that, with
    the failure (the user's line and the ``jnp``/``lax`` form that gets
    sharing back), instead of raising.

    Raises:
      ShapeError: as ``mask`` does for bad specs, constraints or arguments
        (example ``Masked`` sizes of the wrong rank or type, or where it fails;
        for a runner, only where plain JAX fails too).
      UnsupportedError: ``fun`` uses a primitive without a masking rule (not
        for a runner: it runs those sizes per exact shape).
    """
    if kwargs:  # a polymask.jit call's keywords: static ones bind a runner, as a call does
        if not hasattr(fun, "explained_runner"):
            raise TypeError(f"explain takes keyword arguments of a polymask.jit call only; got "
                            f"{sorted(kwargs)} (pass them positionally, or bind them with "
                            "functools.partial)")
        if in_specs is not None and not is_spec_tree(in_specs):
            args, in_specs = (in_specs, *args), None
        fun, args = fun.explained_runner(args, kwargs)
    if layout is None:  # a runner made with layout="packed" runs it: explain that
        layout = ("packed" if _is_runner(fun) and getattr(fun, "layout", None) == "packed"
                  else "padded")
    if layout not in ("padded", "packed"):
        raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")
    if layout == "packed" and hasattr(fun, "row_size") and hasattr(fun, "explain"):
        return _packed_ragged_map(fun, in_specs, args, dtype, print_output, file)
    runner, fun = (fun, fun.fun) if _is_runner(fun) else (None, fun)  # trace the user's function
    fun, in_specs, args, constraints = what_to_trace(fun, in_specs, args, constraints)
    if runner is not None:
        in_specs, args, constraints = _runner_arguments(runner, in_specs, args, constraints,
                                                        dtype)
    placeholder = not args
    if placeholder:
        args = _placeholder_arguments(runner, in_specs, dtype)
    _check_signature(fun, args)
    if isinstance(in_specs, dict):  # by parameter name, as mask takes them: by position
        in_specs = split_specs(fun, in_specs, len(args), {})[0]
    # polymask.jit and ragged_map compile forward-only programs of zero-padded
    # inputs (mask(zero_padded=True, differentiable=False)): explain that program
    forward_only = runner is not None and getattr(runner, "FORWARD_ONLY", False)
    if forward_only and hasattr(runner, "padded_example") and not placeholder:
        args = _at_runner_buckets(runner, args)
    absargs = abstractify(args, in_specs, dtype)
    if runner is not None:  # specs that do not fit the arguments: the user's call, no fallback
        _refuse_a_batch(runner, in_specs, args)
        try:
            broadcast_specs(split_specs(fun, in_specs, len(absargs), {})[0], list(absargs),
                            is_masked)
        except ShapeError as e:
            if not any(isinstance(a, (list, tuple)) and a and hasattr(a[0], "shape")
                       for a in args):
                raise
            raise SpecError(f"{e}\n  ({_ONE_EXAMPLE})") from None
    if layout == "packed":
        plain = jax.tree_util.tree_map(lambda v: v.data if is_masked(v) else v, absargs,
                                       is_leaf=is_masked)
        result = explain_packed(fun, in_specs, plain, constraints,
                                runner=_runner_name(runner))
        if print_output:
            print(result, file=file)
        return result
    try:
        tree, absleaves = trace_function_cases(fun, absargs, in_specs, constraints)
    except (ShapeError, UnsupportedError) as e:
        if isinstance(e, SpecError) and runner is not None:  # the specs do not fit
            raise SpecError(f"{e}\n  (explain(runner, *args) takes the arguments in the "
                            "function's order: for value_and_grad params, then one "
                            "example's; for ragged_map the broadcast arguments, then one "
                            "example's)") from None
        return _per_shape_or_raise(runner, e, print_output, file)
    if getattr(runner, "per_size_buckets_per_shape", False) and per_size_reason(tree):
        # (polymask.jit compiles such a bucket per exact shape: runners/polyjit.py)
        result = _per_shape_explanation(runner, per_size_reason(tree), "")
        if print_output:
            print(result, file=file)
        return result
    prog = tree.base
    leaves_in = jax.tree_util.tree_leaves(tuple(args), is_leaf=lambda v: is_masked(v) or
                                          is_shape_tuple(v))
    ex_leaves = [Masked(b.data if is_masked(b) else b, a.shape) if is_masked(a) else b
                 for a, b in zip(leaves_in, absleaves)]
    concrete = concrete_sizes(prog, ex_leaves) if any(map(is_masked, leaves_in)) else None
    if concrete is not None and not tree.single:  # show the case the example sizes reach
        try:
            prog = case_program(tree, concrete) or prog
        except (ShapeError, UnsupportedError) as e:  # an error case (a runner: per shape)
            return _per_shape_or_raise(runner, e, print_output, file)

    # Every dynamic axis gets a traced int32 size so the masks become visible.
    n_sizes = sum(a.var is not None for axes in prog.axis_specs for a in axes)
    recorder = _Recorder(concrete, prog.internal)
    interp = Interpreter(observe=recorder.observe)

    def masked_program(datas, sizes):
        it = iter(sizes)
        leaves = []
        for d, axes in zip(datas, prog.axis_specs):
            shape = [int(np.shape(d)[a.axis]) if a.var is None else next(it) for a in axes]
            leaves.append(Masked(d, tuple(shape)))
        values, _ = solve_dim_vars(prog, leaves, checks_on=False)
        outs = run_program(prog, leaves, values, interpreter=interp,
                           zero_padded=forward_only, forward_only=forward_only)
        return [o.data for o in outs], [o.shape for o in outs]

    datas = [jax.ShapeDtypeStruct(tuple(np.shape(leaf.data if is_masked(leaf) else leaf)),
                                  leaf.dtype) for leaf in absleaves]
    sizes = [jax.ShapeDtypeStruct((), jnp.int32) for _ in range(n_sizes)]
    masked_jaxpr = jax.make_jaxpr(masked_program)(datas, sizes)
    recorder.attribute(masked_jaxpr, n_sizes)

    size_table = sizes_table(prog, concrete)
    paths = ["args" + jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(
        tuple(args), is_leaf=lambda v: is_masked(v) or is_shape_tuple(v))[0]]
    header = (_header(fun, prog, concrete, masked_jaxpr, paths) + tree.explain_header(prog)
              + _fallbacks_so_far(runner))
    if placeholder:
        header += (f"\n(no example arguments: every dim var has the placeholder bound "
                   f"{PLACEHOLDER_BOUND})")
    text = display_text(_render_text(header, size_table, recorder.rows), prog.internal)
    result = Explanation(text, recorder.rows, size_table, masked_jaxpr, header, prog.internal)
    if print_output:
        print(text, file=file)
    return result


def _packed_ragged_map(rm, in_specs, args, dtype, print_output: bool, file):
    """``explain(ragged_map, *broadcast, *example, layout="packed")``: the
    map's own packed explanation (``RaggedMap.explain``: its row size, not the
    example's length as the row); a padded shape tuple is an array of that
    shape of ``dtype``."""
    if in_specs is not None and is_spec_tree(in_specs) and not (in_specs == () and args):
        raise SpecError("explain(ragged_map, ..., layout='packed') explains the map with its "
                        "own specs: pass the broadcast arguments, then one example's")
    args = (in_specs, *args) if in_specs is not None else tuple(args)
    n_example = len(rm.in_specs) if isinstance(rm.in_specs, (tuple, list)) else 1
    if len(args) < n_example:
        raise SpecError(f"explain(ragged_map, *broadcast, *example, layout='packed') needs "
                        f"one example's {n_example} argument(s); got {len(args)} arguments")
    args = tuple(jax.ShapeDtypeStruct(tuple(a), dtype) if is_shape_tuple(a) else a
                 for a in args)
    split = len(args) - n_example
    return rm.explain(tuple(args[split:]), *args[:split], print_output=print_output, file=file)


def _runner_name(runner) -> str:
    """How the packed explanation names the runner (duck-typed: runners are a
    later layer): ``value_and_grad``'s objects hold ``argnums``."""
    return "value_and_grad" if hasattr(runner, "argnums") else "ragged_map"


def _is_runner(fun) -> bool:
    """``polymask.jit``, ``ragged_map`` or ``value_and_grad`` (they list the
    buckets that run per exact shape; duck-typed: runners are a later layer)."""
    return callable(getattr(fun, "fallbacks", None)) and callable(getattr(fun, "fun", None))


def _fallbacks_so_far(fun) -> str:
    if fun is None or not fun.fallbacks():
        return ""
    return "\nbuckets that run per exact shape, as jax.jit (fun.fallbacks()):\n" + "\n".join(
        f"  {bucket}: {refusal_line(reason)}" for bucket, reason in fun.fallbacks().items())


def _per_shape_or_raise(runner, error: BaseException, print_output: bool, file):
    """A failed masked trace: raised for a plain function or where plain JAX
    fails too (no fallback runs those sizes), else the runner's per-shape
    explanation."""
    if runner is None or isinstance(error, FailsAsPlainJax):
        raise error
    result = _per_shape_explanation(runner, error)
    if print_output:
        print(result, file=file)
    return result


def _per_shape_explanation(fun, error: BaseException | str,
                           why: str = "the masked trace fails") -> Explanation:
    """A runner whose masked trace fails at these sizes (or shares nothing: ``why``
    empty, ``error`` the reason): it runs them per exact shape under
    ``jax.jit`` (runners/fallback.py), so explain says so and why, instead of
    raising as ``mask`` does."""
    counted = ("stats()['exact_compiles']" if callable(getattr(fun, "stats", None))
               else "exact_compiles")  # value_and_grad: vg.exact_compiles, no stats()
    reason = str(error) if isinstance(error, str) else f"{type(error).__name__}: {error}"
    text = (f"{getattr(fun.fun, '__name__', type(fun).__name__)}: no shared program for these "
            "sizes; the runner runs them per exact shape under jax.jit (one compile per "
            f"distinct shape, jax.jit's values; counted in {counted}), "
            f"because{' ' + why if why else ''}:\n  "
            + reason.replace("\n", "\n  ") + _fallbacks_so_far(fun))
    return Explanation(text, [], {}, None, text)


def _header(fun, prog, concrete, masked_jaxpr, paths) -> str:
    name = getattr(fun, "__name__", repr(fun))
    lines = [f"polymask.explain: {name}"]
    ins = []
    if len(paths) != len(prog.axis_specs):  # not one program input per argument leaf
        paths = [None] * len(prog.axis_specs)
    for axes, lb, aval, leaf_path in zip(prog.axis_specs, prog.leaf_bounds,
                                         prog.closed_jaxpr.in_avals, paths):
        path = axes[0].path if axes else (leaf_path or "arg")
        ins.append(f"  {path}: {aval_text(aval)}  bound {_bound_str(lb)}")
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
    cons = [t for _, _, _, t in compat.explicit_constraints(prog.user_scope)  # as written
            if not re.fullmatch(r"\s*\w+\s*<=\s*\d+\s*", t)] if prog.user_scope else []
    lines += ["constraints: " + ", ".join(cons)] if cons else []
    if prog.conditions:
        lines.append("this case: " + describe_conditions(prog.conditions, prog.internal))
    outs = ", ".join(aval_text(v.aval) for v in prog.closed_jaxpr.jaxpr.outvars)
    lines.append(f"outputs: {outs}")
    n_eqns = sum(1 for _ in walk_eqns(masked_jaxpr.jaxpr))
    n_sel = sum(1 for e in walk_eqns(masked_jaxpr.jaxpr) if e.primitive.name == "select_n")
    n_user = sum(1 for _ in walk_eqns(prog.closed_jaxpr.jaxpr))
    lines.append(f"masked program: {n_eqns} equations ({n_sel} select_n) for {n_user} "
                 "user equations, sizes traced (as under jax.jit)")
    return "\n".join(lines)


def _render_text(header, size_table, rows: list[Row]) -> str:
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
            out.append(f"  {short_path(r.source)}" + (f":  {r.code}" if r.code else ""))
        line = (f"  {c[0]:<{widths[0]}}  {c[1]:<{widths[1]}}  bound {c[2]:<{widths[2]}}  "
                + (f"logical {c[3]:<{widths[3]}}  " if widths[3] else "")
                + f"{c[4]:<{widths[4]}}  {c[5]}")
        out.append(line.rstrip())
    return "\n".join(out)
