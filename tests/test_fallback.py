"""Never worse than jax.jit (#36): where a bucket's masked trace fails, the
runners run its sizes per exact shape under plain ``jax.jit`` with plain JAX's
values, warn once, count the compiles and say why; where plain ``jax.jit``
fails too they raise ``ShapeError`` with its reason.

Each function here is the minimal form of a real program an outside tester
found refused where ``jax.jit`` ran it (issue #36): a size as a Python value
past the per-size limit (``np.tril(np.ones((n, n)))``, ``range(n)``), a
primitive without a masking rule, a library's own ``assert`` on a size.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import mlir

import polymask as pm
from polymask._jax_compat import testing as jax_private

SIZES = (3, 40, 41, 70, 40, 0, 1)


def tril_cumsum(x):
    """np.tril(np.ones((n, n))) @ x: NumPy needs n as a Python int."""
    n = x.shape[0]
    return jnp.asarray(np.tril(np.ones((n, n), np.float32))) @ x


def python_range_sum(x):
    """sum over range(n): a Python loop over the size (a trace per size)."""
    return sum(x[i] * i for i in range(x.shape[0])) + jnp.zeros((), x.dtype)


def library_assert(x):
    """A library's own check on a size (numpyro's GaussianRandomWalk: num_steps > 0)."""
    num_steps = x.shape[0]
    assert num_steps > 0, "num_steps must be positive"
    return jnp.cumsum(x) / num_steps


# a primitive polymask has no masking rule for, which jax.jit compiles (its
# eager implementation is XLA's, as for JAX's own primitives: nothing to inline)
no_rule_p = jax.extend.core.Primitive("polymask_test_fallback_no_rule")
no_rule_p.def_impl(jax_private.xla_impl(no_rule_p))
no_rule_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(no_rule_p, mlir.lower_fun(lambda x: x * 2.0, multiple_results=False))


def no_rule(x):
    return jnp.sum(no_rule_p.bind(x))


def _vec(n, seed=0):
    return np.random.default_rng(seed + n).normal(size=n).astype(np.float32)


def _calls(f, sizes=SIZES):
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        outs = [f(_vec(n)) for n in sizes]
    return outs, [w for w in ws if issubclass(w.category, pm.FallbackWarning)]


@pytest.mark.parametrize("fun", [tril_cumsum, python_range_sum, no_rule])
def test_polymask_jit_runs_what_jax_jit_runs_with_its_values(fun):
    f = pm.jit(fun, "n")
    outs, ws = _calls(f)
    for n, out in zip(SIZES, outs):
        np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(fun)(_vec(n))),
                                   rtol=1e-5, atol=1e-5)
    assert len(ws) == 1, [str(w.message) for w in ws]  # once per function
    assert "as jax.jit does" in str(ws[0].message) and __file__ in ws[0].filename
    st = f.stats()
    distinct = len(set(SIZES))
    # never more compiles than jax.jit (one per distinct shape), fewer where sizes share
    assert st["compiles"] + st["exact_compiles"] <= distinct
    assert st["exact_calls"] >= 1 and st["calls"] == len(SIZES)
    assert f.fallbacks() and all(isinstance(r, str) and r for r in f.fallbacks().values())


def test_the_reason_names_the_users_line_and_the_rewrite():
    f = pm.jit(tril_cumsum, "n")
    with pytest.warns(pm.FallbackWarning) as ws:
        f(_vec(40))
    msg = str(ws[0].message)
    assert "test_fallback.py" in msg and "(tril_cumsum)" in msg  # the line inside the function
    assert "jnp.arange(n)" in msg  # the jnp form that takes symbolic sizes
    assert "numeric.py" not in msg  # NumPy's own frame is not the user's line
    (reason,) = f.fallbacks().values()
    assert "Python int" in reason


def test_without_specs_the_warning_says_how_to_keep_parameters_static():
    # a model's parameters passed as an argument get dim vars too without specs
    with pytest.warns(pm.FallbackWarning) as ws:
        pm.jit(tril_cumsum)(_vec(40))
    assert "in_specs with None for the arguments whose shapes never change" in str(
        ws[0].message)
    with pytest.warns(pm.FallbackWarning) as ws:
        pm.jit(tril_cumsum, "n")(_vec(40))
    assert "shapes never change" not in str(ws[0].message)


def test_with_warnings_as_errors_every_call_that_falls_back_raises():
    """The runner marks the warning given only once it went out: where the
    user's filter turns it into an error, later calls raise it too instead of
    returning silently."""
    f = pm.jit(tril_cumsum, "n", tiered=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with pytest.raises(pm.FallbackWarning, match="do not share one compiled program: each exact shape"):
                f(_vec(40))
    with pytest.warns(pm.FallbackWarning):  # and once more, as a warning, with the value
        np.testing.assert_allclose(f(_vec(40)), tril_cumsum(_vec(40)), rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # given once: the next call is silent
        np.testing.assert_allclose(f(_vec(41)), tril_cumsum(_vec(41)), rtol=1e-5)


def test_explain_of_a_runner_says_which_sizes_run_per_shape_and_why():
    """pm.explain(runner): its own specs; at sizes whose masked trace fails it
    says they run per exact shape and why (the user's line, the jnp form),
    instead of raising as for mask; at sizes that share, the masked trace plus
    the buckets that ran per shape so far."""
    # (buckets of at most 4 sizes keep per-size cases in one program: PER_SIZE_SHARED_MAX)
    f = pm.jit(tril_cumsum, "n", tiered=False, buckets=pm.buckets.explicit([3, 64]))
    with pytest.warns(pm.FallbackWarning):
        f(_vec(40))
    text = pm.explain(f, None, (64,), print_output=False)
    assert text.startswith("tril_cumsum: no shared program for these sizes")
    assert "test_fallback.py" in text and "(tril_cumsum)" in text and "jnp.arange(n)" in text
    shared = pm.explain(f, None, (3,), print_output=False)
    assert "dot_general" in shared and "n <= 64: " in shared.split("per exact shape")[-1]
    with pytest.raises(pm.ShapeError, match="Python int"):  # mask's contract: one program
        pm.explain(tril_cumsum, "n", (64,), print_output=False)


def test_sizes_that_share_still_share():
    """A bucket of at most 4 sizes traces them in one program; a larger one,
    whose every size is a case of its own, runs per exact shape, as does the
    bucket past the per-size limit; each shape compiles once."""
    f = pm.jit(python_range_sum, "n", buckets=pm.buckets.explicit([3, 8, 64]))
    with pytest.warns(pm.FallbackWarning):
        for n in (2, 3, 2, 5, 7, 40, 41, 40, 41):
            np.testing.assert_allclose(f(_vec(n)), python_range_sum(_vec(n)), rtol=1e-5)
    st = f.stats()
    assert st["compiles"] == 1  # bucket 3: sizes 2 and 3 in one program
    assert st["exact_compiles"] == 4 and st["exact_calls"] == 6
    assert list(f.fallbacks()) == ["n <= 8", "n <= 64"]


def test_where_plain_jax_fails_too_it_is_a_shape_error_with_plain_jaxs_reason():
    f = pm.jit(library_assert, "n")
    np.testing.assert_allclose(f(_vec(3)), library_assert(_vec(3)), rtol=1e-6)
    with pytest.raises(pm.ShapeError, match="num_steps must be positive"):
        f(_vec(0))
    big = pm.jit(library_assert, "n", buckets=pm.buckets.exact())
    with pytest.raises(pm.ShapeError, match="num_steps must be positive"):
        big(np.zeros(0, np.float32))


def test_fallback_false_keeps_the_refusal():
    with pytest.raises(pm.UnsupportedError, match="polymask_test_fallback_no_rule"):
        pm.jit(no_rule, "n", fallback=False)(_vec(3))
    with pytest.raises(pm.UnsupportedError, match="polymask_test_fallback_no_rule"):
        pm.ragged_map(no_rule, "n", fallback=False)([_vec(3)])


def test_numpy_outputs_and_pytrees_in_the_fallback():
    def f(x, y):
        return {"a": tril_cumsum(x), "b": y * len(x)}

    g = pm.jit(f, ("n", "m"), numpy_outputs=True)
    with pytest.warns(pm.FallbackWarning):
        out = g(_vec(40), _vec(2))
    assert isinstance(out["a"], np.ndarray)
    np.testing.assert_allclose(out["a"], tril_cumsum(_vec(40)), rtol=1e-5)
    np.testing.assert_allclose(out["b"], _vec(2) * 40)


def test_tiered_runner_falls_back_too():
    f = pm.jit(no_rule, "n", tiered=True)
    with pytest.warns(pm.FallbackWarning):
        for n in (3, 9, 3):
            np.testing.assert_allclose(f(_vec(n)), 2 * _vec(n).sum(), rtol=1e-5)
    f.wait()
    assert f.stats()["exact_compiles"] == 2


@pytest.mark.parametrize("layout", ["auto", "padded"])
def test_ragged_map_runs_each_example_as_jax_jit(layout):
    exs = [_vec(n) for n in SIZES]
    rm = pm.ragged_map(tril_cumsum, "n", layout=layout)
    with pytest.warns(pm.FallbackWarning, match="ragged_map"):
        outs = rm(exs)
    for x, out in zip(exs, outs):
        np.testing.assert_allclose(out, tril_cumsum(x), rtol=1e-5, atol=1e-5)
    st = rm.stats()
    # sizes 0, 1 and 3 share bucket 8's program; 40, 41 and 70 run per shape
    assert st["exact_compiles"] == 3 and st["exact_calls"] == 4, (st, rm.fallbacks().keys())
    assert st["compiles"] - st.get("packed", {}).get("compiles", 0) == 1
    rm(exs)  # again: nothing new to compile
    assert rm.stats()["exact_compiles"] == 3


def test_ragged_map_plain_failure_names_the_example():
    rm = pm.ragged_map(library_assert, "n", buckets=pm.buckets.exact(), layout="padded")
    with pytest.raises(pm.ShapeError, match=r"(?s)examples\[1\].*num_steps must be positive"):
        rm([_vec(2), np.zeros(0, np.float32)])


def test_value_and_grad_falls_back_per_example_with_exact_gradients():
    def loss(w, x):
        return jnp.sqrt(jnp.sum(tril_cumsum(x * w) ** 2) + 1.0)

    w = np.float32(0.7)
    xs = [_vec(n) for n in (3, 40, 70)]
    vg = pm.value_and_grad(loss, ("n",))
    with pytest.warns(pm.FallbackWarning, match="value_and_grad"):
        val, grad = vg(w, xs)
    ref_val, ref_grad = jax.value_and_grad(
        lambda w: jnp.mean(jnp.stack([loss(w, x) for x in xs])))(w)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4)
    assert vg.exact_compiles == 3 and vg.fallbacks()
    vg(w, xs)
    assert vg.exact_compiles == 3


def test_a_single_size_case_left_by_a_constraint_is_traced_at_that_size():
    """jax.scipy.signal.convolve(mode='full') swaps its operands when the signal
    is shorter than the kernel; with constraints=['t >= 3'] the case t <= 3 is
    t = 3 alone, traced at 3 as plain JAX does (was refused as 'plain JAX fails',
    which it does not)."""
    from jax.scipy import signal

    k = jnp.array([0.25, 0.5, 0.25])
    x = jnp.arange(16.0)
    for mode in ("full", "same", "valid"):
        f = pm.mask(lambda x, k, mode=mode: signal.convolve(x, k, mode=mode), ("t", None),
                    constraints=("t >= 3",))
        for t in (3, 4, 16):
            np.testing.assert_allclose(f(pm.Masked(x, (t,)), k).unpad(),
                                       signal.convolve(x[:t], k, mode=mode), rtol=1e-6)
            np.testing.assert_allclose(jax.jit(f)(pm.Masked(x, (t,)), k).unpad(),
                                       signal.convolve(x[:t], k, mode=mode), rtol=1e-6)


def test_an_error_case_is_checked_against_plain_jax(monkeypatch):
    """Where the masked trace says "the function fails at these sizes" but plain
    jax.jit runs them, polymask.jit and ragged_map return plain JAX's values
    (warned as a polymask bug), never a refusal."""
    from polymask.runners import polyjit, ragged

    def always_error(entry, names, values, prefix=""):
        raise pm.ShapeError(prefix + "for these sizes the function fails (a wrong error case)")

    monkeypatch.setattr(polyjit, "raise_case_error", always_error)
    monkeypatch.setattr(ragged, "raise_case_error", always_error)
    with pytest.warns(pm.FallbackWarning, match="a wrong error case"):
        np.testing.assert_allclose(pm.jit(jnp.cumsum, "n")(_vec(5)), np.cumsum(_vec(5)),
                                   rtol=1e-6)
    with pytest.warns(pm.FallbackWarning, match="a wrong error case"):
        outs = pm.ragged_map(jnp.cumsum, "n", layout="padded")([_vec(5), _vec(2)])
    np.testing.assert_allclose(outs[1], np.cumsum(_vec(2)), rtol=1e-6)
    # where plain JAX fails too, the trace's own message stays
    with pytest.raises(pm.ShapeError, match="a wrong error case"):
        pm.jit(lambda x: jax.lax.top_k(x, 3)[0], "n")(_vec(2))


# a library primitive whose implementation is Python (equinox's filter_primitive
# pattern): the impl stops gradients that a JVP rule of its own would supply
py_impl_p = jax.extend.core.Primitive("polymask_test_python_impl")
py_impl_p.def_impl(lambda x: jnp.cumsum(jax.lax.stop_gradient(x)) * 2.0)
py_impl_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
jax.interpreters.ad.defjvp(py_impl_p, lambda t, x: jnp.cumsum(t) * 2.0)
mlir.register_lowering(py_impl_p, mlir.lower_fun(lambda x: jnp.cumsum(x) * 2.0,
                                                 multiple_results=False))


def python_impl(x):
    return py_impl_p.bind(x)


def test_a_primitive_with_a_python_implementation_is_masked_through_it():
    """Values through the implementation in eager and jit; a derivative is the
    primitive's own JVP rule, masked (the implementation's own would be
    wrong: it stops gradients), with zeros in the padding; the runners'
    value_and_grad agrees."""
    m = pm.mask(python_impl, "n")
    for n in (0, 3, 8):
        x = np.full(8, np.nan, np.float32)
        x[:n] = _vec(n)
        want = 2.0 * np.cumsum(_vec(n))
        np.testing.assert_allclose(m(pm.Masked(jnp.asarray(x), (n,))).unpad(), want, rtol=1e-5)
        np.testing.assert_allclose(jax.jit(m)(pm.Masked(jnp.asarray(x), (n,))).unpad(), want,
                                   rtol=1e-5)
    for n in (0, 1, 3, 8):
        x = np.full(8, np.nan, np.float32)
        x[:n] = _vec(n)
        loss = lambda d, n=n: jnp.sum(m(pm.Masked(d, (n,))).data[:n] * jnp.arange(1., n + 1))
        want = jax.grad(lambda d: jnp.sum(python_impl(d) * jnp.arange(1., n + 1)))(_vec(n))
        for grad_fn in (jax.grad(loss), jax.jit(jax.grad(loss))):
            got = np.asarray(grad_fn(jnp.asarray(x)))
            np.testing.assert_allclose(got[:n], want, rtol=1e-5)
            np.testing.assert_array_equal(got[n:], 0.0)
    vg = pm.value_and_grad(lambda w, x: jnp.sum(python_impl(x * w)), "n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)  # one program, no fallback
        val, grad = vg(np.float32(1.5), [_vec(3), _vec(5)])
    ref = jax.value_and_grad(lambda w: jnp.mean(jnp.stack(
        [jnp.sum(python_impl(_vec(n) * w)) for n in (3, 5)])))(np.float32(1.5))
    np.testing.assert_allclose(val, ref[0], rtol=1e-5)
    np.testing.assert_allclose(grad, ref[1], rtol=1e-5)


# its implementation checks its result on the host, as lineax's solves do (equinox's
# error_if: unvmap_any of the predicate, then a pure_callback without vmap_method)
checked_impl_p = jax.extend.core.Primitive("polymask_test_checked_python_impl")


def _checked_impl(x):
    import equinox as eqx
    y = jnp.cumsum(x) * 2.0
    return eqx.error_if(y, ~jnp.isfinite(y), "non-finite output")


checked_impl_p.def_impl(_checked_impl)
checked_impl_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(checked_impl_p, mlir.lower_fun(_checked_impl, multiple_results=False))


def _refuse_batching(args, dims):  # like lineax: its batching rule is not what vmap needs here
    raise RuntimeError("batched with respect to a closed-over value")


jax.interpreters.batching.primitive_batchers[checked_impl_p] = _refuse_batching


def test_a_python_implementation_under_vmap_runs_per_example_with_its_checks():
    """jax.vmap of mask over ragged sizes: the implementation runs one example
    at a time (it may hold callbacks only its own batching rule could batch),
    its error_if sees each example's logical data only (unvmap_any reduces per
    example, then over the batch); a non-finite logical value still raises."""
    pytest.importorskip("equinox")

    def f(x):
        z = checked_impl_p.bind(x)
        return z[1:] - z[:-1]  # a case split at n = 0 (x[1:] of an empty x)

    m = pm.mask(f, "n")
    ns = np.array([0, 1, 3, 8])
    xs = np.full((4, 8), np.nan, np.float32)
    for i, n in enumerate(ns):
        xs[i, :n] = _vec(int(n))
    out = jax.vmap(lambda x, n: m(pm.Masked(x, (n,))).data)(jnp.asarray(xs), jnp.asarray(ns))
    for i, n in enumerate(ns):
        want = np.diff(2.0 * np.cumsum(_vec(int(n))))
        np.testing.assert_allclose(out[i, :max(int(n) - 1, 0)], want, rtol=1e-5, atol=1e-6)
    xs[2, 1] = np.inf  # a logical value: the library's own check fires, as in plain JAX
    with pytest.raises(Exception, match="non-finite output"):
        jax.block_until_ready(jax.vmap(lambda x, n: m(pm.Masked(x, (n,))).data)(
            jnp.asarray(xs), jnp.asarray(ns)))


def test_a_python_implementation_at_its_exact_shapes_runs_only_where_its_case_is_taken():
    """Under jax.vmap every case of a case split runs for every example: the
    case n == 2 binds the primitive at its exact shape (nothing to mask) and
    would see a 2-element corner of the other examples' NaN padding, on which
    its own error_if raised (lineax's LU solve with n = 0 in the batch did)
    and its batching rule refuses. It now runs per example behind the case's
    guard: plain JAX's values for every size, and its check still fires on a
    logical non-finite value. Without vmap (one case runs) and under grad
    (its own derivative) it is bound unchanged."""
    pytest.importorskip("equinox")

    def f(x):
        if x.shape[0] == 2:  # polymask splits the trace on the comparison
            return checked_impl_p.bind(x)
        return x * 3.0

    def plain(n):
        x = _vec(n)
        return 2.0 * np.cumsum(x) if n == 2 else 3.0 * x

    m = pm.mask(f, "n")
    ns = np.array([0, 1, 2, 5, 8])
    xs = np.full((len(ns), 8), np.nan, np.float32)
    for i, n in enumerate(ns):
        xs[i, :n] = _vec(int(n))
    batched = jax.jit(jax.vmap(lambda x, n: m(pm.Masked(x, (n,))).data))
    out = batched(jnp.asarray(xs), jnp.asarray(ns))
    for i, n in enumerate(ns):
        np.testing.assert_allclose(out[i, :n], plain(int(n)), rtol=1e-5)
        got = jax.jit(m)(pm.Masked(jnp.asarray(xs[i]), (jnp.int32(n),)))
        np.testing.assert_allclose(got.unpad(), plain(int(n)), rtol=1e-5)
    xs[2, 1] = np.inf  # a logical value of the n == 2 example: its check fires
    with pytest.raises(Exception, match="non-finite output"):
        jax.block_until_ready(batched(jnp.asarray(xs), jnp.asarray(ns)))

    def g(x):  # its own derivative at the exact shape, through the case's guard
        return jnp.sum(python_impl(x) ** 2) if x.shape[0] == 2 else jnp.sum(x)

    x2 = jnp.asarray(np.concatenate([_vec(2), np.zeros(6, np.float32)]))
    grad = jax.grad(lambda d: pm.mask(g, "n")(pm.Masked(d, (jnp.int32(2),))).data)(x2)
    want = jax.grad(g)(jnp.asarray(_vec(2)))
    np.testing.assert_allclose(grad[:2], want, rtol=1e-5)
    np.testing.assert_array_equal(grad[2:], 0.0)


def _lu_solve(A, b):
    import lineax as lx
    return lx.linear_solve(lx.MatrixLinearOperator(A), b, solver=lx.LU()).value


def _system(n, seed=0):
    rng = np.random.default_rng(seed)
    return ((rng.normal(size=(n, n)) + 3 * np.eye(n)).astype(np.float32),
            rng.normal(size=n).astype(np.float32))


def test_lineax_at_every_size_up_to_the_bound_eagerly():
    """Every size at its bound with static sizes (plain arrays, ``pm.pad`` to
    the exact shape): lineax's params hold the traced operator's symbolic
    structure, so binding it unchanged raised "pytree does not match
    out_structure"; its implementation runs instead."""
    pytest.importorskip("lineax")
    m = pm.mask(_lu_solve, ("n, n", "n"))
    for n, bound in ((3, 3), (8, 8), (3, 8)):
        A, b = _system(n)
        want = _lu_solve(jnp.asarray(A), jnp.asarray(b))
        got = m(pm.pad(A, (bound, bound)), pm.pad(b, (bound,)))
        np.testing.assert_allclose(got.unpad(), want, rtol=1e-4, atol=1e-5)
    A, b = _system(4)
    np.testing.assert_allclose(m(A, b).unpad(), _lu_solve(jnp.asarray(A), jnp.asarray(b)),
                               rtol=1e-4, atol=1e-5)


def test_lineax_in_a_case_of_its_own_differentiates_under_jit():
    """lineax bound at the exact shapes of the n == 2 case: its own JVP rule,
    which asserts that its state, options and solver operands have symbolic
    zero tangents (they were materialised zeros: AssertionError under jit)."""
    pytest.importorskip("lineax")

    def g(A, b):
        if A.shape[0] == 2:
            return jnp.sum(_lu_solve(A, b) ** 2)
        return jnp.sum(b ** 2) + jnp.sum(A)

    m = pm.mask(g, ("n, n", "n"))
    for n in (0, 2, 3):
        A, b = _system(n, seed=n)
        Ap = np.zeros((8, 8), np.float32)
        Ap[:n, :n] = A
        bp = np.zeros(8, np.float32)
        bp[:n] = b
        size = jnp.int32(n)
        loss = lambda A, b: m(pm.Masked(A, (size, size)), pm.Masked(b, (size,))).data
        got = jax.jit(jax.grad(loss, (0, 1)))(Ap, bp)
        want = jax.grad(g, (0, 1))(jnp.asarray(A), jnp.asarray(b))
        np.testing.assert_allclose(got[0][:n, :n], want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got[1][:n], want[1], rtol=1e-4, atol=1e-5)


def test_a_python_implementation_applied_to_tangents_is_refused_under_grad():
    """optimistix's implicit function theorem solves with lineax on the
    tangents inside its JVP rule: reverse mode transposes them with the
    primitive's own transpose rule, and this one has none, so jax.grad raises
    UnsupportedError naming it (was: JAX's bare AssertionError) while jax.jvp,
    which transposes nothing, gives the values."""
    @jax.custom_jvp
    def solve_like(x):
        return python_impl(x)

    @solve_like.defjvp
    def _jvp(primals, tangents):
        return solve_like(primals[0]), python_impl(tangents[0])

    m = pm.mask(lambda x: jnp.sum(solve_like(x)), "n")
    x = jnp.asarray(np.concatenate([_vec(3), np.full(5, np.nan, np.float32)]))
    with pytest.raises(pm.UnsupportedError, match="'polymask_test_python_impl'"):
        jax.grad(lambda d: m(pm.Masked(d, (3,))).data)(x)
    t = jnp.asarray(np.concatenate([np.ones(3, np.float32), np.zeros(5, np.float32)]))
    _, tan = jax.jvp(lambda d: m(pm.Masked(d, (3,))).data, (x,), (t,))
    np.testing.assert_allclose(tan, np.sum(2.0 * np.cumsum(np.ones(3))), rtol=1e-6)


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_value_and_grad_never_adds_zero_for_a_case_polymask_could_not_trace():
    """np.arange(n) past the per-size limit is an error case of the padded
    program (polymask's limit, not plain JAX's): its examples run per shape
    with plain JAX's loss and gradients (they added 0 silently before)."""
    def loss(w, x):
        pos = jnp.asarray(np.arange(x.shape[0], dtype=np.float32))
        return (x * w - pos) ** 2

    w = np.float32(0.5)
    for sizes in ([33], [40], [3, 100]):
        xs = [np.ones(n, np.float32) for n in sizes]
        ref = jax.value_and_grad(lambda w: sum(jnp.sum(loss(w, x)) for x in xs) / sum(sizes))(w)
        vg = pm.value_and_grad(loss, "n")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pm.FallbackWarning)
            got = vg(w, xs)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
        np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    with pytest.raises(pm.ShapeError, match="symbolic sizes"):
        pm.value_and_grad(loss, "n", fallback=False)(w, [np.ones(40, np.float32)])
    # a stacked batch has no exact examples to run: the error, never a silent 0
    stacked = pm.stack([np.ones(3, np.float32), np.ones(40, np.float32)])
    with pytest.raises(pm.ShapeError, match=r"examples\[\d\]: .*symbolic sizes"):
        pm.value_and_grad(loss, "n")(w, stacked)


