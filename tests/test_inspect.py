"""polymask.shape_formula, polymask.explain and CSE of size computations (issue 7)."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import attention
from jax import lax

import polymask as pm
from polymask.inspection.explain import Explanation
from polymask.inspection.formula import ShapeFormula


# ----------------------------------------------------------------------------
# shape_formula
# ----------------------------------------------------------------------------
def test_shape_formula_strided_slice():
    (f,) = [pm.shape_formula(lambda x: x[::2], "n", (10,))]
    assert isinstance(f, ShapeFormula)
    assert str(f) == "((n + 1) // 2,)"
    assert f.jax_str == "(floordiv(n + 1, 2),)"
    assert f == ("floordiv(n + 1, 2)",)
    assert f == ("(n + 1) // 2",)  # strings are parsed in the formula's scope
    assert f != ("n",)
    assert f.bound == (5,)
    assert f.evaluate(n=7) == (4,)
    assert f.evaluate(n=0) == (0,)
    assert f.dim_vars == {"n"}
    assert jax.export.symbolic_shape("n")[0].__class__ is f.exprs[0].__class__


def test_shape_formula_accepts_examples_shapes_and_structs():
    fun = lambda x: x[1:]  # noqa: E731
    a = pm.shape_formula(fun, "n", (8,))
    b = pm.shape_formula(fun, "n", jnp.zeros(8))
    c = pm.shape_formula(fun, "n", pm.Masked(jnp.zeros(8), (3,)))
    d = pm.shape_formula(fun, "n", jax.ShapeDtypeStruct((8,), jnp.int32))
    assert a == b == c == d
    assert str(a) == "(- min(n, 1) + n,)"  # exact at n = 0 too (not n - 1)
    assert [a.evaluate(n=n) for n in range(3)] == [(0,), (0,), (1,)]
    assert d.dtype == jnp.int32
    # in_specs=None: every axis is its own dim var
    e = pm.shape_formula(lambda x: x.T, None, (3, 4))
    assert str(e) == "(s1, s0)"


def test_shape_formula_pytree_and_equal_products():
    def f(x):
        a = x.reshape(x.shape[0] * x.shape[1])
        b = jnp.zeros(x.shape[1] * x.shape[0])  # computed separately, other order
        return {"a": a, "b": b, "c": jnp.sum(x)}

    out = pm.shape_formula(f, None, (4, 5))
    assert out["a"] == out["b"]
    assert hash(out["a"]) == hash(out["b"])
    assert out["a"] == ("s0*s1",) == out["a"]
    assert out["a"] == ("s1*s0",)
    assert str(out["c"]) == "()"
    assert out["a"].evaluate(s0=3, s1=2) == (6,)


def test_shape_formula_concatenate_and_conv():
    f = pm.shape_formula(lambda x, y, z: jnp.concatenate([x, y, z]), ("n", "m", "n"),
                         (2,), (3,), (2,))
    assert f == ("m + 2*n",)
    assert f.evaluate(n=1, m=2) == (4,)

    def conv(x):
        return lax.conv_general_dilated(x, jnp.ones((1, 1, 3)), (2,), "VALID")

    g = pm.shape_formula(conv, "1, 1, n", (1, 1, 10))
    assert g.evaluate(n=7) == (1, 1, 3)
    assert g.evaluate(n=4) == (1, 1, 1)
    assert "//" in str(g)


def test_shape_formula_evaluate_needs_all_vars():
    f = pm.shape_formula(lambda x, y: jnp.concatenate([x, y]), ("n", "m"), (2,), (3,))
    with pytest.raises(pm.ShapeError, match="no value for dim vars \\['m'\\]"):
        f.evaluate(n=1)


# ----------------------------------------------------------------------------
# CSE of size computations
# ----------------------------------------------------------------------------
def _count(jaxpr, name):
    return sum(1 for e in _eqns(jaxpr) if e.primitive.name == name)


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for x in (p if isinstance(p, (tuple, list)) else (p,)):
                if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                    yield from _eqns(x.jaxpr)
                elif hasattr(x, "eqns"):
                    yield from _eqns(x)


def five_queries(x):
    acc = jnp.float32(0)
    for i in range(5):
        acc = acc + jnp.sum(x) / (x.shape[0] * x.shape[1]) + i
    return acc + x.shape[1] * x.shape[0]  # the same expression, other order


def test_cse_one_multiply_for_five_queries():
    user = jax.make_jaxpr(five_queries)(
        jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, m"), jnp.float32))
    assert _count(user.jaxpr, "dim_as_value") == 6  # the queries are in the user program
    m = pm.mask(five_queries, "n, m")
    masked = jax.make_jaxpr(lambda x, a, b: m(pm.Masked(x, (a, b))).data)(
        jnp.ones((4, 5)), jnp.int32(3), jnp.int32(2))
    assert _count(masked.jaxpr, "mul") == 1  # one n*m for six queries
    assert _count(masked.jaxpr, "dim_as_value") == 0
    out = jax.jit(lambda x, a, b: m(pm.Masked(x, (a, b))).data)(
        jnp.ones((4, 5)), jnp.int32(3), jnp.int32(2))
    np.testing.assert_allclose(out, 5 * 1 + 10 + 6)


def test_cse_strided_size_computed_once():
    def f(x):
        y = x[::2]
        return jnp.sum(y) / y.shape[0] + y.shape[0] + jnp.sum(x[::2])

    m = pm.mask(f, "n")
    masked = jax.make_jaxpr(lambda x, n: m(pm.Masked(x, (n,))).data)(jnp.ones(10), jnp.int32(7))
    # floordiv(n + 1, 2) is computed once (three uses, two of them as a number)
    int_divs = [e for e in _eqns(masked.jaxpr) if e.primitive.name == "div"
                and e.outvars[0].aval.dtype == jnp.int32 and e.outvars[0].aval.shape == ()]
    # JAX's strided slice compares n >= 1: n = 0 is a case of its own, traced at size 0
    tree = m.cases(pm.Masked(jnp.ones(10), (7,)))[0]
    assert len(tree.cases) == 2, tree.summary()
    assert len(int_divs) == 1
    got = m(pm.Masked(jnp.arange(10.0), (7,))).data
    np.testing.assert_allclose(got, (0 + 2 + 4 + 6) / 4 + 4 + 12)


# ----------------------------------------------------------------------------
# explain
# ----------------------------------------------------------------------------
def strided(x):
    y = x[::2]  # EXPLAIN-STRIDED
    return jnp.sum(y) / y.shape[0] + y.shape[0]


def test_explain_strided_slice():
    buf = io.StringIO()
    e = pm.explain(strided, "n", pm.Masked(jnp.arange(10.0), (7,)), file=buf)
    assert isinstance(e, Explanation) and isinstance(e, str)
    assert buf.getvalue().strip() == str(e).strip()
    assert "f32[floordiv(n + 1, 2)]" in e
    assert "n in [0, 10]" in e and "= 7" in e
    gather = [r for r in e.rows if "floordiv(n + 1, 2)" in " ".join(r.shapes)][0]
    assert gather.bounds == [(5,)]
    assert gather.logical == [(4,)]
    assert "test_inspect.py" in gather.source
    assert "EXPLAIN-STRIDED" in gather.code
    red = [r for r in e.rows if r.primitive == "reduce_sum"][0]
    assert red.selects >= 1  # the reduction masks its padding
    queries = [r for r in e.rows if r.size_query is not None]
    assert len(queries) == 2 and queries[0].size_query == queries[1].size_query
    assert "reuses #" in e  # the second query is the first one's value (CSE)
    assert e.sizes["floordiv(n + 1, 2)"]["queries"] == 2
    assert e.sizes["floordiv(n + 1, 2)"]["bound"] == 5
    assert e.sizes["floordiv(n + 1, 2)"]["logical"] == 4


def test_explain_without_example_sizes_and_rich():
    e = pm.explain(lambda x: jnp.cumsum(x) * x.shape[0], "n", (6,), print_output=False)
    assert "logical" in e and all(r.logical is None for r in e.rows)
    assert e.masked_jaxpr is not None
    from rich.console import Console

    console = Console(record=True, width=200, file=io.StringIO())
    console.print(e)
    text = console.export_text()
    assert "cumsum" in text and "sizes" in text
    # the spec's names, not the internal ones, and shapes kept ('[m]' is no markup)
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(pm.explain(lambda x: x[1:].sum(0), "n, m", (8, 4), print_output=False))
    text = console.export_text()
    assert "__p1" not in text and "f32[n,m]" in text and "f32[m]" in text


def test_explain_nested_jit_and_static_fast_path():
    inner = jax.jit(lambda x: jnp.tril(x))
    e = pm.explain(lambda x: inner(x) + jnp.ones(3).sum(), "n, n", (4, 4), print_output=False)
    nested = [r for r in e.rows if r.nested]
    assert nested and any(r.depth > 0 for r in e.rows)
    assert all("<unknown" not in r.source for r in e.rows)
    assert any(r.rule == "static" for r in e.rows)



def test_explain_attention():
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    e = pm.explain(attention, ("n, 64", None, None, None, None),
                   pm.Masked(jax.ShapeDtypeStruct((32, 64), jnp.float32), (17, 64)), w, w, w, w,
                   print_output=False)
    dots = [r for r in e.rows if r.primitive == "dot_general"]
    assert len(dots) == 6 and all(r.selects >= 1 for r in dots)
    assert any(r.shapes == ["f32[4,n,n]"] and r.bounds == [(4, 32, 32)] for r in dots)
    assert "outputs: f32[n,64]" in e


def test_explain_data_dependent_and_scan():
    def f(x):
        idx = pm.nonzero(x)
        return jnp.sum(x[idx]) + lax.scan(lambda c, v: (c + v, None), 0.0, x)[0]

    x = pm.Masked(jnp.array([0.0, 5, 0, 6, 0, 7]), (6,))
    e = pm.explain(f, "n", x, print_output=False)
    nz = [r for r in e.rows if r.primitive == "polymask_nonzero"][0]
    fresh = nz.shapes[0][4:-1]  # i32[_u1] -> _u1
    assert fresh in e.sizes and e.sizes[fresh]["bound"] == 6
    assert nz.logical is None  # data-dependent: unknown before running
    assert "logical ?" in e
    scan = [r for r in e.rows if r.primitive == "scan"][0]
    assert scan.nested and any(r.depth == 1 for r in e.rows[scan.index:])
    assert float(pm.mask(f, "n")(x).data) == 36  # explain left the function usable


def test_shape_formula_from_specs_alone():
    f = pm.shape_formula(lambda x: x[::2], "n")
    assert str(f) == "((n + 1) // 2,)" and f.bound is None
    g = pm.shape_formula(lambda x, y: jnp.concatenate([x, y]) @ jnp.ones((2, 3)),
                         ("n, 2", "m, 2"))
    assert g == ("m + n", 3)
    assert str(pm.shape_formula(lambda x: x.reshape(x.shape[0], -1, 2), "n, 2*k")) == "(n, k, 2)"
    with pytest.raises(pm.ShapeError, match="in_specs"):
        pm.shape_formula(lambda x: x, None)


def test_explain_from_specs_alone():
    e = pm.explain(lambda x: jnp.sum(x[::2]), "n", print_output=False)
    assert "placeholder bound" in e and "floordiv(n + 1, 2)" in e


def test_shape_formula_evaluate_raises_where_the_function_raises():
    # top_k with k = 3 fails for n < 3 in plain JAX: the formula must not answer (3,) there
    f = pm.shape_formula(lambda x: lax.top_k(x, 3)[0], "n", (8,))
    assert f.evaluate(n=3) == (3,) and f.evaluate(n=8) == (3,)
    for n in (0, 2):
        with pytest.raises(pm.ShapeError, match=rf"at {{'n': {n}}} .*raises"):
            f.evaluate(n=n)
        with pytest.raises(ValueError):
            lax.top_k(jnp.ones(n), 3)  # plain JAX agrees
    assert sorted(t for t, _ in f.errors) == ["n == 0", "n == 1", "n == 2"], f.errors
    assert all("top_k" in e for _, e in f.errors)
    assert "raises when n == " in repr(f) and repr(f).count(" or n == ") == 2
    assert pm.shape_formula(lambda x: x * 2, "n", (8,)).errors == ()
    # a size the error cases need but the call does not give: a ShapeError, not a KeyError
    g, _ = pm.shape_formula(lambda x, y: (lax.top_k(x, 3)[0], y * 2), ("n", "m"), (8,), (4,))
    with pytest.raises(pm.ShapeError, match=r"no value for dim vars \['n'\]"):
        g.evaluate(m=2)
    assert g.evaluate(n=4, m=2) == (3,)


def test_shape_formula_evaluate_refuses_sizes_outside_the_traced_range():
    # the comparison `n > 10` is decided (false) for every size up to the bound 8,
    # so the formula (n,) says nothing about n = 20, where the function gives (3,)
    def f(x):
        return x[:3] if x.shape[0] > 10 else x

    formula = pm.shape_formula(f, "n", (8,))
    assert formula.evaluate(n=0) == (0,) and formula.evaluate(n=8) == (8,)
    for n in (9, 20):
        with pytest.raises(pm.ShapeError, match=f"n={n} is above 8, the largest size"):
            formula.evaluate(n=n)
    with pytest.raises(pm.ShapeError, match="n=-1: sizes are >= 0"):
        formula.evaluate(n=-1)
    wide = pm.shape_formula(f, "n", (32,))
    assert wide.evaluate(n=20) == f(np.zeros(20)).shape == (3,)


def test_shape_formula_evaluate_checks_types_names_and_constraints():
    f = lambda x: jnp.concatenate([x[::2], x[:3]])
    formula = pm.shape_formula(f, "n", (8,), constraints=["n >= 3"])
    for n in (3, 8, np.int64(5)):
        assert formula.evaluate(n=n) == f(np.zeros(int(n))).shape
    for n in (0, 2):  # plain JAX gives other shapes there: the constraint excludes them
        with pytest.raises(pm.ShapeError, match="constraint 'n >= 3' does not hold for n="):
            formula.evaluate(n=n)
    for bad in (2.5, True, "3"):
        with pytest.raises(TypeError, match="is not an int"):
            formula.evaluate(n=bad)
    with pytest.raises(pm.ShapeError, match="unknown dim var 'm'"):
        formula.evaluate(n=3, m=1)


def test_shape_formula_evaluate_with_an_equality_constraint():
    formula = pm.shape_formula(lambda x: x.reshape(2, -1), "m", (8,), constraints=["m == 2*k"])
    assert formula.evaluate(k=2) == (2, 2) == np.zeros(4).reshape(2, -1).shape
    with pytest.raises(pm.ShapeError, match="unknown dim var 'm'"):
        formula.evaluate(m=4)


def test_explain_of_sizes_where_the_function_fails_raises_like_mask():
    def f(x):
        return lax.top_k(x * 2, 3)[0]

    for n in (0, 2):
        m = pm.Masked(jnp.zeros(8), (n,))
        with pytest.raises(pm.ShapeError, match=rf"n in \{{{n}\}}.*fails at .*test_inspect"):
            pm.explain(f, "n", m, print_output=False)
        with pytest.raises(pm.ShapeError, match=rf"n in \{{{n}\}}"):
            pm.mask(f, "n")(m)  # the same message
    text = str(pm.explain(f, "n", pm.Masked(jnp.zeros(8), (5,)), print_output=False))
    assert "this case" in text and "top_k" in text


def test_explain_names_the_rule_of_a_guarded_callback_in_a_loop():
    # a callback on static operands inside a loop over a dynamic length runs
    # through its rule (it skips the padding steps), so it is not "static"
    def f(x):
        body = lambda i, c: (jax.debug.callback(lambda v: None, c), c + 1.0)[1]
        return jax.lax.fori_loop(0, x.shape[0], body, 0.0)

    e = pm.explain(f, "n", (8,), print_output=False)
    (row,) = [r for r in e.rows if r.primitive == "debug_callback"]
    assert row.rule == "debug_callback_rule" and row.depth == 1


@pytest.mark.parametrize("internal_text, shown", [
    # a product of two shifted dim vars: once shown as "(p + 1)*q + 2 - q - 1 - p - 1",
    # which is not even p*q
    ("p__p1*q__p1 + 1 - q__p1 - p__p1", "p*q"),
    ("f32[n__p1 - 1,3]", "f32[n,3]"),
    ("n__p1^2 - 2*n__p1 + 1", "n^2"),
    ("- n__p1 + 3 >= 0", "- n + 2 >= 0"),
    ("got (p__p1*q__p1 + 1 - q__p1 - p__p1, m*n__p1 - m).", "got (p*q, m*n)."),
    ("max(0, n__p1 - 2)", "max(0, n - 1)"),
    ("n__p1*max(0, n__p1 - 2)", "(n + 1)*max(0, n - 1)"),
])
def test_sizes_in_messages_are_written_over_the_spec_dim_vars(internal_text, shown):
    """Messages and explain write a size traced over internal dim vars (a spec
    dim var n that may be 0 is traced as n__p1 - 1) back over the user's: a
    polynomial in JAX's normal form, the same value at every size."""
    from polymask.core.dimvars import display_text

    internal = {"p": ("p__p1", 1), "q": ("q__p1", 1), "n": ("n__p1", 1), "m": ("m", 0)}
    assert display_text(internal_text, internal) == shown


