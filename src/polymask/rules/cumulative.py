"""Cumulative ops (``cumsum``, ``cumprod``, ``cummax``, ``cummin``, ``cumlogsumexp``).

Forward scans are prefix-safe: position ``i`` reads positions ``<= i``. Their
transpose is a reverse scan that reads the padding's cotangent, so float
results get their padding selected to 0 (which zeroes those cotangents).
Reverse scans read the padding, so it is filled with the identity first.
"""

from __future__ import annotations

from jax import lax

from .families import defcumulative

defcumulative(lax.cumsum_p, kind="sum", module=__name__)
defcumulative(lax.cumprod_p, kind="prod", module=__name__)
defcumulative(lax.cummax_p, kind="max", module=__name__)
defcumulative(lax.cummin_p, kind="min", module=__name__)
# logsumexp's identity is -inf, like max's.
defcumulative(lax.cumlogsumexp_p, kind="max", module=__name__)
