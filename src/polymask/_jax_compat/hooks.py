"""Callback-log filtering and attribute patches held only while a masked trace runs."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator


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
