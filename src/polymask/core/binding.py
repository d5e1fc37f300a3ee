"""How a call's arguments meet ``in_specs``: positions, keywords, defaults.

``mask`` takes a dict ``in_specs`` by parameter name and a sequence by
position (later entries reach keyword arguments of those parameters);
``polymask.jit`` places keyword arguments at their positions
(``keywords_as_positional``).
"""

from __future__ import annotations

import inspect
import weakref

from .errors import ShapeError, SpecError, counted
from .specs import check_in_specs_type

__all__ = ["split_specs", "keywords_as_positional", "check_arity", "specs_of_passed",
           "check_function_first"]


def check_function_first(fun, api: str) -> None:
    """``polymask.mask("n")`` / ``polymask.jit("n")``: a spec where the function
    goes (the decorator-factory form takes ``in_specs=`` by keyword).

    Raises:
      TypeError: ``fun`` is not callable.
    """
    if not callable(fun):
        raise TypeError(f"{api} takes the function first, got {fun!r}: {api}(f, {fun!r}), "
                        f"or as a decorator @{api}(in_specs={fun!r})")


def _parameters(fun):
    """(parameter name -> positional index, all parameter names or None if unknown)."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return {}, None
    index = {}
    for i, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        index[p.name] = i
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return index, None  # **kwargs: any name may be passed
    return index, {p.name for p in params if p.kind is not p.VAR_POSITIONAL}


def runner_specs(fun, in_specs, runner: str, accepts_dict: bool = True) -> tuple | None:
    """A runner's ``in_specs`` as a tuple by position (None stays None).

    A string is the spec of the one argument. A dict is keyed by parameter
    name or position, as ``mask``'s: entries of ``fun``'s positional
    parameters, the others None (``accepts_dict=False``: the runner's specs
    cover only some of ``fun``'s parameters, so a dict is refused). A dict is
    never read as the sequence of its keys.

    Raises:
      ShapeError: a dict names a parameter ``fun`` does not take as a
        positional one, or the runner takes no dict.
    """
    check_in_specs_type(in_specs)
    if in_specs is None:
        return None
    if isinstance(in_specs, str):
        return (in_specs,)
    if not isinstance(in_specs, dict):
        return tuple(in_specs)
    one_pytree = (f"; the specs of one pytree argument go in a tuple of one: "
                  f"in_specs=({in_specs!r},)")
    if not accepts_dict:
        raise ShapeError(f"{runner}: in_specs is a dict; give a tuple with one spec per "
                         f"example argument{one_pytree}")
    index, _ = _parameters(fun)
    pos = {}
    for key, spec in in_specs.items():
        if isinstance(key, int):  # a position (any, where the signature is unknown)
            i = key if key >= 0 and (not index or key < len(index)) else None
        else:
            i = index.get(key)
        if i is None:
            raise ShapeError(
                f"{runner}: in_specs names {key!r}, which is not a positional parameter of "
                f"{getattr(fun, '__name__', 'fun')} (positional parameters: {list(index)})"
                f"{one_pytree}")
        pos[i] = spec
    return tuple(pos.get(i) for i in range(max(len(index), max(pos) + 1 if pos else 0)))


def split_specs(fun, in_specs, n_args: int, kwargs: dict):
    """``in_specs`` -> (positional specs or None, {kwarg name: spec}).

    A dict ``in_specs`` is keyed by parameter name (or positional index); a name
    resolves to the keyword argument of that name when passed by keyword, else
    to its position in ``fun``'s signature. Arguments without an entry get no
    spec (plain arrays are unpadded). A name the call does not pass (its
    default is used) is ignored; a name ``fun`` does not take is an error.
    """
    if in_specs is None:
        return None, {}
    if not isinstance(in_specs, dict):
        return _sequence_specs(fun, in_specs, n_args, kwargs)
    pos: list = [None] * n_args
    kw: dict = {}
    params = None
    for key, spec in in_specs.items():
        if isinstance(key, int):
            if not 0 <= key < n_args:
                raise ShapeError(f"in_specs[{key}]: the function was called with {n_args} "
                                 "positional arguments")
            pos[key] = spec
            continue
        if key in kwargs:
            kw[key] = spec
            continue
        if params is None:
            params = _parameters(fun)
        index, names = params
        if key in index:
            if index[key] < n_args:
                pos[index[key]] = spec
        elif names is not None and key not in names:
            raise ShapeError(
                f"in_specs names argument '{key}', which {getattr(fun, '__name__', 'fun')} "
                f"does not take (parameters: {sorted(names)})")
    return tuple(pos), kw


def _sequence_specs(fun, in_specs, n_args: int, kwargs: dict):
    """A spec sequence longer than the positional arguments: its later entries
    go to the keyword arguments passed for those parameters (as
    ``polymask.jit`` places keywords at their positions); entries of
    parameters left to their defaults are dropped."""
    if not isinstance(in_specs, (tuple, list)) or len(in_specs) <= n_args:
        return in_specs, {}
    try:
        params = list(_signature(fun).parameters.values())
    except (TypeError, ValueError):
        return in_specs, {}
    later = params[n_args:len(in_specs)]
    if len(later) < len(in_specs) - n_args or any(
            p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            or (p.name not in kwargs and p.default is p.empty) for p in later):
        return in_specs, {}  # not parameters with a keyword or a default: the count error
    kw = {p.name: spec for p, spec in zip(later, in_specs[n_args:]) if p.name in kwargs}
    return tuple(in_specs[:n_args]), kw


_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(fun) -> inspect.Signature:
    """``inspect.signature(fun)``, kept per function (it costs ~10 us a call)."""
    try:
        return _SIGNATURES[fun]
    except (KeyError, TypeError):  # TypeError: not weak-referenceable or unhashable
        pass
    sig = inspect.signature(fun)
    try:
        _SIGNATURES[fun] = sig
    except TypeError:
        pass
    return sig


def specs_of_passed(in_specs, n_args: int):
    """``in_specs`` (a tuple by position) for a call passing ``n_args``
    positional arguments: the entries of parameters after them, left to
    ``fun``'s defaults (``keywords_as_positional``), are dropped."""
    if isinstance(in_specs, tuple) and n_args < len(in_specs):
        return in_specs[:n_args]
    return in_specs


def check_arity(fun, args: tuple, kwargs: dict | None = None) -> None:
    """Raise Python's ``TypeError`` where ``fun(*args, **kwargs)`` has too few
    or too many arguments (``jax.jit`` raises it before tracing; polymask would
    report it from the trace as a failure at every size, or blame the specs).
    Nothing where ``fun`` has no inspectable signature."""
    try:
        sig = _signature(fun)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **(kwargs or {}))
    except TypeError as e:
        raise TypeError(f"{getattr(fun, '__name__', 'fun')}(): {e}") from None


