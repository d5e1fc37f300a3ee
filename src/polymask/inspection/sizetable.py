"""The size expressions of a traced program: ``polymask.explain``'s sizes table.

Every dimension expression the program uses (input dim vars, output shapes of
equations, sizes in equation params), its padded bound, its logical value at
the example sizes, and how often the program queries it as a value; and the
jaxpr walking ``explain`` shares with it.
"""

from __future__ import annotations

import os
import re

import numpy as np

from .. import _jax_compat as compat
from ..core.diagnostics import user_call_site
from ..core.shapes import DimEnv
from ..tracing.prologue import concrete_value, run_checks, solve_dim_vars
from ..tracing.registry import has_inner_jaxpr, substitute_dims
from .arguments import dim_str


def concrete_sizes(prog, leaves) -> dict | None:
    """Dim var values from example ``Masked`` sizes, when all are concrete.

    Raises:
      ShapeError: as the masked call would (a size outside its bound, sizes
        of one dim var that differ, a constraint that does not hold)."""
    values, checks = solve_dim_vars(prog, leaves, checks_on=False)
    if any(compat.is_tracer(v) for v in values.values()):
        return None
    run_checks([c for c in checks if concrete_value(c.bad) is not None], user_call_site())
    return {k: int(np.asarray(v)) for k, v in values.items()}


def _all_exprs(shapes_and_dims):
    for d in shapes_and_dims:
        if compat.is_dim_expr(d):
            yield d


def sizes_table(prog, concrete) -> dict[str, dict]:
    dims = DimEnv(prog.scope, prog.dim_bounds, {})
    cdims = DimEnv(prog.scope, prog.dim_bounds, concrete) if concrete else None
    table: dict[str, dict] = {}

    def add(d, where, query):
        key = prog.display(dim_str(d))
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
                          "first_use": where}
        if query:
            table[key]["queries"] += 1

    for v in prog.var_order:
        add(prog.spec_var_expr(v), "input", False)
    eqns = walk_eqns(prog.closed_jaxpr.jaxpr)
    for eqn in eqns:
        src = short_path(compat.source_line(eqn.source_info))
        if eqn.primitive is compat.dim_as_value_p:
            add(eqn.params["dim"], src, True)
        for v in eqn.outvars:
            for d in _all_exprs(getattr(v.aval, "shape", ())):
                # (a data-dependent size is born here: say which op counts it)
                count = compat.is_fresh_dim_name(dim_str(d))
                add(d, f"{src} (the count {eqn.primitive.name} returns)" if count else src,
                    False)
        if not has_inner(eqn):  # sizes in params: SAME padding, slice limits, ...
            found: list = []
            substitute_dims(dict(eqn.params), lambda d: found.append(d) or d)
            for d in found:
                add(d, src + f" ({eqn.primitive.name} param)", False)
    return table


def walk_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for inner, _ in compat.inner_jaxprs(eqn.params):
            yield from walk_eqns(inner)


def has_inner(eqn) -> bool:
    return has_inner_jaxpr(eqn.params)


def short_path(src: str) -> str:
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
