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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _jax_compat as compat
from .errors import ShapeError


@dataclasses.dataclass
class Check:
    bad: Any  # bool or bool array (True = violated)
    message: str


def concrete_value(x):
    """NumPy value of ``x`` or None when ``x`` is traced."""
    if compat.is_tracer(x):
        return None
    try:
        return np.asarray(x)
    except Exception:
        return None


def run_checks(checks: list[Check], call_site: str) -> None:
    """Raise eagerly for concrete violations; stage runtime errors otherwise."""
    staged = []
    for c in checks:
        v = concrete_value(c.bad)
        if v is not None:
            if bool(np.any(v)):
                raise ShapeError(f"{c.message}\n  in the masked call at {call_site}")
        else:
            staged.append(c)
    for c in staged:
        _stage_runtime_error(c.bad, f"{c.message}\n  in the masked call at {call_site}")


def _stage_runtime_error(bad, message: str) -> None:
    def _raise(b):
        if np.any(b):
            raise ShapeError(message)

    bad = jnp.asarray(bad)
    lax.cond(jnp.any(bad), lambda: jax.debug.callback(_raise, bad), lambda: None)
