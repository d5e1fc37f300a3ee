"""A closed-loop load generator for ``polymask serve`` (loopback only).

At each concurrency (default 1, 2, 4, 8, 16, 32) that many clients each send
one request, wait for its answer, and send the next (closed loop), until the
level has sent ``--requests`` requests or run ``--seconds`` seconds, whichever
comes first. Each request embeds ``--texts-per-request`` docstrings of the
standard library (``polymask.cli.stdlib_docstrings``, the demo's corpus: its
length distribution, 1,400 texts by default) through ``POST /v1/embeddings``.
Prints, per level: requests, texts/s, requests/s, p50/p95/p99 latency (ms),
errors, and the server's compiles while serving (``/metrics``, must be 0).

    python benchmarks/serve_load.py                  # starts a server on a free port
    python benchmarks/serve_load.py --url http://127.0.0.1:8000   # a running one

Started here, the server uses the persistent compilation cache (its warm-up
loads the program when a previous run compiled it). Only loopback addresses
are accepted. Needs the ``serve`` extra and httpx.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "polymask.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--max-wait-ms", str(args.max_wait_ms),
           "--rows-per-call", str(args.rows_per_call)]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    return proc, f"http://127.0.0.1:{port}"


def _wait_ready(url: str, proc, timeout: float = 600.0) -> dict:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready in {timeout} s")


def _serving_compiles(url: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('polymask_compiles_total{phase="serving"}'):
            return float(line.split()[-1])
    return float("nan")


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))] if xs else float("nan")


def run_level(url: str, texts: list[str], concurrency: int, requests: int, seconds: float,
              per_request: int, seed: int) -> dict:
    """One closed-loop level: latencies (s) of the answered requests, errors, wall."""
    import httpx

    lock = threading.Lock()
    sent = [0]
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.monotonic() + seconds

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        with httpx.Client(base_url=url, timeout=120) as c:
            while time.monotonic() < deadline:
                with lock:
                    if sent[0] >= requests:
                        return
                    sent[0] += 1
                body = {"input": rng.sample(texts, per_request)}
                t0 = time.perf_counter()
                try:
                    r = c.post("/v1/embeddings", json=body)
                    ok = r.status_code == 200
                    why = f"HTTP {r.status_code}"
                except httpx.TransportError as e:
                    ok, why = False, type(e).__name__
                dt = time.perf_counter() - t0
                with lock:
                    (latencies.append(dt) if ok else errors.append(why))

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"latencies": latencies, "errors": errors, "wall": time.perf_counter() - start}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (loopback); default: start one")
    p.add_argument("--model", default=None, help="model directory for a server started here")
    p.add_argument("--concurrency", default="1,2,4,8,16,32",
                   help="comma-separated client counts (default 1,2,4,8,16,32; at most 64)")
    p.add_argument("--requests", type=int, default=200, help="most requests per level (200)")
    p.add_argument("--seconds", type=float, default=30.0, help="most seconds per level (30)")
    p.add_argument("--texts", type=int, default=1400, help="corpus size (default 1400)")
    p.add_argument("--texts-per-request", type=int, default=1)
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="server started here")
    p.add_argument("--rows-per-call", type=int, default=2, help="server started here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if not all(1 <= c <= 64 for c in levels) or args.requests < 1 or args.seconds <= 0:
        p.error("concurrency in 1..64, requests >= 1, seconds > 0")
    if args.url and urllib.parse.urlparse(args.url).hostname not in LOOPBACK:
        p.error(f"--url {args.url}: loopback addresses only (127.0.0.1, localhost, ::1)")

    from polymask.cli import stdlib_docstrings

    texts = stdlib_docstrings(args.texts, seed=args.seed)
    proc = None
    if args.url is None:
        proc, url = _start_server(args)
    else:
        url = args.url.rstrip("/")
    try:
        health = _wait_ready(url, proc)
        print(f"server {url}: {health}; {len(texts)} texts, {args.texts_per_request} per "
              f"request; load average {os.getloadavg()[0]:.2f}", flush=True)
        run_level(url, texts, 2, 8, 30.0, args.texts_per_request, args.seed)  # warm the path
        print(f"{'clients':>7} {'requests':>8} {'texts/s':>8} {'req/s':>7} {'p50 ms':>7} "
              f"{'p95 ms':>7} {'p99 ms':>7} {'errors':>6} {'compiles':>8} {'load':>5}")
        for c in levels:
            r = run_level(url, texts, c, args.requests, args.seconds, args.texts_per_request,
                          args.seed + c)
            lat = [x * 1000 for x in r["latencies"]]
            n = len(lat)
            print(f"{c:>7} {n:>8} {n * args.texts_per_request / r['wall']:>8.1f} "
                  f"{n / r['wall']:>7.1f} {statistics.median(lat) if lat else float('nan'):>7.0f} "
                  f"{_percentile(lat, 95):>7.0f} {_percentile(lat, 99):>7.0f} "
                  f"{len(r['errors']):>6} {_serving_compiles(url):>8.0f} "
                  f"{os.getloadavg()[0]:>5.2f}", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