def test_a_call_that_fails_as_in_plain_jax_is_not_warned_as_a_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        with pytest.raises(pm.ShapeError, match="as plain jax.jit does") as info:
            pm.jit(lambda x, y: x + y, tiered=False)(np.ones(3), np.ones(4))
    # the masked trace's remedies stay; the per-size limit's (max_cases) does not:
    # no max_cases runs what plain JAX cannot
    assert "s0 = args[0].shape[0]" in str(info.value)
    assert "max_cases" not in str(info.value)


def test_tiered_error_case_of_a_covering_bucket_does_not_stick():
    """The covering bucket (128) cannot trace TABLE[:n] at even n; the call runs
    per shape, and once the own bucket (8, traced per size) is compiled that
    size runs there."""
    table = np.arange(2000, dtype=np.int32) * 3

    def g(x):
        n = x.shape[0]
        if n % 2 == 0:
            return jnp.asarray(table[:n]) + x
        return x

    f = pm.jit(g, "n", tiered=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pm.FallbackWarning)
        for n in (3, 8):
            np.testing.assert_array_equal(f(np.arange(n, dtype=np.int32)), g(np.arange(n)))
        f.wait()
        before = f.stats()["exact_calls"]
        for n in (8, 6, 4):
            np.testing.assert_array_equal(f(np.arange(n, dtype=np.int32)), g(np.arange(n)))
    assert f.stats()["exact_calls"] == before  # all in bucket 8 now


