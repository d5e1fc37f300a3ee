"""Compiled ``ragged_map`` batch programs on disk, keyed by what they compute.

JAX's persistent compilation cache (``compile_cache.py``) keys a program by its
StableHLO, so a warm process still traces, masks and lowers every bucket to
find it (in a one-process profile, about 0.2 s of a MiniLM bucket's 0.25 s
load). This store keys the XLA executable by the
*user function's* symbolic trace instead (every case's jaxpr text and
constant bytes, the decision tree's comparisons), the batch's abstract
arguments (shapes, dtypes, weak types), the specs, polymask's own source, and
the JAX/XLA version, backend, device and CPU flags. A warm load is then the
symbolic trace (which the runner needs anyway: it gives the output shapes)
and a deserialize.

A ``RaggedMap(..., program_id=NAME)`` whose name determines the function
stores the program's output plan too and skips even that trace: a load is a
deserialize. Only polymask's own models use it (the MiniLM encoder: its
configuration names the function, whose code is polymask's source, in every
key): a user's name could outlive an edit of the function and load a stale
program, so ``ragged_map`` does not offer it.

The store lives in ``polymask-programs/`` under the persistent cache
directory and is used exactly when that cache is on
(``polymask.enable_compilation_cache``; the CLI's default) on a one-device
backend. A program the store lacks is compiled fresh and written to it:
XLA:CPU cannot serialize again an executable it loaded from the persistent
cache (the copy fails at run time with "Function ... not found"), so the
compile gets a key no persistent-cache entry has
(``compat.fresh_compile_options``; JAX offers no per-compile bypass), and
only an executable XLA compiled in this process is written. A file that does
not load is ignored and replaced. Anything that keeps the key from being
computed (a jaxpr whose text names an object's address, e.g. a host
callback, changes every process) only makes it miss, never hit wrongly.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import pickle
import platform
import sys
import tempfile
from collections.abc import Callable

import jax
import numpy as np

from .. import _jax_compat as compat
from .compiling import compile_counter

__all__ = ["ProgramStore", "StorableProgram", "StoredProgram", "active_store", "program_key",
           "compile_to_store", "stored_program", "tree_fingerprint"]

SUBDIR = "polymask-programs"


class ProgramStore:
    """Serialized executables under ``root``, one file per key (sha256 hex).

    A file holds its key, the executable and, for programs stored by name
    (``RaggedMap(program_id=...)``), the output plan the trace would give.
    Files are pickles: the directory must be as trusted as the code (so is
    JAX's persistent cache, whose entries are machine code).
    """

    def __init__(self, root: pathlib.Path):
        self.root = pathlib.Path(root)

    def key(self, parts, avals) -> str:
        """The key of a program from ``parts`` (strings naming what it computes)
        and its abstract arguments (shapes, dtypes, weak types), in this
        ``environment()``."""
        h = hashlib.sha256()
        for part in (environment(), *map(str, parts),
                     *(f"{a.shape}{a.dtype}{getattr(a, 'weak_type', False)}" for a in avals)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def _path(self, key: str) -> pathlib.Path:
        return self.root / f"{key}.xla"

    def has(self, key: str) -> bool:
        """A file for ``key`` exists (``load`` may still refuse it)."""
        return self._path(key).exists()

    def load(self, key: str):
        """``(jax.stages.Compiled, meta)`` stored under ``key``, or None (absent,
        unreadable, written by another version, or another key's file)."""
        try:
            stored_key, blob, meta = pickle.loads(self._path(key).read_bytes())
            if stored_key != key:
                return None
            return compat.load_executable(blob), meta
        except Exception:  # absent, truncated, another version: compile again
            return None

    def save(self, key: str, compiled, meta=None) -> bool:
        """Write ``compiled`` (and ``meta``) under ``key``, atomically. False when
        it cannot be (a read-only directory, an executable XLA cannot serialize)."""
        try:
            return self._write(key, compat.serialize_executable(compiled), meta)
        except Exception:
            return False

    def copy(self, key: str, new_key: str, meta=None) -> bool:
        """Store the executable of ``key`` under ``new_key`` too (with ``meta``):
        the bytes as written, since XLA:CPU cannot serialize a loaded one again."""
        try:
            stored_key, blob, _ = pickle.loads(self._path(key).read_bytes())
            return stored_key == key and self._write(new_key, blob, meta)
        except Exception:
            return False

    def _write(self, key: str, blob: bytes, meta) -> bool:
        try:
            blob = pickle.dumps((key, blob, meta), protocol=pickle.HIGHEST_PROTOCOL)
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
            return True
        except Exception:
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
    _hash_consts(closed.jaxpr, closed.consts, consts)
    return [str(closed.jaxpr), consts.hexdigest(), repr(prog.axis_specs),
            str(sorted(prog.var_bounds.items())), str(prog.leaf_bounds), str(prog.out_tree),
            str(prog.var_order), str(sorted(prog.dim_bounds.items())), str(prog.conditions)]


def _hash_consts(jaxpr, consts, h) -> None:
    """Hash ``consts`` and the constants of every closed jaxpr inside ``jaxpr``
    (a nested ``jax.jit``, ``cond`` branches, ``scan`` bodies, custom
    derivatives' primal functions): the jaxpr text shows none of them."""
    for c in consts:
        dtype = getattr(c, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            # a typed PRNG key (a closed-over key, flax.nnx's Rngs state): no NumPy
            # view of its own; its implementation's name and its key data are it
            h.update(str(dtype).encode())
            c = jax.random.key_data(c)
        a = np.asarray(c)
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(a.tobytes())
    for eqn in jaxpr.eqns:
        for inner, inner_consts in compat.inner_jaxprs(eqn.params):
            _hash_consts(inner, inner_consts, h)


@functools.lru_cache(maxsize=1)
def environment() -> str:
    """What an executable depends on besides its program: polymask's source,
    the JAX/jaxlib versions, the backend and device, XLA flags and CPU flags."""
    h = hashlib.sha256()
    src = pathlib.Path(__file__).parents[1]
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


@dataclasses.dataclass(frozen=True)
class StorableProgram:
    """What the store needs of a batch program: ``fn`` (the function to jit),
    ``case_tree(avals)`` (traces its cases, fills in the entry's outputs and
    returns the ``CaseTree``) and ``parts`` (strings naming its specs and
    pytrees)."""

    fn: Callable
    case_tree: Callable
    parts: tuple


def program_key(store: ProgramStore, prog: StorableProgram, args,
                program_id: str | None = None) -> tuple:
    """``(key, avals)`` of ``prog`` for ``args`` (values or abstract).

    Without ``program_id`` the key holds the case tree's fingerprint:
    ``prog.case_tree(avals)`` traces the cases (once: ``mask`` caches them)
    and fills in the entry's outputs. With it, nothing is traced: the caller
    vouches that the name determines the function.
    """
    avals = jax.eval_shape(lambda *a: a, *args)
    if program_id is not None:
        return store.key(("program_id", program_id, *prog.parts), avals), avals
    fingerprint = tree_fingerprint(prog.case_tree(avals))
    return store.key((*fingerprint, *prog.parts), avals), avals


def stored_program(store: ProgramStore, prog: StorableProgram, key: str, avals, entry,
                   program_id: str | None = None, on_compile: Callable | None = None):
    """``prog``'s executable: loaded from ``store``, else compiled now and
    written to it. Returns ``(StoredProgram, loaded)``; ``on_compile`` is the
    ``StoredProgram``'s (see there).

    ``key`` is ``program_key``'s. A program stored by name carries the
    entry's output plan, so loading it needs no trace. Programs whose plan
    cannot be carried (output sizes that follow the input sizes are symbolic
    expressions; sizes where the plain function raises are checked from the
    trace) are stored under their traced key only, which a name lookup tries
    next. A miss compiles fresh (never from JAX's persistent cache, whose
    executables cannot be stored: module doc) and the store serves the
    program from then on.
    """
    hit = store.load(key)
    if hit is not None and program_id is not None and hit[1] is not None:
        entry.outputs, entry.tree = hit[1], None
        return StoredProgram(hit[0], prog.fn, entry.compiler_options, on_compile), True
    named_key = key
    if program_id is not None:  # not stored by name: try the traced key
        key, _ = program_key(store, prog, avals)
        hit = store.load(key)
    if hit is not None:
        portable = _portable_outputs(entry)
        if program_id is not None and portable is not None:  # next time, by name
            store.copy(key, named_key, portable)
        return StoredProgram(hit[0], prog.fn, entry.compiler_options, on_compile), True
    compiled, fresh = compile_to_store(store, key, prog.fn, avals, entry.compiler_options)
    if fresh:
        portable = _portable_outputs(entry)
        if program_id is not None and portable is not None:
            store.save(named_key, compiled, portable)
    return StoredProgram(compiled, prog.fn, entry.compiler_options, on_compile), False


def compile_to_store(store: ProgramStore, key: str, fn: Callable, avals,
                     compiler_options: dict, meta: Callable | None = None):
    """Compile ``fn`` for ``avals`` fresh (never from JAX's persistent cache,
    whose executables cannot be stored: module doc) and write it to ``store``
    under ``key`` with ``meta()`` (called after the trace, which may be what
    fills it in). Returns ``(compiled, fresh)``: ``fresh`` is whether XLA
    compiled it here (only then is it stored). Compiles count into the
    caller's ``compile_counter`` too."""
    with compile_counter() as cc:
        compiled = jax.jit(fn).lower(*avals).compile(
            compiler_options={**compiler_options, **compat.fresh_compile_options()})
    if cc.compiles:
        store.save(key, compiled, None if meta is None else meta())
    return compiled, bool(cc.compiles)


def _portable_outputs(entry):
    """The entry's output plan without symbolic expressions (which do not
    survive a pickle), or None when it needs them or the tree has error cases."""
    out = entry.outputs
    if out is None or out.has_host or (entry.tree is not None
                                       and any(c.error for c in entry.tree.cases)):
        return None
    return dataclasses.replace(out, in_axis_specs=[], internal={})


class StoredProgram:
    """A compiled batch program; arguments of other types than it was compiled
    for (an int scalar where it had a float one) go through ``jax.jit`` of the
    program instead of failing. ``on_compile(cc)`` hears of
    the compiles that causes (the runner's stats count them)."""

    def __init__(self, compiled, fn, compiler_options=None, on_compile=None):
        self.compiled, self._fn, self._jit = compiled, fn, None
        self._options = compiler_options or None
        self.on_compile = on_compile

    def __call__(self, *args):
        try:
            return self.compiled(*args)
        except TypeError:
            if self._jit is None:
                self._jit = jax.jit(self._fn, compiler_options=self._options)
            with compile_counter() as cc:
                out = self._jit(*args)
            if cc.compiles and self.on_compile is not None and not cc.nested:
                self.on_compile(cc)  # (a caller's counter would count it already)
            return out