def test_explain_of_a_runner_takes_example_arguments_without_a_spec_slot():
    """``pm.explain(runner, params, x)``: a runner has its specs, so an argument
    in the in_specs slot that is no spec (arrays, a shape tuple) is the first
    example argument, as a user calling the runner passes it."""
    f = pm.jit(lambda p, x: jnp.tanh(x @ p["w"]), (None, "n, 4"))
    p = {"w": jnp.ones((4, 3))}
    x = np.ones((5, 4), np.float32)
    text = pm.explain(f, p, x, print_output=False)
    assert "args[0]['w']: f32[4,3]" in text and "args[1]: f32[n,4]" in text
    assert text == pm.explain(f, None, p, x, print_output=False)
    g = pm.jit(jnp.cumsum, "n")
    assert "i32[n]" in pm.explain(g, np.arange(6, dtype=np.int32), print_output=False)
    assert "f32[n]" in pm.explain(g, (6,), print_output=False)


def test_explain_of_value_and_grad_with_dict_specs_and_of_ragged_map_in_the_wrong_order():
    """Specs by parameter name are explained as the runner runs them (one
    shared program), not as a failing trace; arguments in another order than
    the function's are a SpecError saying the order, not a per-shape claim."""
    loss = lambda p, x: (x * p).sum()  # noqa: E731
    x = np.ones(5, np.float32)
    for specs in ({"x": "n"}, (None, "n"), "n"):
        text = pm.explain(pm.value_and_grad(loss, specs), jnp.float32(1.0), x,
                          print_output=False)
        assert text.startswith("polymask.explain: <lambda>") and "args[1]: f32[n]" in text
    text = pm.explain(loss, {"x": "n"}, jnp.float32(1.0), x, print_output=False)
    assert "args[1]: f32[n]" in text
    rm = pm.ragged_map(lambda w, x: x @ w, "n, 8")
    w, x8 = np.ones((8, 3), np.float32), np.ones((5, 8), np.float32)
    assert "args[1]: f32[n,8]" in pm.explain(rm, w, x8, print_output=False)
    with pytest.raises(pm.SpecError, match="(?s)says 8, but .* is 3.*the function's order"):
        pm.explain(rm, x8, w, print_output=False)
    vg = pm.value_and_grad(loss, {"x": "n"})
    with pytest.raises(pm.SpecError, match=r"one example's arguments, not the batch"):
        pm.explain(vg, jnp.float32(1.0), [x, x[:3]], print_output=False)