def test_tiered_first_pass_never_compiles_more_than_jax_jit():
    """The tiered runner's first call compiles a covering bucket (128) that cannot
    trace np.arange(n) past the per-size limit; sizes whose own bucket can (8,
    32) compile it instead of running per exact shape, so every XLA compile,
    background ones included, is at most jax.jit's one per shape (was 11 for 8
    shapes; newcomer pass)."""
    def pos_weighted(x):
        n = x.shape[0]
        w = np.arange(n, dtype=np.float32) / max(n, 1)
        return jnp.sum(x * w), x * jnp.asarray(w)

    sizes = (0, 1, 5, 17, 40, 100, 33, 70)
    f = pm.jit(pos_weighted, "n", tiered=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pm.FallbackWarning)
        for n in sizes:
            got, want = f(_vec(n)), jax.jit(pos_weighted)(_vec(n))
            np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    f.wait()
    st = f.stats()
    assert st["xla_compiles"] <= len(sizes), st
    assert st["compiles"] + st["exact_compiles"] <= len(sizes), st


@pytest.mark.parametrize("tiered", [False, True])
def test_a_check_failing_on_the_data_never_sends_its_bucket_per_shape(tiered):
    """An equinox error_if that fails on the data (a host callback raising while
    the bucket program runs) is plain jax.jit's JaxRuntimeError, raised as is,
    on the first call of a shape and on later ones. It was read as a failure to
    trace when jaxlib reported it as a ValueError: the bucket then ran every
    later call per exact shape (fallbacks() listed it)."""
    eqx = pytest.importorskip("equinox")

    def f(x):
        x = eqx.error_if(x, ~jnp.isfinite(x), "non-finite logical value")
        return jnp.cumsum(x)

    bad = np.array([1.0, np.nan], np.float32)
    for first in (bad, np.ones(2, np.float32)):
        pj = pm.jit(f, "n", tiered=tiered)
        if first is not bad:
            pj(first)
        for _ in range(2):
            with pytest.raises(jax.errors.JaxRuntimeError, match="non-finite logical value"):
                jax.block_until_ready(pj(bad))
        assert pj.fallbacks() == {}
        for n in (1, 2, 3):
            np.testing.assert_allclose(pj(_vec(n)), np.cumsum(_vec(n)), rtol=1e-6)
        assert pj.stats()["exact_calls"] == 0
    for first in (bad, np.ones(2, np.float32)):
        rm = pm.ragged_map(f, "n", layout="padded")
        if first is not bad:
            rm([first])
        with pytest.raises(jax.errors.JaxRuntimeError, match="non-finite logical value"):
            rm([np.ones(1, np.float32), bad])
        outs = rm([_vec(1), _vec(3)])
        np.testing.assert_allclose(outs[1], np.cumsum(_vec(3)), rtol=1e-6)
        assert rm.fallbacks() == {}


