"""A cost model for choosing the layout: elements computed per equation.

``program_cost(prog, n)`` counts, for one example padded to ``n`` (or one
row of ``n`` packed positions), the elements every equation produces, and
``2 * m * k * n`` multiply-adds for a ``dot_general`` (its FLOPs). A
padded example of bucket ``T`` costs ``program_cost(T)``; a row of ``R``
positions costs ``program_cost(R)`` (attention over a row is ``R^2``,
not the sum of its examples' ``n^2``). A dot of bfloat16 operands is
weighted by the backend's bfloat16 rate (``BF16_DOT_WEIGHT_*``). Inner jaxprs (``jit`` bodies, loop
bodies) count once per call site. The model ranks layouts; it does not
predict seconds (``benchmarks/run.py`` measures those).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from .. import _jax_compat as compat

__all__ = ["program_cost", "padded_cost", "packed_cost"]


def _size(shape, values) -> int:
    out = 1
    for d in shape:
        out *= int(compat.evaluate_dim(d, values)) if compat.is_dim_expr(d) else int(d)
    return max(out, 0)


def _jaxpr_cost(jaxpr, values) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                total += _jaxpr_cost(inner, values)
            elif hasattr(p, "eqns"):
                total += _jaxpr_cost(p, values)
        outs = sum(_size(getattr(v.aval, "shape", ()), values) for v in eqn.outvars)
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            shape = eqn.invars[0].aval.shape
            k = math.prod(_size((shape[a],), values) for a in lc)
            total += 2.0 * outs * k * _dot_weight(eqn)
        else:
            total += outs
    return total


# bfloat16 dots against float32 ones, per FLOP: where the backend multiplies
# bfloat16 natively (AMX, AVX512-BF16, accelerators) about 4x faster
# (benchmarks/roofline.py on a 2-core AMX Xeon: 1,252-1,542 against 266-356
# GFLOP/s), so elementwise work (softmax over a packed row's R^2 scores)
# weighs more (an informal one-process ablation of the hand-written encoder at
# 8 rows of 256: attention 41% of the bfloat16 time); emulated (roofline.py on
# AMD EPYC: 27 against 80 GFLOP/s), bfloat16 dots are about 3x slower
BF16_DOT_WEIGHT_NATIVE = 0.25
BF16_DOT_WEIGHT_EMULATED = 3.0


def _dot_weight(eqn) -> float:
    narrow = all(getattr(v.aval, "dtype", None) == jnp.bfloat16 for v in eqn.invars)
    if not narrow:
        return 1.0
    return BF16_DOT_WEIGHT_NATIVE if compat.native_bfloat16() else BF16_DOT_WEIGHT_EMULATED


def program_cost(prog, var: str, n: int) -> float:
    """Elements (and dot FLOPs) of ``prog`` with dim var ``var`` at ``n``."""
    values = {name: v for name, v in prog.internal_values({var: int(n)}).items()}
    return _jaxpr_cost(prog.closed_jaxpr.jaxpr, values)


def padded_cost(prog, var: str, lengths, policy, batch_size: int) -> float:
    """The padded layout's cost: examples sorted longest first, batches of
    ``batch_size`` padded to the bucket of their longest (``ragged_map``)."""
    order = sorted((int(n) for n in lengths), reverse=True)
    total, cache = 0.0, {}
    for i in range(0, len(order), batch_size):
        T = int(policy(order[i]))
        if T not in cache:
            cache[T] = program_cost(prog, var, T)
        total += cache[T] * min(batch_size, len(order) - i)
    return total


def packed_cost(prog, var: str, rows: int, row_size: int) -> float:
    """The packed layout's cost: ``rows`` rows of ``row_size`` positions."""
    return rows * program_cost(prog, var, row_size)
