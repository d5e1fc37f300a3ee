"""``jax.jit``'s static arguments for ``polymask.jit``: hashable Python values
(a mode string, a ``k`` for ``top_k``, a flag) that are part of the cache key
and reach ``fun`` as they are.

A static argument travels through the runner as a ``StaticArg``: a pytree node
with no leaves whose auxiliary data is the value
(``jax.tree_util.register_static``). The call's tree structure then carries
the value into every key the runner keeps (plans, programs, the per-shape
fallback), as ``jax.jit`` keys its programs on static arguments, and nothing in
the padding, planning or tracing machinery needs to know about it. ``fun`` is
wrapped once (``StaticArgs.unwrapping``) to hand the values back.

Keyword-only static parameters (``def f(x, *, train)``) take a position after
the positional ones in the wrapper's signature, so a call passing them by
keyword is planned by position like any other (``keywords_as_positional``)
instead of running per exact shape.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ..core.errors import SpecError

__all__ = ["StaticArg", "StaticArgs"]

_MISSING = object()  # the default of a moved keyword-only static parameter that has none


@jax.tree_util.register_static
class StaticArg:
    """One static argument's value, as a leafless pytree node. Equal when the
    values are equal and of the same type (``1``, ``1.0`` and ``True`` are
    different programs, as their results' dtypes can differ)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return hash((type(self.value), self.value))

    def __eq__(self, other):
        return (type(other) is StaticArg and type(other.value) is type(self.value)
                and bool(other.value == self.value))

    def __repr__(self):
        return f"static {self.value!r}"


def _as_tuple(x, kind, name: str) -> tuple:
    if x is None:
        return ()
    if isinstance(x, kind):
        return (x,)
    try:
        out = tuple(x)
    except TypeError:
        raise TypeError(f"polymask.jit: {name} takes {kind.__name__}s, got {x!r}") from None
    bad = [v for v in out if not isinstance(v, kind) or (kind is int and isinstance(v, bool))]
    if bad:
        raise TypeError(f"polymask.jit: {name} takes {kind.__name__}s, got {bad[0]!r}")
    return out


def _unhashable(value, error: Exception) -> ValueError:
    # jax.jit's wording and exception type, for code that catches it
    return ValueError(
        "Non-hashable static arguments are not supported. An error occurred while trying "
        f"to hash an object of type {type(value)}, {value!r}. The error was:\n"
        f"{type(error).__name__}: {error}\n(polymask keys its programs on static "
        "arguments, as jax.jit does: pass a hashable value, e.g. a tuple for a list)")


class StaticArgs:
    """Which parameters of ``fun`` are static, by position and by name (each
    given one derives the other from ``fun``'s signature, as ``jax.jit``), and
    the two ends of their journey through the runner: ``wrap`` at the call,
    ``unwrapping(fun)`` around the traced function.

    Raises (at construction, as ``jax.jit``):
      ValueError: a position past ``fun``'s positional parameters (without
        ``*args``), or a name ``fun`` does not take (without ``**kwargs``).
      TypeError: positions that are not ints, names that are not strings.
    """

    def __init__(self, fun: Callable, static_argnums: int | Sequence[int] | None,
                 static_argnames: str | Sequence[str] | None):
        nums = _as_tuple(static_argnums, int, "static_argnums")
        names = _as_tuple(static_argnames, str, "static_argnames")
        try:
            self.signature = inspect.signature(fun)
        except (TypeError, ValueError):
            self.signature = None
        params = [] if self.signature is None else list(self.signature.parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        var_args = any(p.kind is p.VAR_POSITIONAL for p in params)
        var_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
        fname = getattr(fun, "__name__", "fun")
        if self.signature is not None:
            if any(n < 0 for n in nums):
                nums = tuple(n + len(positional) if n < 0 else n for n in nums)
            if not var_args and any(not 0 <= n < len(positional) for n in nums):
                raise ValueError(
                    f"jitted function {fname} has static_argnums={nums}, but only accepts "
                    f"{len(positional)} positional arguments")
            known = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
            unknown = sorted(set(names) - known)
            if unknown and not var_kwargs:
                raise ValueError(
                    f"jitted function {fname} has invalid argnames {set(unknown)} in "
                    f"static_argnames. Function does not take these args.")
            by_name = {p.name: i for i, p in enumerate(positional)}
            nums = tuple(sorted(set(nums) | {by_name[n] for n in names if n in by_name}))
            names = tuple(dict.fromkeys(names + tuple(
                positional[n].name for n in nums if n < len(positional)
                and positional[n].kind is not inspect.Parameter.POSITIONAL_ONLY)))
        elif any(n < 0 for n in nums):
            raise ValueError(f"polymask.jit: negative static_argnums {nums} need "
                             f"{fname}'s signature, which cannot be inspected")
        self.argnums = frozenset(nums)
        self.argnames = frozenset(names)
        self.fun_name = fname
        # keyword-only static parameters, moved after the positional ones
        self.moved: tuple[str, ...] = () if var_args else tuple(
            p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name in self.argnames)
        self.n_positional = len(positional)
        self.required = tuple(name for name in self.moved
                              if self.signature.parameters[name].default is inspect.Parameter.empty)

    # -- at the call ----------------------------------------------------------------
    def wrap(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's static arguments as ``StaticArg``s (already wrapped ones,
        as ``PolyJit.example_arguments`` returns them, stay as they are)."""
        nums, names = self.argnums, self.argnames
        if self.moved and len(args) > self.n_positional:  # the moved places are keywords'
            n = self.n_positional
            raise TypeError(f"{self.fun_name}() takes {n} positional argument"
                            f"{'' if n == 1 else 's'} but {len(args)} were given")
        missing = [k for k in self.required if k not in kwargs]
        if missing:  # as Python says it (fun's own call would, inside a trace)
            raise TypeError(f"{self.fun_name}() missing {len(missing)} required keyword-only "
                            f"argument{'s' if len(missing) > 1 else ''}: "
                            + ", ".join(repr(k) for k in missing))
        if any(i in nums for i in range(len(args))):
            args = tuple(_wrapped(a) if i in nums else a for i, a in enumerate(args))
        if kwargs and not names.isdisjoint(kwargs):
            kwargs = {k: _wrapped(v) if k in names else v for k, v in kwargs.items()}
        return args, kwargs

    def specs(self, in_specs: tuple | None) -> tuple | None:
        """``in_specs`` (by position) with None at every static position and
        the moved keyword-only ones (a static argument has no spec).

        Raises:
          SpecError: a spec given for a static argument.
        """
        if in_specs is None:
            return None
        out = list(in_specs)
        for i, spec in enumerate(out):
            if i in self.argnums and spec is not None:
                raise SpecError(
                    f"polymask.jit: argument {i} of {self.fun_name} is static "
                    f"(static_argnums / static_argnames) and has the spec {spec!r}: a static "
                    "argument is a Python value, not an array; give it None in in_specs")
        last = max([*self.argnums, *self._moved_positions(), len(out) - 1])
        return tuple(out + [None] * (last + 1 - len(out)))

    def _moved_positions(self) -> range:
        return range(self.n_positional, self.n_positional + len(self.moved))

    # -- around the traced function ----------------------------------------------------
    def unwrapping(self, fun: Callable) -> Callable:
        """``fun`` taking ``StaticArg``s where it takes static arguments; its
        signature is ``fun``'s with the static defaults wrapped and the
        keyword-only static parameters made positional (after the others)."""
        moved = self.moved
        first_moved = self.n_positional

        def call(*args, **kwargs):
            if moved and len(args) > first_moved:
                extra = {name: a for name, a in zip(moved, args[first_moved:])}
                args = args[:first_moved]
                kwargs = {**kwargs, **{k: v for k, v in extra.items()
                                       if _unwrapped(v) is not _MISSING}}
            return fun(*map(_unwrapped, args),
                       **{k: _unwrapped(v) for k, v in kwargs.items()})

        functools.update_wrapper(call, fun)
        if self.signature is not None:
            call.__signature__ = self._signature()
        return call

    def _signature(self) -> inspect.Signature:
        P = inspect.Parameter
        params = list(self.signature.parameters.values())
        out = [p.replace(default=StaticArg(p.default))
               if p.name in self.argnames and p.default is not P.empty else p
               for p in params if p.name not in self.moved]
        at = next((i for i, p in enumerate(out)
                   if p.kind not in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)), len(out))
        # a moved parameter always has a default (_MISSING where fun gives none:
        # the call leaves it out of fun's keywords, and fun reports it missing),
        # so it may follow any positional parameter
        moved = [P(name, P.POSITIONAL_OR_KEYWORD, default=StaticArg(
            _MISSING if self.signature.parameters[name].default is P.empty
            else self.signature.parameters[name].default)) for name in self.moved]
        return self.signature.replace(parameters=out[:at] + moved + out[at:])


def _wrapped(value: Any) -> StaticArg:
    if type(value) is StaticArg:
        return value
    out = StaticArg(value)
    try:
        hash(out)
    except TypeError as e:
        raise _unhashable(value, e) from None
    return out


def _unwrapped(value: Any) -> Any:
    return value.value if type(value) is StaticArg else value