# a linear solve of the lineax kind (equinox's filter_primitive pattern): a
# Python implementation that reverse mode cannot transpose (a while loop, and a
# check of its result), a JVP rule that binds the primitive again on tangents,
# and a transpose rule that binds it with the transposed operator
tri_solve_p = jax.extend.core.Primitive("polymask_test_tri_solve")


def _tri_solve_impl(L, b, *, lower):
    """Jacobi sweeps until the iterate stops changing (a triangular matrix's
    off-diagonal part is nilpotent: exact after at most n sweeps), in a while
    loop; NaN where the result is not finite (a check of the lineax kind)."""
    T = jnp.tril(L) if lower else jnp.triu(L)
    eye = jnp.eye(b.shape[0], dtype=bool)  # (jnp.diagonal compares sizes: no symbolic n)
    d = jnp.sum(jnp.where(eye, T, 0.0), axis=1)
    off = jnp.where(eye, 0.0, T)

    def sweep(c):
        t, x, _ = c
        new = (b - off @ x) / d
        return t + 1, new, jnp.all(new == x)

    x = jax.lax.while_loop(lambda c: (c[0] < 64) & ~c[2], sweep,
                           (0, jnp.zeros_like(b), False))[1]
    return jnp.where(jnp.all(jnp.isfinite(x)), x, jnp.nan)


