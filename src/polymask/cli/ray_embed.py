"""``polymask embed FILE --ray [ADDRESS]``: embed with a Ray Data actor pool.

Each actor loads the encoder once and embeds the batches it is given with the
usual ragged runner (one compile per length bucket per actor); rows carry
their input index, so the result is in input order whatever order the
actors finish in. Needs the ``ray`` extra (``pip install -e ".[ray]"``).
"""

from __future__ import annotations

import numpy as np

from ..core.errors import install_extra

__all__ = ["embed_with_ray"]


class _Embedder:
    """A Ray Data callable class: one ``SentenceEncoder`` per actor."""

    def __init__(self, model_dir, min_bucket, batch_size, normalize=True, bucket_steps=2,
                 reuse_memory=True, max_length=None, precision="float32"):
        if reuse_memory:  # as the CLI's own process (polymask.runners.hostmem), before JAX runs
            from ..runners.hostmem import reuse_host_memory

            reuse_host_memory()
        from ..models.loader import SentenceEncoder, length_buckets

        self.enc = SentenceEncoder(model_dir, precision)
        if max_length is not None:  # polymask embed --max-length
            self.enc.tokenizer.enable_truncation(max_length=max_length)
        self.buckets = length_buckets(min_bucket, bucket_steps)
        self.batch_size = batch_size
        self.normalize = normalize

    def __call__(self, batch):
        texts = [str(t) for t in batch["text"]]
        emb = self.enc.embed(texts, buckets=self.buckets, batch_size=self.batch_size,
                             normalize=self.normalize)
        return {"index": np.asarray(batch["index"]), "embedding": np.asarray(emb)}


def embed_with_ray(texts: list[str], model_dir=None, *, address: str | None = None,
                   actors: int = 2, batch_size: int = 32, min_bucket: int = 16,
                   bucket_steps: int = 2, block_size: int | None = None, normalize: bool = True,
                   reuse_memory: bool = True, max_length: int | None = None,
                   precision: str = "float32") -> np.ndarray:
    """Embeddings ``(len(texts), dim)`` in input order, computed by ``actors`` Ray actors.

    ``address``: a Ray cluster (``"auto"``, ``"ray://host:10001"``); None starts
    or reuses a local instance. ``block_size``: texts per Ray Data batch
    (default ``4 * batch_size``). ``reuse_memory``: each actor calls
    ``polymask.reuse_host_memory()`` first, as the CLI does. ``max_length``:
    truncate texts to that many tokens (default: the model's ``max_seq_length``).
    ``precision``: the encoder's (``polymask.models.SentenceEncoder``).
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"--ray needs Ray Data: {install_extra('ray')}") from e
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    if model_dir is not None:
        import pathlib
        model_dir = str(pathlib.Path(model_dir).resolve())
    ds = ray.data.from_items([{"index": i, "text": t} for i, t in enumerate(texts)])
    out = ds.map_batches(_Embedder, fn_constructor_args=(model_dir, min_bucket, batch_size,
                                                         normalize, bucket_steps, reuse_memory,
                                                         max_length, precision),
                         batch_size=block_size or 4 * batch_size, batch_format="numpy",
                         concurrency=actors)
    rows = out.take_all()
    if len(rows) != len(texts):
        raise RuntimeError(f"ray: {len(rows)} embeddings for {len(texts)} texts")
    order = np.argsort([r["index"] for r in rows], kind="stable")
    return np.stack([np.asarray(rows[i]["embedding"], np.float32) for i in order])
