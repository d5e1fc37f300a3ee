"""``polymask.serving``: answer concurrent requests of any size with one program.

``DynamicBatcher`` wraps a function written for one example, as
``polymask.ragged_map`` does, and serves it to many concurrent callers
(threads or asyncio tasks): calls are gathered for at most ``max_wait_ms`` or
until a budget of examples or elements, run as one ``ragged_map`` call (the
packed layout when the function packs), and each caller gets its own result.
``polymask serve`` (``command.py``, ``http.py``) puts the sentence encoder
behind HTTP with it: ``docs/serving.md``.

Modules: ``errors`` (``QueueFull``, ``BatcherClosed``), ``batcher``
(``DynamicBatcher``), ``embedding`` (``EmbeddingService``: tokenizer, batcher,
warm-up), ``requests`` (OpenAI and TEI request bodies, checked), ``metrics``
(Prometheus), ``http`` (the Starlette app and uvicorn), ``command`` (the
``polymask serve`` subcommand), ``ray_serve`` (that app as Ray Serve
replicas: ``polymask serve --ray``).

Layer: imports ``runners`` and ``models`` (and what they import); ``cli``
imports it. ``http`` needs the ``serve`` extra (Starlette, uvicorn,
prometheus_client), ``ray_serve`` the ``ray`` extra (Ray Serve); nothing
else here does.
"""

from .batcher import BatchReport, DynamicBatcher, Timing
from .errors import BatcherClosed, QueueFull

__all__ = ["DynamicBatcher", "BatchReport", "Timing", "QueueFull", "BatcherClosed"]
