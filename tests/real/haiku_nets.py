"""An MLP over N rows and an LSTM unrolled over T steps, built with the
installed dm-haiku.

Source: https://github.com/google-deepmind/dm-haiku (dm-haiku 0.0.17, as installed):
``hk.transform`` of ``hk.nets.MLP`` and of ``hk.LSTM`` + ``hk.dynamic_unroll``
(time-major) with an ``hk.Linear`` head, as in haiku's README and
examples/rnn (``hk.dynamic_unroll`` over a sequence); applied with fixed
parameters (``init`` once with a fixed key).
License: Apache-2.0, Copyright 2019 DeepMind Technologies Limited.
The programs call haiku itself (an installed dependency of the real extra);
only the wrappers that flatten the parameters and turn one input into arrays
with a variable-size axis are ours.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp

from .corpus import flat, normal, program

SRC = "dm-haiku https://github.com/google-deepmind/dm-haiku/blob/v0.0.17/haiku/_src/"


def _mlp(x):
    return hk.nets.MLP([16, 16, 2])(x)


def _lstm(xs):
    core = hk.LSTM(8)
    outs, _ = hk.dynamic_unroll(core, xs, core.initial_state(1))
    return hk.Linear(2)(outs[:, 0, :])


_NETS = {"mlp": (_mlp, (1, 5)), "lstm": (_lstm, (1, 1, 4))}


@functools.cache
def _net(kind):
    f, shape = _NETS[kind]
    net = hk.without_apply_rng(hk.transform(f))
    leaves, rebuild = flat(net.init(jax.random.PRNGKey(0), jnp.zeros(shape)))
    return leaves, lambda ls, x: net.apply(rebuild(ls), x)


def mlp_program(x, *leaves):
    """hk.nets.MLP on n rows of 5 features."""
    return _net("mlp")[1](leaves, x)


def lstm_program(xs, *leaves):
    """hk.LSTM over t steps (time-major, batch 1) with a linear read-out per step."""
    return _net("lstm")[1](leaves, xs)


def _mlp_example(n, rng):
    return (normal(rng, n, 5),) + _net("mlp")[0]


def _lstm_example(t, rng):
    return (normal(rng, t, 1, 4),) + _net("lstm")[0]


PROGRAMS = [
    program(name="haiku_mlp", source=SRC + "nets/mlp.py MLP", license="Apache-2.0",
            fun=mlp_program, in_specs=lambda: ("n, 5",) + (None,) * len(_net("mlp")[0]),
            make_example=_mlp_example, bound=12),
    program(name="haiku_lstm_dynamic_unroll", source=SRC + "recurrent.py LSTM, dynamic_unroll",
            license="Apache-2.0", fun=lstm_program,
            in_specs=lambda: ("t, 1, 4",) + (None,) * len(_net("lstm")[0]),
            make_example=_lstm_example, bound=10),
]
