"""Bucketing policies: map a logical size to the bound it is padded to.

A policy is a callable ``size -> bound`` with ``bound >= max(size, 1)``. Few
distinct bounds mean few compiled programs (``polymask.jit`` compiles once per
bucket signature); tighter bounds mean less padding.

- ``pow2(minimum=8, maximum=None, steps=1, headroom=16)``: the next power of
  two (at least ``minimum``); ``steps=2`` adds 1.5 x 2^j between powers
  (tighter fit).
- ``multiple(k, minimum=None, maximum=None, headroom=16)``: the next multiple
  of ``k``.
  With ``maximum``, sizes above it raise and tiered ``polymask.jit`` compiles
  that largest bucket first (``Policy.largest``). Without one, tiered
  ``polymask.jit`` compiles a *headroom* bucket first: the bucket of
  ``headroom`` times the size's own bucket (``Policy.headroom``), capped as
  ``runners/tiering.py`` says (a constraint's upper bound, a byte budget).
- ``explicit([16, 32, 100])``: the smallest listed bound that fits.
- ``fixed(maximum)``: always ``maximum`` (one program; sizes above it fail).
- ``exact()``: no padding (one program per size, like ``jax.jit``).

``as_policy`` also accepts: ``None`` or ``"pow2"`` (the default ``pow2()``:
8, 16, 32, ... with headroom 16),
``"exact"``, an int (``fixed``), a list/tuple of ints (``explicit``), or any
callable. ``polymask.jit`` also takes a dict ``{dim var name: policy}``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np

from .errors import ShapeError

__all__ = ["Policy", "pow2", "multiple", "explicit", "fixed", "exact", "as_policy"]


def int_arg(v, what: str, minimum: int) -> int:
    """``v`` as an int >= ``minimum`` (a Python or NumPy integer; a float, a
    bool or a string is a mistake, never truncated).

    Raises:
      TypeError: ``v`` is not an integer.
      ValueError: ``v`` is below ``minimum``.
    """
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {v!r}")
    if v < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {int(v)}")
    return int(v)


class Policy:
    """A named bucketing policy: ``policy(size) -> bound``.

    ``largest``: the bucket that holds every size (None: unbounded); tiered
    ``polymask.jit`` compiles it first, so one compile serves a first pass.
    ``headroom``: for an unbounded policy, how much larger than a size's own
    bucket the bucket is that tiered ``polymask.jit`` compiles first when no
    compiled bucket holds the size (the policy's bucket of ``headroom`` times
    the own bucket; 1: the own bucket, no headroom). Smaller sizes then run in
    it while their own buckets compile in the background.
    """

    def __init__(self, fn: Callable[[int], int], name: str, largest: int | None = None,
                 headroom: int = 1):
        self._fn = fn
        self.name = name
        self.largest = largest
        self.headroom = int_arg(headroom, f"{name}: headroom", 1)

    def __call__(self, size: int) -> int:
        if isinstance(size, (bool, np.bool_)) or not (
                isinstance(size, (int, np.integer))
                or (isinstance(size, np.ndarray) and size.ndim == 0
                    and np.issubdtype(size.dtype, np.integer))):
            raise TypeError(f"bucket policy {self.name}: a size must be an int; got {size!r}")
        size = int(size)
        if size < 0:
            raise ShapeError(f"bucket policy {self.name}: negative size {size}")
        b = int(self._fn(size))
        if b < max(size, 1):
            raise ShapeError(f"bucket policy {self.name} gave bound {b} for size {size}")
        return b

    def __repr__(self) -> str:
        return self.name


def _capped(fn, maximum: int | None, name: str):
    """``fn`` with sizes above ``maximum`` refused (``ShapeError``) and the
    last bucket cut to ``maximum``."""
    if maximum is None:
        return fn

    def capped(n):
        if n > maximum:
            raise ShapeError(f"size {n} is larger than the largest bucket {maximum} "
                             f"({name})")
        return min(fn(n), maximum)

    return capped


def pow2(minimum: int = 8, maximum: int | None = None, steps: int = 1,
         headroom: int = 16) -> Policy:
    """Next power of two, at least ``minimum`` (``pow2(8)``: 0..8 -> 8, 9 -> 16;
    sizes up to ``minimum`` get ``minimum`` itself: ``pow2(12)``: 0..12 -> 12).

    ``steps`` (default 1) splits each octave ``(2^j, 2^(j+1)]`` into that many
    equal buckets: ``pow2(16, steps=2)`` gives 16, 24, 32, 48, 64, 96, 128,
    192, 256, ... At most about ``1/(steps+1)`` of a bound is padding (50% for
    ``steps=1``, 33% for 2, 20% for 4) while the number of programs still
    grows with ``log2`` of the largest size. The geometric buckets of
    ``tf.data.bucket_by_sequence_length`` users and of vLLM's captured batch
    sizes follow the same idea.

    ``maximum`` (optional) is the largest bucket: sizes up to it fit (the last
    bucket may be smaller than a power of two), larger sizes raise
    ``ShapeError``. It lets tiered ``polymask.jit`` compile that bucket first.

    ``headroom`` (default 16; ``Policy.headroom``) applies without
    ``maximum``: when no compiled bucket holds a size, tiered
    ``polymask.jit`` compiles the bucket of 16 times the size's own bucket
    first (4 powers of two up; ``pow2()``: a first size of 5, bucket 8, gets
    bucket 128), capped as ``polymask.jit`` documents. ``headroom=1``
    compiles the own bucket in the foreground.

    Raises:
      TypeError: ``minimum``, ``maximum``, ``steps`` or ``headroom`` is not an int.
      ValueError: ``minimum``, ``steps`` or ``headroom`` below 1, ``maximum``
        below ``minimum``.
      ShapeError (when applied): a size above ``maximum``.
    """
    minimum = int_arg(minimum, "pow2: minimum", 1)
    if maximum is not None:
        maximum = int_arg(maximum, "pow2: maximum", minimum)
    steps = int_arg(steps, "pow2: steps", 1)
    headroom = int_arg(headroom, "pow2: headroom", 1)
    name = (f"pow2(minimum={minimum}" + ("" if maximum is None else f", maximum={maximum}")
            + ("" if steps == 1 else f", steps={steps}")
            + ("" if headroom == 16 else f", headroom={headroom}") + ")")

    def fn(n):
        p = 1 << max(n - 1, 0).bit_length()  # next power of two >= n
        lower = p // 2
        if steps > 1 and lower >= 1:
            i = -(-(n - lower) * steps // lower)  # which step of (lower, p] holds n
            p = lower + -(-i * lower // steps)
        return int(minimum) if n <= minimum else p  # (a minimum of 12 holds 9..12)

    return Policy(_capped(fn, maximum, name), name, maximum, headroom)


def multiple(k: int, minimum: int | None = None, maximum: int | None = None,
             headroom: int = 16) -> Policy:
    """Next multiple of ``k`` (at least ``minimum``, default ``k``); sizes above
    ``maximum`` (optional, the largest bucket) raise ``ShapeError``.
    ``headroom``: as for ``pow2`` (without ``maximum``)."""
    k = int_arg(k, "multiple: k", 1)
    lo = k if minimum is None else int_arg(minimum, "multiple: minimum", 1)
    if maximum is not None:
        maximum = int_arg(maximum, "multiple: maximum", lo)
    headroom = int_arg(headroom, "multiple: headroom", 1)
    name = (f"multiple({k}" + ("" if maximum is None else f", maximum={maximum}")
            + ("" if headroom == 16 else f", headroom={headroom}") + ")")

    def fn(n):
        return max(lo, -(-n // k) * k, 1)

    return Policy(_capped(fn, maximum, name), name, maximum, headroom)


def explicit(bounds: Sequence[int]) -> Policy:
    """Smallest bound in ``bounds`` that is ``>= size``; ShapeError above the largest."""
    bs = sorted({int_arg(b, "explicit: each bound", 1) for b in bounds})
    if not bs:
        raise ValueError("explicit: needs at least one bound >= 1")

    def fn(n):
        i = bisect.bisect_left(bs, n)
        if i == len(bs):
            raise ShapeError(f"size {n} is larger than the largest bucket {bs[-1]} "
                             f"(explicit buckets {bs})")
        return bs[i]

    return Policy(fn, f"explicit({bs})", bs[-1])


def fixed(maximum: int) -> Policy:
    """Always ``maximum``: one program for every size ``<= maximum``.

    Raises (when applied):
      ShapeError: a size above ``maximum``.
    """
    return explicit([maximum])


def exact() -> Policy:
    """No padding: the bound is the size (one compile per size, like ``jax.jit``;
    no headroom)."""
    return Policy(lambda n: max(n, 1), "exact()")


def as_policy(buckets) -> Callable[[int], int]:
    """A callable ``size -> bound`` from a policy spec (see the module doc).

    Accepts None (``pow2()``), a ``Policy`` or any callable, ``"pow2"`` /
    ``"exact"``, an int (``fixed``) or a list of bounds (``explicit``).

    Raises:
      ValueError: an unknown policy name.
      TypeError: any other kind of spec.
    """
    if buckets is None:
        return pow2()
    if isinstance(buckets, Policy) or callable(buckets):
        return buckets
    if isinstance(buckets, str):
        if buckets == "pow2":
            return pow2()
        if buckets == "exact":
            return exact()
        raise ValueError(f"unknown bucket policy {buckets!r} (use 'pow2', 'exact' or a "
                         "polymask.buckets policy)")
    if isinstance(buckets, bool):
        raise TypeError("buckets must be a policy, not a bool")
    if isinstance(buckets, int):
        return fixed(buckets)
    if isinstance(buckets, (list, tuple)):
        return explicit(buckets)
    raise TypeError(f"cannot make a bucket policy from {buckets!r}")