def _tri_solve_jvp(primals, tangents, *, lower):
    L, b = primals
    tL, tb = tangents
    x = tri_solve_p.bind(L, b, lower=lower)
    rhs = jnp.zeros_like(b) if type(tb) is jax.interpreters.ad.Zero else tb
    if type(tL) is not jax.interpreters.ad.Zero:
        rhs = rhs - tL @ x
    return x, tri_solve_p.bind(L, rhs, lower=lower)


def _tri_solve_transpose(ct, L, b, *, lower):
    assert jax.interpreters.ad.is_undefined_primal(b)
    return None, tri_solve_p.bind(L.T, ct, lower=not lower)


tri_solve_p.def_impl(_tri_solve_impl)
tri_solve_p.def_abstract_eval(lambda L, b, *, lower: b)
jax.interpreters.ad.primitive_jvps[tri_solve_p] = _tri_solve_jvp
jax.interpreters.ad.primitive_transposes[tri_solve_p] = _tri_solve_transpose
mlir.register_lowering(tri_solve_p, mlir.lower_fun(_tri_solve_impl, multiple_results=False))


def _tri_loss(L, b):
    n = b.shape[0]
    L = jnp.tril(L) + 4.0 * jnp.eye(n)
    return jnp.sum(jnp.sin(tri_solve_p.bind(L, b, lower=True)) * (jnp.arange(n) + 1.0))


def test_a_python_primitive_differentiates_through_its_own_jvp_and_transpose_rules():
    """jax.grad of mask of a solve whose implementation cannot be transposed
    (a while loop): its JVP rule binds it on tangents, which run linearly with
    its own transpose rule, each masked (rules/inlined.py). Gradients equal
    plain JAX's on the exact arrays at n = 0, 1, a middle size and the bound,
    NaN padding, eager and under jit; zeros in the padding; jax.jvp too; and
    jax.vmap of jax.grad over the ragged sizes."""
    m = pm.mask(_tri_loss, ("n, n", "n"))
    rng = np.random.default_rng(3)
    batch = []
    for n in (0, 1, 5, 8):
        L = rng.normal(size=(n, n)).astype(np.float32)
        b = rng.normal(size=n).astype(np.float32)
        want = jax.grad(_tri_loss, (0, 1))(jnp.asarray(L), jnp.asarray(b))
        Lp = np.full((8, 8), np.nan, np.float32)
        Lp[:n, :n] = L
        bp = np.full(8, np.nan, np.float32)
        bp[:n] = b
        loss = lambda L, b, n: m(pm.Masked(L, (n, n)), pm.Masked(b, (n,))).data
        for got in (jax.grad(loss, (0, 1))(jnp.asarray(Lp), jnp.asarray(bp), n),
                    jax.jit(jax.grad(loss, (0, 1)))(Lp, bp, jnp.int32(n))):
            np.testing.assert_allclose(got[0][:n, :n], want[0], rtol=2e-4, atol=1e-5)
            np.testing.assert_allclose(got[1][:n], want[1], rtol=2e-4, atol=1e-5)
            assert np.all(np.asarray(got[0])[n:] == 0) and np.all(np.asarray(got[0])[:, n:] == 0)
            np.testing.assert_array_equal(np.asarray(got[1])[n:], 0.0)
        tb = np.zeros(8, np.float32)
        tb[:n] = 1.0
        _, tan = jax.jvp(lambda b: loss(jnp.asarray(Lp), b, n), (jnp.asarray(bp),),
                         (jnp.asarray(tb),))
        _, want_tan = jax.jvp(lambda b: _tri_loss(jnp.asarray(L), b), (jnp.asarray(b),),
                              (jnp.ones(n, np.float32),))
        np.testing.assert_allclose(tan, want_tan, rtol=2e-4, atol=1e-5)
        batch.append((n, Lp, bp, want))
    # ragged sizes under vmap: one program, the solves of tangents batched
    got = jax.jit(jax.vmap(jax.grad(loss, (0, 1))))(
        np.stack([c[1] for c in batch]), np.stack([c[2] for c in batch]),
        jnp.asarray([c[0] for c in batch], jnp.int32))
    for k, (n, _, _, want) in enumerate(batch):
        np.testing.assert_allclose(got[0][k, :n, :n], want[0], rtol=2e-4, atol=1e-5)
        np.testing.assert_allclose(got[1][k, :n], want[1], rtol=2e-4, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(got[1][k])[n:], 0.0)


def test_lineax_gradients_at_every_size():
    """jax.grad of lineax's LU and CG solves through mask equals plain JAX's at
    n = 0, 1, a middle size and the bound with NaN padding (was: UnsupportedError,
    "its own derivative rule works at exact shapes only"); under jax.vmap over
    ragged sizes with a constraint that leaves one case; without it the split
    between cases is refused under vmap with the remedy, never a wrong value."""
    lx = pytest.importorskip("lineax")

    def cg_solve(A, b):
        K = A @ A.T + jnp.eye(A.shape[0])
        op = lx.MatrixLinearOperator(K, lx.positive_semidefinite_tag)
        return lx.linear_solve(op, b, solver=lx.CG(rtol=1e-7, atol=1e-7, max_steps=100)).value

    B = 6
    for solve, tol in ((_lu_solve, 1e-4), (cg_solve, 2e-3)):
        loss = lambda A, b, solve=solve: jnp.sum(jnp.sin(solve(A, b)))
        m = pm.mask(loss, ("n, n", "n"))
        masked = lambda A, b, n, m=m: m(pm.Masked(A, (n, n)), pm.Masked(b, (n,))).data
        cases = []
        for n in (0, 1, 4, B):
            A, b = _system(n, seed=n)
            Ap = np.full((B, B), np.nan, np.float32)
            Ap[:n, :n] = A
            bp = np.full(B, np.nan, np.float32)
            bp[:n] = b
            want = jax.grad(loss, (0, 1))(jnp.asarray(A), jnp.asarray(b))
            got = jax.jit(jax.grad(masked, (0, 1)))(Ap, bp, jnp.int32(n))
            np.testing.assert_allclose(got[0][:n, :n], want[0], rtol=tol, atol=tol)
            np.testing.assert_allclose(got[1][:n], want[1], rtol=tol, atol=tol)
            assert np.isfinite(np.asarray(got[0])).all()
            cases.append((n, Ap, bp, want))
        with pytest.raises(pm.UnsupportedError, match="case split"):
            jax.jit(jax.vmap(jax.grad(masked, (0, 1))))(
                np.stack([c[1] for c in cases]), np.stack([c[2] for c in cases]),
                jnp.asarray([c[0] for c in cases], jnp.int32))
    m2 = pm.mask(lambda A, b: jnp.sum(jnp.sin(_lu_solve(A, b))), ("n, n", "n"),
                 constraints=["n >= 2"])
    ns = (2, 4, B)
    systems = [_system(n, seed=n) for n in ns]
    Ap = np.full((len(ns), B, B), np.nan, np.float32)
    bp = np.full((len(ns), B), np.nan, np.float32)
    for k, (n, (A, b)) in enumerate(zip(ns, systems)):
        Ap[k, :n, :n] = A
        bp[k, :n] = b
    got = jax.jit(jax.vmap(jax.grad(
        lambda A, b, n: m2(pm.Masked(A, (n, n)), pm.Masked(b, (n,))).data, (0, 1))))(
        Ap, bp, jnp.asarray(ns, jnp.int32))
    for k, (n, (A, b)) in enumerate(zip(ns, systems)):
        want = jax.grad(lambda A, b: jnp.sum(jnp.sin(_lu_solve(A, b))), (0, 1))(A, b)
        np.testing.assert_allclose(got[0][k, :n, :n], want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got[1][k, :n], want[1], rtol=1e-4, atol=1e-5)


