"""Pair energies and a dense neighbour list from JAX MD.

Source: https://github.com/jax-md/jax-md (commit a41c7d1; Apache-2.0,
Copyright 2019 Google LLC): jax_md/space.py (periodic displacement,
distance with safe_mask), jax_md/energy.py (soft_sphere,
lennard_jones with multiplicative_isotropic_cutoff), jax_md/smap.py (pair:
map_product, _diagonal_mask, 0.5 * high_precision_sum) and
jax_md/partition.py (the dense-format neighbour-list pruning:
``cumsum`` of the cutoff mask, scatter into an ``N``-filled index array).
N = n particles in a periodic 2-D box; the neighbour list has capacity N.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .corpus import program

SRC = "jax-md https://github.com/jax-md/jax-md/blob/a41c7d1/jax_md/"
BOX = 4.0
f32 = jnp.float32


def safe_mask(mask, fn, operand, placeholder=0):
    masked = jnp.where(mask, operand, 0)
    return jnp.where(mask, fn(masked), placeholder)


def periodic_displacement(side, dR):
    return jnp.mod(dR + side * f32(0.5), side) - f32(0.5) * side


def displacement(Ra, Rb):
    return periodic_displacement(BOX, Ra - Rb)


def distance(dR):
    dr = jnp.sum(dR ** 2, axis=-1)
    return safe_mask(dr > 0, jnp.sqrt, dr)


def map_product(metric):
    return jax.vmap(jax.vmap(metric, (0, None), 0), (None, 0), 0)


def _diagonal_mask(X):
    N = X.shape[0]
    X = jnp.nan_to_num(X)
    mask = f32(1.0) - jnp.eye(N, dtype=X.dtype)
    return mask * X


def soft_sphere(dr, sigma=1.0, epsilon=1.0, alpha=2.0):
    dr = dr / sigma
    fn = lambda dr: epsilon / alpha * (f32(1.0) - dr) ** alpha
    return safe_mask(dr < 1.0, fn, dr, f32(0.0))


def multiplicative_isotropic_cutoff(fn, r_onset, r_cutoff):
    r_c = r_cutoff ** f32(2)
    r_o = r_onset ** f32(2)

    def smooth_fn(dr):
        r = dr ** f32(2)
        inner = jnp.where(dr < r_cutoff,
                          (r_c - r) ** 2 * (r_c + 2 * r - 3 * r_o) / (r_c - r_o) ** 3, 0)
        return jnp.where(dr < r_onset, 1, inner)

    return lambda dr, *a, **k: smooth_fn(dr) * fn(dr, *a, **k)


def lennard_jones(dr, sigma=0.5, epsilon=1.0):
    idr = sigma / dr
    idr6 = idr ** 6
    idr12 = idr6 ** 2
    return jnp.nan_to_num(f32(4) * epsilon * (idr12 - idr6))


def soft_sphere_energy_and_forces(R):
    """smap.pair(soft_sphere) energy and forces = -grad(energy)."""
    def energy(R):
        dr = distance(map_product(displacement)(R, R))
        return f32(0.5) * jnp.sum(_diagonal_mask(soft_sphere(dr)))

    e, g = jax.value_and_grad(energy)(R)
    return e, -g


def lj_neighbor_energy(R):
    """Dense neighbour list (capacity N) then the LJ pair energy over it."""
    N = R.shape[0]
    cutoff = 1.5
    dR = map_product(displacement)(R, R)
    dr2 = jnp.sum(dR ** 2, -1)
    idx = jnp.broadcast_to(jnp.arange(N)[None, :], (N, N))
    mask = (dr2 < cutoff ** 2) & (idx != jnp.arange(N)[:, None])
    cumsum = jnp.cumsum(mask, axis=1)
    index = jnp.where(mask, cumsum - 1, idx.shape[1])  # a spare last column for the rest
    p_index = jnp.arange(idx.shape[0])[:, None]
    out_idx = N * jnp.ones((N, N + 1), jnp.int32)
    out_idx = out_idx.at[p_index, index].set(jnp.where(mask, idx, N))[:, :-1]
    max_occupancy = jnp.max(cumsum[:, -1], initial=0)
    # smap.pair_neighbor_list (dense): gather neighbours, mask the N fill
    neighbour_mask = out_idx < N
    Rn = R[jnp.minimum(out_idx, N - 1)]
    dr = distance(jax.vmap(jax.vmap(displacement, (None, 0)))(R, Rn))
    fn = multiplicative_isotropic_cutoff(lennard_jones, 1.0, cutoff)
    e = jnp.where(neighbour_mask, fn(jnp.where(neighbour_mask, dr, 1.0)), 0.0)
    return f32(0.5) * jnp.sum(e), out_idx, max_occupancy


def _positions(n, rng):
    return (rng.random((n, 2)) * BOX).astype(np.float32)


PROGRAMS = [
    program(name="jaxmd_soft_sphere_forces",
            source=SRC + "energy.py soft_sphere_pair + smap.py pair", license="Apache-2.0",
            fun=soft_sphere_energy_and_forces, in_specs=("n, 2",), make_example=lambda n, r:
            (_positions(n, r),), bound=8),
    program(name="jaxmd_neighbor_list_lj",
            source=SRC + "partition.py neighbor_list (dense) + energy.py lennard_jones",
            license="Apache-2.0", fun=lj_neighbor_energy, in_specs=("n, 2",),
            make_example=lambda n, r: (_positions(n, r),), bound=8),
]
