"""Masked pytree, pad, stack, logical_shape."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm


def test_masked_pytree_static_and_dynamic_sizes():
    m = pm.Masked(jnp.zeros((4, 3)), (2, jnp.int32(1)))
    leaves, tree = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 2  # data + the dynamic size; the static 2 is aux data
    m2 = jax.tree_util.tree_unflatten(tree, leaves)
    assert m2.shape[0] == 2 and int(m2.shape[1]) == 1 and m2.bound == (4, 3)


def test_a_logical_shape_given_as_one_array_runs_over_the_data_axes():
    # an (r,) array is one example's shape; a (B, r) array a batch's, which
    # jax.vmap maps (it used to become r 0-d leaves and vmap's rank error)
    f = pm.mask(lambda x: jnp.sum(x, axis=1), "n, m")
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(3, 4, 5)).astype(np.float32)
    xs[:, 3:, :] = np.nan  # padding of every example (n <= 3)
    ns = np.array([[2, 3], [3, 5], [0, 1]], np.int32)
    for sizes in (ns, jnp.asarray(ns)):
        out = jax.vmap(f)(pm.Masked(jnp.asarray(xs), sizes))
        for b, (n, m) in enumerate(ns):
            np.testing.assert_allclose(out.data[b, :n], xs[b, :n, :m].sum(1), rtol=1e-6)
            assert int(out.shape[0][b]) == n
        one = f(pm.Masked(xs[1], sizes[1]))
        np.testing.assert_allclose(one.data[:3], xs[1, :3, :5].sum(1), rtol=1e-6)
    assert pm.Masked(jnp.zeros(4), jnp.int32(2)).shape == (2,)
    with pytest.raises(pm.ShapeError, match=r"array of shape \(3,\), read as 3 sizes.*rank 2"):
        pm.Masked(xs[:, 0], ns[:, 0])  # meant as a batch: sizes go in a tuple
    with pytest.raises(pm.ShapeError, match=r"array of shape \(1,\), read as 1 sizes.*rank 2"):
        pm.Masked(xs[:1, 0], ns[:1, 0])  # a batch of one: the same mistake
    np.testing.assert_array_equal(pm.pad([1.0, 2.0], 4).data, [1, 2, 0, 0])  # a list, as NumPy
    with pytest.raises(TypeError, match=r"called at .*test_masked.py"):
        pm.pad(np.ones(3), 3.7)


def test_pad_unpad_valid():
    m = pm.pad(np.arange(3.0), 5, fill=np.nan)
    assert m.bound == (5,)
    np.testing.assert_array_equal(m.unpad(), [0, 1, 2])
    np.testing.assert_array_equal(m.valid(), [1, 1, 1, 0, 0])
    with pytest.raises(pm.ShapeError, match=r"larger than its bound(.|\n)*called at .*test_masked.py"):
        pm.pad(np.arange(6.0), 5)  # the user's line is named
    with pytest.raises(pm.ShapeError, match=r"different ranks(.|\n)*called at .*test_masked.py"):
        pm.stack([np.ones(3), np.ones((2, 2))])
    with pytest.raises(pm.ShapeError, match=r"outside \[0, 3\](.|\n)*called at .*test_masked.py"):
        pm.Masked(np.ones(3), (5,)).unpad()
    with pytest.raises(pm.ShapeError, match="rank"):
        pm.pad(np.zeros((2, 2)), (3,) * 3)


def test_stack_ragged_batch_roundtrip_and_vmap():
    xs = [np.arange(n, dtype=np.float32) for n in (3, 0, 5)]
    b = pm.stack(xs)
    assert np.shape(b.data) == (3, 5)
    for got, want in zip(b.unpad(), xs):
        np.testing.assert_array_equal(got, want)
    out = jax.vmap(pm.mask(jnp.cumsum))(b)
    for got, want in zip(out.unpad(), xs):
        np.testing.assert_array_equal(got, np.cumsum(want))
    with pytest.raises(pm.ShapeError):
        pm.stack([np.zeros(2), np.zeros((2, 2))])


def test_logical_shape_inside_and_outside_mask():
    m = pm.Masked(jnp.ones((6, 2)), (jnp.int32(4), 2))
    assert pm.logical_shape(m) == m.shape
    f = pm.mask(lambda x: pm.logical_shape(x)[0] * 10 + pm.logical_shape(x)[1])
    assert int(f(m).data) == 42
    assert int(jax.jit(f)(m).data) == 42


def test_plain_array_argument_is_unpadded():
    f = pm.mask(lambda x, w: x @ w, ("n, 3", None))
    out = f(pm.Masked(jnp.ones((5, 3)), (jnp.int32(2), 3)), jnp.ones((3, 4)))
    assert out.bound == (5, 4)
    np.testing.assert_array_equal(out.unpad(), np.full((2, 4), 3.0))


def test_python_scalar_arguments_stay_weakly_typed():
    # plain JAX: a Python scalar yields to the array's dtype (bf16 * 2.0 is bf16,
    # int8 + 1 is int8); mask traced it as a strong float32/int32 before
    cases = [(lambda s, x: x * s, 2.5, np.array([1, 2, 3], jnp.bfloat16)),
             (lambda s, x: x + s, 1, np.array([1, 2, 3], np.int8))]
    for g, s, x in cases:
        want = jax.jit(g)(s, jnp.asarray(x))
        padded = pm.Masked(jnp.asarray(np.concatenate([x, x[:2]])), (3,))
        m = pm.mask(g, (None, "n"))
        for out in (m(s, padded).data, jax.jit(m)(s, padded).data,
                    jax.vmap(m, in_axes=(None, 0))(
                        s, pm.Masked(padded.data[None], (jnp.array([3]),))).data[0],
                    pm.jit(g, (None, "n"))(s, x), pm.jit(g, (None, "n"))(jnp.asarray(s), x)):
            assert out.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(out[:3], np.float32),
                                          np.asarray(want, np.float32))


def test_mask_sequence_specs_reach_keyword_and_defaulted_parameters():
    # like polymask.jit: a spec entry past the positional arguments belongs to
    # the parameter at that position, passed by keyword or left to its default
    def f(x, how="sum", w=None):
        y = x.sum(0) if how == "sum" else x.max(0)
        return y if w is None else y * w.sum()

    m = pm.Masked(jnp.asarray(np.arange(10.0, dtype=np.float32).reshape(5, 2)), (3, 2))
    exact = np.arange(6.0, dtype=np.float32).reshape(3, 2)
    specs = ("n, 2", None, "k")
    np.testing.assert_array_equal(pm.mask(f, specs)(m, how="max").unpad(), exact.max(0))
    np.testing.assert_array_equal(pm.mask(f, specs)(m).unpad(), exact.sum(0))
    w = pm.Masked(jnp.array([2.0, 3.0, 99.0]), (2,))
    np.testing.assert_array_equal(pm.mask(f, specs)(m, w=w).unpad(), exact.sum(0) * 5.0)
    with pytest.raises(pm.ShapeError, match=r"called with 1 positional argument\b(?!s)"):
        pm.mask(lambda *a: a[0], ("n", "k"))(m)
    # where the function's signature rejects the call, Python's TypeError (as
    # plain jax.jit and polymask.jit raise), not a fault of the specs
    with pytest.raises(TypeError, match="missing a required argument: 'y'"):
        pm.mask(lambda x, y: x, ("n", "k"))(m)
    with pytest.raises(TypeError, match="too many positional arguments"):
        pm.mask(lambda x, y: x, ("n", "k"))(m, m, m)


def test_out_of_range_sizes_are_caught_where_the_shape_is_an_array_and_by_valid():
    # (2, 8) data with sizes [3, 5]: read as one example's shape, 3 is past the
    # bound 2, most likely a batch's sizes meant as (sizes,)
    with pytest.raises(pm.ShapeError, match=r"outside \[0, 2\].*Masked\(data, \(sizes,\)\)"):
        pm.Masked(jnp.ones((2, 8)), jnp.array([3, 5]))
    with pytest.raises(pm.ShapeError, match=r"outside \[0, 4\](.|\n)*called at .*test_masked.py"):
        pm.Masked(jnp.ones(4), (9,)).valid()
    np.testing.assert_array_equal(pm.Masked(jnp.ones(4), (jnp.int32(2),)).valid(),
                                  [True, True, False, False])
    assert issubclass(pm.TooManyCases, pm.ShapeError)


def test_a_library_function_masked_as_it_is_names_where_it_fails():
    with pytest.raises(pm.ShapeError, match=r"fails at .*reductions.py:\d+ \(max\)"):
        pm.mask(jnp.max, "n")(pm.Masked(jnp.ones(4), (0,)))


def test_a_masked_value_rebuilt_from_its_structure_keeps_it():
    # tree_unflatten with Python-int leaves made the sizes static: a different
    # structure (vmap's in_axes from jax.tree.map(lambda _: 0, m) was no prefix;
    # jax.export of a vmapped ragged batch with a symbolic batch size crashed)
    m = pm.Masked(jnp.ones((3, 8)), (jnp.array([2, 1, 7], jnp.int32),))
    td = jax.tree_util.tree_structure(m)
    assert jax.tree_util.tree_structure(jax.tree_util.tree_unflatten(td, [0, 1])) == td

    def f(x):
        return jnp.sum(x) / x.shape[0]

    xs = np.arange(24, dtype=np.float32).reshape(3, 8)
    want = [float(f(jnp.asarray(xs[i, :n]))) for i, n in enumerate([2, 1, 7])]
    batch = pm.Masked(jnp.asarray(xs), (jnp.array([2, 1, 7], jnp.int32),))
    got = jax.vmap(pm.mask(f, "n"), in_axes=(jax.tree.map(lambda _: 0, batch),))(batch)
    np.testing.assert_allclose(got.data, want, rtol=1e-6)
    b, = jax.export.symbolic_shape("b")
    spec = pm.Masked(jax.ShapeDtypeStruct((b, 8), jnp.float32),
                     (jax.ShapeDtypeStruct((b,), jnp.int32),))
    exp = jax.export.export(jax.jit(jax.vmap(pm.mask(f, "n", checks="functional"))))(spec)
    np.testing.assert_allclose(exp.call(batch).data, want, rtol=1e-6)


def test_a_trace_s_warnings_are_said_for_the_sizes_that_reach_them():
    """A library that warns on a shape warned at trace time for every case
    of the masked trace (sizes 0, 1, ... and JAX's internal names, n__p1 - 1)
    where plain JAX, traced at one shape, warns for that shape only (helper
    A: jax.scipy.signal.welch at n = 16 gave 7 warnings, plain JAX none).
    A case's warnings are said when a call reaches it, with the spec's
    names; under jax.jit (sizes traced) each case's, with its sizes."""
    import warnings

    from jax.scipy import signal

    def short(x):
        if x.shape[0] < 4:
            warnings.warn(f"short input of length {x.shape[0]}", RuntimeWarning, stacklevel=2)
        return x * 2

    def said(call) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        return [str(w.message) for w in caught]

    assert said(lambda: pm.mask(short, "n")(pm.Masked(jnp.ones(8), (6,)))) == []
    assert said(lambda: pm.jit(short, "n", tiered=False)(np.ones(6, np.float32))) == []
    assert said(lambda: pm.mask(short, "n")(pm.Masked(jnp.ones(8), (2,)))) == [
        "short input of length n"]
    assert said(lambda: jax.jit(pm.mask(lambda x: short(x) + 1, "n"))(
        pm.Masked(jnp.ones(8), (jnp.int32(6),)))) == [
        "(for sizes n in {0..3}) short input of length n"]
    g = pm.jit(lambda x: short(x) - 1, "n", tiered=False)
    assert said(lambda: g(np.ones(6, np.float32))) == []
    assert said(lambda: g(np.ones(2, np.float32))) == ["short input of length n"]

    def psd(x):
        return signal.welch(x, fs=10.0, nperseg=4, noverlap=2)[1]

    x = np.random.default_rng(0).normal(size=16).astype(np.float32)
    assert said(lambda: psd(jnp.asarray(x))) == []
    assert said(lambda: pm.mask(psd, "n")(pm.Masked(x, (16,)))) == []
    # (welch is traced per size: fallback=False keeps its one program of 17 cases,
    # whose trace warned for other sizes; with the fallback each shape runs plain)
    assert said(lambda: pm.jit(psd, "n", tiered=False, fallback=False)(x)) == []
    # the patch is global while a trace runs: a thread not tracing warns as
    # before, at its own line (one frame deeper through the replacement)
    from polymask.tracing.trace_warnings import warn_during_trace

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_during_trace("not in a trace", RuntimeWarning)
    assert [(str(w.message), w.category, w.filename) for w in caught] == [
        ("not in a trace", RuntimeWarning, __file__)]



def test_mask_is_also_a_decorator_factory_and_refuses_a_spec_for_the_function():
    @pm.mask(in_specs="n")
    def total(x):
        return jnp.sum(x)

    x = pm.pad(np.arange(3.0, dtype=np.float32), 8)
    assert float(total(x)) == 3.0 and type(total).__name__ == "MaskedFunction"
    with pytest.raises(TypeError, match=r"takes the function first.*@polymask.mask\(in_specs='n'\)"):
        pm.mask("n")


def test_a_masked_value_read_as_an_array_says_to_unpad_it():
    """A forgotten unpad(): np.asarray made an object array, bool() was True
    whatever the value, float() and arithmetic gave Python's bare TypeError."""
    m = pm.mask(lambda x: x * 2, "n")(pm.pad(np.zeros(3, np.float32), 8))
    for read in (np.asarray, float, bool, lambda v: v + 1, lambda v: 1 - v, lambda v: -v,
                 lambda v: v < 0, lambda v: jnp.ones(8) * v):
        with pytest.raises(TypeError, match=r"Masked value .*call \.unpad\(\)"):
            read(m)
    np.testing.assert_array_equal(np.asarray(m.unpad()), [0, 0, 0])
    # a scalar output has no padding: it converts as its data does
    s = pm.mask(lambda x: x.sum(), "n")(pm.pad(np.zeros(3, np.float32), 8))
    assert (float(s), bool(s), int(s), np.asarray(s).shape) == (0.0, False, 0, ())


def test_python_int_sizes_inside_jax_jit_are_said_to_compile_per_size():
    """Masked(x, (n, 4)) with a Python int n is static under jax.jit: one
    compile per size, silently; said once at the second size (array sizes
    share one program and say nothing)."""
    f = jax.jit(pm.mask(lambda x: jnp.sum(x, 0) / x.shape[0], "n, 4"))
    xp = jnp.ones((8, 4))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(pm.ShapeError, match="logical size 9"):  # (not listed below)
            f(pm.Masked(xp, (9, 4)))
        for n in (1, 2, 3):
            np.testing.assert_allclose(f(pm.Masked(xp, (n, 4))).unpad(), np.ones(4))
        for n in (1, 2, 3):
            f(pm.Masked(xp, (np.int32(n), 4)))
        g = pm.mask(lambda x: jnp.sum(x ** 2), "n, 4")  # eager grad compiles no program
        for n in (1, 2, 3):
            grad = jax.grad(lambda d, n=n: g(pm.Masked(d, (n, 4))).data)(xp)
            np.testing.assert_allclose(grad, np.where(np.arange(8)[:, None] < n, 2.0, 0.0) * xp)
    said = [w for w in seen if issubclass(w.category, pm.FallbackWarning)]
    assert len(said) == 1 and "(n = 1; n = 2)" in str(said[0].message)
    assert said[0].filename == __file__  # the user's line


def test_a_masked_value_compared_or_used_as_an_array_says_to_unpad_it():
    """``out == 2`` fell back to identity (silently False); ``out.sum()`` and
    ``out[0]`` gave Python's bare errors. Two Masked values still compare by
    identity, and a Masked stays hashable (a dict key)."""
    out = pm.mask(lambda x: x * 2, "n")(pm.pad(np.ones(3, np.float32), 8))
    for read in (lambda v: v == 2, lambda v: v != 2, lambda v: v[0], lambda v: v.sum()):
        with pytest.raises((TypeError, AttributeError), match=r"call \.unpad\(\)"):
            read(out)
    assert out == out and out != pm.Masked(out.data, out.shape) and {out: 1}[out] == 1
    assert not hasattr(out, "sum") and hasattr(out, "unpad")


@pytest.mark.parametrize("size", [np.int64(2**32 + 3), np.uint32(2**32 - 1),
                                  np.int64(-2**32 + 3), np.array([2**32 + 3, 2], np.int64)])
def test_a_numpy_size_past_int32_raises_instead_of_wrapping_under_jit(size):
    """``jax.jit`` converts an int64 size to int32 by wrapping: 2**32 + 3 ran as
    3 and returned a value (the prologue saw 3). Refused where the Masked is made."""
    f = pm.mask(lambda x: x.sum(), "n")
    x = np.arange(8, dtype=np.float32).reshape((1, 8) if np.ndim(size) else (8,))
    if np.ndim(size):
        x = np.tile(x, (2, 1))
    with pytest.raises(pm.ShapeError, match=r"shape\[0\] = -?42949672\d\d \((int64|uint32)\) "
                                            r"is outside \[0, 8\].*does not fit int32"):
        jax.jit(f)(pm.Masked(x, (size,)))
    # in range, an int64 size is taken as any other
    assert float(jax.jit(f)(pm.Masked(np.arange(8, dtype=np.float32), (np.int64(3),))).data) == 3.0
    # a size put in by a tree map (tree_unflatten: no __init__) is checked too
    ok = pm.Masked(x, (np.tile(np.int64(3), np.shape(size)) if np.ndim(size) else np.int64(3),))
    rebuilt = jax.tree.map(lambda leaf: size if np.ndim(leaf) == np.ndim(size)
                           and leaf.dtype == np.int64 else leaf, ok)
    with pytest.raises(pm.ShapeError, match="does not fit int32"):
        jax.jit(f)(rebuilt)
