"""1-D interpolation, called from the installed interpax.

Source: https://github.com/f0uriest/interpax (interpax 0.3.16, as installed):
``interpax.interp1d(xq, x, f, method="cubic2")`` at n query points on fixed
knots, and ``interpax.CubicSpline(x, y, check=False)`` through n knots evaluated at fixed
points, as in interpax's README.
License: MIT, Copyright (c) 2023 Rory Conlin.
The programs call interpax itself (an installed dependency of the real extra);
only the wrappers that turn one problem into arrays with a variable-size axis
are ours.
"""

import interpax
import jax.numpy as jnp
import numpy as np

from .corpus import program

SRC = "interpax https://github.com/f0uriest/interpax/blob/v0.3.16/interpax/"
KNOTS = np.linspace(0.0, 2 * np.pi, 8).astype(np.float32)


def queries_program(xq, f):
    """C1 cubic interpolation of 8 fixed knots' values at n query points."""
    return interpax.interp1d(xq, jnp.asarray(KNOTS), f, method="cubic2")


def spline_program(x, y):
    """A not-a-knot cubic spline through n knots, evaluated at 5 fixed points."""
    xq = jnp.linspace(0.1, 0.9, 5)
    return interpax.CubicSpline(x, y, check=False)(xq)


def _queries_example(n, rng):
    return (rng.uniform(0, 2 * np.pi, n).astype(np.float32),
            np.sin(KNOTS).astype(np.float32))


def _spline_example(n, rng):
    x = np.sort(np.concatenate([[0.0, 1.0], rng.uniform(0.05, 0.95, n - 2)])).astype(np.float32)
    return x, np.cos(3 * x).astype(np.float32)


PROGRAMS = [
    program(name="interpax_interp1d_queries", source=SRC + "_spline.py interp1d",
            license="MIT", fun=queries_program, in_specs=("n", "8"),
            make_example=_queries_example, bound=12),
    program(name="interpax_cubic_spline_knots", source=SRC + "_ppoly.py CubicSpline",
            license="MIT", fun=spline_program, in_specs=("n", "n"),
            make_example=_spline_example, bound=10, sizes=(4, 5, 7, 10),
            pmjit_sizes=(4, 5, 7, 9, 10), constraints=("n >= 4",), rtol=1e-3, atol=1e-3,
            note="n >= 4 knots, the first at 0 and the last at 1"),
]
