"""PointNet classification and segmentation networks on n points.

Source: https://github.com/charlesq34/pointnet (MIT, Copyright (c) 2017
Charles R. Qi), models/pointnet_cls.py and models/pointnet_seg.py with
models/transform_nets.py (input T-Net): shared per-point MLPs (1x1 convs),
``max_pool2d(net, [num_point, 1])`` global feature, FC head; the segmentation
net concatenates the global feature back to every point. Written with flax
linen as the common JAX ports do (``nn.max_pool(x, (num_points, 1))``).
"""

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from .corpus import flat, normal, program

SRC = "pointnet https://github.com/charlesq34/pointnet/blob/master/models/"


class TNet(nn.Module):
    k: int = 3

    @nn.compact
    def __call__(self, x):  # (B, N, 1, k)
        num_points = x.shape[1]
        h = nn.relu(nn.Dense(16)(x))
        h = nn.relu(nn.Dense(32)(h))
        h = nn.max_pool(h, (num_points, 1))
        h = h.reshape(h.shape[0], -1)
        h = nn.relu(nn.Dense(16)(h))
        t = nn.Dense(self.k * self.k, kernel_init=nn.initializers.zeros)(h)
        return t.reshape(-1, self.k, self.k) + jnp.eye(self.k)


class PointNetCls(nn.Module):
    num_classes: int = 4

    @nn.compact
    def __call__(self, points):  # (B, N, 3)
        num_points = points.shape[1]
        x = points[:, :, None, :]
        transform = TNet(3)(x)
        x = jnp.einsum("bnij,bjk->bnik", x, transform)
        x = nn.relu(nn.Dense(16)(x))
        x = nn.relu(nn.Dense(32)(x))
        x = nn.max_pool(x, (num_points, 1))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(self.num_classes)(x)


class PointNetSeg(nn.Module):
    num_parts: int = 3

    @nn.compact
    def __call__(self, points):  # (B, N, 3)
        num_points = points.shape[1]
        point_feat = nn.relu(nn.Dense(16)(points))
        x = nn.relu(nn.Dense(32)(point_feat))
        global_feat = jnp.max(x, axis=1, keepdims=True)
        global_expand = jnp.tile(global_feat, [1, num_points, 1])
        x = jnp.concatenate([point_feat, global_expand], axis=2)
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(self.num_parts)(x)


@functools.cache
def _model(kind):
    model = {"cls": PointNetCls(), "seg": PointNetSeg()}[kind]
    leaves, rebuild = flat(model.init(jax.random.PRNGKey(0), jnp.ones((1, 5, 3))))
    return model, leaves, rebuild


def _fun(kind):
    def fun(points, *leaves):
        model, _, rebuild = _model(kind)
        return model.apply(rebuild(leaves), points)

    fun.__name__ = f"pointnet_{kind}"
    return fun


def _ex(kind):
    return lambda n, rng: (normal(rng, 1, n, 3),) + _model(kind)[1]


PROGRAMS = [
    program(name="pointnet_cls_maxpool_window", source=SRC + "pointnet_cls.py get_model",
            license="MIT", fun=_fun("cls"),
            in_specs=lambda: ("1, n, 3",) + (None,) * len(_model("cls")[1]),
            make_example=_ex("cls"), bound=8),
    program(name="pointnet_cls_many_point_counts", source=SRC + "pointnet_cls.py get_model",
            license="MIT", fun=_fun("cls"),
            in_specs=lambda: ("1, n, 3",) + (None,) * len(_model("cls")[1]),
            make_example=_ex("cls"), bound=100, modes=("pmjit",), pmjit_sizes=(3, 40, 64, 65),
            note="polymask.jit over point counts past 64 (the window of max_pool)"),
    program(name="pointnet_seg_global_feature", source=SRC + "pointnet_seg.py get_model",
            license="MIT", fun=_fun("seg"),
            in_specs=lambda: ("1, n, 3",) + (None,) * len(_model("seg")[1]),
            make_example=_ex("seg"), bound=8),
]