class KeywordWithoutSpec(ShapeError):
    """A keyword argument with no position in ``in_specs`` (keyword-only, taken
    by ``**kwargs``, or past the last spec): ``polymask.jit`` runs such a call
    per exact shape, as ``jax.jit`` (``runners/polyjit.py``)."""


def keywords_as_positional(fun, in_specs, args: tuple, kwargs: dict) -> tuple:
    """The positional arguments of a call ``fun(*args, **kwargs)`` (``polymask.jit``).

    A keyword argument of a positional-or-keyword parameter takes that
    parameter's place (parameters skipped before it take their defaults), so
    ``f(x, mask=m)`` is planned as ``f(x, m)`` and ``in_specs`` applies by
    position; parameters after the last one the call passes are left out
    (``fun``'s defaults, not inputs). A keyword argument with no place there
    (keyword-only or ``**kwargs`` parameters, or a position ``in_specs`` gives
    no entry) has no spec to pad it by and raises.

    Raises:
      TypeError: the call does not match ``fun``'s signature (as ``fun``
        itself would), or ``fun`` has no inspectable signature.
      ShapeError: ``in_specs`` has more entries than ``fun`` has positional
        parameters, or gives no entry for a keyword argument's position or
        cannot (keyword-only parameters); the message says what to do.
    """
    name = getattr(fun, "__name__", "fun")
    try:
        sig = _signature(fun)
    except (TypeError, ValueError):
        if not kwargs:  # no defaults to fill in: the in_specs check reports the count
            return args
        raise TypeError(f"polymask.jit: {name} has no inspectable signature: pass "
                        f"{sorted(kwargs)} positionally") from None
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{name}(): {e}") from None
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in positional]
    n_specs = None if in_specs is None else len(in_specs)
    if n_specs is not None and n_specs > len(names) and not any(
            p.kind is p.VAR_POSITIONAL for p in params):
        raise SpecError(f"in_specs has {counted(n_specs, 'entry')} but {name} takes "
                         f"{counted(len(names), 'positional parameter')} ({', '.join(names)})")
    for k in kwargs:
        i = names.index(k) if k in names else None
        if i is None:
            raise KeywordWithoutSpec(
                f"polymask.jit: {name}'s argument '{k}' is keyword-only (or taken by "
                "**kwargs), and polymask.jit plans positional arguments: for a Python "
                f"value, make it static: polymask.jit({name}, static_argnames='{k}'); for "
                "arrays (a PRNG key, weights), take them positionally in a wrapper with "
                f"an in_specs entry, e.g. polymask.jit(lambda p, x, key: {name}(p, x, "
                f"{k}=...key...), (None, 'n, 8', None)); or bind it first, "
                f"polymask.jit(functools.partial({name}, {k}=...), ...)")
        if n_specs is not None and i >= n_specs:
            raise KeywordWithoutSpec(
                f"polymask.jit: {name}'s argument '{k}' (passed by keyword) is argument {i}, "
                f"and in_specs has {counted(n_specs, 'entry')}: give it an entry (None for a static "
                "argument), or bind it first with functools.partial")
    # parameters the call skips before its last keyword take their defaults; later
    # ones are left out, and fun takes its own defaults, as under jax.jit (never
    # traced: `if mode == "sum":` on a default works)
    last = max([names.index(k) for k in kwargs] + [len(args) - 1])
    out = list(args)
    for p in positional[len(args):last + 1]:
        out.append(kwargs[p.name] if p.name in kwargs else p.default)
    return tuple(out)
