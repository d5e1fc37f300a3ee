"""Differential tester of ``polymask.jit`` as users call it by default: no
``in_specs`` and tiered compiles on. Random sequences of calls whose shapes
coincide with each other and with the weights' sizes (the default specs name
equal sizes alike, and an axis that meets a weight is planned static) must
give ``jax.jit``'s values at every call, before and after background compiles
land."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import polymask as pm

_W = jnp.asarray(np.arange(16 * 3, dtype=np.float32).reshape(16, 3) % 5 - 2)
_B = jnp.asarray(np.arange(16, dtype=np.float32) % 3)

# name -> (function, number of array arguments, whether its last axis must be 16)
FUNCTIONS = {
    "scale": (lambda x: x * 2.0 + 1.0, 1, False),
    "mean_axis1": (lambda x: x.mean(axis=1), 1, False),
    "cumsum": (lambda x: jnp.cumsum(x, axis=0), 1, False),
    "sum_plus": (lambda a, b: a.sum() + b, 2, False),
    "outer": (lambda a, b: a[:, None, :1] * b[None, :, None], 2, False),
    "dense": (lambda x: jnp.tanh(x @ _W), 1, True),
    "bias": (lambda x: x - _B, 1, True),
    "max_rows": (lambda x: x.max(axis=-1) + x[..., 0], 1, False),
}

_SIZES = st.sampled_from([1, 2, 3, 16])


@st.composite
def calls(draw):
    name = draw(st.sampled_from(sorted(FUNCTIONS)))
    _, n_args, feature16 = FUNCTIONS[name]
    shapes = []
    for _ in range(draw(st.integers(2, 6))):
        if n_args == 1:
            rank = 2 if name in ("mean_axis1", "cumsum") else draw(st.integers(2, 3))
            shape = [draw(_SIZES) for _ in range(rank)]
            if feature16:
                shape[-1] = 16
            shapes.append((tuple(shape),))
        else:
            a = (draw(_SIZES), draw(_SIZES))
            b = (draw(_SIZES),)
            shapes.append((a, b))
    return name, shapes


def _value(shape, k):
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * (k + 1)) % 7 - 3


@given(calls())
def test_default_jit_gives_jax_jits_values_at_every_call(case):
    name, shapes = case
    fn = FUNCTIONS[name][0]
    f = pm.jit(fn, tiered=True)
    try:
        for k, arg_shapes in enumerate(shapes):
            args = [_value(s, k) for s in arg_shapes]
            try:
                want = jax.jit(fn)(*args)
            except Exception as plain:  # noqa: BLE001 - plain JAX's failure: the same type
                try:
                    f(*args)
                except type(plain):
                    continue
                raise AssertionError(f"{name}{arg_shapes}: jax.jit raised {plain!r}") from plain
            got = f(*args)
            assert np.shape(got) == np.shape(want), (name, arg_shapes)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6,
                                       err_msg=f"{name} call {k} {arg_shapes}")
        f.wait()
        for k, arg_shapes in enumerate(shapes):  # again, in the programs compiled since
            args = [_value(s, k) for s in arg_shapes]
            try:
                want = jax.jit(fn)(*args)
            except Exception:  # noqa: BLE001
                continue
            np.testing.assert_allclose(f(*args), want, rtol=1e-6, atol=1e-6,
                                       err_msg=f"{name} again {k} {arg_shapes}")
    finally:
        f.wait()
