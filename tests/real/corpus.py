"""The registry of the real-program corpus.

A program is a JAX function of arrays with a variable-size axis (sequence
length, number of nodes / edges / points, time steps, image height / width)
plus fixed-size parameters, and how to make its inputs:

- ``fun(*args)``: the program, written for exact (unpadded) arrays.
- ``in_specs``: one ``jax.export`` shape spec per positional argument, ``None``
  for an unpadded argument (parameters); or a function returning that tuple
  (computed on first use, so importing the corpus initialises no model).
- ``make_example(n, rng)``: the exact arguments at size ``n`` (NumPy arrays).
  Shapes depend on ``n`` only; parameters must not depend on ``n`` or ``rng``
  (``params(seed, init)`` caches them), so they are shared across sizes.
- ``bound``: the largest ``n``; every padded argument's bound is its shape at
  ``make_example(bound)``.
- ``sizes``: the sizes the oracle runs (default ``0, 1, middle, bound``).
- ``constraints``: passed to ``mask`` and ``polymask.jit``.
- ``modes``: any of ``eager, jit, vmap, grad, pmjit``. ``grad`` differentiates
  the sum of the float outputs with respect to every float argument, the
  unpadded parameters included; it is left out (``n/a``) when the program has
  no float output.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

MODES = ("eager", "jit", "vmap", "grad", "pmjit")

# the modules of this package that define programs (``PROGRAMS`` lists)
MODULES = (
    "jraph_gnn", "optax_losses", "flax_examples", "equinox_examples", "dynamax_hmm",
    "dynamax_lgssm", "gp_kernels", "ott_sinkhorn", "distrax_dists", "diffrax_steps",
    "blackjax_mcmc", "jaxmd_energy", "speech_vision", "pointnet", "nanogpt",
    "ssm_scans", "user_reports", "lineax_solves", "optimistix_fits",
    "einops_ops", "jax_signal", "numpyro_models",
    "jaxopt_solvers", "haiku_nets",
    "e3nn_points", "dm_pix_images", "interpax_interp", "quadax_integrals",
    "mctx_search", "big_vision_losses", "jax_cosmo_interp", "praxis_layers", "clu_metrics",
    "rl_returns", "tfp_mcmc_diagnostics", "neural_tangents_predict", "jaxley_solve",
    "kfac_precondition", "session60_programs",
)


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    source: str
    license: str
    fun: Callable
    in_specs: tuple | Callable[[], tuple]
    make_example: Callable[[int, np.random.Generator], tuple]
    bound: int = 8
    sizes: tuple[int, ...] | None = None
    constraints: tuple[str, ...] = ()
    modes: tuple[str, ...] = MODES
    rtol: float = 1e-4
    atol: float = 1e-4
    pmjit_sizes: tuple[int, ...] | None = None
    timeout: float = 120.0  # seconds per mode before the run counts as a hang
    note: str = ""

    def specs(self) -> tuple:
        return _specs(self.in_specs)

    def example(self, n: int) -> tuple:
        return tuple(self.make_example(n, np.random.default_rng(1000 + n)))

    def oracle_sizes(self) -> tuple[int, ...]:
        if self.sizes is not None:
            return self.sizes
        return tuple(sorted({0, 1, (self.bound + 1) // 2 + 1, self.bound}))

    def jit_sizes(self) -> tuple[int, ...]:
        if self.pmjit_sizes is not None:
            return self.pmjit_sizes
        b = self.bound
        return tuple(sorted({s for s in (0, 1, 2, (b + 1) // 2 + 1, b - 1, b) if 0 <= s <= b}))

    def bounds(self) -> list:
        at_bound = self.example(self.bound)
        return [None if spec is None else tuple(np.shape(a))
                for spec, a in zip(self.specs(), at_bound)]


@functools.cache
def _specs(in_specs):
    return tuple(in_specs() if callable(in_specs) else in_specs)


def params(seed: int, init: Callable[[np.random.Generator], Any]):
    """``init(rng)`` with a fixed seed, computed once (parameters are the same
    at every size, so ``vmap`` passes them unbatched)."""
    return _params_cache(seed, init)


@functools.cache
def _params_cache(seed, init):
    return init(np.random.default_rng(seed))


def normal(rng, *shape, scale=1.0):
    return (rng.normal(size=shape) * scale).astype(np.float32)


def flat(tree):
    """A parameter pytree as a tuple of NumPy leaves and the function rebuilding it."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return tuple(np.asarray(v) for v in leaves), (
        lambda ls: jax.tree_util.tree_unflatten(treedef, list(ls)))


def program(**kw) -> Program:
    return Program(**kw)


@functools.cache
def all_programs() -> tuple[Program, ...]:
    progs = []
    for m in MODULES:
        mod = importlib.import_module(f"{__package__}.{m}")
        progs.extend(mod.PROGRAMS)
    names = [p.name for p in progs]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"duplicate program names {dup}"
    return tuple(progs)


def get(name: str) -> Program:
    for p in all_programs():
        if p.name == name:
            return p
    raise KeyError(name)


def names() -> list[str]:
    return [p.name for p in all_programs()]


def sources(progs: Sequence[Program] | None = None) -> set[str]:
    """The distinct libraries / repositories the corpus copies from."""
    return {p.source.split(" ")[0] for p in (progs or all_programs())}
