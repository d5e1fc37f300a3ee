"""The ``polymask`` command line: ``polymask demo``, ``embed`` and ``warmup``.

``polymask demo`` embeds a corpus of real text that ships with every Python
install (the docstrings of the standard library, read with ``ast``, nothing is
imported) with all-MiniLM-L6-v2 in ragged batches, and prints what it took:
texts, distinct token lengths, compiles, wall time, throughput, and the max
deviation from an exact per-text run on a sample, which is also timed with
plain ``jax.jit`` (one compile per token length).

``polymask embed FILE --out FILE.npy`` embeds one text per line.
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
import os
import pathlib
import random
import sys
import sysconfig
import time

__all__ = ["main", "stdlib_docstrings"]


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
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title, show_header=True, header_style="bold")
        t.add_column("metric")
        t.add_column("value", justify="right")
        for k, v in rows:
            t.add_row(k, v)
        Console().print(t)
    except ImportError:  # pragma: no cover - rich is in the models extra
        w = max(len(k) for k, _ in rows)
        print(title)
        for k, v in rows:
            print(f"  {k.ljust(w)}  {v}")


def _load_encoder(model_dir):
    from ..models.loader import INSTALL_HINT, SentenceEncoder

    try:
        return SentenceEncoder(model_dir)
    except FileNotFoundError as e:
        print(f"polymask: {e}", file=sys.stderr)
        if model_dir is None:
            print(f"polymask: install the default model with: {INSTALL_HINT}", file=sys.stderr)
        raise SystemExit(2) from None
    except ImportError as e:
        print(f"polymask: {e}; install the models extra: pip install 'polymask[models]'",
              file=sys.stderr)
        raise SystemExit(2) from None


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
    import jax
    import numpy as np

    from ..core import buckets as B
    from ..core.plan import bucket_bound
    from ..runners.compiling import compile_counter

    enc = _load_encoder(args.model)
    texts = stdlib_docstrings(args.texts, seed=args.seed)
    ids = enc.tokenize(texts)
    lengths = [len(x) for x in ids]
    print(f"model: {enc.model_dir}\ncorpus: {len(texts)} docstrings of the Python "
          f"{sys.version.split()[0]} standard library; {sum(lengths)} tokens, "
          f"lengths {min(lengths)}..{max(lengths)} (max_seq_length {enc.max_seq_length})",
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
    sample_lengths = len({lengths[i] for i in sample})
    n_buckets = len({bucket_bound(_policy(args), n) for n in lengths})
    rows = [
        ("texts", f"{len(texts)}"),
        ("tokens (exact)", f"{sum(lengths)}"),
        ("distinct token lengths", f"{len(set(lengths))}"),
        ("length buckets of single texts", f"{n_buckets}  ({_policy(args)!r})"),
        ("programs (polymask)", f"{_programs_in_words(st, args)}  (one per packed row shape or batch bucket; "
                                f"{st['compile_time_s']:.1f} s of compiling or loading, "
                                "summed over threads)"),
        ("layout", _layout_in_words(st)),
        ("padding fraction", f"{st['padding_fraction']:.1%}"),
        ("wall time (incl. compiles)", f"{wall:.1f} s"),
        ("throughput", f"{len(texts) / wall:.1f} texts/s"),
        (f"max |deviation| vs exact run ({len(sample)} texts)", f"{dev:.2e}"),
        (f"plain jax.jit per shape, same {len(sample)} texts",
         f"{jax_wall:.1f} s  ({sample_lengths} programs: {cc.compiles} compiled, "
         f"{cc.cache_hits} loaded from the cache; {len(sample) / jax_wall:.1f} texts/s)"),
    ]
    _print_table("polymask demo: all-MiniLM-L6-v2 on stdlib docstrings", rows)
    if args.out:
        np.save(args.out, emb)
        print(f"embeddings {emb.shape} -> {args.out}")
    del B
    return 0


def _layout_in_words(st: dict) -> str:
    """``"1384 texts packed (rows of 256 tokens, 8 per call), 16 padded: ..."``."""
    lay = st.get("layout", {})
    packed = st.get("packed")
    text = f"{lay.get('packed', 0)} texts packed"
    if packed:
        text += f" (rows of {packed['row_size']} tokens, {packed['rows_per_call']} per call)"
    return f"{text}, {lay.get('padded', 0)} padded; {lay.get('reason', '')}"


def _write_embeddings(out: str, emb, texts: list[str], line_numbers: list[int]) -> None:
    """``.jsonl``: one ``{"line", "text", "embedding"}`` object per text; else ``.npy``."""
    import json

    import numpy as np

    if out.endswith(".jsonl"):
        with open(out, "w", encoding="utf-8") as fh:
            for ln, t, v in zip(line_numbers, texts, emb):
                fh.write(json.dumps({"line": ln, "text": t,
                                     "embedding": [float(x) for x in v]}) + "\n")
    else:
        np.save(out, emb)


def _embed_with_progress(enc, texts, args):
    """Embed in chunks of 8 batches, with a progress bar in texts/s (stderr).

    Without refined buckets: a one-shot pass does not pay for background
    compiles that only later calls would use."""
    import numpy as np

    if not args.progress or not texts:
        return enc.embed(texts, buckets=_policy(args), batch_size=args.batch_size,
                         normalize=args.normalize, refine=False, layout=args.layout)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the models extra
        return enc.embed(texts, buckets=_policy(args), batch_size=args.batch_size,
                         normalize=args.normalize, refine=False, layout=args.layout)
    chunk = 8 * args.batch_size
    parts = []
    with tqdm(total=len(texts), unit="texts", desc="polymask embed", file=sys.stderr) as bar:
        for i in range(0, len(texts), chunk):
            parts.append(enc.embed(texts[i:i + chunk], buckets=_policy(args),
                                   batch_size=args.batch_size, normalize=args.normalize,
                                   refine=False, layout=args.layout))
            bar.update(len(parts[-1]))
    return np.concatenate(parts)


def cmd_embed(args) -> int:
    path = pathlib.Path(args.file)
    if not path.exists():
        print(f"polymask: {path}: no such file", file=sys.stderr)
        return 2
    out = args.out or str(path.with_suffix(".npy"))
    if not out.endswith((".npy", ".jsonl")):
        print(f"polymask: --out {out}: use a .npy or .jsonl file name", file=sys.stderr)
        return 2
    lines = path.read_text(encoding="utf-8").splitlines()
    line_numbers = [i + 1 for i, t in enumerate(lines) if t.strip()]
    texts = [lines[i - 1] for i in line_numbers]
    blank = len(lines) - len(texts)
    if blank:
        shown = [i + 1 for i, t in enumerate(lines) if not t.strip()][:10]
        print(f"polymask: skipped {blank} blank line{'s' * (blank != 1)} "
              f"(line {', '.join(map(str, shown))}{', ...' if blank > 10 else ''})",
              file=sys.stderr)
    t0 = time.perf_counter()
    if args.ray is not None:  # a Ray Data actor pool, each actor holding the encoder
        from .ray_embed import embed_with_ray

        emb = embed_with_ray(texts, args.model, address=args.ray or None, actors=args.actors,
                             batch_size=args.batch_size, min_bucket=args.min_bucket, bucket_steps=args.bucket_steps,
                             normalize=args.normalize,
                             reuse_memory=not args.no_reuse_host_memory)
        how = f"ray, {args.actors} actors"
    else:
        enc = _load_encoder(args.model)
        emb = _embed_with_progress(enc, texts, args)
        st = enc.runner(_policy(args), args.batch_size, args.normalize, args.layout).stats()
        how = _programs_in_words(st, args)
    wall = time.perf_counter() - t0
    _write_embeddings(out, emb, texts, line_numbers)
    print(f"{len(texts)} texts -> {out} {emb.shape} float32 in {wall:.1f} s "
          f"({len(texts) / max(wall, 1e-9):.1f} texts/s, {how})", file=sys.stderr)
    return 0


def _programs_in_words(st: dict, args) -> str:
    """``"6 programs: 0 compiled, 6 loaded from the cache, host memory reuse on"``
    from a runner's stats and the options."""
    import jax

    n = f"{st['compiles']} program{'s' * (st['compiles'] != 1)}: {st['xla_compiles']} compiled"
    if jax.config.jax_compilation_cache_dir:
        n += f", {st['persistent_cache_hits'] + st.get('stored_loads', 0)} loaded from the cache"
    else:
        n += " (cache off: later runs compile again)"
    return n + ", host memory reuse " + ("off" if args.no_reuse_host_memory else "on")


