"""State-space sequence models: Mamba's selective scan and S4's convolution / recurrence.

Sources:
- mamba-minimal, https://github.com/johnma2006/mamba-minimal (Apache-2.0,
  Copyright John Ma), model.py MambaBlock.forward (in_proj, depthwise causal
  conv1d with padding d_conv - 1 then ``[:, :, :l]``, SiLU, ssm: x_proj,
  softplus(dt_proj), ``selective_scan`` over the sequence, gate, out_proj),
  written in JAX (as mamba-minimal-jax does; ``lax.scan`` over l).
- The Annotated S4, https://github.com/srush/annotated-s4 (MIT, Copyright (c)
  2021 Sasha Rush), s4/s4.py: discretize (bilinear), K_conv (``for l in
  range(L)``), causal_convolution (FFT: ``jnp.fft.rfft(jnp.pad(u, (0, K.shape[0])))``),
  scan_SSM (recurrent form).
Sequence length l = n; model width fixed.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .corpus import normal, params, program

SRC_M = "mamba-minimal https://github.com/johnma2006/mamba-minimal/blob/master/model.py"
SRC_S = "annotated-s4 https://github.com/srush/annotated-s4/blob/main/s4/s4.py"
D_MODEL, D_INNER, D_STATE, D_CONV, DT_RANK = 4, 8, 4, 4, 2


def selective_scan(u, delta, A, B, C, D):
    deltaA = jnp.exp(jnp.einsum("ld,dn->ldn", delta, A))
    deltaB_u = jnp.einsum("ld,ln,ld->ldn", delta, B, u)

    def step(x, inp):
        dA, dBu, c = inp
        x = dA * x + dBu
        return x, jnp.einsum("dn,n->d", x, c)

    _, ys = lax.scan(step, jnp.zeros((u.shape[1], A.shape[1])), (deltaA, deltaB_u, C))
    return ys + u * D


def mamba_block(x, in_proj, conv_w, conv_b, x_proj, dt_proj_w, dt_proj_b, A_log, D, out_proj):
    l = x.shape[0]
    x_and_res = x @ in_proj
    x, res = jnp.split(x_and_res, [D_INNER], axis=-1)
    # depthwise Conv1d(kernel=D_CONV, padding=D_CONV - 1), then [:l]
    xp = jnp.pad(x, ((D_CONV - 1, D_CONV - 1), (0, 0)))
    x = jax.lax.conv_general_dilated(xp.T[None], conv_w[:, None, :], (1,), "VALID",
                                     feature_group_count=D_INNER)[0].T + conv_b
    x = x[:l]
    x = jax.nn.silu(x)
    A = -jnp.exp(A_log)
    x_dbl = x @ x_proj
    delta, B, C = jnp.split(x_dbl, [DT_RANK, DT_RANK + D_STATE], axis=-1)
    delta = jax.nn.softplus(delta @ dt_proj_w + dt_proj_b)
    y = selective_scan(x, delta, A, B, C, D)
    y = y * jax.nn.silu(res)
    return y @ out_proj


def _mamba_params(rng):
    return (normal(rng, D_MODEL, 2 * D_INNER, scale=0.5), normal(rng, D_INNER, D_CONV, scale=0.5),
            normal(rng, D_INNER, scale=0.1), normal(rng, D_INNER, DT_RANK + 2 * D_STATE, scale=0.5),
            normal(rng, DT_RANK, D_INNER, scale=0.5), normal(rng, D_INNER, scale=0.1),
            np.log(np.tile(np.arange(1, D_STATE + 1, dtype=np.float32), (D_INNER, 1))),
            np.ones(D_INNER, np.float32), normal(rng, D_INNER, D_MODEL, scale=0.5))


# -- Annotated S4 -----------------------------------------------------------------------------------
def discretize(A, B, C, step):
    I = jnp.eye(A.shape[0])
    BL = jnp.linalg.inv(I - (step / 2.0) * A)
    Ab = BL @ (I + (step / 2.0) * A)
    Bb = (BL * step) @ B
    return Ab, Bb, C


def K_conv(Ab, Bb, Cb, L):
    return jnp.array([(Cb @ jnp.linalg.matrix_power(Ab, l) @ Bb).reshape() for l in range(L)])


def causal_convolution(u, K):
    assert K.shape[0] == u.shape[0]
    ud = jnp.fft.rfft(jnp.pad(u, (0, K.shape[0])))
    Kd = jnp.fft.rfft(jnp.pad(K, (0, u.shape[0])))
    out = ud * Kd
    return jnp.fft.irfft(out)[: u.shape[0]]


def scan_SSM(Ab, Bb, Cb, u, x0):
    def step(x_k_1, u_k):
        x_k = Ab @ x_k_1 + Bb @ u_k
        y_k = Cb @ x_k
        return x_k, y_k

    return lax.scan(step, x0, u)


def s4_conv(u, A, B, C, log_step):
    """SSM layer, convolution mode: y = K * u with K from the discretised SSM."""
    L = u.shape[0]
    Ab, Bb, Cb = discretize(A, B, C, jnp.exp(log_step))
    return causal_convolution(u, K_conv(Ab, Bb, Cb, L))


def s4_recurrent(u, A, B, C, log_step):
    """SSM layer, recurrent mode (the same outputs as s4_conv)."""
    Ab, Bb, Cb = discretize(A, B, C, jnp.exp(log_step))
    return scan_SSM(Ab, Bb, Cb, u[:, None], jnp.zeros((A.shape[0],)))[1][:, 0]


def _s4_params(rng):
    N = 4
    A = (rng.normal(size=(N, N)) * 0.3 - 1.0 * np.eye(N)).astype(np.float32)
    return A, normal(rng, N, 1), normal(rng, 1, N), np.float32(np.log(0.1))


PROGRAMS = [
    program(name="mamba_selective_scan_block", source=SRC_M + " MambaBlock", license="Apache-2.0",
            fun=mamba_block, in_specs=("l, 4",) + (None,) * 9,
            make_example=lambda n, rng: (normal(rng, n, D_MODEL),) + params(90, _mamba_params),
            bound=8),
    program(name="s4_convolution_fft", source=SRC_S + " K_conv + causal_convolution",
            license="MIT", fun=s4_conv, in_specs=("l", None, None, None, None),
            make_example=lambda n, rng: (normal(rng, n),) + params(91, _s4_params), bound=8,
            rtol=1e-3, atol=1e-4),
    program(name="s4_recurrent_scan", source=SRC_S + " scan_SSM", license="MIT",
            fun=s4_recurrent, in_specs=("l", None, None, None, None),
            make_example=lambda n, rng: (normal(rng, n),) + params(91, _s4_params), bound=8),
]
