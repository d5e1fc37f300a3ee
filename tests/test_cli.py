"""The command line: `polymask embed` and `polymask demo` (tiny random model, fast)."""

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from test_bert import _tiny_model_dir  # noqa: E402

from polymask import cli  # noqa: E402
from polymask.models.loader import SentenceEncoder  # noqa: E402


def test_stdlib_docstrings_deterministic():
    a = cli.stdlib_docstrings(25, seed=3)
    assert len(a) == 25 and all(isinstance(t, str) and t.strip() for t in a)
    assert a == cli.stdlib_docstrings(25, seed=3)
    assert len(set(a)) == 25


def test_embed_command(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    model = _tiny_model_dir(tmp_path / "m")
    f = tmp_path / "texts.txt"
    f.write_text("The cat sat on the mat.\n\nbig red dog ran fast and the cat sat on a mat\n")
    out = tmp_path / "emb.npy"
    assert cli.main(["embed", str(f), "--out", str(out), "--model", str(model)]) == 0
    emb = np.load(out)
    assert emb.shape == (2, 16) and emb.dtype == np.float32  # the blank line is skipped
    texts = [t for t in f.read_text().splitlines() if t.strip()]
    ref = SentenceEncoder(model).embed(texts)
    np.testing.assert_allclose(emb, ref, atol=1e-6)
    err = capsys.readouterr().err
    assert "2 texts" in err and "skipped 1 blank line (line 2)" in err and "texts/s" in err


def test_embed_jsonl_no_normalize_progress(tmp_path, capsys):
    import json

    (tmp_path / "m").mkdir()
    model = _tiny_model_dir(tmp_path / "m")
    f = tmp_path / "texts.txt"
    texts = ["the cat sat", "a big red dog ran fast", "", "  ", "on a mat"]
    f.write_text("\n".join(texts) + "\n")
    out = tmp_path / "emb.jsonl"
    assert cli.main(["embed", str(f), "--out", str(out), "--model", str(model),
                     "--no-normalize", "--batch-size", "2", "--progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 5]
    assert [r["text"] for r in rows] == ["the cat sat", "a big red dog ran fast", "on a mat"]
    emb = np.array([r["embedding"] for r in rows], np.float32)
    enc = SentenceEncoder(model)
    ref = enc.embed([r["text"] for r in rows], normalize=False)
    np.testing.assert_allclose(emb, ref, rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.linalg.norm(emb, axis=1), 1.0)  # not normalised
    np.testing.assert_allclose(enc.embed(["on a mat"])[0], ref[2] / np.linalg.norm(ref[2]),
                               rtol=1e-5, atol=1e-6)
    err = capsys.readouterr().err
    assert "skipped 2 blank lines (line 3, 4)" in err and "texts/s" in err


def test_embed_missing_file(tmp_path, capsys):
    assert cli.main(["embed", str(tmp_path / "nope.txt")]) == 2


def test_demo_command_prints_table(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    _tiny_model_dir(model)
    out = tmp_path / "demo.npy"
    assert cli.main(["demo", "--texts", "40", "--sample", "4", "--model", str(model),
                     "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("texts", "distinct token lengths", "compiles", "wall time", "throughput",
                 "deviation", "plain jax.jit"):
        assert word in text
    assert np.load(out).shape == (40, 16)


def test_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "polymask.cli", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "demo" in r.stdout and "embed" in r.stdout


def test_warmup_command_fills_the_cache_then_embed_compiles_nothing(tmp_path, capsys):
    import polymask as pm

    model = tmp_path / "m"
    model.mkdir()
    _tiny_model_dir(model)
    cache = tmp_path / "xla"
    try:
        assert cli.main(["--cache-dir", str(cache), "warmup", "--model", str(model),
                         "--batch-size", "4", "--min-bucket", "16"]) == 0
        err = capsys.readouterr().err
        assert "length buckets [16] and the packed row program" in err
        # the 16 bucket and the packed row program
        assert "2 programs: 2 compiled, 0 loaded from the cache, host memory reuse" in err
        assert any(p.is_file() for p in cache.rglob("*"))
    finally:
        pm.disable_compilation_cache()
    enc = SentenceEncoder(model)
    policy = pm.buckets.pow2(16)
    lengths = enc.warmup(policy, batch_size=4, max_length=20)
    assert lengths == [16, 32] and enc.runner(policy, 4).stats()["precompiles"] == 2
    with pm.compile_counter() as cc:
        enc.embed(["a short text", "the cat sat on the mat"], buckets=policy, batch_size=4)
    assert cc.compiles == 0


@pytest.mark.parametrize("flag", ["--bucket-steps", "--min-bucket", "--batch-size"])
def test_cli_rejects_non_positive_sizes_with_a_usage_error(flag, tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("a text\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["embed", str(f), flag, "0"])
    assert e.value.code == 2
    assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, no_cache, cache_dir", [
    (["embed", "f"], False, None),
    (["--no-cache", "embed", "f"], True, None),
    (["embed", "f", "--no-cache"], True, None),
    (["--cache-dir", "X", "warmup"], False, "X"),
    (["warmup", "--cache-dir", "Y"], False, "Y"),
    (["--cache-dir", "X", "demo", "--no-cache"], True, "X"),
])
def test_cache_options_before_or_after_the_subcommand(argv, no_cache, cache_dir):
    args = cli.build_parser().parse_args(argv)
    assert (args.no_cache, args.cache_dir) == (no_cache, cache_dir)


@pytest.mark.parametrize("argv, off", [
    (["embed", "f"], False),
    (["--no-reuse-host-memory", "embed", "f"], True),
    (["warmup", "--no-reuse-host-memory"], True),
])
def test_reuse_host_memory_option_before_or_after_the_subcommand(argv, off):
    assert cli.build_parser().parse_args(argv).no_reuse_host_memory is off


def test_cli_reuses_host_memory_unless_told_not_to(monkeypatch):
    from polymask.runners import hostmem

    calls = []
    monkeypatch.setattr(hostmem, "reuse_host_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(cli, "cmd_warmup", lambda args: 0)  # read by build_parser
    assert cli.main(["warmup", "--no-cache", "--no-reuse-host-memory"]) == 0
    assert calls == []
    monkeypatch.setenv("POLYMASK_REUSE_HOST_MEMORY", "off")
    assert cli.main(["warmup", "--no-cache"]) == 0
    assert calls == []
    monkeypatch.delenv("POLYMASK_REUSE_HOST_MEMORY")
    assert cli.main(["warmup", "--no-cache"]) == 0
    assert calls == [1]


def test_no_cache_with_a_cache_dir_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--no-cache", "--cache-dir", "/tmp/x", "warmup"])
    assert e.value.code == 2
    assert "--no-cache and --cache-dir contradict" in capsys.readouterr().err
