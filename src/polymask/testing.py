"""The test oracle (DESIGN.md): compare ``mask(f)`` with ``f`` on exact arrays.

For logical inputs ``x`` and bounds ``b``: embed ``x`` into buffers of shape
``b`` filled with garbage (NaN for floats, extreme values for ints), run
``mask(f)``; the unpadded outputs and logical shapes must equal ``f(x)`` run at
exact shapes, eagerly, under ``jax.jit`` (one trace for all the examples),
under ``jax.vmap`` (a ragged batch) and for ``jax.grad`` (logical region
equal, padding zero, all finite). Public so users can test their own models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .core.masked import Masked
from .tracing.transform import mask

__all__ = ["garbage_pad", "check_oracle"]


# ml_dtypes floats with no NaN encoding (nor inf): a NaN cast to them is -0.0
_NO_NAN_FLOATS = frozenset(n for n in ("float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn")
                           if hasattr(jnp, n))


def garbage_value(dtype):
    """The padding fill of ``garbage_pad``: NaN for floats (bfloat16 and float8
    included; the largest finite value for float types without NaN), True for
    bools, a large value for ints."""
    dtype = np.dtype(dtype)
    # jnp.issubdtype knows the ml_dtypes floats (bfloat16, float8_*), which
    # np.issubdtype does not count as np.inexact.
    if jnp.issubdtype(dtype, jnp.inexact):
        if dtype.name in _NO_NAN_FLOATS:
            return jnp.finfo(dtype).max  # float4_e2m1fn: 6.0
        return np.nan
    if dtype == np.bool_:
        return True
    info = jnp.iinfo(dtype)
    return min(int(info.max), int(info.max) // 2 + 7)  # int4: max // 2 + 7 overflows


def garbage_pad(x, bound: Sequence[int], fill=None) -> np.ndarray:
    """``x`` embedded in a ``bound``-shaped buffer whose padding is garbage."""
    x = np.asarray(x)
    fill = garbage_value(x.dtype) if fill is None else fill
    buf = np.full(tuple(bound), fill, dtype=x.dtype)
    buf[tuple(slice(0, s) for s in x.shape)] = x
    return buf


def _to_masked(x, bound, dynamic=True):
    if bound is None:
        return jnp.asarray(x)
    x = np.asarray(x)
    sizes = tuple(np.int32(s) for s in x.shape) if dynamic else tuple(x.shape)
    return Masked(jnp.asarray(garbage_pad(x, bound)), sizes)


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda v: isinstance(v, Masked))


def _assert_close(got, want, rtol, atol, what):
    if isinstance(want, (bool, int, float, complex)):  # a Python scalar: as JAX returns it
        want = jnp.asarray(want)
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: logical shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if jnp.issubdtype(want.dtype, jnp.inexact):
        if not np.issubdtype(want.dtype, np.inexact):  # bfloat16, float8: compare as float32
            got, want = got.astype(np.float32), want.astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def _unpad_batched(m: Masked, i: int):
    sizes = tuple(int(np.asarray(s)[i]) if np.ndim(s) else int(s) for s in m.shape)
    return np.asarray(m.data[i])[tuple(slice(0, s) for s in sizes)]


def _plain(fun: Callable, *args):
    """Plain JAX on exact arrays, compiled as one program (one XLA compile per
    size instead of one per primitive: the oracle's cost in the test suite);
    eagerly when ``fun`` cannot be traced (concrete values, host code): then
    plain JAX's own value or error."""
    try:
        return jax.jit(fun)(*args)
    except Exception:  # noqa: BLE001 - not traceable: eager plain JAX is the reference
        return fun(*args)


def check_oracle(fun: Callable, examples: Sequence[Sequence[Any]],
                 bounds: Sequence[Sequence[int] | None], in_specs=None, *,
                 constraints=(), modes=("eager", "jit", "vmap", "grad"),
                 rtol: float = 1e-5, atol: float = 1e-5, grad_rtol: float | None = None,
                 static_sizes: bool = True) -> None:
    """Assert that ``mask(fun)`` matches ``fun`` on each example.

    Args:
      fun: function of arrays returning an array or a pytree of arrays.
      examples: list of argument tuples of *logical* (exact) arrays.
      bounds: per argument, the padded shape (None: pass the argument as a
        plain, unpadded array).
      modes: any of "eager", "jit", "vmap", "grad". ``grad``: ``jax.jit(jax.grad)``
        of a random projection of the outputs, the sizes traced (arguments of
        the jitted gradient, so every case of a split is transposed), against
        plain JAX's gradient; finite, and exactly 0 in the padding. Sizes
        where plain JAX's own gradient raises are skipped.
      static_sizes: also run eagerly with Python-int sizes (static fast path).

    Raises:
      AssertionError: on any mismatch, naming the example and the mode.
      ValueError: ``bounds`` with another length than each example's
        arguments (one bound per argument, shared by every example).
    """
    for i, ex in enumerate(examples):
        if len(ex) != len(bounds):
            raise ValueError(
                f"check_oracle: examples[{i}] has {len(ex)} argument(s) but bounds has "
                f"{len(bounds)} entries; bounds gives one padded shape per argument "
                "(shared by every example), e.g. [(8,)] for examples [(x3,), (x7,)]")
    refs = [_plain(fun, *[jnp.asarray(a) for a in ex]) for ex in examples]
    mfun = mask(fun, in_specs, constraints=constraints)

    def padded_args(ex, dynamic=True):
        return [_to_masked(a, b, dynamic) for a, b in zip(ex, bounds)]

    def compare(out, ref, what):
        outs, rs = _leaves(out), jax.tree_util.tree_leaves(ref)
        assert len(outs) == len(rs), f"{what}: {len(outs)} outputs, expected {len(rs)}"
        for k, (o, r) in enumerate(zip(outs, rs)):
            _assert_close(o.unpad(), r, rtol, atol, f"{what}, output {k}")

    if "eager" in modes:
        for i, (ex, ref) in enumerate(zip(examples, refs)):
            compare(mfun(*padded_args(ex)), ref, f"eager, example {i}")
            if static_sizes:
                compare(mfun(*padded_args(ex, dynamic=False)), ref, f"static, example {i}")

    if "jit" in modes:
        traces = []

        def counted(*args):
            traces.append(1)
            return mfun(*args)

        jf = jax.jit(counted)
        for i, (ex, ref) in enumerate(zip(examples, refs)):
            compare(jf(*padded_args(ex)), ref, f"jit, example {i}")
        assert len(traces) == 1, f"jit traced {len(traces)} times for {len(examples)} sizes"

    if "vmap" in modes:
        # A ragged batch of all the examples (a batch of one when there is one
        # example). Plain (unpadded) arguments that are equal across examples
        # are passed unbatched; ones that differ are batched when their shapes
        # agree, and are an error otherwise (vmap cannot batch them).
        per = [padded_args(ex) for ex in examples]
        in_axes = []
        stacked = []
        for j, b in enumerate(bounds):
            if b is None:
                if _same(examples, j):
                    in_axes.append(None)
                    stacked.append(per[0][j])
                    continue
                shapes = {np.shape(ex[j]) for ex in examples}
                if len(shapes) != 1:
                    raise ValueError(
                        f"check_oracle: vmap mode: plain argument {j} has different shapes "
                        f"{sorted(shapes)} across examples; give it a bound or drop 'vmap' "
                        "from modes")
                in_axes.append(0)
                stacked.append(jnp.stack([jnp.asarray(ex[j]) for ex in examples]))
                continue
            in_axes.append(0)
            data = jnp.stack([p[j].data for p in per])
            sizes = tuple(jnp.stack([jnp.asarray(p[j].shape[k]) for p in per])
                          for k in range(len(b)))
            stacked.append(Masked(data, sizes))
        out = jax.jit(jax.vmap(mfun, in_axes=in_axes))(*stacked)
        outs = _leaves(out)
        for i, ref in enumerate(refs):
            rs = jax.tree_util.tree_leaves(ref)
            assert len(outs) == len(rs), f"vmap: {len(outs)} outputs, expected {len(rs)}"
            for k, (o, r) in enumerate(zip(outs, rs)):
                _assert_close(_unpad_batched(o, i), r, rtol, atol,
                              f"vmap, example {i}, output {k}")

    if "grad" in modes:
        _check_grad(fun, mfun, examples, refs, bounds, grad_rtol or max(rtol, 1e-4), atol)


def _same(examples, j):
    first = np.asarray(examples[0][j])
    return all(np.array_equal(np.asarray(ex[j]), first) for ex in examples)


def _check_grad(fun, mfun, examples, refs, bounds, rtol, atol):
    rng = np.random.default_rng(0)
    for i, (ex, ref_out) in enumerate(zip(examples, refs)):
        float_args = [j for j, a in enumerate(ex)
                      if jnp.issubdtype(np.asarray(a).dtype, jnp.floating)]
        if not float_args:
            continue
        if not any(jnp.issubdtype(jnp.result_type(r), jnp.floating)
                   for r in jax.tree_util.tree_leaves(ref_out)):
            continue  # no float output to differentiate
        weights = [rng.normal(size=np.shape(r)).astype(np.float32)
                   for r in jax.tree_util.tree_leaves(ref_out)]

        def ref_loss(*xs):
            outs = jax.tree_util.tree_leaves(fun(*xs))
            return sum(jnp.sum(jnp.where(jnp.isfinite(w), o * w, 0.0))
                       for o, w in zip(outs, weights)
                       if jnp.issubdtype(jnp.result_type(o), jnp.floating))  # (a size: an int)

        try:
            ref_grads = _plain(jax.grad(ref_loss, argnums=float_args),
                               *[jnp.asarray(a) for a in ex])
        except Exception:  # noqa: BLE001 - plain JAX's own gradient fails at this size
            continue  # (docs/limitations.md: zeros under mask, e.g. irfft to length 0)
        margs = [_to_masked(a, b) for a, b in zip(ex, bounds)]
        sizes = [m.shape if isinstance(m, Masked) else None for m in margs]

        def masked_loss(datas, sizes):
            # the sizes are arguments of the jitted gradient: traced, as in a
            # user's jax.jit(jax.grad(loss))(params, batch), so a case split is
            # a lax.switch whose every branch JAX transposes
            args = list(margs)
            for j, s in enumerate(sizes):
                if s is not None:
                    args[j] = Masked(margs[j].data, s)
            for j, d in zip(float_args, datas):
                args[j] = Masked(d, args[j].shape) if isinstance(args[j], Masked) else d
            outs = _leaves(mfun(*args))
            total = 0.0
            for o, w in zip(outs, weights):
                if not jnp.issubdtype(o.data.dtype, jnp.floating):
                    continue
                wp = jnp.asarray(garbage_pad(w, o.data.shape, fill=0.0))
                total = total + jnp.sum(jnp.where(o.valid(), o.data * wp, 0.0))
            return total

        datas = [margs[j].data if isinstance(margs[j], Masked) else margs[j] for j in float_args]
        grads = jax.jit(jax.grad(masked_loss))(datas, sizes)
        for j, g, rg in zip(float_args, grads, ref_grads):
            g = np.asarray(g)
            logical = np.asarray(ex[j]).shape
            region = tuple(slice(0, s) for s in logical)
            # finite wherever plain JAX's gradient is (std of one element is NaN there too)
            finite = np.array(np.isfinite(g), ndmin=0)  # an array even for a 0-d gradient
            finite[region] |= ~np.isfinite(np.asarray(rg))
            assert np.all(finite), f"grad, example {i}, arg {j}: non-finite gradient"
            _assert_close(g[region], rg, rtol, atol, f"grad, example {i}, arg {j}")
            pad_part = g.copy()
            pad_part[region] = 0
            assert np.all(pad_part == 0), f"grad, example {i}, arg {j}: non-zero in padding"
