"""jnp.array_equal / array_equiv on arrays whose sizes are different dim vars:
JAX's structural answer to ``n == m`` would make them False even where the
sizes are equal at run time; polymask splits the trace there instead."""

import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm
from polymask.testing import check_oracle

A = np.arange(3.0, dtype=np.float32)
B = np.array([0.0, 1.0], np.float32)


@pytest.mark.parametrize("fun", [
    jnp.array_equal,
    lambda x, y: jnp.array_equal(x, y[::-1], equal_nan=True),
    lambda x, y: jnp.array_equal(x[:, None] * 2, y[:, None] + y[:, None]),
], ids=["plain", "reversed", "2d"])
def test_array_equal_of_two_dim_vars(fun):
    exs = [(A, A), (A, A[:2]), (A[:0], A[:0]), (A[:1], A[:1] + 1), (A[:0], A[:1]), (A[:2], B)]
    check_oracle(fun, exs, [(5,), (5,)], ("n", "m"), modes=("eager", "jit", "vmap"))
    # polymask.jit and ragged_map run the same masked function
    assert bool(pm.jit(fun, ("n", "m"))(A, A.copy())) == bool(fun(A, A.copy()))
    outs = pm.ragged_map(fun, ("n", "m"))([(A, A), (A[:2], B), (A, B)])
    assert [bool(o) for o in outs] == [bool(fun(A, A)), bool(fun(A[:2], B)), bool(fun(A, B))]


def test_array_equiv_broadcasts_where_plain_jax_does_and_raises_where_it_raises():
    exs = [(A, A), (A[:1], A), (A, A[:1]), (A[:0], A[:0]), (A[:0], A[:1]), (A[:2], B)]
    check_oracle(jnp.array_equiv, exs, [(5,), (5,)], ("n", "m"), modes=("eager", "jit", "vmap"))
    with pytest.raises(TypeError):  # plain JAX: (3,) and (2,) do not broadcast
        jnp.array_equiv(A, B)
    with pytest.raises(pm.ShapeError, match="incompatible shapes"):
        pm.mask(jnp.array_equiv, ("n", "m"))(pm.pad(A, (5,)), pm.pad(B, (5,)))
