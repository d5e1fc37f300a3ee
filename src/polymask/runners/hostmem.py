"""Host memory for XLA:CPU: let glibc's malloc reuse freed buffers.

XLA:CPU allocates each execution's large buffers (MiniLM at 32x256: a 100 MB
attention-score buffer per layer) with ``malloc``. glibc serves requests above
its mmap threshold (at most 32 MB) with a fresh ``mmap`` and returns them to
the kernel on ``free``, so every call touches new pages: about 300,000 page
faults and 0.55-0.65 s of system time per MiniLM batch of 32x256 on the 2-core
box (``resource.getrusage``, a one-process profile), 20% of the batch. ``reuse_host_memory()`` keeps
freed memory in the process instead, as PyTorch's and TensorFlow's
recommended tcmalloc/jemalloc setups do: the same batch then takes no page
fault.

The CLI calls it on start, and so do its Ray actors (``--no-reuse-host-memory``
or ``POLYMASK_REUSE_HOST_MEMORY=off`` turn it off); the library never changes
the process's allocator by itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from .envvars import env_switch

__all__ = ["reuse_host_memory", "reuse_host_memory_wanted"]

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_applied = False


def _glibc():
    """glibc's ``mallopt`` or None (not Linux/glibc: musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: AttributeError elsewhere)
    except (OSError, AttributeError):
        return None
    return libc.mallopt


def reuse_host_memory() -> bool:
    """Make glibc's ``malloc`` keep freed memory for reuse (process-wide).

    Sets ``mallopt``: no ``mmap`` for large blocks (``M_MMAP_MAX=0``), never
    trim the heap (``M_TRIM_THRESHOLD``), one arena (``M_ARENA_MAX=1``, so
    every thread's large block comes from the same reusable heap). The
    process's resident memory then stays at its peak instead of shrinking
    after each call; XLA:CPU programs with large temporaries skip the page
    faults of fresh pages on every call (measured in the module docstring).

    Trade-offs: memory freed after a peak (a long batch) is never given back
    to the kernel, so a long-running server keeps its largest call's
    footprint while idle; and one arena serialises ``malloc`` across threads
    (host code that allocates heavily from many threads can slow down). There
    is no undo within the process.

    ``$POLYMASK_REUSE_HOST_MEMORY`` is read by the CLI only
    (``reuse_host_memory_wanted``): this function always applies the
    settings.

    Call it early, before the first JAX computation: a thread that already
    allocated keeps its own arena, whose large blocks are then still returned
    to the kernel (the call still returns True; the effect is partial).
    Idempotent.

    Returns:
      True when the settings are applied (Linux with glibc), False elsewhere
      (nothing changes).
    """
    global _applied
    if _applied:
        return True
    mallopt = _glibc()
    if mallopt is None:
        return False
    ok = all(mallopt(p, v) == 1 for p, v in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0),
                                            (_M_TRIM_THRESHOLD, 2**31 - 1)))
    _applied = ok
    return ok


def reuse_host_memory_wanted() -> bool:
    """False when ``$POLYMASK_REUSE_HOST_MEMORY`` says off (``0``, ``off``,
    ``false``, ``no``, ``none`` or empty, as ``POLYMASK_CACHE_DIR``): the CLI
    then leaves the allocator alone. Unset or any other value: on."""
    return env_switch("POLYMASK_REUSE_HOST_MEMORY")
