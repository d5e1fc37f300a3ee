"""Shape specs: parsing, dim vars, solving sizes for dim vars.

A spec uses the ``jax.export.symbolic_shape`` syntax, one per array leaf:
``"b, n, 64"``; ``"_"`` takes the padded size as a static axis; an axis may be
``a*k + c`` in one dim var (``"2*k"``), solved at run time as
``k = (size - c) / a`` with the divisibility checked in the prologue.
The same name on two inputs means the logical sizes must be equal.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .. import _jax_compat as compat
from .errors import ShapeError, SpecError, counted


@dataclasses.dataclass(frozen=True)
class AxisSpec:
    """How one axis of one input relates to the dim vars.

    ``expr`` is the symbolic size used for tracing (an int for a static axis).
    For a dynamic axis, ``size = coeff * var + offset``.
    """

    path: str
    axis: int
    expr: Any
    var: str | None = None
    coeff: int = 1
    offset: int = 0

    @property
    def where(self) -> str:
        return f"{self.path}.shape[{self.axis}]"


def _linear_in_one_var(e, where: str, written: str | None = None) -> tuple[str, int, int]:
    names = sorted(compat.dim_vars(e))
    if len(names) != 1 and len(_vars_written(written)) == 1:
        # JAX rewrote the axis by an equality constraint ('k == p + q')
        raise SpecError(
            f"{where}: spec axis '{written}' is '{e}' by an equality constraint of "
            f"mask(..., constraints=[...]) (like '{written} == {e}'), a size in several "
            f"dim vars {names}; polymask needs each axis's size in one dim var (like 'n' "
            f"or '2*k + 1'). Drop that constraint: '{written}' is then a dim var of its "
            "own, checked against the array's size as any other")
    if len(names) != 1:
        # ("seq-len" reads as seq - len: a name with a dash is two dim vars)
        dashed = " - " in str(e) and len(names) == 2
        raise SpecError(
            f"{where}: spec axis '{e}' must be an affine expression in one dim var "
            f"(like 'n' or '2*k + 1'); found vars {names}"
            + ("; a dim var name is an identifier and '-' subtracts: did you mean "
               f"'{str(e).replace(' - ', '_')}'?" if dashed else ""))
    (v,) = names
    b = int(compat.evaluate_dim(e, {v: 0}))
    a = int(compat.evaluate_dim(e, {v: 1})) - b
    if a <= 0 or int(compat.evaluate_dim(e, {v: 5})) != 5 * a + b:
        raise SpecError(
            f"{where}: spec axis '{e}' must be affine with a positive coefficient "
            f"(like 'n' or '2*k + 1')")
    return v, a, b


def _vars_written(text: str | None) -> set[str]:
    """The dim vars of a spec axis as written (before the scope's constraints)."""
    try:
        (e,) = jax.export.symbolic_shape(text)
    except Exception:  # (None, or a form the parser reads only in the scope)
        return set()
    return set(compat.dim_vars(e)) if compat.is_dim_expr(e) else set()


def parse_leaf_spec(spec: str | None, path: str, padded_shape: tuple[int, ...],
                    scope, default_dynamic: bool, name_gen) -> list[AxisSpec]:
    """Parse one leaf's spec into per-axis ``AxisSpec`` values.

    Raises:
      ShapeError: the spec does not parse, has the wrong rank, or gives a
        constant that differs from the padded size.
    """
    rank = len(padded_shape)
    if spec is None:
        if not default_dynamic:
            return [AxisSpec(path, i, int(b)) for i, b in enumerate(padded_shape)]
        spec = ", ".join(name_gen() for _ in range(rank))
    if not isinstance(spec, str):
        raise ShapeError(f"{path}: a shape spec must be a string like 'b, n, 64'; got {spec!r}")
    stripped = spec.strip().strip("()").strip()
    parts = [p.strip() for p in _split_top_level(stripped)] if stripped else []
    ellipsis = bool(parts) and parts[-1] == "..."
    if ellipsis:
        parts = parts[:-1]  # '...': the remaining axes, static at their padded sizes
    if "..." in parts:
        raise ShapeError(f"{path}: spec '{spec}': '...' may only be the last axis "
                         "(as in jax.export.symbolic_shape)")
    n_axes = len(parts)
    if n_axes != rank and not (ellipsis and n_axes <= rank):
        _raise_unparsable_axis(path, spec, parts, scope)  # 'n k' is a typo, not a rank
        raise SpecError(
            f"{path}: spec '{spec}' has {counted(n_axes, 'axis')} but the array has rank {rank} "
            f"(shape {tuple(padded_shape)})"
            + (" ('...' stands for the remaining axes)" if ellipsis else ""), names_example=True)
    for i, part in enumerate(parts):
        if part.isdigit() and int(part) != padded_shape[i]:
            raise SpecError(
                f"{path}.shape[{i}]: spec '{spec}' says {int(part)}, but the array's size "
                f"there is {padded_shape[i]}", names_example=True)
    try:
        # '...' expands to the padded sizes of the remaining axes (static), as
        # symbolic_shape(like=...) reads it; we do not pass `like` otherwise, so
        # that an equality constraint 'n == 3' reaches the message below.
        given = [str(int(padded_shape[i])) if p == "_" else p for i, p in enumerate(parts)]
        text = ", ".join(given + [str(int(d)) for d in padded_shape[len(parts):]])
        exprs = jax.export.symbolic_shape(f"({text})" if text else "()", scope=scope)
    except Exception as e:  # jax raises ValueError with its own parse message
        hint = next((h for h in map(_typo_hint, parts) if h), "")
        raise SpecError(f"{path}: cannot parse shape spec '{spec}'.{hint} JAX's parser "
                         f"says: {e}") from None
    axes = []
    for i, e in enumerate(exprs):
        where = f"{path}.shape[{i}]"
        if not compat.is_dim_expr(e):
            if int(e) != padded_shape[i] and i < len(parts) and not parts[i].isdigit():
                raise ShapeError(
                    f"{where}: spec '{spec}' gives axis '{parts[i]}', which the constraints "
                    f"fix to the constant {int(e)} (an equality constraint like "
                    f"'{parts[i]} == {int(e)}'), but the padded size is {padded_shape[i]}. "
                    "polymask cannot pad an axis whose size is a constant: pad that axis to "
                    f"exactly {int(e)}, or drop the equality constraint.")
            if int(e) != padded_shape[i]:
                raise SpecError(
                    f"{where}: spec '{spec}' says {int(e)}, but the array's size there is "
                    f"{padded_shape[i]}", names_example=True)
            axes.append(AxisSpec(path, i, int(e)))
            continue
        v, a, b = _linear_in_one_var(e, where, parts[i] if i < len(parts) else None)
        axes.append(AxisSpec(path, i, e, v, a, b))
    return axes


def _raise_unparsable_axis(path: str, spec: str, parts: list[str], scope) -> None:
    """``ShapeError`` naming the first axis of ``spec`` that does not parse."""
    for part in (p for p in parts if p != "_" and not p.isdigit()):
        try:
            jax.export.symbolic_shape(f"({part},)", scope=scope)
        except Exception as e:
            raise SpecError(f"{path}: cannot parse shape spec '{spec}' (axis '{part}')."
                             f"{_typo_hint(part)} JAX's parser says: {e}") from None


def _typo_hint(part: str) -> str:
    """The likely intent of an axis that does not parse, for the message
    ('' when none is clear): a missing comma or a missing '*'."""
    words = part.split()
    if len(words) > 1 and all(re.fullmatch(r"\w+", w) for w in words):
        return f" Axes are separated by commas: did you mean '{', '.join(words)}'?"
    product = re.fullmatch(r"(\d+)\s*([A-Za-z_]\w*)", part)
    if product:
        return f" A product needs '*': did you mean '{product[1]}*{product[2]}'?"
    return ""


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def _is_list_of_numbers(x) -> bool:
    """A list or tuple of numbers, nested or empty (``[1., 2.]``, ``[[1, 2]]``,
    ``[np.float32(1)]``, ``[]``): meant as one array."""
    if not isinstance(x, (list, tuple)):
        return False
    return all(isinstance(v, (int, float, complex, bool, np.number, np.bool_))
               or _is_list_of_numbers(v) for v in x)


def broadcast_specs(in_specs, args: Sequence[Any], is_leaf, labels=None) -> list:
    """One spec (or None) per array leaf of ``args``.

    ``in_specs`` is None, or a sequence with one entry per positional argument;
    each entry is a spec string applied to that argument (when it is a single
    array), None, or a pytree of specs matching the argument's structure.
    ``labels``: per argument, ``(spec_name, arg_name)`` for messages (default
    ``in_specs[i]``, ``args[i]``).
    """
    if labels is None:
        labels = [(f"in_specs[{i}]", f"args[{i}]") for i in range(len(args))]
    leaves_per_arg = [jax.tree_util.tree_leaves(a, is_leaf=is_leaf) for a in args]
    if in_specs is None:
        return [None for leaves in leaves_per_arg for _ in leaves]
    if isinstance(in_specs, str):
        in_specs = (in_specs,)
    in_specs = tuple(in_specs)
    if len(in_specs) != len(args):
        raise SpecError(
            f"in_specs has {counted(len(in_specs), 'entry')} but the function was called "
            f"with {counted(len(args), 'positional argument')}")
    out = []
    for (spec, arg, leaves, (sname, aname)) in zip(in_specs, args, leaves_per_arg, labels):
        if spec is None or isinstance(spec, str):
            if isinstance(spec, str) and len(leaves) != 1:
                hint = ("; give a pytree of specs" if not _is_list_of_numbers(arg) else
                        f" (a {type(arg).__name__} of numbers is a pytree of scalars to "
                        f"JAX): pass one array, np.asarray({aname})")
                raise ShapeError(
                    f"{sname} is one spec '{spec}' but {aname} has {len(leaves)} "
                    f"array leaves{hint}")
            out.extend([spec] * len(leaves))
            continue
        try:
            with_paths = jax.tree_util.tree_flatten_with_path(
                spec, is_leaf=lambda s: s is None or isinstance(s, str))[0]
            spec_leaves = [leaf for _, leaf in with_paths]
            spec_keys = [jax.tree_util.keystr(p) for p, _ in with_paths]
            arg_keys = [jax.tree_util.keystr(p) for p, _ in
                        jax.tree_util.tree_flatten_with_path(arg, is_leaf=is_leaf)[0]]
            struct_ok = spec_keys == arg_keys  # lists and tuples match each other
        except Exception:
            spec_keys = arg_keys = None
            struct_ok = False
        if not struct_ok:  # a None in the argument (eqx.partition's filtered-out
            try:  # leaves) holds no array: the spec's None there is no leaf either
                spec_leaves = jax.tree_util.tree_structure(arg, is_leaf=is_leaf).flatten_up_to(
                    spec)
                struct_ok = len(spec_leaves) == len(leaves)
            except Exception:  # noqa: BLE001 - the structures differ: said below
                pass
        if not struct_ok:
            raise ShapeError(f"{sname} does not match the structure of {aname}: "
                             f"spec leaves at {spec_keys}, array leaves at {arg_keys}")
        out.extend(spec_leaves)
    return out


def check_in_specs_type(in_specs) -> None:
    """``in_specs`` is None, a spec string, a dict (by parameter name or
    positional index) or a sequence (one entry per positional argument).

    Raises:
      TypeError: anything else, where the function or runner is made.
    """
    if in_specs is None or isinstance(in_specs, (str, dict, tuple, list)):
        return
    raise TypeError(f"in_specs must be None, a spec string such as 'n, 3', a tuple with one "
                    "entry per positional argument, or a dict by parameter name; got "
                    f"{in_specs!r} of type {type(in_specs).__name__}")


def as_constraints(constraints) -> tuple[str, ...]:
    """The ``constraints=`` argument as a tuple of strings, each parsed now
    (where the runner or masked function is made, not at its first call):
    one string is one constraint (``constraints="n >= 4"``), not its
    characters; None is none.

    Raises:
      ShapeError: not a string or a sequence of strings, or a constraint that
        does not parse.
    """
    if constraints is None:
        return ()
    if isinstance(constraints, str):
        constraints = (constraints,)
    try:
        out = tuple(constraints)
    except TypeError:
        raise ShapeError(f"constraints must be a string such as 'n >= 4' or a list of them; "
                         f"got {constraints!r}") from None
    for c in out:
        if not isinstance(c, str):
            raise ShapeError(f"constraints must be strings such as 'n >= 4'; got {c!r} "
                             f"of type {type(c).__name__} in {list(out)!r}")
    try:
        jax.export.SymbolicScope(out)
    except Exception as e:
        raise constraint_parse_error(out, e) from None
    return out


def constraint_parse_error(constraints, error: BaseException) -> SpecError:
    """The ``ShapeError`` for constraints that ``jax.export`` cannot parse:
    which one, JAX's reason, and the form it takes."""
    bad = []
    for c in constraints:
        try:
            jax.export.SymbolicScope((c,))
        except Exception:
            bad.append(c)
    which = f"{bad[0]!r}" if len(bad) == 1 else f"{list(constraints)}"
    reason = _constraint_fault(bad[0]) if len(bad) == 1 else None
    if reason is None:
        reason = str(error).splitlines()[0].rstrip(".") if str(error) else type(error).__name__
    return SpecError(
        f"cannot parse the constraint {which}: {reason}. Write each constraint as one "
        "comparison of dim vars and integers with '>=', '<=' or '==' (for n > 3 write "
        "'n >= 4'), one per string: constraints=['n >= 4', 'n <= 20']")


def unknown_dim_vars_error(constraint: str, unknown, known) -> SpecError:
    """The error for a constraint naming dim vars no spec defines."""
    return SpecError(f"constraint '{constraint}' names unknown dim vars {sorted(unknown)}; "
                     f"the specs define {sorted(known)}")


def _constraint_fault(constraint: str) -> str | None:
    """What is wrong with one constraint's form, in the user's terms, where
    JAX's parser reason would be about its internals (an unpacking error for
    a missing side); None to keep JAX's (a syntax error names the token)."""
    ops = re.findall(r"==|>=|<=", constraint)
    if not ops:
        return "it has no '>=', '<=' or '=='"
    if len(ops) > 1:
        return f"it holds {len(ops)} comparisons"
    left, _, right = constraint.partition(ops[0])
    if not left.strip() or not right.strip():
        return f"a side of '{ops[0]}' is empty"
    return None


def spec_identifiers(spec: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", spec))


def with_static_vars(spec, shape: tuple[int, ...], static_vars) -> Any:
    """``spec`` (one leaf's) with each axis named by dim vars of ``static_vars``
    only written as its size in ``shape`` (``"n, m"`` at shape ``(3, 5)`` with
    ``n`` static: ``"3, m"``); other specs unchanged (``parse_leaf_spec``
    reports their errors)."""
    if not isinstance(spec, str):
        return spec
    stripped = spec.strip().strip("()").strip()
    parts = [p.strip() for p in _split_top_level(stripped)] if stripped else []
    if len(parts) > len(shape) or (len(parts) < len(shape) and parts[-1:] != ["..."]):
        return spec
    out = [str(shape[k]) if (names := spec_identifiers(p)) and names <= static_vars else p
           for k, p in enumerate(parts)]
    return ", ".join(out)


def scope_and_name_generator(spec_leaves, constraints):
    """A ``SymbolicScope`` with the user's constraints, and a generator of fresh
    default dim var names (``s0``, ``s1``, ...) that avoid the names in specs.

    Raises:
      ShapeError: a constraint does not parse.
    """
    try:
        scope = jax.export.SymbolicScope(tuple(constraints))
    except Exception as e:
        raise constraint_parse_error(constraints, e) from None
    used: set[str] = set()
    for s in spec_leaves:
        if isinstance(s, str):
            used |= spec_identifiers(s)
    counter = itertools.count()

    def gen_name() -> str:
        while True:
            name = f"s{next(counter)}"
            if name not in used:
                return name

    return scope, gen_name


PLACEHOLDER_BOUND = 1024


def args_from_specs(in_specs, dtype):
    """Abstract arguments (``jax.ShapeDtypeStruct`` of ``dtype``) from spec
    strings alone (``shape_formula(fun, specs)``, ``explain``).

    Each dim var gets the placeholder bound ``PLACEHOLDER_BOUND`` (1024): the
    formulas hold for sizes up to it (``ShapeFormula.evaluate`` refuses larger
    ones) and ``ShapeFormula.bound`` is None.

    Raises:
      ShapeError: ``in_specs`` is None, an entry is not a string, or a spec
        does not parse.
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
            raise SpecError(f"{where}: cannot parse shape spec '{spec}': {e}") from None
        shape = []
        for e in exprs:
            names = compat.dim_vars(e)
            shape.append(int(compat.evaluate_dim(e, {v: PLACEHOLDER_BOUND for v in names})))
        return jax.ShapeDtypeStruct(tuple(shape), dtype)

    out = []
    for i, spec in enumerate(specs):
        out.append(jax.tree_util.tree_map(lambda s, i=i: one(s, f"in_specs[{i}]"), spec,
                                          is_leaf=lambda s: s is None or isinstance(s, str)))
    return tuple(out)
