"""Errors raised by polymask and helpers that locate the user's source line."""

from __future__ import annotations

import os
import sys

__all__ = ["ShapeError", "UnsupportedError", "user_call_site"]

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
