"""``polymask.mask``: a function of exact arrays -> a function of padded arrays.

A call flattens its arguments, looks up (or traces, ``symbolic.py``, with case splits: ``cases/``) the masked
program of their padded signature, solves and checks the logical sizes
(``prologue.py``) and evaluates the program (``interpreter.py``).
"""

from __future__ import annotations

import collections
import functools
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .. import _jax_compat as compat
from ..core.binding import check_arity, check_function_first, split_specs
from ..core.buckets import int_arg
from ..core.diagnostics import (
    at_call_site,
    at_this_call,
    called,
    user_call_site,
    user_stacklevel,
    with_size_names,
)
from ..core.errors import FallbackWarning, ShapeError, TooManyCases
from ..core.masked import Masked
from ..core.shapes import native_byte_order
from ..core.specs import as_constraints, broadcast_specs, check_in_specs_type
from ..core.trace_state import masked_call, replaced, trace_state
from .cases.dispatch import run_cases
from .cases.splitting import DEFAULT_MAX_CASES, CaseTree, trace_cases
from .eager import run_cases_eagerly, run_program_eagerly, runs_eagerly
from .interpreter import run_program
from .prologue import functional_checks, poison_outputs, run_checks, solve_dim_vars
from .symbolic import MaskedProgram, arg_paths, dtype_of, flatten_args, is_masked, trace_flat
from .trace_warnings import say_case_warnings

__all__ = ["mask", "MaskedFunction", "is_array_leaf", "is_pytree_callee"]


_NUMBERS = (bool, int, float, complex)


def is_array_leaf(x) -> bool:
    """An input of the masked program: a ``Masked``, a JAX or NumPy array (or tracer)."""
    return isinstance(x, (Masked, jax.Array, np.ndarray, np.generic))


def is_pytree_callee(fun) -> bool:
    """True for a callable that is itself a pytree (an equinox or flax.nnx module,
    ``jax.tree_util.Partial``): its array leaves become unpadded inputs."""
    try:
        return not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(fun))
    except Exception:
        return False


def _leaf_sig(leaf):
    if is_masked(leaf):
        return ("M", tuple(np.shape(leaf.data)), str(dtype_of(leaf.data)),
                compat.is_weakly_typed(leaf.data))
    return ("A", tuple(np.shape(leaf)), str(dtype_of(leaf)),
            isinstance(leaf, (int, float, bool, complex)), compat.is_weakly_typed(leaf))


def _hashable(key):
    try:
        hash(key)
    except Exception:
        return None
    return key


class _Call:
    """One call bound to flat inputs: array leaves, their specs and paths, the
    static rest (part of the cache key) and how to rebuild ``fun(*args, **kwargs)``."""

    __slots__ = ("leaves", "specs", "paths", "static_key", "rebuild")


