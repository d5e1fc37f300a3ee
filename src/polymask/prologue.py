"""The prologue: checks on logical sizes before the computation.

Checks run in Python (raising ``ShapeError`` at once) when sizes are concrete.
When sizes are traced (inside ``jax.jit`` or ``jax.vmap``) each check becomes a
predicate; a failing predicate raises the same ``ShapeError`` text through a
host callback guarded by ``lax.cond``, so the callback only runs on failure and
the error surfaces at the result (as ``JaxRuntimeError`` wrapping our message),
never as a wrong result. The user's call site is recorded while tracing, as the
seed proposal asks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _jax_compat as compat
from .errors import ShapeError


@dataclasses.dataclass
class Check:
    """One prologue check.

    ``message`` may hold ``{0}``, ``{1}``... placeholders for ``values`` (sizes
    that can be traced): they are filled in with the concrete values, at run
    time inside ``jit``, so the error names the actual sizes. Without
    ``values`` the message is used as is.
    """

    bad: Any  # bool or bool array (True = violated)
    message: str
    values: tuple = ()


def concrete_value(x):
    """NumPy value of ``x`` or None when ``x`` is traced."""
    if compat.is_tracer(x):
        return None
    try:
        return np.asarray(x)
    except Exception:
        return None


def _render(v) -> str:
    a = concrete_value(v)
    if a is None:
        return "<traced>"
    return str(a.tolist())


def format_message(message: str, values, rendered=None) -> str:
    if not values:
        return message
    rendered = [_render(v) for v in values] if rendered is None else rendered
    try:
        return message.format(*rendered)
    except (IndexError, KeyError, ValueError):
        return message


class _QuietPolymaskCallbackErrors(logging.Filter):
    """Drop JAX's "jax.debug.callback failed" log for our own ShapeError.

    The error still propagates (as ``JaxRuntimeError`` with our message); the
    log record only duplicated it as a long traceback on stderr.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, ShapeError)


for _name in ("jax._src.debugging", "jax._src.callback"):
    logging.getLogger(_name).addFilter(_QuietPolymaskCallbackErrors())


def run_checks(checks: list[Check], call_site: str) -> None:
    """Raise eagerly for concrete violations; stage runtime errors otherwise."""
    staged = []
    for c in checks:
        v = concrete_value(c.bad)
        if v is not None:
            if bool(np.any(v)):
                raise ShapeError(f"{format_message(c.message, c.values)}\n"
                                 f"  in the masked call at {call_site}")
        else:
            staged.append(c)
    if staged:
        _stage_runtime_errors(staged, call_site)


def _stage_runtime_errors(checks: list[Check], call_site: str) -> None:
    """One ``lax.cond`` + host callback for all traced checks.

    The callback gets every check's predicate and values, and raises the
    ``ShapeError`` of the first violated check with the actual sizes (under
    ``vmap``, of the first failing batch element).
    """
    templates = [(c.message, len(c.values)) for c in checks]

    def _raise(bads, values):
        it = iter(values)
        for (message, n), b in zip(templates, bads):
            vals = [np.asarray(next(it)) for _ in range(n)]
            b = np.asarray(b)
            if not np.any(b):
                continue
            where = ""
            if b.ndim:
                idx = tuple(int(i[0]) for i in np.nonzero(b))
                vals = [v[idx] if v.shape == b.shape else v for v in vals]
                where = f" (batch element {idx[0] if len(idx) == 1 else idx})"
            text = format_message(message, vals, [str(v.tolist()) for v in vals])
            raise ShapeError(f"{text}{where}\n  in the masked call at {call_site}")

    @jax.custom_batching.custom_vmap
    def check(bads, values):
        any_bad = functools.reduce(jnp.logical_or, [jnp.any(b) for b in bads])
        lax.cond(any_bad, lambda: jax.debug.callback(_raise, bads, values), lambda: None)
        return any_bad

    @check.def_vmap
    def _check_whole_batch(axis_size, in_batched, bads, values):
        # Check the whole ragged batch in one callback instead of letting
        # vmap slice the callback per example (which fails on sharded batch
        # axes); the reduction over the batch is an ordinary collective.
        if all(concrete_value(x) is not None for x in [*bads, *values]):
            _raise(bads, values)  # eager vmap: raise the ShapeError itself
        return check(bads, values), False

    check([jnp.asarray(c.bad) for c in checks],
          [jnp.asarray(v) for c in checks for v in c.values])
