"""The prologue: the dim vars' logical values and every check on logical sizes.

``solve_dim_vars`` reads each dim var's logical value off the input sizes
(``plan.solve_sizes``) and lists the checks: sizes in ``[0, bound]``, equal
sizes for equal names, affine axes and constraints. The values returned are
those of the program's internal dim vars (``MaskedProgram.internal_values``).

Checks run in Python (raising ``ShapeError`` at once) when sizes are concrete.
When sizes are traced (inside ``jax.jit`` or ``jax.vmap``) each check becomes a
predicate; a failing predicate raises the same ``ShapeError`` text through a
host callback guarded by ``lax.cond``, so the callback only runs on failure and
the error surfaces at the result (as ``JaxRuntimeError`` wrapping our message),
never as a wrong result. The user's call site is recorded while tracing, as the
seed proposal asks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_compat as compat
from ..core.diagnostics import at_this_call, user_call_site
from ..core.dimvars import display_internal_names
from ..core.errors import ShapeError, counted, plain_type_of, typed_as
from ..core.masked import Masked, ragged_batch_hint
from ..core.plan import not_affine, solve_sizes
from ..core.shapes import DimEnv, is_static
from ..core.trace_state import replaced, trace_state


@dataclasses.dataclass
class Check:
    """One prologue check.

    ``message`` may hold ``{0}``, ``{1}``... placeholders for ``values`` (sizes
    that can be traced): they are filled in with the concrete values, at run
    time inside ``jit``, so the error names the actual sizes. Without
    ``values`` the message is used as is.
    """

    bad: Any  # bool or bool array (True = violated)
    message: str
    values: tuple = ()
    error_type: type | None = None  # plain JAX's exception there (``errors.typed_as``)
    error_class: type = ShapeError  # TooManyCases: polymask's limit, not the function's


def concrete_value(x):
    """NumPy value of ``x`` or None when ``x`` is traced."""
    if compat.is_tracer(x):
        return None
    try:
        return np.asarray(x)
    except Exception:
        return None


def _render(v) -> str:
    a = concrete_value(v)
    if a is None:
        return "<traced>"
    return str(a.tolist())


def format_message(message: str, values, rendered=None) -> str:
    if not values:
        return message
    rendered = [_render(v) for v in values] if rendered is None else rendered
    try:
        return message.format(*rendered)
    except (IndexError, KeyError, ValueError):
        return message


def functional_checks():
    """Collect traced checks as predicates instead of staging host callbacks.

    For ``mask(..., checks="functional")``: programs without host callbacks
    (``jax.export`` can serialize them); the caller poisons the outputs with
    the collected predicates (``transform.poison_outputs``).
    """
    return replaced("functional_checks", [])


def poison_outputs(outs: list, bads: list) -> list:
    """``checks="functional"``: when a traced check fails, every dynamic output
    size becomes -1 (``Masked.unpad`` and the next ``mask`` call reject it with
    a ShapeError) and float data becomes NaN."""
    if not bads:
        return outs
    bad = jnp.any(jnp.stack([jnp.asarray(b) for b in bads]))
    out = []
    for o in outs:
        data = o.data if isinstance(o, Masked) else o
        if jnp.issubdtype(jnp.result_type(data), jnp.inexact):
            data = jnp.where(bad, jnp.nan, data)
        if isinstance(o, Masked):
            sizes = tuple(s if is_static(s) else jnp.where(bad, jnp.int32(-1), s)
                          for s in o.shape)
            out.append(Masked(data, sizes))
        else:
            out.append(data)
    return out


def run_checks(checks: list[Check], call_site: str) -> None:
    """Raise eagerly for concrete violations; stage runtime errors otherwise."""
    staged = []
    compat.quiet_callback_errors(ShapeError)
    for c in checks:
        v = concrete_value(c.bad)
        if v is not None:
            if bool(np.any(v)):
                raise typed_as(c.error_class(f"{format_message(c.message, c.values)}\n"
                                             f"  in the masked call at {call_site}"),
                               c.error_type)
        else:
            staged.append(c)
    bads = trace_state().functional_checks
    if staged and bads is not None:
        bads.extend(jnp.any(jnp.asarray(c.bad)) for c in staged)
    elif staged:
        _stage_runtime_errors(staged, call_site)


def _stage_runtime_errors(checks: list[Check], call_site: str) -> None:
    """One ``lax.cond`` + host callback for all traced checks.

    The callback gets every check's predicate and values, and raises the
    ``ShapeError`` of the first violated check with the actual sizes (under
    ``vmap``, of the first failing batch element).
    """
    templates = [(c.message, len(c.values), c.error_type, c.error_class) for c in checks]

    def _raise(bads, values):
        it = iter(values)
        for (message, n, error_type, error_class), b in zip(templates, bads):
            vals = [np.asarray(next(it)) for _ in range(n)]
            b = np.asarray(b)
            if not np.any(b):
                continue
            where = ""
            if b.ndim:
                idx = tuple(int(i[0]) for i in np.nonzero(b))
                vals = [v[idx] if v.shape == b.shape else v for v in vals]
                where = f" (batch element {idx[0] if len(idx) == 1 else idx})"
            text = format_message(message, vals, [str(v.tolist()) for v in vals])
            raise _raised_in_callback(typed_as(
                error_class(f"{text}{where}\n  in the masked call at {call_site}"), error_type))

    @jax.custom_batching.custom_vmap
    def check(bads, values):
        any_bad = functools.reduce(jnp.logical_or, [jnp.any(b) for b in bads])
        # inside shard_map each device checks its own shard: a callback of the
        # whole operands gathers them first, a collective that the devices
        # whose check passed never join (a deadlock)
        partitioned = bool(compat.varying_axes((bads, values)))
        lax.cond(any_bad, lambda: jax.debug.callback(_raise, bads, values,
                                                     partitioned=partitioned),
                 lambda: None)
        return any_bad

    @check.def_vmap
    def _check_whole_batch(axis_size, in_batched, bads, values):
        # Check the whole ragged batch in one callback instead of letting
        # vmap slice the callback per example (which fails on sharded batch
        # axes); the reduction over the batch is an ordinary collective.
        if all(concrete_value(x) is not None for x in [*bads, *values]):
            _raise(bads, values)  # eager vmap: raise the ShapeError itself
            # else nothing failed, and nothing to stage: a fresh callback each
            # call would make eager vmap compile a cond per call (10 ms)
            return jnp.zeros((), bool), False
        return check(bads, values), False

    check([jnp.asarray(c.bad) for c in checks],
          [jnp.asarray(v) for c in checks for v in c.values])


# ----------------------------------------------------------------------------
# ShapeErrors raised in host callbacks, re-raised on the host (shape_errors)
# ----------------------------------------------------------------------------
# Under a user's own jax.jit a failed check raises in a host callback, and
# jaxlib reports it as ``JaxRuntimeError: INTERNAL: CpuCallback error calling
# callback: Traceback ...`` with our text at the end, on every supported JAX
# (0.10.2 .. 0.12: the prefix and the Python stack are written by jaxlib's
# C++; the exception's own traceback cannot shorten them). The errors raised
# there are remembered, so ``shape_errors`` can raise the ShapeError itself.
_CALLBACK_ERRORS: collections.deque = collections.deque(maxlen=16)


def _raised_in_callback(err: ShapeError) -> ShapeError:
    _CALLBACK_ERRORS.append(err)
    return err


def shape_error_of(exc: BaseException) -> ShapeError | None:
    """The polymask ``ShapeError`` that a ``JaxRuntimeError`` from a host
    callback carries (None for any other error)."""
    if isinstance(exc, ShapeError):
        return exc
    text = str(exc)
    for err in reversed(_CALLBACK_ERRORS):
        if str(err) in text:
            return err
    return None


def raise_run_failure(e: Exception) -> None:
    """Raise a failure of a compiled program while it ran
    (``compat.is_runtime_error``) as the user reads it: a size check that
    failed inside the program (a host callback: ``x`` split into pairs at an
    odd length) as its ``ShapeError``, not JAX's ``CpuCallback error`` wall of
    frames; any other as ``jax.jit``'s ``JaxRuntimeError`` (jaxlib reports
    some as a plain ``ValueError``). Returns for an error raised before the
    program ran (a failed trace)."""
    if not compat.is_runtime_error(e):
        return
    err = shape_error_of(e)
    if err is not None:
        new = at_this_call(err, user_call_site())  # (not the call it was traced at)
        new.jax_error = e  # JAX's JaxRuntimeError, kept for inspection
        raise new from None
    raise compat.as_jax_runtime_error(e) from None


class shape_errors(contextlib.ContextDecorator):
    """Raise polymask's ``ShapeError`` itself from compiled code.

    Under your own ``jax.jit`` a failed size check (sizes out of range,
    different sizes for one dim var, a constraint) cannot raise in Python:
    it raises in a host callback, and JAX reports
    ``JaxRuntimeError: INTERNAL: CpuCallback error calling callback:
    Traceback ...`` with the ``ShapeError`` text at its end. Inside this
    context (or a function decorated with it) such an error is re-raised as
    the ``ShapeError``, so its message is the first thing you read and
    ``except polymask.ShapeError`` catches it::

        step = jax.jit(polymask.mask(f, "n"))
        with polymask.shape_errors():
            out = step(x).data.block_until_ready()

    The ``ShapeError``'s ``jax_error`` attribute holds JAX's error. Any
    other exception passes through unchanged. ``polymask.jit`` and
    ``ragged_map`` check sizes on the host and raise ``ShapeError`` directly;
    eager ``mask`` calls and eager ``jax.vmap`` do too.
    """

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, ShapeError):
            return False
        err = shape_error_of(exc)
        if err is None:
            return False
        new = typed_as(type(err)(str(err)), plain_type_of(err))  # its type(s) kept
        new.jax_error = exc  # JAX's JaxRuntimeError, kept for inspection
        raise new from None  # JAX's wall of callback frames says nothing more


# ----------------------------------------------------------------------------
# Dim var values and the checks on them
# ----------------------------------------------------------------------------
def _leaf_sizes(leaf) -> tuple:
    if isinstance(leaf, Masked):
        return leaf.shape
    return tuple(int(d) for d in np.shape(leaf))


def _leaf_data(leaf):
    return leaf.data if isinstance(leaf, Masked) else leaf


def _validate_size_type(size, where: str, sizes=(), data_shape=()) -> None:
    if isinstance(size, bool) or isinstance(size, (float, complex)):
        raise ShapeError(f"{where}: logical size {size!r} must be an integer")
    if is_static(size):
        return
    dtype = getattr(size, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ShapeError(f"{where}: logical size must be an integer scalar; got "
                         f"{_described(size, dtype)} (cast it: jnp.int32(n), n.astype(int))")
    if np.ndim(size) != 0:
        raise ShapeError(
            f"{where}: logical size must be a scalar; got shape {np.shape(size)}"
            f"{ragged_batch_hint(sizes, data_shape)}")


def _described(size, dtype) -> str:
    """A size's description without a tracer's repr (``JitTracer(~float32[])``
    names JAX's internals, not the user's value)."""
    if compat.is_tracer(size):
        return f"a traced {dtype} value of shape {np.shape(size)}"
    return f"{size!r} of dtype {dtype}"


def _host_int(x) -> int | None:
    """``x`` as a Python int when it is known on the host: a Python or NumPy
    integer, or a concrete scalar array (an eager ``jnp.int32`` size: read
    once, rather than compared by dispatched operations); None when traced."""
    if is_static(x):
        return int(x)
    if compat.is_tracer(x) or np.ndim(x) != 0:
        return None
    return int(np.asarray(x))


def _out_of_range(size, bound):
    s = _host_int(size)
    if s is not None:
        return not (0 <= s <= bound)
    return (size < 0) | (size > bound)


def _ne(a, b):
    ha, hb = _host_int(a), _host_int(b)
    if ha is not None and hb is not None:
        return ha != hb
    return jnp.asarray(a) != jnp.asarray(b)


def _lt(a, b):
    ha, hb = _host_int(a), _host_int(b)
    if ha is not None and hb is not None:
        return ha < hb
    return jnp.asarray(a) < jnp.asarray(b)


def _axis_checks(leaves, prog, checks_on: bool) -> tuple[list[Check], list[list]]:
    """Range and static-size checks of every input axis; returns them and the sizes."""
    checks: list[Check] = []
    all_sizes = []
    for leaf, axes in zip(leaves, prog.axis_specs):
        sizes = _leaf_sizes(leaf)
        data = _leaf_data(leaf)
        if len(sizes) != len(axes):
            shown = tuple(int(s) if is_static(s) else s for s in sizes)
            raise ShapeError(f"{axes[0].path if axes else 'argument'}: logical shape "
                             f"{shown} has {counted(len(sizes), 'size')} but the data has rank "
                             f"{len(axes)} (shape {np.shape(data)}){ragged_batch_hint(sizes, np.shape(data))}")
        for a, size in zip(axes, sizes):
            _validate_size_type(size, a.where, sizes, np.shape(data))
            bound = np.shape(data)[a.axis]
            if checks_on or is_static(size):
                named = f"{a.where} (dim var '{a.var}')" if a.var else a.where
                checks.append(Check(_out_of_range(size, bound),
                                    f"{named}: logical size {{0}} is outside "
                                    f"[0, {bound}] (the bound of that axis)", (size,)))
            if a.var is None and not (is_static(size) and int(size) == int(a.expr)):
                checks.append(Check(_ne(size, a.expr),
                                    f"{a.where}: static axis of size {a.expr} got logical "
                                    "size {0}", (size,)))
        all_sizes.append(sizes)
    return checks, all_sizes


def _solution_checks(sol) -> list[Check]:
    checks = []
    for a, size in sol.affine:
        checks.append(Check(not_affine(size, a),
                            f"{a.where}: logical size {{0}} is not of the form "
                            f"{display_internal_names(str(a.expr))} for an integer "
                            f"{a.var} >= 0", (size,)))
    for var, prev, prev_where, value, where in sol.conflicts:
        checks.append(Check(_ne(prev, value),
                            f"dim var '{var}' has different logical values: "
                            f"{{0}} at {prev_where} and {{1}} at {where}", (prev, value)))
    return checks


def constraint_checks(prog, values) -> list[Check]:
    """The user's constraints, checked on the spec dim vars' logical values
    (ints or traced); ``prog`` has ``user_scope`` and ``var_bounds``."""
    checks = []
    env = DimEnv(prog.user_scope, prog.var_bounds, values)
    for kind, e1, e2, text in compat.explicit_constraints(prog.user_scope):
        names = compat.dim_vars(e1) | compat.dim_vars(e2)
        if not names <= set(values):
            continue
        names = sorted(names)
        v1, v2 = env.logical_raw(e1), env.logical_raw(e2)
        bad = _ne(v1, v2) if kind == "==" else _lt(v1, v2)
        checks.append(Check(bad, f"constraint '{text}' does not hold for "
                                 + ", ".join(f"{k}={{{i}}}{_read_from(prog, k)}"
                                             for i, k in enumerate(names)),
                            tuple(values[k] for k in names)))
    return checks


def _read_from(prog, var: str) -> str:
    """`` (args[1].shape[0])``: the first input axis that dim var ``var`` sizes."""
    for axes in getattr(prog, "axis_specs", ()):
        for a in axes:
            if a.var == var:
                return f" ({a.where})"
    return ""


def solve_dim_vars(prog, leaves, checks_on: bool) -> tuple[dict[str, Any], list[Check]]:
    """Logical values of the dim vars from the input sizes, plus the prologue checks.

    With ``checks_on=False`` only the checks decidable in Python are kept.

    Raises:
      ShapeError: a logical shape of the wrong rank or a size that is not an
        integer scalar (the rest are ``Check``s for ``run_checks``).
    """
    checks, sizes = _axis_checks(leaves, prog, checks_on)
    sol = solve_sizes(prog.axis_specs, sizes)
    checks += _solution_checks(sol)
    checks += constraint_checks(prog, sol.values)
    if not checks_on:
        checks = [c for c in checks if concrete_value(c.bad) is not None]
    return prog.internal_values(sol.values), checks
