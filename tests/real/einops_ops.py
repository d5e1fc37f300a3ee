"""einops on JAX arrays: pack / unpack of a class token with a variable number
of tokens, rearrange into patches and heads, reduce and repeat.

Source: https://github.com/arogozhnikov/einops (einops 0.8.2, as installed):
the idioms of its documentation, docs/4-pack-and-unpack.ipynb (``pack([class_token,
image_tokens], 'b * c')`` then ``unpack``), docs/1-einops-basics.ipynb and the
README's ViT / attention examples (``rearrange(x, 'b (h p1) (w p2) c -> b (h w)
(p1 p2 c)')``, ``'b n (h d) -> b h n d'``, ``reduce(..., 'mean')``, ``repeat``).
License: MIT, Copyright (c) 2018 Alex Rogozhnikov.
The programs call einops itself (a small pure-Python dependency of the real
extra, pinned); the tiny models around the einops calls are ours.
"""

import jax
import jax.numpy as jnp
import numpy as np
from einops import pack, rearrange, reduce, repeat, unpack

from .corpus import normal, params, program

SRC = "einops https://github.com/arogozhnikov/einops/blob/v0.8.2/"
D, H = 8, 2


def _w(rng):
    return normal(rng, D, 3 * D, scale=0.3), normal(rng, D, scale=0.3)


def pack_unpack_attention(tokens, w_qkv, class_token):
    """ViT-style: pack a class token with n tokens, multi-head self-attention
    with rearrange, unpack the class token and the tokens again."""
    b = tokens.shape[0]
    class_token_b = repeat(class_token, 'c -> b c', b=b)
    x, ps = pack([class_token_b, tokens], 'b * c')
    q, k, v = jnp.split(x @ w_qkv, 3, axis=-1)
    q, k, v = (rearrange(t, 'b n (h d) -> b h n d', h=H) for t in (q, k, v))
    att = jax.nn.softmax(jnp.einsum('bhid,bhjd->bhij', q, k) / np.sqrt(D // H), axis=-1)
    out = rearrange(jnp.einsum('bhij,bhjd->bhid', att, v), 'b h n d -> b n (h d)')
    cls_out, tokens_out = unpack(out, ps, 'b * c')
    return cls_out, reduce(tokens_out, 'b n c -> b c', 'mean')


def _pack_example(n, rng):
    w, cls = params(50, _w)
    return normal(rng, 2, n, D), w, cls


def patchify(img):
    """rearrange an image of height 2h into 2x2 patches, then a per-patch mean."""
    patches = rearrange(img, '(h p1) (w p2) c -> (h w) (p1 p2 c)', p1=2, p2=2)
    return patches, reduce(img, '(h p1) (w p2) c -> h w c', 'max', p1=2, p2=2)


def _patch_example(n, rng):
    return (normal(rng, 2 * n, 4, 3),)


def space_to_depth_roundtrip(x):
    """rearrange a sequence of length 4 * n into n blocks of 4 and back."""
    blocks = rearrange(x, '(n k) c -> n (k c)', k=4)
    summed = reduce(blocks, 'n kc -> kc', 'sum')
    return rearrange(blocks, 'n (k c) -> (n k) c', k=4) * 2, summed


def _s2d_example(n, rng):
    return (normal(rng, 4 * n, 3),)


PROGRAMS = [
    program(name="einops_pack_unpack_attention", source=SRC
            + "docs/4-pack-and-unpack.ipynb pack/unpack", license="MIT",
            fun=pack_unpack_attention, in_specs=("2, n, 8", None, None),
            make_example=_pack_example, bound=10),
    program(name="einops_rearrange_patches", source=SRC + "docs/1-einops-basics.ipynb rearrange",
            license="MIT", fun=patchify, in_specs=("2*h, 4, 3",),
            make_example=_patch_example, bound=6),
    program(name="einops_rearrange_blocks", source=SRC + "docs/1-einops-basics.ipynb rearrange",
            license="MIT", fun=space_to_depth_roundtrip, in_specs=("4*n, 3",),
            make_example=_s2d_example, bound=6),
]
