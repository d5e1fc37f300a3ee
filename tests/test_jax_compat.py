"""Every function of the private-JAX compatibility module, on the pinned JAX."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm
from polymask import _jax_compat as compat
from polymask import _jax_compat as jax_hooks


def scope_and_n(constraints=("n <= 10",)):
    scope = jax.export.SymbolicScope(list(constraints))
    (n,) = jax.export.symbolic_shape("n", scope=scope)
    return scope, n


def test_dim_expr_queries_and_evaluation():
    _, n = scope_and_n()
    e = (n + 1) // 2
    assert compat.is_dim_expr(e) and not compat.is_dim_expr(3)
    assert compat.dim_vars(e) == {"n"} and compat.dim_vars(4) == set()
    assert int(compat.evaluate_dim(e, {"n": 7})) == 4
    assert int(compat.evaluate_dim(e, {"n": jnp.int32(7)})) == 4
    assert compat.is_symbolic_shape((n, 3)) and not compat.is_symbolic_shape((2, 3))


def test_bounds_and_added_constraints():
    scope, n = scope_and_n()
    assert compat.upper_bound((n + 1) // 2) == 5
    assert compat.upper_bound(n % 3) == 2
    assert compat.lower_bound(n - 5) == -4
    u = compat.fresh_dim("_u1", scope)
    compat.add_constraint(scope, "_u1 <= 6")
    assert compat.upper_bound(u + n) == 16
    kinds = [c[0] for c in compat.explicit_constraints(scope)]
    assert kinds == [">=", ">="]


def test_source_line_and_literals():
    _, n = scope_and_n()
    jaxpr = jax.make_jaxpr(lambda x: x * 2.0)(jax.ShapeDtypeStruct((n,), jnp.float32))
    eqn = jaxpr.jaxpr.eqns[0]
    assert "test_jax_compat.py" in compat.source_line(eqn.source_info)
    lit = eqn.invars[1]
    assert compat.is_jaxpr_literal(lit) and float(compat.literal_value(lit)) == 2.0
    # Ops bound inside user_context carry the equation's user line.
    inner = jax.make_jaxpr(lambda x: _bind_in_context(eqn, x))(jnp.ones(3))
    assert compat.source_line(inner.jaxpr.eqns[0].source_info) == \
        compat.source_line(eqn.source_info)


def test_jaxpr_as_fun_of_a_reduce_window_reducer():
    f = lambda x: jax.lax.reduce_window(x, 1.0, lambda a, b: a * 2.0 + b, (2,), (1,), "VALID")
    eqn = jax.make_jaxpr(f)(jnp.ones(3)).jaxpr.eqns[0]
    reducer = compat.jaxpr_as_fun(eqn.params["jaxpr"], eqn.params["consts"])
    assert float(reducer(jnp.float32(3.0), jnp.float32(1.0))[0]) == 7.0
    closed = jax.make_jaxpr(lambda a: a + 1.0)(1.0)
    assert float(compat.jaxpr_as_fun(closed)(2.0)[0]) == 3.0


def _bind_in_context(eqn, x):
    with compat.user_context(eqn.source_info):
        return jax.lax.sin(x)


def test_name_scopes():
    def f(x):
        with jax.named_scope("outer"), jax.named_scope("inner"):
            y = jax.grad(jnp.sin)(x)
        return y + 1.0

    eqns = jax.make_jaxpr(f)(1.0).jaxpr.eqns
    assert compat.name_scopes(eqns[0].source_info)[:2] == ("outer", "inner")
    assert compat.name_scopes(eqns[-1].source_info) == ()


def test_dim_as_value_is_the_shape_primitive():
    _, n = scope_and_n()
    jaxpr = jax.make_jaxpr(lambda x: x.shape[0] * 1.0)(jax.ShapeDtypeStruct((n,), jnp.float32))
    assert jaxpr.jaxpr.eqns[0].primitive is compat.dim_as_value_p


def test_trace_hooks_split_undecidable_comparisons_only_inside_the_context():
    import pytest

    _, n = scope_and_n()
    orig_eq = type(n).__eq__
    with jax_hooks.trace_hooks(lambda f: True, split_vars={"n": (1, 10)}):
        assert jax_hooks.hooks_installed()
        assert (n == n) is True and (n + 1 == n) is False
        assert (n - n % 1 == n) is True  # equal at every value in the bounds
        with pytest.raises(jax_hooks.SplitNeeded) as info:
            _ = n == 1
        assert str(info.value.cond) == "- n + 1"  # n >= 1: split at n <= 1
        with pytest.raises(jax_hooks.SplitNeeded) as info:
            _ = n > 2
        assert str(info.value.cond) == "- n + 2"
        # JAX's own fallback on an inconclusive comparison still applies.
        assert str(n.max(3)) == "max(n, 3)"
    assert (n == 1) is False  # outside: plain JAX behaviour
    assert not jax_hooks.hooks_installed()
    assert type(n).__eq__ is orig_eq


def test_trace_hooks_are_removed_after_a_masked_trace():
    import polymask as pm

    orig_eq = type(scope_and_n()[1]).__eq__
    pm.mask(lambda x: x * 2, "n")(pm.Masked(jnp.ones(4), (3,)))
    assert not jax_hooks.hooks_installed()
    assert type(scope_and_n()[1]).__eq__ is orig_eq


def test_rule_tables_of_polymask_primitives():
    """def_jvp / def_transpose / def_linear / def_batching on a fresh primitive."""
    double_p = compat.Primitive("polymask_test_double")
    double_p.def_impl(lambda x: 2 * x)
    double_p.def_abstract_eval(lambda x: x)
    compat.def_linear(double_p, lambda ct, x: [
        None if compat.is_symbolic_zero(ct) else double_p.bind(ct)])
    compat.def_batching(double_p, lambda args, dims: (double_p.bind(*args), dims[0]))
    assert float(jax.grad(lambda x: double_p.bind(x))(1.0)) == 2.0
    assert jax.vmap(double_p.bind)(jnp.arange(3.0)).tolist() == [0.0, 2.0, 4.0]

    half_p = compat.Primitive("polymask_test_half")
    half_p.def_impl(lambda x: x / 2)
    half_p.def_abstract_eval(lambda x: x)
    compat.def_jvp(half_p, lambda primals, tangents: (
        half_p.bind(*primals),
        compat.symbolic_zero_like(primals[0]) if compat.is_symbolic_zero(tangents[0])
        else half_p.bind(tangents[0])))
    compat.def_transpose(half_p, lambda ct, x: [half_p.bind(ct)])
    assert float(jax.grad(lambda x: half_p.bind(x))(1.0)) == 0.5
    assert compat.is_symbolic_zero(compat.symbolic_zero_like(jnp.ones(2)))
    assert not compat.is_symbolic_zero(jnp.ones(2))


def test_lowering_as_a_jax_function_and_undefined_primals():
    """def_lowering_as: jit lowers a fresh primitive as a JAX function;
    is_undefined_primal tells a transpose rule which operand it transposes."""
    scale_p = compat.Primitive("polymask_test_scale")
    scale_p.def_impl(lambda x, y: x * y)
    scale_p.def_abstract_eval(lambda x, y: x)
    compat.def_lowering_as(scale_p, lambda x, y: x * y)
    seen = []

    def transpose(ct, x, y):
        seen.append((compat.is_undefined_primal(x), compat.is_undefined_primal(y)))
        return [scale_p.bind(ct, y), None]

    compat.def_transpose(scale_p, transpose)
    compat.def_jvp(scale_p, lambda primals, tangents: (
        scale_p.bind(*primals), scale_p.bind(tangents[0], primals[1])))
    assert float(jax.jit(scale_p.bind)(2.0, 3.0)) == 6.0
    assert float(jax.grad(lambda x: scale_p.bind(x, 3.0))(2.0)) == 3.0
    assert seen == [(True, False)]


def test_current_trace_identifies_the_trace_being_built():
    seen = []

    def f(x):
        seen.append(compat.current_trace())
        return x + 1

    jax.make_jaxpr(f)(1.0)
    jax.make_jaxpr(lambda x: f(x) * 2)(1.0)
    assert seen[0] is not None and seen[0] is not seen[1]
    assert compat.current_trace() is not seen[0]  # outside: the eval trace


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_reset_compilation_cache_rereads_the_directory(tmp_path):
    import polymask as pm

    x = np.arange(7.0, dtype=np.float32)
    prev = pm.enable_compilation_cache(tmp_path / "c")
    try:
        with pm.compile_counter() as cc:
            jax.jit(lambda x: x * 3.5 + 1)(x).block_until_ready()
        assert cc.compiles == 1
        assert any((tmp_path / "c").iterdir())  # written where the setting points
        jax.clear_caches()
        with pm.compile_counter() as cc:
            jax.jit(lambda x: x * 3.5 + 1)(x).block_until_ready()
        assert (cc.compiles, cc.cache_hits) == (0, 1)  # read back from it
    finally:
        pm.disable_compilation_cache(prev)


def test_fresh_compile_options_compile_past_the_persistent_cache_and_serialize(tmp_path):
    import polymask as pm

    f = lambda x: jnp.cos(x) * 1.5 - x
    x = np.linspace(-1, 1, 9, dtype=np.float32)
    prev = pm.enable_compilation_cache(tmp_path / "c")
    try:
        jax.jit(f).lower(x).compile()  # written to the persistent cache
        jax.clear_caches()
        with pm.compile_counter() as cc:
            jax.jit(f).lower(x).compile()
        assert (cc.compiles, cc.cache_hits) == (0, 1)  # a plain compile loads it
        with pm.compile_counter() as cc:
            fresh = jax.jit(f).lower(x).compile(compiler_options=compat.fresh_compile_options())
        assert (cc.compiles, cc.cache_hits) == (1, 0)  # XLA compiled it: serializable
        loaded = compat.load_executable(compat.serialize_executable(fresh))
        np.testing.assert_allclose(np.asarray(loaded(x)), np.cos(x) * 1.5 - x, rtol=1e-6)
    finally:
        pm.disable_compilation_cache(prev)


def test_threefry2x32_is_what_random_bits_draws():
    key = jax.random.key(5)
    k = jax.random.key_data(key)
    lo = jnp.arange(6, dtype=jnp.uint32).reshape(2, 3)
    b1, b2 = compat.threefry2x32(k[0], k[1], jnp.zeros_like(lo), lo)
    np.testing.assert_array_equal(b1 ^ b2, jax.random.bits(key, (2, 3)))  # partitionable


def test_weak_types_queried_and_restored():
    assert compat.is_weakly_typed(2.0) and not compat.is_weakly_typed(np.float32(2))
    strong = np.array([2.0, 3.0], np.float32)
    out = jax.jit(lambda s, x: x * compat.as_weakly_typed(s))(strong, jnp.ones(2, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16  # the weak factor yields to bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), [2.0, 3.0])
    assert compat.is_weakly_typed(jax.jit(compat.as_weakly_typed)(strong))


# ----------------------------------------------------------------------------
# JAX versions (0.10.2 .. 0.12): jaxprs with constants, versioned primitives
# ----------------------------------------------------------------------------
def _open_jaxpr_and_consts():
    """A jaxpr whose constants are not attached (JAX 0.11+ carries them as leading
    invars), with its consts and the function it was traced from."""
    c = jnp.array([10.0, 20.0, 30.0])
    f = lambda x: x * c + 1.0
    closed = jax.make_jaxpr(f)(jnp.ones(3))
    j = closed.jaxpr
    assert len(closed.consts) == 1
    open_ = compat.Jaxpr(j.constvars, j.invars, j.outvars, j.eqns, j.effects, j.debug_info)
    return open_, list(closed.consts), f


def test_jaxpr_as_fun_binds_the_constants_of_an_open_jaxpr():
    open_, consts, f = _open_jaxpr_and_consts()
    x = jnp.array([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(compat.jaxpr_as_fun(open_, consts)(x)[0], f(x))
    constvars, invars = compat.jaxpr_inputs(open_, consts)
    assert len(constvars) == 1 and len(invars) == 1


def test_interpreter_binds_the_constants_of_an_open_jaxpr():
    """Dropping an inner jaxpr's constants would shift its arguments: a wrong value."""
    from polymask.core.shapes import DimEnv
    from polymask.tracing.interpreter import Interpreter
    from polymask.tracing.state import RunState

    open_, consts, f = _open_jaxpr_and_consts()
    x = jnp.array([1.0, 2.0, 3.0])
    interp = Interpreter()
    state = RunState(DimEnv(jax.export.SymbolicScope(), {}, {}), interp)
    (got,) = interp.eval_jaxpr(open_, consts, [x], state)
    np.testing.assert_array_equal(got, f(x))
    (got,) = interp.eval_closed(compat.closed_jaxpr(open_, consts), [x], state)
    np.testing.assert_array_equal(got, f(x))


