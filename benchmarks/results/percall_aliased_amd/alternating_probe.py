"""Per-call probe behind ``alternating.txt``: ``sum(x * x)`` on 100 float32,
``polymask.jit`` and ``jax.jit``, NumPy and ``jax.Array`` inputs, best of 7
blocks of 20,000 calls (us per call). Run in fresh processes, alternating two
checkouts, e.g.::

    for r in 1 2 3 4; do for w in before after; do
      PYTHONPATH=/tmp/wt_$w/src python alternating_probe.py; done; done
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import polymask as pm


def per_call_us(fn, x, n: int = 20000) -> float:
    for _ in range(200):
        fn(x)
    best = 1e9
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(x)
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    def f(x):
        return jnp.sum(x * x)

    runners = {"pm": pm.jit(f, in_specs=("n",)), "jj": jax.jit(f)}
    xn = np.arange(100, dtype=np.float32)
    inputs = {"np": xn, "arr": jnp.asarray(xn)}
    for name, fn in runners.items():
        for kind, x in inputs.items():
            print(name, kind, round(per_call_us(fn, x), 2))


if __name__ == "__main__":
    main()