def test_explain_of_a_runner_without_arguments_uses_its_last_new_call():
    """Without example arguments, a polymask.jit runner that has run is
    explained at its most recent new call's shapes and dtypes (integer
    inputs included: float32 placeholders failed inside such a function)."""
    f = pm.jit(lambda p, ids: p["table"][ids].sum(0), (None, "n"))
    p = {"table": jnp.ones((10, 4))}
    assert f.example_arguments() is None
    f(p, np.arange(5, dtype=np.int32))
    f(p, np.arange(3, dtype=np.int32))
    table, ids = f.example_arguments()
    assert ids == jax.ShapeDtypeStruct((3,), jnp.int32) and table["table"].shape == (10, 4)
    text = pm.explain(f, print_output=False)
    assert "args[1]: i32[n]" in text and "args[0]['table']: f32[10,4]" in text


def test_explain_names_rank_0_inputs_by_their_path():
    f = pm.jit(lambda p, x: x @ p["w"] + p["b"], (None, "n, 3"))
    p = {"w": jnp.ones((3,)), "b": jnp.float32(1.0)}
    text = pm.explain(f, p, np.ones((4, 3), np.float32), print_output=False)
    assert "  args[0]['b']: f32[]  bound []" in text and "  arg:" not in text


def test_explain_of_ragged_map_and_value_and_grad_takes_their_call_arguments():
    """``explain(rm, w, x)``: broadcast arguments first, one example after
    (it was an in_specs count error); ``explain(vg, params, x)``; without
    arguments both say what to pass; a forgotten argument is named as the
    user's mistake (it was 'fails for every size at <unknown location>')."""
    pool = lambda w, x: jnp.max(x @ w, axis=0)  # noqa: E731
    w, x = jnp.ones((4, 2)), np.ones((5, 4), np.float32)
    rm = pm.ragged_map(pool, "n, 4")
    text = pm.explain(rm, w, x, print_output=False)
    assert "args[0]: f32[4,2]" in text and "args[1]: f32[n,4]" in text
    assert text == pm.explain(rm, None, w, x, print_output=False)
    vg = pm.value_and_grad(lambda p, x: jnp.sum(x @ p), "n, 4")
    assert "args[1]: f32[n,4]" in pm.explain(vg, jnp.ones(4), x, print_output=False)
    for runner in (rm, vg):
        with pytest.raises(pm.ShapeError, match=r"without example arguments: it needs them"):
            pm.explain(runner, print_output=False)
        with pytest.raises(pm.ShapeError, match=r"do not fit <lambda>\(\w, x\): missing a "
                                                r"required argument: 'x'"):
            pm.explain(runner, x, print_output=False)


