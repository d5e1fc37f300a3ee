"""Equivariant features of N points, called from the installed e3nn-jax.

Source: https://github.com/e3nn/e3nn-jax (e3nn-jax 0.20.8, as installed):
``e3nn.spherical_harmonics`` of the points' vectors, and a point convolution in
the style of e3nn's tutorials: messages ``f_j * Y(r_cj) * R(|r_cj|)`` with
``e3nn.tensor_product``, a radial basis ``e3nn.soft_one_hot_linspace``
(smooth_finite, with cutoff) and fixed radial weights, summed over the points.
License: Apache-2.0, Copyright the e3nn-jax developers.
The programs call e3nn-jax itself (an installed dependency of the real extra);
only the wrappers that turn one point cloud into arrays with a variable number
of points are ours.
"""

import e3nn_jax as e3nn
import jax.numpy as jnp
import numpy as np

from .corpus import normal, params, program

SRC = "e3nn-jax https://github.com/e3nn/e3nn-jax/blob/0.20.8/e3nn_jax/_src/"
IRREPS_SH = "1x0e + 1x1e + 1x2e"


def sh_program(vectors):
    """Real spherical harmonics up to l = 2 of n (normalised) vectors."""
    return e3nn.spherical_harmonics(IRREPS_SH, vectors, normalize=True,
                                    normalization="component").array


def conv_program(positions, features, centres, radial_w):
    """Features at 2 fixed centres gathered from n points: per point a tensor
    product of its scalar feature with Y(r), weighted by a learned radial
    function of |r|, summed over the points."""
    r = positions[None, :, :] - centres[:, None, :]          # (2, n, 3)
    sh = e3nn.spherical_harmonics(IRREPS_SH, r, normalize=True, normalization="component")
    basis = e3nn.soft_one_hot_linspace(jnp.linalg.norm(r, axis=-1), start=0.0, end=4.0,
                                       number=4, basis="smooth_finite", cutoff=True)
    f = e3nn.IrrepsArray("1x0e", jnp.broadcast_to(features[None, :, None], r.shape[:2] + (1,)))
    msg = e3nn.tensor_product(f, sh)                          # (2, n, 9)
    radial = basis @ radial_w                                 # (2, n, 3): one weight per l
    scale = jnp.concatenate([radial[..., :1], jnp.repeat(radial[..., 1:2], 3, -1),
                             jnp.repeat(radial[..., 2:], 5, -1)], -1)
    return jnp.sum(msg.array * scale, axis=1)


def _conv_params(rng):
    return (np.array([[0.0, 0.0, 0.0], [1.0, 0.5, -0.5]], np.float32),
            normal(rng, 4, 3, scale=0.5))


def _sh_example(n, rng):
    return (normal(rng, n, 3),)


def _conv_example(n, rng):
    return (normal(rng, n, 3), normal(rng, n)) + params(11, _conv_params)


PROGRAMS = [
    program(name="e3nn_spherical_harmonics", source=SRC + "spherical_harmonics/__init__.py",
            license="Apache-2.0", fun=sh_program, in_specs=("n, 3",),
            make_example=_sh_example, bound=12),
    program(name="e3nn_point_convolution",
            source=SRC + "tensor_products.py tensor_product, radial.py soft_one_hot_linspace",
            license="Apache-2.0", fun=conv_program, in_specs=("n, 3", "n", None, None),
            make_example=_conv_example, bound=12, rtol=1e-3, atol=1e-3),
]