def test_masked_inner_jit_closing_over_an_array():
    """An inner jit whose jaxpr has constants (a closed-over array), masked."""
    import polymask as pm

    c = jnp.arange(6.0) * 10
    inner = jax.jit(lambda x: x * c[: x.shape[0]].sum() + c[0])
    f = pm.mask(lambda x: inner(x).sum(), "n")
    x = jnp.array([1.0, 2.0, 3.0, jnp.nan, jnp.nan, jnp.nan])
    for n in (0, 1, 3, 6):
        padded = jnp.where(jnp.arange(6) < n, x, jnp.nan)
        got = f(pm.Masked(padded, (n,))).data
        np.testing.assert_allclose(got, inner(x[:n]).sum(), rtol=1e-6)
        got = jax.jit(f)(pm.Masked(padded, (jnp.int32(n),))).data
        np.testing.assert_allclose(got, inner(x[:n]).sum(), rtol=1e-6)


def test_scan_counts_of_the_installed_jax():
    closed = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda a, x: (a + x, a * x), c, xs))(
        1.0, jnp.ones(4))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    assert compat.scan_counts(eqn.params) == (0, 1)


def test_versioned_primitives_table_matches_the_installed_jax():
    prims = compat.all_primitives()
    for name in compat.VERSIONED_PRIMITIVES:
        assert compat.has_primitive(name) == (name in prims), (name, compat.JAX_VERSION)


