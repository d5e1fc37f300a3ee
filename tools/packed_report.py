"""The real-program corpus (tests/real) through ``ragged_map(layout="packed")``.

    python tools/packed_report.py                      # every program, 2 at a time
    python tools/packed_report.py --only optax_ntxent nanogpt_forward_loss
    python tools/packed_report.py --jobs 1 --no-grad --json packed.json
    python tools/packed_report.py --inline --only s4_recurrent_scan   # no subprocess

For every corpus program whose specs name exactly one dim var (the others are
listed as ``skipped: several dim vars``), the examples are the program's
inputs at its oracle and ``polymask.jit`` sizes (``Program.oracle_sizes`` and
``jit_sizes``: 0, 1, 2, middle, bound - 1, bound) where plain JAX runs. Unpadded
arguments (spec ``None``) that are the same at every size are passed as
``ragged_map``'s broadcast arguments (shared parameters); ones that differ are
example arguments without a dim var (one value per example). The examples run
in one call of ``polymask.ragged_map(fun, specs, layout="packed",
row_size=R)`` for two row sizes: ``R`` = the longest example (the bound's
example fills a row alone, the others share rows) and the power of two
``>= 2 R`` (every example, the bound's included, shares a row with others
and with the row's padding tail). Every example's outputs are compared with
plain JAX (jitted) on that exact example, with the corpus harness's
tolerances (``Program.rtol`` / ``atol``).

Result per program: ``packed-correct``; ``packed-WRONG`` (a value, shape or
dtype mismatch: the max abs difference); ``refused`` (``PackedUnsupported``:
its primitive and reason); ``error`` (any other exception: type and first
line, and the innermost polymask frame); ``hang`` (no answer within
``--timeout`` seconds: the subprocess is killed). The ``packed`` column says
how many examples ran packed (``stats()["layout"]``; the rest ran in the
padded layout, e.g. sizes where the trace takes another case), so a correct
result with few packed examples is not mistaken for coverage.

Gradients (``--no-grad`` skips them): for programs with the ``grad`` mode,
``loss(params, *example)`` = the sum of the program's float outputs, ``params``
= its float unpadded arguments that are the same at every size (the other
unpadded arguments are closed over); ``polymask.value_and_grad(loss, specs,
layout="packed", reduce="sum", row_size=R)`` on the sizes where plain
``jax.value_and_grad`` runs is compared with the sum of the per-example plain
values and gradients (``atol`` scaled by the number of examples).

Each program runs in its own subprocess (``--jobs`` at a time) with a time
limit. Run with the venv's interpreter from the repository root, e.g.
``/work/v312/bin/python tools/packed_report.py``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

_TAG = "@@packed-report@@ "
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# -- one program (in the child process) -----------------------------------------------------------
def dim_vars(specs) -> set[str]:
    out = set()
    for s in specs:
        if s is None:
            continue
        if not isinstance(s, str):  # a pytree of specs
            import jax
            return dim_vars(jax.tree_util.tree_leaves(s)) | out
        out |= set(_IDENT.findall(s))
    return out


def _first_line(e: BaseException, limit=300) -> str:
    text = " ".join(str(e).strip().split("\n")[0].split())
    return f"{type(e).__name__}: {text[:limit]}"


def _polymask_frame(e: BaseException) -> str:
    where = ""
    for fs in traceback.extract_tb(e.__traceback__):
        fn = fs.filename.replace(os.sep, "/")
        if "/src/polymask/" in fn:
            where = f"{fn.split('/src/')[-1]}:{fs.lineno} in {fs.name}"
    return where


def _refusal(e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = text.replace("ragged_map(layout='packed'): ", "")
    return text[:400]


def _refused_primitive(text: str) -> str:
    m = re.search(r"primitive '([\w\-]+)'", text)
    if m:
        return m.group(1)
    if "dim vars" in text:
        return "(several dim vars)"
    if "size" in text and "ragged axis" in text:
        return "(a size other than n)"
    return "(" + text[:60] + ")"


def _same_everywhere(values) -> bool:
    import numpy as np

    a0 = np.asarray(values[0])
    for v in values[1:]:
        a = np.asarray(v)
        if a.shape != a0.shape or a.dtype != a0.dtype or not np.array_equal(a, a0,
                                                                            equal_nan=True):
            return False
    return True


def _compare(got, want, rtol, atol) -> tuple[bool, str, float]:
    """(ok, what, max abs diff) of one example's outputs."""
    import jax
    import numpy as np

    g_leaves, w_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    if len(g_leaves) != len(w_leaves):
        return False, f"{len(g_leaves)} outputs, expected {len(w_leaves)}", float("inf")
    worst, what, ok = 0.0, "", True
    for k, (g, w) in enumerate(zip(g_leaves, w_leaves)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return False, f"output {k}: shape {g.shape} != {w.shape}", float("inf")
        if g.dtype != w.dtype:
            ok, what = False, f"output {k}: dtype {g.dtype} != {w.dtype}"
        if g.size == 0:
            continue
        if np.issubdtype(w.dtype, np.inexact) or np.issubdtype(g.dtype, np.inexact):
            gf, wf = g.astype(np.float64), w.astype(np.float64)
            nan_mismatch = np.isnan(gf) != np.isnan(wf)
            both = ~np.isnan(gf) & ~np.isnan(wf)
            inf_eq = np.isinf(gf) & np.isinf(wf) & (gf == wf)
            diff = np.where(both & ~inf_eq, np.abs(gf - wf), 0.0)
            d = float(np.max(diff)) if diff.size else 0.0
            if nan_mismatch.any():
                d = float("inf")
            try:
                np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
            except AssertionError:
                ok = False
                if d >= worst:
                    what = (f"output {k} {w.shape}: max abs diff {d:.3g}"
                            + (" (NaN where plain JAX has a number or back)"
                               if nan_mismatch.any() else ""))
            worst = max(worst, d)
        else:
            bad = g != w
            if bad.any():
                ok = False
                what = f"output {k} {w.shape} {w.dtype}: {int(bad.sum())} entries differ"
                worst = max(worst, float(np.max(np.abs(g.astype(np.int64)
                                                       - w.astype(np.int64)))))
    return ok, what, worst


def _per_size(run: dict, rm, R: int) -> None:
    """Mark a run whose packed program serves one size only (the function's
    trace takes a case per size, e.g. ``len(x)`` or ``range(n)`` as a Python
    int: the row program is the case of the size it was traced at, so only
    examples of exactly that size run packed, a row each)."""
    prog = getattr(getattr(rm, "_packed", None), "program", None)
    if prog is None or run["result"] not in ("packed-correct", "refused"):
        return
    if run["result"] == "refused" and "no example fits" not in run["detail"]:
        return
    if prog.tree is None or prog.tree.single:
        return
    reach = [n for n in range(R + 1) if prog.runs(n)]
    if len(reach) > 1:
        return
    where = re.findall(r"at (\S+:\d+ \([^)]*\))", prog.tree.summary())
    run["per_size"] = (f"the trace takes a case per size ({len(prog.tree.cases)} cases up to "
                       f"R={R}; first split at {where[0] if where else '?'}): only n = "
                       f"{reach} runs in the row program")


def run_one(name: str, grad: bool = True) -> dict:

    from real import corpus, harness

    import polymask as pm
    from polymask.core.plan import plan_call, policy_getter

    prog = corpus.get(name)
    specs = prog.specs()
    var = dim_vars(specs)
    res = {"program": name}
    if len(var) != 1:
        res.update(result="skipped", detail=f"several dim vars ({', '.join(sorted(var))})")
        return res
    sizes = sorted(set(prog.oracle_sizes()) | set(prog.jit_sizes()))
    plain = harness.plain_results(prog, sizes)
    ok = [n for n in sizes if plain[n][0] == "ok"]
    res["sizes"] = ok
    res["plain_raises"] = [n for n in sizes if plain[n][0] == "err"]
    if not ok:
        res.update(result="skipped", detail="plain JAX raises at every size")
        return res
    exs = {n: prog.example(n) for n in ok}
    n_args = len(specs)
    bidx = [i for i in range(n_args)
            if specs[i] is None and _same_everywhere([exs[n][i] for n in ok])]
    eidx = [i for i in range(n_args) if i not in bidx]
    ex_specs = tuple(specs[i] for i in eidx)

    def assemble(b, e):
        full = [None] * n_args
        for i, v in zip(bidx, b):
            full[i] = v
        for i, v in zip(eidx, e):
            full[i] = v
        return full

    def g(*args):
        return prog.fun(*assemble(args[:len(bidx)], args[len(bidx):]))

    g.__name__ = getattr(prog.fun, "__name__", name)
    examples = [tuple(exs[n][i] for i in eidx) for n in ok]
    broadcast = [exs[ok[0]][i] for i in bidx]
    lengths = [int(plan_call(ex, ex_specs, prog.constraints, policy_getter(None)).values[0])
               for ex in examples]
    longest = max(max(lengths), 1)
    row_sizes = [longest, 1 << (2 * longest - 1).bit_length()]
    res["lengths"] = lengths
    res["row_sizes"] = row_sizes
    res["broadcast_args"] = len(bidx)

    # -- forward: ragged_map(layout="packed") ----------------------------------
    runs = []
    for R in row_sizes:
        t0 = time.perf_counter()
        run = {"row_size": R}
        rm = None
        try:
            rm = pm.ragged_map(g, ex_specs, layout="packed", row_size=R,
                               constraints=prog.constraints)
            outs = rm(examples, *broadcast)
            lay = rm.stats()["layout"]
            run["packed"] = f"{lay['packed']}/{lay['packed'] + lay['padded']}"
            run["layout_reason"] = lay["reason"]
            bad = []
            worst = 0.0
            for n, out in zip(ok, outs):
                good, what, d = _compare(out, plain[n][1], prog.rtol, prog.atol)
                worst = max(worst, d)
                if not good:
                    bad.append(f"n={n}: {what}")
            run["max_abs_diff"] = worst
            if bad:
                run.update(result="packed-WRONG", detail="; ".join(bad))
            else:
                run.update(result="packed-correct", detail="")
        except pm.PackedUnsupported as e:
            run.update(result="refused", detail=_refusal(e),
                       primitive=_refused_primitive(_refusal(e)))
        except Exception as e:  # noqa: BLE001 - every failure is a result
            where = _polymask_frame(e)
            run.update(result="error", detail=_first_line(e) + (f" [at {where}]" if where else ""))
        _per_size(run, rm, R)
        run["seconds"] = round(time.perf_counter() - t0, 1)
        runs.append(run)
        if run["result"] == "refused" and "no example fits" not in run["detail"]:
            break  # a refusal of the function does not depend on the row size
    res["runs"] = runs
    # the worst result over the row sizes; "no example fits a row" (every size
    # of this row size's trace takes another case) ranks below a correct run
    order = ["packed-WRONG", "error", "refused", "packed-correct", "no-fit"]
    rank = lambda r: order.index("no-fit" if "no example fits" in r["detail"]
                                 else r["result"])
    worst_run = min(runs, key=rank)
    if worst_run["result"] == "packed-correct" and all(r.get("per_size") for r in runs):
        # correct, but only the size the row program was traced at ran packed
        worst_run = dict(worst_run, result="refused", primitive="(a traced case per size)",
                         detail=runs[0]["per_size"])
    res["result"] = worst_run["result"]
    res["detail"] = (f"R={worst_run['row_size']}: " + worst_run["detail"]
                     if worst_run["detail"] else "")
    if "primitive" in worst_run:
        res["primitive"] = worst_run["primitive"]
    res["packed"] = " ".join(f"R{r['row_size']}:{r.get('packed', '-')}" for r in runs)

    # -- gradients: value_and_grad(layout="packed") -------------------------------
    if grad:
        res["grad"] = _run_grad(prog, exs, ok, plain, bidx, eidx, ex_specs, assemble,
                                row_sizes[0])
    return res


def _run_grad(prog, exs, ok, plain, bidx, eidx, ex_specs, assemble, R) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import polymask as pm

    if "grad" not in prog.modes:
        return {"result": "n/a", "detail": "no grad mode in the corpus"}
    if not any(np.issubdtype(np.asarray(o).dtype, np.floating)
               for o in jax.tree_util.tree_leaves(plain[ok[0]][1])):
        return {"result": "n/a", "detail": "no float output"}
    pidx = [i for i in bidx if np.issubdtype(np.asarray(exs[ok[0]][i]).dtype, np.floating)]
    cidx = [i for i in bidx if i not in pidx]
    if not pidx:
        return {"result": "n/a", "detail": "no float parameter"}
    consts = {i: exs[ok[0]][i] for i in cidx}

    def loss(params, *ex):
        b = []
        it = iter(params)
        for i in bidx:
            b.append(next(it) if i in pidx else consts[i])
        outs = jax.tree_util.tree_leaves(prog.fun(*assemble(b, ex)))
        return sum(jnp.sum(o) for o in outs if jnp.issubdtype(o.dtype, jnp.floating))

    params = tuple(jnp.asarray(exs[ok[0]][i]) for i in pidx)
    plain_vg = jax.jit(jax.value_and_grad(loss))
    want_l, want_g, sizes = 0.0, None, []
    for n in ok:
        try:
            l, gr = plain_vg(params, *[jnp.asarray(exs[n][i]) for i in eidx])
            jax.block_until_ready(gr)
        except Exception:  # noqa: BLE001 - plain JAX's grad fails at this size
            continue
        sizes.append(n)
        want_l = want_l + l
        want_g = gr if want_g is None else jax.tree_util.tree_map(jnp.add, want_g, gr)
    if not sizes:
        return {"result": "n/a", "detail": "plain JAX's grad fails at every size"}
    out = {"sizes": sizes}
    t0 = time.perf_counter()
    try:
        vg = pm.value_and_grad(loss, (None,) + ex_specs, layout="packed", reduce="sum",
                               row_size=R)
        batched = [[exs[n][i] for n in sizes] for i in eidx]
        got_l, got_g = vg(params, *batched)
        atol = prog.atol * len(sizes)
        good, what, d = _compare((got_l,) + tuple(got_g), (want_l,) + tuple(want_g),
                                 prog.rtol, atol)
        out["max_abs_diff"] = d
        if good:
            out.update(result="packed-correct", detail="")
        else:
            what = re.sub(r"^output 0 ", "loss ", what)
            what = re.sub(r"^output (\d+)", lambda m: f"grad of arg {pidx[int(m[1]) - 1]}",
                          what)
            out.update(result="packed-WRONG", detail=what)
    except pm.PackedUnsupported as e:
        out.update(result="refused", detail=_refusal(e),
                   primitive=_refused_primitive(_refusal(e)))
    except Exception as e:  # noqa: BLE001
        where = _polymask_frame(e)
        out.update(result="error", detail=_first_line(e) + (f" [at {where}]" if where else ""))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def child_main(name: str, grad: bool) -> None:
    try:
        os.nice(10)
    except OSError:
        pass
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr
    try:
        res = run_one(name, grad)
    except Exception as e:  # noqa: BLE001 - the harness itself failed
        res = {"program": name, "result": "error",
               "detail": "(report) " + _first_line(e) + " " + _polymask_frame(e)}
    out.write(_TAG + json.dumps(res) + "\n")


# -- the parent: subprocesses with a time limit, the table -------------------------------------
def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("POLYMASK_TIERED", "0")
    env.setdefault("POLYMASK_CACHE_DIR", "off")
    env.setdefault("POLYMASK_REUSE_HOST_MEMORY", "off")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src"),
                                         env.get("PYTHONPATH", "")])
    return env


