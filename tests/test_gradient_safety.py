"""Gradients stay finite and exact whatever the padding computes (issue: real programs).

Each program computes something infinite in the padding (``log(0)``, a division
by a count that is 0 on padded nodes, a loop step past the logical end that
divides by 0); plain JAX never computes those positions or steps, so its
gradients, parameters' included, are finite. ``check_oracle``'s grad mode
differentiates every float argument: the padded ones and the unpadded
parameters, with NaN in the input padding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import polymask as pm
from polymask.testing import check_oracle

RNG = np.random.default_rng(0)


def test_scalar_parameter_times_a_value_infinite_in_the_padding():
    # lax broadcasts the scalar w implicitly: its cotangent sums over every position
    f = lambda x, w: jnp.sum(jnp.log(x) * w) + jnp.sum(w / jnp.cumsum(jnp.ones_like(x)))
    exs = [(RNG.uniform(0.5, 2, size=n).astype(np.float32), np.float32(1.5)) for n in (0, 1, 3, 5)]
    check_oracle(f, exs, [(5,), None], ["n", None])


def test_division_by_a_per_node_count_gathered_to_the_edges():
    """A GAT-style normalisation: counts are 0 on padded nodes (jraph's
    ``segment_sum(ones, receivers, N)[receivers]``)."""

    def layer(x, receivers, b):
        n = x.shape[0]
        count = jax.ops.segment_sum(jnp.ones(receivers.shape[0]), receivers, n)
        h = (x + b) / count[:, None]
        return jnp.tanh(h[receivers]).sum(axis=0)

    def example(n, e):
        receivers = np.concatenate([np.arange(n), RNG.integers(0, max(n, 1), e - n)]) if n else \
            np.zeros(0, np.int32)
        return (RNG.normal(size=(n, 4)).astype(np.float32), receivers.astype(np.int32),
                RNG.normal(size=4).astype(np.float32))

    exs = [example(0, 0), example(1, 2), example(3, 5), example(6, 8)]
    check_oracle(layer, exs, [(6, 4), (8,), None], ["n, 4", "e", None])


def test_scan_steps_past_the_end_that_divide_by_zero():
    # at T = 1 the scan over x[1:] has no step; its padded steps see zeros
    def f(x, w):
        def body(c, b):
            b = b * w
            return c + jnp.where(b.sum(), b / b.sum(), b).sum() * w, None
        return lax.scan(body, jnp.float32(0), x[1:])[0]

    exs = [(RNG.normal(size=(t, 2)).astype(np.float32), np.float32(2.0)) for t in (1, 2, 4)]
    check_oracle(f, exs, [(4, 2), None], ["t, 2", None])


def test_fori_loop_steps_past_the_end_that_divide_by_zero():
    # step k sees count == k; past the logical end (count == t) 1 / (t - count)
    # is infinite in the untaken branch of the where
    def f(x, w):
        t = x.shape[0]

        def body(i, carry):
            count, acc = carry
            term = jnp.where(count < t, w * x[i] / (t - count), 0.0)
            return count + 1.0, acc + term

        return lax.fori_loop(0, t, body, (jnp.float32(0), jnp.float32(0)))[1]

    exs = [(RNG.normal(size=t).astype(np.float32), np.float32(0.5)) for t in (1, 3)]
    check_oracle(f, exs, [(4,), None], ["t", None])


def test_gate_is_exact_on_valid_steps():
    # the same scan with every step valid: gradients equal plain JAX's exactly
    f = lambda x, w: lax.scan(lambda c, r: (c * w + jnp.log(r), None), jnp.float32(1), x)[0]
    x = RNG.uniform(1, 2, size=5).astype(np.float32)
    g = jax.grad(lambda w: pm.mask(f, ("t", None))(pm.Masked(jnp.asarray(x), (5,)), w).data)(0.7)
    np.testing.assert_allclose(g, jax.grad(f, argnums=1)(x, 0.7), rtol=1e-6)


def test_reverse_scan_from_the_last_row_with_a_size_constraint():
    """A Kalman smoother's backward pass (dynamax): the carry starts at the last
    filtered row and the scan runs over the others in reverse; with
    ``constraints=["t >= 1"]`` under jit and vmap (it raised a raw TypeError from
    the scan rule's last-row slice)."""
    def smoother(x, a):
        last = x[-1]

        def step(c, xi):
            c = a * c + xi / (1.0 + jnp.abs(c))
            return c, c

        _, ys = lax.scan(step, last, x[:-1], reverse=True)
        return jnp.concatenate([ys, last[None]]).sum(0)

    exs = [(RNG.normal(size=(n, 2)).astype(np.float32), np.float32(0.7)) for n in (6, 1, 2, 4)]
    check_oracle(smoother, exs, [(6, 2), None], ["t, 2", None], constraints=["t >= 1"])


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_an_empty_graph_in_a_message_passing_layer():
    """jraph's GraphNetwork on an empty graph (N = 0, E = 0) inside a ragged
    batch: segment sums over no edges, a mean by counts clamped to 1."""
    def layer(nodes, senders, receivers, w):
        msgs = jnp.tanh(nodes[senders] @ w)
        agg = jax.ops.segment_sum(msgs, receivers, nodes.shape[0])
        counts = jax.ops.segment_sum(jnp.ones(len(receivers)), receivers, nodes.shape[0])
        return jnp.sum(agg / jnp.maximum(counts, 1.0)[:, None] + nodes @ w)

    def graph(n, e):
        ids = lambda: RNG.integers(0, max(n, 1), size=e).astype(np.int32)
        return (RNG.normal(size=(n, 3)).astype(np.float32), ids(), ids(),
                RNG.normal(size=(3, 3)).astype(np.float32))

    exs = [graph(n, e) for n, e in ((5, 8), (0, 0), (1, 0), (3, 4))]
    check_oracle(layer, exs, [(5, 3), (8,), (8,), None], ["n, 3", "e", "e", None])


@pytest.mark.xfail(strict=True, reason="docs/limitations.md: a value computed as inf whose "
                   "only readers are empty at that size (plain JAX drops a zero-size result's "
                   "dependencies; one program for every size keeps them: 0 * inf)")
def test_an_inf_read_only_by_an_empty_result_keeps_a_finite_gradient():
    # torax's face_grad(two_point_mask) at one cell: 1 / (v[-2] - v[-1]) reads v[0] twice
    def f(v):
        g3 = jnp.concatenate([v[:-2] * 2, jnp.atleast_1d(1.0 / (v[-2] - v[-1]))])
        m = jnp.arange(v.shape[0] + 1) % 3 == 1
        return jnp.concatenate([jnp.where(m[1:-1], v[1:] - v[:-1], g3), v[-1:]])

    x = np.array([1.5], np.float32)
    want = jax.grad(lambda v: f(v).sum())(x)
    assert np.isfinite(want).all()
    padded = np.concatenate([x, np.zeros(7, np.float32)])
    got = jax.grad(lambda d: pm.mask(f, "n")(pm.Masked(d, (1,))).filled(0.0).sum())(padded)
    np.testing.assert_allclose(got[:1], want)
