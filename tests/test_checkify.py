"""``checkify.check`` inside a masked function (rules/checks.py): it fails
exactly where plain JAX's check fails on the exact arrays, never on padding,
on another case's garbage under ``jax.vmap``, or on a loop's steps past the
logical length."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import polymask as pm

BOUND = 8


def _padded(values, fill=np.nan):
    x = np.full(BOUND, fill, np.float32)
    x[:len(values)] = values
    return x


def _positive(x):
    checkify.check(jnp.all(x > 0), "x must be positive, min {m}", m=jnp.min(x))
    return jnp.log(x)


@pytest.mark.parametrize("fill", [np.nan, -1.0])
def test_a_check_sees_the_logical_values_eagerly_and_under_jit(fill):
    checked = checkify.checkify(pm.mask(_positive, "n"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="zero-size array"):  # as plain JAX
        jax.jit(checked)(pm.Masked(_padded([], fill), (jnp.int32(0),)))
    for n in (1, 3, BOUND):
        values = np.arange(1, n + 1, dtype=np.float32)
        for size in (n, jnp.int32(n)):
            err, out = jax.jit(checked)(pm.Masked(_padded(values, fill), (size,)))
            assert err.get() is None
            np.testing.assert_allclose(out.unpad(), np.log(values), rtol=1e-6)
    values = np.array([1.0, -5.0, 3.0], np.float32)
    err, _ = jax.jit(checked)(pm.Masked(_padded(values, fill), (jnp.int32(3),)))
    plain, _ = checkify.checkify(_positive)(values)
    assert err.get() == plain.get() and "min -5.0" in err.get()


def _split(x):
    checkify.check(jnp.all(x > 0), "x must be positive")
    if x.shape[0] == 2:  # polymask splits the trace on the comparison
        return x * 10.0
    return x[1:] - x[:-1] if x.shape[0] > 0 else x


def test_under_vmap_a_check_of_one_case_ignores_examples_of_other_cases():
    """Every case runs for every example under vmap: the n == 2 case reads two
    entries of the others' padding (NaN, -1), which failed the check before."""
    ns = np.array([0, 1, 2, 5, BOUND])
    xs = np.stack([_padded(np.arange(1, n + 1), fill=-1.0) for n in ns])
    checked = jax.jit(checkify.checkify(jax.vmap(pm.mask(_split, "n"))))
    err, out = checked(pm.Masked(jnp.asarray(xs), (jnp.asarray(ns),)))
    assert err.get() is None
    for i, n in enumerate(ns):
        want = _split(jnp.arange(1, n + 1, dtype=jnp.float32))
        np.testing.assert_allclose(out.data[i, :want.shape[0]], want)
    xs[3, 4] = -2.0  # a logical value of the n = 5 example: its check fails, as in plain JAX
    err, _ = checked(pm.Masked(jnp.asarray(xs), (jnp.asarray(ns),)))
    assert err.get() is not None and "x must be positive" in err.get()


@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
def test_a_check_in_a_loop_body_ignores_the_steps_past_the_logical_length(loop):
    """Steps past an example's length (a scan over a dynamic axis; a fori_loop
    under vmap runs to the longest example) read its padding, -1 here: the
    check fails only on a logical entry."""
    def f(x):
        def check(xi, i):
            checkify.check(xi > 0, "entry {i} is not positive", i=i)
            return jnp.log(xi)

        if loop == "scan":
            def step(acc, xi_i):
                return acc + check(*xi_i), None
            return jax.lax.scan(step, jnp.float32(0), (x, jnp.arange(x.shape[0])))[0]
        return jax.lax.fori_loop(0, x.shape[0], lambda i, acc: acc + check(x[i], i),
                                 jnp.float32(0))

    def want(n):
        return np.sum(np.log(np.arange(1, n + 1, dtype=np.float32)))

    checked = jax.jit(checkify.checkify(pm.mask(f, "n")))
    for n in (1, 3, BOUND):  # (x[i] of an empty x fails in plain JAX too)
        err, out = checked(pm.Masked(_padded(np.arange(1, n + 1), -1.0), (jnp.int32(n),)))
        assert err.get() is None
        np.testing.assert_allclose(out.data, want(n), rtol=1e-6)
    err, _ = checked(pm.Masked(_padded([1.0, 2.0, -1.0], -1.0), (jnp.int32(3),)))
    assert err.get() is not None and "entry 2 is not positive" in err.get()
    ns = np.array([1, 3, BOUND])
    xs = np.stack([_padded(np.arange(1, n + 1), -1.0) for n in ns])
    batched = jax.jit(checkify.checkify(jax.vmap(pm.mask(f, "n"))))
    err, out = batched(pm.Masked(jnp.asarray(xs), (jnp.asarray(ns),)))
    assert err.get() is None
    np.testing.assert_allclose(out.data, [want(n) for n in ns], rtol=1e-6)


