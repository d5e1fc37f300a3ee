"""Cumulative ops (``cumsum``, ``cumprod``, ``cummax``, ``cummin``, ``cumlogsumexp``).

Forward scans are prefix-safe: position ``i`` reads positions ``<= i``. Their
transpose is a reverse scan that reads the padding's cotangent, so float
results get their padding selected to 0 (which zeroes those cotangents).
Reverse scans read the padding, so it is filled with the identity first.
"""

from __future__ import annotations

from .families import defcumulative

defcumulative("cumsum", kind="sum")
defcumulative("cumprod", kind="prod")
defcumulative("cummax", kind="max")
defcumulative("cummin", kind="min")
# logsumexp's identity is -inf, like max's.
defcumulative("cumlogsumexp", kind="max")
