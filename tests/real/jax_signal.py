"""jax.scipy.signal on a variable-length signal: convolve (mode 'same'),
detrend, and stft's magnitude spectrogram.

Source: https://github.com/jax-ml/jax (jax 0.10.2, as installed),
jax/_src/scipy/signal.py: convolve, detrend, stft (the SciPy-compatible
functions). License: Apache-2.0, Copyright 2020 The JAX Authors.
The programs call jax.scipy.signal itself; the smoothing / spectrogram
wrappers over one signal of T samples are ours.
"""

import jax.numpy as jnp
import numpy as np
from jax.scipy import signal

from .corpus import normal, program

SRC = "jax https://github.com/jax-ml/jax/blob/jax-v0.10.2/jax/_src/scipy/signal.py"


def smooth(x, kernel):
    """A moving-average-like smoothing filter, same length as the input."""
    return signal.convolve(x, kernel, mode="same")


def _smooth_example(n, rng):
    return normal(rng, n), np.array([0.25, 0.5, 0.25], np.float32)


def full_convolve(x, kernel):
    return signal.convolve(x, kernel, mode="full"), signal.convolve(x, kernel, mode="valid")


def _full_example(n, rng):
    return normal(rng, n), np.array([0.25, 0.5, 0.25], np.float32)


def detrend_linear(x):
    """Remove the least-squares line (and the mean) from a series."""
    return signal.detrend(x), signal.detrend(x, type="constant")


def _detrend_example(n, rng):
    return ((np.arange(n) * 0.3 + rng.normal(size=n)).astype(np.float32),)


def spectrogram(x):
    """|STFT|^2 with 8-sample Hann windows (4-sample hop): frames = T / 4 + 1."""
    f, t, Z = signal.stft(x, nperseg=8)
    return jnp.abs(Z) ** 2


def _stft_example(n, rng):
    return (normal(rng, 4 * n),)


PROGRAMS = [
    program(name="jax_signal_convolve_same", source=SRC + " convolve", license="Apache-2.0",
            fun=smooth, in_specs=("t", None), make_example=_smooth_example, bound=16),
    program(name="jax_signal_convolve_full_valid", source=SRC + " convolve",
            license="Apache-2.0", fun=full_convolve, in_specs=("t", None),
            make_example=_full_example, bound=16, sizes=(3, 4, 9, 16),
            pmjit_sizes=(3, 4, 9, 15, 16), constraints=("t >= 3",),
            note="mode 'valid' needs t >= len(kernel)"),
    program(name="jax_signal_detrend", source=SRC + " detrend", license="Apache-2.0",
            fun=detrend_linear, in_specs=("t",), make_example=_detrend_example, bound=16,
            sizes=(2, 3, 9, 16), pmjit_sizes=(2, 3, 9, 15, 16), constraints=("t >= 2",),
            rtol=1e-3, atol=1e-3),
    program(name="jax_signal_stft_spectrogram", source=SRC + " stft", license="Apache-2.0",
            fun=spectrogram, in_specs=("4*t",), make_example=_stft_example, bound=8,
            sizes=(2, 3, 5, 8), pmjit_sizes=(2, 3, 5, 7, 8), constraints=("t >= 2",),
            note="at least one 8-sample window"),
]
