"""A load generator for embedding servers on loopback: ``polymask serve`` against
infinity-emb and sentence-transformers behind the same ASGI stack.

Two modes, each bounded in requests and seconds per point:

- **closed loop** (``--concurrency``, default 1,4,16,32,64): that many clients
  each send one request, wait for its answer and send the next, until the point
  has sent ``--requests`` requests or run ``--seconds`` seconds;
- **open loop** (``--rates``, requests/s): requests leave at a fixed rate
  (``--arrivals poisson`` or ``constant``) whatever the answers, at most
  ``--open-requests`` of them and for at most ``--seconds``; latency runs from
  each request's scheduled time (no coordinated omission).

Every request has its own timeout (``--timeout``; a timeout is an error). Each
request embeds 1..8 texts (``--texts-per-request``) drawn from the 1,400
stdlib docstrings the other benchmarks use (``polymask.cli.stdlib_docstrings``,
their length distribution) through ``POST /v1/embeddings``; the request list
of each point is fixed by ``--seed``, so every server gets the same requests
in the same order. Per point: texts/s, requests/s, p50/p95/p99 latency (ms),
errors, the 1-minute load average, and for polymask the XLA compiles while
serving and the queue / tokenize / compute time per request (``/metrics``).

Servers (``--server``, a comma list; each started as a subprocess on a free
127.0.0.1 port, ready when its ``/health`` answers 200, then warmed up):

- ``polymask``: ``polymask serve`` (this Python);
- ``infinity``: infinity-emb's ``infinity_emb v2 --engine torch --device cpu``
  on the same model directory (``--alt-python``'s environment);
- ``st``: ``benchmarks/st_server.py``: SentenceTransformer in Starlette +
  uvicorn with a length-sorting micro-batcher (5 ms, 32 texts).

Every server gets the same thread count (``--threads``, default: the CPU
count): ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and ``RAYON_NUM_THREADS``
(tokenizers), ``torch.set_num_threads`` in ``st``; XLA:CPU sizes its pool to
the CPUs. ``--rounds N`` repeats everything with the server order rotated.

    python benchmarks/serve_load.py                              # polymask, closed loop
    python benchmarks/serve_load.py --server polymask,infinity,st --alt-python /tmp/venv-alt/bin/python \\
        --rates 2,4,8 --rounds 2
    python benchmarks/serve_load.py --url http://127.0.0.1:8000   # a running server

Writes ``results.json``, ``results.md`` and ``serve_load.png`` (texts/s and p99
against concurrency, p99 against rate) under ``--out`` (default
``benchmarks/results/serve_load``). Only loopback addresses are accepted.
Needs httpx (and matplotlib for the plot); not a test or CI dependency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SERVERS = ("polymask", "infinity", "st")
HERE = pathlib.Path(__file__).resolve().parent
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_dir(args) -> str:
    if args.model:
        return args.model
    from polymask.models import default_model_dir

    return str(default_model_dir())


def _thread_env(threads: int) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        env[k] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "true"
    return env


def server_command(kind: str, args, port: int) -> list[str]:
    """The command line that starts server ``kind`` on 127.0.0.1:``port``."""
    if kind == "polymask":
        cmd = [sys.executable, "-m", "polymask.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--max-wait-ms", str(args.max_wait_ms),
               "--rows-per-call", str(args.rows_per_call)]
        return cmd + (["--model", args.model] if args.model else [])
    if not args.alt_python:
        raise SystemExit(f"--server {kind} needs --alt-python (a Python with torch, "
                         "sentence-transformers, infinity-emb, starlette, uvicorn)")
    if kind == "infinity":
        exe = pathlib.Path(args.alt_python).parent / "infinity_emb"
        # the defaults but said: no vector disk cache (repeated texts would be cache hits),
        # no torch.compile; the OpenAI route under /v1 like the others; /health stays
        return [str(exe), "v2", "--model-id", _model_dir(args), "--served-model-name",
                MODEL_NAME, "--engine", "torch", "--device", "cpu", "--batch-size", "32",
                "--no-vector-disk-cache", "--no-compile", "--host", "127.0.0.1",
                "--port", str(port), "--url-prefix", "/v1", "--log-level", "warning"]
    if kind == "st":
        return [args.alt_python, str(HERE / "st_server.py"), "--model", _model_dir(args),
                "--port", str(port), "--threads", str(args.threads), "--batch-size", "32",
                "--max-wait-ms", str(args.max_wait_ms)]
    raise SystemExit(f"unknown server {kind!r} (one of {', '.join(SERVERS)})")


class Server:
    """A server subprocess on a free loopback port (its output in a temporary log)."""

    def __init__(self, kind: str, args):
        self.kind = kind
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = server_command(kind, args, port)
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"serve_load-{kind}-",
                                               suffix=".log", delete=False)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=_thread_env(args.threads), cwd=str(HERE.parent))

    def tail(self, n: int = 30) -> str:
        self.log.flush()
        return "".join(pathlib.Path(self.log.name).read_text().splitlines(True)[-n:])

    def wait_ready(self, timeout: float = 600.0) -> tuple[dict, float]:
        return _wait_ready(self.url, self.proc, timeout, self.tail), \
            time.perf_counter() - self.t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()
        os.unlink(self.log.name)


def _wait_ready(url: str, proc, timeout: float = 600.0, tail=None) -> dict:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})"
                             + (f":\n{tail()}" if tail else ""))
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                try:
                    return r.json()
                except ValueError:
                    return {"status": r.text[:80]}
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{url} not ready in {timeout} s")


def polymask_metrics(url: str) -> dict | None:
    """The counters of polymask's ``/metrics`` this benchmark reads (None: not polymask)."""
    import httpx

    try:
        r = httpx.get(url + "/metrics", timeout=30)
    except httpx.TransportError:
        return None
    if r.status_code != 200 or "polymask_compiles_total" not in r.text:
        return None
    out: dict = {}
    for line in r.text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        keys = {
            'polymask_compiles_total{phase="serving"}': "compiles_serving",
            'polymask_compiles_total{phase="warmup"}': "compiles_warmup",
            'polymask_tokens_total{kind="real"}': "tokens_real",
            'polymask_tokens_total{kind="computed"}': "tokens_computed",
            "polymask_batch_size_sum": "batch_inputs",
            "polymask_batch_size_count": "batches",
        }
        for ph in ("queue", "tokenize", "compute"):
            keys[f'polymask_phase_seconds_sum{{phase="{ph}"}}'] = f"{ph}_s"
            keys[f'polymask_phase_seconds_count{{phase="{ph}"}}'] = f"{ph}_n"
        if name in keys:
            out[keys[name]] = float(value)
    return out