def test_formatting_an_array_of_dynamic_size_is_refused_naming_the_check():
    def f(x):
        checkify.check(jnp.all(x > 0), "bad x {x}", x=x)
        return x

    with pytest.raises(pm.UnsupportedError, match="'check'.*print its padding"):
        checkify.checkify(pm.mask(f, "n"))(pm.Masked(_padded([1.0, 2.0]), (jnp.int32(2),)))


@pytest.mark.parametrize("runner", ["jit", "ragged_padded", "ragged_packed", "mask"])
def test_checkify_inside_a_runner_checks_the_logical_values_only(runner):
    """``checkify.checkify(f, errors=float_checks)`` inside polymask: the NaN
    checks are reductions over the values, which polymask masks, so NaN
    padding (and the NaN a padded sqrt makes) is never reported; a NaN made
    from a logical value is, with plain JAX's message."""
    def f(x):
        checkify.check(jnp.all(x < 100), "too large")
        return jnp.sum(jnp.sqrt(x - 1.0))

    cf = checkify.checkify(f, errors=checkify.all_checks)
    examples = [np.array(v, np.float32) for v in
                ([1.0, 2.0, 3.0], [2.0], [], [1.0, 0.5, 3.0], [5.0, 200.0])]
    if runner == "jit":
        got = [pm.jit(cf, "n")(x) for x in examples]
    elif runner == "mask":
        masked = jax.jit(pm.mask(cf, "n"))
        unpad = lambda t: jax.tree.map(lambda m: m.unpad(), t,
                                       is_leaf=lambda v: isinstance(v, pm.Masked))
        got = [unpad(masked(pm.Masked(_padded(x), (jnp.int32(len(x)),)))) for x in examples]
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pm.PackedLayoutWarning)
            got = pm.ragged_map(cf, "n", layout=runner.split("_")[1])(examples)
    for x, (err, out) in zip(examples, got):
        plain_err, plain_out = cf(x)
        assert err.get() == plain_err.get(), (x, err.get(), plain_err.get())
        np.testing.assert_allclose(out, plain_out, rtol=1e-6)
    assert [e.get() is None for e, _ in got] == [True, True, True, False, False]


def test_checkify_inside_with_a_size_comparison_runs_per_shape_and_says_why():
    """checkify's Error records each check's source traceback in its static
    data, so the cases of a size comparison return different structures: mask
    keeps the structure of most sizes and says so for the others (never a
    wrong error value), the runners run those sizes per exact shape with plain
    JAX's errors."""
    def f(x):
        if x.shape[0] == 2:
            return jnp.log(x[::-1])
        return jnp.log(x)

    cf = checkify.checkify(f, errors=checkify.float_checks)
    masked = pm.mask(cf, "n")
    with pytest.raises(pm.ShapeError, match=r"(?s)n in \{2\}.*static data differs.*checkify"):
        masked(pm.pad(np.ones(2, np.float32), BOUND))
    # the sizes past the comparison share one program (on jax 0.10, n <= 1's
    # Error numbers its checks otherwise: left out too)
    for values in ([1.0, 2.0, 3.0], [-1.0, 2.0, 3.0], [1.0, 2.0, -3.0, 4.0]):
        x = np.array(values, np.float32)
        err, out = masked(pm.pad(x, BOUND, fill=np.nan))
        plain_err, plain_out = cf(x)
        assert err.get() == plain_err.get()
        np.testing.assert_allclose(out.unpad(), plain_out, rtol=1e-6)
    runner = pm.jit(cf, "n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pm.FallbackWarning)
        for values in ([1.0, 2.0], [1.0, -2.0], [1.0, 2.0, 3.0], [-1.0, 2.0, 3.0]):
            x = np.array(values, np.float32)
            err, out = runner(x)
            plain_err, plain_out = cf(x)
            assert err.get() == plain_err.get()
            np.testing.assert_allclose(out, plain_out, rtol=1e-6)
