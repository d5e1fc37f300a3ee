"""polymask.serving: the dynamic batcher (threads, asyncio, a bad input, a full
queue, one compile for concurrent first calls) and ``polymask serve``, the real
server process on a loopback port (every route and error, concurrency 32 against
``SentenceEncoder.embed``, SIGTERM under load)."""

from __future__ import annotations

import asyncio
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import eventually

import polymask as pm
from polymask.core.errors import ShapeError
from polymask.runners.ragged import RaggedMap
from polymask.serving import BatcherClosed, DynamicBatcher, QueueFull

pytestmark = pytest.mark.slow  # the slow tier: starts polymask serve processes and loads the model


# ----------------------------------------------------------------------------
# the batcher, on a small function
# ----------------------------------------------------------------------------
def _f(w, x):
    """One example ``x (n, 4)`` -> ``(3,)``: a mean over its rows."""
    return jnp.tanh(x @ w).sum(0) / x.shape[0]


W = (np.arange(12, dtype=np.float32).reshape(4, 3) - 6) / 10


def _examples(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(int(n), 4)).astype(np.float32)
            for n in rng.integers(1, 30, count)]


def _batcher(**kw) -> DynamicBatcher:
    kw.setdefault("max_wait_ms", 20)
    return DynamicBatcher(_f, ("n, 4",), broadcast=(W,), layout="packed", row_size=32,
                          rows_per_call=4, **kw)


def _reference(exs):
    exact = jax.jit(_f)
    return [np.asarray(exact(W, x)) for x in exs]


