"""Masked evaluation metrics from CLU (CommonLoopUtils).

Source: https://github.com/google/CommonLoopUtils (commit 04ad2f9),
clu/metrics.py (_broadcast_masks, Average, Std, Accuracy).
License: Apache-2.0, Copyright 2026 The CLU Authors.
Copied: the metrics' ``from_model_output`` / ``merge`` / ``compute``
arithmetic verbatim; the ``flax.struct.dataclass`` classes are plain classes
here (no ``Metric`` base, no ``Collection``). n examples, a mask of valid ones.
"""

import jax.numpy as jnp
import numpy as np

from .corpus import normal, program

SRC = "clu https://github.com/google/CommonLoopUtils/blob/04ad2f9/clu/metrics.py"


# -- clu/metrics.py -------------------------------------------------------------------------------
def _broadcast_masks(values, mask):
    if values.ndim == 0:
        values = values[None]
    if mask is None:
        mask = jnp.ones_like(values)
    if mask.shape[0] != values.shape[0]:
        raise ValueError("Argument `mask` must have the same leading dimension as `values`.")
    if mask.ndim < values.ndim:
        mask = jnp.expand_dims(mask, axis=tuple(np.arange(mask.ndim, values.ndim)))
    mask = mask.astype(bool)
    return values, mask


class Average:
    def __init__(self, total, count):
        self.total, self.count = total, count

    @classmethod
    def from_model_output(cls, values, mask=None, **_):
        values, mask = _broadcast_masks(values, mask)
        return cls(
            total=jnp.where(mask, values, jnp.zeros_like(values)).sum(),
            count=jnp.where(mask, jnp.ones_like(values, dtype=jnp.int32),
                            jnp.zeros_like(values, dtype=jnp.int32)).sum())

    def merge(self, other):
        return type(self)(total=self.total + other.total, count=self.count + other.count)

    def compute(self):
        return self.total / self.count


class Std:
    def __init__(self, total, sum_of_squares, count):
        self.total, self.sum_of_squares, self.count = total, sum_of_squares, count

    @classmethod
    def from_model_output(cls, values, mask=None, **_):
        values, mask = _broadcast_masks(values, mask)
        return cls(
            total=jnp.where(mask, values, jnp.zeros_like(values)).sum(),
            sum_of_squares=jnp.where(mask, values**2, jnp.zeros_like(values)).sum(),
            count=jnp.where(mask, jnp.ones_like(values, dtype=jnp.int32),
                            jnp.zeros_like(values, dtype=jnp.int32)).sum())

    def compute(self):
        mean = self.total / self.count
        variance = self.sum_of_squares / self.count - mean**2
        variance = jnp.clip(variance, min=0.0)
        return variance**.5


class Accuracy(Average):
    @classmethod
    def from_model_output(cls, *, logits, labels, **kwargs):
        if logits.ndim != labels.ndim + 1 or labels.dtype != jnp.int32:
            raise ValueError("Expected labels.dtype==jnp.int32 and logits.ndim==labels.ndim+1")
        metric = super().from_model_output(
            values=(logits.argmax(axis=-1) == labels).astype(jnp.float32), **kwargs)
        return cls(metric.total, metric.count)


# -- the program ----------------------------------------------------------------------------------
def metrics_program(logits, labels, mask, loss):
    """Masked accuracy (merged with a second batch), masked Std and Average of n examples."""
    acc = Accuracy.from_model_output(logits=logits, labels=labels, mask=mask)
    acc2 = acc.merge(Accuracy.from_model_output(logits=logits[::-1], labels=labels))
    std = Std.from_model_output(loss, mask=mask)
    avg = Average.from_model_output(loss[:, None] * logits, mask=mask)
    return acc.compute(), acc2.compute(), acc.count, std.compute(), avg.compute()


def _metrics_example(n, rng):
    mask = (rng.random(n) < 0.8).astype(np.int32)
    if n:
        mask[0] = 1
    return (normal(rng, n, 5), rng.integers(0, 5, n).astype(np.int32), mask,
            np.abs(normal(rng, n)))


PROGRAMS = [
    program(name="clu_metrics_accuracy_std_average", source=SRC + " Accuracy, Std, Average (masked)",
            license="Apache-2.0", fun=metrics_program, in_specs=("n, 5", "n", "n", "n"),
            make_example=_metrics_example, bound=8),
]
