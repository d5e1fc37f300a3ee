"""The ``polymask`` command line: ``polymask demo`` and ``polymask embed``.

``polymask demo`` embeds a corpus of real text that ships with every Python
install (the docstrings of the standard library, read with ``ast``, nothing is
imported) with all-MiniLM-L6-v2 in ragged batches, and prints what it took:
texts, distinct token lengths, compiles, wall time, throughput, and the max
deviation from an exact per-text run on a sample, which is also timed with
plain ``jax.jit`` (one compile per token length).

``polymask embed FILE --out FILE.npy`` embeds one text per line.
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
    from .models.loader import INSTALL_HINT, SentenceEncoder

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


def _policy(args):
    """The length bucket policy of ``--min-bucket`` (applied through ``plan.bucket_bound``)."""
    from . import buckets as B

    return B.pow2(args.min_bucket)


# ----------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------
def cmd_demo(args) -> int:
    import jax
    import numpy as np

    from . import buckets as B
    from .plan import bucket_bound

    enc = _load_encoder(args.model)
    texts = stdlib_docstrings(args.texts, seed=args.seed)
    ids = enc.tokenize(texts)
    lengths = [len(x) for x in ids]
    print(f"model: {enc.model_dir}\ncorpus: {len(texts)} docstrings of the Python "
          f"{sys.version.split()[0]} standard library; {sum(lengths)} tokens, "
          f"lengths {min(lengths)}..{max(lengths)} (max_seq_length {enc.max_seq_length})",
          flush=True)
    runner = enc.runner(_policy(args), args.batch_size)
    t0 = time.perf_counter()
    emb = enc.embed_ids(ids, buckets=_policy(args), batch_size=args.batch_size,
                        progress=not args.no_progress)
    wall = time.perf_counter() - t0
    st = runner.stats()

    # Exact per-text run on a sample: plain jax.jit, one compile per token length.
    rng = random.Random(args.seed + 1)
    sample = sorted(rng.sample(range(len(ids)), min(args.sample, len(ids))))
    exact = jax.jit(enc.embed_fn())
    t1 = time.perf_counter()
    ref = [np.asarray(exact(enc.params, ids[i])) for i in sample]
    jax_wall = time.perf_counter() - t1
    dev = float(max(np.abs(emb[i] - r).max() for i, r in zip(sample, ref)))
    sample_lengths = len({lengths[i] for i in sample})
    n_buckets = len({bucket_bound(_policy(args), n) for n in lengths})
    rows = [
        ("texts", f"{len(texts)}"),
        ("tokens (exact)", f"{sum(lengths)}"),
        ("distinct token lengths", f"{len(set(lengths))}"),
        ("length buckets", f"{n_buckets}  ({_policy(args)!r})"),
        ("compiles (polymask)", f"{st['compiles']}  ({st['compile_time_s']:.1f} s incl. first runs)"),
        ("padding fraction", f"{st['padding_fraction']:.1%}"),
        ("wall time (incl. compiles)", f"{wall:.1f} s"),
        ("throughput", f"{len(texts) / wall:.1f} texts/s"),
        (f"max |deviation| vs exact run ({len(sample)} texts)", f"{dev:.2e}"),
        (f"plain jax.jit per shape, same {len(sample)} texts",
         f"{jax_wall:.1f} s  ({sample_lengths} compiles, {len(sample) / jax_wall:.1f} texts/s)"),
    ]
    _print_table("polymask demo: all-MiniLM-L6-v2 on stdlib docstrings", rows)
    if args.out:
        np.save(args.out, emb)
        print(f"embeddings {emb.shape} -> {args.out}")
    del B
    return 0


def cmd_embed(args) -> int:
    import numpy as np

    path = pathlib.Path(args.file)
    if not path.exists():
        print(f"polymask: {path}: no such file", file=sys.stderr)
        return 2
    texts = path.read_text(encoding="utf-8").splitlines()
    enc = _load_encoder(args.model)
    t0 = time.perf_counter()
    emb = enc.embed(texts, buckets=_policy(args), batch_size=args.batch_size,
                    progress=args.progress)
    wall = time.perf_counter() - t0
    out = args.out or str(path.with_suffix(".npy"))
    np.save(out, emb)
    st = enc.runner(_policy(args), args.batch_size).stats()
    print(f"{len(texts)} texts -> {out} {emb.shape} float32 in {wall:.1f} s "
          f"({st['compiles']} compiles)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polymask", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="embed stdlib docstrings with all-MiniLM-L6-v2 and report")
    d.add_argument("--texts", type=int, default=384, help="corpus size (default 384)")
    d.add_argument("--sample", type=int, default=12,
                   help="texts re-run exactly with plain jax.jit (default 12)")
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--min-bucket", type=int, default=16,
                   help="smallest length bucket (powers of two above it)")
    d.add_argument("--model", default=None, help="model directory (default: installed MiniLM)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default=None, help="also save the embeddings (.npy)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("embed", help="embed a text file, one text per line")
    e.add_argument("file")
    e.add_argument("--out", default=None, help="output .npy (default: FILE with .npy)")
    e.add_argument("--model", default=None, help="model directory (default: installed MiniLM)")
    e.add_argument("--batch-size", type=int, default=32)
    e.add_argument("--min-bucket", type=int, default=16)
    e.add_argument("--progress", action="store_true")
    e.set_defaults(func=cmd_embed)
    return p


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