def test_threads_each_get_their_own_result():
    exs = _examples(48)
    reports = []
    with _batcher(on_batch=reports.append) as b:
        out: list = [None] * len(exs)
        barrier = threading.Barrier(len(exs))

        def call(i):
            barrier.wait()
            out[i] = b(exs[i], timeout=60)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(exs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        st = b.stats()
    for got, ref in zip(out, _reference(exs)):
        assert isinstance(got, np.ndarray) and got.shape == (3,)
        assert np.abs(got - ref).max() <= 1e-6
    assert st["examples"] == 48 and st["batches"] < 48 and st["failed"] == 0
    assert st["runner"]["packed"]["compiles"] == 1
    assert sum(r.size for r in reports) == 48
    assert sum(r.elements for r in reports) == sum(x.size for x in exs)
    assert all(r.computed_elements >= r.elements and len(r.queue_s) == r.size for r in reports)


def test_asyncio_callers_get_their_results_and_timing_fields():
    exs = _examples(40, seed=1)

    async def main(b):
        one = await asyncio.gather(*(b.acall(x) for x in exs[:30]))
        many = await b.amap(exs[30:])
        return one + many

    with _batcher(max_batch_size=16) as b:
        out = asyncio.run(main(b))
        f = b.submit(exs[0])
        f.result(60)
        # the timing fields are recorded for the caller (their values are speed: benchmarks/)
        assert f.timing.batch_size >= 1
        assert all(isinstance(getattr(f.timing, k), float) for k in ("queue_s", "compute_s"))
        assert b.stats()["largest_batch"] <= 16
    for got, ref in zip(out, _reference(exs)):
        assert np.abs(got - ref).max() <= 1e-6


def test_a_bad_input_fails_only_its_caller():
    exs = _examples(12, seed=2)
    bad = np.ones((3, 5), np.float32)  # the spec says 'n, 4'
    with _batcher(max_wait_ms=200) as b:
        futures = b.submit_many(exs[:6] + [bad] + exs[6:])  # one batch
        with pytest.raises(ShapeError, match="spec 'n, 4' says 4") as e:
            futures[6].result(60)
        # the caller's own line, not the worker thread's, and no place in its batch
        assert "test_serving.py" in str(e.value) and "threading.py" not in str(e.value)
        assert not str(e.value).startswith("examples[")
        good = [f.result(60) for i, f in enumerate(futures) if i != 6]
        st = b.stats()
    for got, ref in zip(good, _reference(exs)):
        assert np.abs(got - ref).max() <= 1e-6
    assert st["failed"] == 1 and st["isolated_batches"] == 1 and st["examples"] == 13


class _GatedMap(RaggedMap):
    """A ragged_map whose calls wait for ``gate``: the worker is busy on demand."""

    gate = threading.Event()

    def __call__(self, *args, **kw):
        assert self.gate.wait(60)
        return super().__call__(*args, **kw)


def test_full_queue_raises_then_drains_and_closes():
    runner = _GatedMap(_f, ("n, 4",), layout="packed", row_size=32, rows_per_call=4,
                       numpy_outputs=True)
    exs = _examples(5, seed=3)
    b = DynamicBatcher(runner, broadcast=(W,), max_wait_ms=0, max_queue=3)
    try:
        first = b.submit(exs[0])  # taken by the worker, which then waits at the gate
        for _ in range(500):
            if b.queue_depth == 0:
                break
            threading.Event().wait(0.01)
        waiting = b.submit_many(exs[1:4])
        assert b.queue_depth == 3
        with pytest.raises(QueueFull, match="queue is full: 3 of 3") as e:
            b.submit(exs[4])
        assert e.value.retry_after_s >= 1 and e.value.depth == 3
        with pytest.raises(QueueFull):  # all or none
            b.submit_many(exs[:2])
        assert b.queue_depth == 3 and b.stats()["rejected"] == 3
        _GatedMap.gate.set()
        out = [f.result(60) for f in [first, *waiting]]
    finally:
        _GatedMap.gate.set()
        b.close()
    for got, ref in zip(out, _reference(exs[:4])):
        assert np.abs(got - ref).max() <= 1e-6
    with pytest.raises(BatcherClosed):
        b.submit(exs[0])
    with pytest.raises(ValueError, match="max_queue"):
        DynamicBatcher(_f, ("n, 4",), max_queue=0)


def test_concurrent_first_calls_compile_one_program():
    """8 threads calling one ragged_map at once compile its packed program once
    (each used to trace and compile its own copy: 8 XLA compiles)."""
    rm = pm.ragged_map(_f, ("n, 4",), layout="packed", row_size=64, rows_per_call=4)
    exs = _examples(40, seed=4)
    barrier = threading.Barrier(8)
    out: list = [None] * 8
    counts = [0] * 8

    def call(i):
        barrier.wait()
        with pm.compile_counter() as cc:
            out[i] = rm(exs[5 * i:5 * i + 5], W)
        counts[i] = cc.compiles

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st = rm.stats()["packed"]
    assert (st["compiles"], st["xla_compiles"], sum(counts)) == (1, 1, 1)
    got = [np.asarray(r) for part in out for r in part]
    for g, ref in zip(got, _reference(exs)):
        assert np.abs(g - ref).max() <= 1e-6


# ----------------------------------------------------------------------------
# polymask serve: the real server process on a loopback port
# ----------------------------------------------------------------------------
HOST = "127.0.0.1"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The installed all-MiniLM-L6-v2 (CI installs it), else a tiny random BERT."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    from polymask.models import default_model_dir

    try:
        return default_model_dir()
    except FileNotFoundError:
        from test_bert import _tiny_model_dir

        return _tiny_model_dir(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="module")
def encoder(model_dir):
    from polymask.models import SentenceEncoder

    return SentenceEncoder(model_dir)


@pytest.fixture(scope="module")
def corpus(encoder):
    """Texts of many lengths (some over the model's token limit) and their
    embeddings from ``SentenceEncoder.embed`` (normalised and not), one call each."""
    from polymask.cli import stdlib_docstrings

    long = " ".join(["polymask"] * (encoder.max_seq_length + 40))
    texts = stdlib_docstrings(60, seed=7) + ["hi", "", "a b c", long]
    return texts, encoder.embed(texts), encoder.embed(texts, normalize=False)


class _Server:
    """A ``python -m polymask.cli serve`` process on a free loopback port
    (``port=0``: the one the server says it picked)."""

    def __init__(self, model_dir, cache_dir, log_path, *extra: str, port: int | None = None):
        import subprocess
        import sys

        self.port = _free_port() if port is None else port
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "polymask.cli", "--cache-dir", str(cache_dir), "serve",
             "--model", str(model_dir), "--host", HOST, "--port", str(self.port), *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        if port == 0:
            self.port = self._announced_port()
        self.url = f"http://{HOST}:{self.port}"
        # (route, status, Retry-After, error type) while warming up
        self.before_ready: list = []

    def _announced_port(self) -> int:
        """The port of ``--port 0``, from the first line (``eventually``'s limit
        only stops a hang; no duration is asserted)."""
        import re

        found: list = []

        def announced() -> bool:
            assert self.proc.poll() is None, self.output()
            m = re.search(rf"polymask serve: http://{HOST}:(\d+) ", self.output())
            return bool(m) and not found.append(int(m.group(1)))

        eventually(announced, f"the server announces its address:\n{self.output()}")
        return found[0]

    def wait_ready(self) -> dict:
        """/health's body once it is 200, recording the 503s before it
        (``eventually``'s limit only stops a hang; no duration is asserted)."""
        import httpx

        ready: list = []

        def healthy(c) -> bool:
            assert self.proc.poll() is None, self.output()
            try:
                r = c.get("/health")
            except httpx.TransportError:
                return False
            if r.status_code == 200:
                ready.append(r.json())
                return True
            self.before_ready.append(("/health", r.status_code, r.headers.get("retry-after"),
                                      r.json()["error"]["type"]))
            if len(self.before_ready) == 1:
                e = c.post("/v1/embeddings", json={"input": "too early"})
                self.before_ready.append(("/v1/embeddings", e.status_code,
                                          e.headers.get("retry-after"),
                                          e.json()["error"]["type"]))
            return False

        with httpx.Client(base_url=self.url, timeout=10) as c:
            eventually(lambda: healthy(c), "the server becomes ready", limit_s=300.0)
        return ready[0]

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return open(self.log_path).read()

    def stop(self, timeout: float = 60.0) -> bool:
        """SIGTERM; True when the process ended cleanly (uvicorn re-raises the
        signal after its graceful shutdown: exit status -SIGTERM, or 0)."""
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self.log.close()
        return rc in (0, -signal.SIGTERM)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("xla-cache")


@pytest.fixture(scope="module")
def server(model_dir, cache_dir, tmp_path_factory):
    for mod in ("starlette", "uvicorn", "prometheus_client", "httpx"):
        pytest.importorskip(mod)
    s = _Server(model_dir, cache_dir, tmp_path_factory.mktemp("log") / "serve.log",
                "--max-wait-ms", "10")
    try:
        s.health = s.wait_ready()
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(30)


def _dev(got, want):
    try:
        return float(np.abs(np.asarray(got, np.float32) - want).max())
    except (ValueError, TypeError):
        return got


def _close(got, want, raw: bool = False) -> bool:
    """Max abs deviation <= 1e-6 (normalised embeddings). ``raw``: unnormalised
    ones (entries up to ~3, means of up to 256 tokens) <= 4e-6 of their largest
    entry: the server's program (2 rows per call) and the reference's (8)
    are different XLA programs, whose float32 sums differ by ~10 ulp."""
    want = np.asarray(want, np.float32)
    tol = (4e-6 if raw else 1e-6) * max(1.0, float(np.abs(want).max()))
    if isinstance(got, str) or np.asarray(got).shape != want.shape:
        return False
    return float(np.abs(np.asarray(got, np.float32) - want).max()) <= tol


def test_health_is_503_until_warm_then_200(server):
    assert server.before_ready, "no 503 seen while the program compiled"
    assert all(status == 503 and retry == "1" for _, status, retry, _ in server.before_ready)
    # not overloaded: unavailable for now (a full queue says server_overloaded)
    assert {kind for *_, kind in server.before_ready} == {"service_unavailable"}
    assert {route for route, *_ in server.before_ready} == {"/health", "/v1/embeddings"}
    assert server.health["status"] == "ok" and server.health["warmup_compiles"] >= 1


def test_openai_embeddings(server, encoder, corpus):
    import base64

    import httpx

    texts, ref, _ = corpus
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/embeddings", json={"input": texts[:5], "model": "whatever"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == server.health["model"]
        assert [d["index"] for d in body["data"]] == list(range(5))
        assert all(d["object"] == "embedding" for d in body["data"])
        assert _close([d["embedding"] for d in body["data"]], ref[:5])
        tokens = sum(len(x) for x in encoder.tokenize(texts[:5]))
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        # one string; base64 (little-endian float32); the over-long text truncated
        r = c.post("/v1/embeddings", json={"input": texts[-1], "encoding_format": "base64"})
        assert r.status_code == 200, r.text
        (d,) = r.json()["data"]
        v = np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
        assert _close(v, ref[-1])
        assert r.json()["usage"]["prompt_tokens"] == encoder.max_seq_length


def test_tei_embed(server, encoder, corpus):
    import httpx

    texts, ref, raw = corpus
    with httpx.Client(base_url=server.url, timeout=60) as c:
        limit = encoder.max_seq_length
        short = [i for i, ids in enumerate(encoder.tokenize(texts)) if len(ids) < limit][:4]
        r = c.post("/embed", json={"inputs": [texts[i] for i in short]})
        assert r.status_code == 200 and _close(r.json(), ref[short])
        r = c.post("/embed", json={"inputs": texts[short[0]], "normalize": False})
        assert r.status_code == 200 and _close(r.json(), raw[short[:1]], raw=True)
        r = c.post("/embed", json={"inputs": ["x", texts[-1]], "truncate": True})
        assert r.status_code == 200 and _close(r.json()[1], ref[-1])
        r = c.post("/embed", json={"inputs": ["x", texts[-1]]})  # truncate: false
        assert r.status_code == 413
        assert r.json()["field"] == "inputs[1]" and "more than" in r.json()["error"]


BAD = [
    ("/v1/embeddings", b"{not json", 400, "body"),
    ("/v1/embeddings", b"[1, 2]", 400, "body"),
    ("/v1/embeddings", b"\xff\xfe", 400, "body"),
    ("/v1/embeddings", b"[" * 100_000 + b"]" * 100_000, 400, "body"),
    ("/v1/embeddings", b'{"input": "a", "dimensions": ' + b"9" * 5000 + b"}", 400, "body"),
    ("/v1/embeddings", b"{}", 400, "input"),
    ("/v1/embeddings", b'{"input": 3}', 400, "input"),
    ("/v1/embeddings", b'{"input": []}', 400, "input"),
    ("/v1/embeddings", b'{"input": ["a", null]}', 400, "input[1]"),
    ("/v1/embeddings", b'{"input": [[1, 2]]}', 400, "input[0]"),
    ("/v1/embeddings", b'{"input": ["a", "\\ud800"]}', 400, "input[1]"),  # lone surrogate
    ("/embed", b'{"inputs": "x \\udfff"}', 422, "inputs"),
    ("/v1/embeddings", b'{"input": "a", "encoding_format": "hex"}', 400, "encoding_format"),
    ("/v1/embeddings", b'{"input": "a", "model": 7}', 400, "model"),
    ("/v1/embeddings", b'{"input": "a", "dimensions": 3}', 400, "dimensions"),
    ("/v1/embeddings", b'{"input": "a", "dimensions": true}', 400, "dimensions"),
    ("/v1/embeddings", b'{"input": "a", "user": 1}', 400, "user"),
    ("/embed", b"", 400, "body"),
    ("/embed", b'{"input": "a"}', 422, "inputs"),
    ("/embed", b'{"inputs": {"a": 1}}', 422, "inputs"),
    ("/embed", b'{"inputs": "a", "normalize": "yes"}', 422, "normalize"),
    ("/embed", b'{"inputs": "a", "truncate": 1}', 422, "truncate"),
    ("/embed", b'{"inputs": "a", "truncation_direction": "Left"}', 422, "truncation_direction"),
    ("/embed", b'{"inputs": "a", "prompt_name": "query"}', 422, "prompt_name"),
]


def test_malformed_requests_are_json_4xx_naming_the_field(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        for route, body, status, field in BAD:
            r = c.post(route, content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (route, body, r.text)
            err = r.json()
            named = err["field"] if route == "/embed" else err["error"]["param"]
            assert named == field, (route, body, err)
            assert "Traceback" not in r.text
        # limits: inputs per request, body size; unknown route and method
        r = c.post("/v1/embeddings", json={"input": ["a"] * 257})
        assert r.status_code == 413 and r.json()["error"]["param"] == "input"
        r = c.post("/embed", content=b" " * (8 << 20) + b"{}")
        assert r.status_code == 413 and r.json()["field"] == "body"
        r = c.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["param"] == "path"
        r = c.delete("/health")
        assert r.status_code == 405 and r.json()["error"]["param"] == "method"


def test_unknown_routes_and_methods_answer_json_in_their_route_family_s_shape(server):
    """A trailing slash is no route (a JSON 404, not Starlette's empty 307
    redirect); under /embed the error is TEI's shape, elsewhere OpenAI's."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        for path in ("/embed/", "/embed/x"):
            r = c.post(path, json={"inputs": "a"})
            assert r.status_code == 404, (path, r.status_code, r.text)
            assert r.json()["field"] == "path" and r.json()["error_type"] == "Validation"
            assert f"no route {path}" in r.json()["error"]
        r = c.get("/embed")
        assert r.status_code == 405 and r.json()["field"] == "method"
        assert r.json()["error"] == "GET is not allowed on /embed"
        for path in ("/v1/embeddings/", "/health/"):
            r = c.post(path, json={"input": "a"})
            assert r.status_code == 404, (path, r.status_code, r.text)
            assert r.json()["error"]["param"] == "path"
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = c.get("/v1/embeddings")
        assert r.status_code == 405 and r.json()["error"]["param"] == "method"


def _metric(text: str, name: str, default: float | None = None, **labels) -> float:
    """A sample's value; ``default`` where the series was never observed (a
    labelled Prometheus counter appears only once a label set is used)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    key = f"{name}{{{want}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    if default is not None:
        return default
    raise KeyError(key)


def test_a_client_that_leaves_is_499_not_500_and_its_queued_texts_are_dropped(server):
    """A client closing its connection while sending its body was a logged 500
    (a ClientDisconnect traceback: an alert on 5xx fired), and one closing it
    while its texts waited had them all computed, delaying every later
    request, and counted as a 200 (helper D). Both are 499 now ("client
    closed request", nginx's), with no traceback, and the texts not yet in a
    batch are dropped."""
    import json
    import socket

    import httpx

    def metric(status) -> float:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return _metric(text, "polymask_requests_total", 0.0, route="/v1/embeddings",
                       status=status)

    def real_tokens() -> float:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return _metric(text, "polymask_tokens_total", 0.0, kind="real")

    before = {st: metric(st) for st in ("200", "499", "500")}
    tokens = real_tokens()
    with socket.create_connection((HOST, server.port), timeout=30) as mid_body:
        mid_body.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000\r\n\r\n{\"input\": ")
    body = json.dumps({"input": [f"text {k} " + "word " * 300 for k in range(256)]}).encode()
    with socket.create_connection((HOST, server.port), timeout=30) as leaves:
        leaves.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nContent-Length: " + str(len(body)).encode()
                       + b"\r\n\r\n" + body)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "still served"}, timeout=120)
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    eventually(lambda: metric("499") == before["499"] + 2,
               f"both clients that left are counted 499:\n{server.output()[-3000:]}")
    assert metric("500") == before["500"]
    assert metric("200") == before["200"] + 1  # the probe only
    # 256 texts of 256 tokens: the batches not started when it left never ran
    assert real_tokens() - tokens < 256 * 256, real_tokens() - tokens
    assert "Traceback" not in server.output() and "failed" not in server.output()


