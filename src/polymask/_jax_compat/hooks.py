"""JAX hooks installed only while a masked trace runs, and callback-log filtering."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator

from .core import DimExpr, is_dim_expr

# The hooks are installed while at least one masked trace runs (in any thread)
# and removed when the last one ends; what they record goes to the recorder
# of the thread that made the comparison.
_HOOK_LOCK = threading.Lock()
_HOOK_USERS = 0
_HOOK_ORIG: tuple = ()
_HOOK_TLS = threading.local()


@contextlib.contextmanager
def trace_hooks(is_user_frame) -> Iterator[list]:
    """The JAX hooks a masked trace needs, installed for its duration only.

    ``DimExpr.__eq__``/``__ne__`` record each symbolic ``==`` that JAX decided
    as False without a proof, made from a frame for which
    ``is_user_frame(filename)`` holds (see ``_recording_eq``).

    Yields the list the records are appended to, as ``(lhs, rhs,
    "file:line (function)")``. The hook is removed when the last trace in
    progress (in any thread) ends.
    """
    global _HOOK_USERS, _HOOK_ORIG
    records: list = []
    with _HOOK_LOCK:
        if _HOOK_USERS == 0:
            _HOOK_ORIG = (DimExpr.__eq__, DimExpr.__ne__)
            DimExpr.__eq__, DimExpr.__ne__ = _recording_eq(_HOOK_ORIG[0])
        _HOOK_USERS += 1
    stack = _HOOK_TLS.__dict__.setdefault("stack", [])
    stack.append((records, is_user_frame))
    try:
        yield records
    finally:
        stack.pop()
        with _HOOK_LOCK:
            _HOOK_USERS -= 1
            if _HOOK_USERS == 0:
                DimExpr.__eq__, DimExpr.__ne__ = _HOOK_ORIG


def hooks_installed() -> bool:
    """True while a masked trace is in progress (tests check the hooks are removed)."""
    return _HOOK_USERS > 0


def _recording_eq(orig_eq):
    """``__eq__``/``__ne__`` that record unsound symbolic equalities.

    JAX answers ``n == 1`` with False (and ``n != 1`` with True) when the
    difference is not a constant, because ``__eq__`` cannot raise
    (https://docs.jax.dev/en/latest/export/shape_poly.html#comparison-of-symbolic-dimensions-is-partially-supported).
    A user's ``if x.shape[0] == 1:`` would then silently trace the wrong
    branch for ``n == 1``; the prologue checks each recorded comparison at
    run time.
    """

    def record(a, b):
        stack = getattr(_HOOK_TLS, "stack", None)
        if not stack:
            return
        try:
            diff = a - b
        except Exception:
            return
        if is_dim_expr(diff):  # neither provably equal nor provably different
            records, is_user_frame = stack[-1]
            f = sys._getframe(2)
            if is_user_frame(f.f_code.co_filename):
                records.append((a, b, f"{f.f_code.co_filename}:{f.f_lineno} "
                                      f"({f.f_code.co_name})"))

    def eq(a, b):
        res = orig_eq(a, b)
        if res is False:
            record(a, b)
        return res

    def ne(a, b):
        res = orig_eq(a, b)
        if res is False:
            record(a, b)
        return not res

    return eq, ne


class _QuietCallbackErrors(logging.Filter):
    """Drop JAX's "callback failed" log record for one exception type.

    The error still propagates (as ``JaxRuntimeError`` with its message); the
    log record only duplicated it as a long traceback on stderr.
    """

    def __init__(self, exc_type: type):
        super().__init__()
        self.exc_type = exc_type

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, self.exc_type)


_QUIETED: set = set()


def quiet_callback_errors(exc_type: type) -> None:
    """Silence JAX's log of host-callback failures raised as ``exc_type`` (once)."""
    if exc_type in _QUIETED:
        return
    _QUIETED.add(exc_type)
    for name in ("jax._src.debugging", "jax._src.callback"):
        logging.getLogger(name).addFilter(_QuietCallbackErrors(exc_type))


_PATCH_LOCK = threading.Lock()
_PATCH_USERS: dict = {}


@contextlib.contextmanager
def patched_attr(module, name: str, replacement) -> Iterator[None]:
    """``module.name = replacement`` for the duration (reference-counted across
    threads; the replacement must fall back to the original outside a masked
    trace, since other threads see it too)."""
    key = (id(module), name)
    with _PATCH_LOCK:
        users, orig = _PATCH_USERS.get(key, (0, getattr(module, name)))
        if users == 0:
            setattr(module, name, replacement)
        _PATCH_USERS[key] = (users + 1, orig)
    try:
        yield
    finally:
        with _PATCH_LOCK:
            users, orig = _PATCH_USERS[key]
            if users == 1:
                setattr(module, name, orig)
                del _PATCH_USERS[key]
            else:
                _PATCH_USERS[key] = (users - 1, orig)
