"""The prologue: size checks eagerly, inside jit, under vmap; checks=False."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm

X = jnp.arange(5.0)


def test_size_above_bound_eager():
    f = pm.mask(jnp.sum, "n")
    with pytest.raises(pm.ShapeError, match=r"args\[0\]\.shape\[0\].*7.*\[0, 5\]"):
        f(pm.Masked(X, (7,)))
    with pytest.raises(pm.ShapeError, match="outside"):
        f(pm.Masked(X, (jnp.int32(-1),)))


def test_error_names_call_site():
    f = pm.mask(jnp.sum, "n")
    with pytest.raises(pm.ShapeError, match="test_prologue.py"):
        f(pm.Masked(X, (9,)))


def test_same_name_must_agree():
    f = pm.mask(lambda a, b: a + b, ("n", "n"))
    with pytest.raises(pm.ShapeError, match="dim var 'n'.*3.*4"):
        f(pm.Masked(X, (3,)), pm.Masked(X, (4,)))
    out = f(pm.Masked(X, (3,)), pm.Masked(X * 2, (3,)))
    np.testing.assert_array_equal(out.unpad(), [0, 3, 6])


def test_shared_dim_var_with_different_bounds():
    f = pm.mask(lambda a, b: a * b, ("n", "n"))
    out = f(pm.Masked(jnp.arange(5.0), (2,)), pm.Masked(jnp.arange(8.0), (2,)))
    assert out.bound == (5,)
    np.testing.assert_array_equal(out.unpad(), [0, 1])


def test_constraint_checked():
    f = pm.mask(lambda x: x[0] + x[1], "n", constraints=["n >= 2"])
    with pytest.raises(pm.ShapeError, match="constraint 'n >= 2'.*n=1"):
        f(pm.Masked(X, (1,)))


def test_affine_spec_divisibility():
    f = pm.mask(lambda x: x.reshape(-1, 2).sum(axis=1), "2*k")
    out = f(pm.Masked(jnp.arange(6.0), (4,)))
    np.testing.assert_array_equal(out.unpad(), [1, 5])
    with pytest.raises(pm.ShapeError, match="2\\*k"):
        f(pm.Masked(jnp.arange(6.0), (3,)))


def test_invalid_size_inside_jit_is_an_error_not_a_wrong_result():
    f = jax.jit(pm.mask(jnp.sum, "n"))
    assert float(f(pm.Masked(X, (jnp.int32(3),))).data) == 3.0
    with pytest.raises(Exception, match="outside"):
        jax.block_until_ready(f(pm.Masked(X, (jnp.int32(9),))).data)


def test_invalid_size_under_vmap_is_an_error():
    f = jax.jit(jax.vmap(pm.mask(jnp.sum, "n")))
    with pytest.raises(Exception, match="outside"):
        jax.block_until_ready(f(pm.Masked(jnp.ones((3, 5)), (jnp.array([1, 9, 2]),))).data)


def test_checks_false_removes_runtime_checks():
    f = pm.mask(jnp.sum, "n", checks=False)
    jaxpr = jax.make_jaxpr(f)(pm.Masked(X, (jnp.int32(3),)))
    assert "callback" not in str(jaxpr)
    g = pm.mask(jnp.sum, "n")
    assert "callback" in str(jax.make_jaxpr(g)(pm.Masked(X, (jnp.int32(3),))))


def test_float_and_bool_sizes_rejected():
    f = pm.mask(jnp.sum, "n")
    with pytest.raises(pm.ShapeError, match="integer"):
        f(pm.Masked(X, (3.0,)))
    with pytest.raises(pm.ShapeError, match="integer"):
        f(pm.Masked(X, (jnp.float32(3.0),)))


def test_static_fast_path_compiles_to_plain_program():
    """Unpadded inputs with static sizes give the plain function's program (a
    max or min adds its NaN keeping there too: ``rules.util.keep_nan``)."""
    def model(x, w):
        return jnp.tanh(x @ w).sum(axis=0) / jnp.exp(w).sum()

    x, w = jnp.ones((8, 4)), jnp.ones((4, 3))
    masked = pm.mask(model, ("n, 4", None))
    plain_eqns = [e.primitive.name for e in jax.make_jaxpr(model)(x, w).eqns]
    masked_jaxpr = jax.make_jaxpr(lambda x, w: masked(pm.Masked(x, (8, 4)), w).data)(x, w)
    masked_eqns = [e.primitive.name for e in masked_jaxpr.eqns]
    assert masked_eqns == plain_eqns


def test_dynamic_sizes_do_not_retrace_and_static_sizes_do():
    traces = []

    def f(x):
        traces.append(1)
        return jnp.sum(x)

    jf = jax.jit(pm.mask(f, "n"))
    for n in range(6):
        jf(pm.Masked(X, (jnp.int32(n),)))
    assert len(traces) == 1


def _if_size_is_one(x):
    if x.shape[0] == 1:  # JAX decides this symbolic `==` as False while tracing
        return x * 100.0
    return x + 1.0


def test_symbolic_equality_in_user_code_is_a_case_split():
    # JAX decides a symbolic `==` as False while tracing; polymask splits on it.
    m = pm.mask(_if_size_is_one, "n")
    for n in range(5):
        x = np.arange(4.0, dtype=np.float32)
        want = _if_size_is_one(jnp.asarray(x[:n]))
        np.testing.assert_array_equal(m(pm.Masked(jnp.asarray(x), (n,))).unpad(), want)
        got = jax.jit(m)(pm.Masked(jnp.asarray(x), (jnp.int32(n),)))
        np.testing.assert_array_equal(got.unpad(), want)
    assert len(m.cases(pm.Masked(jnp.ones(4), (1,)))[0].cases) >= 2
    # JAX's own broadcasting comparisons (inside jax) are not split on.
    g = pm.mask(lambda x, y: jnp.sum(x * y), ("n", "n"))
    assert float(g(pm.Masked(jnp.ones(4), (1,)), pm.Masked(jnp.ones(4), (1,))).data) == 1.0
    assert len(g.cases(pm.Masked(jnp.ones(4), (1,)), pm.Masked(jnp.ones(4), (1,)))[0].cases) == 1


def test_jax_function_needing_a_python_int_size_is_a_shape_error_at_user_line():
    f = pm.mask(lambda x: jnp.polyder(x), "n")
    with pytest.raises(pm.ShapeError, match=r"(?s)symbolic size at .*test_prologue.py.*lax form"):
        f(pm.pad(np.arange(5.0), 40))  # more sizes than max_cases
    out = f(pm.pad(np.arange(5.0), 12))  # few sizes: traced once per size
    np.testing.assert_allclose(out.unpad(), np.polyder(np.arange(5.0)))


def test_shape_errors_raises_the_shape_error_from_a_users_jit():
    """Under the user's own jax.jit a failed check is JAX's JaxRuntimeError (XLA's
    prefix first); polymask.shape_errors re-raises the ShapeError itself."""
    import jax
    import jax.numpy as jnp
    import pytest

    import polymask as pm

    g = jax.jit(pm.mask(lambda x, y: x + y, ("n", "n")))
    a = pm.Masked(jnp.ones(4), (jnp.int32(3),))
    b = pm.Masked(jnp.ones(4), (jnp.int32(2),))
    with pytest.raises(jax.errors.JaxRuntimeError, match="different logical values"):
        g(a, b).data.block_until_ready()
    with pytest.raises(pm.ShapeError, match=r"^dim var 'n' has different logical values: 3") as ei:
        with pm.shape_errors():
            g(a, b).data.block_until_ready()
    assert isinstance(ei.value.jax_error, jax.errors.JaxRuntimeError)
    assert ei.value.__cause__ is None and "in the masked call at" in str(ei.value)

    @pm.shape_errors()
    def step(x, y):
        return g(x, y).data.block_until_ready()

    with pytest.raises(pm.ShapeError, match="different logical values"):
        step(a, b)
    assert step(a, a)[:3].tolist() == [2.0, 2.0, 2.0]  # valid sizes: the value
    with pytest.raises(ZeroDivisionError):  # other errors pass through unchanged
        with pm.shape_errors():
            raise ZeroDivisionError("not a size error")
