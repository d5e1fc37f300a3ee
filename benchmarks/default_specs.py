"""Program sharing of ``polymask.jit`` without ``in_specs`` on ecosystem models.

Each model (equinox, haiku, optax; weights closed over or passed as
arguments; functions of arguments with related sizes, T and T + 1, and a
first call whose sizes coincide) is called on 6-31 exact shapes with ``polymask.jit(f)`` and with
``jax.jit(f)``; values are compared (float32, rtol 1e-4) and the compiles
counted: ``jax.jit`` compiles once per distinct shape, polymask once per
bucket where it shares, and per exact shape (``exact_compiles``) where it
falls back. Compile counts, not speed: one process is enough.

    python benchmarks/default_specs.py [--untiered]

Results: ``benchmarks/results/default_specs/``.
"""

from __future__ import annotations

import argparse
import warnings

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import polymask as pm

RNG = np.random.default_rng(2)
KEY = jax.random.PRNGKey(0)


def normal(*shape):
    return jnp.asarray(RNG.normal(size=shape), jnp.float32)


def check(name: str, f, calls, tiered: bool) -> None:
    pf = pm.jit(f, tiered=tiered)
    shapes, worst = set(), 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pm.FallbackWarning)
        for args in calls:
            want = jax.jit(f)(*args)
            got = pf(*args)
            for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)
                scale = np.maximum(np.abs(np.asarray(w)), 1e-3)
                worst = max(worst, float(np.max(np.abs(np.asarray(g) - w) / scale, initial=0)))
            shapes.add(tuple(np.shape(x) for x in jax.tree_util.tree_leaves(args)))
    pf.wait()
    st = pf.stats()
    print(f"{name:18s} calls={len(calls)} jax.jit_compiles={len(shapes)} "
          f"polymask_compiles={st['compiles']} (background {st['background_compiles']}) "
          f"exact_compiles={st['exact_compiles']} max_rel_dev={worst:.1e}")


def models():
    """``(name, f, calls)``: the models and the shapes they are called on."""
    seq = [0, 1, 3, 16, 17, 32, 33, 100]
    mlp = eqx.nn.MLP(in_size=16, out_size=4, width_size=32, depth=2, key=KEY)
    params, static = eqx.partition(mlp, eqx.is_array)
    yield "eqx_mlp_closed", lambda x: jax.vmap(mlp)(x), [(normal(n, 16),) for n in seq]
    yield ("eqx_mlp_params", lambda p, x: jax.vmap(eqx.combine(p, static))(x),
           [(params, normal(n, 16)) for n in seq])

    conv = eqx.nn.Conv1d(3, 8, kernel_size=5, padding="SAME", key=KEY)
    lin = eqx.nn.Linear(8, 2, key=KEY)
    yield ("eqx_conv1d", lambda x: jax.vmap(lin)(jax.nn.relu(jax.vmap(conv)(x)).mean(-1)),
           [(normal(b, 3, t),) for b, t in [(1, 1), (2, 3), (2, 8), (8, 8), (3, 17), (1, 64)]])

    cell = eqx.nn.GRUCell(4, 8, key=KEY)

    def gru(xs):
        return jax.lax.scan(lambda h, x: (cell(x, h),) * 2, jnp.zeros(8), xs)

    yield "eqx_gru_scan", gru, [(normal(t, 4),) for t in [0, 1, 2, 4, 8, 9, 30, 100]]

    emb = eqx.nn.Embedding(50, 16, key=KEY)
    mha = eqx.nn.MultiheadAttention(2, 16, key=KEY)
    norm = eqx.nn.LayerNorm(16)

    def transformer(tokens):
        x = jax.vmap(norm)(jax.vmap(emb)(tokens))
        t = tokens.shape[0]
        return mha(x, x, x, mask=jnp.tril(jnp.ones((t, t), bool)))

    yield ("eqx_transformer", transformer,
           [(jnp.asarray(RNG.integers(0, 50, size=t), jnp.int32),)
            for t in [1, 2, 7, 16, 17, 50, 64, 3]])

    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 32, 10])(x)))
    hp = net.init(KEY, jnp.ones((1, 16)))
    seq = [0, 1, 3, 10, 16, 17, 32, 33]
    yield "hk_mlp_closed", lambda x: net.apply(hp, x), [(normal(n, 16),) for n in seq]
    yield "hk_mlp_params", net.apply, [(hp, normal(n, 16)) for n in seq]

    def cnn(x):
        x = hk.MaxPool(2, 2, "SAME")(jax.nn.relu(hk.Conv2D(8, 3)(x)))
        return hk.Linear(3)(jnp.mean(x, axis=(1, 2)))

    cnet = hk.without_apply_rng(hk.transform(cnn))
    cp = cnet.init(KEY, jnp.ones((1, 8, 8, 3)))
    yield ("hk_cnn_closed", lambda x: cnet.apply(cp, x),
           [(normal(b, h, w, 3),) for b, h, w in [(1, 1, 1), (2, 5, 7), (1, 8, 8), (3, 16, 9),
                                                  (1, 3, 3), (2, 33, 8)]])

    def lstm(x):
        core = hk.LSTM(8)
        out, _ = hk.dynamic_unroll(core, x, core.initial_state(x.shape[1]))
        return hk.Linear(2)(out[-1])

    lnet = hk.without_apply_rng(hk.transform(lstm))
    lp = lnet.init(KEY, jnp.ones((3, 2, 4)))
    yield ("hk_lstm_closed", lambda x: lnet.apply(lp, x),
           [(normal(t, b, 4),) for t, b in [(1, 1), (3, 2), (8, 8), (17, 3), (4, 4), (40, 1)]])

    tx = optax.adam(1e-2)

    def train_step(params, opt_state, x, y):
        def loss(p):
            return optax.softmax_cross_entropy(net.apply(p, x), jax.nn.one_hot(y, 10)).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    yield ("optax_train_step", train_step,
           [(hp, tx.init(hp), normal(n, 16), jnp.asarray(RNG.integers(0, 10, n), jnp.int32))
            for n in [1, 3, 5, 16, 17, 32, 33, 64]])

    # arguments whose sizes are related (T and T + 1) or coincide in the first call
    ts = (5, 7, 9, 12, 3, 20, 0, 1)
    yield ("rlax_td_error", lambda r, d, v: r + d * v[1:] - v[:-1],
           [(normal(t), normal(t), normal(t + 1)) for t in ts])
    yield "tail_slice_3", lambda r, v: r - v[3:], [(normal(t), normal(t + 3)) for t in ts]
    yield ("two_relations", lambda a, b, c: a + b[1:] + c[2:],
           [(normal(t), normal(t + 1), normal(t + 2)) for t in ts])
    w3 = jnp.eye(3)
    yield ("rnn_states_first_coinciding", lambda x, h: x @ w3 + h[1:] @ w3,
           [(normal(t, 3), normal(t + 1, 3)) for t in (2, 3, 4, 6, 9, 1, 5)])
    yield ("jnp_cov_first_square", jnp.cov,
           [(normal(*s),) for s in [(3, 3)] + [(int(RNG.integers(3, 6)), int(RNG.integers(3, 40)))
                                              for _ in range(30)]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--untiered", action="store_true", help="polymask.jit(tiered=False)")
    opts = ap.parse_args()
    print(f"jax {jax.__version__}, polymask {pm.__version__}, tiered={not opts.untiered}")
    for name, f, calls in models():
        check(name, f, calls, tiered=not opts.untiered)


if __name__ == "__main__":
    main()