def _bind(fun, pytree_callee: bool, in_specs, args, kwargs) -> _Call:
    c = _Call()
    leaves: list = []
    specs: list = []
    paths: list = []
    static: list = []
    pos_specs, kw_specs = split_specs(fun, in_specs, len(args), kwargs)

    # the callee (a module): array leaves unpadded, the rest static
    if pytree_callee:
        c_flat, c_tree = jax.tree_util.tree_flatten_with_path(fun, is_leaf=is_masked)
        c_dyn = [is_array_leaf(x) for _, x in c_flat]
        for (p, x), d in zip(c_flat, c_dyn):
            if d:
                leaves.append(x)
                specs.append(None)
                paths.append("fun" + jax.tree_util.keystr(p))
        c_static = tuple(x for (_, x), d in zip(c_flat, c_dyn) if not d)
        static.append(("callee", c_tree, tuple(c_dyn), c_static))
    n_callee = len(leaves)

    # positional arguments: array and number leaves are inputs (a number is
    # traced weakly typed, as by jax.jit); the rest (a str mode) is static
    p_leaves, p_tree = flatten_args(args)
    if pos_specs is not None and not isinstance(pos_specs, str) and len(pos_specs) != len(args):
        check_arity(fun, args, kwargs)  # the call's fault, where fun's signature says so
    p_specs = broadcast_specs(pos_specs, list(args), is_masked)
    p_dyn = [is_array_leaf(x) or isinstance(x, _NUMBERS) for x in p_leaves]
    for x, sp, path, d in zip(p_leaves, p_specs, arg_paths(args), p_dyn):
        if d:
            leaves.append(x)
            specs.append(sp)
            paths.append(path)
        elif sp is not None:
            raise ShapeError(f"in_specs gives spec '{sp}' to a non-array value {x!r} at {path}")
    p_static = tuple(x for x, d in zip(p_leaves, p_dyn) if not d)
    static.append(("args", p_tree, tuple(p_dyn), p_static))

    # keyword arguments: array leaves are inputs; the rest is static
    kw_names = sorted(kwargs)
    kw_parts = []
    for name in kw_names:
        value = kwargs[name]
        flat, tree = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_masked)
        k_specs = broadcast_specs(
            (kw_specs.get(name),), [value], is_masked,
            labels=[(f"in_specs['{name}']", f"kwargs['{name}']")])
        dyn = [is_array_leaf(x) for _, x in flat]
        for (p, x), sp, d in zip(flat, k_specs, dyn):
            if d:
                leaves.append(x)
                specs.append(sp)
                paths.append(f"kwargs['{name}']" + jax.tree_util.keystr(p))
            elif sp is not None:
                raise ShapeError(f"in_specs['{name}'] gives spec '{sp}' to a non-array value "
                                 f"{x!r} at kwargs['{name}']{jax.tree_util.keystr(p)}")
        kw_static = tuple(x for (_, x), d in zip(flat, dyn) if not d)
        kw_parts.append((name, tree, tuple(dyn), kw_static))
        static.append((name, tree, tuple(dyn), kw_static))
    n_pos = sum(p_dyn)

    def rebuild(*flat):
        flat = list(flat)
        if pytree_callee:
            _, c_tree_, c_dyn_, c_static_ = static[0]
            it_d, it_s = iter(flat[:n_callee]), iter(c_static_)
            callee = jax.tree_util.tree_unflatten(
                c_tree_, [next(it_d) if d else next(it_s) for d in c_dyn_])
        else:
            callee = fun
        it_p, it_s = iter(flat[n_callee:n_callee + n_pos]), iter(p_static)
        pos = jax.tree_util.tree_unflatten(p_tree, [next(it_p) if d else next(it_s)
                                                    for d in p_dyn])
        rest = iter(flat[n_callee + n_pos:])
        kw = {}
        for name, tree, dyn, st in kw_parts:
            it_s = iter(st)
            kw[name] = jax.tree_util.tree_unflatten(
                tree, [next(rest) if d else next(it_s) for d in dyn])
        # (a patched JAX function passed itself runs as its replacement: registry)
        return called(compat.replacement_of(callee), *pos, **kw)

    _check_concrete_bounds(leaves, paths)
    rebuild.__wrapped__ = fun  # (as functools.wraps: messages name the user's function)
    c.leaves, c.specs, c.paths, c.rebuild = leaves, specs, paths, rebuild
    c.static_key = tuple(static)
    return c


def _check_concrete_bounds(leaves, paths) -> None:
    """A padded array's shape (its bounds) is concrete: the masked program is
    traced with each bound an int (``jax.export`` with a symbolic padded shape
    would otherwise fail deep in JAX's shape checks)."""
    for x, path in zip(leaves, paths):
        if is_masked(x) and any(map(compat.is_dim_expr, np.shape(x.data))):
            raise ShapeError(
                f"{path} is padded to the symbolic shape {tuple(np.shape(x.data))}: polymask "
                "traces each padded shape (bound) as ints, and the logical sizes are what "
                "varies within it. Export or jit one program per bound (jax.export with a "
                "concrete padded shape and the sizes as inputs); a symbolic batch axis "
                "outside mask (jax.vmap over it) is supported.")


