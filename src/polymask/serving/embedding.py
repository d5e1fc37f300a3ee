"""``EmbeddingService``: a ``SentenceEncoder`` behind a ``DynamicBatcher``.

Texts are tokenized by the caller's thread (the encoder's tokenizer,
truncating at ``max_seq_length`` as ``SentenceEncoder.tokenize`` does), and
their token ids go to one batcher over the encoder's packed layout: rows of
``max_seq_length`` tokens, ``rows_per_call`` rows per call of **one** compiled
program, which ``warmup`` compiles (or loads from the persistent compilation
cache) before the service is ready. The program computes the mean-pooled
embedding; L2 normalisation is done per request on the host, so
``normalize=True`` and ``False`` share the program. Results equal
``SentenceEncoder.embed``'s (float32 rounding: <= 1e-6).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ..runners.compiling import compile_counter
from .batcher import BatchReport, DynamicBatcher

__all__ = ["EmbeddingService", "Tokenized", "l2_normalize", "served_model_name",
           "DEFAULT_MODEL_NAME"]

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def served_model_name(model_dir) -> str:
    """The name the servers give ``model_dir`` (``model`` in OpenAI responses):
    the default model's Hub name, else the directory's name."""
    import pathlib

    from ..models.loader import default_model_dir

    model_dir = pathlib.Path(model_dir).resolve()
    try:
        if model_dir == default_model_dir().resolve():
            return DEFAULT_MODEL_NAME
    except FileNotFoundError:
        pass
    return model_dir.name


def l2_normalize(v: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """``v / max(||v||, eps)`` along the last axis, float32 (as the model's
    ``bert.l2_normalize``)."""
    v = np.asarray(v, np.float32)
    norm = np.linalg.norm(v, axis=-1, keepdims=True)
    return (v / np.maximum(norm, np.float32(eps))).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Tokenized:
    """Token ids of texts: ``ids`` (int32 ``(n_i,)`` each, ``[CLS] ... [SEP]``,
    at most ``max_seq_length``), ``truncated`` (which texts were longer),
    ``seconds`` (tokenizing time)."""

    ids: list[np.ndarray]
    truncated: list[bool]
    seconds: float

    @property
    def tokens(self) -> int:
        return int(sum(len(x) for x in self.ids))


class EmbeddingService:
    """Tokenize, batch and embed texts for concurrent requests.

    Args:
      encoder: a ``polymask.models.SentenceEncoder``.
      max_wait_ms, max_queue, max_batch_size: as ``DynamicBatcher``'s.
      max_batch_tokens: the batcher's element budget (tokens per batch;
        default ``rows_per_call * max_seq_length``: one packed call).
      rows_per_call: rows of ``max_seq_length`` tokens per call of the packed
        program (default 2: a lone short text computes 2 rows, not 8).
      on_batch: ``BatchReport`` callback (metrics).

    Attributes:
      encoder, batcher, hidden_size, max_tokens (``max_seq_length``),
      ready (True once ``warmup`` ran), warmup_compiles, warmup_s.
    """

    def __init__(self, encoder, *, max_wait_ms: float = 5.0, max_queue: int = 4096,
                 max_batch_size: int = 256, max_batch_tokens: int | None = None,
                 rows_per_call: int = 2,
                 on_batch: Callable[[BatchReport], None] | None = None):
        from ..runners.ragged import RaggedMap

        if int(rows_per_call) < 1:
            raise ValueError(f"rows_per_call must be >= 1, got {rows_per_call!r}")
        self.encoder = encoder
        self.hidden_size = int(encoder.config.hidden_size)
        self.max_tokens = int(encoder.max_seq_length)
        self.rows_per_call = int(rows_per_call)
        # one program: the mean-pooled embedding (normalised on the host), packed
        # into rows of max_seq_length tokens; every tokenized text fits a row
        self.runner = RaggedMap(encoder.embed_fn(normalize=False), ("n",),
                                numpy_outputs=True, layout="packed",
                                row_size=self.max_tokens, rows_per_call=self.rows_per_call,
                                compile_ahead=False)
        budget = max_batch_tokens or self.rows_per_call * self.max_tokens
        self.batcher = DynamicBatcher(self.runner, broadcast=(encoder.params,),
                                      max_wait_ms=max_wait_ms, max_queue=max_queue,
                                      max_batch_size=max_batch_size,
                                      max_batch_elements=budget, on_batch=on_batch,
                                      name="polymask-embeddings")
        self.max_batch_tokens = int(budget)
        self.ready = False
        self.warmup_compiles = 0
        self.warmup_s = 0.0
        self._lock = threading.Lock()

    def tokenize(self, texts: Sequence[str]) -> Tokenized:
        """Token ids of ``texts`` (truncated at ``max_tokens``, as
        ``SentenceEncoder.tokenize``), with which texts were longer."""
        start = time.perf_counter()
        encs = self.encoder.tokenizer.encode_batch(list(texts))
        ids = [np.asarray(e.ids, np.int32) for e in encs]
        truncated = [bool(e.overflowing) for e in encs]
        return Tokenized(ids, truncated, time.perf_counter() - start)

    def warmup(self) -> int:
        """Compile (or load from the persistent compilation cache) the packed
        program and run one text through the batcher; then ``ready``. Returns
        the XLA compiles it took (0 when every program came from the cache).
        Idempotent."""
        with self._lock:
            if self.ready:
                return self.warmup_compiles
            start = time.perf_counter()
            with compile_counter() as cc:
                self.runner.precompile_packed(jax.ShapeDtypeStruct((1,), np.int32),
                                              self.encoder.params)
                ids = self.tokenize(["polymask warm-up"]).ids
                [f.result() for f in self.batcher.submit_many(ids)]
            self.warmup_compiles = cc.compiles
            self.warmup_s = time.perf_counter() - start
            self.ready = True
            return self.warmup_compiles

    def submit(self, ids: Sequence[np.ndarray]):
        """One future per token-id array (the batcher's ``submit_many``: all or
        none). Each result is the mean-pooled embedding ``(hidden_size,)``
        float32, before normalisation.

        Raises:
          QueueFull: the queue cannot take them now.
          BatcherClosed: the service is closing.
        """
        return self.batcher.submit_many(list(ids))

    def embed(self, texts: Sequence[str], normalize: bool = True) -> np.ndarray:
        """Embeddings ``(len(texts), hidden_size)`` float32 (blocks this thread;
        the texts truncated at ``max_tokens``)."""
        futures = self.submit(self.tokenize(texts).ids)
        out = np.stack([f.result() for f in futures]) if futures else \
            np.zeros((0, self.hidden_size), np.float32)
        return l2_normalize(out) if normalize else out.astype(np.float32)

    def close(self, drain: bool = True) -> None:
        """Stop taking texts; ``drain``: embed those waiting first."""
        self.batcher.close(drain)