def test_rules_are_registered_only_for_primitives_of_the_installed_jax():
    from polymask.rules import registered_primitives

    registered = set(registered_primitives())
    for name in compat.VERSIONED_PRIMITIVES:
        if not compat.has_primitive(name):
            assert name not in registered, name
    for name in ("log2", "one_minus_square", "polynomial"):
        assert (name in registered) == compat.has_primitive(name), name


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_hijax_primitives_are_traced_as_their_expansion():
    """jax 0.12 binds jnp.searchsorted / jnp.nonzero(size=) (and so tril_indices)
    as hijax primitives; a masked trace inlines their expansion, so their size
    comparisons split the trace (tril_indices' n * (n + 1) / 2)."""
    from polymask.testing import check_oracle

    rng = np.random.default_rng(0)
    exs = [(rng.normal(size=(n, n)).astype(np.float32),) for n in (0, 1, 3, 4)]
    check_oracle(lambda x: x[jnp.tril_indices(x.shape[0])] * 2.0, exs, [(4, 4)], ["n, n"],
                 modes=("eager", "jit", "vmap"))
    exs = [(np.sort(rng.normal(size=n)).astype(np.float32), rng.normal(size=3).astype(np.float32))
           for n in (0, 1, 4)]
    check_oracle(lambda a, q: jnp.searchsorted(a, q), exs, [(4,), None], ["n", None],
                 modes=("eager", "jit", "vmap"))
    assert not compat.hooks_installed()