# Case trees shared by every ``mask(fun, ...)`` of the same callee (a pytree
# callee: the same module structure) and options: ``mask`` is often called afresh
# per call or inside a grad/jit'd function. Least recently used first.
_SHARED: collections.OrderedDict = collections.OrderedDict()
_SHARED_SIZE = 128
_SHARED_LOCK = threading.Lock()


def _weak_callee(fun):
    """``fun`` as a ``_SHARED`` key that does not keep it alive where it can be
    weakly referenced (as ``jax.jit``'s cache): a weak reference equals another
    to the same live callee, a bound method's (new on every attribute access)
    while its object and function are alive. A dead one equals nothing, and
    its entry leaves with the least recently used.

    Tagged by kind: a bound method's ``WeakMethod`` compares equal to a plain
    weak reference to its object (``ref.__eq__`` compares the referents), so
    ``mask(obj.method)`` and ``mask(obj)`` would share a trace."""
    try:
        if inspect.ismethod(fun):
            return ("method", weakref.WeakMethod(fun))
        return ("callee", weakref.ref(fun))
    except TypeError:
        return ("strong", fun)


class _Meta:
    """What a ``MaskedFunction`` keeps besides its callee: specs, options, cache.

    Compared by identity: the pytree aux data of a ``MaskedFunction``.
    """

    def __init__(self, in_specs, constraints, checks, zero_padded=False, differentiable=True,
                 max_cases=DEFAULT_MAX_CASES):
        check_in_specs_type(in_specs)
        self.in_specs = in_specs
        self.constraints = as_constraints(constraints)
        self.checks = checks
        self.zero_padded = zero_padded
        self.differentiable = differentiable
        # (4.0 is a mistake, never truncated: as the runners' other int settings)
        self.max_cases = int_arg(max_cases, "max_cases", 0)
        self.cache: dict[Any, CaseTree] = {}
        self.lock = threading.Lock()
        # Python-int sizes met inside a transformation, per padded signature
        self.static_seen: dict[int, tuple] = {}
        self.warned_static = False
        try:
            self.spec_key = _hashable(repr(in_specs))
        except Exception:
            self.spec_key = None


