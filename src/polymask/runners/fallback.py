"""The per-shape fallback: run a function under plain ``jax.jit`` on its exact
arrays where its masked trace cannot share one program across a bucket's sizes.

polymask's promise is "never worse than ``jax.jit``" (issue #36): a function
that ``jax.jit`` runs on the exact arrays, the runners run with the same
values. Sharing a compiled program across sizes is the gain, never a
precondition. When a bucket's masked trace fails (a size needed as a Python
value past the per-size limit, a primitive without a masking rule, sizes JAX
cannot prove equal, a library's own error under symbolic sizes), the runner
records why, warns once (``FallbackWarning``), and from then on runs the
sizes of that bucket here: one ``jax.jit`` compile per distinct exact shape,
exactly what ``jax.jit`` does. Where plain ``jax.jit`` fails too, the call
raises ``ShapeError`` with plain JAX's reason (the masked refusal was not
polymask's to make).

``ExactFallback`` is held by ``polymask.jit`` (``polyjit.py``), ``ragged_map``'s
padded layout (``ragged.py``, per example) and ``value_and_grad``
(``training.py``, per example).
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

from .. import _jax_compat as compat
from ..core.diagnostics import refusal_line, size_names_legend, user_stacklevel
from ..core.errors import FailsAsPlainJax, FallbackWarning, ShapeError, SpecError, typed_as
from ..core.shapes import native_byte_order
from ..tracing.cases.refine import TRACE_NOTE
from ..tracing.cases.tree import ONE_OUTPUT_REMEDY_START, per_size_cause
from .compiling import compile_counter

__all__ = ["ExactFallback", "refusal_text", "falls_back", "bucket_text"]

_MAX_REASON = 1500  # characters of a refusal kept (a TooManyCases lists sizes)
_MAX_SEEN = 1 << 16  # exact shapes remembered as compiled (then forgotten, recounted)


def bucket_text(buckets: dict | None) -> str:
    """A bucket as the messages and ``.fallbacks()`` name it: ``"n <= 64, m <= 8"``."""
    return ", ".join(f"{v} <= {b}" for v, b in (buckets or {}).items()) or "(static)"


def falls_back(error: BaseException) -> bool:
    """Whether a bucket program's failure sends its sizes to the per-shape
    fallback: a failure of the masked trace, yes; not where the function fails
    at every size as plain JAX does (``FailsAsPlainJax``), nor for a mistake
    in the specs or constraints themselves (``SpecError``: no exact shape
    would make them right), nor XLA's own compile or run-time errors (a bad
    compiler option, out of memory, a host callback that raised:
    ``compat.is_runtime_error``)."""
    return (isinstance(error, Exception) and not isinstance(error, (FailsAsPlainJax, SpecError))
            and not compat.is_runtime_error(error))


_SHARE_ONE_OUTPUT = ("\n  Outputs of one rank, dtype and structure at every size share the "
                     "program: name the axis where a rank changes (y.squeeze(-1) or y[..., 0] "
                     "for y.squeeze()).")


def refusal_text(error: BaseException) -> str:
    """One refusal, as its message says it (type name for non-polymask errors)."""
    text = str(error).strip() or type(error).__name__
    # (mask's remedy for outputs that differ by size: the runner does what it
    # says; what shares the program again instead)
    head, remedy, _ = text.partition(ONE_OUTPUT_REMEDY_START)
    if remedy:
        text = head + _SHARE_ONE_OUTPUT
    if not isinstance(error, (ShapeError, NotImplementedError)):
        text = f"{type(error).__name__}: {text}"
    # a library's error of the symbolic trace: polymask's note says why and what to do
    text += "".join(f"\n{n}" for n in getattr(error, "__notes__", ()) if n.startswith(TRACE_NOTE))
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON] + " ..."


class ExactFallback:
    """``fun`` under one ``jax.jit`` (JAX caches its programs per exact shape),
    the refusals that sent calls here, and the counts.

    ``runner``: how messages name the runner (``"polymask.jit(f)"``);
    ``add_stats(**counts)``: the runner's stats counter (``exact_compiles``,
    ``xla_compiles``, ``persistent_cache_hits``); ``counted_in``: where the
    warning says the user finds that count.
    """

    def __init__(self, fun: Callable, runner: str, add_stats: Callable[..., None],
                 compiler_options: dict | None = None,
                 counted_in: str = "stats()['exact_compiles']", hint: str = ""):
        self.runner = runner
        self.counted_in = counted_in
        self.hint = hint  # said after the reason (the runner's own remedy)
        self._add = add_stats
        self._jit = jax.jit(fun, compiler_options=compiler_options or None)
        self._lock = threading.Lock()
        self._reasons: dict[str, str] = {}
        self._seen: set = set()
        self._warned = False
        self._pending: tuple[str, str] | None = None  # a refusal not warned yet

    # -- refusals ------------------------------------------------------------------
    def refused(self, where: str, error: BaseException,
                axes: Mapping[str, str] | None = None) -> str:
        """Record that the bucket described by ``where`` (``"n <= 16"``) cannot
        share a program because of ``error``. The runner's first refusal is
        warned once a call has run per shape (``warn_pending``; ``call`` does
        it). ``axes``: the dim vars the runner named itself (no in_specs:
        ``s0`` -> ``"args[0].shape[0]"``), explained in the reason. Returns
        the reason."""
        reason = _with_legend(refusal_text(error), where, axes)
        with self._lock:
            self._reasons.setdefault(where, reason)
            if not self._warned and self._pending is None:
                self._pending = (where, reason)
        return reason

    def warn_pending(self) -> None:
        """Warn of the first refusal, once a call ran per shape (a call that
        fails as in plain JAX gets its ShapeError, no warning)."""
        with self._lock:
            pending = self._pending
            if pending is None or self._warned:
                return
        where, reason = pending
        # where warnings are errors this raises, and so does every later call
        # that meets it: the flag is set only once the warning went out
        warnings.warn(FallbackWarning(
            f"{self.runner}: the sizes {where} do not share one compiled program: each "
            f"exact shape there compiles its own, as jax.jit does (counted in "
            f"{self.counted_in}; .fallbacks() lists every bucket and reason). "
            f"Why:\n{reason}{self.hint}"), stacklevel=user_stacklevel())
        with self._lock:
            self._warned, self._pending = True, None

    def made_static(self, axes: str, error: BaseException,
                    names: Mapping[str, str] | None = None) -> None:
        """Record and warn (once per ``axes``) that the runner made these input
        axes static (``"args[0].shape[0]"``) because the function needs their
        sizes as Python values (``np.arange(x.shape[0])``): one program per
        size of them, as jax.jit, counted in ``stats()['compiles']``. ``names``:
        the dim vars the error names them by (explained in the reason)."""
        where = f"{axes} (static)"
        reason = _with_legend(per_size_cause(refusal_text(error)), "", names)
        with self._lock:
            if where in self._reasons:
                return
            self._reasons[where] = reason
        warnings.warn(FallbackWarning(
            f"{self.runner}: the function needs the size of {axes} as a Python value, so "
            "that axis is static: each size of it compiles its own program, as jax.jit "
            "does (counted in stats()['compiles']; .fallbacks() lists it). Why:\n"
            f"{reason}"), stacklevel=user_stacklevel())

    def fallbacks(self) -> dict[str, str]:
        """``{bucket: reason}`` of every bucket that runs per exact shape."""
        with self._lock:
            return dict(self._reasons)

    # -- calls ---------------------------------------------------------------------
    def seen(self, shape_key: Any) -> bool:
        """Whether ``shape_key``'s program is compiled (a call compiles nothing)."""
        return shape_key in self._seen

    def call(self, shape_key: Any, args: tuple, reason: str | None = None,
             kwargs: dict | None = None):
        """``jax.jit(fun)(*args)``: a new ``shape_key`` (the exact shapes and
        dtypes) counts one exact compile.

        Raises:
          ShapeError: plain ``jax.jit`` fails on these exact arrays too (its
            error chained); ``reason`` (the masked refusal) is added to the message.
        """
        args, kwargs = native_byte_order((args, kwargs or {}))
        if shape_key in self._seen:
            if self._pending is not None:
                self.warn_pending()
            return self._jit(*args, **kwargs)
        with compile_counter() as cc:
            try:
                out = self._jit(*args, **kwargs)
                jax.block_until_ready(out)
            except Exception as plain:  # noqa: BLE001 - plain JAX's own failure, reworded
                raise self.plain_failure(plain, reason) from plain
        with self._lock:
            if len(self._seen) >= _MAX_SEEN:
                self._seen.clear()
            new = shape_key not in self._seen  # threads racing on one shape count once
            self._seen.add(shape_key)
        self._add(exact_compiles=int(new), xla_compiles=cc.compiles,
                  persistent_cache_hits=cc.cache_hits)
        self.warn_pending()
        return out

    def plain_failure(self, plain: BaseException, reason: str | None = None) -> ShapeError:
        """The ``ShapeError`` of a function that plain JAX cannot run on these
        exact arrays either."""
        if reason is not None and getattr(plain, "polymask_needs_mask", False):
            # a polymask data-dependent op runs only in the masked trace: its
            # refusal is the cause, plain jax.jit of the function cannot help
            return ShapeError(f"{self.runner} cannot run these arrays: its masked trace "
                              f"stopped: {reason}\n  (plain jax.jit, the per-shape fallback, "
                              f"cannot run it either: {str(plain).splitlines()[0]})")
        remedy = _data_dependent_remedy(reason)
        if remedy is not None:  # (jnp.nonzero without size=: no size can share, nor run)
            return typed_as(ShapeError(
                f"{self.runner} fails on these exact arrays, as plain jax.jit does: "
                f"{remedy}\n  JAX said: {type(plain).__name__}: "
                f"{str(plain).strip().splitlines()[0]}"), type(plain))
        msg = (f"{self.runner} fails on these exact arrays, as plain jax.jit does: "
               f"{type(plain).__name__}: {str(plain).strip()}")
        if reason is not None and not _same_error(reason, plain):
            # its first line only: its remedies (equal sizes named alike, max_cases)
            # are for what the masked trace could not share, and plain JAX fails here
            msg += "\n(polymask's masked trace had stopped first: " + refusal_line(reason) + ")"
        return typed_as(ShapeError(msg), type(plain))