def _jax_state() -> dict:
    """``{(container id, name): value id}`` over every loaded JAX module's globals,
    the classes they define, and the containers of the trace-patch table (rule
    tables included)."""
    import sys

    out = {}

    def scan(container, items):
        for k, v in items:
            out[(id(container), k)] = (id(v), container, k)

    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "jax" or name.startswith(("jax.", "jaxlib."))):
            continue
        d = getattr(mod, "__dict__", {})
        scan(mod, list(d.items()))
        for v in list(d.values()):
            if isinstance(v, type) and getattr(v, "__module__", None) == name:
                scan(v, list(vars(v).items()))
    for row in compat.TRACE_PATCHES:
        container, _ = row.home()
        items = container.items() if isinstance(container, dict) else vars(container).items()
        scan(container, list(items))
    return out


def test_every_replacement_of_jax_during_a_trace_is_in_the_table():
    """What a masked trace changes in JAX (module globals, class attributes, rule
    tables) is exactly the rows of ``_jax_compat/patches.py``, and every row is
    installed while the trace runs and undone after it."""
    before = _jax_state()
    during = {}
    homes = {}
    for row in compat.TRACE_PATCHES:
        container, attr = row.home()
        homes[(id(container), attr)] = row.name

    def f(x):
        now = _jax_state()
        # changed, or added where a row says so (DimExpr.__bool__: JAX defines none)
        during.update({k: v for k, v in now.items() if (k in before and before[k][0] != v[0])
                       or (k not in before and k in homes)})
        during["rows"] = {r.name: r.current() for r in compat.TRACE_PATCHES}
        return x * 2

    pm.mask(f, "n")(pm.Masked(jnp.ones(4), (2,)))
    rows_now = during.pop("rows")
    changed = {(c_id, attr) for (c_id, attr) in during}
    unlisted = sorted(f"{getattr(v[1], '__name__', type(v[1]).__name__)}.{v[2]}"
                      for k, v in during.items() if k not in homes)
    assert unlisted == []
    not_installed = sorted(name for key, name in homes.items() if key not in changed)
    assert not_installed == []
    assert all(rows_now[r.name] is not r.current() for r in compat.TRACE_PATCHES)
    after = _jax_state()
    assert {k for k in before if k in after and before[k][0] != after[k][0]} == set()
    assert {k for k in after if k not in before} & set(homes) == set()  # added ones removed


