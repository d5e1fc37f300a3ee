"""Image processing on H x W images, called from the installed dm-pix.

Source: https://github.com/google-deepmind/dm_pix (dm-pix 0.4.5, as installed):
``pix.gaussian_blur`` (separable depthwise convolution, SAME padding),
``pix.ssim`` between an image and a blurred copy (a 3 x 3 Gaussian window) and
``pix.adjust_contrast`` after ``pix.rgb_to_hsv`` / ``pix.hsv_to_rgb``, as in
dm-pix's README and examples/image_augmentation.ipynb.
License: Apache-2.0, Copyright 2021 DeepMind Technologies Limited.
The programs call dm-pix itself (an installed dependency of the real extra);
only the wrappers that turn one image into arrays with a variable height
(and width) are ours.
"""

import dm_pix as pix
import numpy as np

from .corpus import program

SRC = "dm-pix https://github.com/google-deepmind/dm_pix/blob/v0.4.5/dm_pix/_src/"


def blur_program(image):
    """Gaussian blur (sigma 1, 5 x 5 kernel) of an h x 8 RGB image."""
    return pix.gaussian_blur(image, sigma=1.0, kernel_size=5)


def ssim_program(a, b):
    """Mean SSIM of two h x 6 grey images (3 x 3 Gaussian window, VALID)."""
    return pix.ssim(a, b, filter_size=3, filter_sigma=1.0)


def hsv_contrast_program(image):
    """Round trip through HSV, then a contrast change around each channel's mean
    over an h x w image."""
    return pix.adjust_contrast(pix.hsv_to_rgb(pix.rgb_to_hsv(image)), 1.5)


def _rgb(rng, *shape):
    return rng.random(shape).astype(np.float32)


def _blur_example(h, rng):
    return (_rgb(rng, h, 8, 3),)


def _ssim_example(h, rng):
    a = _rgb(rng, h, 6, 1)
    return a, np.clip(a + 0.1 * rng.normal(size=a.shape), 0, 1).astype(np.float32)


def _hsv_example(h, rng):
    return (_rgb(rng, h, h + 1, 3),)


PROGRAMS = [
    program(name="pix_gaussian_blur", source=SRC + "augment.py gaussian_blur",
            license="Apache-2.0", fun=blur_program, in_specs=("h, 8, 3",),
            make_example=_blur_example, bound=10),
    program(name="pix_ssim", source=SRC + "metrics.py ssim", license="Apache-2.0",
            fun=ssim_program, in_specs=("h, 6, 1", "h, 6, 1"), make_example=_ssim_example,
            bound=10, sizes=(3, 4, 7, 10), pmjit_sizes=(3, 4, 7, 9, 10),
            constraints=("h >= 3",), rtol=1e-3, atol=1e-3,
            note="h >= 3: the 3 x 3 window with VALID padding"),
    program(name="pix_hsv_adjust_contrast",
            source=SRC + "color_conversion.py rgb_to_hsv, augment.py adjust_contrast",
            license="Apache-2.0", fun=hsv_contrast_program, in_specs=("h, h + 1, 3",),
            make_example=_hsv_example, bound=8, rtol=1e-3, atol=1e-3),
]
