"""``polymask.value_and_grad``: a plain scalar loss and gradients over a ragged batch.

``fun(params, *example)`` is written for one exact example and returns its
loss: a scalar, or an array of per-element (per-token) losses whose shape
depends on the example's sizes. Over a ragged batch the loss is the mean over
every *logical* element of every example (``reduce="mean"``: per-token losses
averaged over the batch's tokens; scalar losses averaged over examples) or
their sum (``reduce="sum"``). One ``jax.jit`` program per padded signature:
stack batches with a bucketing policy and the batch size with
``batch_buckets`` and a training run compiles once per bucket.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.binding import split_specs
from ..core.buckets import as_policy
from ..core.diagnostics import at_call_site, user_call_site, user_frame_of_exception
from ..core.errors import ShapeError, SpecError, about_example, typed_as, with_plain_state
from ..core.masked import Masked, stack
from ..core.plan import bucket_values, padded_shape, plan_call, policy_getter, solve_axis
from ..core.specs import as_constraints, parse_leaf_spec
from ..packing import PackedUnsupported, pack_rows
from ..packing.interpreter import ROWS_AXIS
from ..packing.segments import SEGMENT_FIELDS, Segments
from ..tracing.cases.dispatch import case_error
from ..tracing.prologue import run_checks, solve_dim_vars
from ..tracing.transform import mask
from .fallback import ExactFallback, falls_back
from .packed import PackedRunner, default_row_size, spare_rows
from .ragged_batches import AxisHistory, auto_specs

__all__ = ["value_and_grad", "RaggedValueAndGrad"]


@jax.jit
def _all_finite(tree) -> jax.Array:
    """Whether every entry of every float leaf of ``tree`` is finite (one bool)."""
    leaves = [jnp.all(jnp.isfinite(v)) for v in jax.tree_util.tree_leaves(tree)
              if jnp.issubdtype(jnp.result_type(v), jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _batch_size(x, i: int, argnums) -> int:
    """The number of examples in batched argument ``i`` (axis 0 of its leaves).

    Raises:
      ShapeError: a leaf without axis 0 (a scalar, or parameters passed where
        ``argnums`` does not point), or leaves of different lengths.
    """
    leaves = jax.tree_util.tree_leaves(x.data if isinstance(x, Masked) else x)
    lengths = {int(np.shape(v)[0]) if np.ndim(v) else None for v in leaves}
    if len(lengths) != 1 or None in lengths:
        shapes = [np.shape(v) for v in leaves][:4]
        raise ShapeError(
            f"value_and_grad: args[{i}] is not in argnums={argnums!r}, so it is a batch of "
            f"examples along axis 0 (a list of examples, polymask.stack or a leading batch "
            f"axis), but its leaves have shapes {shapes}; are the parameters at another "
            "position than argnums says?")
    return lengths.pop()


def _at_least_one(n: int) -> int:
    return max(int(n), 1)


def _per_example(size, b: int) -> np.ndarray:
    """A batch's logical size as one entry per example (at least ``b``): an
    int for the whole batch (``jax.vmap``'s form of a static axis) repeated."""
    size = np.asarray(size)
    return size if size.ndim else np.broadcast_to(size, (b,))


def _take_pad(x, b: int, total: int):
    """Pad the batch axis from ``b`` to ``total`` by repeating example 0 (weight 0)."""
    if total == b:
        return x
    idx = np.concatenate([np.arange(b), np.zeros(total - b, np.int64)])
    if isinstance(x, Masked):
        return Masked(np.asarray(x.data)[idx], tuple(_per_example(s, b)[idx] for s in x.shape))
    return jax.tree_util.tree_map(lambda a: np.asarray(a)[idx], x)


def plain_loss_shape(fun: Callable, args: Sequence[Any], cache: dict, where: str):
    """The shape of ``fun(*args)`` on one exact example (``jax.eval_shape``,
    cached by the arguments' shapes and dtypes).

    Raises:
      ShapeError: plain JAX fails on this example (``jnp.max`` of an empty
        axis, ``top_k`` with k > n): as on the exact arrays, never a value.
    """
    key = tuple((np.shape(x), str(getattr(x, "dtype", type(x).__name__)))
                for x in jax.tree_util.tree_leaves(args))
    if key not in cache:
        try:
            try:
                out = jax.eval_shape(fun, *args)
            except ShapeError:
                # polymask's data-dependent ops (boolean_mask) need concrete
                # inputs outside mask: the example itself, eagerly
                out = fun(*args)
            if not hasattr(out, "shape"):  # a tuple (loss, aux), a dict, None
                raise not_one_loss(fun, out)
            cache[key] = out.shape
        except ShapeError:
            raise
        except Exception as e:  # noqa: BLE001 - plain JAX's own error, reworded
            # (of plain JAX's type too, with its args: `except TypeError` still catches it)
            cache[key] = with_plain_state(typed_as(ShapeError(
                f"{where}: the loss fails on this example at {user_frame_of_exception(e)}, "
                "as on the exact arrays:\n  "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"),
                type(e)), e)
    if isinstance(cache[key], ShapeError):
        raise cache[key]
    return cache[key]


def not_one_loss(fun: Callable, out) -> ShapeError:
    """The error for a ``fun`` whose result is not one array (``(loss, aux)``)."""
    leaves = jax.tree_util.tree_leaves(out, is_leaf=lambda x: isinstance(x, Masked))
    what = (f"{type(out).__name__} of {len(leaves)}" if isinstance(out, (tuple, list, dict))
            else type(out).__name__)
    return ShapeError(f"value_and_grad: fun must return one array (its loss), got a {what} "
                      f"from {_defined_at(fun)}; return the loss alone (auxiliary outputs "
                      "are not supported)")


def _defined_at(fun: Callable) -> str:
    """``fun``'s name and the file:line of its definition (as far as known)."""
    code = getattr(inspect.unwrap(fun), "__code__", None)
    name = getattr(fun, "__qualname__", getattr(fun, "__name__", type(fun).__name__))
    if code is None:
        return name
    return f"{name} defined at {code.co_filename}:{code.co_firstlineno}"


class RaggedValueAndGrad:
    """The callable ``value_and_grad`` returns: ``vg(params, *batch) -> (loss, grads)``."""

    def __init__(self, fun: Callable, in_specs=None, *, argnums: int | Sequence[int] = 0,
                 reduce: str = "mean", buckets=None, batch_buckets=None, checks: bool = False,
                 layout: str = "padded", row_size: int | None = None,
                 rows_per_call: int | None = None, fallback: bool = True,
                 constraints: Sequence[str] = ()):
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        if layout not in ("padded", "packed"):
            raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")
        self.layout = layout
        self._in_specs = in_specs
        self.constraints = as_constraints(constraints)
        self._packed = (PackedTraining(fun, in_specs, argnums, reduce, row_size, rows_per_call,
                                       self.constraints)
                        if layout == "packed" else None)
        self.fun = fun
        self.argnums = argnums
        self._unbatched = {argnums} if isinstance(argnums, int) else set(argnums)
        self.reduce = reduce
        self._checks = checks
        self._plain_shapes: dict = {}
        self._fitting_shapes: set = set()  # example shapes that fit the specs
        self._valid_rows: set = set()  # (padded shapes, sizes) of stacked examples checked
        self._masked = mask(fun, in_specs, constraints=self.constraints, checks=checks)
        # a policy, or a {dim var: policy} dict as polymask.jit takes (None: pow2(),
        # as polymask.jit and ragged_map, for the dim vars of spec strings; an
        # array without one is stacked to the batch's longest unless given a policy)
        self._policy_for = policy_getter(buckets)
        self._policy = self._policy_for(None) if buckets is not None else None
        self._batch_policy = as_policy(batch_buckets) if batch_buckets is not None else None
        self.compiles = 0
        self.exact_compiles = 0  # per-example programs of the fallback (also in compiles)
        self._jitted = jax.jit(self._value_and_grad)
        # without in_specs, lists of exact examples get ragged_map's specs read off
        # each call's examples: repr(specs) -> (masked function, its jitted step)
        self._auto_specs = in_specs is None
        self._axis_history = AxisHistory()  # auto specs over the calls
        self._by_specs: dict = {repr(None): (self._masked, self._jitted)}
        name = getattr(fun, "__name__", type(fun).__name__)
        self._fallback = ExactFallback(self._example_sum_and_grad, f"value_and_grad({name})",
                                       self._count_exact, counted_in="vg.exact_compiles")
        self._unshared: dict = {}  # padded batch signature -> why its trace failed
        self._fallback_on = bool(fallback)

    def _loss(self, weights, *args):
        """(the reduced loss, the count of logical elements it reduced)."""
        in_axes = tuple(None if i in self._unbatched else 0 for i in range(len(args)))
        out = jax.vmap(self._masked, in_axes=in_axes)(*args)
        if not isinstance(out, Masked):
            raise not_one_loss(self.fun, out)
        w = weights.reshape(weights.shape + (1,) * (out.data.ndim - 1))
        keep = out.valid() & (w > 0)
        total = jnp.sum(jnp.where(keep, out.data, 0))
        count = jnp.sum(keep).astype(jnp.float32)
        if self.reduce == "sum":
            return total, count
        return total / jnp.maximum(count, 1).astype(total.dtype), count

    def _value_and_grad(self, weights, *args):
        """((loss, count), grads): ``count`` lets examples run apart be added."""
        self.compiles += 1  # runs once per trace, i.e. per compiled signature
        argnums = (1 + self.argnums if isinstance(self.argnums, int)
                   else tuple(1 + i for i in self.argnums))  # weights come first
        return jax.value_and_grad(self._loss, argnums=argnums, has_aux=True)(weights, *args)

    def prepare(self, *args) -> tuple[Any, tuple]:
        """(example weights, args): lists of exact arrays stacked into ragged
        batches (padded by ``buckets``), the batch padded by ``batch_buckets``."""
        args = list(args)
        for i, a in enumerate(args):
            if i not in self._unbatched and isinstance(a, (list, tuple)) and a and \
                    not isinstance(a[0], (list, tuple, dict)):
                # without a policy the bound is the longest example, at least 1
                # (a batch of empty examples still needs a padded size)
                args[i] = stack(list(a), bound=self._bucketed_bound(i, a, len(args)),
                                buckets=self._policy or _at_least_one)
        sizes = {_batch_size(a, i, self.argnums) for i, a in enumerate(args)
                 if i not in self._unbatched}
        if len(sizes) != 1:
            raise ShapeError(f"value_and_grad: batched arguments have different batch sizes "
                             f"{sorted(sizes)}")
        (b,) = sizes
        total = self._batch_policy(b) if self._batch_policy is not None else b
        weights = np.concatenate([np.ones(b, np.float32), np.zeros(total - b, np.float32)])
        args = [a if i in self._unbatched else _take_pad(a, b, total)
                for i, a in enumerate(args)]
        return weights, tuple(args)

    def _bucketed_bound(self, i: int, examples, n_args: int) -> tuple[int, ...] | None:
        """The padded shape of argument ``i``'s examples: ``buckets`` rounds up
        the dim vars of its spec (``"n, 3"``: ``n`` only; the static 3 stays 3,
        as ``ragged_map`` pads). None (``stack`` rounds every axis) without a
        spec string: the masked trace then reports the spec."""
        specs, _ = split_specs(self.fun, self._in_specs, n_args, {})
        spec = specs[i] if isinstance(specs, (tuple, list)) and i < len(specs) else None
        shapes = {np.shape(x) for x in examples}
        if not isinstance(spec, str) or len({len(sh) for sh in shapes}) != 1:
            return None
        longest = tuple(int(m) for m in np.max(np.array(sorted(shapes)), axis=0))
        try:
            axes = parse_leaf_spec(spec, f"args[{i}]", longest, jax.export.SymbolicScope(),
                                   False, None)
        except ShapeError:
            return None
        # each dim var's bucket, then the axis' affine size of it ('2*k + 1': k is bucketed)
        values = {a.var: solve_axis(n, a) for a, n in zip(axes, longest) if a.var is not None}
        where = {a.var: f"{a.where}, the longest of the batch" for a in axes if a.var is not None}
        buckets = bucket_values(self._policy_for, values, where)
        return padded_shape(axes, buckets)

    @property
    def last_padded(self) -> int:
        """Examples of the last packed call that ran in the padded layout."""
        return self._packed.last_padded if self._packed is not None else 0

    @property
    def nonfinite_reruns(self) -> int:
        """Packed calls whose loss or gradients were not finite, rerun in the
        padded layout (a NaN or inf of one example stays its own)."""
        return self._packed.nonfinite_reruns if self._packed is not None else 0

    def specs_for(self, n_args: int):
        """``fun``'s specs for a call with ``n_args`` arguments, as
        ``polymask.mask`` takes them: specs of the batched arguments only
        (``("n, 4",)`` for ``fun(params, x)``, as the packed layout takes
        them) get None for the differentiated ones (``explain`` uses this)."""
        specs = self._in_specs
        if (isinstance(specs, (tuple, list)) and len(specs) == n_args - len(self._unbatched)
                and self._unbatched):
            it = iter(specs)
            return tuple(None if i in self._unbatched else next(it) for i in range(n_args))
        return specs

    def _specs_of_examples(self, args):
        """``ragged_map``'s specs of this call's examples (``auto_specs``: axes
        whose sizes differ are dynamic, equal ones share a dim var), None for
        the parameters; None (each axis its own dim var) unless every batched
        argument is a list of exact arrays."""
        batched = [i for i in range(len(args)) if i not in self._unbatched]
        if not batched or not all(isinstance(args[i], (list, tuple)) and args[i]
                                  for i in batched):
            return None
        if len({len(args[i]) for i in batched}) != 1:
            return None  # different batch sizes: prepare() says so
        examples = list(zip(*(args[i] for i in batched)))
        try:  # (the stacked batch pads an axis empty in every example to 1: dynamic)
            specs = iter(auto_specs(examples, empty_dynamic=True, history=self._axis_history))
        except ShapeError:
            return None  # ranks or structures differ: the masked trace says so
        return tuple(None if i in self._unbatched else _static_as_sizes(next(specs), args[i][0])
                     for i in range(len(args)))

    def _use_specs(self, specs) -> None:
        """Run this call with ``specs`` (``_specs_of_examples``): its masked
        function and jitted step, made once per specs (a jitted step traced
        with other specs must never run these)."""
        key = repr(specs)
        if key not in self._by_specs:
            masked = mask(self.fun, specs, constraints=self.constraints, checks=self._checks)
            step = jax.jit(functools.partial(RaggedValueAndGrad._value_and_grad, self))
            self._by_specs[key] = (masked, step)
        self._in_specs = specs
        self._masked, self._jitted = self._by_specs[key]

    def _fit_specs(self, n_args: int) -> None:
        specs = self.specs_for(n_args)
        if specs is not self._in_specs:
            self._in_specs = specs
            self._masked = mask(self.fun, self._in_specs, constraints=self.constraints,
                                checks=self._checks)

    def _check_arguments(self, args) -> None:
        """The examples are the arguments not in ``argnums``: a call where every
        argument is differentiated has no batch (``vg(X, y)`` with
        ``argnums=(0, 1)``, meant as ``jax.value_and_grad``). A dict of specs
        names parameters ``fun`` takes (checked here: inside the trace, the
        error would send the batch to the per-example fallback), and gives no
        spec to an argument in ``argnums`` (parameters may be any pytree, a
        list or tuple of arrays of different shapes included)."""
        if args and all(i in self._unbatched for i in range(len(args))):
            raise ShapeError(
                f"value_and_grad: argnums={self.argnums!r} differentiates every one of the "
                f"{len(args)} argument(s), so there is no batch of examples: the "
                "arguments in argnums (the parameters) are not batched, every other "
                "argument is a batch of examples along axis 0; call vg(params, "
                "examples...) with the examples outside argnums, or use "
                "polymask.jit(jax.value_and_grad(fun, argnums), specs) for one example")
        for i, a in enumerate(args):
            if i not in self._unbatched and isinstance(a, list) and a and \
                    isinstance(a[0], (tuple, dict)):
                kind = type(a[0]).__name__
                raise ShapeError(
                    f"value_and_grad: args[{i}] is a list of {kind}s, one per example; a batch "
                    "is one list of arrays per argument of the loss: for fun(params, x, y) call "
                    "vg(params, xs, ys), for example vg(params, *map(list, zip(*pairs))) from "
                    "a list of (x, y) pairs, or for a dict per example one list per key "
                    "passed as its own argument (polymask.ragged_map takes tuples as they are)")
            if i not in self._unbatched and any(
                    jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key)
                    for leaf in jax.tree_util.tree_leaves(a)):
                raise typed_as(ShapeError(
                    f"value_and_grad: args[{i}] holds typed PRNG keys (jax.random.key): the "
                    "examples are stacked and padded as numbers, which key arrays are not. Pass "
                    "each example's jax.random.key_data(key) (spec '2' for one key, or '_') and "
                    "make the key in the loss with jax.random.wrap_key_data(data); "
                    "polymask.ragged_map takes typed keys as they are"), TypeError)
        specs = self._in_specs
        if isinstance(specs, dict):
            specs = split_specs(self.fun, specs, len(args), {})[0]
        if isinstance(specs, (tuple, list)) and len(specs) == len(args):
            given = [i for i in sorted(self._unbatched) if specs[i] is not None]
            if given:
                raise SpecError(
                    f"value_and_grad: in_specs gives a spec to args[{given[0]}], which "
                    f"argnums={self.argnums!r} differentiates; the arguments in argnums "
                    "(the parameters) are not batched and take no spec: give specs to "
                    "the example arguments, and argnums the parameters' positions")

    def _empty_batch(self, args) -> bool:
        """Whether every batched argument is an empty list (no examples)."""
        batched = [a for i, a in enumerate(args) if i not in self._unbatched]
        return bool(batched) and all(isinstance(a, (list, tuple)) and not a for a in batched)

    def _zero(self, args):
        """A batch of no examples: loss 0 and zero gradients (the sum over no
        examples; the mean takes max(count, 1) as its denominator)."""
        zeros = lambda p: jax.tree_util.tree_map(jnp.zeros_like, p)  # noqa: E731
        grads = (zeros(args[self.argnums]) if isinstance(self.argnums, int)
                 else tuple(zeros(args[i]) for i in self.argnums))
        return jnp.zeros((), jnp.float32), grads

    def __call__(self, *args):
        self._check_arguments(args)
        if self._empty_batch(args):
            if self._packed is not None:
                self._packed.last_padded = 0
            return self._zero(args)
        if self._auto_specs and self._packed is None:
            self._use_specs(self._specs_of_examples(args))
        self._fit_specs(len(args))
        if self._packed is not None:
            try:
                out = self._packed(*args)
            except PackedUnsupported as e:
                raise PackedUnsupported(f"value_and_grad(layout='packed'): {e}; "
                                        "layout='padded' (the default) runs it") from None
            self.compiles = self._packed.compiles + self._packed.compiles_padded
            padded = self._packed._padded  # (examples the row program does not serve)
            self.exact_compiles = 0 if padded is None else padded.exact_compiles
            return out
        exact = self._check_exact_examples(args)
        weights, batch = self.prepare(*args)
        self._check_stacked_sizes(weights, batch, exact)
        key = (repr(self._in_specs),) + tuple((np.shape(x), str(getattr(x, "dtype", "")))
                                              for x in jax.tree_util.tree_leaves(batch))
        if key in self._unshared and exact:
            return self._exact_value_and_grad(args, self._unshared[key])
        # examples whose sizes reach a case with outputs of another rank or
        # dtype (``squeeze()`` at n = 1: Case.differs) run apart, as jax.jit
        # runs them; the others share the padded program
        try:
            apart = self._examples_apart(weights, batch)
            run = weights
            if apart:
                run = weights.copy()
                run[list(apart)] = 0
            if apart and not np.any(run > 0):  # (no program for a batch of them only)
                loss, grads = self._zero(args)
                return self._add_examples_apart(loss, 0.0, grads, args, batch, apart, exact)
            (loss, count), grads = self._jitted(run, *batch)
            # A case the masked trace could not trace symbolically ("polymask
            # cannot trace the function with symbolic sizes": np.arange(n) past
            # the per-size limit) is an error case of the program, and the
            # program has no host check to raise it (checks=False): its examples
            # would add 0. Plain JAX's own failures were raised above.
            # Stacked batches get the error itself: never a silent 0.
            limit = None if self._checks else self._symbolic_limit(run, batch)
            if limit is not None:
                raise limit
        except Exception as e:
            if not exact or not self._fallback_on or not falls_back(e):
                raise  # stacked batches: no exact examples to run one by one
            if self._axis_history.pin_promoted():  # static again, as the examples read alone
                return self(*args)
            self._unshared[key] = self._fallback.refused(self._padded_text(batch), e)
            return self._exact_value_and_grad(args, self._unshared[key])
        if not apart:
            return loss, grads
        return self._add_examples_apart(loss, count, grads, args, batch, apart, exact)

    def _padded_text(self, batch) -> str:
        return "of examples padded to " + ", ".join(
            str(np.shape(a.data)[1:]) for i, a in enumerate(batch)
            if i not in self._unbatched and isinstance(a, Masked))

    def _examples_apart(self, weights, batch) -> dict[int, tuple]:
        """``{k: (tree, case)}``: the examples (weight > 0) whose sizes reach a
        case whose outputs differ from the padded program's (``Case.differs``)."""
        return {k: (tree, case) for k, tree, case in
                self._cases_reached(weights, batch, lambda c: c.differs)}

    def _cases_reached(self, weights, batch, which):
        """``(k, tree, case)`` for each example ``k`` (weight > 0) whose sizes
        reach a case ``which(case)`` holds for (past a split on a count: a case
        the count may choose); nothing when no case of the tree is such."""
        tree, _ = self._masked.cases(*self._example_args(batch, 0))
        if not any(which(c) for c in tree.cases):
            return
        for k in np.flatnonzero(np.asarray(weights) > 0):
            tree, leaves = self._masked.cases(*self._example_args(batch, int(k)))
            values, _ = solve_dim_vars(tree.base, leaves, checks_on=False)
            case = next((c for c in tree.reachable_cases(values) if which(c)), None)
            if case is not None:
                yield int(k), tree, case

    def _add_examples_apart(self, loss, count, grads, args, batch, apart, exact: bool):
        """The padded program's sums plus those of ``apart``'s examples, each
        run exact under plain ``jax.jit`` (once per shape), reduced as one batch."""
        count_p = float(count)
        scale = 1.0 if self.reduce == "sum" else max(count_p, 1.0)
        total = loss * scale
        grads = jax.tree_util.tree_map(lambda v: v * jnp.asarray(scale, v.dtype), grads)
        for k, (tree, case) in sorted(apart.items()):
            ex = ([a if i in self._unbatched else a[k] for i, a in enumerate(args)] if exact
                  else self._exact_example(batch, k))
            where = f"{tree.case_sizes(case)} ({self._padded_text(batch)})"
            s, c, g = self._exact_sums(k, ex, self._fallback.refused(where, case_error(tree, case)))
            total, count_p = total + s, count_p + c
            grads = jax.tree_util.tree_map(jnp.add, grads, g)
        return self._reduced(total, count_p, grads)

    def _exact_sums(self, k: int, ex, reason: str):
        """(loss sum, element count, gradient sums) of example ``k``, exact,
        under plain ``jax.jit`` (once per shape)."""
        key = tuple((np.shape(x), str(getattr(x, "dtype", type(x).__name__)))
                    for x in jax.tree_util.tree_leaves(ex))
        try:
            (s, c), g = self._fallback.call(key, tuple(ex), reason)
        except ShapeError as e:
            raise ShapeError(f"examples[{k}]: {e}") from e.__cause__
        return s, float(c), g

    def _reduced(self, total, count: float, grads):
        """Sums as the loss reduces them (the mean: over max(count, 1) elements)."""
        if self.reduce == "mean":
            scale = 1.0 / max(count, 1.0)
            total = total * scale
            grads = jax.tree_util.tree_map(lambda v: v * jnp.asarray(scale, v.dtype), grads)
        return total, grads

    def _exact_example(self, batch, k: int) -> list:
        """Example ``k`` of a stacked batch as exact arrays (its logical region)."""
        return [a.unpad() if isinstance(a, Masked) else a
                for a in self._example_args(batch, k)]

    def _example_args(self, batch, k: int) -> list:
        """Example ``k`` of a prepared batch, as ``mask`` takes it (concrete sizes)."""
        return [a if i in self._unbatched else
                Masked(np.asarray(a.data)[k], tuple(int(_per_example(s, k + 1)[k]) for s in a.shape))
                if isinstance(a, Masked) else jax.tree_util.tree_map(lambda v: np.asarray(v)[k], a)
                for i, a in enumerate(batch)]

    def _check_stacked_sizes(self, weights, batch, exact: bool) -> None:
        """Every example's logical sizes against the specs and constraints, on
        the host, once per distinct row of sizes: in range, of each axis' form
        (``2*n``), equal for a shared dim var, and within the constraints. The
        program has no check (``checks=False``), and a size it cannot serve
        would be read as another (7 clipped to a bound of 5; 3 as ``2*1``).
        Lists of exact arrays were checked example by example already.

        Raises:
          ShapeError: ``examples[k]: constraint 'n >= 4' does not hold for n=2``.
        """
        if exact or self._checks:
            return
        masked = [a for i, a in enumerate(batch) if i not in self._unbatched
                  and isinstance(a, Masked)]
        if not masked:
            return
        b = len(weights)  # a size may be one int for the whole batch (jax.vmap's form)
        rows = np.concatenate([np.stack([_per_example(s, b) for s in a.shape], axis=-1)
                               for a in masked], axis=1)
        signature = tuple(np.shape(a.data)[1:] for a in masked)
        site = user_call_site()
        for k in np.flatnonzero(np.asarray(weights) > 0):
            key = (signature, tuple(rows[k].tolist()))
            if key in self._valid_rows:
                continue
            try:
                tree, leaves = self._masked.cases(*self._example_args(batch, int(k)))
                _, checks = solve_dim_vars(tree.base, leaves, checks_on=False)
                run_checks(checks, site)
            except ShapeError as e:
                raise at_call_site(about_example(int(k), e), site) from None
            self._valid_rows.add(key)

    def _symbolic_limit(self, weights, batch) -> ShapeError | None:
        """The error of the first example (weight > 0) whose sizes reach a case
        of the masked program that polymask could not trace symbolically (not
        one where plain JAX fails), or None. The program itself has no host
        check for it (``checks=False``): that example would add 0."""
        for k, _, case in self._cases_reached(
                weights, batch, lambda c: c.error is not None and not c.pinned and not c.differs):
            return ShapeError(f"examples[{k}]: polymask cannot trace the function with "
                              f"symbolic sizes at {case.where}:\n  {case.error}")
        return None

    # -- the per-example fallback (fallback.py) -----------------------------------
    def fallbacks(self) -> dict[str, str]:
        """``{batch: reason}``: padded batches whose program could not be
        traced, so their examples ran one by one under ``jax.jit`` (as the
        exact loss would), and why (with ``layout="packed"``: those of the
        examples it ran in the padded layout)."""
        padded = None if self._packed is None else self._packed._padded
        return self._fallback.fallbacks() if padded is None else padded.fallbacks()

    def _count_exact(self, exact_compiles=0, **_):
        self.exact_compiles += exact_compiles
        self.compiles += exact_compiles

    def _example_sum_and_grad(self, *example):
        """One exact example: ((sum of its loss elements, their count), grads)."""
        def loss_sum(*ex):
            out = jnp.asarray(self.fun(*ex))
            return jnp.sum(out), jnp.asarray(out.size, jnp.float32)

        return jax.value_and_grad(loss_sum, argnums=self.argnums, has_aux=True)(*example)

    def _exact_value_and_grad(self, args, reason: str):
        """The batch example by example under plain ``jax.jit`` (its padded
        program cannot be traced): the sums and counts of every example's loss
        reduced as the padded program reduces them."""
        n = len(next(a for i, a in enumerate(args) if i not in self._unbatched))
        total, count, grads = None, 0.0, None
        for k in range(n):
            ex = [a if i in self._unbatched else a[k] for i, a in enumerate(args)]
            s, c, g = self._exact_sums(k, ex, reason)
            total = s if total is None else total + s
            count += c
            grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
        return self._reduced(total, count, grads)

    def _check_exact_examples(self, args) -> bool:
        """Lists of exact arrays: each example's loss traced by plain JAX (once
        per shape), so an example where the plain loss fails raises
        ``ShapeError`` instead of adding 0 (the compiled program has no
        host callback to say it). Returns whether the batch is such lists."""
        lists = {i: a for i, a in enumerate(args) if i not in self._unbatched
                 and isinstance(a, (list, tuple)) and a and not isinstance(a[0], (list, dict))}
        if len(lists) != len(args) - len(self._unbatched):
            return False  # stacked batches: their sizes were checked when stacked
        if len({len(a) for a in lists.values()}) != 1:
            raise ShapeError("value_and_grad: batched arguments have different batch sizes "
                             f"{sorted({len(a) for a in lists.values()})} (examples per list)")
        specs, _ = split_specs(self.fun, self._in_specs, len(args), {})
        for k in range(len(next(iter(lists.values())))):
            ex = [a[k] if i in lists else a for i, a in enumerate(args)]
            self._check_example_fits_specs(ex, specs, k)
            plain_loss_shape(self.fun, ex, self._plain_shapes, f"examples[{k}]")
        return True

    def _check_example_fits_specs(self, ex, specs, k: int) -> None:
        """An exact example against the specs, on the host, once per shape
        signature: its rank, static sizes and a size of each axis' form (3 is
        not ``2*n``). The padded program has no check (``checks=False``) and
        would read a size that does not fit as another (3 as ``2*1``); a
        spec error is never a reason for the per-example fallback.

        Raises:
          ShapeError: ``examples[k]: ...`` as ``ragged_map`` says it.
        """
        key = tuple((np.shape(x), str(getattr(x, "dtype", type(x).__name__)))
                    for x in jax.tree_util.tree_leaves(ex))
        if key in self._fitting_shapes:
            return
        try:
            plan_call(ex, specs, self.constraints, self._policy_for)
        except ShapeError as e:
            raise at_call_site(about_example(k, e), user_call_site()) from None
        self._fitting_shapes.add(key)


def _static_as_sizes(spec, example):
    """``spec`` (of one argument, a pytree) with each array leaf of the same
    size in every example (None) written as its sizes (``"3, 16"``): the
    batch stacks every example argument, so each takes a spec."""
    leaves, tree = jax.tree_util.tree_flatten(example)
    specs = jax.tree_util.tree_leaves(spec, is_leaf=lambda v: v is None)
    specs = [", ".join(map(str, np.shape(x))) if sp is None and np.ndim(x) else sp
             for sp, x in zip(specs, leaves)]
    return specs[0] if tree == jax.tree_util.tree_structure(0) else (
        jax.tree_util.tree_unflatten(tree, specs))


def value_and_grad(fun: Callable, in_specs=None, *, argnums: int | Sequence[int] = 0,
                   reduce: str = "mean", buckets=None, batch_buckets=None,
                   checks: bool = False, layout: str = "padded", row_size: int | None = None,
                   rows_per_call: int | None = None, fallback: bool = True,
                   constraints: Sequence[str] = ()) -> RaggedValueAndGrad:
    """Loss and gradients of ``fun`` over a ragged batch, as plain arrays.

    Args:
      fun: ``fun(params, *example)``, written for one exact example, returns
        its loss: a scalar, or per-element losses (e.g. ``(n,)`` per-token).
      in_specs: specs of one example's arguments, as for ``polymask.mask``
        (a dict by parameter name leaves ``params`` unpadded:
        ``{"tokens": "n", "labels": "n"}``; a tuple of the example
        arguments' specs, ``("n, 4",)``, or with None for ``params``,
        ``(None, "n, 4")``; a string: the spec of the one example argument).
        None, with lists of exact arrays: read off each call's examples as
        ``ragged_map`` reads them (sizes that differ across the examples are
        dynamic, the others static, axes of equal sizes in every example
        share one dim var), so ``x @ w - y`` of ``(n, 16)`` and ``(n,)``
        examples trains in shared programs.
      argnums: the argument(s) differentiated; they are not batched. Every
        other argument is batched along axis 0: a ragged batch
        (``polymask.stack``), a list of exact arrays (stacked here, padded by
        ``buckets``), or an array whose leading axis is the batch.
      reduce: ``"mean"``: the mean over all logical elements of all examples
        (per-token losses: the mean over the batch's tokens; scalar losses:
        over examples); ``"sum"``: their sum.
      buckets: policy for the per-example bounds of lists of exact arrays: one
        policy, or a dict by dim var name as ``polymask.jit`` takes
        (``{"n": pow2(), None: exact()}``; ``None``: the others' policy).
        Default ``pow2()`` for the dim vars of the specs (or of the specs read
        off the examples), as ``polymask.jit`` and ``ragged_map``: batches
        whose longest examples share a bucket share a program.
      batch_buckets: policy for the batch size (padded with zero-weight
        copies of example 0), so a short last batch does not compile again.
      checks: run the masked prologue checks (sizes from ``stack`` are valid
        by construction, so off by default: no host callback in the program).
      layout: ``"padded"`` (default) or ``"packed"``: the batch's examples
        (lists of exact arrays of one ragged dim var) are packed end to end
        into rows of ``row_size`` positions (default: the power of two that
        holds the longest, at least 64) with segment ids, ``rows_per_call``
        rows per call of one compiled program (``packing/``; the docstring
        of ``ragged_map``). No bucket padding; a batch with more rows runs
        in several calls whose sums are added. Examples longer than a row,
        or of a size the row program does not serve (another traced case;
        ``x[1:]`` at ``n = 0``), run in the padded layout and their sums are
        added (``vg.last_padded`` counts them).
      fallback: run a batch whose padded program cannot be traced example by
        example under ``jax.jit`` (default), or raise the trace's error. An
        example whose loss has another rank, dtype or structure at its size
        (``(x @ w).squeeze()`` at n = 1) runs so alone, its sums added to the
        padded program's (``vg.fallbacks()`` names those sizes).
      constraints: what you know about the example sizes, as for
        ``polymask.mask`` (``["n >= 4"]``): the masked trace needs no case
        for the sizes they rule out (a library's choice by shape, such as
        lineax's QR for a tall ``n x k`` matrix, decided by ``n >= k + 1``).
        Every example of every call is checked on the host.

    Returns:
      ``vg(params, *batch) -> (loss, grads)``: ``loss`` a scalar array,
      ``grads`` shaped like ``params``; equal to ``jax.value_and_grad`` of the
      same reduction computed example by example on exact arrays.
      ``vg.compiles`` counts the compiled signatures. Where a batch's padded
      program cannot be traced (a size needed as a Python value, a
      primitive without a masking rule) and the batch is lists of exact
      arrays, its examples run one by one under ``jax.jit`` (one compile per
      distinct shape, as plain JAX; ``vg.exact_compiles``; warned once,
      ``polymask.FallbackWarning``; ``vg.fallbacks()`` says why);
      ``fallback=False`` raises the trace's error instead.

    A batch of no examples (empty lists) gives a loss of 0 and zero
    gradients in either layout and either ``reduce`` (the mean over no
    elements is taken as 0, not NaN).

    Raises:
      ShapeError: ``fun`` does not return one array, a spec does not fit,
        examples of one batch disagree in rank or static sizes, or the plain
        loss fails on an example (``examples[k]`` and the line are named).
      UnsupportedError: a primitive in ``fun`` has no masking rule and the
        batch is stacked (``polymask.stack``: no exact examples to fall back to).
      PackedUnsupported: ``layout="packed"`` and ``fun`` cannot run packed
        (the primitive and line are named); ``layout="padded"`` runs it.
      ShapeError: an example whose sizes break ``constraints`` (checked on
        the host for every example of every call, ``examples[k]`` named).
      ValueError: ``layout`` other than ``"padded"``/``"packed"``, or
        ``reduce`` other than ``"mean"``/``"sum"``.

    Padding rows of the batch and padded positions of each example are
    dropped with ``where`` (never multiplied by 0), so NaN in padding cannot
    reach the loss or the gradients.
    """
    if isinstance(in_specs, str):  # the spec of the one example argument, as ragged_map's
        in_specs = (in_specs,)
    return RaggedValueAndGrad(fun, in_specs, argnums=argnums, reduce=reduce, buckets=buckets,
                              batch_buckets=batch_buckets, checks=checks, layout=layout,
                              row_size=row_size, rows_per_call=rows_per_call, fallback=fallback,
                              constraints=constraints)


def _add_sums(a, b):
    return a[0] + b[0], a[1] + b[1], jax.tree_util.tree_map(jnp.add, a[2], b[2])


class PackedTraining:
    """``value_and_grad(..., layout="packed")``: loss sums and gradients over
    rows of packed examples (``runners/packed.py`` packs them; the row
    program is the packed interpreter's, differentiated by ``jax.grad``)."""

    def __init__(self, fun, in_specs, argnums, reduce, row_size, rows_per_call,
                 constraints: tuple[str, ...] = ()):
        if not isinstance(argnums, int):
            raise ValueError("value_and_grad(layout='packed') takes one argnums (the params)")
        self.fun, self.argnums, self.reduce = fun, argnums, reduce
        self.in_specs = in_specs
        self.constraints = constraints
        self.row_size, self.rows_per_call = row_size, rows_per_call
        self.runner: PackedRunner | None = None
        self.compiles = 0
        self.compiles_padded = 0
        self.last_padded = 0  # examples of the last call that ran in the padded layout
        self.nonfinite_reruns = 0  # calls whose non-finite sums reran in the padded layout
        self._fn = None
        self._fn_program = None  # the runner's program self._fn runs
        self._padded: RaggedValueAndGrad | None = None
        self._loss_sizes: dict = {}

    def _example_fun(self):
        i = self.argnums
        return lambda params, *ex: self.fun(*ex[:i], params, *ex[i:])

    def _specs(self, n_args: int, examples) -> tuple:
        specs = self.in_specs
        if specs is None:  # read off the examples, one ragged axis (as ragged_map packs)
            return auto_specs(examples, leading_if_uniform=True, empty_dynamic=True)
        if isinstance(specs, dict):  # by parameter name, as for mask
            names = list(inspect.signature(self.fun).parameters)
            specs = tuple(specs.get(names[j]) for j in range(len(names)) if j != self.argnums)
        elif isinstance(specs, (tuple, list)) and len(specs) == n_args + 1:
            specs = tuple(s for j, s in enumerate(specs) if j != self.argnums)
        return tuple(specs)

    def __call__(self, *args):
        # a stacked batch (``polymask.stack``) is packed from its exact examples
        args = tuple(a.unpad() if isinstance(a, Masked) and j != self.argnums else a
                     for j, a in enumerate(args))
        params = args[self.argnums]
        batched = [a for j, a in enumerate(args) if j != self.argnums]
        examples = list(zip(*batched))
        specs = self._specs(len(batched), examples)
        # messages name an argument by its place in the user's call vg(params, *example)
        arg_names = [f"args[{j + (j >= self.argnums)}]" for j in range(len(batched))]
        infos, tree = [], None
        for k, ex in enumerate(examples):
            try:
                plan = plan_call(ex, specs, self.constraints, policy_getter(None), arg_names)
            except ShapeError as e:
                raise at_call_site(about_example(k, e), user_call_site()) from None
            leaves, tree = jax.tree_util.tree_flatten(tuple(ex))
            infos.append((plan, leaves))
        if len({tuple(p.var_names) for p, _ in infos}) != 1 or len(infos[0][0].var_names) != 1:
            raise PackedUnsupported("the packed layout packs one ragged dim var")
        lengths = [int(p.values[0]) for p, _ in infos]
        if self.runner is None:
            R = self.row_size or default_row_size(max(lengths))
            self.runner = PackedRunner(self._example_fun(), self.constraints, R, min(R, 128),
                                       self.rows_per_call, 16, True, differentiable=True)
        runner = self.runner
        first = next((k for k, n in enumerate(lengths) if n <= runner.row_size), None)
        if first is None:
            self.last_padded = len(lengths)
            return self._finish(*self._padded_sums(args, range(len(lengths))))
        try:
            prog = runner.prepare(infos[first][0], infos[first][1], tree, (params,), specs)
        except PackedUnsupported:  # where plain JAX fails on the example: its error
            plain_loss_shape(self._example_fun(), [params, *examples[first]], self._loss_sizes,
                             f"examples[{first}]")
            raise
        packed = [k for k, n in enumerate(lengths) if n <= runner.row_size and prog.runs(n)]
        # longer than a row, or a size the row program does not serve (another
        # traced case, ``x[1:]`` at n = 0): those examples run in the padded layout
        in_rows = set(packed)
        left = [k for k in range(len(lengths)) if k not in in_rows]
        self.last_padded = len(left)
        sums = self._run(params, [infos[k] for k in packed], [lengths[k] for k in packed])
        if packed and not _all_finite((sums[0], sums[2])):
            # A NaN or inf of one example reaches the others' gradients through
            # the backward pass of a product over the row (0 * inf in the
            # transpose of x @ x.T): the padded layout keeps examples apart
            # (the forward's rare paths do not cover the backward pass)
            self.nonfinite_reruns += 1
            sums = self._padded_sums(args, packed)
        if left:
            sums = _add_sums(sums, self._padded_sums(args, left))
        return self._finish(*sums)

    def _finish(self, total, count, grads):
        if self.reduce == "sum":
            return total, grads
        denom = jnp.maximum(count, 1.0)
        return total / denom, jax.tree_util.tree_map(lambda g: g / denom, grads)

    def _padded_sums(self, args, idxs):
        """(loss sum, logical element count, gradient sums) of examples ``idxs``
        in the padded layout (``value_and_grad(layout="padded", reduce="sum")``)."""
        if self._padded is None:
            self._padded = RaggedValueAndGrad(self.fun, self.in_specs, argnums=self.argnums,
                                              reduce="sum", constraints=self.constraints)
        params = args[self.argnums]
        count = 0
        for k in idxs:  # first: a size where the plain loss fails names its example
            ex = [a[k] for j, a in enumerate(args) if j != self.argnums]
            # the loss's logical elements at this size
            count += int(np.prod(plain_loss_shape(self._example_fun(), [params, *ex],
                                                  self._loss_sizes, f"examples[{k}]")))
        sub = [a if j == self.argnums else [a[k] for k in idxs] for j, a in enumerate(args)]
        total, grads = self._padded(*sub)
        self.compiles_padded = self._padded.compiles
        return total, float(count), grads

    def _run(self, params, infos, lengths):
        """(loss sum, element count, gradient sums) of the packed examples."""
        if not infos:
            return 0.0, 0.0, jax.tree_util.tree_map(jnp.zeros_like, params)
        runner = self.runner
        packing = pack_rows(lengths, runner.row_size, runner.slots, runner.program.gap)
        B = runner.choose_rows_per_call(len(packing.rows))
        p_leaves, p_tree = jax.tree_util.tree_flatten(params)
        fn = self._compiled(len(p_leaves))
        leaf_specs = runner._leaf_specs(infos[0])
        total, count, grads = 0.0, 0.0, None
        for b0 in range(0, len(packing.rows), B):
            rows = packing.rows[b0:b0 + B]
            run_rows = spare_rows(rows, B)  # spare rows: copies, their losses unused
            inputs = runner._inputs(run_rows, infos, lengths, leaf_specs)
            seg = runner.segment_arrays(run_rows, lengths)
            seg_in = [np.stack([s[f] for s in seg]) for f in SEGMENT_FIELDS]
            used = np.zeros((B, runner.slots), bool)
            for r, row in enumerate(rows):
                used[r, :len(row)] = True
            (s, c), g = fn(p_leaves, *inputs, *seg_in, used)
            total, count = total + s, count + c
            grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
        return total, count, jax.tree_util.tree_unflatten(p_tree, grads)

    def _compiled(self, n_params: int):
        prog = self.runner.program
        if self._fn is not None and self._fn_program is prog:
            return self._fn
        # (the runner traces a new program when the examples' static axes or the
        # parameters' structure or shapes change: the step follows it)
        self._fn_program = prog
        row = prog.row_fn(n_params, forward_only=False, rows_axis=ROWS_AXIS)
        n_in = len(prog.packed_axes) + len(SEGMENT_FIELDS)

        def loss_sum(p_leaves, *rest):
            *inputs, used = rest
            outs = jax.vmap(row, in_axes=(None,) * n_params + (0,) * n_in,
                            axis_name=ROWS_AXIS)(*p_leaves, *inputs)
            if len(outs) != 1:
                raise not_one_loss(self.fun, tuple(outs))
            out, kind = outs[0], prog.out_kinds[0]
            if kind == "packed":  # the live positions of real rows' examples
                seg = jax.vmap(lambda *a: Segments.from_arrays(a, prog.gap)
                               .at(prog.out_offset(0)).seg)(*inputs[-len(SEGMENT_FIELDS):])
                live = (seg != self.runner.slots) & jnp.any(used, axis=1)[:, None]  # (B, R)
                valid = _packed_elements(live, seg, out.ndim, _packed_axes(prog))
            elif kind == "segment":
                valid = used  # (B, S)
            else:  # the same loss for every example (an empty sum at every size served)
                examples = jnp.sum(used).astype(out.dtype)
                return jnp.sum(out) * examples, (examples * out.size).astype(out.dtype)
            valid = jnp.broadcast_to(valid.reshape(valid.shape + (1,) * (out.ndim - valid.ndim)),
                                     out.shape)
            s = jnp.sum(jnp.where(valid, out, 0))
            return s, jnp.sum(valid).astype(s.dtype)

        def step(params, *rest):
            self.compiles += 1
            (s, c), g = jax.value_and_grad(loss_sum, has_aux=True)(params, *rest)
            return (s, c), g

        self._fn = jax.jit(step)
        return self._fn


def _packed_axes(prog) -> list[int]:
    """The axes of the loss of one example that are packed (sizes ``n + c``)."""
    return [k for k, d in enumerate(prog.out_shapes[0]) if prog.sizes.offset(d) is not None]


def _packed_elements(live, seg, ndim: int, axes: list[int]):
    """Which entries of a packed loss of rank ``ndim`` (rows first) are an
    example's logical elements: ``live`` (rows x positions) along each packed
    axis, and, along two or more (a per-pair ``(n, n)`` loss), the same
    example's positions only (the block diagonal). A mask along the first
    packed axis alone counted every position of the row in the others: the
    mean of an ``(n, n)`` loss divided by ``row_size * sum(n)``, not
    ``sum(n**2)`` (helper A, AlphaFold's per-pair losses)."""
    def along(x, k):  # (rows, positions) at the loss's axis k (after the rows axis)
        shape = [x.shape[0]] + [1] * (ndim - 1)
        shape[1 + k] = x.shape[1]
        return x.reshape(shape)

    valid = along(live, axes[0])
    for k in axes[1:]:
        valid = valid & along(live, k) & (along(seg, axes[0]) == along(seg, k))
    return valid
