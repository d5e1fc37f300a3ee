"""Rule families: one constructor per kind of masking, one line per member.

In the style of ``jax/_src/interpreters/batching.py`` (``defvectorized``,
``defbroadcasting``, ``defreducer``) and ``ad.py`` (``deflinear2``): a family
member is registered by naming its primitive, e.g.
``defelementwise(lax.sin_p, lax.cos_p, module=__name__)`` or
``defreducer(lax.reduce_sum_p, kind="sum", module=__name__)``; the rule body
is shared. ``module``: the rule module that declares the members (the
coverage table and duplicate-registration errors name it; default this one).
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import _jax_compat as compat
from ..tracing.registry import register
from .util import (
    clean,
    fill_padding,
    identity_of,
    is_inexact,
    keep_last_complex_nan,
    keep_nan,
    masked_axes,
)

# primitive name -> (family, kind): what the packed layout (``packing/``) reads
# to give each family member its packed interpretation without a second list.
FAMILIES: dict[str, tuple[str, str | None]] = {}


def _note_family(prims, family: str, kind: str | None = None) -> None:
    for p in prims:
        FAMILIES[p if isinstance(p, str) else p.name] = (family, kind)


def family_of(name: str) -> tuple[str | None, str | None]:
    """``(family, kind)`` of a primitive registered through a family
    constructor here (``("reduction", "max")``), else ``(None, None)``."""
    return FAMILIES.get(name, (None, None))


def _declared_in(rule, module: str | None):
    """Attribute ``rule`` to the rule module that declares the family members
    (``rules/elementwise.py``, not this file): the coverage table
    (``tools/coverage.py``) and duplicate-registration errors name it."""
    if module is not None:
        rule.__module__ = module
    return rule


def defelementwise(*prims, zero_preserving: bool = False, module: str | None = None) -> None:
    """Elementwise primitives: bind on the padded operands unchanged.

    Logical positions only ever read logical positions; garbage in padding
    stays in padding. With ``zero_preserving`` (``f(0, ..., 0) == 0``
    exactly) zero padding in all full-shape operands is recorded as kept.
    """
    register(*prims)(_declared_in(_elementwise_rule(zero_preserving), module))
    _note_family(prims, "elementwise")


def _elementwise_rule(zero_preserving: bool):
    def elementwise_rule(ctx, *args, **params):
        args = _broadcast_operands(ctx, _at_out_bounds(ctx, args))
        out = ctx.bind(*args)
        if zero_preserving and _all_zero_padded(ctx, args, out):
            ctx.mark_zero_padding(out)
        return out

    return elementwise_rule


def _broadcast_operands(ctx, args):
    """Float operands that lax broadcasts implicitly onto padded axes (a
    scalar ``w`` in ``log(x) * w``, a ``(1, F)`` bias in ``x + b``: lax
    broadcasts rank 0 and size-1 axes) are broadcast explicitly with the
    padding of those axes zeroed, as ``broadcast_in_dim``'s rule does: such an
    operand's cotangent sums the op's cotangent over the broadcast axes, and at
    padding positions that is ``0 * inf = nan`` wherever the forward is
    infinite there (``log(0)``, a division by a count of 0)."""
    if ctx.state.forward_only or len(args) < 2:
        return args
    bounds, logical = ctx.out_bounds[0], ctx.out_logical[0]
    masked = masked_axes(logical, bounds) if bounds else []
    if not masked:
        return args
    out = []
    for a in args:
        axes = _implicitly_broadcast_axes(a, bounds, masked)
        if axes:
            zero = len(axes) == len(masked) or ctx.has_zero_padding(a)
            a = clean(jnp.broadcast_to(a, bounds), logical, axes)
            if zero:  # every padding position is on a cleaned axis, or was 0
                ctx.mark_zero_padding(a)
        out.append(a)
    return out


def _at_out_bounds(ctx, args):
    """Operands of the output's rank cut or zero-padded to the output's padded
    shape on the axes where theirs differs (size-1 axes broadcast as they are).

    JAX accepts operands whose sizes it proves equal, and two expressions of
    one size may have different bounds: in a case where ``n % 4 != 0``,
    alphafold3's ``4 * ((n - 1) // 4) + n % 4`` is ``n``, bounded by 7 where
    the input's ``n`` is padded to 8. Each bound holds for the case's logical
    size, so cutting to the smaller one keeps every logical entry."""
    bounds = ctx.out_bounds[0] if ctx.out_bounds else None
    if not bounds:
        return args
    out = []
    for a in args:
        shape = jnp.shape(a)
        if len(shape) == len(bounds) and shape != tuple(bounds):
            a = _fit(a, [b if s != 1 else 1 for s, b in zip(shape, bounds)])
        out.append(a)
    return out


def _fit(a, shape):
    """``a`` cut or zero-padded (at the end of each axis) to ``shape``."""
    cut = [min(s, b) for s, b in zip(jnp.shape(a), shape)]
    if cut != list(jnp.shape(a)):
        a = a[tuple(slice(0, c) for c in cut)]
    if cut != list(shape):
        a = jnp.pad(a, [(0, b - c) for c, b in zip(cut, shape)])
    return a


def _implicitly_broadcast_axes(a, bounds, masked) -> list[int]:
    """The padded axes ``a`` (a traced float operand) is broadcast along."""
    shape = jnp.shape(a)
    if shape == tuple(bounds) or not compat.is_tracer(a) or not is_inexact(jnp.result_type(a)):
        return []  # a constant (a literal 2.0) has no cotangent
    if not shape:
        return list(masked)
    return [ax for ax in masked if shape[ax] == 1 and bounds[ax] != 1]


def _all_zero_padded(ctx, args, out) -> bool:
    """Every operand is full-shape with zero padding, and the result is float."""
    return bool(args) and all(
        getattr(a, "shape", ()) == getattr(out, "shape", None) and ctx.has_zero_padding(a)
        for a in args) and jnp.issubdtype(out.dtype, jnp.inexact)


def defrelayout(*prims, module: str | None = None) -> None:
    """Ops that keep the logical corner a corner: bind with padded-size params.

    The padding moves with the corner, so zero padding of the first operand
    stays zero padding.
    """
    register(*prims)(_declared_in(_relayout_rule(), module))
    _note_family(prims, "relayout")


def _relayout_rule():
    def relayout_rule(ctx, *args, **params):
        out = ctx.bind(*args)
        if args and ctx.has_zero_padding(args[0]):
            ctx.mark_zero_padding(out)
        return out

    return relayout_rule


def defreducer(*prims, kind: str, module: str | None = None) -> None:
    """Reductions over ``axes`` (incl. ``argmax``/``argmin``): padding becomes
    the identity of ``kind`` before the physical reduction.

    For ``argmax``/``argmin`` the identity is the worst value, so the first
    logical extremum wins. A max or min runs its rule at the bound too
    (``keep_nan``): batched over examples (``vmap``, ``ragged_map``), a
    reduction of static size grows past the width where XLA:CPU drops a NaN.
    """
    register(*prims, at_bound=kind in ("max", "min"))(_declared_in(_reducer_rule(kind), module))
    _note_family(prims, "reduction", kind)


def _reducer_rule(kind: str):
    def reducer_rule(ctx, x, *, axes, **params):
        if not (kind in ("sum", "or", "xor") and ctx.has_zero_padding(x)):  # 0 is the identity
            x = fill_padding(x, ctx.in_logical[0], identity_of(x.dtype, kind), axes)
        out = ctx.bind(x)
        if kind in ("max", "min") and out.dtype == x.dtype:  # a value, not argmax's index
            out = keep_nan(out, x, lambda v: jnp.sum(v, axis=tuple(axes)))
            out = keep_last_complex_nan(out, x, ctx.in_logical[0], axes)
        return out

    return reducer_rule


def defcumulative(*prims, kind: str, module: str | None = None) -> None:
    """Cumulative scans along ``axis`` whose combiner has the identity of ``kind``.

    Forward scans are prefix-safe but their transpose (a reverse scan) reads
    the padding's cotangent, so float results get their padding selected to
    0. Reverse scans read the padding, so it is filled with the identity.
    """
    register(*prims)(_declared_in(_cumulative_rule(kind), module))
    _note_family(prims, "cumulative", kind)


def _cumulative_rule(kind: str):
    def cumulative_rule(ctx, x, *, axis, reverse):
        lg = ctx.in_logical[0]
        if not masked_axes(lg, ctx.in_bounds[0], [axis]):
            return ctx.bind(x)
        if reverse:
            return ctx.bind(fill_padding(x, lg, identity_of(x.dtype, kind), [axis]))
        out = ctx.bind(x)
        if not is_inexact(out.dtype):
            return out
        out = clean(out, lg, [axis])
        if kind == "sum" and ctx.has_zero_padding(x):
            ctx.mark_zero_padding(out)  # other axes' padding: a sum of zeros is 0
        return out

    return cumulative_rule
