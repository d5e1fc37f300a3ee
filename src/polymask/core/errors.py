"""The exceptions polymask raises (locating and rewording them: ``diagnostics.py``)."""

from __future__ import annotations

__all__ = ["ShapeError", "UnsupportedError", "TooManyCases"]


class ShapeError(ValueError):
    """Bad logical sizes or shape specs.

    The message names the dimension variable, the offending values, the
    argument path (``args[1].shape[0]``) and the user's source line.
    """


class UnsupportedError(NotImplementedError):
    """A primitive or a case polymask has no masking rule for.

    The message names the primitive, the user's source line and where the
    coverage table lives (``docs/coverage.md``).
    """


class TooManyCases(ShapeError):
    """The trace needs more cases than ``max_cases``: size comparisons JAX
    cannot decide split it too often, or it takes a case per size (a size used
    as a Python int) and the bounds allow more than ``2 x max_cases`` sizes.

    ``reason``: the failure without the advice on ``max_cases`` (the packed
    layout, which needs one program for every size, gives its own)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = message if reason is None else reason