def test_a_replacement_needs_a_row_in_the_table():
    with pytest.raises(KeyError, match="TRACE_PATCHES"):
        compat.replace_during_trace("jnp.not_in_the_table", lambda *a: None)


def test_has_python_impl_and_is_batched():
    from jax import lax

    assert not compat.has_python_impl(lax.add_p)  # XLA's apply_primitive
    p = jax.extend.core.Primitive("polymask_test_compat_python_impl")
    p.def_impl(lambda x: x + 1)
    assert compat.has_python_impl(p)
    seen = []
    jax.vmap(lambda x: seen.append(compat.is_batched(x)) or x)(jnp.ones(3))
    jax.jit(lambda x: seen.append(compat.is_batched(x)) or x)(jnp.ones(3))
    assert seen == [True, False] and not compat.is_batched(jnp.ones(3))


def test_rule_tables_and_linear_call_under_vmap_of_grad():
    """A primitive's own JVP and transpose rules with JAX's symbolic zeros and
    undefined primals (rules/inlined.py masks them), and linear_call batched
    (JAX has no batching rule for it): vmap of grad, with the residual
    batched, the linear operand batched, or both, equals the plain gradient."""
    from jax import lax

    aval = jax.core.ShapedArray((3,), jnp.float32)
    primal, tangent = compat.jvp_rule(lax.mul_p)([jnp.ones(3), 2 * jnp.ones(3)],
                                                  [jnp.ones(3), compat.zero_tangent(aval)])
    np.testing.assert_allclose(tangent, 2 * np.ones(3))
    assert compat.is_zero_tangent(compat.zero_tangent(aval))
    assert not compat.is_zero_tangent(jnp.zeros(3))
    (ct,) = compat.transpose_rule(lax.neg_p)(jnp.ones(3), compat.undefined_primal(aval))
    np.testing.assert_array_equal(ct, -np.ones(3))
    assert compat.jvp_rule(jax.extend.core.Primitive("polymask_test_no_rules")) is None

    def divided(x, r):
        out = compat.linear_call(lambda r, x: (x[0] / r,), lambda r, ct: [ct[0] / r], r, [x])
        return jnp.sum(jnp.sin(out[0]))

    plain = lambda x, r: jnp.sum(jnp.sin(x / r))  # noqa: E731
    x = jnp.arange(1.0, 7.0).reshape(2, 3)
    r = jnp.array([[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]])
    for axes, args in (((0, 0), (x, r)), ((0, None), (x, r[0])), ((None, 0), (x[0], r))):
        got = jax.jit(jax.vmap(jax.grad(divided), in_axes=axes))(*args)
        want = jax.vmap(jax.grad(plain), in_axes=axes)(*args)
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_eager_transforms_name_eager_vmaps_and_derivatives_only():
    seen = []
    probe = lambda x: seen.append(compat.eager_transforms(x)) or x  # noqa: E731
    jax.vmap(probe)(jnp.ones(3))
    jax.vmap(jax.vmap(probe))(jnp.ones((2, 3)))
    jax.grad(lambda x: jnp.sum(probe(x)))(jnp.ones(3))
    jax.jvp(probe, (jnp.ones(3),), (jnp.ones(3),))
    jax.grad(lambda x: jnp.sum(jax.vmap(probe)(x)))(jnp.ones(3))
    jax.vmap(jax.grad(lambda x: probe(x) ** 2))(jnp.ones(3))
    jax.jit(jax.vmap(probe))(jnp.ones(3))
    jax.vmap(jax.jit(probe))(jnp.ones(3))
    jax.grad(jax.jit(lambda x: jnp.sum(probe(x))))(jnp.ones(3))
    jax.make_jaxpr(jax.grad(lambda x: jnp.sum(probe(x))))(jnp.ones(3))
    b, j = frozenset({"batch"}), frozenset({"jvp"})
    assert seen == [b, b, j, j, b | j, b | j, None, None, None, None]
    assert compat.eager_transforms(jnp.ones(3)) == frozenset()


