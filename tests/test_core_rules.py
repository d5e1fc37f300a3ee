"""Oracle tests for the core rule families: elementwise, reductions, dot_general,
cumulative ops, sort and custom derivatives (eager, jit, vmap, grad; NaN padding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import polymask as pm
from polymask.testing import check_oracle

RNG = np.random.default_rng(0)
B = 6  # bound


def vec(n, dtype=np.float32):
    if np.issubdtype(dtype, np.floating):
        return RNG.normal(size=n).astype(dtype)
    if dtype == np.bool_:
        return RNG.integers(0, 2, size=n).astype(bool)
    return RNG.integers(-50, 50, size=n).astype(dtype)


def sizes_examples(make, sizes=(0, 1, 3, B)):
    return [make(n) for n in sizes]


# --- elementwise ---------------------------------------------------------------
ELEMENTWISE_FUNS = {
    "sin_exp": lambda x: jnp.sin(x) * jnp.exp(-x ** 2),
    "log_abs": lambda x: jnp.log1p(jnp.abs(x)),
    "tanh_pow": lambda x: jnp.tanh(x) ** 3 + lax.integer_pow(x, 2),
    "clamp": lambda x: lax.clamp(-0.5, x, 0.5),
    "where": lambda x: jnp.where(x > 0, x, 2 * x),
    "erf_logistic": lambda x: jax.scipy.special.erf(x) + jax.nn.sigmoid(x),
    "gelu": lambda x: jax.nn.gelu(x),
    "convert": lambda x: (x * 10).astype(jnp.int32).astype(jnp.float32),
    "stop_gradient": lambda x: x * lax.stop_gradient(x),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE_FUNS))
def test_elementwise(name):
    f = ELEMENTWISE_FUNS[name]
    check_oracle(f, sizes_examples(lambda n: (vec(n),)), [(B,)], rtol=1e-5, atol=1e-5)


def test_binary_and_comparison_ops_2d():
    f = lambda x, y: (jnp.maximum(x, y) - jnp.minimum(x, y) / (1 + y ** 2), x < y, x == y)
    exs = [(vec((n, 3)), vec((n, 3))) for n in (0, 2, 4)]
    check_oracle(f, exs, [(4, 3), (4, 3)], ("n, 3", "n, 3"))


def test_integer_and_bool_elementwise():
    f = lambda x: ((x >> 1) ^ (x & 3), jnp.logical_not(x > 0))
    check_oracle(f, sizes_examples(lambda n: (vec(n, np.int32),)), [(B,)])


# --- reductions -------------------------------------------------------------------
REDUCTIONS = {
    "sum": jnp.sum, "prod": jnp.prod, "max": lambda x: jnp.max(x, initial=-1e30),
    "min": lambda x: jnp.min(x, initial=1e30), "mean_axis": lambda x: jnp.mean(x, axis=1),
    "var": lambda x: jnp.var(x, axis=0), "logsumexp": lambda x: jax.nn.logsumexp(x, axis=1),
    "softmax": lambda x: jax.nn.softmax(x, axis=0), "norm": lambda x: jnp.linalg.norm(x + 3.0),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_float_reductions(name):
    f = REDUCTIONS[name]
    exs = [(vec((n, m)),) for n, m in [(1, 1), (3, 2), (4, 5), (2, 5)]]
    if name in ("sum", "prod", "max", "min", "mean_axis", "logsumexp"):
        exs.append((vec((0, 3)),))
    check_oracle(f, exs, [(4, 5)], rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.bool_])
def test_integer_and_bool_reductions(dtype):
    def f(x):
        outs = [jnp.max(x, axis=0), jnp.min(x, axis=0), jnp.sum(x, axis=0)]
        if dtype == np.bool_:
            outs += [jnp.all(x, axis=0), jnp.any(x, axis=0)]
        else:
            outs += [jnp.prod(x, axis=0) % 7, lax.reduce_xor(x, (0,))]
        return outs

    exs = [(vec((n, 3), dtype),) for n in (1, 2, 5)]
    check_oracle(f, exs, [(5, 3)], ("n, 3",))


def test_argmax_argmin_ties_and_inf():
    f = lambda x: (jnp.argmax(x, axis=1), jnp.argmin(x, axis=1), jnp.argmax(x, axis=0))
    x = np.array([[-np.inf, 2.0], [3.0, 3.0], [3.0, -1.0]], np.float32)
    check_oracle(f, [(x,), (x[:1],), (x[:2, :1],)], [(4, 3)], modes=("eager", "jit", "vmap"))


def test_generic_reduce_with_init():
    f = lambda x: lax.reduce(x, np.float32(1.0), lambda a, b: a * b + 0 * a, (0,))
    check_oracle(f, sizes_examples(lambda n: (vec((n, 2)),), (0, 1, 4)), [(5, 2)],
                 ("n, 2",), modes=("eager", "jit", "vmap"))


# --- dot_general --------------------------------------------------------------------
def test_matmul_all_axes_dynamic():
    f = lambda a, b: a @ b
    exs = [(vec((m, k)), vec((k, n))) for m, k, n in [(2, 3, 4), (1, 1, 1), (3, 0, 2), (4, 5, 1)]]
    check_oracle(f, exs, [(4, 5), (5, 4)], ("m, k", "k, n"), rtol=1e-5)


def test_batched_einsum_and_int_dot():
    f = lambda a, b: jnp.einsum("bij,bjk->bik", a, b)
    exs = [(vec((b, 2, k)), vec((b, k, 3))) for b, k in [(1, 3), (2, 1), (3, 4)]]
    check_oracle(f, exs, [(3, 2, 4), (3, 4, 3)], ("b, 2, k", "b, k, 3"), rtol=1e-5)
    g = lambda a, b: a @ b
    exs = [(vec((2, k), np.int32), vec((k,), np.int32)) for k in (0, 2, 5)]
    check_oracle(g, exs, [(2, 5), (5,)], ("2, k", "k"))


def test_dot_backward_with_inf_derivatives_in_padding():
    # sqrt'(0) = inf in padding must not leak into the gradient through the dot.
    f = lambda a, w: jnp.sum(jnp.sqrt(jnp.abs(a @ w)))
    exs = [(vec((n, 3)), vec((3, 2))) for n in (1, 3)]
    check_oracle(f, exs, [(5, 3), None], ("n, 3", None), rtol=1e-4, atol=1e-5)


# --- cumulative -----------------------------------------------------------------------
CUMULATIVE = {
    "cumsum": jnp.cumsum, "cumprod": jnp.cumprod,
    "cummax": lambda x: lax.cummax(x, axis=0), "cummin": lambda x: lax.cummin(x, axis=0),
    "cumlogsumexp": lambda x: lax.cumlogsumexp(x, axis=0),
    "cumsum_rev": lambda x: lax.cumsum(x, axis=0, reverse=True),
    "cumprod_rev": lambda x: lax.cumprod(x, axis=0, reverse=True),
    "cummax_rev": lambda x: lax.cummax(x, axis=0, reverse=True),
    "cumlogsumexp_rev": lambda x: lax.cumlogsumexp(x, axis=0, reverse=True),
}


@pytest.mark.parametrize("name", sorted(CUMULATIVE))
def test_cumulative(name):
    f = CUMULATIVE[name]
    check_oracle(f, sizes_examples(lambda n: (vec(n),)), [(B,)], rtol=1e-5)


def test_cumsum_int_reverse():
    f = lambda x: lax.cumsum(x, axis=0, reverse=True)
    check_oracle(f, sizes_examples(lambda n: (vec(n, np.int32),)), [(B,)])


# --- sort -------------------------------------------------------------------------------
def test_sort_multi_operand_and_argsort():
    f = lambda k, v: lax.sort((k, v), num_keys=1)
    exs = [(vec(n), vec(n, np.int32)) for n in (0, 1, 4, B)]
    check_oracle(f, exs, [(B,), (B,)], ("n", "n"), modes=("eager", "jit", "vmap"))
    check_oracle(jnp.argsort, [(vec(n),) for n in (1, 3, 5)], [(B,)],
                 modes=("eager", "jit", "vmap"))


def test_sort_2d_along_rows_grad():
    f = lambda x: jnp.sort(x, axis=1)[:, 0] * 2.0
    exs = [(vec((2, m)),) for m in (1, 3, 4)]
    check_oracle(f, exs, [(2, 4)], ("2, m",))


# --- custom derivatives -------------------------------------------------------------------
def test_custom_jvp_rule_is_kept():
    # relu's custom JVP gives 0 at x = 0 (differentiating max(x, 0) would give 0.5).
    f = lambda x: jnp.sum(jax.nn.relu(x)) + jax.nn.logsumexp(x)
    x = np.array([0.0, -1.0, 2.0, 3.0], np.float32)
    check_oracle(f, [(x,), (x[:2],), (x[:1],)], [(6,)])


def test_custom_vjp_rule_is_kept_and_masked():
    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, x.shape[0]), lambda n, g: (jnp.clip(g, -0.1, 0.1) / n,))
    f = lambda x: jnp.sum(clip_grad(x) ** 2)
    x = np.array([0.5, -1.0, 2.0, 3.0], np.float32)
    check_oracle(f, [(x,), (x[:2],), (x[:3],)], [(6,)])
    g = jax.grad(lambda d: pm.mask(f)(pm.Masked(d, (2,))).data)(jnp.asarray([0.5, -1.0, 9, 9]))
    np.testing.assert_allclose(g, [0.05, -0.05, 0, 0])


@pytest.mark.parametrize("cotangent", [lambda: 0.0, lambda: jnp.array(0.0), lambda: None],
                         ids=["python_float", "array", "none"])
def test_custom_vjp_with_a_python_float_argument_differentiates(cotangent):
    """t5x's cross_entropy_with_logits(..., z_loss=1e-4): a custom_vjp that
    takes a Python float and returns a constant cotangent for it (a literal
    of the backward's jaxpr) crashed jax.grad at every size (found from
    outside: AttributeError 'TypedFloat' object has no attribute 'shape')."""
    f = jax.custom_vjp(lambda x, c: jnp.sum(x) * c)
    f.defvjp(lambda x, c: (jnp.sum(x) * c, (x, c)),
             lambda res, g: (g * res[1] * jnp.ones_like(res[0]), cotangent()))
    m = pm.mask(lambda x: f(x, 0.5), "n")
    x = jnp.array([1.0, 2.0, 3.0, np.nan, np.nan])
    for n in (0, 1, 3):
        g = jax.grad(lambda d, n=n: m(pm.Masked(d, (n,))).data)(x)
        np.testing.assert_array_equal(g, [0.5] * n + [0.0] * (5 - n))
    g = jax.jit(jax.grad(lambda d, n: m(pm.Masked(d, (n,))).data))(x, 2)
    np.testing.assert_array_equal(g, [0.5, 0.5, 0, 0, 0])


def test_a_custom_vjp_whose_forward_checks_a_size_differentiates():
    """levanter's flash attention: the custom_vjp's forward raises unless the
    length is a multiple of its block. JAX traces the forward rule only when
    the call is differentiated, after the masked trace's cases: the check was
    answered outside its case and jax.grad raised it at every size (helper A,
    session 60). It is traced with the case now: exact where plain JAX runs,
    a ShapeError at odd sizes."""
    @jax.custom_vjp
    def blocked_double(x):
        if x.shape[0] % 2 != 0:
            raise ValueError(f"size {x.shape[0]} is not a multiple of 2")
        return 2 * x

    blocked_double.defvjp(lambda x: (blocked_double(x), x.shape[0]),
                          lambda n, g: (2 * g + n,))
    f = lambda x: jnp.sum(blocked_double(x) ** 2)  # noqa: E731
    x = np.arange(1.0, 9.0, dtype=np.float32)
    check_oracle(f, [(x[:n],) for n in (0, 2, 4, 8)], [(8,)], "n",
                 modes=("eager", "jit", "vmap", "grad"))
    with pytest.raises(pm.ShapeError, match="not a multiple of 2"):
        jax.grad(lambda d: pm.mask(f, "n")(pm.Masked(d, (3,))).data)(jnp.asarray(x))


def test_a_custom_vjp_forward_rule_failing_at_some_sizes_differentiates_at_the_others():
    """The forward rule (not the function) raises at odd sizes: the gradient
    at even sizes is plain JAX's, under jit too, and at odd sizes a
    ShapeError (it raised at every size: helper D, session 60). A function
    that is never differentiated (polymask.jit's programs) does not trace
    the rule, so its comparisons do not split the forward program."""
    @jax.custom_vjp
    def b(x):
        return 2 * x

    def b_fwd(x):
        if x.shape[0] % 2:
            raise ValueError("odd size in fwd")
        return 2 * x, None

    b.defvjp(b_fwd, lambda r, g: (2 * g,))
    f = lambda x: jnp.sum(b(x) ** 2)  # noqa: E731
    x = jnp.arange(1.0, 9.0)
    grad = jax.jit(jax.grad(lambda d, n: pm.mask(f, "n")(pm.Masked(d, (n,))).data))
    for n in (0, 2, 4, 8):
        np.testing.assert_allclose(grad(x, jnp.int32(n))[:n], jax.grad(f)(x[:n]))
    with pytest.raises(pm.ShapeError, match="odd size in fwd"), pm.shape_errors():
        jax.block_until_ready(grad(x, jnp.int32(3)))

    @jax.custom_vjp
    def a(x):
        return jnp.sin(x)

    def a_fwd(x):
        k = sum(1 for t in range(48) if x.shape[0] > t)  # a split per size
        return jnp.sin(x), k

    a.defvjp(a_fwd, lambda k, g: (g,))
    runner = pm.jit(lambda x: jnp.sum(a(x)), "n", tiered=False)
    for n in (1, 5, 12, 30):
        np.testing.assert_allclose(runner(np.ones(n, np.float32)), n * np.sin(1.0), rtol=1e-6)
    assert runner.stats()["exact_compiles"] == 0
    # mask() may be differentiated: past the case limit the rule's own splits are
    # left to the derivative, and the forward runs as before (helper D's regression)
    fwd = jax.jit(pm.mask(lambda x: jnp.sum(a(x)), "n"))
    got = fwd(pm.Masked(jnp.ones(40), (jnp.int32(5),))).data
    np.testing.assert_allclose(got, 5 * np.sin(1.0), rtol=1e-6)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_implicit_differentiation_by_custom_root_keeps_its_rule():
    """lax.custom_root (jaxopt's implicit differentiation): the solve is a
    while_loop, which reverse mode cannot differentiate; the gradient comes from
    the tangent solve at the root (issue #36: "Reverse-mode differentiation does
    not work for lax.while_loop" under mask). Masked gradients equal plain JAX's
    on the logical rows, zero in the padding, eagerly and under jit."""
    def ridge(X, y):
        def stationarity(w):
            return X.T @ (X @ w - y) + w

        def gradient_descent(f, w0):
            body = lambda c: (c[0] - 0.05 * f(c[0]), c[1] + 1)
            return lax.while_loop(lambda c: c[1] < 300, body, (w0, 0))[0]

        def tangent_solve(g, v):
            return jnp.linalg.solve(jax.jacobian(g)(v), v)

        return lax.custom_root(stationarity, jnp.zeros(X.shape[1]), gradient_descent,
                               tangent_solve)

    rng = np.random.default_rng(5)
    m = pm.mask(ridge, ("n, 3", "n"))
    for n in (0, 1, 7, 12):
        X = rng.normal(size=(n, 3)).astype(np.float32)
        y = rng.normal(size=n).astype(np.float32)
        want = jax.grad(lambda X, y: jnp.sum(ridge(X, y) ** 2), argnums=(0, 1))(X, y)
        Xp = np.full((12, 3), np.nan, np.float32)
        Xp[:n] = X
        yp = np.full(12, np.nan, np.float32)
        yp[:n] = y

        def loss(Xd, yd):
            return jnp.sum(m(pm.Masked(Xd, (n, 3)), pm.Masked(yd, (n,))).data ** 2)

        for grad in (jax.grad(loss, argnums=(0, 1)), jax.jit(jax.grad(loss, argnums=(0, 1)))):
            gX, gy = grad(jnp.asarray(Xp), jnp.asarray(yp))
            np.testing.assert_allclose(gX[:n], want[0], rtol=2e-4, atol=2e-5)
            np.testing.assert_allclose(gy[:n], want[1], rtol=2e-4, atol=2e-5)
            np.testing.assert_array_equal(gX[n:], 0.0)
            np.testing.assert_array_equal(gy[n:], 0.0)


def test_nested_jit_and_remat():
    inner = jax.jit(lambda x: jnp.cumsum(x) / x.shape[0])
    f = lambda x: jax.checkpoint(lambda y: jnp.sum(jnp.sin(inner(y))))(x)
    check_oracle(f, sizes_examples(lambda n: (vec(n),)), [(B,)])


# --- property test: random sizes including 0, 1 and the bound --------------------------------
@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
@given(n=st.integers(0, 7), m=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_property_mean_center_matmul(n, m, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, m)).astype(np.float32)
    w = rng.normal(size=(m, 2)).astype(np.float32)
    f = lambda x, w: jnp.tanh((x - jnp.mean(x, axis=0, keepdims=True)) @ w).sum(axis=0)
    check_oracle(f, [(x, w)], [(7, 5), (5, 2)], ("n, m", "m, 2"),
                 modes=("eager", "grad"), rtol=1e-4, atol=1e-5)


def test_top_k_padding_never_wins_ties():
    f = lambda x: lax.top_k(x, 2)
    x = np.array([-np.inf, 3.0, 3.0, -np.inf, 1.0], np.float32)
    exs = [(x,), (x[:2],), (x[:3],), (np.array([-np.inf, -np.inf], np.float32),)]
    check_oracle(f, exs, [(6,)], "n", constraints=["n >= 2"])
    g = lambda x: lax.top_k(x, 2)
    exs = [(vec((m, 4)),) for m in (1, 3)] + [(vec((2, 2)),)]
    check_oracle(g, exs, [(3, 5)], ("m, n",), constraints=["n >= 2"])


def test_top_k_with_k_from_the_size():
    # k = n - 1 (a dimension expression): padded size its bound, logical size
    # n - 1; plain JAX gives an empty result at n = 1 (k = 0).
    f = lambda x: lax.top_k(x, x.shape[-1] - 1)
    x = np.array([2.0, -1.0, 2.0, np.inf, 0.5, -np.inf, 2.0, 7.0], np.float32)
    exs = [(x[:n],) for n in (1, 2, 3, 5, 8)]
    check_oracle(f, exs, [(8,)], "b")
    # Rows of a 2-D operand, with k of the other axis's size (n >= m).
    g = lambda x, y: lax.top_k(x, y.shape[0])
    exs = [(vec((2, n)), vec(m)) for n, m in ((4, 0), (4, 4), (1, 1), (5, 3))]
    check_oracle(g, exs, [(3, 5), (5,)], ("r, n", "m"), constraints=["n >= m"])


def test_top_k_with_k_from_the_size_repro():
    f = lambda x: lax.top_k(x, x.shape[-1] - 1)
    x = np.full(32, np.nan, np.float32)
    x[:16] = RNG.random(16)
    for fn in (pm.mask(f, "b, ..."), jax.jit(pm.mask(f, "b, ..."))):
        vals, idx = fn(pm.Masked(jnp.asarray(x), (np.int32(16),)))
        assert vals.data.shape == (31,) and idx.data.shape == (31,)
        want_v, want_i = lax.top_k(jnp.asarray(x[:16]), 15)
        np.testing.assert_array_equal(vals.unpad(), want_v)
        np.testing.assert_array_equal(idx.unpad(), want_i)


def test_top_k_with_negative_k_raises():
    # n = 0 gives k = -1: plain JAX raises, so must the masked function.
    f = lambda x: lax.top_k(x, x.shape[-1] - 1)
    with pytest.raises(ValueError):
        f(jnp.zeros((0,), jnp.float32))
    m = pm.mask(f, "b")
    arg = pm.Masked(jnp.full((8,), np.nan, jnp.float32), (np.int32(0),))
    # a case split: b = 0 is a case of its own, where the plain function fails
    with pytest.raises(pm.ShapeError, match="(?s)b in {0}.*k argument to top_k must be nonneg"):
        m(arg)
    with pytest.raises(Exception, match="(?s)ShapeError: for these sizes .b in {0}"):
        jax.block_until_ready(jax.jit(m)(arg))
    # Under vmap the error names the offending batch element.
    data = jnp.full((2, 8), np.nan, jnp.float32)
    with pytest.raises(Exception, match="(?s)must be nonnegative.*batch element 1"):
        jax.block_until_ready(jax.jit(jax.vmap(m))(
            pm.Masked(data, (jnp.array([3, 0], jnp.int32),))))


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int8])
@pytest.mark.parametrize("op", ["and", "or", "xor"])
def test_integer_bitwise_reductions_fill_with_their_identity(dtype, op):
    """The padding of an integer AND was filled with 1, clearing every bit but
    bit 0 whenever the logical size was below the bound (helper B)."""
    fun = {"and": jnp.bitwise_and.reduce, "or": jnp.bitwise_or.reduce,
           "xor": jnp.bitwise_xor.reduce}[op]
    rng = np.random.default_rng(0)
    exs = [(rng.integers(0, 127, size=n).astype(dtype) | dtype(0b1110000),) for n in (0, 1, 3, 8)]
    check_oracle(fun, exs, [(8,)], "n", modes=("eager", "jit", "vmap"))


@pytest.mark.parametrize("op", ["and", "or"])
def test_packed_bitwise_reductions_of_integers_are_refused_and_of_bools_run(op):
    """The packed layout reduced an integer OR / AND over the packed axis as a
    segment max / min: a bool's or / and, not an integer's bitwise one."""
    fun = {"and": jnp.bitwise_and.reduce, "or": jnp.bitwise_or.reduce}[op]
    xs = [np.array([0b1010, 0b0101, 0b0011], np.int32), np.array([12, 3], np.int32)]
    with pytest.raises(pm.PackedUnsupported, match=f"bitwise {op} of int32"):
        pm.ragged_map(fun, "n", layout="packed")(xs)
    for got, x in zip(pm.ragged_map(fun, "n", layout="auto")(xs), xs):
        assert int(got) == int(fun(x))
    bools = [x % 2 == 1 for x in xs]
    for got, x in zip(pm.ragged_map(fun, "n", layout="packed")(bools), bools):
        assert bool(got) == bool(fun(x))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz"])
@pytest.mark.parametrize("op", ["max", "min", "argmax", "cummin_reverse"])
def test_max_and_min_of_float_types_without_an_infinity(dtype, op):
    """The padding of a max was filled with -inf, which is NaN in float8
    types without an infinity: the max was NaN, argmax the padding's index
    (helper B). Their finite extremes fill it now."""
    fun = {"max": jnp.max, "min": jnp.min, "argmax": jnp.argmax,
           "cummin_reverse": lambda x: lax.cummin(x, reverse=True)}[op]
    dt = jnp.dtype(dtype)
    masked = pm.mask(fun, "n")
    for vals in ([0.5, -1.0, 2.0], [-3.0], [1.0, 1.0, -0.5, 4.0, -2.0]):
        x = jnp.asarray(vals, dt)
        padded = jnp.zeros(8, dt).at[:len(vals)].set(x)
        want = np.asarray(jax.jit(fun)(x)).astype(np.float32)
        for size in (len(vals), jnp.int32(len(vals))):
            got = jax.jit(masked)(pm.Masked(padded, (size,))) if not isinstance(size, int) \
                else masked(pm.Masked(padded, (size,)))
            np.testing.assert_array_equal(np.asarray(got.unpad()).astype(np.float32), want)


@pytest.mark.parametrize("fun", [lambda x: jnp.sum(x.astype(jnp.float32)),
                                 lambda x: jnp.cumsum(x.astype(jnp.float32)),
                                 lambda x: x.astype(jnp.float32) @ jnp.ones(x.shape[0])])
def test_reductions_of_a_type_without_zero(fun):
    """float8_e8m0fnu has no zero (0 stored there is NaN): the entry select
    "zeroed" its padding to NaN and marked it zero, so the sum of its float32
    conversion skipped the float32 fill and was NaN at every size below the
    bound (helper B, session 59)."""
    dt = jnp.float8_e8m0fnu
    exs = [(np.asarray([1., 2., 4., 0.5, 8., 0.25, 16.][:n], dt),) for n in (0, 1, 3, 7)]
    check_oracle(fun, exs, [(8,)], "n", modes=("eager", "jit", "vmap"))