def test_explain_takes_python_scalars_and_0_d_shapes():
    j = pm.jit(lambda s, x: jnp.sum(x * s), (None, "n"))
    x = np.ones(5, np.float32)
    assert float(j(2.0, x)) == 10.0
    for args in ((2.0, x), (), ((), (5,))):  # () : the runner's last new call
        text = pm.explain(j, *args, print_output=False)
        assert "args[0]: f32[]" in text and "args[1]: f32[n]" in text


def test_explain_of_polymask_jit_shows_the_program_it_compiles():
    """Forward only, zero-padded inputs, at the runner's bucket with the
    example's sizes (it showed mask's differentiable program, 3 selects
    instead of 1, at the example's exact shape)."""
    f = lambda s, x: jnp.sum(jnp.log(x) * s)  # noqa: E731
    text = pm.explain(pm.jit(f, (None, "n")), jnp.float32(2), jnp.ones(5), print_output=False)
    assert "args[1]: f32[n]  bound [8]" in text and "from args[1].shape[0] = 5" in text
    assert "(1 select_n)" in text
    assert "(3 select_n)" in pm.explain(f, (None, "n"), jnp.float32(2), jnp.ones(5),
                                        print_output=False)


def test_explain_of_a_runner_without_specs_takes_a_padded_shape_tuple():
    """explain(polymask.jit(f), None, (8,)) read the shape tuple as a tuple of
    two ints (static), and said the runner ran the call per exact shape."""
    f = pm.jit(lambda x: jnp.sum(x * 2), tiered=False)
    f(jnp.ones(5))
    text = str(pm.explain(f, None, (8,), print_output=False))
    assert "f32[s0]  bound [8]" in text and "no shared program" not in text