def test_concurrency_32_gets_exact_embeddings_and_compiles_nothing(server, corpus):
    import random
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    texts, ref, raw = corpus

    def client(k: int) -> list[bool]:
        rng = random.Random(k)
        ok: list = []
        with httpx.Client(base_url=server.url, timeout=120) as c:
            for j in range(4):
                idx = rng.sample(range(len(texts)), rng.randint(1, 4))
                if (k + j) % 2:
                    r = c.post("/v1/embeddings", json={"input": [texts[i] for i in idx]})
                    got = [d["embedding"] for d in r.json()["data"]] \
                        if r.status_code == 200 else r.text
                    ok.append(_close(got, ref[idx]) or (r.status_code, idx, _dev(got, ref[idx])))
                else:
                    norm = bool(j % 3)
                    r = c.post("/embed", json={"inputs": [texts[i] for i in idx],
                                               "normalize": norm, "truncate": True})
                    want = (ref if norm else raw)[idx]
                    got = r.json() if r.status_code == 200 else r.text
                    ok.append(_close(got, want, raw=not norm)
                              or (r.status_code, norm, idx, _dev(got, want)))
        return ok

    with ThreadPoolExecutor(32) as pool:
        results = [ok for part in pool.map(client, range(32)) for ok in part]
    assert len(results) == 128 and [x for x in results if x is not True] == []

    # one over-limit request of this test's own: the error metric counts it whatever
    # other tests ran in this shard
    long_text = texts[int(np.argmax([len(t) for t in texts]))]
    r = httpx.post(server.url + "/embed", json={"inputs": ["x", long_text * 8]}, timeout=60)
    assert r.status_code == 413

    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert _metric(text, "polymask_compiles_total", phase="serving") == 0
    assert _metric(text, "polymask_compiles_total", phase="warmup") >= 1
    batches = _metric(text, "polymask_batch_size_count")
    assert _metric(text, "polymask_batch_size_sum") / batches > 1.5  # requests were batched
    real = _metric(text, "polymask_tokens_total", kind="real")
    assert 0 < real <= _metric(text, "polymask_tokens_total", kind="computed")
    assert _metric(text, "polymask_queue_depth") == 0
    for phase in ("queue", "tokenize", "compute"):
        assert _metric(text, "polymask_phase_seconds_count", phase=phase) >= 128
    assert _metric(text, "polymask_requests_total", route="/embed", status="200") >= 64
    assert _metric(text, "polymask_request_errors_total", route="/embed", status="413") >= 1
    assert "polymask_request_seconds_bucket" in text


