"""Locating the user's source line and translating JAX's errors into polymask's.

Everything that walks Python frames or rewrites an exception's message lives
here, so the tracer, the interpreter and the data-dependent ops share one
implementation (and import nothing from each other for it).
"""

from __future__ import annotations

import os
import re
import sys
import traceback

import jax

from . import _jax_compat as compat
from .errors import ShapeError

__all__ = ["is_library_frame", "user_call_site", "user_frame_of_exception", "at_call_site",
           "relocate", "translate_trace_error", "UNKNOWN_LOCATION", "SIZE_BRANCH_REMEDIES"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
UNKNOWN_LOCATION = "<unknown location>"

SIZE_BRANCH_REMEDIES = (
    "Remedies: state what you know as a constraint (mask(..., constraints=['n >= 3'])), "
    "or replace the Python `if` on a size with lax.cond / jnp.where.")


# ----------------------------------------------------------------------------
# Frames
# ----------------------------------------------------------------------------
def is_library_frame(filename: str) -> bool:
    """True for frames of polymask, JAX, jaxlib and the stdlib's functools/contextlib."""
    filename = os.path.abspath(filename)
    if filename.startswith(_PKG_DIR):
        return True
    parts = filename.replace("\\", "/").split("/")
    return any(p in ("jax", "jaxlib", "contextlib.py", "functools.py") for p in parts)


def _fmt_frame(filename: str, lineno: int | None, name: str) -> str:
    return f"{filename}:{lineno} ({name})"


def user_call_site() -> str:
    """``file:line (function)`` of the innermost frame outside polymask and JAX."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not is_library_frame(code.co_filename):
            return _fmt_frame(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return UNKNOWN_LOCATION


def user_frame_of_exception(e: BaseException) -> str:
    """The innermost user frame of ``e``'s traceback."""
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        if not is_library_frame(fr.filename):
            return _fmt_frame(fr.filename, fr.lineno, fr.name)
    return UNKNOWN_LOCATION


def _api_called_by_user(e: BaseException) -> str | None:
    """Name of the first library function the user's innermost frame called."""
    frames = traceback.extract_tb(e.__traceback__)
    user = [i for i, fr in enumerate(frames) if not is_library_frame(fr.filename)]
    if not user or user[-1] + 1 >= len(frames):
        return None
    return frames[user[-1] + 1].name


# ----------------------------------------------------------------------------
# Message rewriting
# ----------------------------------------------------------------------------
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
    if UNKNOWN_LOCATION not in text or where.startswith(UNKNOWN_LOCATION):
        return e
    return _same_type(e, text.replace(UNKNOWN_LOCATION, where))


# ----------------------------------------------------------------------------
# JAX errors raised while tracing the user's function
# ----------------------------------------------------------------------------
_DATA_DEPENDENT_REPLACEMENTS = {
    "nonzero": "polymask.nonzero(x)",
    "where": "polymask.where(condition) (one argument; three arguments work as jnp.where)",
    "argwhere": "polymask.argwhere(x)",
    "flatnonzero": "polymask.flatnonzero(x)",
    "unique": "polymask.unique(x, return_index=..., return_inverse=..., return_counts=...)",
    "unique_values": "polymask.unique(x)",
    "unique_counts": "polymask.unique(x, return_counts=True)",
    "unique_inverse": "polymask.unique(x, return_inverse=True)",
    "unique_all": "polymask.unique(x, True, True, True)",
    "compress": "polymask.compress(condition, x)",
    "extract": "polymask.extract(condition, x)",
    "arange": "polymask.arange(n, max_size=...)",
}


def _data_dependent_error(e: BaseException, where: str) -> ShapeError | None:
    """A ``ShapeError`` naming the polymask replacement of a data-dependent jnp op."""
    api = _api_called_by_user(e)
    said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, jax.errors.NonConcreteBooleanIndexError):
        return ShapeError(
            f"boolean indexing x[m] has a data-dependent size (at {where}); inside "
            "polymask.mask use polymask.boolean_mask(x, m) (or polymask.compress / "
            "polymask.extract) instead.")
    if isinstance(e, IndexError) and api in ("op", "__getitem__") and "Slice entries" in said:
        return ShapeError(
            f"a slice with traced bounds has a data-dependent size (at {where}); inside "
            "polymask.mask use polymask.dynamic_slice(x, start, size, max_size=...) "
            f"instead.\n  JAX said: {said}")
    if isinstance(e, jax.errors.ConcretizationTypeError) and api in _DATA_DEPENDENT_REPLACEMENTS:
        return ShapeError(
            f"jnp.{api} has a data-dependent output size (at {where}); inside polymask.mask "
            f"use {_DATA_DEPENDENT_REPLACEMENTS[api]} instead: its size becomes a logical "
            f"size with a known bound.\n  JAX said: {said}")
    if isinstance(e, jax.errors.ConcretizationTypeError):
        text = str(e)
        if "nonzero" in text or "argwhere" in text or "size argument" in text:
            first = next((ln for ln in text.splitlines() if "size argument" in ln),
                         said)
            return ShapeError(
                f"an op with a data-dependent output size (jnp.nonzero / one-argument "
                f"jnp.where / argwhere / unique) was called at {where}; inside polymask.mask "
                "use polymask.nonzero, polymask.where, polymask.argwhere, "
                f"polymask.flatnonzero or polymask.unique.\n  JAX said: {first}")
    return None