def test_explain_labels_the_cases_a_count_chooses():
    """The cases of a branch on a data-dependent size are told apart by the
    count's conditions (the sizes alone reach both), outputs are printed as
    abstract values, and a count's failure checked as the program runs is
    said where the case's own conditions do not rule it out."""
    def f(x):
        s = pm.boolean_mask(x, x > 0)
        if s.shape[0] > 2:
            return s.sum()
        return s.max()

    text = str(pm.explain(f, ("n",), (8,), print_output=False))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("case ")]
    assert lines[0] == ("case 0: outputs f32[]; sizes n in {1..8} where _u1 <= 2 and _u1 >= 1; "
                        "_u1 <= 0: error, checked as the program runs"), lines
    assert lines[1] == "case 1: outputs f32[]; sizes n in {1..8} where _u1 >= 3", lines
    assert lines[2].startswith("case 2: error: ValueError: zero-size array"), lines


def test_explain_marks_a_case_no_count_reaches():
    """A case whose count conditions contradict (``_u1 >= 3`` and ``_u1 <=
    0``: JAX's emptiness split traced under ``> 2``) is said unreachable
    (new-user check)."""
    def f(x):
        s = pm.boolean_mask(x, x > 0)
        if s.shape[0] > 2:
            return s.mean()
        return -s.sum()

    text = str(pm.explain(f, "n", pm.Masked(jnp.ones(8), (6,)), print_output=False))
    cases = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("case ")]
    contradictory = [c for c in cases if "_u1 >= 3 and _u1 <= 0" in c]
    assert contradictory and all("(unreachable" in c for c in contradictory), cases
    assert not any("(unreachable" in c for c in cases if c not in contradictory), cases