@jax.custom_jvp
def _solve_implicitly(L, b):
    """x with L x = b, whose JVP solves with the tangents (the implicit
    function theorem's shape, as optimistix's ``implicit_jvp``)."""
    return tri_solve_p.bind(L, b, lower=True)


@_solve_implicitly.defjvp
def _solve_implicitly_jvp(primals, tangents):
    L, b = primals
    tL, tb = tangents
    x = _solve_implicitly(L, b)
    return x, tri_solve_p.bind(L, tb - tL @ x, lower=True)


def _split_loss(L, b):
    n = b.shape[0]
    L = jnp.tril(L) + 4.0 * jnp.eye(n)
    x = _solve_implicitly(L, b)
    if n >= 3:  # a case split: under jit the sizes choose a case at run time
        x = x * 2.0
    return jnp.sum(jnp.sin(x) * (jnp.arange(n) + 1.0))


def test_a_custom_jvp_that_solves_with_tangents_differentiates_in_every_case():
    """A custom JVP rule's own solves of tangents (optimistix's implicit
    function theorem) run linearly with the primitive's transpose rule, also
    inside one case of a case split, where JAX linearizes the switch's
    branches without marking tangents (was: "Transpose rule for
    'custom_vmap_call' not implemented"). jax.jit(jax.grad) with the size
    traced equals plain JAX at n = 0, 1, 2, 3 and the bound; under jax.vmap
    forward mode (jax.jvp) gives the values and reverse mode is refused with
    the remedy."""
    m = pm.mask(_split_loss, ("n, n", "n"))
    loss = lambda L, b, n: m(pm.Masked(L, (n, n)), pm.Masked(b, (n,))).data
    rng = np.random.default_rng(4)
    batch = []
    for n in (0, 1, 2, 3, 8):
        L = rng.normal(size=(n, n)).astype(np.float32)
        b = rng.normal(size=n).astype(np.float32)
        Lp = np.full((8, 8), np.nan, np.float32)
        Lp[:n, :n] = L
        bp = np.full(8, np.nan, np.float32)
        bp[:n] = b
        want = jax.grad(_split_loss, (0, 1))(jnp.asarray(L), jnp.asarray(b))
        got = jax.jit(jax.grad(loss, (0, 1)))(Lp, bp, jnp.int32(n))
        np.testing.assert_allclose(got[0][:n, :n], want[0], rtol=2e-4, atol=1e-5)
        np.testing.assert_allclose(got[1][:n], want[1], rtol=2e-4, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(got[1])[n:], 0.0)
        batch.append((n, L, b, Lp, bp))
    ns = jnp.asarray([c[0] for c in batch], jnp.int32)
    Ls, bs = np.stack([c[3] for c in batch]), np.stack([c[4] for c in batch])
    tbs = np.zeros_like(bs)
    for k, c in enumerate(batch):
        tbs[k, :c[0]] = 1.0
    _, tans = jax.jit(jax.vmap(lambda L, b, t, n: jax.jvp(
        lambda b: loss(L, b, n), (b,), (t,))))(Ls, bs, tbs, ns)
    for k, (n, L, b, _, _) in enumerate(batch):
        _, want = jax.jvp(lambda b: _split_loss(jnp.asarray(L), b), (jnp.asarray(b),),
                          (jnp.ones(n, np.float32),))
        np.testing.assert_allclose(tans[k], want, rtol=2e-4, atol=1e-5)
    with pytest.raises(pm.UnsupportedError, match="case split"):
        jax.jit(jax.vmap(jax.grad(loss, (0, 1))))(Ls, bs, ns)


def _decay_fit():
    """An optimistix Gauss-Newton fit of ``a exp(-k t) + c`` (3 parameters) to
    12 points: ``(fit(t, y) -> sum of the parameters, t, y)``."""
    optx = pytest.importorskip("optimistix")

    def residual(p, args):
        t, y = args
        return p[0] * jnp.exp(-p[1] * t) + p[2] - y

    def fit(t, y):
        sol = optx.least_squares(residual, optx.GaussNewton(rtol=1e-6, atol=1e-6),
                                 jnp.array([1.0, 1.0, 0.0]), args=(t, y), max_steps=200,
                                 throw=False)
        return jnp.sum(sol.value)

    t = np.linspace(0, 1, 12).astype(np.float32)
    return fit, t, (2.0 * np.exp(-1.5 * t) + 0.3).astype(np.float32)


def test_optimistix_least_squares_gradients_under_jit():
    """jax.grad through mask of an optimistix Gauss-Newton fit (its implicit
    function theorem solves with lineax on tangents, and lineax picks QR or LU
    by the matrix's shape: a case split), the size traced under jax.jit,
    equals plain JAX's gradient with respect to the data."""
    fit, t, y = _decay_fit()
    m = pm.mask(fit, ("n", "n"))
    grad = jax.jit(jax.grad(lambda t, y, n: m(pm.Masked(t, (n,)), pm.Masked(y, (n,))).data))
    for n in (0, 3, 12):
        want = jax.grad(fit)(jnp.asarray(t[:n]), jnp.asarray(y[:n]))
        got = np.asarray(grad(t, y, jnp.int32(n)))
        np.testing.assert_allclose(got[:n], want, rtol=1e-3, atol=1e-3 * (1 + np.abs(want).max(initial=0)))
        np.testing.assert_array_equal(got[n:], 0.0)


def test_optimistix_least_squares_gradients_eagerly_at_every_size():
    """Eager jax.grad through mask of the same fit (no jax.jit): at n = 0 and
    n = k (k = 3 parameters, where lineax's shape-dependent choice makes exact
    cases) it equals plain JAX's gradient too. A scalar constant of the fit
    (the solver's learning rate) reaches lineax's transpose as an array, not
    as a jaxpr literal that equinox would move to the static part; and at
    n = 0 the singular solve of the backward pass, which XLA drops in plain
    JAX (its result is empty), is dropped here too: the eager derivative
    differentiates the compiled program."""
    fit, t, y = _decay_fit()
    m = pm.mask(fit, ("n", "n"))
    t_padded, y_padded = (np.concatenate([a[:8], np.full(4, np.nan, np.float32)]) for a in (t, y))
    for n in (0, 3, 4, 8):
        want = jax.grad(fit)(jnp.asarray(t[:n]), jnp.asarray(y[:n]))
        got = np.asarray(jax.grad(lambda t, y: m(pm.Masked(t, (n,)), pm.Masked(y, (n,))).data)(
            t_padded, y_padded))
        # n = k is exactly determined and ill-conditioned: float32 rounding grows
        np.testing.assert_allclose(got[:n], want, rtol=1e-2 if n == 3 else 1e-3,
                                   atol=1e-3 * (1 + np.abs(want).max(initial=0)))
        np.testing.assert_array_equal(got[n:], 0.0)


