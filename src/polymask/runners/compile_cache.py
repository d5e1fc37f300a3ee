"""Compile once per machine: JAX's persistent compilation cache.

``polymask.enable_compilation_cache(path)`` turns it on for the process (the
library never does so by itself); the CLI turns it on by default in
``default_cache_dir()`` (``$POLYMASK_CACHE_DIR``, else
``~/.cache/polymask/xla``; ``--no-cache`` or ``POLYMASK_CACHE_DIR=off`` turn it
off). A program compiled once (its StableHLO, compile options, JAX/XLA version
and device as the key) is then loaded from disk by every later process.
"""

from __future__ import annotations

import os
import pathlib

import jax

from .. import _jax_compat as compat
from .envvars import is_off

__all__ = ["default_cache_dir", "enable_compilation_cache", "disable_compilation_cache"]

def default_cache_dir() -> pathlib.Path | None:
    """``$POLYMASK_CACHE_DIR`` (None when it says off), else ``~/.cache/polymask/xla``."""
    env = os.environ.get("POLYMASK_CACHE_DIR")
    if env is not None:
        return None if is_off(env) else pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "polymask" / "xla"


def enable_compilation_cache(path=None):
    """Store every XLA program this process compiles under ``path`` and reuse it.

    Args:
      path: the cache directory (default ``default_cache_dir()``).

    Returns:
      The previous cache directory setting (for ``disable_compilation_cache``).

    Raises:
      OSError: ``path`` cannot be created.

    Uses JAX's persistent compilation cache (``jax_compilation_cache_dir``),
    with the minimum compile time and entry size set to 0 so every bucket
    program is stored.
    """
    if path is None:
        path = default_cache_dir()
        if path is None:
            return jax.config.jax_compilation_cache_dir
    path = pathlib.Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    prev = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compat.reset_compilation_cache()
    return prev


def disable_compilation_cache(previous=None) -> None:
    """Turn the persistent cache off (or back to ``previous``, from ``enable_...``)."""
    jax.config.update("jax_compilation_cache_dir", previous)
    compat.reset_compilation_cache()
