"""Python warnings raised while a masked trace runs, said when a call reaches
the case that raised them.

A masked trace covers many sizes: a library that warns on a shape
(``jax.scipy.signal.welch``: "nperseg = 4 is greater than input_length")
warned at trace time for every case (sizes 0, 1, 2, ... traced one by one,
and the symbolic case with JAX's internal names, ``n__p1 - 1``) where plain
JAX, traced at one shape, warns for that shape only. While a masked trace
runs, ``warnings.warn`` (a row of ``_jax_compat/patches.py``) records in the
trace's program instead (``MaskedProgram.trace_warnings``; other threads
warn as before), and ``say_case_warnings`` warns once per case with the
spec's size names: for the case a call's concrete sizes reach, or, where
the sizes are traced (under ``jax.jit``), for every case, each prefixed with
the sizes it applies to where there are several cases.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from .. import _jax_compat as compat
from ..core.diagnostics import user_stacklevel
from ..core.shapes import is_static

__all__ = ["recording", "warn_during_trace", "say_case_warnings"]

_ORIGINAL_WARN = warnings.warn
_TLS = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Record this thread's ``warnings.warn`` calls (``(category, text)``)
    while the block runs (a masked trace) instead of warning."""
    stack = _TLS.__dict__.setdefault("stack", [])
    caught: list = []
    stack.append(caught)
    try:
        yield caught
    finally:
        stack.pop()


def warn_during_trace(message, category=None, stacklevel=1, source=None, **kwargs):
    """``warnings.warn`` while a masked trace runs (in any thread): recorded
    where this thread is tracing (``recording``), else warned as before."""
    stack = getattr(_TLS, "stack", None)
    if not stack:  # (another thread's warning, or none recording: one frame deeper)
        return _ORIGINAL_WARN(message, category, stacklevel + 1, source, **kwargs)
    if isinstance(message, Warning):
        category, message = type(message), str(message)
    stack[-1].append((category or UserWarning, str(message)))
    return None


def say_case_warnings(tree, values: dict[str, Any]) -> None:
    """Warn what the traces of the cases ``values`` (spec dim var -> size)
    reach recorded, once per case (as ``jax.jit`` warns once per traced
    shape), with spec names. Traced sizes: every case's, each prefixed with
    its sizes where there are several."""
    if not any(getattr(c.program, "trace_warnings", ()) for c in tree.cases):
        return  # (the common case, every call of a runner's shape: nothing to say)
    concrete = all(is_static(v) for v in values.values())
    if concrete:
        cases = tree.reachable_cases(tree.base.internal_values(values))
    else:
        cases = [c for c in tree.cases if c.reachable]
    for case in cases:
        prog = case.program
        pending = getattr(prog, "trace_warnings", ())
        if not pending:
            continue
        prog.trace_warnings = ()  # (said once: a trace warns once)
        sizes = "" if concrete or tree.single else f"(for sizes {tree.case_sizes(case)}) "
        for category, text in dict.fromkeys(pending):
            _ORIGINAL_WARN(sizes + tree.display(text), category, stacklevel=user_stacklevel())


compat.replace_during_trace("warnings.warn", warn_during_trace)
