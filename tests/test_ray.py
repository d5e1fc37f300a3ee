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
