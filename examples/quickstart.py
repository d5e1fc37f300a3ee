"""polymask quickstart: mask + jit + vmap + grad on a small function.

Install: pip install -e .   (polymask alone)
Run: python examples/quickstart.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import polymask as pm


def normalized_energy(x):
    """Mean-centred energy of a variable-length signal, divided by its length."""
    centred = x - jnp.mean(x)
    return jnp.sum(jax.nn.softplus(centred) ** 2) / x.shape[0]


def main() -> None:
    rng = np.random.default_rng(0)
    signals = [rng.normal(size=n).astype(np.float32) for n in (3, 7, 12, 16)]
    f = pm.mask(normalized_energy, "n")

    print("mask + jit: one compiled program for every length <= 16")
    traces = []

    def counted(m):
        traces.append(1)
        return f(m)

    jf = jax.jit(counted)
    for s in signals:
        m = pm.pad(s, 16, fill=np.nan)  # NaN padding: the contract says it cannot leak
        got = float(jf(m).data)
        ref = float(normalized_energy(jnp.asarray(s)))
        print(f"  n={len(s):2d}  masked={got: .6f}  unpadded={ref: .6f}")
    print(f"  traces: {len(traces)}")

    print("vmap over a ragged batch (one program for the whole batch)")
    batch = pm.stack(signals, bound=(16,))
    out = jax.jit(jax.vmap(f))(pm.Masked(batch.data, batch.shape))
    for s, v in zip(signals, np.asarray(out.data)):
        print(f"  n={len(s):2d}  masked={v: .6f}  unpadded={float(normalized_energy(s)): .6f}")

    print("grad: exact on the logical region, zero (and finite) in the padding")
    s = signals[1]
    m = pm.pad(s, 16, fill=np.nan)
    g = jax.grad(lambda d: f(pm.Masked(d, m.shape)).data)(jnp.asarray(m.data))
    ref = jax.grad(normalized_energy)(jnp.asarray(s))
    print("  masked  :", np.round(np.asarray(g), 4))
    print("  unpadded:", np.round(np.asarray(ref), 4))


if __name__ == "__main__":
    main()
