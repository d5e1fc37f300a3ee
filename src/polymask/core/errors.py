"""The exceptions polymask raises (locating and rewording them: ``diagnostics.py``)."""

from __future__ import annotations

__all__ = ["ShapeError", "SpecError", "about_example", "UnsupportedError", "TooManyCases",
           "FallbackWarning", "counted", "typed_as", "plain_type_of", "with_plain_state"]


class ShapeError(ValueError):
    """Bad logical sizes or shape specs.

    The message names the dimension variable, the offending values, the
    argument path (``args[1].shape[0]``) and the user's source line.

    ``fixed_size_vars``: the dim vars whose axes met a fixed size in the
    trace (``x @ W`` with ``W`` closed over), so they cannot be dim vars; a
    runner planning its own specs makes those axes static and traces again.
    """

    fixed_size_vars: tuple[str, ...] = ()

    def __str__(self) -> str:
        # polymask's message: not the plain type's __str__ (KeyError's quotes
        # its argument; ``typed_as``), nor args that are plain JAX's
        # (``with_plain_state``)
        message = self.__dict__.get("polymask_message")
        return message if message is not None else BaseException.__str__(self)


class SpecError(ShapeError):
    """The specs do not parse or do not fit the arguments: a spec that does not
    parse, a constraint naming an unknown dim var, an ``in_specs`` count, or
    an array whose rank or static size differs from its spec. No exact shape
    would make them right, so the runners raise it (never run the call per
    shape instead). ``names_example``: the arrays of one example are at
    fault (rank, a static size), not the specs alone; only then does a
    runner name the example."""

    def __init__(self, message: str = "", *, names_example: bool = False):
        super().__init__(message)
        self.names_example = names_example


def about_example(k: int, error: ShapeError, hint: str = "") -> ShapeError:
    """``error`` as raised for ``examples[k]`` of a ragged batch: prefixed with
    the example, unless no example is at fault (a ``SpecError`` of the specs
    alone); a ``SpecError`` stays one."""
    if not isinstance(error, SpecError):  # (of the plain JAX type it has, with its args)
        return with_plain_state(
            typed_as(ShapeError(f"examples[{k}]: {error}{hint}"), plain_type_of(error)),
            _plain_state_of(error))
    if error.names_example:
        return SpecError(f"examples[{k}]: {error}{hint}", names_example=True)
    return SpecError(f"{error}{hint}") if hint else error


_TYPED: dict = {}


def typed_as(error: ShapeError, plain_type: type | None) -> ShapeError:
    """``error`` also an instance of ``plain_type``, the exception plain JAX
    raises there (``IndexError`` for ``x[0]`` at n = 0, ``TypeError`` for a
    reshape that does not divide), so code written for ``jax.jit``
    (``except IndexError:``) still catches it: a ``ShapeError`` that loses
    nothing. Its class is ``ShapeError[IndexError]`` (made once per pair, and
    pickled by its two bases); ``error`` itself where it already is one (a
    ``ValueError``: a ``ShapeError`` is one) or cannot be combined with it (a
    class that takes other constructor arguments). Either way
    ``plain_type_of`` gives ``plain_type`` back."""
    if plain_type is None or not issubclass(plain_type, Exception):
        return error
    base = type(error).__bases__[0] if type(error).__dict__.get("_plain_type") else type(error)
    cls = False if issubclass(base, plain_type) else _typed_class(base, plain_type)
    if cls is False:
        out = error
    else:
        out = cls(*error.args)
        out.__dict__.update(error.__dict__)
        out.__cause__, out.__traceback__ = error.__cause__, error.__traceback__
    out.polymask_plain_type = plain_type
    return out


def _typed_class(base: type, plain_type: type):
    """The class ``base[plain_type]`` (False where the two cannot combine)."""
    key = (base, plain_type)
    cls = _TYPED.get(key)
    if cls is None:
        try:
            cls = type(f"{base.__name__}[{plain_type.__name__}]", (base, plain_type),
                       {"__module__": base.__module__, "__reduce__": _reduce_typed,
                        "_plain_type": plain_type})
            cls("a message")  # constructible from the message alone
        except Exception:  # noqa: BLE001 - a layout conflict or another signature
            cls = False
        _TYPED[key] = cls
    return cls


