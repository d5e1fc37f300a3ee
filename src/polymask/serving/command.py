"""``polymask serve``: the subcommand's options and what it runs.

``add_parser(sub, parents, load_encoder)`` registers it on the CLI's
subparsers (the CLI's cache options come in ``parents``, its model loader in
``load_encoder``: ``serve`` reports a model that cannot be loaded as ``embed``
does); ``cmd_serve(args)`` loads the model (the installed all-MiniLM-L6-v2, or
``--model DIR``), builds the
``EmbeddingService`` and runs the HTTP server (``http.run``); with ``--ray``
it deploys ``--replicas`` copies of that server on Ray Serve instead
(``ray_serve``). Starlette, uvicorn and prometheus_client (the ``serve``
extra) and Ray (the ``ray`` extra) are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys

from ..core.errors import install_extra
from .embedding import DEFAULT_MODEL_NAME, served_model_name

__all__ = ["add_parser", "cmd_serve"]


def _int_at_least(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {v}")
        return v

    return parse


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def add_parser(sub, parents: list, load_encoder) -> argparse.ArgumentParser:
    """Add ``serve`` to the CLI's subparsers ``sub``; returns its parser.

    ``load_encoder(model_dir, precision)``: the CLI's loader (a
    ``SentenceEncoder``; raises the CLI's error for a model that cannot be
    loaded). Passed in because this layer may not import the CLI's."""
    s = sub.add_parser(
        "serve", parents=parents,
        help="serve embeddings over HTTP (OpenAI /v1/embeddings, TEI /embed, /health, "
             "/metrics) with dynamic batching into one packed program",
        description="Serve the model over HTTP: concurrent requests are batched into one "
                    "compiled packed program (compiled or loaded from the cache at start; "
                    "/health is 503 until then). Needs the serve extra: "
                    f"{install_extra('serve')}. See docs/serving.md.")
    s.add_argument("--model", default=None, metavar="DIR",
                   help="a BERT-style model directory (default: installed all-MiniLM-L6-v2)")
    s.add_argument("--model-name", default=None,
                   help="the model's name in responses (default: "
                        f"{DEFAULT_MODEL_NAME} for the default model, else the directory name)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    # the OS takes a port modulo 65536: 70000 would bind 4464
    s.add_argument("--port", type=_int_at_least(0, 65535), default=8000,
                   help="port, 0-65535 (default 8000; 0: a free port, printed once bound)")
    s.add_argument("--max-wait-ms", type=_non_negative_float, default=5.0,
                   help="longest wait for more inputs before a batch runs (default 5 ms)")
    s.add_argument("--max-batch-tokens", type=_int_at_least(1), default=None,
                   help="most tokens per batch (default rows-per-call x max_seq_length)")
    s.add_argument("--max-batch-size", type=_int_at_least(1), default=256,
                   help="most inputs per batch (default 256)")
    s.add_argument("--rows-per-call", type=_int_at_least(1), default=2,
                   help="packed rows of max_seq_length tokens per program call (default 2)")
    s.add_argument("--max-queue", type=_int_at_least(1), default=4096,
                   help="most inputs waiting; more get 503 + Retry-After (default 4096)")
    s.add_argument("--max-inputs", type=_int_at_least(1), default=256,
                   help="most inputs per request; more get 413 (default 256)")
    s.add_argument("--max-body-bytes", type=_int_at_least(1), default=8 << 20,
                   help="largest request body; larger get 413 (default 8 MiB)")
    s.add_argument("--shutdown-timeout", type=_non_negative_float, default=30.0,
                   metavar="SECONDS",
                   help="on SIGTERM/SIGINT, most seconds to wait for the requests in flight "
                        "(a client still sending its body included); those still running "
                        "are then answered 503, the queue drained (default 30; not with "
                        "--ray)")
    s.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default warning)")
    s.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="serve --replicas replicas behind Ray Serve's HTTP proxy on --host "
                        "and --port (ray extra): on the cluster at ADDRESS, or on a local "
                        "Ray instance when ADDRESS is left out")
    s.add_argument("--replicas", type=_int_at_least(1), default=2,
                   help="Ray Serve replicas, each with its model and batcher (with --ray; "
                        "default 2)")
    s.set_defaults(func=cmd_serve, load_encoder=load_encoder)
    return s