class MaskedFunction:
    """The callable ``mask`` returns; ``.program(*args, **kwargs)`` gives its traced program.

    A pytree: when the callee is itself a pytree (an equinox or flax.nnx
    module), its leaves are this object's leaves, so ``eqx.filter_jit``,
    ``eqx.filter_grad``, ``jax.tree_util`` and ``nnx`` transforms see the
    module's parameters through it.
    """

    def __init__(self, fun: Callable, in_specs, constraints: Sequence[str], checks: bool,
                 zero_padded: bool = False, differentiable: bool = True,
                 max_cases: int = DEFAULT_MAX_CASES, _meta: _Meta | None = None):
        self.fun = fun
        self._meta = _meta or _Meta(in_specs, constraints, checks, zero_padded, differentiable,
                                    max_cases)
        self._pytree_callee = is_pytree_callee(fun)
        try:
            self.__name__ = getattr(fun, "__name__", type(fun).__name__)
            self.__qualname__ = getattr(fun, "__qualname__", self.__name__)
            self.__doc__ = getattr(fun, "__doc__", None)
            self.__wrapped__ = fun
        except Exception:  # pragma: no cover
            pass

    in_specs = property(lambda self: self._meta.in_specs)
    constraints = property(lambda self: self._meta.constraints)
    checks = property(lambda self: self._meta.checks)

    def _key(self, call: _Call):
        """``(key, shared)``: the case tree's cache key (None: not cacheable)
        and whether ``_SHARED`` keeps it too. Shared between ``mask()``s of the
        same callee, which is often wrapped afresh per call (``jax.jit`` too
        caches by the function): a pytree callee by its type (its leaves are
        in the key), any other by itself where it hashes."""
        m = self._meta
        if m.spec_key is None:
            return None, False
        key = (tuple(_leaf_sig(x) for x in call.leaves), call.static_key, m.spec_key,
               m.constraints, m.max_cases, m.differentiable, compat.context_mesh())
        callee = type(self.fun) if self._pytree_callee else _weak_callee(self.fun)
        try:
            hash(callee)
        except TypeError:
            return _hashable(key), False
        key = _hashable((key, callee))
        return key, key is not None

    def _tree_for(self, call: _Call) -> CaseTree:
        m = self._meta
        key, shared = self._key(call)
        if key is not None:
            with m.lock:
                tree = m.cache.get(key)
            if tree is None and shared:
                with _SHARED_LOCK:
                    tree = _SHARED.get(key)
                    if tree is not None:
                        _SHARED.move_to_end(key)
            if tree is not None:
                return tree
        def trace_one(conditions):
            return trace_flat(call.rebuild, call.leaves, call.specs, call.paths,
                              m.constraints, conditions)

        with replaced("differentiable", m.differentiable), \
                replaced("derivative_rule_splits", False):
            try:
                tree = trace_cases(trace_one, m.max_cases)
            except TooManyCases:
                if not trace_state().derivative_rule_splits:
                    raise
                # custom derivative rules split the trace past the limit: traced
                # when differentiated instead, as JAX does (the forward never
                # needs them)
                with replaced("differentiable", False):
                    tree = trace_cases(trace_one, m.max_cases)
        if key is not None:
            with m.lock:
                m.cache.setdefault(key, tree)
            if shared:
                with _SHARED_LOCK:
                    _SHARED[key] = tree
                    while len(_SHARED) > _SHARED_SIZE:
                        _SHARED.popitem(last=False)
        return tree

    def cases(self, *args, **kwargs) -> tuple[CaseTree, list]:
        """The decision tree of masked programs for the padded signature of the call.

        Traced once per signature (once per case). Returns ``(tree, leaves)``;
        ``tree.cases`` lists the cases, ``tree.summary()`` describes them.
        """
        call = _bind(self.fun, self._pytree_callee, self.in_specs, args, kwargs)
        return self._tree_for(call), call.leaves

    @property
    def programs(self) -> tuple[MaskedProgram, ...]:
        """The masked programs traced so far: one per padded signature (with case
        splits, the signature's first live case; ``cases`` gives them all)."""
        with self._meta.lock:
            return tuple(t.base for t in self._meta.cache.values())

    def program(self, *args, **kwargs) -> tuple[MaskedProgram, list]:
        """The masked program for the padded signature of the call (traced once per
        signature and static keyword/callee values).

        Returns ``(program, leaves)``; ``program.out_shapes`` are the symbolic
        output shapes. With case splits (``cases``) this is the first case's.
        """
        tree, leaves = self.cases(*args, **kwargs)
        return tree.base, leaves

    def __call__(self, *args, **kwargs):
        return self.call_guarded(None, *args, **kwargs)

    def call_guarded(self, guard, *args, **kwargs):
        """``self(*args, **kwargs)`` where ``guard`` (a bool scalar, traced, or
        None) says whether this call is real: where it is false, host callbacks
        and run-time checks do nothing (``ragged_map``'s spare rows of a
        partial batch, which plain JAX never sees). Returns and raises as
        ``__call__``."""
        return self._call(guard, args, kwargs, say_warnings=True)

    def call_for_runner(self, guard, *args, **kwargs):
        """``call_guarded`` for a runner (``polymask.jit``) that knows each
        call's exact sizes: the warnings the trace recorded are left for it
        to say per shape (``say_case_warnings``)."""
        return self._call(guard, args, kwargs, say_warnings=False)

    def _note_static_sizes(self, tree: CaseTree, values: dict) -> None:
        """Sizes given as Python ints inside the caller's ``jax.jit`` (a
        staging trace, not eager ``grad`` or ``vmap``) are static there: each
        one traces and compiles its own program, where array sizes
        (``np.int32(n)``) share one. Said once, at the second
        size of a padded signature (a Python int is the natural thing to
        pass, and the per-size compile is otherwise silent)."""
        m = self._meta
        if m.warned_static:
            return
        static = tuple(sorted((v, values[name] - off)
                              for v, (name, off) in tree.base.internal.items()
                              if type(values.get(name)) is int))
        if not static:
            return
        with m.lock:
            seen = m.static_seen.setdefault(id(tree), (tree, set()))[1]
            seen.add(static)
            if len(seen) < 2 or m.warned_static:
                return
            m.warned_static = True
        sizes = "; ".join(", ".join(f"{v} = {x}" for v, x in combo) for combo in sorted(seen))
        warnings.warn(
            f"polymask.mask({self.__name__}): logical sizes given as Python ints inside a JAX "
            f"transformation ({sizes}) are static there, so jax.jit traces and compiles a "
            "program per size; give them as arrays (np.int32(n), jnp.asarray(sizes)) to "
            "share one program for every size up to the bound", FallbackWarning,
            stacklevel=user_stacklevel())

    def _call(self, guard, args, kwargs, say_warnings: bool):
        call_site = user_call_site()
        # (big-endian NumPy data, as read from a file: converted, as polymask.jit does)
        args, kwargs = native_byte_order((args, kwargs))
        try:
            tree, leaves = self.cases(*args, **kwargs)
        except ShapeError as e:
            raise at_call_site(e, call_site) from None
        try:
            values, checks = solve_dim_vars(tree.base, leaves, self.checks)
        except ShapeError as e:
            raise self._sizes_named(at_call_site(e, call_site), tree) from None
        if say_warnings:
            say_case_warnings(tree, values)
        with masked_call(call_site):  # (the rules' run-time checks name it)
            if self.checks == "functional":
                with functional_checks() as bads:
                    outs = self._run(tree, leaves, values, checks, call_site, guard)
                outs = poison_outputs(outs, bads)
            else:
                try:
                    outs = self._run(tree, leaves, values, checks, call_site, guard)
                except ShapeError as e:  # (an eager program compiled at another call)
                    raise self._sizes_named(at_this_call(e, call_site), tree) from e.__cause__
        if say_warnings and compat.under_staging():  # (sizes the checks accepted)
            self._note_static_sizes(tree, values)
        return jax.tree_util.tree_unflatten(tree.base.out_tree, outs)

    def _sizes_named(self, error: ShapeError, tree: CaseTree) -> ShapeError:
        """``error`` saying which input axis each dim var polymask named is
        (no in_specs: ``s0 = args[0].shape[0]``; ``with_size_names``)."""
        return error if self.in_specs is not None else with_size_names(
            error, tree.base.var_axes())

    def _run(self, tree: CaseTree, leaves, values, checks, call_site, guard=None):
        meta = self._meta
        run_checks(checks, call_site)
        if guard is None and self.checks != "functional" and runs_eagerly(leaves, values):
            # an eager call: one compiled program, not an interpretation (tracing/eager.py)
            if not tree.single and any(map(compat.is_tracer, values.values())):
                return run_cases_eagerly(tree, leaves, values, call_site, bool(self.checks),
                                         meta.zero_padded, not meta.differentiable)
            run = functools.partial(run_program_eagerly, zero_padded=meta.zero_padded,
                                    forward_only=not meta.differentiable)
        else:
            run = functools.partial(run_program, zero_padded=meta.zero_padded,
                                    forward_only=not meta.differentiable, guard=guard)
        if tree.single:
            return run(tree.base, leaves, values)
        return run_cases(tree, leaves, values, call_site, run, checks_on=bool(self.checks),
                         outer_guard=guard)

    def __get__(self, obj, objtype=None):  # behave like a function as a class attribute
        return self if obj is None else functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"polymask.mask({self.fun!r}, {self.in_specs!r})"