_DATA_DEPENDENT_REMEDY = re.compile(
    r"((?:jnp\.\w+|a slice with traced bounds) has a data-dependent (?:output )?size "
    r"\(at [^\n]*?\); under polymask\.mask, polymask\.jit or ragged_map use .*? instead)")


def _data_dependent_remedy(reason: str | None) -> str | None:
    """The masked trace's "use polymask.nonzero(x) instead" where the function
    calls a jnp op whose output size depends on the values (under jax.jit too)."""
    m = _DATA_DEPENDENT_REMEDY.search(reason or "")
    return None if m is None else m.group(1)


def _with_legend(reason: str, where: str, names: Mapping[str, str] | None) -> str:
    """``reason`` with a line explaining the dim vars the runner named itself
    that it or ``where`` uses (``s0 = args[0].shape[0]``: ``size_names_legend``)."""
    legend = size_names_legend(f"{where}\n{reason}", names or {})
    return f"{reason}\n{legend}" if legend else reason


def _same_error(reason: str, plain: BaseException) -> bool:
    """Whether the masked trace's refusal is plain JAX's own error (the trace
    had nothing symbolic where it failed): saying it twice adds nothing."""
    first = reason.splitlines()[0] if reason else ""
    return first.endswith(str(plain).strip().splitlines()[0]) if str(plain).strip() else False
