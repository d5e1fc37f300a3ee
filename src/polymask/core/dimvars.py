"""Internal dim vars: how a spec dim var that may be 0 is traced.

JAX's decision procedure assumes every dim var is >= 1, so ``x[:1]`` would
trace to length 1 for a size that may be 0. A spec dim var ``n`` is traced as
``n__p1 - 1`` with the internal dim var ``n__p1 = n + 1 >= 1`` (unless the
user's constraints say ``n >= 1``): JAX's own shape arithmetic is then exact at
0 (``min(n__p1 - 1, 1)``). Users never see the internal names:
``display_text`` writes them back in terms of ``n`` for messages, ``explain``
and ``shape_formula``.

``internal`` maps are ``{spec dim var: (internal name, offset)}``, internal =
spec + offset (offset 0: traced as is).
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np

from .. import _jax_compat as compat
from .errors import SpecError
from .shapes import SHIFT_SUFFIX
from .specs import constraint_parse_error

__all__ = ["describe_conditions", "display_text", "display_internal_names", "display_expr", "pretty_condition", "sizes_text", "to_internal", "displayed_error", "translate_constraint", "internal_names",
           "internal_scope"]


def display_internal_names(text: str) -> str:
    """``display_text`` for any internal dim var in ``text`` (``n__p1 - 1`` -> ``n``),
    where the trace's map is not at hand (a masking rule's message)."""
    names = set(re.findall(r"\b(\w+)" + re.escape(SHIFT_SUFFIX) + r"\b", text))
    return display_text(text, {v: (v + SHIFT_SUFFIX, 1) for v in names}) if names else text


# a polynomial as JAX prints one (``2*n__p1^2 - n__p1*m__p1 + 3``): terms joined by
# " + " / " - ", not part of a larger product or a function call
_TERM = r"(?:\d+\*)?[A-Za-z_]\w*(?:\^\d+)?(?:\*[A-Za-z_]\w*(?:\^\d+)?)*|\d+"
_POLYNOMIAL = re.compile(rf"(?<![\w*^/])(?:- )?(?:{_TERM})(?: [+-] (?:{_TERM}))*(?![\w(*^/])")


def display_text(text: str, internal: dict[str, tuple[str, int]]) -> str:
    """Rewrite internal dim var names in ``text`` (``n__p1 - 1`` -> ``n``).

    Polynomials are rewritten symbolically (``p__p1*q__p1 - p__p1 - q__p1 + 1``
    -> ``p*q``, by JAX's own normal form); what remains (a product with a
    ``max(...)``) textually, an internal name as ``(n + 1)``."""
    shifted = {name: (v, off) for v, (name, off) in internal.items() if off}
    if shifted and any(name in text for name in shifted):
        text = _POLYNOMIAL.sub(lambda m: _display_polynomial(m.group(0), shifted), text)
    for v, (name, off) in internal.items():
        if off == 0 or name not in text:
            continue
        pat = re.compile(r"(?P<sign>- )?(?P<coef>\d+\*)?\b" + re.escape(name)
                         + r"\b(?![*^])(?P<const> [+-] \d+(?![\w*^(]))?")

        def repl(m, v=v, off=off):
            sgn = -1 if m.group("sign") else 1
            a = int(m.group("coef")[:-1]) if m.group("coef") else 1
            c = int(m.group("const").replace(" ", "")) if m.group("const") else 0
            c += sgn * a * off
            term = ("- " if sgn < 0 else "") + (f"{a}*{v}" if a != 1 else v)
            if c > 0:
                term += f" + {c}"
            elif c < 0:
                term += f" - {-c}"
            return term

        text = pat.sub(repl, text)
        text = re.sub(r"\b" + re.escape(name) + r"\b", f"({v} + {off})", text)
    return text


def _display_polynomial(text: str, shifted: dict[str, tuple[str, int]]) -> str:
    """``text``, a polynomial over internal dim vars, in terms of the spec dim
    vars, in JAX's normal form; ``text`` itself where it names none or does not
    parse (English around it, an operator JAX does not write)."""
    if not any(re.search(r"\b" + re.escape(name) + r"\b", text) for name in shifted):
        return text
    try:
        (e,) = jax.export.symbolic_shape(text, scope=jax.export.SymbolicScope())
        return _over_spec_dim_vars(e, shifted) if compat.is_dim_expr(e) else text
    except Exception:  # noqa: BLE001 - not an expression after all: left as it is
        return text


def _over_spec_dim_vars(e, shifted: dict[str, tuple[str, int]]) -> str:
    """A polynomial dimension expression over internal dim vars, with each
    ``name`` replaced by ``v + off`` in a fresh scope: JAX's normal form
    over the spec dim vars, as text."""
    plain = jax.export.SymbolicScope()
    env = {}
    for name in compat.dim_vars(e):
        v, off = shifted.get(name, (name, 0))
        (x,) = jax.export.symbolic_shape(v, scope=plain)
        env[name] = x + off
    return str(compat.evaluate_dim(e, env))


_COMPARATOR = re.compile(r"\s*(>=|<=|==)\s*")


def translate_constraint(text: str, internal: dict[str, tuple[str, int]]) -> str:
    """A constraint over spec dim vars rewritten over the internal dim vars.

    Each side is parsed and ``v`` replaced by ``name - off`` symbolically (JAX's
    constraint syntax has no parentheses after ``*``). For ``==`` the constant
    moves to the right: JAX wants a single term on the left.
    """
    if not any(off for _, off in internal.values()):
        return text
    parts = _COMPARATOR.split(text.strip())
    if len(parts) != 3:
        return text  # JAX's own parser reports it
    lhs, op, rhs = parts
    inner = jax.export.SymbolicScope()
    try:
        left, right = to_internal(lhs, internal, inner), to_internal(rhs, internal, inner)
        if op == "==":
            const = _constant_term(left)
            left, right = left - const, right - const
    except Exception:
        return text
    return f"{left} {op} {right}"


def to_internal(text: str, internal: dict[str, tuple[str, int]], scope):
    """A dimension expression over spec dim vars (JAX syntax) as an expression of
    ``scope`` over the internal dim vars (``v`` -> ``name - off``)."""
    (e,) = jax.export.symbolic_shape(text, scope=jax.export.SymbolicScope())
    if not compat.is_dim_expr(e):
        return e
    env = {}
    for v in compat.dim_vars(e):
        name, off = internal.get(v, (v, 0))
        (x,) = jax.export.symbolic_shape(name, scope=scope)
        env[v] = x - off
    return compat.evaluate_dim(e, env)


_NOT_POLYNOMIAL = ("min(", "max(", "floordiv(", "mod(", "non_negative(")


def display_expr(d, internal: dict[str, tuple[str, int]]) -> str:
    """A dimension expression in terms of the spec dim vars, as text.

    A polynomial is rewritten symbolically (``n__p1*m__p1 - n__p1 - m__p1 + 1``
    -> ``m*n``); other expressions textually (``display_text``): JAX would
    simplify ``min(n, 1)`` assuming ``n >= 1`` in a scope over ``n``.
    """
    text = str(d) if compat.is_dim_expr(d) else str(int(d))
    if not compat.is_dim_expr(d) or any(op in text for op in _NOT_POLYNOMIAL):
        return display_text(text, internal)
    shifted = {name: (v, off) for v, (name, off) in internal.items() if off}
    if not compat.dim_vars(d) & set(shifted):
        return text
    try:
        return _over_spec_dim_vars(d, shifted)
    except Exception:
        return display_text(text, internal)


def _constant_term(e) -> int:
    """The constant term of a dimension expression as JAX prints it (``2*k - 2`` -> -2)."""
    text = str(e)
    head, sep, tail = max(text.rpartition(" + "), text.rpartition(" - "), key=lambda p: len(p[0]))
    if sep and tail.isdigit() and head.count("(") == head.count(")"):
        return int(tail) if sep == " + " else -int(tail)
    return 0


def internal_scope(constraints, conditions, internal, var_bounds):
    """The scope of the internal dim vars: the user's constraints (translated),
    each var's bound and the case's conditions (pinned to one value when they
    leave one). Returns ``(scope, pinned)``: the internal names of the vars
    pinned so (every var pinned: the trace is plain JAX's at one size)."""
    texts = [translate_constraint(c, internal) for c in constraints]
    texts += [f"{internal[v][0]} <= {b + internal[v][1]}" for v, b in var_bounds.items()]
    texts += list(conditions)
    try:
        scope = jax.export.SymbolicScope(tuple(texts))
        # the user's constraints count too: "t >= 3" and a case's "t <= 3" leave t = 3
        pins = _pinned(tuple(texts[:len(constraints)]) + tuple(conditions), internal,
                       var_bounds)
        if pins:  # a case for one size: traced at that size, as plain JAX would
            scope = jax.export.SymbolicScope(tuple(_unpinned(texts, pins) + pins))
    except Exception as e:
        if _unsatisfiable(e):
            raise _cannot_hold(constraints, var_bounds) from None
        raise constraint_parse_error(constraints, e) from None
    return scope, {p.split(" == ")[0] for p in pins}


def _unpinned(texts: list[str], pins: list[str]) -> list[str]:
    """The constraints of ``texts`` that name a var the ``pins`` (``"v == c"``)
    leave free. One over pinned vars only holds at the pins (they were read off
    it) and is a constant once JAX substitutes them, which its decision
    procedure cannot take (jax 0.10-0.12: AttributeError '_sorted_terms' on
    ``- min(4 - 1, 2) + 4 - 2 >= 0``)."""
    pinned = {p.split(" == ")[0] for p in pins}
    names = re.compile(r"\b[A-Za-z_]\w*\b(?!\s*\()")  # (not min(, max(, ...)
    return [t for t in texts if not set(names.findall(t)) <= pinned]


def _pinned(conditions, internal, var_bounds) -> list[str]:
    """``"v == c"`` for each internal dim var the case's conditions leave one value.

    Counted here over the var's range (JAX's bounds from several constraints on
    one var are not always tight); conditions over several vars are skipped.
    """
    out = []
    for v, (name, off) in internal.items():
        ok = set(range(off, var_bounds[v] + off + 1))
        for c in conditions:
            try:
                text, op, rhs = c.rsplit(" ", 2)
                (e,) = jax.export.symbolic_shape(text)
                rhs = int(rhs)
            except Exception:
                continue
            if compat.dim_vars(e) == {name} and op in _OPS:
                ok = {x for x in ok if _holds(e, name, x, op, rhs)}
        if len(ok) == 1:
            out.append(f"{name} == {ok.pop()}")
    return out


_OPS = {">=": int.__ge__, "<=": int.__le__, "==": int.__eq__, ">": int.__gt__, "<": int.__lt__}


def _holds(e, name: str, x: int, op: str, rhs: int) -> bool:
    """``e <op> rhs`` at ``name = x`` (a case's ``e >= 0`` / ``e <= -1``, a
    constraint's ``t >= 3``); True when undefined (x // 0)."""
    try:
        with np.errstate(all="raise"):
            return _OPS[op](int(compat.evaluate_dim(e, {name: x})), rhs)
    except (ArithmeticError, FloatingPointError):
        return True


def internal_names(var_order, var_bounds, constraints) -> dict[str, tuple[str, int]]:
    """Spec dim var -> (internal name, offset): shifted unless the constraints say >= 1."""
    shifted = {v: (v + SHIFT_SUFFIX, 1) for v in var_order}
    if not constraints:
        return shifted
    texts = [translate_constraint(c, shifted) for c in constraints]
    texts += [f"{n} <= {var_bounds[v] + off}" for v, (n, off) in shifted.items()]
    try:
        scope = jax.export.SymbolicScope(tuple(texts))
    except Exception:
        return shifted
    out = {}
    try:
        for v, (n, off) in shifted.items():
            (e,) = jax.export.symbolic_shape(n, scope=scope)
            out[v] = (v, 0) if compat.lower_bound(e - off) >= 1 else (n, off)
    except Exception as e:
        if _unsatisfiable(e):
            raise _cannot_hold(constraints, var_bounds) from None
        raise
    return out


def _unsatisfiable(e: BaseException) -> bool:
    """JAX's decision procedure found the constraints and bounds contradictory."""
    return "nsatisfiable" in str(e)


def _cannot_hold(constraints, var_bounds) -> SpecError:
    bounds = ", ".join(f"{v} <= {b}" for v, b in var_bounds.items())
    return SpecError(f"the constraints {list(constraints)} cannot hold at the sizes the "
                     f"arrays allow ({bounds}: their padded sizes)")


def displayed_error(e: BaseException, internal) -> BaseException:
    text = str(e)
    new = display_text(text, internal)
    if new == text:
        return e
    try:
        out = type(e)(new).with_traceback(e.__traceback__)
    except Exception:  # pragma: no cover - exotic subclass
        return e
    # (what polymask noted on the error: polymask_where, polymask_call_signature)
    for name, value in getattr(e, "__dict__", {}).items():
        if name.startswith("polymask_"):
            setattr(out, name, value)
    return out


def pretty_condition(text: str, internal) -> str:
    """``"n__p1 - 3 <= -1"`` -> ``"n <= 1"`` (other forms: the expression as is)."""
    expr, op, rhs = text.rpartition(" >= ")[0] or text.rpartition(" <= ")[0], \
        (">=" if " >= " in text else "<="), text.rsplit(" ", 1)[1]
    try:  # a polynomial is rewritten symbolically (display_expr)
        (e,) = jax.export.symbolic_shape(expr)
        shown = display_expr(e, internal)
    except Exception:
        shown = display_text(expr, internal)
    m = re.fullmatch(r"(- )?(\w+)(?: ([+-]) (\d+))?", shown)
    if not m:
        return _sum_condition(shown, op, int(rhs))
    neg, var = bool(m.group(1)), m.group(2)
    c = int(m.group(4) or 0) * (-1 if m.group(3) == "-" else 1)
    bound = int(rhs) - c  # (+/-) var op bound
    if neg:
        return f"{var} {'<=' if op == '>=' else '>='} {-bound}"
    return f"{var} {op} {bound}"


def _sum_condition(shown: str, op: str, rhs: int) -> str:
    """``"- mod(2, n) >= 0"`` -> ``"mod(2, n) <= 0"``; ``"- floordiv(n, 2) - n
    <= -1"`` -> ``"n + floordiv(n, 2) >= 1"``: terms mostly subtracted are
    negated (the comparison flips), and a constant term moves to the right."""
    terms = _signed_terms(shown)
    const = sum(sign * int(t) for sign, t in terms if t.isdigit())
    terms = [(sign, t) for sign, t in terms if not t.isdigit()]
    rhs -= const
    if sum(sign for sign, _ in terms) < 0:
        terms = [(-sign, t) for sign, t in terms]
        op, rhs = ("<=" if op == ">=" else ">="), -rhs
    terms.sort(key=lambda st: -st[0])  # (added terms first: no leading minus where any)
    text = " ".join(f"{'-' if sign < 0 else '+'} {t}" for sign, t in terms)
    return f"{text[2:] if text.startswith('+ ') else text} {op} {rhs}"


def _signed_terms(expr: str) -> list[tuple[int, str]]:
    """The top-level terms of ``"a - floordiv(n - 1, 2) + 3"`` with their signs."""
    terms, depth, start, sign = [], 0, 0, 1
    if expr.startswith("- "):
        sign, start = -1, 2
    i = start
    while i < len(expr):
        ch = expr[i]
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and expr.startswith((" + ", " - "), i):
            terms.append((sign, expr[start:i]))
            sign, start = (1 if expr[i + 1] == "+" else -1), i + 3
            i += 3
            continue
        i += 1
    terms.append((sign, expr[start:]))
    return terms


def sizes_text(assignments: list[dict[str, int]]) -> str:
    """``"n in {0, 3..5}"``; with several dim vars ``"m in {1}, n in {0..8}"``
    where the sizes are every combination of such sets, else
    ``"m=0, n=1; m=2, n=1"`` (one combination: ``"m=0, n=1"``)."""
    names = sorted(assignments[0])
    values = {k: sorted({a[k] for a in assignments}) for k in names}
    combos = {tuple(a[k] for k in names) for a in assignments}
    if len(names) == 1 or 1 < len(combos) == math.prod(len(v) for v in values.values()):
        return ", ".join(f"{k} in {_ranges(values[k])}" for k in names)
    shown = "; ".join(", ".join(f"{k}={a[k]}" for k in names) for a in assignments[:6])
    return shown + (f"; ... ({len(assignments)} in all)" if len(assignments) > 6 else "")


def _ranges(vals: list[int]) -> str:
    parts, start = [], None
    for i, v in enumerate(vals):
        if start is None:
            start = v
        if i + 1 == len(vals) or vals[i + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}..{v}")
            start = None
    return "{" + ", ".join(parts) + "}"


def describe_conditions(conditions, internal) -> str:
    """A case's conditions in the user's words: ``"n >= 3 and n <= 5"``;
    a case pinned to one size reads ``"n == 2"``."""
    parts = list(dict.fromkeys(pretty_condition(c, internal) for c in conditions))
    # a bound another one implies goes ("n >= 1 and n >= 2": "n >= 2")
    bounds = [re.fullmatch(r"(\w+) (>=|<=) (-?\d+)", p) for p in parts]
    tightest: dict = {}
    for m in bounds:
        if m:
            k, v = (m[1], m[2]), int(m[3])
            tightest[k] = max(v, tightest.get(k, v)) if m[2] == ">=" else min(
                v, tightest.get(k, v))
    parts = [p for p, m in zip(parts, bounds) if not m or tightest[(m[1], m[2])] == int(m[3])]
    for p in list(parts):
        m = re.fullmatch(r"(\w+) >= (-?\d+)", p)
        if m and f"{m[1]} <= {m[2]}" in parts:
            parts[parts.index(p)] = f"{m[1]} == {m[2]}"
            parts.remove(f"{m[1]} <= {m[2]}")
    return " and ".join(parts)
