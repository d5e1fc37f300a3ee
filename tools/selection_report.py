"""Functions of a data-dependent selection under ``polymask.mask``, against plain
eager JAX on the exact arrays, at every size 0..9 of one input: a table of
what each size gives.

    python tools/selection_report.py                 # every function
    python tools/selection_report.py top_k3 cov       # some of them

Each function ``op`` runs as ``op(polymask.boolean_mask(x, x > 10))`` under
``mask(f, "n")`` with NaN in the padding. A cell is ``ok`` (polymask's value
equals plain JAX's), ``ok-err`` (both raise: polymask a ``ShapeError``),
``refused`` (plain JAX returns a value, polymask raises a ``ShapeError``),
``WRONG`` (a different value, or a value where plain JAX raises) or
``CRASH`` (another exception). ``WRONG`` is a defect; ``refused`` is one of
the limits docs/data_dependent.md describes.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import polymask as pm

OPS = {
    "gradient": lambda s: jnp.gradient(s),
    "convolve": lambda s: jnp.convolve(s, jnp.array([1., 2., 3.])),
    "convolve_same": lambda s: jnp.convolve(s, jnp.array([1., 2., 3.]), mode="same"),
    "correlate": lambda s: jnp.correlate(s, jnp.array([1., 2.])),
    "median": lambda s: jnp.median(s),
    "percentile": lambda s: jnp.percentile(s, 30.),
    "quantile": lambda s: jnp.quantile(s, jnp.array([0.2, 0.8])),
    "histogram": lambda s: jnp.histogram(s, bins=4, range=(0., 100.))[0],
    "diff2": lambda s: jnp.diff(s, n=2),
    "ediff1d": lambda s: jnp.ediff1d(s),
    "roll": lambda s: jnp.roll(s, 1),
    "fft": lambda s: jnp.abs(jnp.fft.fft(s)),
    "rfft": lambda s: jnp.abs(jnp.fft.rfft(s)),
    "cumsum": lambda s: jnp.cumsum(s),
    "trapezoid": lambda s: jnp.trapezoid(s),
    "outer": lambda s: jnp.outer(s, s),
    "vander": lambda s: jnp.vander(s, 3),
    "polyval": lambda s: jnp.polyval(s, 2.0),
    "interp": lambda s: jnp.interp(jnp.array([25., 45.]), jnp.sort(s), jnp.sort(s) * 2),
    "searchsorted": lambda s: jnp.searchsorted(jnp.sort(s), 42.0),
    "top_k1": lambda s: jax.lax.top_k(s, 1)[0],
    "top_k3": lambda s: jax.lax.top_k(s, 3)[0],
    "sort_k": lambda s: jnp.sort(s)[::-1][:2],
    "argsort": lambda s: jnp.argsort(s),
    "split3": lambda s: jnp.split(s, 3)[0],
    "array_split": lambda s: jnp.array_split(s, 2)[0],
    "reshape2": lambda s: s.reshape(-1, 2).sum(1),
    "pad_edge": lambda s: jnp.pad(s, 2, mode="edge"),
    "pad_reflect": lambda s: jnp.pad(s, 1, mode="reflect"),
    "pad_wrap": lambda s: jnp.pad(s, 2, mode="wrap"),
    "tile": lambda s: jnp.tile(s, 2),
    "repeat": lambda s: jnp.repeat(s, 2),
    "linspace": lambda s: s * jnp.linspace(0, 1, s.shape[0]),
    "mean_std": lambda s: jnp.std(s),
    "var_ddof": lambda s: jnp.var(s, ddof=1),
    "cov": lambda s: jnp.cov(jnp.stack([s, s * 2])),
    "corrcoef": lambda s: jnp.corrcoef(jnp.stack([s, s * s])),
    "stft": lambda s: jnp.abs(jax.scipy.signal.stft(s, nperseg=4)[2]).sum(),
    "unique": lambda s: pm.unique(s, max_size=9),
    "nonzero2": lambda s: s[pm.nonzero(s > 40)].sum(),
    "kron": lambda s: jnp.kron(s, jnp.array([1., -1.])),
    "concat": lambda s: jnp.concatenate([s, s[:1]]),
    "where_first": lambda s: jnp.where(jnp.arange(s.shape[0]) == 0, s, 0.),
    "dot_self": lambda s: s @ s,
    "logsumexp": lambda s: jax.nn.logsumexp(s),
    "softmax": lambda s: jax.nn.softmax(s),
    "argmax": lambda s: jnp.argmax(s),
    "cond_len": lambda s: jax.lax.cond(s.shape[0] > 2, lambda: s.sum(), lambda: -s.sum()),
    "where_len": lambda s: jnp.where(s.shape[0] > 2, s.sum(), -1.0),
    "fori": lambda s: jax.lax.fori_loop(0, s.shape[0], lambda i, c: c + s[i] * i, 0.0),
    "slice2": lambda s: s[2:],
    "zeros_len_minus1": lambda s: jnp.zeros(s.shape[0] - 1),
    "iota_len_minus2": lambda s: jnp.arange(s.shape[0] - 2) * 1.0,
    "ones_like_slice": lambda s: jnp.ones_like(s[1:]) + s[:-1],
    "slice_slice": lambda s: s[1:][1:] - s[:-2],
    "slice_neg": lambda s: s[:-2],
    "stride": lambda s: s[::2],
    "flip": lambda s: s[::-1],
    "at_set": lambda s: s.at[1].set(0.),
    "index1": lambda s: s[1],
    "mean_over_len": lambda s: s.sum() / max(s.shape[0], 1),
}


def outcome(op, m, x, n) -> str:
    """One cell: ``op`` of the selection of ``x[:n]``, polymask against plain JAX."""
    sub = jnp.asarray(x[:n])
    try:
        want = [np.asarray(w) for w in jax.tree_util.tree_leaves(op(sub[sub > 10]))]
    except Exception:  # noqa: BLE001 - plain JAX raises here
        want = None
    try:
        got = m(pm.Masked(jnp.asarray(x), (n,)))
    except pm.ShapeError:
        return "refused" if want is not None else "ok-err"
    except Exception as e:  # noqa: BLE001 - reported as a cell
        return "CRASH:" + type(e).__name__
    if want is None:
        return "WRONG"
    got = [g.unpad() for g in jax.tree_util.tree_leaves(
        got, is_leaf=lambda v: isinstance(v, pm.Masked))]
    same = len(got) == len(want) and all(
        np.shape(g) == np.shape(w) and np.allclose(g, w, rtol=1e-4, atol=1e-4, equal_nan=True)
        for g, w in zip(got, want))
    return "ok" if same else "WRONG"


def main(names) -> int:
    ops = {k: OPS[k] for k in names} if names else OPS
    # n = 1 selects nothing from a nonempty x (a count of 0 in the trace of n >= 1)
    x = np.array([3., 20, 50, 40, 0, 30, 70, 60, 45, np.nan], np.float32)  # NaN: padding
    print(f"{'function':14s} " + " ".join(f"n={n:<5d}" for n in range(10)))
    wrong = 0
    for name, op in ops.items():
        m = pm.mask(lambda a, op=op: op(pm.boolean_mask(a, a > 10)), "n")
        cells = [outcome(op, m, x, n) for n in range(10)]
        wrong += sum(c != "ok" and not c.startswith(("ok-err", "refused")) for c in cells)
        print(f"{name:14s} " + " ".join(f"{c[:7]:7s}" for c in cells), flush=True)
    print(f"{wrong} cells WRONG or CRASH")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
