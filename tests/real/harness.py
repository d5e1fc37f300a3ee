"""Run the real-program corpus through polymask and classify each mode.

For one program and one mode the harness returns a result dict:

- ``status``: ``pass``; ``wrong`` (a silent wrong value or gradient, a
  non-finite gradient or non-zero gradient padding, a value where plain JAX
  raises, or -- ``pmjit`` only -- more compiles than buckets); ``hang`` (no
  answer within the program's time limit: the worker process is killed);
  ``error-polymask`` (a ``ShapeError`` / ``UnsupportedError`` at a size where
  plain JAX runs); ``crash`` (any other exception, from polymask or JAX); or
  ``n/a`` (``grad`` of a program without float output).
- ``detail``: the assertion or the exception (type, message, and the innermost
  polymask frame for a crash).
- ``compiles`` / ``buckets`` (``pmjit``): ``polymask.jit``'s ``stats()["compiles"]``
  over the program's ``jit_sizes`` and the number of distinct buckets they fall
  in; ``exact_compiles`` / ``distinct_shapes``: its per-shape fallback's compiles
  (buckets whose masked trace failed run as ``jax.jit``) and the distinct exact
  shapes (``jax.jit``'s compiles). More programs than ``max(buckets, distinct
  shapes)`` is ``wrong``.
- ``seconds``: wall time of the mode.

Modes ``eager``, ``jit``, ``vmap`` and ``grad`` are
``polymask.testing.check_oracle`` on the sizes where plain JAX runs (NaN /
garbage padding; ``grad`` differentiates with respect to every float argument,
unpadded parameters included, and checks the padding of padded arguments is
zero and finite). At sizes where plain JAX raises, ``eager`` and ``jit`` check
that the masked function raises a ``ShapeError`` too. ``pmjit`` runs
``polymask.jit(fun, in_specs, buckets=pow2(minimum=4))`` on exact inputs of the
program's ``jit_sizes``, compares with plain JAX and counts compiles (the
per-shape fallback's included: a pass there says "N per-shape compiles").

Every program runs in a worker subprocess (``Worker``): a mode that does not
answer within ``Program.timeout`` seconds is reported as a hang and the
worker is restarted.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO = TESTS_DIR.parent
_TAG = "@@polymask-real-result@@ "


# -- running one mode (inside the worker) ---------------------------------------------------------
def _polymask_error_names() -> tuple[str, ...]:
    """The class names of polymask's errors (ShapeError, TooManyCases, ...),
    as a staged check's JaxRuntimeError names the one it carries."""
    import polymask as pm

    names, todo = set(), [pm.ShapeError, pm.UnsupportedError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return tuple(sorted(names))


def _staged_polymask_error(text: str) -> int:
    """Where a staged check's JaxRuntimeError text names a polymask error
    (``... TooManyCases: ...``), else -1."""
    hits = [text.rfind(f"{n}: ") for n in _polymask_error_names()]
    hits += [text.rfind(f"{n}[") for n in _polymask_error_names()]  # ShapeError[TypeError]
    return max(hits)


def _exc_text(e: BaseException, limit: int = 600) -> str:
    msg = " ".join(str(e).split())
    if type(e).__name__ == "JaxRuntimeError":  # a staged check's
        at = _staged_polymask_error(msg)
        if at >= 0:
            msg = "(staged) " + msg[at:]
    if len(msg) > limit:
        msg = msg[:limit] + " ..."
    return f"{type(e).__name__}: {msg}"


def _polymask_frame(e: BaseException) -> str:
    """The innermost traceback frame inside src/polymask (file:line in function)."""
    where = ""
    for fs in traceback.extract_tb(e.__traceback__):
        if "/src/polymask/" in fs.filename.replace(os.sep, "/"):
            rel = fs.filename.replace(os.sep, "/").split("/src/")[-1]
            where = f"{rel}:{fs.lineno} in {fs.name}"
    return where


def _unless_polymask_error(e: BaseException, n, plain) -> dict | None:
    """At a size where plain JAX raises: None for polymask's own error (the
    expected answer), else the failure's result."""
    if _is_polymask_error(e):
        return None
    r = _classify_exception(e)
    r["detail"] = f"n={n} (plain JAX: {plain[n][1]}): " + r["detail"]
    return r


def _is_polymask_error(e: BaseException) -> bool:
    import polymask as pm

    if isinstance(e, (pm.ShapeError, pm.UnsupportedError)):
        return True
    # a staged size check under jax.jit surfaces as a JaxRuntimeError carrying the
    # error (a ShapeError or a subclass: TooManyCases, FailsAsPlainJax, ...)
    return type(e).__name__ == "JaxRuntimeError" and _staged_polymask_error(str(e)) >= 0


# Python errors that, named inside a polymask message, are polymask's own bug
# rather than JAX refusing the program (JAX's refusals are TypeError / ValueError)
_INTERNAL_NAMES = ("AttributeError:", "NameError:", "UnboundLocalError:", "KeyError:")


def _internal_cause(e: BaseException):
    """An exception raised inside src/polymask that a ShapeError / UnsupportedError
    wraps (its ``__cause__`` / ``__context__`` chain), or None."""
    seen, todo = set(), [e.__cause__, e.__context__]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen or len(seen) > 20:
            continue
        seen.add(id(c))
        # JAX's JaxStackTraceBeforeTransformation only carries the user's stack
        if (not _is_polymask_error(c) and type(c).__name__ != "JaxStackTraceBeforeTransformation"
                and _polymask_frame(c)):
            return c
        todo += [c.__cause__, c.__context__]
    return None


def _is_value_check(e: AssertionError) -> bool:
    """An assertion of the oracle's comparisons (polymask.testing, NumPy's
    assert_allclose, this harness), not one raised inside JAX or a library."""
    if type(e.__cause__).__name__ == "JaxStackTraceBeforeTransformation" or not str(e):
        return False  # raised inside a JAX transformation (its frames filtered out)
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return True
    last = tb[-1].filename.replace(os.sep, "/")
    return any(k in last for k in ("/polymask/testing.py", "/numpy/testing/", "/real/harness.py"))


def _classify_exception(e: BaseException) -> dict:
    if isinstance(e, AssertionError) and _is_value_check(e):
        return {"status": "wrong", "detail": _exc_text(e, 900)}
    if _is_polymask_error(e):
        inner = _internal_cause(e)
        if inner is not None:
            return {"status": "crash", "detail": _exc_text(e, 500) + " [wraps "
                    + _exc_text(inner, 200) + f" at {_polymask_frame(inner)}]"}
        if any(k in str(e) for k in _INTERNAL_NAMES):
            return {"status": "crash",
                    "detail": "(an internal error wrapped in a polymask error) "
                              + _exc_text(e, 900)}
        return {"status": "error-polymask", "detail": _exc_text(e, 900)}
    where = _polymask_frame(e)
    return {"status": "crash", "detail": _exc_text(e) + (f" [at {where}]" if where else "")}


_PLAIN: dict = {}
_ORACLE_FUNS: dict = {}


def oracle_fun(prog):
    """``prog.fun`` for ``check_oracle``: traced as written when a JAX trace calls it
    (polymask's symbolic trace, ``make_jaxpr``), under ``jax.jit`` when called on
    concrete arrays or ``jax.grad``'s tracers (plain JAX's reference values and
    gradients, one compile per size instead of op-by-op dispatch)."""
    import jax

    if prog.name not in _ORACLE_FUNS:
        fun, jitted = prog.fun, jax.jit(prog.fun)

        def wrapped(*args):
            leaves = jax.tree_util.tree_leaves(args)
            if any(type(x).__name__ == "DynamicJaxprTracer" for x in leaves):
                return fun(*args)
            return jitted(*args)

        wrapped.__name__ = getattr(fun, "__name__", prog.name)
        wrapped.__wrapped__ = fun
        _ORACLE_FUNS[prog.name] = wrapped
    return _ORACLE_FUNS[prog.name]


def plain_results(prog, sizes):
    """``{n: ('ok', output) | ('err', text)}``: plain JAX on the exact arrays."""
    import jax
    import jax.numpy as jnp

    out = {}
    for n in sizes:
        key = (prog.name, n)
        if key not in _PLAIN:
            try:
                r = oracle_fun(prog)(*[jnp.asarray(a) for a in prog.example(n)])
                _PLAIN[key] = ("ok", jax.block_until_ready(r))
            except Exception as e:  # noqa: BLE001 - plain JAX's own error is the reference
                _PLAIN[key] = ("err", _exc_text(e, 300))
        out[n] = _PLAIN[key]
    return out


def _has_float_output(ref) -> bool:
    import jax
    import jax.numpy as jnp

    return any(jnp.issubdtype(jnp.result_type(r), jnp.floating)
               for r in jax.tree_util.tree_leaves(ref))


def _plain_grad_fails(prog, n):
    import jax
    import jax.numpy as jnp

    ex = [jnp.asarray(a) for a in prog.example(n)]
    argnums = tuple(i for i, a in enumerate(ex) if jnp.issubdtype(a.dtype, jnp.floating))
    if not argnums:
        return "no float argument"

    def loss(*xs):
        outs = jax.tree_util.tree_leaves(oracle_fun(prog)(*xs))
        return sum(jnp.sum(o) for o in outs if jnp.issubdtype(o.dtype, jnp.floating))

    try:
        jax.grad(loss, argnums)(*ex)
    except Exception as e:  # noqa: BLE001
        return _exc_text(e, 200)
    return None


def _padded(prog, n, bounds):
    from polymask.testing import _to_masked

    return [_to_masked(a, b) for a, b in zip(prog.example(n), bounds)]


def _check_raises(prog, mode, err_sizes, plain, bounds):
    """At sizes where plain JAX raises, the masked function must raise a ShapeError."""
    import jax

    import polymask as pm

    mfun = pm.mask(prog.fun, prog.specs(), constraints=prog.constraints)
    jf = jax.jit(mfun)
    for n in err_sizes:
        args = _padded(prog, n, bounds)
        try:
            if mode == "jit":
                with pm.shape_errors():
                    out = jax.block_until_ready(jf(*args))
            else:
                out = jax.block_until_ready(mfun(*args))
        except Exception as e:  # noqa: BLE001
            r = _unless_polymask_error(e, n, plain)
            if r is None:
                continue
            return r
        leaves = [getattr(o, "data", o) for o in
                  jax.tree_util.tree_leaves(out, is_leaf=lambda v: isinstance(v, pm.Masked))]
        return {"status": "wrong",
                "detail": f"n={n}: returned {_short(leaves)} where plain JAX raises "
                          f"{plain[n][1]}"}
    return None


def _short(leaves):
    import numpy as np

    parts = []
    for v in leaves[:2]:
        a = np.asarray(v)
        parts.append(repr(a.ravel()[:4].tolist()) if a.size else f"empty{a.shape}")
    return ", ".join(parts)


def run_mode(prog, mode: str, quick: bool = False) -> dict:
    """Run one mode of one program in this process (see the module docstring).

    ``quick`` (the test file's profile): ``grad`` runs on two sizes (the
    smallest where plain JAX runs and the middle one) and ``eager`` on the
    middle one instead of all, eager with array sizes only (no Python-int
    sizes), and ``pmjit`` runs the oracle
    sizes (whose plain results are already computed)."""
    t0 = time.perf_counter()
    try:
        r = _run_mode(prog, mode, quick)
    except Exception as e:  # noqa: BLE001 - every failure is a result
        r = _classify_exception(e)
    r.setdefault("detail", "")
    r["seconds"] = round(time.perf_counter() - t0, 2)
    return r


def _quick_sizes(ok, mode):
    """The quick profile's sizes: grad at the smallest and a middle size (an
    edge and a typical one); eager at the middle one (``jit`` checks every
    oracle size, edges included, through the same rules)."""
    if mode == "eager":
        return ok[len(ok) // 2:][:1]
    return ok if len(ok) <= 2 else [ok[0], ok[len(ok) // 2]]


def _run_mode(prog, mode, quick=False):
    if mode == "pmjit":
        return _run_pmjit(prog, quick)
    from polymask.testing import check_oracle

    sizes = prog.oracle_sizes()
    plain = plain_results(prog, sizes)
    ok = [n for n in sizes if plain[n][0] == "ok"]
    err = [n for n in sizes if plain[n][0] == "err"]
    bounds = prog.bounds()
    if mode == "grad":
        if not ok or not _has_float_output(plain[ok[0]][1]):
            return {"status": "n/a", "detail": "no float output"}
        why = _plain_grad_fails(prog, ok[-1])
        if why:
            return {"status": "n/a", "detail": f"plain JAX's grad fails: {why}"}
    run = _quick_sizes(ok, mode) if quick and mode in ("eager", "grad") else ok
    if run:
        try:
            check_oracle(oracle_fun(prog), [prog.example(n) for n in run], bounds, prog.specs(),
                         constraints=prog.constraints, modes=(mode,), rtol=prog.rtol,
                         atol=prog.atol, static_sizes=(mode == "eager" and not quick))
        except Exception as e:  # noqa: BLE001
            r = _classify_exception(e)
            r["detail"] = f"sizes {run}: " + r["detail"]
            return r
    if mode in ("eager", "jit") and err:
        r = _check_raises(prog, mode, err, plain, bounds)
        if r is not None:
            return r
    note = f"plain JAX raises at n={err}" if err else ""
    return {"status": "pass", "detail": note}


def _run_pmjit(prog, quick=False):
    import jax
    import numpy as np

    import polymask as pm

    sizes = prog.oracle_sizes() if quick and prog.pmjit_sizes is None else prog.jit_sizes()
    plain = plain_results(prog, sizes)
    policy = pm.buckets.pow2(minimum=4)
    f = pm.jit(prog.fun, prog.specs(), buckets=policy, constraints=prog.constraints)
    buckets = set()
    for n in sizes:
        ex = prog.example(n)
        if plain[n][0] == "err":
            try:
                out = f(*ex)
            except Exception as e:  # noqa: BLE001
                r = _unless_polymask_error(e, n, plain)
                if r is None:
                    continue
                return r
            return {"status": "wrong",
                    "detail": f"n={n}: returned {_short(jax.tree_util.tree_leaves(out))} "
                              f"where plain JAX raises {plain[n][1]}"}
        buckets.add(tuple(sorted(f.plans.plan(ex)[0].buckets.items())))  # per dim var
        try:
            out = f(*ex)
        except Exception as e:  # noqa: BLE001
            r = _classify_exception(e)
            r["detail"] = f"n={n}: " + r["detail"]
            return r
        got, want = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(plain[n][1])
        try:
            assert len(got) == len(want), f"{len(got)} outputs, expected {len(want)}"
            for k, (g, w) in enumerate(zip(got, want)):
                g, w = np.asarray(g), np.asarray(w)
                assert g.shape == w.shape, f"output {k}: shape {g.shape} != {w.shape}"
                if np.issubdtype(w.dtype, np.inexact):
                    np.testing.assert_allclose(g, w, rtol=prog.rtol, atol=prog.atol,
                                               err_msg=f"output {k}")
                else:
                    np.testing.assert_array_equal(g, w, err_msg=f"output {k}")
        except AssertionError as e:
            return {"status": "wrong", "detail": f"n={n}: " + _exc_text(e, 600)}
    st = f.stats()
    compiles, exact = int(st["compiles"]), int(st["exact_compiles"])
    distinct = len({tuple(np.shape(a) for a in prog.example(n)) for n in sizes
                    if plain[n][0] == "ok"})
    # axes the runner made static (a size needed as a Python value): a program per
    # size of them and bucket of the others, at most jax.jit's one per shape
    static = sorted(k for k in f.fallbacks() if k.endswith("(static)"))
    r = {"status": "pass", "compiles": compiles, "buckets": len(buckets),
         "exact_compiles": exact, "distinct_shapes": distinct, "static_axes": len(static),
         "detail": f"{compiles} compiles for {len(buckets)} buckets over sizes {list(sizes)}"
                   + (f" ({', '.join(static)})" if static else "")}
    if exact:
        reasons = sorted({why.splitlines()[0][:160] for why in f.fallbacks().values()})
        r["detail"] += (f"; {exact} per-shape compiles (fallback, {distinct} distinct shapes): "
                        + " | ".join(reasons))
    if compiles + exact > max(len(buckets), distinct) or (
            not exact and not static and compiles > len(buckets)):
        r["status"] = "wrong"
        r["detail"] = "more compiles than buckets (or than jax.jit): " + r["detail"]
    return r


# -- the worker process ---------------------------------------------------------------------------
def worker_main():
    """Read ``{"program", "mode"}`` requests (JSON lines) on stdin, answer on the
    original stdout (other output goes to stderr)."""
    try:
        os.nice(10)
    except OSError:
        pass
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (jax.debug.print, warnings) go to stderr
    from real import corpus

    for line in sys.stdin:
        req = json.loads(line)
        prog = corpus.get(req["program"])
        res = run_mode(prog, req["mode"], req.get("quick", False))
        out.write(_TAG + json.dumps(res) + "\n")


class Worker:
    """A worker subprocess; ``run(program, mode)`` with a time limit (a hang kills it)."""

    def __init__(self, log=None):
        self.proc = None
        self.log = log
        self._buf = b""

    def _start(self):
        env = dict(os.environ)
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.setdefault("POLYMASK_TIERED", "0")
        env.setdefault("POLYMASK_CACHE_DIR", "off")
        env.setdefault("POLYMASK_REUSE_HOST_MEMORY", "off")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(TESTS_DIR), str(REPO / "src"), env.get("PYTHONPATH", "")])
        code = "from real.harness import worker_main; worker_main()"
        self._log = self.log or tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     start_new_session=True)
        self._buf = b""

    def run(self, program: str, mode: str, timeout: float, quick: bool = False) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        t0 = time.perf_counter()
        req = {"program": program, "mode": mode, "quick": quick}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        fd = self.proc.stdout.fileno()
        deadline = t0 + timeout
        while True:
            if b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(_TAG):
                    return json.loads(text[len(_TAG):])
                continue
            left = deadline - time.perf_counter()
            if left <= 0:
                self.close()
                return {"status": "hang", "seconds": round(time.perf_counter() - t0, 1),
                        "detail": f"no result within {timeout:.0f} s (worker killed)"}
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:  # the worker died (segfault, abort, out of memory)
                    rc = self.proc.wait()
                    self.proc = None
                    return {"status": "crash", "seconds": round(time.perf_counter() - t0, 1),
                            "detail": f"worker process died (exit code {rc})"}
                self._buf += chunk

    def close(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            self.proc = None


def run_program(worker: Worker, prog, modes=None, quick=False) -> dict:
    """``{mode: result}`` for one program, each mode under its time limit."""
    modes = prog.modes if modes is None else [m for m in modes if m in prog.modes]
    return {m: worker.run(prog.name, m, prog.timeout, quick) for m in modes}


def run_corpus(progs, modes=None, progress=None, quick=False) -> dict:
    """``{program name: {mode: result}}`` for ``progs`` in one worker process."""
    w = Worker()
    out = {}
    try:
        for p in progs:
            out[p.name] = run_program(w, p, modes, quick)
            if progress:
                progress(p, out[p.name])
    finally:
        w.close()
    return out
