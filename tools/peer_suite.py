"""Run JAX's own shape-polymorphism harnesses under ``polymask.mask``.

JAX's ``tests/shape_poly_test.py`` lists ``PolyHarness`` objects
(``_POLY_SHAPE_TEST_HARNESSES``): a function, its arguments and a
``jax.export`` shape spec per argument (``"b, ..."``, ``"_, b, _"``, with
``symbolic_constraints``). JAX exports each one shape-polymorphically; here
each one is masked instead: every polymorphic argument is padded (each dim var
to about twice its value, the padding filled with garbage: NaN for floats,
huge values for ints, True for bools), ``polymask.mask(f, specs,
constraints=...)`` runs eagerly, and the unpadded outputs are compared with
plain JAX (``jax.jit(f)``) on the exact arrays. Each case is classified:

  pass     outputs equal (shapes, dtypes, values within a dtype tolerance)
  refused  polymask raised ShapeError or UnsupportedError (a documented "no")
  wrong    a shape/dtype/value mismatch, or NaN leaking from the padding
  crash    any other exception (a raw JAX/Python error), a timeout, or the
           worker process dying
  skip     the harness expects JAX itself to fail, plain JAX fails on it here,
           or it cannot be set up (device-specific, PRNG-key arguments, ...)

The harness file is not vendored: pass a copy of ``tests/shape_poly_test.py``
from the JAX release matching the installed jax (here jax-v0.10.2)::

    git --git-dir=<jax mirror> show jax-v0.10.2:tests/shape_poly_test.py > /tmp/spt.py
    nice -n 10 python tools/peer_suite.py --jax-tests /tmp/spt.py --out results.json

Without ``--jax-tests`` the copy ``tools/peer/shape_poly_test_v0_10_2.py`` is
used when present. ``--per-group N`` (default 3; 0 = all) takes the first N
harnesses of each group, ``--only GROUP`` / ``--case FULLNAME`` (repeatable)
narrow the selection, ``--jobs 0`` runs in this process (no timeout; for
debugging with ``-v``). Cases run in a worker process that is restarted after
a timeout (``--timeout``) or a hard crash, so one case never stops the run.
The exit code is 1 when any case is ``wrong`` or ``crash``.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import sys
import time
import traceback
import zlib

STATUSES = ("pass", "refused", "wrong", "crash", "skip")
DEFAULT_COPY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer",
                            "shape_poly_test_v0_10_2.py")
# float tolerance (rtol and atol) by dtype name; a harness's own `tol` raises it.
TOLERANCE = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-5, "complex64": 1e-5,
             "float64": 1e-12, "complex128": 1e-12}
LOOSE = 1e-3  # a `wrong` within LOOSE * max|want| everywhere is flagged "near"


class Skip(Exception):
    """The case cannot be run here; the message says why."""


# ----------------------------------------------------------------------------
# Loading and selecting the harnesses
# ----------------------------------------------------------------------------
def load_harness_module(path: str):
    """Import JAX's shape_poly_test.py (it parses absl flags from sys.argv at import)."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else "peer_suite"]
    try:
        spec = importlib.util.spec_from_file_location("_polymask_peer_shape_poly_test", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    finally:
        sys.argv = saved
    return mod


def flat_harnesses(mod) -> list:
    def flatten(hs):
        out = []
        for h in hs:
            if isinstance(h, (list, tuple)):
                out.extend(flatten(h))
            else:
                out.append(h)
        return out

    return flatten(mod._POLY_SHAPE_TEST_HARNESSES)


def select(harnesses, per_group: int = 3, only=(), cases=()) -> list[int]:
    """Indices into ``harnesses``: the first ``per_group`` of each group (0 = all)."""
    counts: collections.Counter = collections.Counter()
    out = []
    for i, h in enumerate(harnesses):
        if only and h.group_name not in only:
            continue
        if cases and h.fullname not in cases:
            continue
        if per_group and counts[h.group_name] >= per_group:
            continue
        counts[h.group_name] += 1
        out.append(i)
    return out


# ----------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------
def _skip_reason(h) -> str | None:
    """Skips of JAX's own ShapePolyHarnessesTest.test_harness that concern the
    device or the comparison (not jax.export limitations, which polymask does
    not share), plus harnesses that expect JAX itself to fail."""
    from jax._src import test_util as jtu

    if h.expect_error is not None:
        etype, regex = h.expect_error
        return f"harness expects JAX to fail: {getattr(etype, '__name__', etype)}: {regex}"
    if h.group_name in ("schur", "eig") and not jtu.test_device_matches(["cpu"]):
        return f"{h.group_name} is implemented only on CPU"
    if h.group_name == "vmap_eigh":
        return "JAX skips it: eigendecompositions are not compared for equality directly"
    return None


def _config_flags(h) -> dict:
    flags = dict(getattr(h, "override_jax_config_flags", {}) or {})
    if "random_gamma" in h.group_name:
        flags["jax_debug_key_reuse"] = False  # as JAX's test_harness does
    return flags


def _is_key(x) -> bool:
    import jax

    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def prepare(h):
    """(args, masked args, in_specs, constraints) for harness ``h``.

    Each dim var ``v`` of logical value ``n`` gets the bound ``max(2n, n + 1)``;
    an axis ``a*v + c`` is padded to ``a*bound + c`` (so axes sharing a var
    agree); an axis of another form to twice its size (polymask refuses it).

    Raises:
      Skip: the specs do not match the arguments, or a polymorphic argument
        cannot be padded (a PRNG key array).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src.tree_util import broadcast_prefix

    import polymask as pm
    from polymask import _jax_compat as compat
    from polymask.testing import garbage_pad

    rng = np.random.RandomState(zlib.adler32(h.fullname.encode()))
    args = tuple(jax.tree.map(jnp.array, list(h.dyn_args_maker(rng))))
    if not args:
        raise Skip("no dynamic arguments")
    specs = h.polymorphic_shapes
    specs = tuple(specs) if isinstance(specs, list) else specs
    leaves, treedef = jax.tree_util.tree_flatten(args)
    try:
        flat_specs = broadcast_prefix(specs, args, is_leaf=lambda x: x is None)
    except ValueError as e:
        raise Skip(f"polymorphic_shapes {specs!r} do not match the arguments: {e}") from None
    constraints = tuple(getattr(h, "symbolic_constraints", ()) or ())
    scope = jax.export.SymbolicScope(constraints)
    sym = []
    for leaf, sp in zip(leaves, flat_specs):
        if sp is None:
            sym.append(None)
            continue
        try:
            sym.append(jax.export.symbolic_shape(sp, like=np.shape(leaf), scope=scope))
        except Exception as e:
            raise Skip(f"spec {sp!r} does not fit shape {np.shape(leaf)}: {e}") from None
        if _is_key(leaf) and any(compat.is_dim_expr(d) for d in sym[-1]):
            raise Skip("a PRNG key array with a polymorphic shape (cannot pad it with garbage)")

    # Logical value of each dim var, from the first axis affine in it alone.
    values: dict[str, int] = {}
    for leaf, shape in zip(leaves, sym):
        for d, size in zip(shape or (), np.shape(leaf)):
            names = compat.dim_vars(d)
            if len(names) != 1 or next(iter(names)) in values:
                continue
            (v,) = names
            c = int(compat.evaluate_dim(d, {v: 0}))
            a = int(compat.evaluate_dim(d, {v: 1})) - c
            if a > 0 and (size - c) % a == 0:
                values[v] = (size - c) // a
    bounds = {v: max(2 * n, n + 1) for v, n in values.items()}

    margs_flat = []
    for leaf, shape, sp in zip(leaves, sym, flat_specs):
        if sp is None:
            margs_flat.append(leaf)
            continue
        bound, sizes = [], []
        for d, size in zip(shape, np.shape(leaf)):
            if not compat.is_dim_expr(d):
                bound.append(int(size))
                sizes.append(int(size))
                continue
            b = None
            if compat.dim_vars(d) <= set(bounds):
                try:
                    b = int(compat.evaluate_dim(d, bounds))
                except Exception:
                    b = None
            if b is None or b < size:
                b = max(2 * int(size), int(size) + 1)
            bound.append(b)
            sizes.append(np.int32(size))
        buf = garbage_pad(np.asarray(leaf), bound, fill=_garbage(leaf.dtype))
        margs_flat.append(pm.Masked(jnp.asarray(buf), tuple(sizes)))
    in_specs = jax.tree_util.tree_unflatten(treedef, flat_specs)
    margs = jax.tree_util.tree_unflatten(treedef, margs_flat)
    return args, tuple(margs), tuple(in_specs), constraints


def _garbage(dtype):
    """The padding value: NaN for floats (bfloat16 too), True, or a huge int."""
    import jax.numpy as jnp

    if jnp.issubdtype(dtype, jnp.inexact):
        return float("nan")
    if jnp.issubdtype(dtype, jnp.bool_):
        return True
    return int(jnp.iinfo(dtype).max) // 2 + 7


def _tolerance(h, dtype) -> float:
    tol = TOLERANCE.get(str(dtype), 1e-5)
    if getattr(h, "tol", None) is not None:
        tol = max(tol, float(h.tol))
    return tol


def compare(h, out, ref) -> tuple[str, str, dict]:
    """("pass" | "wrong", message, extra fields) for masked outputs ``out``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import polymask as pm

    outs = jax.tree_util.tree_leaves(out, is_leaf=lambda v: isinstance(v, pm.Masked))
    refs = jax.tree_util.tree_leaves(ref)
    if len(outs) != len(refs):
        return "wrong", f"{len(outs)} outputs, expected {len(refs)}", {}
    for k, (o, r) in enumerate(zip(outs, refs)):
        got = o.unpad() if isinstance(o, pm.Masked) else o
        if _is_key(r):
            r = jax.random.key_data(r)
            got = jax.random.key_data(got) if _is_key(got) else got
        got, want = np.asarray(got), np.asarray(r)
        where = f"output {k}"
        if got.shape != want.shape:
            return "wrong", f"{where}: logical shape {got.shape} != {want.shape}", {}
        if got.dtype != want.dtype:
            return "wrong", f"{where}: dtype {got.dtype} != {want.dtype}", {}
        if not jnp.issubdtype(want.dtype, jnp.inexact):
            if not np.array_equal(got, want):
                bad = np.argwhere(got != want)
                i = tuple(int(j) for j in bad[0])
                return "wrong", (f"{where}: {len(bad)}/{want.size} elements differ, first at "
                                 f"{i}: got {got[i]!r}, want {want[i]!r}"), {}
            continue
        g = got.astype(np.complex128 if jnp.issubdtype(want.dtype, jnp.complexfloating)
                       else np.float64)
        w = want.astype(g.dtype)
        leak = np.isnan(g) & ~np.isnan(w)
        if leak.any():
            i = tuple(int(j) for j in np.argwhere(leak)[0])
            return "wrong", (f"{where}: NaN where JAX gives a number ({int(leak.sum())}/"
                             f"{want.size} elements, first at {i}; want {w[i]!r}): NaN "
                             "leaking from the padding?"), {"nan_leak": True}
        tol = _tolerance(h, want.dtype)
        with np.errstate(invalid="ignore"):
            err = np.abs(g - w)
            bad = ~(np.isclose(g, w, rtol=tol, atol=tol, equal_nan=True))
        if bad.any():
            finite = np.isfinite(err)
            scale = float(np.max(np.abs(w[np.isfinite(w)]), initial=1.0))
            max_err = float(np.max(err[finite], initial=0.0))
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            near = bool(finite[bad].all() and max_err <= LOOSE * max(scale, 1.0))
            return "wrong", (f"{where}: {int(bad.sum())}/{want.size} elements differ "
                             f"(rtol=atol={tol:g}), max abs err {max_err:.3g} (max |want| "
                             f"{scale:.3g}), first at {i}: got {g[i]!r}, want {w[i]!r}"), \
                {"near": near, "max_abs_err": max_err}
    return "pass", "", {}


_PRIM = re.compile(r"primitive '([^']+)'")
_LOC = re.compile(r"\s*\(?(used )?at [^\s()]+:\d+ \([^)]*\)\)?")


def refusal_reason(e: BaseException) -> tuple[str, str | None]:
    """(short reason for grouping, primitive named or None)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    m = _PRIM.search(first)
    prim = m.group(1) if m else None
    reason = _LOC.sub("", first)
    reason = re.sub(r"; see \S+ for the covered primitives", "", reason)
    if prim and "no masking rule" in reason:
        return f"no masking rule for '{prim}'", prim
    if prim and " here: " in reason:
        return f"{prim}: {reason.split(' here: ', 1)[1]}"[:200], prim
    # ShapeError: drop argument paths, numbers and file locations for grouping
    reason = re.sub(r"\S+\.py:\d+", "<loc>", reason)
    return f"{type(e).__name__}: {reason}"[:200], prim


def run_case(h, verbose: bool = False) -> dict:
    """Classify one harness; never raises."""
    res = {"group": h.group_name, "name": h.name, "fullname": h.fullname,
           "specs": repr(h.polymorphic_shapes),
           "constraints": list(getattr(h, "symbolic_constraints", ()) or ()),
           "status": None, "message": ""}
    t0 = time.perf_counter()
    try:
        _run_case(h, res, verbose)
    except Exception as e:  # a bug of this script or something unforeseen
        res.update(status="crash", message=f"peer_suite: {type(e).__name__}: {e}"[:2000],
                   traceback=traceback.format_exc()[-4000:])
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def _run_case(h, res: dict, verbose: bool) -> None:
    import jax
    from jax._src import test_util as jtu

    import polymask as pm

    reason = _skip_reason(h)
    if reason:
        res.update(status="skip", message=reason)
        return
    with jtu.thread_local_config_context(**_config_flags(h)):
        try:
            args, margs, in_specs, constraints = prepare(h)
        except Skip as e:
            res.update(status="skip", message=f"setup: {e}")
            return
        except Exception as e:  # a bug of this script: flagged, not skipped
            res.update(status="crash", error=type(e).__name__,
                       message=f"peer_suite setup: {type(e).__name__}: {_first_line(e)}",
                       traceback=traceback.format_exc()[-4000:])
            return
        res["in_specs"] = repr(in_specs)
        res["padded"] = [repr(tuple(m.bound)) if isinstance(m, pm.Masked) else None
                         for m in jax.tree_util.tree_leaves(
                             margs, is_leaf=lambda v: isinstance(v, pm.Masked))]
        try:
            ref = jax.block_until_ready(jax.jit(h.dyn_fun)(*args))
        except Exception as e:
            res.update(status="skip", message=f"plain JAX fails on the exact arrays: "
                                              f"{type(e).__name__}: {_first_line(e)}")
            return
        try:
            out = pm.mask(h.dyn_fun, in_specs, constraints=constraints)(*margs)
            out = jax.block_until_ready(out)
        except (pm.ShapeError, pm.UnsupportedError) as e:
            reason, prim = refusal_reason(e)
            res.update(status="refused", message=_first_line(e), error=type(e).__name__,
                       reason=reason, primitive=prim, names_primitive=prim is not None)
            if verbose:
                traceback.print_exc()
            return
        except Exception as e:
            res.update(status="crash", message=f"{type(e).__name__}: {_first_line(e)}",
                       error=type(e).__name__, traceback=traceback.format_exc()[-4000:])
            if verbose:
                traceback.print_exc()
            return
        try:
            status, msg, extra = compare(h, out, ref)
        except Exception as e:
            res.update(status="crash",
                       message=f"reading the outputs: {type(e).__name__}: {_first_line(e)}",
                       error=type(e).__name__, traceback=traceback.format_exc()[-4000:])
            return
        res.update(status=status, message=msg, **extra)


def _first_line(e: BaseException, limit: int = 400) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else "")[:limit]


# ----------------------------------------------------------------------------
# Worker processes (a timeout or a segfault costs one case, not the run)
# ----------------------------------------------------------------------------
def _worker_main(conn, jax_tests: str) -> None:  # pragma: no cover - child process
    try:
        harnesses = flat_harnesses(load_harness_module(jax_tests))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", len(harnesses)))
    while True:
        try:
            idx = conn.recv()
        except EOFError:
            return
        if idx is None:
            return
        conn.send(("result", run_case(harnesses[idx])))


class _Worker:
    def __init__(self, ctx, jax_tests: str, load_timeout: float):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, jax_tests), daemon=True)
        self.proc.start()
        child.close()
        self.idx: int | None = None
        self.started = 0.0
        if not self.conn.poll(load_timeout):
            self.kill()
            raise RuntimeError(f"worker did not load {jax_tests} in {load_timeout:.0f} s")
        kind, payload = self.conn.recv()
        if kind != "ready":
            self.kill()
            raise RuntimeError(f"worker could not load {jax_tests}: {payload}")

    def submit(self, idx: int) -> None:
        self.idx, self.started = idx, time.monotonic()
        self.conn.send(idx)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


def run_in_workers(harnesses, indices, jax_tests, jobs, timeout, progress):
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    pending = collections.deque(indices)
    results: dict[int, dict] = {}
    workers = [_Worker(ctx, jax_tests, 600) for _ in range(min(jobs, len(indices)))]

    def lost(w, why):
        h = harnesses[w.idx]
        results[w.idx] = {"group": h.group_name, "name": h.name, "fullname": h.fullname,
                          "specs": repr(h.polymorphic_shapes), "status": "crash",
                          "message": why, "error": "worker",
                          "seconds": round(time.monotonic() - w.started, 3)}
        progress(results[w.idx])
        w.kill()
        return _Worker(ctx, jax_tests, 600)

    try:
        for w in workers:
            if pending:
                w.submit(pending.popleft())
        while any(w.idx is not None for w in workers):
            busy = [w for w in workers if w.idx is not None]
            left = min(timeout - (time.monotonic() - w.started) for w in busy)
            ready = wait([w.conn for w in busy] + [w.proc.sentinel for w in busy],
                         timeout=max(left, 0.01))
            for i, w in enumerate(workers):
                if w.idx is None:
                    continue
                new = None
                if w.conn in ready:
                    try:
                        _, res = w.conn.recv()
                    except (EOFError, OSError):
                        new = lost(w, f"worker process died (exit code {w.proc.exitcode})")
                    else:
                        results[w.idx] = res
                        progress(res)
                        w.idx = None
                elif w.proc.sentinel in ready or not w.proc.is_alive():
                    w.proc.join(5)
                    new = lost(w, f"worker process died (exit code {w.proc.exitcode})")
                elif time.monotonic() - w.started > timeout:
                    new = lost(w, f"timeout: no result after {timeout:.0f} s")
                if new is not None:
                    workers[i] = w = new
                if w.idx is None and pending:
                    w.submit(pending.popleft())
    finally:
        for w in workers:
            w.close()
    return [results[i] for i in indices]


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------
def totals(results) -> dict:
    c = collections.Counter(r["status"] for r in results)
    t = {s: c.get(s, 0) for s in STATUSES}
    ran = len(results) - t["skip"]
    t["total"] = len(results)
    t["pass_pct_of_non_skipped"] = round(100.0 * t["pass"] / ran, 1) if ran else None
    return t


def report(results, out=sys.stdout) -> None:
    groups: dict[str, collections.Counter] = {}
    for r in results:
        groups.setdefault(r["group"], collections.Counter())[r["status"]] += 1
    w = max([len(g) for g in groups] + [5])
    head = f"{'group':<{w}}  {'n':>3}  " + "  ".join(f"{s:>7}" for s in STATUSES)
    print(head, file=out)
    print("-" * len(head), file=out)
    for g, c in groups.items():
        cells = "  ".join(f"{(c[s] or ''):>7}" for s in STATUSES)
        print(f"{g:<{w}}  {sum(c.values()):>3}  {cells}", file=out)
    t = totals(results)
    print("-" * len(head), file=out)
    print(f"{'TOTAL':<{w}}  {t['total']:>3}  " + "  ".join(f"{t[s]:>7}" for s in STATUSES),
          file=out)
    print(f"pass: {t['pass_pct_of_non_skipped']}% of the {t['total'] - t['skip']} non-skipped "
          "cases", file=out)
    for status in ("wrong", "crash"):
        bad = [r for r in results if r["status"] == status]
        if bad:
            print(f"\n{status} ({len(bad)}):", file=out)
            for r in bad:
                near = " [near: within 1e-3 of the scale]" if r.get("near") else ""
                print(f"  {r['fullname']}  specs={r.get('specs')}{near}\n      {r['message']}",
                      file=out)
    reasons = collections.Counter(r["reason"] for r in results if r["status"] == "refused")
    if reasons:
        print("\nrefusal reasons:", file=out)
        for reason, n in reasons.most_common():
            print(f"  {n:>4}  {reason}", file=out)
    skips = collections.Counter(re.sub(r":.*", "", r["message"]) if r["message"].startswith(
        "harness expects") else r["message"][:120] for r in results if r["status"] == "skip")
    if skips:
        print("\nskip reasons:", file=out)
        for reason, n in skips.most_common():
            print(f"  {n:>4}  {reason}", file=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jax-tests", default=None,
                   help="a copy of JAX's tests/shape_poly_test.py (default: "
                        "tools/peer/shape_poly_test_v0_10_2.py when present)")
    p.add_argument("--per-group", type=int, default=3,
                   help="first N harnesses of each group (0 = all; default 3)")
    p.add_argument("--only", action="append", default=[], metavar="GROUP",
                   help="only this harness group (repeatable)")
    p.add_argument("--case", action="append", default=[], metavar="FULLNAME",
                   help="only the harness with this full name (repeatable)")
    p.add_argument("--out", default=None, help="write every case as JSON here")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes (default 1; 0 = run in this process, no timeout)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per case (workers)")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print tracebacks (with --jobs 0)")
    a = p.parse_args(argv)

    jax_tests = a.jax_tests or DEFAULT_COPY
    if not os.path.exists(jax_tests):
        p.error(f"{jax_tests} not found: pass --jax-tests with a copy of JAX's "
                "tests/shape_poly_test.py for the installed jax, e.g. `git show "
                "jax-v0.10.2:tests/shape_poly_test.py` in a clone of jax-ml/jax")
    jax_tests = os.path.abspath(jax_tests)

    import jax

    mod = load_harness_module(jax_tests)
    harnesses = flat_harnesses(mod)
    indices = select(harnesses, a.per_group, set(a.only), set(a.case))
    if a.list:
        for i in indices:
            print(harnesses[i].fullname)
        return 0
    print(f"jax {jax.__version__}; {len(harnesses)} harnesses in {jax_tests}; "
          f"running {len(indices)} ({a.per_group or 'all'} per group)", flush=True)
    if not indices:
        print("nothing selected", file=sys.stderr)
        return 2

    n = len(indices)
    done = [0]

    def progress(r):
        done[0] += 1
        msg = f"  {r['message'][:110]}" if r["status"] != "pass" else ""
        print(f"[{done[0]:>4}/{n}] {r['status']:<7} {r['fullname']} ({r.get('seconds', 0):.1f}s)"
              f"{msg}", flush=True)

    t0 = time.time()
    if a.jobs <= 0:
        results = []
        for i in indices:
            results.append(run_case(harnesses[i], verbose=a.verbose))
            progress(results[-1])
    else:
        results = run_in_workers(harnesses, indices, jax_tests, a.jobs, a.timeout, progress)
    print(file=sys.stdout)
    report(results)
    t = totals(results)
    print(f"\n{n} cases in {time.time() - t0:.0f} s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"jax_version": jax.__version__, "jax_tests": jax_tests,
                       "per_group": a.per_group, "only": a.only, "case": a.case,
                       "totals": t, "cases": results}, f, indent=1)
    return 1 if t["wrong"] or t["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