def _mf_flatten(mf: MaskedFunction):
    if mf._pytree_callee:
        return (mf.fun,), (mf._meta, None)
    return (), (mf._meta, mf.fun)


def _mf_unflatten(aux, children):
    meta, fun = aux
    obj = object.__new__(MaskedFunction)
    obj.fun = children[0] if fun is None else fun
    obj._meta = meta
    obj._pytree_callee = fun is None
    obj.__name__ = getattr(obj.fun, "__name__", type(obj.fun).__name__)
    return obj


jax.tree_util.register_pytree_node(MaskedFunction, _mf_flatten, _mf_unflatten)


def mask(fun: Callable | None = None, in_specs=None, *, constraints: Sequence[str] = (),
         checks: bool = True, zero_padded: bool = False,
         differentiable: bool = True, max_cases: int = DEFAULT_MAX_CASES) -> MaskedFunction:
    """Transform ``fun`` (written for exact arrays) to run on padded arrays.

    Args:
      fun: a JAX-traceable function of arrays (pytrees allowed), or a callable
        pytree such as an equinox or flax.nnx module: its array leaves become
        unpadded inputs (its other leaves are static), and the returned
        ``MaskedFunction`` is a pytree holding it, so ``eqx.filter_jit``,
        ``eqx.filter_grad``, ``nnx.jit`` and ``nnx.grad`` see its parameters.
        None: a decorator with these options (``@polymask.mask(in_specs="n")``).
      in_specs: None (every axis of a ``Masked`` input gets its own dim var;
        plain arrays are unpadded and static); or one entry per positional
        argument (a tuple, as ``jax.vmap``'s ``in_axes``): a
        ``jax.export.symbolic_shape`` spec string (``"b, n, 64"``, ``"_"`` =
        static, same name = equal sizes, ``"2*k"`` = affine), None, or a
        pytree of specs matching the argument; or a dict keyed by parameter
        name (or positional index): ``{"x": "n, 16", "mask": "1, n, n"}``.
        An argument without a spec is unpadded (a params pytree needs none).
        Keyword arguments are passed through: their array leaves are inputs,
        their other leaves (``deterministic=True``) static and part of the
        cache key.
      constraints: extra ``jax.export`` constraints (``"n >= 3"``), checked in
        the prologue and used while tracing.
      checks: run the prologue checks (sizes in ``[0, bound]``, equal sizes for
        equal names, constraints). Concrete sizes are always range-checked.
        ``"functional"``: traced checks use no host callback (so ``jax.export``
        can serialize the program); a failed check makes every dynamic output
        size -1 (``Masked.unpad`` raises ShapeError on it) and float outputs
        NaN.
      zero_padded: the caller promises that the padding of every ``Masked``
        float input is exactly zero (``polymask.jit`` and ``ragged_map`` pad
        with zeros on the host): the entry ``select`` that zeroes it is skipped
        and rules treat the inputs as zero-padded. Gradients with respect to
        the padding are then not forced to 0.
      differentiable: False when the masked function will never be
        differentiated (``polymask.jit`` and ``ragged_map`` compile forward
        programs): the selects that only keep its backward pass finite are
        skipped (smaller programs).

    Returns:
      ``masked_fun(*args, **kwargs)``: array leaves may be ``Masked`` (padded data plus
      logical shape) or plain arrays (unpadded). Returns ``fun``'s output
      pytree with each array leaf a ``Masked`` whose logical shape is the
      symbolic output shape evaluated at the logical sizes and whose padded
      shape is that expression's upper bound.

    Raises:
      ShapeError: bad spec, sizes out of range or inconsistent, a constraint
        violated, or an inconclusive size comparison while tracing. With
        concrete sizes it is raised at the call. Inside ``jax.jit`` (traced
        sizes) the same message is raised when the result is computed, wrapped
        by JAX as ``jax.errors.JaxRuntimeError`` (``polymask.jit`` checks sizes
        on the host and raises ``ShapeError`` itself).
      UnsupportedError: a primitive without a masking rule.
      TypeError: ``fun`` is not callable (``polymask.mask("n")``).

    Composes with ``jax.jit`` (one trace per padded signature: sizes are
    runtime data), ``jax.vmap`` (ragged batches) and ``jax.grad``.
    """
    if fun is None:  # a decorator factory: @polymask.mask(in_specs=...), as polymask.jit
        return functools.partial(mask, in_specs=in_specs, constraints=constraints,
                                 checks=checks, zero_padded=zero_padded,
                                 differentiable=differentiable, max_cases=max_cases)
    check_function_first(fun, "polymask.mask")
    return MaskedFunction(fun, in_specs, constraints, checks, zero_padded, differentiable,
                          max_cases)
