"""Interpolation, a cubic spline and an RK4 ODE integrator from jax_cosmo.

Source: https://github.com/DifferentiableUniverseInitiative/jax_cosmo (commit
c4f249f), jax_cosmo/scipy/interpolate.py (interp, InterpolatedUnivariateSpline
with k=3, the only path kept) and jax_cosmo/scipy/ode.py (odeint).
License: MIT, Copyright (c) 2022 Differentiable Universe Initiative.
Copied: ``interp`` and ``odeint`` verbatim (``np`` is jax.numpy there), the
spline's ``__init__`` / ``__call__`` for k=3 as ``CubicSpline``; the number of
knots / time steps is the variable-size axis.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .corpus import program

SRC = ("jax_cosmo https://github.com/DifferentiableUniverseInitiative/jax_cosmo/blob/c4f249f/"
       "jax_cosmo/scipy/")


# -- jax_cosmo/scipy/interpolate.py interp; ode.py odeint; interpolate.py spline (k=3) -------------
@functools.partial(jax.vmap, in_axes=(0, None, None))
def cosmo_interp(x, xp, fp):
    np_ = jnp
    ind = np_.argmin((x - xp) ** 2)
    ind = np_.clip(ind, 1, len(xp) - 2)
    xi = xp[ind]
    s = np_.sign(np_.clip(x, xp[1], xp[-2]) - xi).astype(np_.int64)
    a = (fp[ind + np_.copysign(1, s).astype(np_.int64)] - fp[ind]) / (
        xp[ind + np_.copysign(1, s).astype(np_.int64)] - xp[ind])
    b = fp[ind] - a * xp[ind]
    return a * x + b


def cosmo_odeint(fn, y0, t):
    def rk4(carry, t):
        y, t_prev = carry
        h = t - t_prev
        k1 = fn(y, t_prev)
        k2 = fn(y + h * k1 / 2, t_prev + h / 2)
        k3 = fn(y + h * k2 / 2, t_prev + h / 2)
        k4 = fn(y + h * k3, t)
        y = y + 1.0 / 6.0 * h * (k1 + 2 * k2 + 2 * k3 + k4)
        return (y, t), y

    (yf, _), y = jax.lax.scan(rk4, (y0, jnp.array(t[0])), t)
    return y


class CubicSpline:
    """InterpolatedUnivariateSpline(x, y, k=3, endpoints='not-a-knot'), k=3 path only."""

    def __init__(self, x, y, endpoints="not-a-knot"):
        np_ = jnp
        array, concatenate, zeros = jnp.array, jnp.concatenate, jnp.zeros
        x = np_.atleast_1d(x)
        y = np_.atleast_1d(y)
        assert len(x) == len(y), "Input arrays must be the same length."
        assert x.ndim == 1 and y.ndim == 1, "Input arrays must be 1D."
        n_data = len(x)
        h = np_.diff(x)
        p = np_.diff(y)
        assert n_data > 3, "Not enough input points for cubic spline."
        zero = array([0.0])
        one = array([1.0])
        A00 = one if endpoints == "natural" else array([h[1]])
        A01 = zero if endpoints == "natural" else array([-(h[0] + h[1])])
        A02 = zero if endpoints == "natural" else array([h[0]])
        ANN = one if endpoints == "natural" else array([h[-2]])
        AN1 = -one if endpoints == "natural" else array([-(h[-2] + h[-1])])
        AN2 = zero if endpoints == "natural" else array([h[-1]])
        A = np_.diag(concatenate((A00, 2 * (h[:-1] + h[1:]), ANN)))
        upper_diag1 = np_.diag(concatenate((A01, h[1:])), k=1)
        upper_diag2 = np_.diag(concatenate((A02, zeros(n_data - 3))), k=2)
        lower_diag1 = np_.diag(concatenate((h[:-1], AN1)), k=-1)
        lower_diag2 = np_.diag(concatenate((zeros(n_data - 3), AN2)), k=-2)
        A += upper_diag1 + upper_diag2 + lower_diag1 + lower_diag2
        center = 3 * (p[1:] / h[1:] - p[:-1] / h[:-1])
        s = concatenate((zero, center, zero))
        coefficients = np_.linalg.solve(A, s)
        self._x, self._y, self._coefficients = x, y, coefficients

    def __call__(self, xs):
        x, y, coefficients = self._x, self._y, self._coefficients
        knots = x
        ind = jnp.digitize(xs, knots) - 1
        ind = jnp.clip(ind, 0, len(knots) - 2)
        t = xs - knots[ind]
        h = jnp.diff(knots)[ind]
        c = coefficients[ind]
        c1 = coefficients[ind + 1]
        a = y[ind]
        a1 = y[ind + 1]
        b = (a1 - a) / h - (2 * c + c1) * h / 3.0
        d = (c1 - c) / (3 * h)
        return a + b * t + c * t**2 + d * t**3


# -- the programs ---------------------------------------------------------------------------------
def interp_program(x, xp, fp):
    """Linear interpolation of n + 1 queries in a table of n knots (nearest-knot search)."""
    return cosmo_interp(x, xp, fp)


def _interp_example(n, rng):
    xp = np.sort(rng.random(n) * 10).astype(np.float32) + np.arange(n, dtype=np.float32) * 0.1
    fp = np.sin(xp).astype(np.float32)
    lo, hi = (float(xp[0]), float(xp[-1])) if n else (0.0, 1.0)
    x = (lo + (hi - lo) * rng.random(n + 1)).astype(np.float32)
    return x, xp, fp


def odeint_program(omega, y0, t):
    """A damped oscillator plus a decaying mode, RK4 on n time points."""
    def fn(y, t):
        return jnp.stack([y[1], -omega * y[0] - 0.1 * t * y[1], 0.3 * y[0] - 0.2 * y[2]])
    return cosmo_odeint(fn, y0, t)


def _odeint_example(n, rng):
    return (np.float32(2.0), np.array([1.0, 0.0, 0.5], np.float32),
            np.cumsum(0.05 + 0.1 * rng.random(n)).astype(np.float32))


def spline_program(xs, x, y):
    """A not-a-knot cubic spline through n knots (a dense n x n solve), at 7 points."""
    return CubicSpline(x, y)(xs)


def _spline_example(n, rng):
    x = np.cumsum(0.3 + rng.random(n)).astype(np.float32)
    return np.linspace(0.5, 4.0, 7).astype(np.float32), x, np.cos(x).astype(np.float32)


PROGRAMS = [
    program(name="jaxcosmo_interp",
            source=SRC + "interpolate.py interp (vmapped, clip(ind, 1, len(xp) - 2), xp[-2])",
            license="MIT", fun=interp_program, in_specs=("m", "n", "n"),
            make_example=_interp_example, bound=8, sizes=(0, 1, 2, 3, 5, 8)),
    program(name="jaxcosmo_odeint_rk4", source=SRC + "ode.py odeint", license="MIT",
            fun=odeint_program, in_specs=(None, None, "n"), make_example=_odeint_example,
            bound=8),
    program(name="jaxcosmo_cubic_spline",
            source=SRC + "interpolate.py InterpolatedUnivariateSpline(k=3, endpoints='not-a-knot')",
            license="MIT", fun=spline_program, in_specs=(None, "n", "n"),
            make_example=_spline_example, bound=7, sizes=(0, 1, 3, 4, 7)),
]