def test_custom_vjp_cotangents_through_mask():
    """A custom_vjp whose bwd returns None for one argument (jaxopt's
    custom_root): masked gradients equal plain JAX's on every supported JAX
    (from 0.11 the flattened bwd returns (cotangents, logs))."""
    @jax.custom_vjp
    def scaled(x, k):
        return x * k

    scaled.defvjp(lambda x, k: (x * k, k), lambda k, g: (g * k, None))

    def loss(x):
        return jnp.sum(scaled(x, 3.0) ** 2)

    m = pm.mask(loss, "n")
    x = np.arange(6, dtype=np.float32)
    got = jax.grad(lambda d: m(pm.Masked(d, (4,))).data)(jnp.asarray(x))
    np.testing.assert_allclose(got[:4], jax.grad(loss)(x[:4]), rtol=1e-6)
    np.testing.assert_array_equal(got[4:], 0.0)


def test_jnp_empty_on_a_dynamic_axis():
    """jnp.empty binds the `empty` primitive from jax 0.11 (0.10: a broadcast of 0)."""
    m = pm.mask(lambda x: jnp.empty(x.shape).at[:].set(x) * 2.0, "n")
    for n in (0, 3, 5):
        np.testing.assert_array_equal(m(pm.Masked(jnp.arange(5.0), (n,))).unpad(),
                                      2.0 * np.arange(n))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gradients_through_max_min_and_pooling_on_this_jax(layout):
    """The NaN keepers of max and min bind a sum beside them: its params must be
    the sum's own on every JAX (0.10's reduce_max has no out_sharding, which its
    reduce_sum transpose requires), forward and backward, in both layouts."""
    rng = np.random.default_rng(0)
    W = jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)

    def loss(w, x):
        h = jnp.tanh(x @ w)
        pooled = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (2, 1), (1, 1), "SAME")
        return jnp.max(h) + jnp.sum(jnp.min(h, 0)) + jnp.mean(pooled) + jnp.max(h @ h.T)

    xs = [np.asarray(rng.normal(size=(n, 4)), np.float32) for n in (3, 1, 7, 5)]
    got_loss, got = pm.value_and_grad(loss, (None, "n, 4"), layout=layout,
                                      row_size=16 if layout == "packed" else None)(W, xs)
    want = [jax.value_and_grad(loss)(W, x) for x in xs]
    np.testing.assert_allclose(got_loss, np.mean([v for v, _ in want]), rtol=1e-5)
    np.testing.assert_allclose(got, np.mean([g for _, g in want], 0), rtol=1e-4, atol=1e-6)


def test_check_operands_where_gates_checkify_checks_failure_predicates():
    """The ``check`` primitive's operands are a flattened ``checkify.Error``."""
    from jax.experimental import checkify

    def f(x):
        checkify.check(x > 0, "x is {x}", x=x)

    err, _ = checkify.checkify(f)(jnp.float32(-2.0))
    leaves, tree = jax.tree_util.tree_flatten(err)
    gated = lambda where: jax.tree_util.tree_unflatten(
        tree, compat.check_operands_where(leaves, tree, jnp.bool_(where))).get()
    assert gated(True) == err.get() and "x is -2.0" in err.get()
    assert gated(False) is None


