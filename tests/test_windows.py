"""Windowed ops: conv_general_dilated, reduce_window*, select_and_{scatter,gather}_add.

ACCEPTANCE.md case 7 (strided convolution) and its case-15 gradient part, plus
oracle sweeps over strides, dilations, padding modes and logical sizes 0..bound.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import polymask as pm
from polymask.testing import check_oracle, garbage_pad

RNG = np.random.default_rng(0)


def _vec(n):
    return RNG.normal(size=(n,)).astype(np.float32)


def conv1d(x, k, stride=1, padding="VALID", rhs_dilation=1, lhs_dilation=1):
    """1-D convolution of a vector (no gather/reshape: expand_dims/squeeze only)."""
    out = lax.conv_general_dilated(lax.expand_dims(x, (0, 1)), lax.expand_dims(k, (0, 1)),
                                   (stride,), padding, lhs_dilation=(lhs_dilation,),
                                   rhs_dilation=(rhs_dilation,))
    return lax.squeeze(out, (0, 1))


# ----------------------------------------------------------------------------
# ACCEPTANCE case 7 (+ case 15 gradient part)
# ----------------------------------------------------------------------------
X7 = np.arange(1, 8, dtype=np.float32)


def _pad7(n=7):
    return jnp.asarray(garbage_pad(X7[:n], (10,)))


@pytest.mark.parametrize("dynamic", [False, True])
def test_case7_values(dynamic):
    def size(n):
        return jnp.int32(n) if dynamic else n

    valid = pm.mask(lambda x: conv1d(x, jnp.ones(3), 2, "VALID"), "n")
    same = pm.mask(lambda x: conv1d(x, jnp.ones(3), 2, "SAME"), "n")
    out = valid(pm.Masked(_pad7(), (size(7),)))
    np.testing.assert_array_equal(out.unpad(), [6, 12, 18])
    assert int(out.shape[0]) == (7 - 3) // 2 + 1
    out = same(pm.Masked(_pad7(), (size(7),)))
    np.testing.assert_array_equal(out.unpad(), [3, 9, 15, 13])
    assert int(out.shape[0]) == 4  # ceil(7 / 2)
    big = pm.mask(lambda x: conv1d(x, jnp.ones(8), 2, "VALID"), "n")
    out = big(pm.Masked(_pad7(4), (size(4),)))
    assert int(out.shape[0]) == 0
    assert out.unpad().shape == (0,)


def test_case7_one_trace_and_ragged_batch():
    traces = []

    def f(x):
        return conv1d(x, jnp.ones(3), 2, "VALID"), conv1d(x, jnp.ones(3), 2, "SAME")

    def counted(x):
        traces.append(1)
        return f(x)

    m = jax.jit(pm.mask(counted, "n"))
    ns = [7, 4, 3, 1, 0, 10]
    for n in ns:
        xs = np.arange(1, n + 1, dtype=np.float32)
        v, s = m(pm.Masked(jnp.asarray(garbage_pad(xs, (10,))), (jnp.int32(n),)))
        rv, rs = f(jnp.asarray(xs))
        np.testing.assert_array_equal(v.unpad(), rv)
        np.testing.assert_array_equal(s.unpad(), rs)
    assert len(traces) == 1
    # ragged batch
    data = jnp.stack([jnp.asarray(garbage_pad(np.arange(1, n + 1, dtype=np.float32), (10,)))
                      for n in ns])
    v, s = jax.vmap(pm.mask(f, "n"))(pm.Masked(data, (jnp.asarray(ns, jnp.int32),)))
    for i, n in enumerate(ns):
        rv, rs = f(jnp.arange(1, n + 1, dtype=jnp.float32))
        assert int(v.shape[0][i]) == rv.shape[0] and int(s.shape[0][i]) == rs.shape[0]
        np.testing.assert_array_equal(v.data[i, :rv.shape[0]], rv)
        np.testing.assert_array_equal(s.data[i, :rs.shape[0]], rs)


def test_case7_oracle_with_gradients():
    """Case 15 for case 7: grad finite, 0 in padding, equal on the logical region."""
    k = np.array([1.0, -2.0, 0.5], np.float32)
    exs = [(X7[:n], k) for n in (7, 4, 3, 0, 2)]
    for pad in ("VALID", "SAME"):
        check_oracle(lambda x, k, pad=pad: conv1d(x, k, 2, pad), exs, [(10,), None],
                     ("n", None))
    check_oracle(lambda x: conv1d(x, jnp.ones(8), 2, "VALID"), [(X7[:4],), (X7,)], [(10,)])


# ----------------------------------------------------------------------------
# Sweeps: strides 1-3, dilations 1-2, padding modes, logical sizes 0..bound
# ----------------------------------------------------------------------------
BOUND = 7
PADS = ["VALID", "SAME", "SAME_LOWER", [(1, 2)], [(-1, 1)]]


def _conv_sweep_fn(stride):
    k3 = jnp.array([1.0, 2.0, -1.0])
    k2 = jnp.array([0.5, -1.5])

    def f(x):
        outs = []
        for pad in PADS:
            for k, rd in ((k3, 1), (k3, 2), (k2, 1)):
                outs.append(conv1d(x, k, stride, pad, rhs_dilation=rd))
        return outs

    return jax.jit(f)  # jit: the unpadded references compile once per size


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_conv1d_sweep(stride):
    f = _conv_sweep_fn(stride)
    exs = [(_vec(n),) for n in range(BOUND + 1)]
    check_oracle(f, exs, [(BOUND,)], modes=("jit", "vmap"))
    check_oracle(f, [exs[0], exs[BOUND]], [(BOUND,)], modes=("eager",))
    check_oracle(f, [exs[4]], [(BOUND,)], modes=("grad",))


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_conv1d_lhs_dilation_sweep(stride):
    """Transposed-conv style lhs dilation (sizes >= 1: see test_lhs_dilation_size0)."""
    k3 = jnp.array([1.0, 2.0, -1.0])

    def f(x):
        return [conv1d(x, k3, stride, pad, rhs_dilation=rd, lhs_dilation=2)
                for pad in ([(0, 0)], [(1, 1)], [(2, 1)], [(0, -1)]) for rd in (1, 2)]

    exs = [(_vec(n),) for n in range(1, BOUND + 1)]
    check_oracle(jax.jit(f), exs, [(BOUND,)], modes=("jit", "vmap"))
    check_oracle(jax.jit(f), [exs[3]], [(BOUND,)], modes=("grad",))


def _rw_sweep_fn(stride, base_dilation, for_grad=False):
    """for_grad: JAX has no VJP for max pooling with window dilation or pad < 0."""
    def f(x):
        outs = []
        for pad in PADS[:-1] if for_grad else PADS:  # JAX's own VJP rejects pad < 0
            for wd in (1, 2):
                kw = dict(window_dilation=(wd,), base_dilation=(base_dilation,))
                if wd == 1 or not for_grad:
                    outs.append(lax.reduce_window(x, -jnp.inf, lax.max, (3,), (stride,), pad,
                                                  **kw))
                if wd == 1:
                    outs.append(lax.reduce_window(x, 0.0, lax.add, (2,), (stride,), pad, **kw))
        if base_dilation == 1:
            outs.append(lax.reduce_window(x, jnp.inf, lax.min, (3,), (stride,), "SAME"))
        return outs

    return jax.jit(f)


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_reduce_window_sweep(stride):
    f = _rw_sweep_fn(stride, 1)
    exs = [(_vec(n),) for n in range(BOUND + 1)]
    check_oracle(f, exs, [(BOUND,)], modes=("jit", "vmap"))
    check_oracle(f, [exs[0], exs[BOUND]], [(BOUND,)], modes=("eager",))
    check_oracle(_rw_sweep_fn(stride, 1, True), [exs[3]], [(BOUND,)], modes=("grad",))


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_reduce_window_base_dilation_sweep(stride):
    """Base dilation 2, sizes >= 1 (see test_dilation_at_size_0)."""
    f = _rw_sweep_fn(stride, 2)
    exs = [(_vec(n),) for n in range(1, BOUND + 1)]
    check_oracle(f, exs, [(BOUND,)], modes=("jit", "vmap"))
    check_oracle(_rw_sweep_fn(stride, 2, True), [exs[3]], [(BOUND,)], modes=("grad",))