def _inconclusive_error(msg: str, where: str) -> ShapeError:
    msg = re.split(r"\n(?:Using symbolic scope|This error arises)", msg)[0].strip()
    extra = ""
    if "requires a constant" in msg:
        extra = ("\n  A size was needed as a Python constant (int(x.shape[0]), range(n), "
                 "np.zeros(n), ...): keep it symbolic (jnp/lax ops accept symbolic sizes) "
                 "or use polymask.logical_shape(x) for its value.")
    if "divide evenly" in msg:
        extra = ("\n  Write the axis in the spec as a multiple (e.g. '2*k') so that the "
                 "division is exact for every logical size.")
    remedies = SIZE_BRANCH_REMEDIES
    m = re.search(r"comparison '(.+?)' (\S+) '(.+?)' is inconclusive", msg)
    if m:
        lhs, op, rhs = m.groups()
        if op in (">", "<=") and rhs.lstrip("-").isdigit():
            rhs = str(int(rhs) + 1)
        remedies = remedies.replace("'n >= 3'", f"'{lhs} >= {rhs}'")
    return ShapeError(
        f"a comparison of symbolic sizes is inconclusive while tracing at {where}:\n"
        f"  {msg}{extra}\n  {remedies}")


def translate_trace_error(e: BaseException) -> ShapeError | None:
    """The polymask error for a JAX error raised while tracing the user's function.

    Returns None when the error is not about sizes (it then propagates as is).
    """
    where = user_frame_of_exception(e)
    msg = str(e).split("\n\n")[0].strip()
    dd = _data_dependent_error(e, where)
    if dd is not None:
        return dd
    if isinstance(e, compat.InconclusiveDimensionOperation):
        return _inconclusive_error(msg, where)
    if isinstance(e, TypeError) and re.search(
            r"incompatible shapes|must have (the )?same shape|same shape|shapes must", msg):
        return ShapeError(
            f"incompatible symbolic shapes at {where}: {msg}\n  Axes named by different "
            "dim vars are different sizes while tracing; if they are always equal, give "
            "them the same name in in_specs (e.g. ('n', 'n')).")
    if (isinstance(e, TypeError) and "_DimExpr" in msg) or (
            isinstance(e, ValueError) and "shape polymorphism" in msg):
        return ShapeError(
            f"JAX cannot trace this with a symbolic size at {where}:\n  {msg}\n  The JAX "
            "function needs a size as a Python int (len(x), int(x.shape[0]), a Python "
            "branch on it) or does not support symbolic shapes (e.g. jnp.convolve, "
            "jnp.array_split, jnp.cov): use the lax form (lax.conv_general_dilated, "
            "lax.slice, ...) or make that axis static with '_' in the spec. "
            "See docs/coverage.md.")
    return None