def test_full_queue_is_503_with_retry_after_and_warm_start_compiles_nothing(
        server, model_dir, cache_dir, corpus, tmp_path):
    """A second server on the same cache: warm from it (0 compiles), and a
    queue of 4 inputs answers a burst with 503 + Retry-After.

    ``server`` is requested so the first server fills ``cache_dir`` in this
    worker: pytest-xdist may run this test in another worker than the tests
    that use ``server``, whose module fixtures (the cache) are its own."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    texts, ref, _ = corpus
    s = _Server(model_dir, cache_dir, tmp_path / "serve.log", "--max-queue", "4",
                "--max-wait-ms", "50")
    try:
        health = s.wait_ready()
        assert health["warmup_compiles"] == 0, s.output()

        def call(k: int):
            idx = [k % 60, (k + 1) % 60, (k + 2) % 60]
            r = httpx.post(s.url + "/v1/embeddings", json={"input": [texts[i] for i in idx]},
                           timeout=120)
            return r, idx

        with ThreadPoolExecutor(24) as pool:
            out = list(pool.map(call, range(24)))
        statuses = [r.status_code for r, _ in out]
        assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses, statuses
        for r, idx in out:
            if r.status_code == 503:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"] == "server_overloaded"
                assert "queue is full" in r.json()["error"]["message"]
            else:
                assert _close([d["embedding"] for d in r.json()["data"]], ref[idx])
        # more inputs than the queue holds can never be queued: a 413, not a 503
        r = httpx.post(s.url + "/embed", json={"inputs": ["a"] * 5}, timeout=60)
        assert r.status_code == 413 and r.json()["field"] == "inputs"
        # and the server said so at its start (--max-inputs 256 > --max-queue 4)
        assert "a request takes at most 4 inputs (more get 413)" in s.output()
    finally:
        assert s.stop(), s.output()


def test_a_second_ctrl_c_answers_its_requests_as_a_forced_stop_without_a_traceback(
        server, model_dir, cache_dir, tmp_path):
    """Ctrl-C twice with requests in flight (uvicorn's force quit): the
    requests it cut are 503 saying so (they said "did not finish within its
    shutdown timeout", a timeout never reached), the last line counts them
    as cut by the second Ctrl-C, and uvicorn's traceback of the interrupted
    lifespan is not printed (helper D). ``server``: the cache (see above)."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    s = _Server(model_dir, cache_dir, tmp_path / "serve.log", port=0)
    try:
        s.wait_ready()
        big = {"input": [f"text {k} " + "word " * 300 for k in range(128)]}

        def call(_):
            try:
                return httpx.post(s.url + "/v1/embeddings", json=big, timeout=120)
            except httpx.TransportError as e:
                return e

        with ThreadPoolExecutor(4) as pool:
            pending = [pool.submit(call, k) for k in range(4)]
            eventually(lambda: _metric(httpx.get(s.url + "/metrics", timeout=30).text,
                                       "polymask_inflight_requests", 0.0) >= 1,
                       "a request is in flight")
            s.proc.send_signal(signal.SIGINT)
            eventually(lambda: "stopping (SIGINT)" in s.output(), "the first SIGINT is said")
            s.proc.send_signal(signal.SIGINT)
            rc = s.proc.wait(120)
            answers = [f.result() for f in pending]
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(30)
    log = s.output()
    assert rc == 130 and "Traceback" not in log and "ERROR" not in log, (rc, log)
    cut = [r for r in answers if isinstance(r, httpx.Response) and r.status_code == 503]
    for r in cut:
        assert "stopped at once (a second Ctrl-C)" in r.json()["error"]["message"], r.text
    assert "shutdown timeout" not in log, log  # (cut ones queued: "by a second Ctrl-C")


def test_sigterm_under_load_loses_no_accepted_request(server, corpus):
    """SIGTERM while 16 clients send requests (a new connection each): every
    request the server accepted is answered with the exact embeddings; the
    others are refused at the connection, none gets a 5xx."""
    import re
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    texts, ref, _ = corpus
    stopped = threading.Event()  # set once SIGTERM is sent
    answered = threading.Event()

    def client(k: int) -> list:
        out = []
        for j in range(40):
            idx = [(k * 7 + j) % 60, (k + 3 * j) % 60]
            before_stop = not stopped.is_set()  # sent before SIGTERM (an order, no clock)
            try:
                r = httpx.post(server.url + "/v1/embeddings",
                               json={"input": [texts[i] for i in idx]},
                               headers={"connection": "close"}, timeout=120)
            except httpx.TransportError as e:
                out.append(("refused", type(e).__name__, before_stop))
                if stopped.is_set():
                    break
                continue
            ok = r.status_code == 200 and _close([d["embedding"] for d in r.json()["data"]],
                                                 ref[idx])
            out.append((r.status_code, ok, before_stop))
            answered.set()
        return out

    def answered_so_far() -> float:  # embedding requests answered by earlier tests
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return sum(_metric(text, "polymask_requests_total", default=0.0, route=route,
                           status="200")
                   for route in ("/v1/embeddings", "/embed"))

    before = answered_so_far()
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(client, k) for k in range(16)]
        assert answered.wait(120)
        time.sleep(0.5)
        stopped.set()
        server.proc.send_signal(__import__("signal").SIGTERM)
        results = [x for f in futures for x in f.result(300)]
    rc = server.proc.wait(60)
    log = server.output()
    assert rc in (0, -__import__("signal").SIGTERM), log  # uvicorn re-raises SIGTERM
    answers = [x for x in results if x[0] != "refused"]
    assert answers and all(status == 200 and ok for status, ok, _ in answers), answers
    # requests sent before SIGTERM and answered after it: in flight, finished
    assert any(before_stop for *_, before_stop in answers)
    m = re.search(r"stopped; (\d+) of (\d+) accepted embedding requests finished"
                  r"(?:; (\d+) dropped, their client gone)?", log)
    assert m, log
    # every request the server accepted finished, and its answer reached the client
    # (but those whose client left first: the 499 test's)
    dropped = int(m.group(3) or 0)
    assert int(m.group(1)) + dropped == int(m.group(2)), m.group(0)
    assert int(m.group(1)) == before + len(answers), (m.group(0), before)


def _serve(*argv: str, timeout: float = 120.0):
    """``polymask serve ARGV`` run to its end (a bounded wait: it must not serve)."""
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "polymask.cli", "serve", *argv],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, POLYMASK_CACHE_DIR="off"))


