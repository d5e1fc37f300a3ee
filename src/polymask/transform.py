"""``polymask.mask``: a function of exact arrays -> a function of padded arrays.

A call flattens its arguments, looks up (or traces, ``trace.py``) the masked
program of their padded signature, solves and checks the logical sizes
(``prologue.py``) and evaluates the program (``interpreter.py``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .cases import DEFAULT_MAX_CASES, CaseTree, run_cases, trace_cases
from .diagnostics import at_call_site, user_call_site
from .errors import ShapeError
from .interpreter import run_program
from .prologue import run_checks, solve_dim_vars
from .trace import MaskedProgram, dtype_of, flatten_args, is_masked

__all__ = ["mask", "MaskedFunction"]


def _signature(args, in_specs, constraints):
    """The cache key of a call: tree, padded shapes and dtypes, specs (None: uncacheable)."""
    leaves, tree = flatten_args(args)
    sig = []
    for leaf in leaves:
        if is_masked(leaf):
            sig.append(("M", tuple(np.shape(leaf.data)), str(dtype_of(leaf.data))))
        else:
            sig.append(("A", tuple(np.shape(leaf)), str(dtype_of(leaf)),
                        isinstance(leaf, (int, float, bool, complex))))
    try:
        spec_key = repr(in_specs)
        hash(spec_key)
    except Exception:
        return None
    return (tree, tuple(sig), spec_key, tuple(constraints))


class MaskedFunction:
    """The callable ``mask`` returns; ``.program(*args)`` gives its traced program."""

    def __init__(self, fun: Callable, in_specs, constraints: Sequence[str], checks: bool,
                 max_cases: int = DEFAULT_MAX_CASES):
        functools.update_wrapper(self, fun, updated=())  # name and doc only
        self.fun = fun
        self.in_specs = in_specs
        self.constraints = tuple(constraints)
        self.checks = checks
        self.max_cases = max_cases
        self._cache: dict[Any, CaseTree] = {}
        self._lock = threading.Lock()

    def cases(self, *args) -> tuple[CaseTree, list]:
        """The decision tree of masked programs for the padded signature of ``args``.

        Traced once per signature (once per case). Returns ``(tree, leaves)``;
        ``tree.cases`` lists the cases, ``tree.summary()`` describes them.
        """
        key = _signature(args, self.in_specs, self.constraints)
        with self._lock:
            tree = self._cache.get(key) if key is not None else None
        if tree is not None:
            return tree, flatten_args(args)[0]
        tree, leaves = trace_cases(self.fun, args, self.in_specs, self.constraints,
                                   self.max_cases)
        if key is not None:
            with self._lock:
                self._cache.setdefault(key, tree)
        return tree, leaves

    @property
    def programs(self) -> tuple[MaskedProgram, ...]:
        """The masked programs traced so far: one per padded signature (with case
        splits, the signature's first live case; ``cases`` gives them all)."""
        with self._lock:
            return tuple(t.base for t in self._cache.values())

    def program(self, *args) -> tuple[MaskedProgram, list]:
        """The masked program for the padded signature of ``args`` (traced once per signature).

        Returns ``(program, leaves)``; ``program.out_shapes`` are the symbolic
        output shapes. With case splits (``cases``) this is the first case's.
        """
        tree, leaves = self.cases(*args)
        return tree.base, leaves

    def __call__(self, *args):
        call_site = user_call_site()
        try:
            tree, leaves = self.cases(*args)
            prog = tree.base
            values, checks = solve_dim_vars(prog, leaves, self.checks)
        except ShapeError as e:
            raise at_call_site(e, call_site) from None
        run_checks(checks, call_site)
        if tree.single:
            outs = run_program(prog, leaves, values)
        else:
            outs = run_cases(tree, leaves, values, call_site, run_program)
        return jax.tree_util.tree_unflatten(prog.out_tree, outs)

    def __get__(self, obj, objtype=None):  # behave like a function as a class attribute
        return self if obj is None else functools.partial(self, obj)


def mask(fun: Callable, in_specs=None, *, constraints: Sequence[str] = (),
         checks: bool = True, max_cases: int = DEFAULT_MAX_CASES) -> MaskedFunction:
    """Transform ``fun`` (written for exact arrays) to run on padded arrays.

    Args:
      fun: a JAX-traceable function of arrays (pytrees allowed).
      in_specs: None (every axis of a ``Masked`` input gets its own dim var;
        plain arrays are unpadded and static), or one entry per positional
        argument: a ``jax.export.symbolic_shape`` spec string (``"b, n, 64"``,
        ``"_"`` = static, same name = equal sizes, ``"2*k"`` = affine), None,
        or a pytree of specs matching the argument.
      constraints: extra ``jax.export`` constraints (``"n >= 3"``), checked in
        the prologue and used while tracing.
      checks: run the prologue checks (sizes in ``[0, bound]``, equal sizes for
        equal names, constraints). Concrete sizes are always range-checked.
      max_cases: most cases (leaves of the decision tree) traced for the size
        comparisons JAX cannot decide (``if x.shape[0] > 2``, ``top_k``'s
        ``k <= n``, ...); each case is a masked program and the logical sizes
        choose one at run time (``lax.switch`` under ``jit``).

    Returns:
      ``masked_fun(*args)``: array leaves may be ``Masked`` (padded data plus
      logical shape) or plain arrays (unpadded). Returns ``fun``'s output
      pytree with each array leaf a ``Masked`` whose logical shape is the
      symbolic output shape evaluated at the logical sizes and whose padded
      shape is that expression's upper bound.

    Raises:
      ShapeError: bad spec, sizes out of range or inconsistent, a constraint
        violated, sizes for which ``fun`` itself fails (``top_k`` with
        ``k > n``), or more than ``max_cases`` cases. With
        concrete sizes it is raised at the call. Inside ``jax.jit`` (traced
        sizes) the same message is raised when the result is computed, wrapped
        by JAX as ``jax.errors.JaxRuntimeError`` (``polymask.jit`` checks sizes
        on the host and raises ``ShapeError`` itself).
      UnsupportedError: a primitive without a masking rule.

    Composes with ``jax.jit`` (one trace per padded signature: sizes are
    runtime data), ``jax.vmap`` (ragged batches) and ``jax.grad``.
    """
    return MaskedFunction(fun, in_specs, constraints, checks, max_cases)
