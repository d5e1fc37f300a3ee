"""The arguments ``shape_formula`` and ``explain`` trace: example arrays, ``Masked``
values, ``ShapeDtypeStruct``s or bare padded shapes, made abstract."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as compat
from ..core.masked import Masked
from ..tracing.transform import MaskedFunction

__all__ = ["is_masked", "is_shape_tuple", "abstractify", "dim_str", "is_spec_tree",
           "what_to_trace"]


def is_masked(x) -> bool:
    return isinstance(x, Masked)


def is_shape_tuple(x) -> bool:
    return (isinstance(x, (tuple, list)) and
            all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in x))


def is_spec_tree(x) -> bool:
    """Whether ``x`` can be ``in_specs``: its leaves are spec strings (None
    is no leaf); an array or a shape tuple of ints is an example argument
    (so is ``()`` followed by more arguments: a 0-d padded shape)."""
    return all(isinstance(leaf, str) for leaf in jax.tree_util.tree_leaves(x))


def what_to_trace(fun, in_specs, args, constraints):
    """``(fun, in_specs, args, constraints)`` that ``explain`` and
    ``shape_formula`` trace. A ``polymask.mask``-ed function is its own
    function with its specs and constraints (tracing the masked function
    would mask it twice, every size its own case); an argument in the spec
    slot that is no spec is the first example argument (``explain(f, x)``:
    default specs, as ``mask(f)`` takes them)."""
    if not callable(fun):
        raise TypeError(f"explain and shape_formula take a function, a polymask.mask-ed "
                        f"function or a runner; got {type(fun).__name__} {_short(fun)}")
    if in_specs is not None and (not is_spec_tree(in_specs) or (in_specs == () and args)):
        args, in_specs = (in_specs, *args), None
    if isinstance(fun, MaskedFunction):
        in_specs = fun.in_specs if in_specs is None else in_specs
        constraints = constraints or fun.constraints
        fun = fun.fun
    return fun, in_specs, tuple(args), constraints


def _short(x, limit: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + " ..."


def abstractify(args, in_specs, dtype):
    """Replace data by ``ShapeDtypeStruct``s; bare shape tuples become padded inputs.

    Example arrays are kept abstract (nothing is computed). With
    ``in_specs=None`` every axis of every input is dynamic (its own dim var),
    so the formulas are in terms of all input sizes.
    """
    def one(x):
        if is_masked(x):
            return Masked(jax.ShapeDtypeStruct(np.shape(x.data), x.data.dtype), x.shape)
        if is_shape_tuple(x):
            sds = jax.ShapeDtypeStruct(tuple(int(d) for d in x), dtype)
            return Masked(sds) if in_specs is None else sds
        if isinstance(x, jax.ShapeDtypeStruct) or hasattr(x, "shape"):
            sds = jax.ShapeDtypeStruct(tuple(np.shape(x)), x.dtype)
            return Masked(sds) if in_specs is None else sds
        if isinstance(x, (bool, int, float, complex)):  # weakly typed, as jax.jit takes it
            return jax.ShapeDtypeStruct((), jnp.result_type(x), weak_type=True)
        return x

    return tuple(jax.tree_util.tree_map(one, a, is_leaf=lambda v: is_masked(v) or
                                        is_shape_tuple(v)) for a in args)


def dim_str(d) -> str:
    return str(d) if compat.is_dim_expr(d) else str(int(d))