def run_child(name: str, grad: bool, timeout: float, log_dir: Path | None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name]
    if not grad:
        cmd.append("--no-grad")
    t0 = time.perf_counter()
    err = open(log_dir / f"{name}.log", "w") if log_dir else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=_env(),
                            cwd=str(ROOT), start_new_session=True, text=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # this child's own process group
        except (ProcessLookupError, PermissionError):
            pass
        proc.communicate()
        return {"program": name, "result": "hang",
                "detail": f"no answer within {timeout:.0f} s (killed)",
                "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        if log_dir:
            err.close()
    for line in stdout.splitlines():
        if line.startswith(_TAG):
            r = json.loads(line[len(_TAG):])
            r["seconds"] = round(time.perf_counter() - t0, 1)
            return r
    return {"program": name, "result": "error",
            "detail": f"the subprocess died (exit code {proc.returncode})",
            "seconds": round(time.perf_counter() - t0, 1)}


def _cell(text: str, limit: int) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + " ..."


def table(results: list[dict], width: int) -> str:
    lines = ["| program | forward (packed) | examples packed | grad (packed) | detail |",
             "|---|---|---|---|---|"]
    for r in results:
        g = r.get("grad") or {}
        detail = r.get("detail", "")
        if g.get("result") in ("packed-WRONG", "error", "refused"):
            detail += (" || grad: " if detail else "grad: ") + g.get("detail", "")
        lines.append(f"| {r['program']} | {r['result']} | {r.get('packed', '-')} | "
                     f"{g.get('result', '-')} | {_cell(detail, width)} |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    fwd = collections.Counter(r["result"] for r in results)
    grd = collections.Counter((r.get("grad") or {}).get("result", "-") for r in results
                              if r["result"] != "skipped")
    prims = collections.Counter(r.get("primitive") for r in results
                                if r["result"] == "refused")
    gprims = collections.Counter((r.get("grad") or {}).get("primitive") for r in results
                                 if (r.get("grad") or {}).get("result") == "refused")
    out = ["forward: " + ", ".join(f"{k} {v}" for k, v in fwd.most_common()),
           "grad:    " + ", ".join(f"{k} {v}" for k, v in grd.most_common()),
           "refusals (forward) by primitive: "
           + (", ".join(f"{k} {v}" for k, v in prims.most_common()) or "none"),
           "refusals (grad) by primitive: "
           + (", ".join(f"{k} {v}" for k, v in gprims.most_common()) or "none")]
    skipped = [r["program"] + " (" + r.get("detail", "") + ")" for r in results
               if r["result"] == "skipped"]
    if skipped:
        out.append("skipped: " + "; ".join(skipped))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="program names (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="subprocesses at a time")
    ap.add_argument("--timeout", type=float, default=360.0, help="seconds per program")
    ap.add_argument("--no-grad", action="store_true", help="skip the gradient check")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--logs", help="a folder for each subprocess's stderr")
    ap.add_argument("--width", type=int, default=260, help="detail column width")
    ap.add_argument("--inline", action="store_true", help="run in this process (debugging)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    grad = not args.no_grad
    if args.child:
        child_main(args.child, grad)
        return 0
    from real import corpus

    names = args.only or corpus.names()
    unknown = [n for n in names if n not in corpus.names()]
    if unknown:
        ap.error(f"unknown programs {unknown}")
    log_dir = Path(args.logs) if args.logs else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def one(name):
        if args.inline:
            r = run_one(name, grad)
        else:
            r = run_child(name, grad, args.timeout, log_dir)
        g = (r.get("grad") or {}).get("result", "-")
        print(f"[{time.perf_counter() - t0:6.0f}s] {name}: {r['result']} (grad {g}) "
              f"{r.get('seconds', '')}s", file=sys.stderr, flush=True)
        return r

    if args.inline or args.jobs <= 1:
        results = [one(n) for n in names]
    else:
        with ThreadPoolExecutor(args.jobs) as ex:
            results = list(ex.map(one, names))
    print(table(results, args.width))
    print()
    print(summary(results))
    print(f"\n({len(results)} programs, {time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
