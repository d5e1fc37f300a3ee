"""An implicit voltage step of a neuron cable with jaxley's dendritic
hierarchical scheduling (DHS) tridiagonal solve.

Source: https://github.com/jaxleyverse/jaxley (commit 2638cca),
jaxley/solver_voltage.py (step_voltage_implicit_with_dhs_solve,
_make_dhs_solve with its CPU ``_raw_solve`` and custom JVP,
_comp_based_triang, _comp_based_backsub).
License: Apache-2.0 (the file header: "Jaxley is licensed under the Apache License
Version 2.0").
Copied: the solver functions verbatim but that the level arrays
(``flipped_comp_edges`` / ``ordered_comp_edges``) are arguments of the
custom_jvp function instead of NumPy constants closed over, and
``all_parents`` / ``all_children`` are read from them; the voltage step
(``jaxley_step``, ours) assembles the system of an unbranched cable of n
compartments, solve order = compartment order, as jaxley's does.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .corpus import normal, program

SRC = "jaxley https://github.com/jaxleyverse/jaxley/blob/2638cca/jaxley/solver_voltage.py"


# -- jaxley/solver_voltage.py ---------------------------------------------------------------------
def _comp_based_triang(index, carry):
    diags, solves, lowers, uppers, flipped_comp_edges = carry
    comp_edge = flipped_comp_edges[index]
    child = comp_edge[:, 0]
    parent = comp_edge[:, 1]
    lower_val = lowers[child]
    upper_val = uppers[child]
    child_diag = diags[child]
    child_solve = solves[child]
    multiplier = upper_val / child_diag
    diags = diags.at[parent].add(-lower_val * multiplier)
    solves = solves.at[parent].add(-child_solve * multiplier)
    return (diags, solves, lowers, uppers, flipped_comp_edges)


def _comp_based_backsub(index, carry):
    solves, lowers, comp_edges = carry
    comp_edge = comp_edges[index]
    child = comp_edge[:, 0]
    parent = comp_edge[:, 1]
    solves = solves.at[child].add(-solves[parent] * lowers[child])
    return (solves, lowers, comp_edges)


def make_dhs_solve():
    """_make_dhs_solve; the level arrays are arguments of the custom_jvp function
    (here they are inputs, not the original's NumPy constants)."""

    def _raw_solve(diags, lowers, uppers, solves, ordered_comp_edges_np, flipped_comp_edges_np):
        steps = flipped_comp_edges_np.shape[0]
        init = (diags, solves, lowers, uppers, flipped_comp_edges_np)
        diags_out, solves_out, _, _, _ = jax.lax.fori_loop(0, steps, _comp_based_triang, init)
        lowers_norm = lowers / diags_out
        solves_norm = solves_out / diags_out
        diags_out = jnp.ones_like(solves_norm)
        init = (solves_norm, lowers_norm, ordered_comp_edges_np)
        solves_out, _, _ = jax.lax.fori_loop(0, steps, _comp_based_backsub, init)
        return solves_out / diags_out

    @jax.custom_jvp
    def _solve(diags, lowers, uppers, solves, ordered, flipped):
        return _raw_solve(diags, lowers, uppers, solves, ordered, flipped)

    @_solve.defjvp
    def _solve_jvp(primals, tangents):
        diags, lowers, uppers, solves, ordered, flipped = primals
        d_diags, d_lowers, d_uppers, d_solves, _, _ = tangents
        all_children = ordered[:, 0, 0]
        all_parents = ordered[:, 0, 1]
        x = _raw_solve(diags, lowers, uppers, solves, ordered, flipped)
        dA_x = d_diags * x
        dA_x = dA_x.at[all_parents].add(d_uppers[all_children] * x[all_children])
        dA_x = dA_x.at[all_children].add(d_lowers[all_children] * x[all_parents])
        new_rhs = d_solves - dA_x
        dx = _raw_solve(diags, lowers, uppers, new_rhs, ordered, flipped)
        return x, dx

    return _solve


# -- the program ----------------------------------------------------------------------------------
def jaxley_step(delta_t, voltages, voltage_terms, constant_terms, g, flipped, ordered):
    """step_voltage_implicit_with_dhs_solve for an unbranched cable (g[i]: i <-> i - 1)."""
    n = voltages.shape[0]
    axial = delta_t * g
    diags = delta_t * voltage_terms
    diags = diags + 1.0
    diags = diags + jnp.where(jnp.arange(n) > 0, axial, 0.0)             # sinks = children
    diags = diags + jnp.concatenate([axial[1:], jnp.zeros(1)])[:n]       # sinks = parents
    solves = voltages + delta_t * constant_terms
    lowers = -axial
    uppers = -axial
    diags = jnp.concatenate([diags, jnp.asarray([1.0])])
    solves = jnp.concatenate([solves, jnp.asarray([0.0])])
    uppers = jnp.concatenate([uppers, jnp.asarray([0.0])])
    lowers = jnp.concatenate([lowers, jnp.asarray([0.0])])
    dhs_solve = make_dhs_solve()
    solution = dhs_solve(diags, lowers, uppers, solves, ordered, flipped)
    return solution[:-1]


def _jaxley_example(n, rng):
    flipped = np.full((n, 1, 2), -1, np.int32)
    for k in range(n - 1):
        flipped[k + 1, 0] = (n - 1 - k, n - 2 - k)   # leaves first; level 0 is padding (-1)
    ordered = flipped[::-1].copy()
    return (np.float32(0.025), -70 + 5 * normal(rng, n), 0.1 + rng.random(n).astype(np.float32),
            normal(rng, n), 1.0 + rng.random(n).astype(np.float32), flipped, ordered)


PROGRAMS = [
    program(name="jaxley_dhs_voltage_solve",
            source=SRC + " step_voltage_implicit_with_dhs_solve, _make_dhs_solve (fori_loop "
                         "over levels, custom_jvp)",
            license="Apache-2.0", fun=jaxley_step,
            in_specs=(None, "n", "n", "n", "n", "n, 1, 2", "n, 1, 2"),
            make_example=_jaxley_example, bound=8, rtol=1e-4, atol=1e-3),
]
