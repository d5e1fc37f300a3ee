"""``polymask embed FILE --ray``: a Ray Data actor pool on a local Ray instance
started here; embeddings identical to the single-process run, in input order."""

import os

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
ray = pytest.importorskip("ray")

from test_bert import _tiny_model_dir  # noqa: E402

from polymask import cli  # noqa: E402
from polymask.models.loader import SentenceEncoder, length_buckets  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier: starts a local Ray instance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_embed_with_ray_actor_pool(tmp_path, capsys, monkeypatch):
    (tmp_path / "m").mkdir()
    model = _tiny_model_dir(tmp_path / "m")
    words = "the cat sat on a mat and a big red dog ran fast".split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, rng.integers(1, 30))) for _ in range(40)]
    f = tmp_path / "texts.txt"
    f.write_text("\n".join(texts) + "\n")
    out = tmp_path / "emb.npy"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(  # the actors import this checkout
        [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert cli.main(["embed", str(f), "--out", str(out), "--model", str(model),
                         "--ray", "--actors", "2", "--batch-size", "4"]) == 0
    finally:
        ray.shutdown()
    emb = np.load(out)
    # the single-process run with the same options (default length buckets, batches of 4)
    ref = SentenceEncoder(model).embed(texts, buckets=length_buckets(), batch_size=4)
    assert emb.shape == ref.shape
    np.testing.assert_array_equal(emb, ref)  # identical, in input order
    assert "40 texts" in capsys.readouterr().err


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_serve_two_replicas_answer_as_polymask_serve(tmp_path, monkeypatch):
    """polymask.serving.ray_serve: 2 replicas behind Ray Serve's HTTP proxy on a
    loopback port answer /v1/embeddings and /embed as polymask serve does
    (embeddings equal to SentenceEncoder.embed's), both replicas serve, and a
    malformed request is the same JSON 4xx."""
    from concurrent.futures import ThreadPoolExecutor

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    pytest.importorskip("prometheus_client")
    serve = pytest.importorskip("ray.serve")
    from polymask.serving import ray_serve

    (tmp_path / "m").mkdir()
    model = _tiny_model_dir(tmp_path / "m")
    words = "the cat sat on a mat and a big red dog ran fast".split()
    rng = np.random.default_rng(1)
    texts = [" ".join(rng.choice(words, rng.integers(1, 9))) for _ in range(48)]
    ref = SentenceEncoder(model).embed(texts)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(  # the replicas import this checkout
        [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = ray_serve.deployment(model, num_replicas=2, num_cpus=1, max_wait_ms=10,
                                   model_name="tiny")
        serve.run(app, name="polymask", route_prefix="/")  # returns once both are warm

        def call(k: int):
            idx = [(3 * k + j) % len(texts) for j in range(1 + k % 3)]
            with httpx.Client(base_url=url, timeout=60) as c:
                if k % 2:
                    r = c.post("/v1/embeddings", json={"input": [texts[i] for i in idx]})
                    got = [d["embedding"] for d in r.json()["data"]] \
                        if r.status_code == 200 else None
                else:
                    r = c.post("/embed", json={"inputs": [texts[i] for i in idx]})
                    got = r.json() if r.status_code == 200 else None
            dev = float(np.abs(np.asarray(got, np.float32) - ref[idx]).max()) \
                if got is not None else r.text
            return r.status_code, dev, r.headers.get(ray_serve.REPLICA_HEADER), r

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(call, range(64)))
        assert [(s, d) for s, d, *_ in results if s != 200 or d > 1e-6] == []
        replicas = {rep for *_, rep, _ in results}
        for _ in range(10):  # Serve's router picks replicas at random: both, surely, by now
            if len(replicas) >= 2:
                break
            with ThreadPoolExecutor(8) as pool:
                replicas |= {rep for *_, rep, _ in pool.map(call, range(16))}
        assert None not in replicas and len(replicas) == 2, replicas
        body = next(r for s, _, _, r in results if r.request.url.path == "/v1/embeddings").json()
        assert body["object"] == "list" and body["model"] == "tiny"
        assert set(body["usage"]) == {"prompt_tokens", "total_tokens"}

        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "ok", r.text
            assert r.json()["model"] == "tiny" and r.json()["warmup_compiles"] >= 0
            # malformed requests: the same JSON 4xx as polymask serve, naming the field
            r = c.post("/v1/embeddings", content=b"{not json",
                       headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text
            r = c.post("/v1/embeddings", json={"input": ["a", None]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input[1]", r.text
            r = c.post("/embed", json={"inputs": "a", "normalize": "yes"})
            assert r.status_code == 422 and r.json()["field"] == "normalize", r.text
            r = c.get("/v1/nothing")
            assert r.status_code == 404 and r.json()["error"]["param"] == "path", r.text
            # each replica's own metrics: nothing compiled while serving
            text = c.get("/metrics").text
            assert 'polymask_compiles_total{phase="serving"} 0.0' in text
    finally:
        serve.shutdown()
        ray.shutdown()
