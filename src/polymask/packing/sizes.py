"""Sizes along the ragged axis in the packed layout: ``n + c``, a constant, or neither.

``RaggedSizes`` says what each symbolic size of a traced program is for the
packed interpreter (a packed axis of size ``n + c``, a constant-length axis,
or a size no packed rule serves); ``check_sizes`` walks a program before
anything runs, refuses sizes of neither form (naming the innermost
primitive and the user's line) and returns the gap the rows need
(``segments.py``).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from .. import _jax_compat as compat
from ..core.errors import ShapeError
from ..tracing.registry import substitute_dims
from .registry import PackedUnsupported, packed_halo

if TYPE_CHECKING:
    from ..tracing.symbolic import MaskedProgram

__all__ = ["RaggedSizes", "check_sizes", "not_n", "param_dims"]


def param_dims(params) -> list:
    found = []
    substitute_dims(dict(params), lambda d: found.append(d) or d)
    return found


def check_sizes(jaxpr, allowed: set, prog, sizes: RaggedSizes, outer=(), line=None) -> int:
    """Every size along a ragged axis must be ``n + c`` for a constant ``c``
    (checked before anything runs, so ``layout="auto"`` says why it pads):
    sizes of data-dependent dim vars (``nonzero``, boolean masks) differ per
    example inside a row, and sizes like ``2 * n`` or ``n // 2`` (strided
    slices and convolutions) have no packed rule. Inner jaxprs first: the
    innermost primitive is named.

    Returns the gap G the rows need: the largest ``c > 0`` and each windowed
    primitive's halo (``registry.register_packed_halo``)."""
    gap = 0
    for eqn in jaxpr.eqns:
        at = line or compat.source_line(eqn.source_info)  # the user's line: the outermost
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                gap = max(gap, check_sizes(inner, allowed, prog, sizes,
                                            (*outer, eqn.primitive.name), at))
        where = "".join(f" inside {o!r}" for o in reversed(outer))
        for v in eqn.outvars:
            for d in getattr(v.aval, "shape", ()):
                if not compat.is_dim_expr(d):
                    continue
                if not compat.dim_vars(d) <= allowed:
                    raise PackedUnsupported(
                        f"primitive '{eqn.primitive.name}'{where} (used at {at}) has a "
                        "data-dependent size (a count known only from the data), which "
                        "the packed layout cannot place in a row")
                form = sizes.form(d)
                if form is None:
                    raise PackedUnsupported(
                        f"primitive '{eqn.primitive.name}'{where} (used at {at}) cannot run "
                        f"packed: {not_n(prog, sizes.n, d)}")
                if form[0] == "n":
                    gap = max(gap, form[1])
        for d in param_dims(eqn.params):  # start indices a rule may read as constants
            sizes.form(d)  # (``mod(1, n)`` of ``jnp.roll``: 1, but not at n = 0 or 1)
        halo = packed_halo(eqn.primitive.name)
        if halo is not None:
            try:
                gap = max(gap, halo(eqn, sizes.offset))
            except (PackedUnsupported, ShapeError):
                raise
            except Exception as e:  # a window or padding of symbolic size (n - 1)
                raise PackedUnsupported(
                    f"primitive '{eqn.primitive.name}'{where} (used at {at}) cannot run "
                    f"packed: its window or padding along the ragged axis depends on the "
                    f"size ({type(e).__name__}: {prog.display(str(e).splitlines()[0])})"
                ) from e
    return gap


class RaggedSizes:
    """What each size along a ragged axis is in the packed layout: ``n + c``
    (packed, ``offset``) or a constant ``k`` (not packed, ``constant``).

    ``n - 1`` is ``n + c`` symbolically. ``jnp`` also stages sizes like
    ``max(0, n - 1)`` (``x[1:]``, empty at ``n = 0``) and ``min(n, 1)``
    (``x[:1]``): those are evaluated at every size the packed program
    serves; the form most sizes agree on is taken, and the sizes that
    disagree (``n = 0`` here) are ``irregular``: they run in the padded
    layout (``PackedProgram.runs``). A size with no common form (``2 * n``,
    ``n // 2``) has none.
    """

    def __init__(self, prog: MaskedProgram, var: str, sizes):
        self.prog, self.var = prog, var
        self.n = prog.spec_var_expr(var)
        self.sizes = sorted(int(s) for s in sizes)
        self.irregular: set[int] = set()
        self._table: dict[str, tuple[str, int] | None] = {}
        self._values: list | None = None

    def form(self, d) -> tuple[str, int] | None:
        """``("n", c)`` for ``n + c``, ``("const", k)`` for a constant, None."""
        if not compat.is_dim_expr(d):
            return ("const", int(d))
        c = _offset(d, self.n)
        if c is not None:
            return ("n", c)
        key = str(d)
        if key not in self._table:
            self._table[key] = self._common_form(d)
        return self._table[key]

    def offset(self, d) -> int | None:
        """``c`` when ``d`` is ``n + c``, else None."""
        f = self.form(d)
        return f[1] if f is not None and f[0] == "n" else None

    def constant(self, d) -> int | None:
        """``k`` when ``d`` is the constant ``k`` (at the sizes that run packed)."""
        f = self.form(d)
        return f[1] if f is not None and f[0] == "const" else None

    def _common_form(self, d) -> tuple[str, int] | None:
        if self._values is None:
            self._values = [(s, self.prog.internal_values({self.var: s})) for s in self.sizes]
        per = {}
        for s, values in self._values:
            try:
                per[s] = int(compat.evaluate_dim(d, values))
            except Exception:  # noqa: BLE001 - not defined at this size: irregular there
                continue
        if not per:
            return None
        ragged = collections.Counter(v - s for s, v in per.items()).most_common(1)[0]
        const = collections.Counter(per.values()).most_common(1)[0]
        kind, (value, count) = ("n", ragged) if ragged[1] >= const[1] else ("const", const)
        if count < 2 or 2 * count < len(self.sizes):
            return None
        at = (lambda s, v: v - s == value) if kind == "n" else (lambda s, v: v == value)
        self.irregular |= {s for s in self.sizes if s not in per or not at(s, per[s])}
        return (kind, value)


def _offset(d, n) -> int | None:
    """``c`` when ``d == n + c`` for a constant ``c``, else None."""
    try:
        c = d - n
    except Exception:  # noqa: BLE001 - not comparable: not n + c
        return None
    if compat.is_dim_expr(c):
        return None
    return int(c)


def not_n(prog, n, d) -> str:
    var = prog.display(str(n))
    c = next(k for k in ("c", "k", "j") if k != var)  # (a dim var named c: "c + k")
    return (f"the packed layout needs every size along the ragged axis to be "
            f"{var} + {c} for a constant {c} (or a constant); this program has "
            f"a size {prog.display(str(d))}")


