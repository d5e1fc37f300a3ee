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

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.buckets import as_policy
from ..core.errors import ShapeError
from ..core.masked import Masked, stack
from ..tracing.transform import mask

__all__ = ["value_and_grad", "RaggedValueAndGrad"]


def _batch_size(x) -> int:
    return int(np.shape(x.data if isinstance(x, Masked) else x)[0])


def _take_pad(x, b: int, total: int):
    """Pad the batch axis from ``b`` to ``total`` by repeating example 0 (weight 0)."""
    if total == b:
        return x
    idx = np.concatenate([np.arange(b), np.zeros(total - b, np.int64)])
    if isinstance(x, Masked):
        return Masked(np.asarray(x.data)[idx], tuple(np.asarray(s)[idx] for s in x.shape))
    return jax.tree_util.tree_map(lambda a: np.asarray(a)[idx], x)


class RaggedValueAndGrad:
    """The callable ``value_and_grad`` returns: ``vg(params, *batch) -> (loss, grads)``."""

    def __init__(self, fun: Callable, in_specs=None, *, argnums: int | Sequence[int] = 0,
                 reduce: str = "mean", buckets=None, batch_buckets=None, checks: bool = False):
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        self.fun = fun
        self.argnums = argnums
        self._unbatched = {argnums} if isinstance(argnums, int) else set(argnums)
        self.reduce = reduce
        self._masked = mask(fun, in_specs, checks=checks)
        self._policy = as_policy(buckets) if buckets is not None else None
        self._batch_policy = as_policy(batch_buckets) if batch_buckets is not None else None
        self.compiles = 0
        self._jitted = jax.jit(self._value_and_grad)

    def _loss(self, weights, *args):
        in_axes = tuple(None if i in self._unbatched else 0 for i in range(len(args)))
        out = jax.vmap(self._masked, in_axes=in_axes)(*args)
        if not isinstance(out, Masked):
            raise ShapeError("value_and_grad: fun must return one array (its loss), got "
                             f"{jax.tree_util.tree_structure(out)}")
        w = weights.reshape(weights.shape + (1,) * (out.data.ndim - 1))
        keep = out.valid() & (w > 0)
        total = jnp.sum(jnp.where(keep, out.data, 0))
        if self.reduce == "sum":
            return total
        return total / jnp.maximum(jnp.sum(keep), 1).astype(total.dtype)

    def _value_and_grad(self, weights, *args):
        self.compiles += 1  # runs once per trace, i.e. per compiled signature
        argnums = (1 + self.argnums if isinstance(self.argnums, int)
                   else tuple(1 + i for i in self.argnums))  # weights come first
        return jax.value_and_grad(self._loss, argnums=argnums)(weights, *args)

    def prepare(self, *args) -> tuple[Any, tuple]:
        """(example weights, args): lists of exact arrays stacked into ragged
        batches (padded by ``buckets``), the batch padded by ``batch_buckets``."""
        args = list(args)
        for i, a in enumerate(args):
            if i not in self._unbatched and isinstance(a, (list, tuple)) and a and \
                    not isinstance(a[0], (list, tuple, dict)):
                args[i] = stack(list(a), buckets=self._policy)
        sizes = {_batch_size(a) for i, a in enumerate(args) if i not in self._unbatched}
        if len(sizes) != 1:
            raise ShapeError(f"value_and_grad: batched arguments have different batch sizes "
                             f"{sorted(sizes)}")
        (b,) = sizes
        total = self._batch_policy(b) if self._batch_policy is not None else b
        weights = np.concatenate([np.ones(b, np.float32), np.zeros(total - b, np.float32)])
        args = [a if i in self._unbatched else _take_pad(a, b, total)
                for i, a in enumerate(args)]
        return weights, tuple(args)

    def __call__(self, *args):
        weights, args = self.prepare(*args)
        return self._jitted(weights, *args)


def value_and_grad(fun: Callable, in_specs=None, *, argnums: int | Sequence[int] = 0,
                   reduce: str = "mean", buckets=None, batch_buckets=None,
                   checks: bool = False) -> RaggedValueAndGrad:
    """Loss and gradients of ``fun`` over a ragged batch, as plain arrays.

    Args:
      fun: ``fun(params, *example)``, written for one exact example, returns
        its loss: a scalar, or per-element losses (e.g. ``(n,)`` per-token).
      in_specs: specs of one example's arguments, as for ``polymask.mask``
        (a dict by parameter name leaves ``params`` unpadded:
        ``{"tokens": "n", "labels": "n"}``).
      argnums: the argument(s) differentiated; they are not batched. Every
        other argument is batched along axis 0: a ragged batch
        (``polymask.stack``), a list of exact arrays (stacked here, padded by
        ``buckets``), or an array whose leading axis is the batch.
      reduce: ``"mean"``: the mean over all logical elements of all examples
        (per-token losses: the mean over the batch's tokens; scalar losses:
        over examples); ``"sum"``: their sum.
      buckets: policy for the per-example bounds of lists of exact arrays.
      batch_buckets: policy for the batch size (padded with zero-weight
        copies of example 0), so a short last batch does not compile again.
      checks: run the masked prologue checks (sizes from ``stack`` are valid
        by construction, so off by default: no host callback in the program).

    Returns:
      ``vg(params, *batch) -> (loss, grads)``: ``loss`` a scalar array,
      ``grads`` shaped like ``params``; equal to ``jax.value_and_grad`` of the
      same reduction computed example by example on exact arrays.
      ``vg.compiles`` counts the compiled signatures.

    Raises:
      ShapeError: ``fun`` does not return one array, a spec does not fit, or
        examples of one batch disagree in rank or static sizes.
      UnsupportedError: a primitive in ``fun`` has no masking rule.

    Padding rows of the batch and padded positions of each example are
    dropped with ``where`` (never multiplied by 0), so NaN in padding cannot
    reach the loss or the gradients.
    """
    return RaggedValueAndGrad(fun, in_specs, argnums=argnums, reduce=reduce, buckets=buckets,
                              batch_buckets=batch_buckets, checks=checks)