def test_explain_of_a_runner_at_sizes_it_runs_per_shape_and_its_users_mistakes():
    """Where the runner's sizes reach an error case of the masked trace (a
    NumPy arange of a size: per exact shape), explain says the runner runs
    them per shape (it raised TooManyCases); a forgotten params is a
    ShapeError naming it (was a TypeError); a ragged_map given a list where
    one example goes says so (was 'fails as on the exact arrays')."""
    f = pm.jit(lambda x: (x * np.arange(x.shape[0])).sum(), "n", tiered=False)
    with pytest.warns(pm.FallbackWarning):
        f(np.ones(40, np.float32))
    for args in ((), (np.ones(40, np.float32),)):
        text = pm.explain(f, *args, print_output=False)
        assert "the runner runs them per exact shape under jax.jit" in text
    g = pm.jit(lambda params, x: x @ params, (None, "n, 4"))
    with pytest.raises(pm.ShapeError, match=r"do not fit <lambda>: .*missing a required "
                                            r"argument: 'x'"):
        pm.explain(g, np.ones((5, 4), np.float32), print_output=False)
    rm = pm.ragged_map(lambda x: x.mean(0), "n, 8")
    with pytest.raises(pm.SpecError, match=r"args\[0\] is a list of 1 array where in_specs"
                                           r"\[0\] is one spec 'n, 8'.*not the batch"):
        pm.explain(rm, [np.ones((5, 8), np.float32)], print_output=False)


