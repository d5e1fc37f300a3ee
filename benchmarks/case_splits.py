"""Leaf counts and trace times of case splits (issue 11's cases).

For each function: the number of cases (leaves of the decision tree, error
cases included), the time to trace all of them (``MaskedFunction.cases``, a
fresh ``mask`` each round, median of 5), and the trace time of the same
function with the sizes fixed by a constraint where one exists (one leaf), so
the cost per extra leaf can be read off. Run in a fresh process:

    python benchmarks/case_splits.py
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import polymask as pm


def _if(x):
    return x * 2 if x.shape[0] > 2 else x * 3


def _cond(x):
    return lax.cond(x.shape[0] > 2, lambda v: v * 2, lambda v: v * 3, x)


def _eq(x):
    return x * 100.0 if x.shape[0] == 1 else x + 1.0


CASES = [
    ("x[:1]", lambda x: x[:1], 4),
    ("x[-1:]", lambda x: x[-1:], 4),
    ("lax.pad interior", lambda x: lax.pad(x, 0.0, [(0, 0, 1)]), 8),
    ("python if n > 2", _if, 8),
    ("lax.cond n > 2", _cond, 8),
    ("python if n == 1", _eq, 8),
    ("grad det(a a^T + 3I)", None, 4),
    ("lax.top_k(x, 2)", lambda x: lax.top_k(x, 2)[0], 8),
    ("jnp.split(x, [2, 5])", lambda x: jnp.split(x, [2, 5]), 8),
    ("jnp.pad symmetric", lambda x: jnp.pad(x, 1, mode="symmetric"), 8),
    ("jnp.linspace(0, 1, n)", lambda x: jnp.linspace(0, 1, x.shape[0]), 8),
    ("jnp.diff(x[1:])", lambda x: jnp.diff(x[1:]), 8),
    ("jnp.roll(x, 2)", lambda x: jnp.roll(x, 2), 8),
    ("jnp.pad wrap", lambda x: jnp.pad(x, 1, mode="wrap"), 8),
    ("sum(x * x) (no split)", lambda x: jnp.sum(x * x), 8),
]


def _det_grad():
    def f(a):
        return jnp.linalg.det(a @ a.T + 3 * jnp.eye(a.shape[0]))
    return jax.grad(f)


def measure(fun, bound, spec, rounds=5):
    times, n = [], None
    for _ in range(rounds):
        m = pm.mask(fun, spec)
        arg = pm.Masked(jnp.zeros(bound if spec == "n" else (bound, bound)),
                        (1,) if spec == "n" else (1, 1))
        t0 = time.perf_counter()
        tree, _ = m.cases(arg)
        times.append(time.perf_counter() - t0)
        n = (len(tree.cases), sum(c.error is not None for c in tree.cases))
    return n, statistics.median(times)


def main():
    print(f"jax {jax.__version__}, polymask {pm.__version__}")
    print("| function | bound | cases (errors) | trace all cases [ms] | per case [ms] |")
    print("|---|---|---|---|---|")
    for name, fun, bound in CASES:
        spec = "n"
        if fun is None:
            fun, spec = _det_grad(), "n, n"
        (k, errs), t = measure(fun, bound, spec)
        print(f"| {name} | {bound} | {k} ({errs}) | {1e3 * t:.1f} | {1e3 * t / k:.1f} |")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
