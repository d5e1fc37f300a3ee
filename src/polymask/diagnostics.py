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


_NOT_VARS = {"min", "max", "mod", "floordiv", "non_negative", "shape", "shapes", "got",
             "incompatible", "for", "broadcasting", "and", "sub", "add", "mul", "div"}


def _dim_vars_in(text: str) -> list[str]:
    """Dim var names in the shape tuples of a JAX message (``(n, _u1 + 2)``)."""
    tuples = re.findall(r"\(([^()]*(?:\([^()]*\)[^()]*)*)\)", text)
    names: list[str] = []
    for t in tuples:
        for n in re.findall(r"(?<![\w.])([A-Za-z_][A-Za-z_0-9]*)(?![\w(])", t):
            if n not in _NOT_VARS and n not in names:
                names.append(n)
    return names


def _lower_bound_that_fixes(msg: str, var: str) -> int | None:
    """Smallest ``k`` such that ``var >= k`` makes the shapes in ``msg`` equal."""
    shapes = re.findall(r"(\([^()]*(?:\([^()]*\)[^()]*)*\))", msg.split(":", 1)[-1])
    if len(shapes) < 2:
        return None
    for k in range(1, 9):
        try:
            scope = jax.export.SymbolicScope((f"{var} >= {k}",))
            parsed = [jax.export.symbolic_shape(sh.strip(), scope=scope) for sh in shapes[:2]]
            if len(parsed[0]) == len(parsed[1]) and all(
                    a == b or (1 in (a, b)) for a, b in zip(*parsed)):
                return k
        except Exception:
            return None
    return None


def _describe_vars(names, var_where) -> str:
    known = [f"{n} = {var_where[n]}" for n in names if var_where and n in var_where]
    return f" ({', '.join(known)})" if known else ""


def _incompatible_shapes_error(msg: str, where: str, var_where) -> ShapeError:
    names = _dim_vars_in(msg)
    fresh = [n for n in names if n.startswith("_u")]
    user = [n for n in names if not n.startswith("_u")]
    head = f"incompatible symbolic shapes at {where}: {msg}"
    if len(fresh) >= 2 and not user:
        return ShapeError(
            f"{head}\n  The sizes {', '.join(fresh)} come from different calls of polymask's "
            "data-dependent ops (nonzero, flatnonzero, where, unique, boolean_mask, ...): each "
            "call gets its own size, and JAX cannot know two of them are equal even when the "
            "calls are identical. Compute the result once and reuse it (i = "
            "polymask.flatnonzero(x); x[i] * i).")
    if len(user) >= 2 or (user and fresh):
        return ShapeError(
            f"{head}\n  Axes named by different dim vars{_describe_vars(user, var_where)} are "
            "different sizes while tracing; if they are always equal, give them the same "
            "name in in_specs (e.g. ('n', 'n')).")
    if len(user) == 1:
        (v,) = user
        k = _lower_bound_that_fixes(msg, v)
        bound = f"'{v} >= {k}'" if k else f"'{v} >= 2'"
        return ShapeError(
            f"{head}\n  Both shapes depend only on {v}{_describe_vars(user, var_where)}, but "
            f"JAX cannot prove them equal for every {v} >= 0 (slicing near size 0 brings in "
            f"min/max). State a lower bound as a constraint: mask(..., constraints=[{bound}])"
            + ("" if k else " (or larger)") + ".")
    return ShapeError(f"{head}\n  The two shapes must be equal for every logical size.")


