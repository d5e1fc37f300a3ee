"""Numerical integration, called from the installed quadax.

Source: https://github.com/f0uriest/quadax (quadax 0.3.1, as installed):
``quadax.trapezoid`` and ``quadax.cumulative_simpson`` of n samples, and
adaptive Gauss-Kronrod ``quadax.quadgk`` of a mixture of n Gaussian bumps
(the components passed through ``args``), as in quadax's README.
License: MIT, Copyright (c) 2023 Rory Conlin.
The programs call quadax itself (an installed dependency of the real extra);
only the wrappers that turn one problem into arrays with a variable-size axis
are ours.
"""

import jax.numpy as jnp
import numpy as np
import quadax

from .corpus import program

SRC = "quadax https://github.com/f0uriest/quadax/blob/v0.3.1/quadax/"


def trapezoid_program(x, y):
    """Trapezoidal rule over n (unevenly spaced) samples."""
    return quadax.trapezoid(y, x=x)


def cumsimpson_program(x, y):
    """Cumulative Simpson integral at each of n samples (initial 0)."""
    return quadax.cumulative_simpson(y, x=x, initial=0.0)


def _mixture(t, w, mu):
    return jnp.sum(w * jnp.exp(-((t - mu) ** 2)))


def quadgk_program(w, mu):
    """Adaptive Gauss-Kronrod integral over [-3, 3] of a sum of n Gaussian bumps."""
    y, _ = quadax.quadgk(_mixture, jnp.array([-3.0, 3.0]), args=(w, mu),
                         epsabs=1e-6, epsrel=1e-6)
    return y


def _samples_example(n, rng):
    x = np.sort(rng.uniform(0, 3, n)).astype(np.float32)
    return x, np.sin(x).astype(np.float32)


def _mixture_example(n, rng):
    return (rng.random(n).astype(np.float32),
            rng.uniform(-2, 2, n).astype(np.float32))


PROGRAMS = [
    program(name="quadax_trapezoid", source=SRC + "sampled.py trapezoid", license="MIT",
            fun=trapezoid_program, in_specs=("n", "n"), make_example=_samples_example,
            bound=12),
    program(name="quadax_cumulative_simpson", source=SRC + "sampled.py cumulative_simpson",
            license="MIT", fun=cumsimpson_program, in_specs=("n", "n"),
            make_example=_samples_example, bound=12, sizes=(3, 4, 7, 12),
            pmjit_sizes=(3, 4, 7, 11, 12), constraints=("n >= 3",), rtol=1e-3, atol=1e-3,
            note="n >= 3 samples (Simpson's rule)"),
    program(name="quadax_quadgk_mixture", source=SRC + "adaptive.py quadgk", license="MIT",
            fun=quadgk_program, in_specs=("n", "n"), make_example=_mixture_example,
            bound=8, rtol=1e-3, atol=1e-3),
]