def cmd_serve(args) -> int:
    """Run the server until SIGTERM/SIGINT; 2 when the serve extra is
    missing, 1 when it cannot listen on ``--host``:``--port`` (checked before
    the model loads). A model that cannot be loaded raises
    ``args.load_encoder``'s error (the CLI's: exit 2 for ``--model DIR``);
    after SIGINT, ``KeyboardInterrupt``."""
    if args.ray is not None:
        return _serve_on_ray(args)
    try:
        # imported where they are used (http.py, metrics.py): check them before any work
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401

        from .http import listen, run
    except ImportError as e:
        print(f"polymask: {e}; install the serve extra: {install_extra('serve')}",
              file=sys.stderr)
        return 2
    from .embedding import EmbeddingService

    if args.max_inputs > args.max_queue:  # (a request must fit the queue: create_app caps it)
        print(f"polymask serve: --max-inputs {args.max_inputs} is more than --max-queue "
              f"{args.max_queue}: a request takes at most {args.max_queue} inputs (more get "
              "413)", file=sys.stderr)
    try:
        sockets = listen(args.host, args.port)
    except OSError as e:
        print(f"polymask serve: {e}", file=sys.stderr)
        return 1
    try:
        enc = args.load_encoder(args.model, args.precision)
        name = args.model_name or served_model_name(enc.model_dir)
        service = EmbeddingService(enc, max_wait_ms=args.max_wait_ms,
                                   max_queue=args.max_queue,
                                   max_batch_size=args.max_batch_size,
                                   max_batch_tokens=args.max_batch_tokens,
                                   rows_per_call=args.rows_per_call)
        run(service, model_name=name, host=args.host, port=args.port, sockets=sockets,
            max_inputs=args.max_inputs, max_body_bytes=args.max_body_bytes,
            log_level=args.log_level, shutdown_timeout=args.shutdown_timeout)
    except OSError as e:  # run's: the sockets could not be served after all
        print(f"polymask serve: {e}", file=sys.stderr)
        return 1
    finally:
        for sock in sockets:
            sock.close()
    return 0


def _serve_on_ray(args) -> int:
    """``--ray``: ``--replicas`` replicas on Ray Serve until SIGTERM/SIGINT; 2
    when Ray Serve is missing."""
    import pathlib

    import jax

    if not args.ray:  # a local instance: the replicas read the model from this machine
        from ..models.loader import INSTALL_HINT, default_model_dir

        try:
            if args.model is None:
                default_model_dir()
            elif not pathlib.Path(args.model).is_dir():
                raise FileNotFoundError(f"no model directory {args.model}")
        except FileNotFoundError as e:
            print(f"polymask: {e}", file=sys.stderr)
            if args.model is None:
                print(f"polymask: install the default model with: {INSTALL_HINT}",
                      file=sys.stderr)
            return 2
    try:
        from .ray_serve import deployment, run
        app = deployment(args.model, num_replicas=args.replicas, precision=args.precision,
                         model_name=args.model_name, max_inputs=args.max_inputs,
                         max_body_bytes=args.max_body_bytes,
                         cache_dir=jax.config.jax_compilation_cache_dir or None,
                         reuse_memory=not args.no_reuse_host_memory,
                         max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
                         max_batch_size=args.max_batch_size,
                         max_batch_tokens=args.max_batch_tokens,
                         rows_per_call=args.rows_per_call)
    except ImportError as e:
        print(f"polymask: {e}", file=sys.stderr)
        return 2
    run(app, address=args.ray or None, host=args.host, port=args.port)
    return 0
