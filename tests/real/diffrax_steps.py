"""ODE / SDE solves in a scan over a variable number of save times (diffrax style).

Source: https://github.com/patrick-kidger/diffrax (Apache-2.0, Copyright Patrick
Kidger): diffrax/_solver/runge_kutta.py (an explicit Runge--Kutta step; here
the classic RK4 tableau) and diffrax/_solver/euler.py (Euler--Maruyama for
an SDE with additive noise), as driven by ``diffeqsolve(..., saveat=SaveAt(ts=ts))`` with
one step per save interval. The vector field is the neural-ODE MLP of
diffrax's examples/neural_ode.ipynb (Func: MLP with softplus, tanh output).
ts has n save times (a variable-length time grid); y0 and MLP weights are fixed.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .corpus import normal, params, program

SRC = "diffrax https://github.com/patrick-kidger/diffrax/blob/main/"


def _mlp(y, w1, b1, w2, b2):
    return jnp.tanh(jax.nn.softplus(y @ w1 + b1) @ w2 + b2)


def rk4_solve(ts, y0, w1, b1, w2, b2):
    """Neural ODE y' = f(y); returns y at every time of ts (y(ts[0]) = y0)."""
    f = lambda t, y: _mlp(y, w1, b1, w2, b2)

    def step(y, t01):
        t0, t1 = t01
        h = t1 - t0
        k1 = f(t0, y)
        k2 = f(t0 + h / 2, y + h / 2 * k1)
        k3 = f(t0 + h / 2, y + h / 2 * k2)
        k4 = f(t1, y + h * k3)
        y1 = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return y1, y1

    _, ys = lax.scan(step, y0, (ts[:-1], ts[1:]))
    return jnp.concatenate([y0[None], ys])


def euler_maruyama(ts, dw, y0, w1, b1, w2, b2):
    """dy = f(y) dt + 0.1 dW; dw[i] is the Brownian increment over [ts[i-1], ts[i]]
    (dw[0] unused); returns the final state."""
    def step(y, inp):
        t0, t1, w = inp
        return y + (t1 - t0) * _mlp(y, w1, b1, w2, b2) + 0.1 * w, None

    y, _ = lax.scan(step, y0, (ts[:-1], ts[1:], dw[1:]))
    return y


def _mlp_params(rng):
    return (normal(rng, 2, 8, scale=0.5), normal(rng, 8, scale=0.1), normal(rng, 8, 2, scale=0.5),
            normal(rng, 2, scale=0.1))


def _ts(n):
    return np.linspace(0.0, 0.1 * max(n - 1, 0), n).astype(np.float32)


PROGRAMS = [
    program(name="diffrax_neural_ode_rk4",
            source=SRC + "examples/neural_ode.ipynb + diffrax/_solver/runge_kutta.py",
            license="Apache-2.0", fun=rk4_solve, in_specs=("n", None, None, None, None, None),
            make_example=lambda n, rng: (_ts(n), params(60, lambda r: normal(r, 2)))
            + params(61, _mlp_params), bound=8),
    program(name="diffrax_euler_maruyama", source=SRC + "diffrax/_solver/euler.py (SDE)",
            license="Apache-2.0", fun=euler_maruyama,
            in_specs=("n", "n, 2", None, None, None, None, None),
            make_example=lambda n, rng: (_ts(n), normal(rng, n, 2, scale=0.3),
                                         params(60, lambda r: normal(r, 2)))
            + params(61, _mlp_params), bound=8),
]
