"""Shared test helpers: model functions and a cheaper oracle wrapper."""

import jax
import jax.numpy as jnp

from polymask.testing import check_oracle


def attention(x, wq, wk, wv, wo):
    """ACCEPTANCE case 13: causal self-attention with 4 heads on x of shape (n, 64)."""
    n = x.shape[0]
    q = (x @ wq).reshape(n, 4, 16).transpose(1, 0, 2)
    k = (x @ wk).reshape(n, 4, 16).transpose(1, 0, 2)
    v = (x @ wv).reshape(n, 4, 16).transpose(1, 0, 2)
    s = q @ k.transpose(0, 2, 1) / jnp.sqrt(16.0)
    causal = jnp.tril(jnp.ones((n, n)))
    s = jnp.where(causal[None] > 0, s, -1e9)
    p = jax.nn.softmax(s, axis=-1)
    o = (p @ v).transpose(1, 0, 2).reshape(n, 64)
    return o @ wo


def oracle(fun, exs, bounds, in_specs=None, *, modes=("eager", "jit", "vmap", "grad"),
           n_grad=2, **kw):
    """``check_oracle`` with the (costly, one compile per example) grad check on
    the first ``n_grad`` examples and the static-size eager run on the first."""
    fast = tuple(m for m in modes if m != "grad")
    if fast:
        check_oracle(fun, exs, bounds, in_specs, modes=fast, static_sizes=False, **kw)
        if "eager" in fast:
            check_oracle(fun, exs[:1], bounds, in_specs, modes=("eager",), **kw)
    if "grad" in modes:
        check_oracle(fun, exs[:n_grad], bounds, in_specs, modes=("grad",), **kw)


def eventually(condition, what: str, limit_s: float = 120.0) -> None:
    """Poll ``condition()`` until it holds (background work finishing on its
    own). ``limit_s`` only stops a hang: no duration is asserted (speed
    belongs in benchmarks/)."""
    import time

    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


def channel_batches(seed: int = 0, channels=(3, 5, 3, 7), lengths=(2, 5, 9)):
    """``(W (4, C), [x (C, n) for n in lengths])`` per call: batches whose leading
    axis is one size within a call and another in the next, but must stay
    static (``W @ x`` needs it as a constant)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for c in channels:
        yield (rng.normal(size=(4, c)).astype(np.float32),
               [rng.normal(size=(c, n)).astype(np.float32) for n in lengths])