def test_a_port_in_use_or_a_host_that_does_not_resolve_is_one_line_and_exit_1(model_dir):
    """Checked before the model loads (it used to fail once warm-up had started,
    and the interpreter exiting under the warm-up's XLA compile crashed: rc -11)."""
    import socket

    for mod in ("starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(mod)
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _serve("--model", str(model_dir), "--host", HOST, "--port", str(port))
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"polymask serve: cannot listen on {HOST}:{port}: address already in use"], r.stderr
    r = _serve("--model", str(model_dir), "--host", "999.1.1.1", "--port", "0")
    assert r.returncode == 1, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("polymask serve: cannot listen on 999.1.1.1:0: "), r.stderr


def test_sigint_while_warming_up_waits_for_the_compile_and_exits_130(model_dir, tmp_path):
    """Ctrl-C while the program compiles (an empty cache): the server stops,
    the compile is waited for, and the process exits as interrupted, never
    with a crash (the interpreter exiting under XLA's compile: rc -11)."""
    import signal
    import time

    import httpx

    for mod in ("starlette", "uvicorn", "prometheus_client", "httpx"):
        pytest.importorskip(mod)
    s = _Server(model_dir, tmp_path / "empty-cache", tmp_path / "serve.log")
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            for _ in range(6000):  # until the app answers: warm-up has started
                assert s.proc.poll() is None, s.output()
                try:
                    status = c.get("/health").status_code
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
        s.proc.send_signal(signal.SIGINT)
        rc = s.proc.wait(300)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(30)
    log = s.output()
    assert rc == 130, (rc, log)
    assert "polymask serve: stopped; 0 of 0 accepted embedding requests finished" in log
    assert "Traceback" not in log and "warm-up failed" not in log, log
    if status == 503:  # SIGINT came during the compile (it usually does: seconds of it)
        assert "ready (" not in log, log