def cmd_warmup(args) -> int:
    enc = _load_encoder(args.model)
    t0 = time.perf_counter()
    lengths = enc.warmup(_policy(args), args.batch_size, layout=args.layout)
    st = enc.runner(_policy(args), args.batch_size, layout=args.layout).stats()
    packed = "" if args.layout == "padded" else (
        f" and the packed row program ({enc.rows_per_call} rows of {enc.max_seq_length})")
    print(f"length buckets {lengths}{packed} ready (batch size {args.batch_size}) in "
          f"{time.perf_counter() - t0:.1f} s: {_programs_in_words(st, args)}", file=sys.stderr)
    return 0


def _enable_cache(args) -> None:
    if args.no_cache:
        return
    from ..runners.compile_cache import default_cache_dir, enable_compilation_cache

    d = args.cache_dir or default_cache_dir()
    if d is not None:
        enable_compilation_cache(d)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polymask",
                                description=__doc__.split("\n\n")[0].replace("``", ""))
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

    d = sub.add_parser("demo", parents=[cache, batching],
                       help="embed stdlib docstrings with all-MiniLM-L6-v2 and report")
    d.add_argument("--texts", type=_positive_int, default=384, help="corpus size (default 384)")
    d.add_argument("--sample", type=_positive_int, default=12,
                   help="texts re-run exactly with plain jax.jit (default 12)")
    d.add_argument("--model", default=None, help="model directory (default: installed MiniLM)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default=None, help="also save the embeddings (.npy)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("embed", parents=[cache, batching],
                       help="embed a text file, one text per line (blank lines "
                            "skipped and reported)")
    e.add_argument("file")
    e.add_argument("--out", default=None,
                   help="output .npy, or .jsonl (one {line, text, embedding} per text); "
                        "default: FILE with .npy")
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
        "warmup", parents=[cache, batching], help="compile every length bucket ahead of time (cached)",
        description="Compile the embedding program of every token-length bucket into the "
                    "persistent compilation cache (~/.cache/polymask/xla, $POLYMASK_CACHE_DIR; "
                    "--no-cache turns it off), so later "
                    "`polymask embed` runs compile nothing.")
    w.add_argument("--model", default=None, help="model directory (default: installed MiniLM)")
    w.set_defaults(func=cmd_warmup)

    from ..serving.command import add_parser as add_serve_parser  # polymask serve (HTTP)

    add_serve_parser(sub, [cache])
    return p


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.no_cache and args.cache_dir:
        parser.error("--no-cache and --cache-dir contradict each other: give one")
    from ..runners.hostmem import reuse_host_memory, reuse_host_memory_wanted

    if args.no_reuse_host_memory or not reuse_host_memory_wanted():
        args.no_reuse_host_memory = True
    else:  # before JAX allocates: see polymask.runners.hostmem
        reuse_host_memory()
    _enable_cache(args)
    return int(args.func(args) or 0)

