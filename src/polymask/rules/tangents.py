"""Which equations of a JVP rule's jaxpr take tangents (a partial evaluation).

``rules/inlined.py`` runs a library primitive implemented in Python that a
JVP rule binds on tangents linearly, with the primitive's own transpose rule
(``jax.custom_derivatives.linear_call``), so that reverse mode never
transposes the implementation. Under ``jax.grad`` at the top level such
operands are JAX's unknown values (``compat.is_linearized``); inside ``cond``
or ``vmap`` JAX linearizes a rule by tracing it first, so they look like any
value. This module finds them in the rule's jaxpr as JAX's partial
evaluation would split it (``jax._src.interpreters.partial_eval``): through
calls, ``cond`` branches, and loop bodies to a fixed point of their carry.
"""

from __future__ import annotations

import numpy as np

from .. import _jax_compat as compat
from .util import is_inexact


def tangent_equations(jaxpr, tangent_invars) -> dict[int, tuple[int, ...]]:
    """``{id(eqn): positions of its operands computed from tangent_invars}`` for
    the equations of a JVP rule's ``jaxpr`` that bind a primitive implemented in
    Python (``rules/inlined.py`` runs those linearly, with their own
    transpose). Inside ``cond`` or ``vmap`` JAX linearizes a rule by tracing it
    first, so its tangents do not look like tangents yet
    (``trace_state().tangent_operands``). Which values are computed from the
    tangents follows JAX's partial evaluation, per equation: a call, a
    ``cond``'s branches, a loop's body to a fixed point of its carry; only
    floating values are tangents (a step count computed beside them is not)."""
    found: dict[int, tuple[int, ...]] = {}
    inputs = set(tangent_invars)
    _tangent_outputs(jaxpr, [v in inputs for v in jaxpr.invars], found)
    return found


def _tangent_outputs(jaxpr, tangent_in: list[bool], found: dict | None) -> list[bool]:
    """Which outputs of ``jaxpr`` are computed from its inputs flagged in
    ``tangent_in``; the equations on the way that bind a Python-implemented
    primitive go into ``found`` (None: not recorded)."""
    derived = {v for v, t in zip(jaxpr.invars, tangent_in) if t}

    def is_tangent(v) -> bool:
        return not compat.is_jaxpr_literal(v) and v in derived

    for e in jaxpr.eqns:
        ins = [is_tangent(v) for v in e.invars]
        if not any(ins):
            continue
        if found is not None and compat.has_python_impl(e.primitive):
            found[id(e)] = tuple(i for i, (t, v) in enumerate(zip(ins, e.invars))
                                 if t and is_inexact(v.aval.dtype))
        outs = _equation_tangent_outputs(e, ins, found)
        derived.update(o for o, t in zip(e.outvars, outs)
                       if t and is_inexact(getattr(o.aval, "dtype", np.int32)))
    return [is_tangent(v) for v in jaxpr.outvars]


def _equation_tangent_outputs(e, ins: list[bool], found) -> list[bool]:
    """Per output of equation ``e``, whether it is computed from its operands
    flagged in ``ins``: looked up inside calls, ``cond`` and loops; any other
    equation with a flagged operand flags every output."""
    p, name = e.params, e.primitive.name
    if name == "cond":
        outs = [False] * len(e.outvars)
        for branch, _ in compat.inner_jaxprs({"branches": p["branches"]}):
            outs = [a or b for a, b in zip(outs, _tangent_outputs(branch, ins[1:], found))]
        return [o or ins[0] for o in outs]
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        body = compat.open_jaxpr(p["body_jaxpr"])
        consts, carry = ins[nc:nc + nb], ins[nc + nb:]
        while True:  # to a fixed point: a carry once computed from a tangent stays so
            new = [a or b for a, b in zip(carry, _tangent_outputs(body, consts + carry, None))]
            if new == carry:
                break
            carry = new
        _tangent_outputs(body, consts + carry, found)
        return carry
    if name == "scan":
        nc, ncarry = compat.scan_counts(p)
        body = compat.open_jaxpr(p["jaxpr"])
        consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        while True:
            outs = _tangent_outputs(body, consts + carry + xs, None)
            new = [a or b for a, b in zip(carry, outs[:ncarry])]
            if new == carry:
                break
            carry = new
        return _tangent_outputs(body, consts + carry + xs, found)
    calls = [inner for inner, _ in compat.inner_jaxprs(p)
             if len(inner.invars) == len(e.invars) and len(inner.outvars) == len(e.outvars)]
    if len(calls) == 1:  # a call (jit, custom_jvp's primal): operands one to one
        return _tangent_outputs(calls[0], ins, found)
    return [True] * len(e.outvars)