def _api_specific_error(e: BaseException, api: str | None, msg: str, where: str,
                        var_where) -> ShapeError | None:
    """Remedies for jnp/lax functions that reject symbolic sizes in known ways."""
    said = msg.splitlines()[0] if msg else type(e).__name__
    inconclusive = isinstance(e, compat.InconclusiveDimensionOperation)
    if api == "pad" and "jnp.pad with 'reflect' or 'symmetric'" in msg:
        m = re.search(r"axis size \(= (.+?)\).*padding length \(= (\d+)\)", msg)
        c = f"'{m.group(1)} >= {int(m.group(2)) + 1}'" if m else "'n >= <pad width + 1>'"
        return ShapeError(
            f"jnp.pad(mode='reflect'/'symmetric') at {where} needs to know while tracing "
            f"that the axis is longer than the pad width: state it as a constraint, "
            f"mask(..., constraints=[{c}]).\n  JAX said: {said}")
    if api == "pad" and (inconclusive or isinstance(e, (TypeError, ValueError))):
        return ShapeError(
            f"jnp.pad at {where} cannot pad a dynamic axis in this mode (JAX's 'wrap' and "
            "'edge'-like modes branch on the size in Python). Write the padding with slices "
            "and concatenate, e.g. for mode='wrap' with width k: "
            "jnp.concatenate([x[-k:], x, x[:k]]) with constraints=['n >= k'] (n: that axis's "
            f"dim var); or make the axis static with '_' in in_specs.\n  JAX said: {said}")
    if api == "arange" and "non-constant arguments" in msg:
        return ShapeError(
            f"jnp.arange with a symbolic size at {where} needs integer start, stop and step "
            "(all ints or size expressions). For a float range, build it from an integer "
            "one: jnp.arange(x.shape[0]) * step + start (e.g. jnp.arange(1., n + 1) is "
            f"jnp.arange(n) + 1.0).\n  JAX said: {said}")
    if api in ("searchsorted", "digitize", "histogram", "histogram_bin_edges") and (
            inconclusive or "_DimExpr" in msg):
        return ShapeError(
            f"jnp.{api} at {where} needs the length of the sorted array (the bins) as a "
            "Python int: JAX picks the index dtype and the number of bisection steps from "
            "it. Give that axis a static size ('_' in in_specs, or pass the bins as a plain "
            "array), or count with comparisons: side='left': jnp.sum(a[:, None] < v, "
            f"axis=0); side='right': jnp.sum(a[:, None] <= v, axis=0).\n  JAX said: {said}")
    if api in _STATIC_PARAM_APIS and (inconclusive or "_DimExpr" in msg
                                      or "polymorphism" in msg.lower()):
        return ShapeError(
            f"lax.{api} at {where} needs its window dimensions, strides, dilations and "
            "padding as Python ints, and one was computed from a symbolic size (like "
            "x.shape[0] // 2). Use a constant, or make the axis it comes from static with "
            f"'_' in in_specs.\n  JAX said: {said}")
    if (isinstance(e, IndexError) and api in ("op", "__getitem__", "_rewriting_take")
            and re.search(r"Got .*[A-Za-z_]", said)):
        return ShapeError(
            f"an index computed from a symbolic size (at {where}) is a size expression, not "
            "an array; JAX only indexes with ints and arrays. Make it an array: "
            "x[jnp.asarray(x.shape[0] // 2)], or use lax.dynamic_index_in_dim(x, i, "
            f"keepdims=False).\n  JAX said: {said}")
    if isinstance(e, (TypeError, ValueError)) and var_where:
        names = [n for n in re.findall(r"\b([A-Za-z_][A-Za-z_0-9]*)\b", said)
                 if n in var_where]
        if names and ("!=" in said or "must equal" in said or "must be equal" in said):
            axes = ", ".join(f"{var_where[n]} (dim var '{n}')" for n in dict.fromkeys(names))
            return ShapeError(
                f"{api or 'a JAX function'} at {where} needs sizes it can compare while "
                f"tracing, but they are symbolic: {axes}. If that axis has a fixed size "
                "(a kernel's channel/feature axis, a window), give it a static size with '_' "
                "in in_specs (or pass that argument as a plain array); if two such axes are "
                f"always equal, give them the same dim var name.\n  JAX said: {said}")
    return None


_STATIC_PARAM_APIS = {"reduce_window", "_reduce_window_sum", "_reduce_window_max",
                      "_reduce_window_min", "reduce_window_shape_tuple", "avg_pool", "max_pool"}


_REMEDY_APIS = ("pad", "arange", "searchsorted", "digitize", "histogram",
                "histogram_bin_edges", "reduce_window", "conv_general_dilated",
                "conv_with_general_padding", "conv_transpose", "conv", "avg_pool", "max_pool")


def _api_for_remedy(e: BaseException) -> str | None:
    """The library function the user called, by frame or (when JAX filtered its
    frames out of the traceback) by the user's source line."""
    api = _api_called_by_user(e)
    if api in _REMEDY_APIS or api in ("op", "__getitem__", "_rewriting_take"):
        return api
    user = [fr for fr in traceback.extract_tb(e.__traceback__)
            if not is_library_frame(fr.filename)]
    line = (user[-1].line or "") if user else ""
    for name in _REMEDY_APIS:
        if re.search(rf"\b{name}\s*\(", line):
            return name
    return api


def translate_trace_error(e: BaseException, var_where: dict[str, str] | None = None
                          ) -> ShapeError | None:
    """The polymask error for a JAX error raised while tracing the user's function.

    ``var_where`` maps each spec dim var to an input axis (``args[0].shape[1]``)
    for messages that name dim vars. Returns None when the error is not about
    sizes (it then propagates as is).
    """
    where = user_frame_of_exception(e)
    msg = str(e).split("\n\n")[0].strip()
    dd = _data_dependent_error(e, where)
    if dd is not None:
        return dd
    api_err = _api_specific_error(e, _api_for_remedy(e), msg, where, var_where)
    if api_err is not None:
        return api_err
    if isinstance(e, compat.InconclusiveDimensionOperation):
        return _inconclusive_error(msg, where)
    if isinstance(e, TypeError) and re.search(
            r"incompatible shapes|must have (the )?same shape|same shape|shapes must", msg):
        return _incompatible_shapes_error(msg, where, var_where)
    if (isinstance(e, TypeError) and "_DimExpr" in msg) or (
            isinstance(e, ValueError) and "shape polymorphism" in msg.lower()):
        return ShapeError(
            f"JAX cannot trace this with a symbolic size at {where}:\n  {msg}\n  The JAX "
            "function needs a size as a Python int (len(x), int(x.shape[0]), a Python "
            "branch on it) or does not support symbolic shapes (e.g. jnp.convolve, "
            "jnp.array_split, jnp.cov): use the lax form (lax.conv_general_dilated, "
            "lax.slice, ...) or make that axis static with '_' in the spec. "
            "See docs/coverage.md.")
    return None