def test_failures_of_a_running_program_are_told_from_trace_failures():
    from polymask.core.errors import ShapeError

    def boom(x):
        raise RuntimeError("from the host")

    f = jax.jit(lambda x: jax.pure_callback(boom, jax.ShapeDtypeStruct((), jnp.float32), x))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(f(jnp.float32(1)))
    assert compat.is_runtime_error(info.value)
    as_value_error = ValueError(str(info.value))  # as jaxlib reports some of them
    assert compat.is_runtime_error(as_value_error)
    again = compat.as_jax_runtime_error(as_value_error)
    assert isinstance(again, jax.errors.JaxRuntimeError) and str(again) == str(info.value)
    for other in (ValueError("bad spec: n"), ShapeError("INTERNAL: x"), TypeError("INTERNAL: x")):
        assert not compat.is_runtime_error(other)


def test_traced_slice_bounds_error_and_message():
    try:
        jax.jit(lambda v, k: v[:k])(jnp.arange(3.0), 2)
    except IndexError as e:
        err = e
    else:
        raise AssertionError("plain jax.jit sliced with a traced bound")
    assert compat.is_traced_slice_bounds_error(err)
    assert compat.is_traced_slice_bounds_message(f"IndexError: {err}")
    assert not compat.is_traced_slice_bounds_message("IndexError: index 5 is out of bounds")


