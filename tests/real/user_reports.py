"""Small programs from the outside user's report on issue #27 (not from a library).

Source: polymask issue #27 (the reported patterns, reduced to the lines that
show them; each is a pattern found in real code, cited per program).
License: Apache-2.0 (this repository).
"""

import jax.numpy as jnp
from jax import lax

from .corpus import normal, params, program

SRC = "issue27 polymask issue #27 report:"


def scan_normalize(x, w):
    """A running sum of normalised steps: the body divides by its own sum, guarded
    by ``jnp.where(b.sum(), ...)`` (the dynamax ``_normalize`` idiom); ``w`` is an
    unpadded parameter."""
    def body(c, xt):
        b = xt * w
        b = jnp.where(b.sum(), b / b.sum(), b)
        return c + b, b

    return lax.scan(body, jnp.zeros(x.shape[1]), x)


def inverse_length(x):
    """``scale = 1.0 / n`` with ``n = x.shape[0]`` (Python division by a size)."""
    n = x.shape[0]
    return jnp.sum(x ** 2) * (1.0 / n)


def len_mean(x):
    """``x.sum(0) / len(x)`` over more than 16 possible sizes."""
    return x.sum(0) / len(x)


PROGRAMS = [
    program(name="report_scan_where_normalize", source=SRC + " scan body b / b.sum()",
            license="Apache-2.0", fun=scan_normalize, in_specs=("t, 3", None),
            make_example=lambda n, rng: (normal(rng, n, 3), params(100, lambda r: normal(r, 3))),
            bound=8),
    program(name="report_python_inverse_length", source=SRC + " 1.0 / x.shape[0]",
            license="Apache-2.0", fun=inverse_length, in_specs=("n, 2",),
            make_example=lambda n, rng: (normal(rng, n, 2),), bound=8),
    program(name="report_len_past_16_sizes", source=SRC + " len(x) with bound 16",
            license="Apache-2.0", fun=len_mean, in_specs=("n, 2",),
            make_example=lambda n, rng: (normal(rng, n, 2),), bound=16,
            sizes=(0, 1, 9, 16), pmjit_sizes=(1, 9, 16)),
]