def test_explain_and_shape_formula_of_a_masked_function_use_its_specs():
    """explain(mask(f, specs)) traced the masked function inside a mask: every
    size its own case (33 at a bound of 32); a Masked example in the spec
    slot was indexed as a spec (a TypeError). Now the masked function is its
    own function with its specs and constraints, and an example argument in
    the spec slot is the first argument (default specs for a plain function)."""
    def f(x):
        return jnp.cumsum(x, 0)[::2].sum(0)

    mf = pm.mask(f, "n, 4", constraints=["n >= 1"])
    x = pm.pad(np.ones((5, 4), np.float32), 32)
    plain = pm.explain(f, "n, 4", x, constraints=["n >= 1"], print_output=False)
    for e in (pm.explain(mf, x, print_output=False),
              pm.explain(mf, "n, 4", x, print_output=False)):
        assert "cases" not in e and e.rows == plain.rows
        assert "constraints: n >= 1" in e  # its constraint
    assert "f32[n,4]" in pm.explain(mf, print_output=False)  # placeholders from its specs
    assert "f32[s0,s1]" in pm.explain(f, x, print_output=False)  # default specs
    assert str(pm.shape_formula(mf)) == "(4,)"
    assert str(pm.shape_formula(lambda v: v[::2], (10,))) == "((s0 + 1) // 2,)"