def test_a_line_inside_an_installed_library_names_the_user_line_that_called_it(tmp_path):
    lib = tmp_path / "site-packages" / "fakelib"
    lib.mkdir(parents=True)
    (lib / "mod.py").write_text("import jax.numpy as jnp\n\n\ndef f(x):\n    return jnp.sin(x)\n")
    spec = importlib.util.spec_from_file_location("fakelib_mod", lib / "mod.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def user(x):
        return mod.f(x) + 1.0

    sin, add = jax.make_jaxpr(user)(1.0).jaxpr.eqns
    line = compat.source_line(sin.source_info)
    assert line.endswith("site-packages/fakelib/mod.py:5 (f)"), line
    own = compat.line_outside_packages(sin.source_info)
    assert own.startswith(f"{__file__}:") and own.endswith(".user)"), own
    assert compat.source_line_with_caller(sin.source_info) == f"{line}, called from {own}"
    # the user's own line stays as it is
    assert compat.source_line_with_caller(add.source_info) == compat.source_line(add.source_info)
    assert compat.line_outside_packages(add.source_info) == compat.source_line(add.source_info)


def test_fresh_dim_names_are_the_prefix_and_a_number_only():
    """Data-dependent sizes are named ``_u1``, ``_u2``...; a spec's dim var that
    merely starts so (``_units``, internally ``_units__p1``) is not one."""
    assert compat.is_fresh_dim_name(compat.FRESH_DIM_PREFIX + "7")
    assert not compat.is_fresh_dim_name("_units__p1")
    assert not compat.is_fresh_dim_name("_units")
    assert not compat.is_fresh_dim_name(compat.FRESH_DIM_PREFIX)


def test_is_made_buffer_address_and_under_transformation():
    made = jnp.arange(3.0) * 2
    assert compat.is_made(made.block_until_ready()) is True
    made.delete()
    assert compat.is_made(made) is None  # (is_ready of a deleted array crashes jaxlib 0.10.2)
    assert compat.buffer_address(jnp.ones(2)) is not None
    assert compat.buffer_address(made) is None
    if jax.default_backend() == "cpu":  # an aligned upload aliases its host memory
        from polymask.runners.hostio import _aligned_zeros

        owner, view = _aligned_zeros((32,), np.dtype(np.float32))
        assert compat.buffer_address(compat.upload(view)) == view.ctypes.data
    seen = []

    def f(x):
        seen.append((compat.under_transformation(), compat.under_staging()))
        return x

    assert compat.under_transformation() is False and compat.under_staging() is False
    jax.grad(f)(1.0), jax.jit(f)(1.0), jax.vmap(f)(jnp.ones(2))
    jax.eval_shape(lambda x: f(x), 1.0)  # (a trace of its own: jit's cache has f's)
    jax.jit(jax.grad(lambda x: f(x)))(1.0)  # (staging beneath grad)
    # eager grad and vmap stage nothing; jit, eval_shape and grad inside jit do
    assert seen == [(True, False), (True, True), (True, False), (True, True), (True, True)]


def test_values_over_a_sizes_range_are_exact_and_never_wrap():
    """``values_over`` (sizes with a division are bounded and compared by
    their values): the scope's constraints over the size's dim vars narrow
    them; a value past int64 (JAX's constants are NumPy ints) or a divisor
    of 0 gives None, never a wrapped number."""
    scope = jax.export.SymbolicScope(("n <= 16", "n >= 3"))
    (n,) = jax.export.symbolic_shape("n", scope=scope)
    k = (n + 2 * (n // 2) + 1) // 2
    got = compat.values_over(k // 2, {"n": (1, 16)}, scope)
    assert got == {((m + 2 * (m // 2) + 1) // 2) // 2 for m in range(3, 17)}
    assert (compat.lower_bound(n % 3 + n // 3), compat.upper_bound(n % 3 + n // 3)) == (1, 6)
    assert compat.values_over(n ** 3 * 10 ** 17, {"n": (1, 16)}, scope) is None  # past int64
    assert compat.values_over(n, {"n": (1, 5000)}, scope) is None  # too many values


def test_values_over_apply_conditions_that_link_other_dim_vars():
    """A case's condition over n, m, k bounds a size over m and k alone: its
    values are those of the (m, k) that some allowed n completes, exactly."""
    cond = "n - m - k + min(m + k, 2) <= -1"  # needs m + k >= n + 3 (n >= 1)
    scope = jax.export.SymbolicScope(("n <= 3", "m <= 4", "k <= 4", cond))
    (e,) = jax.export.symbolic_shape("m + k", scope=scope)
    ranges = {"n": (1, 3), "m": (1, 4), "k": (1, 4)}
    want = {a + b for a in range(1, 5) for b in range(1, 5)
            if any(c - a - b + min(a + b, 2) <= -1 for c in range(1, 4))}
    assert compat.values_over(e, ranges, scope) == frozenset(want) == frozenset(range(4, 9))
    assert compat.exact_values_over(e, ranges, scope) == frozenset(want)
    # without n's range the condition cannot apply: a superset, not exact
    narrow = {"m": (1, 4), "k": (1, 4)}
    assert compat.values_over(e, narrow, scope) == frozenset(range(2, 9))
    assert compat.exact_values_over(e, narrow, scope) is None


def test_a_scope_no_values_meet_is_told_by_its_values():
    """Conditions that contradict where JAX's procedure does not see it (the
    scope builds): no combination of values meets them."""
    scope = jax.export.SymbolicScope(("n <= 5", "m <= 5", "m*n - 2*n - 2*m + 1 >= 0",
                                      "m*n - n - m <= -1"))
    ranges = {"n": (1, 5), "m": (1, 5)}
    assert compat.allows_no_values(scope, ranges)
    scope = jax.export.SymbolicScope(("n <= 5", "m <= 5", "m*n - 2*n - 2*m + 1 >= 0"))
    assert not compat.allows_no_values(scope, ranges)  # (n, m) = (5, 5) meets it


def test_sizes_jax_decides_slowly_are_bounded_by_their_values():
    """A ``min`` beside a product of sizes, or many nested ``min``s (chained
    slices of a concatenation), took JAX's decision procedure seconds to
    minutes: their bounds are their values' over the box, exact."""
    scope = jax.export.SymbolicScope(("n <= 6", "m <= 7", "k <= 5"))
    n, m, k = jax.export.symbolic_shape("n, m, k", scope=scope)
    e = k * m * n - (k * m * n - 3).min(1) + n
    assert compat.costly_to_decide(str(e))
    want = [a * b * c - min(a * b * c - 3, 1) + a
            for a in range(1, 7) for b in range(1, 8) for c in range(1, 6)]
    assert (compat.lower_bound(e), compat.upper_bound(e)) == (min(want), max(want))
    v = n * m
    for _ in range(4):  # jnp.concatenate([v[1:], jnp.arange(n)])[2:]'s sizes
        v = (v - 1 + n - 2).max(0)
    assert compat.upper_bound(v) == 6 * 7 + 4 * (6 - 3)
    assert not compat.costly_to_decide("max(0, n - 1) + min(n, 3)")
    # one min beside a case's conditions with more: JAX bounds it against each
    cased = jax.export.SymbolicScope(("n <= 6", "min(n, 2) + min(n - 1, 3) - 2 >= 0",
                                      "min(m, n) + min(m, 2) - 3 >= 0"))
    assert compat.costly_to_decide("max(0, n - 1) + min(n, 3)", cased)
