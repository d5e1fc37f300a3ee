"""Errors raised by polymask and helpers that locate the user's source line."""

from __future__ import annotations

import os
import sys

__all__ = ["ShapeError", "UnsupportedError", "user_call_site", "at_call_site", "relocate"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


class ShapeError(ValueError):
    """Bad logical sizes or shape specs.

    The message names the dimension variable, the offending values, the
    argument path (``args[1].shape[0]``) and the user's source line.
    """


class UnsupportedError(NotImplementedError):
    """A primitive or a case polymask has no masking rule for.

    The message names the primitive, the user's source line and where the
    coverage table lives (``docs/coverage.md``).
    """


def _is_library_frame(filename: str) -> bool:
    filename = os.path.abspath(filename)
    if filename.startswith(_PKG_DIR):
        return True
    parts = filename.replace("\\", "/").split("/")
    # JAX, jaxlib, the stdlib's contextlib/functools: not the user's code.
    return any(p in ("jax", "jaxlib", "contextlib.py", "functools.py") for p in parts)


def user_call_site(skip_library: bool = True) -> str:
    """``file:line (function)`` of the innermost frame outside polymask and JAX."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not (skip_library and _is_library_frame(code.co_filename)):
            return f"{code.co_filename}:{frame.f_lineno} ({code.co_name})"
        frame = frame.f_back
    return "<unknown location>"


_UNKNOWN = "<unknown location>"


def _same_type(e: BaseException, message: str) -> BaseException:
    try:
        new = type(e)(message)
    except Exception:  # pragma: no cover - exotic subclass
        return e
    return new.with_traceback(e.__traceback__)


def at_call_site(e: BaseException, call_site: str) -> BaseException:
    """``e`` with ``in the masked call at <call_site>`` appended (once)."""
    text = str(e)
    if "in the masked call at" in text or call_site in text:
        return e
    return _same_type(e, f"{text}\n  in the masked call at {call_site}")


def relocate(e: BaseException, where: str) -> BaseException:
    """Replace an unknown location in ``e``'s message by ``where`` (when known)."""
    text = str(e)
    if _UNKNOWN not in text or where.startswith(_UNKNOWN):
        return e
    return _same_type(e, text.replace(_UNKNOWN, where))