def test_sigterm_with_a_client_stuck_sending_its_body_stops_at_the_shutdown_timeout(
        model_dir, cache_dir, server, tmp_path):
    """A client that sent its headers and part of its body held the graceful
    shutdown forever; ``--shutdown-timeout`` bounds it, and the batcher still
    drains. ``--port 0``: the server says the port it was given.

    ``server`` is requested so ``cache_dir`` holds the program (see
    test_full_queue_is_503_...)."""
    import re
    import signal
    import socket
    import time

    s = _Server(model_dir, cache_dir, tmp_path / "serve.log", "--shutdown-timeout", "1",
                port=0)
    try:
        s.wait_ready()
        with socket.create_connection((HOST, s.port), timeout=30) as stuck:
            stuck.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          b"application/json\r\nContent-Length: 100\r\n\r\n{\"inputs\": ")
            # another client is answered meanwhile
            assert __import__("httpx").get(s.url + "/health", timeout=30).status_code == 200
            s.proc.send_signal(signal.SIGTERM)
            for _ in range(600):  # one signal at a time: pending ones merge
                if "stopping (SIGTERM)" in s.output() or s.proc.poll() is not None:
                    break
                time.sleep(0.05)
            s.proc.send_signal(signal.SIGTERM)  # said, not ignored silently
            rc = s.proc.wait(120)  # bounded: it used to wait for the body forever
            answer = b""
            while chunk := stuck.recv(4096):  # a 503, then closed
                answer += chunk
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(30)
    log = s.output()
    assert rc == -signal.SIGTERM, (rc, log)
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower(), answer
    assert b'"error_type":"Unhealthy"' in body and b"shutting down" in body, answer
    assert "Traceback" not in log, log
    assert "stopping (SIGTERM)" in log and "SIGTERM again: already stopping" in log, log
    assert re.search(r"stopped; (\d+) of \1 accepted embedding requests finished\n", log), log