def test_explain_of_a_packed_ragged_map_explains_its_packed_rows():
    """explain(ragged_map(..., layout="packed"), example) explained the padded
    program, and with layout="packed" took the example's length as the row;
    now the packed layout by default, at the map's row size (its own explain)."""
    rm = pm.ragged_map(lambda w, x: jnp.tanh(x @ w).mean(0), "n, 8", layout="packed",
                       row_size=64)
    w, x = np.ones((8, 4), np.float32), np.ones((5, 8), np.float32)
    e = pm.explain(rm, w, x, print_output=False)
    assert e.runs and "rows of 64 positions" in str(e)
    assert str(e) == str(rm.explain(x, w, print_output=False))
    assert "rows of 64" in str(pm.explain(rm, w, x, layout="packed", print_output=False))
    assert "masked program" in pm.explain(rm, w, x, layout="padded", print_output=False)
    with pytest.raises(pm.SpecError, match="one example's 1 argument"):
        pm.explain(rm, layout="packed", print_output=False)
    # a padded shape tuple is an example array of that shape (as for any explain)
    assert "rows of 64 positions" in str(pm.explain(rm, w, (5, 8), print_output=False))


@pytest.mark.parametrize("internal, shown", [
    ("- floordiv(floordiv(n__p1 - 1, 2), 2) - floordiv(n__p1 - 1, 2) - n__p1 + 1 <= -1",
     "floordiv(floordiv(n, 2), 2) + floordiv(n, 2) + n >= 1"),
    ("- mod(2, n) >= 0", "mod(2, n) <= 0"),
    ("m - 2*n - 3 >= 0", "m - 2*n >= 3"),
    ("n__p1 - 3 <= -1", "n <= 1"),
])
def test_case_conditions_read_without_leading_minus_signs(internal, shown):
    """explain and the error cases printed ``- floordiv(floordiv(n, 2), 2) -
    floordiv(n, 2) - n <= -1`` (a jax-cfd case): a sum of subtracted terms is
    negated with the comparison flipped, and its constant moves to the right."""
    from polymask.core.dimvars import pretty_condition

    assert pretty_condition(internal, {"n": ("n__p1", 1)}) == shown


def test_explain_of_a_packed_value_and_grad_explains_its_packed_layout():
    """value_and_grad(layout="packed") runs the packed layout, but explain
    showed the padded program by default, and its packed text named
    ragged_map (new-user check)."""
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    vg = pm.value_and_grad(loss, (None, "n, 4"), layout="packed")
    w, x = jnp.ones((4, 2)), np.ones((5, 4), np.float32)
    text = str(pm.explain(vg, w, x, print_output=False))
    assert text.startswith("polymask.explain: loss, packed layout")
    assert "value_and_grad's row_size" in text and "ragged_map" not in text
    padded = str(pm.explain(vg, w, x, layout="padded", print_output=False))
    assert "packed layout" not in padded and "masked program" in padded


def test_explain_says_what_it_takes_and_checks_example_sizes_as_a_call():
    """explain(42) named shape_formula's specs; an example Masked size above
    its bound was explained as if it fit ("n in [0, 4] ... = 7")."""
    with pytest.raises(TypeError, match="take a function, .* got int 42"):
        pm.explain(42)
    f = pm.mask(lambda x: jnp.sum(x), "n")
    with pytest.raises(pm.ShapeError, match=r"logical size 7 is outside \[0, 4\]"):
        pm.explain(f, pm.Masked(jnp.ones(4), (7,)), print_output=False)
    text = str(pm.explain(f, pm.Masked(jnp.ones(4), (3,)), print_output=False))
    assert "args[0].shape[0] = 3" in text