def test_value_and_grad_constraints_share_the_program_a_shape_choice_split():
    """lineax's least squares on a tall n x k matrix (QR) asks in its JVP rule
    whether n <= k, which no one program decides for every n: without a
    constraint value_and_grad runs those examples per exact shape (warned);
    with ``constraints=["n >= 4"]`` (k = 3) one padded program serves them,
    with plain JAX's values, and an example of n <= 3 is a ShapeError."""
    lx = pytest.importorskip("lineax")

    def loss(w, A, b):
        return jnp.sum(lx.linear_solve(lx.MatrixLinearOperator(A * w), b, lx.QR()).value ** 2)

    rng = np.random.default_rng(7)
    sizes = (4, 6, 9, 5)
    As = [rng.normal(size=(n, 3)).astype(np.float32) for n in sizes]
    bs = [rng.normal(size=n).astype(np.float32) for n in sizes]
    w = jnp.float32(1.5)
    want = jax.value_and_grad(lambda w: sum(loss(w, A, b) for A, b in zip(As, bs)) / 4)(w)
    plain = pm.value_and_grad(loss, ("n, 3", "n"))
    with pytest.warns(pm.FallbackWarning, match=r"constraints=\['n <= 3'\] or \['n >= 4'\]") as ws:
        plain(w, As, bs)
    assert plain.exact_compiles > 0
    # the message names lineax's line and the user's line that called it
    here = f"called from {__file__}:"
    assert any(here in str(r.message) and "loss)" in str(r.message) for r in ws)
    with pytest.raises(pm.PackedUnsupported, match="'geqrf'") as e:
        pm.value_and_grad(loss, ("n, 3", "n"), layout="packed")(w, As, bs)
    assert here in str(e.value) and "loss)" in str(e.value)
    vg = pm.value_and_grad(loss, ("n, 3", "n"), constraints=["n >= 4"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        v, g = vg(w, As, bs)
    assert vg.exact_compiles == 0
    np.testing.assert_allclose(v, want[0], rtol=1e-5)
    np.testing.assert_allclose(g, want[1], rtol=1e-4)
    with pytest.raises(pm.ShapeError, match=r"constraint 'n >= 4' does not hold for n=3"):
        vg(w, As + [rng.normal(size=(3, 3)).astype(np.float32)], bs + [np.ones(3, np.float32)])


def test_tangent_equations_follow_calls_branches_and_loops():
    """The equations of a JVP rule's jaxpr that take tangents, as partial
    evaluation finds them: through a jit, a cond's branches, a scan's and a
    while loop's carry (to a fixed point), floating values only; the solve of
    primal values in the same places is not marked."""
    from polymask.rules.tangents import tangent_equations

    L = jnp.eye(3) * 2.0

    def rule(x, t):
        def body(c, _):  # the carry becomes a tangent on the second step
            prim, tan = c
            return (tri_solve_p.bind(L, prim, lower=True), tri_solve_p.bind(L, tan, lower=True)
                    + 0.0 * prim), None
        (p1, t1), _ = jax.lax.scan(body, (x, t), None, length=2)
        t2 = jax.jit(lambda a: tri_solve_p.bind(L, a, lower=True))(t1)
        t3 = jax.lax.cond(x[0] > 0, lambda a: tri_solve_p.bind(L, a, lower=True),
                          lambda a: a, t2)
        steps = jax.lax.while_loop(lambda c: c[0] < 2,
                                   lambda c: (c[0] + 1, tri_solve_p.bind(L, c[1], lower=True)),
                                   (0, t3))
        return p1, steps[1]

    closed = jax.make_jaxpr(rule)(jnp.ones(3), jnp.ones(3))
    found = tangent_equations(closed.jaxpr, closed.jaxpr.invars[1:])

    def solves(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive is tri_solve_p:
                yield e
            for inner, _ in pm._jax_compat.inner_jaxprs(e.params):
                yield from solves(inner)

    marked = {id(e): found.get(id(e)) for e in solves(closed.jaxpr)}
    # scan body: the primal solve (operand 1 = prim) and the tangent one; jit,
    # cond's first branch, while body: tangent solves
    assert sorted(v for v in marked.values() if v is not None) == [(1,)] * 4
    assert list(marked.values()).count(None) == 1


def _unrolled(x):
    """A loop over the rows in Python (``range(x.shape[0])``): each size is a
    trace of its own."""
    acc = jnp.zeros(x.shape[1:])
    for i in range(x.shape[0]):
        acc = acc * 0.9 + jnp.tanh(x[i] @ jnp.ones((8, 8)))
    return acc


def test_a_bucket_whose_every_size_is_a_case_runs_per_exact_shape():
    """``mask`` traces such a function once per size into one program (up to
    2 x max_cases sizes). polymask.jit compiled that program, a copy of the
    function per size, at a bucket's first call (its speed: docs/runners.md):
    it runs such buckets per exact shape now, says why, and explain agrees.
    With fallback=False the one program is kept."""
    rng = np.random.default_rng(0)
    sizes = (3, 0, 5, 12, 3)
    runner = pm.jit(_unrolled, "n, 8", tiered=False)
    with pytest.warns(pm.FallbackWarning, match="every size is a case of its own"):
        for n in sizes:
            x = rng.normal(size=(n, 8)).astype(np.float32)
            np.testing.assert_allclose(runner(x), jax.jit(_unrolled)(x), rtol=1e-6)
    s = runner.stats()
    assert (s["compiles"], s["exact_compiles"], s["calls"]) == (0, 4, 5)
    assert list(runner.fallbacks()) == ["n <= 8", "n <= 16"]
    assert "range(n)" in runner.fallbacks()["n <= 8"]
    text = str(pm.explain(runner, np.ones((5, 8), np.float32), print_output=False))
    assert "per exact shape" in text and "every size is a case of its own" in text
    tiered = pm.jit(_unrolled, "n, 8", buckets=pm.buckets.pow2(maximum=16),  # covers 16
                    tiered=True)
    with pytest.warns(pm.FallbackWarning, match="every size is a case of its own"):
        for n in sizes:
            x = rng.normal(size=(n, 8)).astype(np.float32)
            np.testing.assert_allclose(tiered(x), jax.jit(_unrolled)(x), rtol=1e-6)
    tiered.wait()  # (a background compile of a per-size bucket is no failure)
    assert (tiered.stats()["compiles"], tiered.stats()["exact_compiles"]) == (0, 4)
    shared = pm.jit(_unrolled, "n, 8", tiered=False, fallback=False)
    for n in sizes:
        x = rng.normal(size=(n, 8)).astype(np.float32)
        np.testing.assert_allclose(shared(x), jax.jit(_unrolled)(x), rtol=1e-6)
    assert (shared.stats()["compiles"], shared.stats()["exact_compiles"]) == (2, 0)


def test_the_per_size_reason_names_the_rewrite_for_len_and_numpy_on_a_size():
    # dinosaur's len(xp) and t5x's np.ceil(np.log2(n)): the FallbackWarning's
    # rewrite names x.shape[0] instead of len(x) and jnp instead of NumPy on a size, not only range
    def interp_len(xp):
        return jnp.cumsum(xp)[: len(xp) - 1].sum() + jnp.zeros((), xp.dtype)

    def log2_steps(x):
        steps = int(np.ceil(np.log2(x.shape[0] + 1)))
        return x.sum() * steps

    def segment_count(x):  # jraph's int(num_segments): x.shape[0] is already the size
        n = int(x.shape[0])
        return jax.ops.segment_sum(x, jnp.arange(n) // 2, num_segments=n).max()

    for f in (interp_len, log2_steps, segment_count):
        runner = pm.jit(f, "n", tiered=False, buckets=[8])
        with pytest.warns(pm.FallbackWarning, match=r"x\.shape\[0\] instead of len\(x\) or "
                          r"int\(x\.shape\[0\]\).*jnp instead of NumPy or math on a size"):
            for n in (2, 5, 7, 8, 3):
                np.testing.assert_allclose(runner(_vec(n)), jax.jit(f)(_vec(n)), rtol=1e-6)
        assert (runner.stats()["compiles"], runner.stats()["exact_compiles"]) == (0, 5)


def test_the_per_size_reason_quotes_the_line_that_needs_the_size():
    # t5x's RelativePositionBiases: np.arange(qlen) fails as a TracerBoolConversionError
    # (NumPy divides the size), which names no size: the line's code says what
    def f(x):
        return x + np.arange(x.shape[0])

    runner = pm.jit(f, "n", tiered=False, buckets=[8])
    with pytest.warns(pm.FallbackWarning, match=r"test_fallback\.py:\d+ \(f\): `return x \+ "
                      r"np\.arange\(x\.shape\[0\]\)` \(TracerBoolConversionError"):
        for n in (2, 5):
            np.testing.assert_allclose(runner(_vec(n)), f(_vec(n)), rtol=1e-6)


def test_jnp_nonzero_without_size_leads_with_the_polymask_remedy_in_the_runners():
    # plain jax.jit fails too: the message starts with "use polymask.nonzero(x)",
    # not with JAX's ConcretizationTypeError and a per-size rewrite that cannot help
    def f(x):
        (idx,) = jnp.nonzero(x)
        return jnp.sum(x[idx] * idx)

    x = np.float32([0, 2, 0, 3, 5])
    calls = [lambda: pm.jit(f, "n", tiered=False)(x), lambda: pm.ragged_map(f, "n")([x])]
    for call in calls:
        with pytest.raises(pm.ShapeError, match=r"as plain jax.jit does: jnp\.nonzero has a "
                           r"data-dependent output size \(at .*test_fallback\.py.*use "
                           r"polymask\.nonzero\(x\) instead\n  JAX said: "
                           r"ConcretizationTypeError") as info:
            call()
        assert "every size is a case of its own" not in str(info.value)
        assert isinstance(info.value, jax.errors.ConcretizationTypeError)


def test_a_per_size_bucket_is_not_traced_size_by_size_first():
    """The first call of a bucket that runs per exact shape traced every size
    of it (9 traces at a bucket of 8, 33 at 32) before going per shape, where
    jax.jit traces the one shape called. It stops at the failed symbolic
    trace now (counted in traces, not time)."""
    traced = []

    def f(x):
        traced.append(x.shape[0])
        return sum(x[i] * i for i in range(x.shape[0])) + jnp.zeros((), x.dtype)

    runner = pm.jit(f, "n", tiered=False, buckets=pm.buckets.explicit([32]))
    with pytest.warns(pm.FallbackWarning, match="every size is a case of its own"):
        np.testing.assert_allclose(runner(_vec(20)), f(_vec(20)), rtol=1e-6)
    # the symbolic attempt(s) and plain jax.jit's trace of the shape called
    assert len(traced) <= 4, traced


@pytest.mark.parametrize("spec", [None, ("n, m", "m")])
def test_a_per_size_bucket_of_two_sizes_is_not_traced_value_by_value_first(spec):
    """A loop over n of (n, m) inputs: each case pins n and keeps m symbolic.
    The first call traced every n of the bucket (36 traces at a bucket of 32)
    before going per shape; it stops once the first pinned trace shows that
    n alone is needed (counted in traces, not time)."""
    traced = []

    def f(x, y):
        traced.append(x.shape)
        return sum(jnp.sum(x[i] * y) for i in range(x.shape[0])) + jnp.zeros((), x.dtype)

    runner = pm.jit(f, spec, tiered=False, buckets=pm.buckets.explicit([32]))
    y = np.arange(4, dtype=np.float32)
    with pytest.warns(pm.FallbackWarning, match="needs the size as a Python value"):
        for n in (20, 13):  # (said at the second size: n is made static)
            x = np.ones((n, 4), np.float32)
            np.testing.assert_allclose(runner(x, y), f(x, y), rtol=1e-6)
            if n == 20:
                # symbolic attempts, the first pinned value, jax.jit's trace of the shape
                assert len(traced) <= 5, traced
    assert runner.stats()["calls"] == 2


def test_a_loop_over_one_of_two_sizes_shares_over_the_other():
    """range(x.shape[0]) over (n, m) inputs: each case of the trace is one n
    with m symbolic, so the rule for a bucket of per-size cases did not apply
    and polymask.jit compiled a copy per n into one program (new-user check).
    n's axis is static now and m still shares, with or without specs (with
    specs "n, m" each shape compiled its own: 4 compiles where 3 serve)."""
    def f(x):
        acc = jnp.zeros(x.shape[1:], x.dtype)
        for i in range(x.shape[0]):
            acc = acc * 0.9 + x[i]
        return acc

    shapes = ((3, 4), (5, 4), (3, 6), (7, 2))
    rng = np.random.default_rng(0)
    for spec, want in ((None, (3, 0, ["args[0].shape[0] (static)"])),
                       ("n, m", (3, 0, ["args[0].shape[0] (static)"]))):
        runner = pm.jit(f, spec, tiered=False)
        with pytest.warns(pm.FallbackWarning):
            for shape in shapes:
                x = rng.normal(size=shape).astype(np.float32)
                np.testing.assert_allclose(runner(x), jax.jit(f)(x), rtol=1e-6)
        s = runner.stats()
        assert (s["compiles"], s["exact_compiles"], list(runner.fallbacks())) == want


def test_a_spec_dim_var_needed_as_a_value_is_static_and_the_others_share():
    """With specs, a dim var whose size the function needs as a Python value
    (``range(x.shape[0])``) is static, each of its sizes one program for
    every size of the others; its constraints and its equality across
    arguments are still checked (planned with the user's specs first)."""
    def f(x, y):
        acc = jnp.zeros(x.shape[1], x.dtype)
        for i in range(x.shape[0]):
            acc = acc + x[i] * y[i + 1]
        return acc

    runner = pm.jit(f, ("n, m", "n + 1"), constraints=["n >= 2"], tiered=False)
    rng = np.random.default_rng(0)
    with pytest.warns(pm.FallbackWarning, match="args\\[0\\].shape\\[0\\] as a Python value"):
        for n, m in ((2, 3), (3, 5), (3, 2), (4, 4), (2, 6), (4, 7)):
            x, y = rng.random((n, m), np.float32), rng.random(n + 1, np.float32)
            np.testing.assert_allclose(runner(x, y), jax.jit(f)(x, y), rtol=1e-6)
    s = runner.stats()
    assert (s["compiles"], s["exact_compiles"]) == (3, 0)  # n = 2, 3, 4
    # said as what runs: n static, m shared (not "each exact shape")
    reason = runner.fallbacks()["args[0].shape[0] (static)"]
    assert reason.startswith("the function needs the size as a Python value"), reason
    x, y = rng.random((3, 9), np.float32), rng.random(4, np.float32)
    text = str(pm.explain(runner, x, y, print_output=False))
    assert text.startswith("polymask.explain: f") and "no shared program" not in text
    with pytest.raises(pm.ShapeError, match="constraint 'n >= 2' does not hold for n=1"):
        runner(rng.random((1, 3), np.float32), rng.random(2, np.float32))
    with pytest.raises(pm.ShapeError, match="dim var 'n' has different sizes"):
        runner(rng.random((3, 4), np.float32), rng.random(5, np.float32))