def with_plain_state(error: BaseException, plain: BaseException | None) -> BaseException:
    """``error`` (typed as ``type(plain)`` by ``typed_as``) carrying the state
    of ``plain``, the exception plain JAX raised on the exact arrays: its
    ``args`` (``except KeyError as e: e.args[0]`` is the missing key) and its
    attributes (a custom exception's ``e.code``), with ``str(error)`` still
    polymask's message. ``error`` as it is where it is not of that type."""
    if (plain is None or not isinstance(error, ShapeError)
            or not isinstance(error, type(plain)) or error is plain):
        return error
    message = str(error)
    for name, value in vars(plain).items():
        error.__dict__.setdefault(name, value)
    error.args = plain.args
    error.polymask_message = message
    return error


def _plain_state_of(error: BaseException) -> BaseException | None:
    """``error`` where it carries plain JAX's state (``with_plain_state``), as the
    exception ``with_plain_state`` copies it from."""
    if "polymask_message" not in error.__dict__:
        return None
    return error


def plain_type_of(error: BaseException) -> type | None:
    """The plain JAX exception type ``typed_as`` gave ``error`` (None: none)."""
    return getattr(error, "polymask_plain_type", None)


def _reduce_typed(self):
    base, plain = type(self).__bases__
    return _rebuild_typed, (base, plain, self.args, dict(self.__dict__))


def _rebuild_typed(base: type, plain: type, args: tuple, state: dict) -> ShapeError:
    error = base.__new__(base)
    error.args = args
    out = typed_as(error, plain)
    out.__dict__.update(state)
    return out


class UnsupportedError(NotImplementedError):
    """A primitive or a case polymask has no masking rule for.

    The message names the primitive, the user's source line and where the
    coverage table lives (``docs/coverage.md``).
    """


class FailsAsPlainJax(ShapeError):
    """The function fails at every logical size the call's bounds allow, as
    plain JAX does on the exact arrays (``top_k`` with ``k`` above the bound):
    the runners raise it as it is, with no per-shape fallback to try."""


class TooManyCases(ShapeError):
    """The trace needs more cases than ``max_cases``: size comparisons JAX
    cannot decide split it too often, or it takes a case per size (a size used
    as a Python int) and the bounds allow more than ``2 x max_cases`` sizes.

    ``reason``: the failure without the advice on ``max_cases`` (the packed
    layout, which needs one program for every size, gives its own)."""

    def __init__(self, message: str, reason: str | None = None,
                 fixed_size_vars: tuple[str, ...] = ()):
        super().__init__(message)
        self.reason = message if reason is None else reason
        self.fixed_size_vars = tuple(fixed_size_vars)


class FallbackWarning(UserWarning):
    """A runner (``polymask.jit``, ``ragged_map``, ``value_and_grad``) could not
    share one compiled program across the sizes of a bucket, so it runs the
    function per exact shape, as ``jax.jit`` does (one compile per distinct
    shape). Warned once per runner; the message gives the reason (the line
    that needs a size as a Python value, the primitive without a rule) and
    the rewrite that gets sharing back. ``runner.fallbacks()`` lists them.
    Also warned, once per ``polymask.mask`` function, where it is called
    inside the caller's ``jax.jit`` with logical sizes that are Python ints:
    they are static there, so each size compiles its own program.
    """


class PackedLayoutWarning(UserWarning):
    """``ragged_map(layout="packed")`` ran examples longer than ``row_size``
    padded, in length buckets. Their values are right; each bucket is one more
    compile. Warned once per runner; ``runner.stats()["layout"]["reason"]``
    says it for every call (and names the other sizes that run padded: those
    where the trace takes another case, such as ``x[1:]`` at ``n = 0``). A
    larger ``row_size`` packs longer examples."""


def install_extra(extra: str) -> str:
    """How to install one of polymask's extras, as messages say it: polymask is
    installed from its checkout (README), so ``pip install -e ".[serve]"``
    there; ``pip install polymask[...]`` finds no package on PyPI."""
    return f'pip install -e ".[{extra}]" (in the polymask checkout)'


def counted(n: int, noun: str) -> str:
    """``'1 axis'``, ``'2 axes'``: a count with its noun for messages (the
    nouns messages count: axis, entry, and regular plurals)."""
    if n == 1:
        return f"{n} {noun}"
    irregular = {"axis": "axes", "entry": "entries"}
    return f"{n} {irregular.get(noun, noun + 's')}"

