"""Compiled ``ragged_map`` batch programs on disk, keyed by what they compute.

JAX's persistent compilation cache (``cache.py``) keys a program by its
StableHLO, so a warm process still traces, masks and lowers every bucket to
find it: about 0.2 s of a MiniLM bucket's 0.25 s load, and up to 0.45 s with
the other core busy computing. This store keys the XLA executable by the
*user function's* symbolic trace instead (every case's jaxpr text and
constant bytes, the decision tree's comparisons), the batch's abstract
arguments (shapes, dtypes, weak types), the specs, polymask's own source, and
the JAX/XLA version, backend, device and CPU flags. A warm load is then the
symbolic trace (which the runner needs anyway: it gives the output shapes)
and a deserialize (about 0.05 s).

The store lives in ``polymask-programs/`` under the persistent cache
directory and is used exactly when that cache is on
(``polymask.enable_compilation_cache``; the CLI's default) on a one-device
backend. A program the store lacks is compiled without JAX's persistent
cache and written to the store: XLA:CPU cannot serialize again an executable
it loaded from the persistent cache (it fails at run time with "Function ...
not found"), and a cache entry from an earlier polymask would otherwise keep
the store from ever holding the program. A file that does not load is
ignored and replaced. Anything that keeps the key from being
computed (a jaxpr whose text names an object's address, e.g. a host
callback, changes every process) only makes it miss, never hit wrongly.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import platform
import sys
import tempfile
import threading

import jax
import numpy as np

from . import _jax_compat as compat

__all__ = ["ProgramStore", "active_store", "tree_fingerprint"]

SUBDIR = "polymask-programs"


class ProgramStore:
    """Serialized executables under ``root``, one file per key (sha256 hex)."""

    def __init__(self, root: pathlib.Path):
        self.root = pathlib.Path(root)
        self._lock = threading.Lock()

    def key(self, tree, avals, parts: tuple) -> str:
        """The key of a batch program: ``tree`` is its ``CaseTree``, ``avals`` the
        abstract arguments (``jax.ShapeDtypeStruct``), ``parts`` strings naming
        everything else it depends on (specs, constraints, pytree structures)."""
        h = hashlib.sha256()
        for part in (environment(), *tree_fingerprint(tree), *map(str, parts),
                     *(f"{a.shape}{a.dtype}{getattr(a, 'weak_type', False)}" for a in avals)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def _path(self, key: str) -> pathlib.Path:
        return self.root / f"{key}.xla"

    def load(self, key: str):
        """The stored ``jax.stages.Compiled`` of ``key``, or None (absent, unreadable)."""
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        try:
            return compat.load_executable(blob)
        except Exception:  # written by another version, truncated: compile again
            return None

    def save(self, key: str, compiled) -> bool:
        """Write ``compiled`` under ``key`` (atomically). False when it cannot be."""
        try:
            blob = compat.serialize_executable(compiled)
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
            return True
        except Exception:  # a read-only cache, an executable XLA cannot serialize
            return False


_STORES: dict[str, ProgramStore] = {}


def active_store() -> ProgramStore | None:
    """The store of the persistent cache directory in use (None: cache off, or
    more than one device, where executables would need their device assignment)."""
    d = jax.config.jax_compilation_cache_dir
    if not d or jax.device_count() != 1:
        return None
    store = _STORES.get(d)
    if store is None:
        store = _STORES.setdefault(d, ProgramStore(pathlib.Path(d) / SUBDIR))
    return store


def tree_fingerprint(tree) -> list[str]:
    """Strings that determine the masked programs of a ``CaseTree``: each case's
    conditions, error and program (jaxpr text, constants, specs, bounds) and
    the splits between them."""
    out = [_node_text(tree.root), str(tree.out_tree), str(tree.out_bounds),
           str(sorted(tree.internal.items()))]
    for case in tree.cases:
        out.append(f"case {case.index} {case.conditions} {case.error!r}")
        if case.program is not None:
            out.extend(_program_text(case.program))
    if tree.base is not None and not any(c.program is tree.base for c in tree.cases):
        out.extend(_program_text(tree.base))
    return out


def _node_text(node) -> str:
    if hasattr(node, "yes"):
        return f"({node.text} ? {_node_text(node.yes)} : {_node_text(node.no)})"
    return f"case {getattr(node, 'index', node)}"


def _program_text(prog) -> list[str]:
    closed = getattr(prog, "closed_jaxpr", None)
    if closed is None:
        return [repr(prog)]
    consts = hashlib.sha256()
    for c in closed.consts:
        a = np.asarray(c)
        consts.update(f"{a.shape}{a.dtype}".encode())
        consts.update(a.tobytes())
    return [str(closed.jaxpr), consts.hexdigest(), repr(prog.axis_specs),
            str(sorted(prog.var_bounds.items())), str(prog.leaf_bounds), str(prog.out_tree),
            str(prog.var_order), str(sorted(prog.dim_bounds.items())), str(prog.conditions)]


@functools.lru_cache(maxsize=1)
def environment() -> str:
    """What an executable depends on besides its program: polymask's source,
    the JAX/jaxlib versions, the backend and device, XLA flags and CPU flags."""
    h = hashlib.sha256()
    src = pathlib.Path(__file__).parent
    for path in sorted(src.rglob("*.py")):
        h.update(str(path.relative_to(src)).encode())
        h.update(path.read_bytes())
    dev = jax.devices()[0]
    parts = [h.hexdigest(), jax.__version__, getattr(jax.lib, "__version__", ""),
             dev.platform, dev.device_kind,
             str(getattr(getattr(dev, "client", None), "platform_version", "")),
             os.environ.get("XLA_FLAGS", ""), str(jax.config.jax_enable_x64),
             str(jax.config.jax_default_matmul_precision), sys.version, platform.machine(),
             _cpu_flags()]
    return "\n".join(parts)


def _cpu_flags() -> str:
    """The host CPU's feature flags (XLA:CPU compiles for them)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return platform.processor()


def stored_program(store: ProgramStore, prog, args, parts: tuple):
    """``prog``'s executable for ``args`` (values or abstract): loaded from
    ``store``, else compiled now and written to it.

    ``prog`` has ``case_tree(avals)``, which traces the cases for the key and
    fills in the entry's outputs. A miss compiles without JAX's persistent
    cache: an executable loaded from there cannot be stored (module doc), and
    the store serves these programs from then on. Returns
    ``(StoredProgram, loaded)``.
    """
    avals = jax.eval_shape(lambda *a: a, *args)
    key = store.key(prog.case_tree(avals), avals, parts)
    compiled = store.load(key)
    if compiled is not None:
        return StoredProgram(compiled, prog), True
    with compat.without_persistent_cache():
        compiled = jax.jit(prog).lower(*avals).compile()
    store.save(key, compiled)
    return StoredProgram(compiled, prog), False


class StoredProgram:
    """A compiled batch program; arguments of other types than it was compiled
    for (a weakly typed scalar where it had a NumPy one) go through
    ``jax.jit`` of the program instead of failing."""

    def __init__(self, compiled, prog):
        self.compiled, self._prog, self._jit = compiled, prog, None

    def __call__(self, *args):
        try:
            return self.compiled(*args)
        except TypeError:
            if self._jit is None:
                self._jit = jax.jit(self._prog)
            return self._jit(*args)