def _metrics_delta(a: dict | None, b: dict | None) -> dict | None:
    if not a or not b:
        return None
    d = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}
    out = {"compiles": d.get("compiles_serving", float("nan")),
           "batches": d.get("batches", 0.0),
           "inputs_per_batch": d["batch_inputs"] / d["batches"] if d.get("batches") else None,
           "computed_per_real_token": (d["tokens_computed"] / d["tokens_real"]
                                       if d.get("tokens_real") else None)}
    for ph in ("queue", "tokenize", "compute"):
        n = d.get(f"{ph}_n", 0.0)
        out[f"{ph}_ms"] = 1000 * d[f"{ph}_s"] / n if n else None
    return out


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))] if xs else float("nan")


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: N or LO-HI with 1 <= LO <= HI")
    return lo, hi


def make_requests(texts: list[str], n: int, per_request: tuple[int, int], seed: int):
    """``n`` requests (lists of texts), the same for every server."""
    rng = random.Random(seed)
    return [rng.sample(texts, rng.randint(*per_request)) for _ in range(n)]


def arrival_times(n: int, rate: float, arrivals: str, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if arrivals == "constant":
            t = i / rate
        else:
            t += rng.expovariate(rate)
        out.append(t)
    return out


async def _one(client, texts: list[str], timeout: float, t_sched: float):
    """POST one request; (latency from t_sched in s, error or None, texts)."""
    import httpx

    body = {"input": texts, "model": MODEL_NAME}
    try:
        r = await asyncio.wait_for(client.post("/v1/embeddings", json=body), timeout)
        err = None
        if r.status_code != 200:
            err = f"HTTP {r.status_code}"
        elif len(r.json().get("data", ())) != len(texts):
            err = "wrong count"
    except (asyncio.TimeoutError, httpx.TimeoutException):
        err = "timeout"
    except httpx.TransportError as e:
        err = type(e).__name__
    return time.perf_counter() - t_sched, err, len(texts)


async def closed_point(url: str, reqs: list, concurrency: int, seconds: float,
                       timeout: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as c:
        todo = iter(reqs)
        start = time.perf_counter()
        deadline = start + seconds

        async def client():
            for texts in todo:
                if time.perf_counter() >= deadline:
                    return
                results.append(await _one(c, texts, timeout, time.perf_counter()))

        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"results": results, "wall": wall}


async def open_point(url: str, reqs: list, times: list[float], seconds: float,
                     timeout: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as c:
        start = time.perf_counter()
        tasks, late = [], []
        for texts, t in zip(reqs, times):
            if t >= seconds:
                break
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            late.append(max(0.0, -delay))
            tasks.append(asyncio.create_task(_one(c, texts, timeout, start + t)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return {"results": list(results), "wall": wall, "send_late_ms_max":
            1000 * max(late, default=0.0)}


def summarize(raw: dict) -> dict:
    ok = [r for r in raw["results"] if r[1] is None]
    lat = [r[0] * 1000 for r in ok]
    errs: dict = {}
    for r in raw["results"]:
        if r[1] is not None:
            errs[r[1]] = errs.get(r[1], 0) + 1
    n_texts = sum(r[2] for r in ok)
    return {"sent": len(raw["results"]), "ok": len(ok), "errors": errs, "texts": n_texts,
            "wall_s": raw["wall"], "texts_per_s": n_texts / raw["wall"],
            "requests_per_s": len(ok) / raw["wall"],
            "p50_ms": statistics.median(lat) if lat else float("nan"),
            "p95_ms": _percentile(lat, 95), "p99_ms": _percentile(lat, 99),
            "max_ms": max(lat, default=float("nan"))}


def run_point(url: str, mode: str, level: float, reqs: list, args, seed: int) -> dict:
    before = polymask_metrics(url)
    load0 = os.getloadavg()[0]
    if mode == "closed":
        raw = asyncio.run(closed_point(url, reqs, int(level), args.seconds, args.timeout))
    else:
        times = arrival_times(len(reqs), level, args.arrivals, seed)
        raw = asyncio.run(open_point(url, reqs, times, args.seconds, args.timeout))
    out = summarize(raw)
    out.update(mode=mode, level=level, load_start=load0, load_end=os.getloadavg()[0])
    if "send_late_ms_max" in raw:
        out["send_late_ms_max"] = raw["send_late_ms_max"]
    out["polymask"] = _metrics_delta(before, polymask_metrics(url))
    return out


def warm_up(url: str, texts: list[str], args) -> None:
    """A few requests at 4 clients (all lengths) so no point pays first-run costs."""
    longest = sorted(texts, key=len)[-8:]
    reqs = make_requests(texts, 24, args.texts_per_request, args.seed + 99) + [longest]
    asyncio.run(closed_point(url, reqs, 4, 120.0, args.timeout * 4))


def probe(url: str, texts: list[str]):
    """The server's embeddings of a few texts (shortest, median, longest), float32."""
    import httpx
    import numpy as np

    by_len = sorted(texts, key=len)
    sample = [by_len[0], by_len[len(by_len) // 2], by_len[-1]]
    r = httpx.post(url + "/v1/embeddings", json={"input": sample, "model": MODEL_NAME},
                   timeout=120)
    r.raise_for_status()
    return np.asarray([d["embedding"] for d in r.json()["data"]], np.float32)


def _fmt(x, spec=".0f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def print_point(server: str, rnd: int, p: dict) -> None:
    pm = p.get("polymask") or {}
    errs = sum(p["errors"].values())
    lvl = f"{p['level']:g}" + (" c" if p["mode"] == "closed" else "/s")
    print(f"{server:>9} {rnd:>2} {lvl:>7} {p['ok']:>5} {p['texts_per_s']:>8.1f} "
          f"{p['requests_per_s']:>6.1f} {_fmt(p['p50_ms']):>7} {_fmt(p['p95_ms']):>7} "
          f"{_fmt(p['p99_ms']):>7} {errs:>4} {_fmt(pm.get('compiles')):>4} "
          f"{_fmt(pm.get('queue_ms')):>6} {_fmt(pm.get('tokenize_ms'), '.1f'):>6} "
          f"{_fmt(pm.get('compute_ms')):>6} {p['load_start']:>5.2f}", flush=True)


HEADER = (f"{'server':>9} {'rd':>2} {'point':>7} {'ok':>5} {'texts/s':>8} {'req/s':>6} "
          f"{'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'err':>4} {'comp':>4} "
          f"{'queue':>6} {'tok':>6} {'comp.':>6} {'load':>5}")


def _versions(args) -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("polymask", "jax", "jaxlib", "starlette", "uvicorn", "httpx"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    if args.alt_python:
        code = ("import importlib.metadata as m, json, platform; d={'python': "
                "platform.python_version()}\nfor p in ('torch', 'sentence-transformers', "
                "'infinity_emb', 'transformers', 'starlette', 'uvicorn', 'fastapi'):\n"
                " try: d[p] = m.version(p)\n except Exception: pass\nprint(json.dumps(d))")
        try:
            out["alt"] = json.loads(subprocess.run([args.alt_python, "-c", code], text=True,
                                                   capture_output=True, timeout=60).stdout)
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            out["alt"] = f"unknown ({e})"
    return out


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


# ---------------------------------------------------------------------------- report
def aggregate(points: list[dict]) -> list[dict]:
    """Per (mode, level, server): the median over rounds and min..max."""
    groups: dict = {}
    for p in points:
        groups.setdefault((p["mode"], p["level"], p["server"]), []).append(p)
    rows = []
    for (mode, level, server), ps in sorted(groups.items(),
                                            key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        row = {"mode": mode, "level": level, "server": server, "rounds": len(ps)}
        for k in ("texts_per_s", "requests_per_s", "p50_ms", "p95_ms", "p99_ms", "load_start"):
            vals = [p[k] for p in ps]
            row[k] = statistics.median(vals)
            row[k + "_range"] = (min(vals), max(vals))
        row["ok"] = sum(p["ok"] for p in ps)
        row["errors"] = sum(sum(p["errors"].values()) for p in ps)
        comp = [p["polymask"]["compiles"] for p in ps if p.get("polymask")]
        row["compiles"] = sum(comp) if comp else None
        for k in ("queue_ms", "tokenize_ms", "compute_ms", "inputs_per_batch"):
            vals = [p["polymask"][k] for p in ps if p.get("polymask")
                    and p["polymask"].get(k) is not None]
            row[k] = statistics.median(vals) if vals else None
        rows.append(row)
    return rows


def _rng(row: dict, k: str, spec: str) -> str:
    lo, hi = row[k + "_range"]
    s = format(row[k], spec)
    return s if row["rounds"] == 1 else f"{s} ({format(lo, spec)}..{format(hi, spec)})"


def verdict(rows: list[dict], concurrency: int = 32) -> str | None:
    at = {r["server"]: r for r in rows if r["mode"] == "closed" and r["level"] == concurrency}
    if "polymask" not in at or len(at) < 2:
        return None
    pm = at.pop("polymask")
    best_tp = max(at.values(), key=lambda r: r["texts_per_s"])
    best_p99 = min(at.values(), key=lambda r: r["p99_ms"])
    tp_ok = pm["texts_per_s"] >= best_tp["texts_per_s"]
    p99_ok = pm["p99_ms"] <= best_p99["p99_ms"]
    comp = pm["compiles"]
    return (f"At concurrency {concurrency}: polymask {pm['texts_per_s']:.1f} texts/s, p99 "
            f"{pm['p99_ms']:.0f} ms; best alternative throughput {best_tp['server']} "
            f"{best_tp['texts_per_s']:.1f} texts/s ({pm['texts_per_s'] / best_tp['texts_per_s']:.2f}x: "
            f"{'met' if tp_ok else 'NOT met'}), best p99 {best_p99['server']} "
            f"{best_p99['p99_ms']:.0f} ms ({'met' if p99_ok else 'NOT met'}); polymask "
            f"compiles after warm-up: {_fmt(comp)} (all points: "
            f"{_fmt(sum(r['compiles'] or 0 for r in rows if r['server'] == 'polymask'))}).")


def markdown(report: dict) -> str:
    rows = aggregate(report["points"])
    env, cfg = report["environment"], report["config"]
    lines = [f"# serve_load: {', '.join(cfg['servers'])}", "",
             f"{env['date']}, commit {env['commit']}, {env['cpus']} CPUs, "
             f"{cfg['threads']} threads per server ({env['threads_note']}), "
             f"{cfg['rounds']} round(s) with the server order rotated; requests of "
             f"{cfg['texts_per_request'][0]}-{cfg['texts_per_request'][1]} texts from "
             f"{cfg['corpus']} stdlib docstrings; closed loop at most {cfg['requests']} "
             f"requests and {cfg['seconds']:g} s per point, open loop ({cfg['arrivals']} "
             f"arrivals) at most {cfg['open_requests']} requests and {cfg['seconds']:g} s; "
             f"timeout {cfg['timeout']:g} s per request. Client and servers share the "
             f"machine's cores. Versions: `{json.dumps(env['versions'])}`.", "",
             "Figures: median over rounds (min..max when several); `load` is the 1-minute "
             "load average when each point started; `compiles` the polymask server's XLA "
             "compiles during the points (after warm-up); `queue` / `tok` / `compute` "
             "polymask's mean per-request phase times from `/metrics` (ms).", ""]
    for mode, title in (("closed", "Closed loop (clients)"),
                        ("open", "Open loop (offered requests/s)")):
        sel = [r for r in rows if r["mode"] == mode]
        if not sel:
            continue
        lines += [f"## {title}", "",
                  "| point | server | texts/s | req/s | p50 ms | p95 ms | p99 ms | ok | "
                  "errors | compiles | queue | tok | compute | load |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sel:
            lines.append(
                f"| {r['level']:g} | {r['server']} | {_rng(r, 'texts_per_s', '.1f')} | "
                f"{r['requests_per_s']:.2f} | {_rng(r, 'p50_ms', '.0f')} | "
                f"{_rng(r, 'p95_ms', '.0f')} | {_rng(r, 'p99_ms', '.0f')} | {r['ok']} | "
                f"{r['errors']} | {_fmt(r['compiles'])} | {_fmt(r['queue_ms'])} | "
                f"{_fmt(r['tokenize_ms'], '.1f')} | {_fmt(r['compute_ms'])} | "
                f"{_rng(r, 'load_start', '.2f')} |")
        lines.append("")
    v = verdict(rows)
    if v:
        lines += ["## Concurrency 32", "", v, ""]
    lines += ["Per server start: seconds until `/health` answered 200; max abs deviation "
              "of 3 embeddings (shortest, median, longest text) from the first server's:", "",
              "| server | round | ready s | max abs deviation | polymask compiles at warm-up |",
              "|---|---|---|---|---|"]
    for kind, starts in report["servers"].items():
        for st in starts:
            lines.append(f"| {kind} | {st['round']} | {st['ready_s']:.1f} | "
                         f"{st['max_abs_dev_vs_first']:.1e} | {_fmt(st['compiles_warmup'])} |")
    lines.append("")
    lines += ["Servers:", ""] + [f"- `{k}`: `{' '.join(c)}`" for k, c in
                                 report["commands"].items()] + [""]
    return "\n".join(lines)


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = aggregate(report["points"])
    servers = report["config"]["servers"]
    has_open = any(r["mode"] == "open" for r in rows)
    fig, axes = plt.subplots(1, 3 if has_open else 2, figsize=(15 if has_open else 10, 4))
    panels = [("closed", "texts_per_s", "texts/s", "clients (closed loop)"),
              ("closed", "p99_ms", "p99 latency [ms]", "clients (closed loop)")]
    if has_open:
        panels.append(("open", "p99_ms", "p99 latency [ms]", "offered requests/s (open loop)"))
    for ax, (mode, key, ylabel, xlabel) in zip(axes, panels):
        for s in servers:
            sel = [r for r in rows if r["mode"] == mode and r["server"] == s]
            if not sel:
                continue
            x = [r["level"] for r in sel]
            y = [r[key] for r in sel]
            err = [[r[key] - r[key + "_range"][0] for r in sel],
                   [r[key + "_range"][1] - r[key] for r in sel]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=s)
        ax.set_xscale("log", base=2)
        levels = sorted({r["level"] for r in rows if r["mode"] == mode})
        ax.set_xticks(levels, [f"{v:g}" for v in levels])
        ax.minorticks_off()
        if key == "p99_ms":
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"MiniLM embedding servers on loopback, {report['config']['threads']} "
                 f"threads each, {report['config']['rounds']} round(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default="polymask",
                   help=f"comma-separated servers to start: {', '.join(SERVERS)} "
                        "(default polymask)")
    p.add_argument("--url", default=None, help="a running server (loopback) instead")
    p.add_argument("--alt-python", default=None,
                   help="the Python of the environment with torch, sentence-transformers, "
                        "infinity-emb (for --server infinity, st)")
    p.add_argument("--model", default=None, help="model directory (default: the installed "
                   "all-MiniLM-L6-v2)")
    p.add_argument("--concurrency", default="1,4,16,32,64",
                   help="closed loop: comma-separated client counts, 1..64 ('' for none)")
    p.add_argument("--rates", default="",
                   help="open loop: comma-separated requests/s (default none)")
    p.add_argument("--arrivals", choices=("poisson", "constant"), default="poisson")
    p.add_argument("--requests", type=int, default=300, help="most requests per closed point")
    p.add_argument("--open-requests", type=int, default=200,
                   help="most requests per open point")
    p.add_argument("--seconds", type=float, default=30.0, help="most seconds per point (30)")
    p.add_argument("--timeout", type=float, default=30.0, help="per request, seconds (30)")
    p.add_argument("--texts", type=int, default=1400, help="corpus size (default 1400)")
    p.add_argument("--texts-per-request", type=parse_range, default=(1, 8),
                   help="N or LO-HI (uniform), default 1-8")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="threads per server (default: the CPU count)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="polymask, st (5)")
    p.add_argument("--rows-per-call", type=int, default=2, help="polymask (2, its default)")
    p.add_argument("--out", default=str(HERE / "results" / "serve_load"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    servers = [s.strip() for s in args.server.split(",") if s.strip()]
    if not all(1 <= c <= 64 for c in levels) or not all(r > 0 for r in rates):
        p.error("concurrency in 1..64, rates > 0")
    if min(args.requests, args.open_requests, args.rounds, args.threads) < 1 \
            or args.seconds <= 0 or args.timeout <= 0:
        p.error("requests, open-requests, rounds, threads >= 1; seconds, timeout > 0")
    if args.url and urllib.parse.urlparse(args.url).hostname not in LOOPBACK:
        p.error(f"--url {args.url}: loopback addresses only (127.0.0.1, localhost, ::1)")
    if not args.url and any(s not in SERVERS for s in servers):
        p.error(f"--server: one or more of {', '.join(SERVERS)}")
    if args.url:
        servers = ["url"]

    from polymask.cli import stdlib_docstrings

    texts = stdlib_docstrings(args.texts, seed=args.seed)
    plan = [("closed", c, make_requests(texts, args.requests, args.texts_per_request,
                                        args.seed * 1000 + c)) for c in levels]
    plan += [("open", r, make_requests(texts, args.open_requests, args.texts_per_request,
                                       args.seed * 1000 + 500 + int(r * 10))) for r in rates]
    report = {
        "environment": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "commit": _git_commit(), "cpus": os.cpu_count(),
                        "machine": platform.machine(), "versions": _versions(args),
                        "threads_note": "OMP/MKL/RAYON_NUM_THREADS and torch.set_num_threads "
                                        "for torch; XLA:CPU's pool is the CPU count"},
        "config": {k: v for k, v in vars(args).items()} | {"servers": servers,
                                                           "corpus": len(texts)},
        "commands": {}, "servers": {}, "points": []}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    print(f"{len(texts)} texts, {args.texts_per_request[0]}-{args.texts_per_request[1]} per "
          f"request, {args.threads} threads per server, load {os.getloadavg()[0]:.2f}",
          flush=True)
    print(HEADER, flush=True)
    ref = None  # the first server's probe embeddings: every server's deviation from them
    for rnd in range(args.rounds):
        order = servers[rnd % len(servers):] + servers[:rnd % len(servers)]
        for kind in order:
            srv = None
            try:
                if args.url:
                    url = args.url.rstrip("/")
                    health, ready_s = _wait_ready(url, None), 0.0
                else:
                    srv = Server(kind, args)
                    report["commands"][kind] = srv.cmd
                    health, ready_s = srv.wait_ready()
                    url = srv.url
                warm_up(url, texts, args)
                vecs = probe(url, texts)
                ref = vecs if ref is None else ref
                m = polymask_metrics(url)
                report["servers"].setdefault(kind, []).append(
                    {"round": rnd, "health": health, "ready_s": ready_s,
                     "max_abs_dev_vs_first": float(abs(vecs - ref).max()),
                     "compiles_warmup": m and m.get("compiles_warmup"),
                     "compiles_serving_after_warmup": m and m.get("compiles_serving")})
                for i, (mode, level, reqs) in enumerate(plan):
                    pt = run_point(url, mode, level, reqs, args, args.seed * 1000 + i)
                    pt.update(server=kind, round=rnd)
                    report["points"].append(pt)
                    print_point(kind, rnd, pt)
            finally:
                if srv is not None:
                    srv.stop()
    report["total_s"] = time.perf_counter() - t_all
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    md = markdown(report)
    (out / "results.md").write_text(md)
    try:
        plot(report, out / "serve_load.png")
    except ImportError:
        print("(no matplotlib: no plot)", file=sys.stderr)
    v = verdict(aggregate(report["points"]))
    if v:
        print(v)
    print(f"total {report['total_s']:.0f} s; wrote {out}/results.{{json,md}}, serve_load.png",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
