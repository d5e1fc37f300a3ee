"""The program store (program_store.py): a later process loads ragged_map's batch
programs from disk, with the same values; a changed function never hits."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm
from polymask import buckets as B
from polymask.runners import program_store


def _script(body: str) -> str:
    """A script run in a fresh process: the store at argv[1], ``scale`` from
    argv[2], ``body`` making ``rm`` and ``xs``; prints outputs and counts."""
    return textwrap.dedent("""
        import json, sys
        import numpy as np, jax, jax.numpy as jnp
        import polymask as pm
        from polymask import buckets as B
        pm.enable_compilation_cache(sys.argv[1])
        scale = float(sys.argv[2])
    """) + textwrap.dedent(body) + textwrap.dedent("""
        outs = rm(xs)
        st = rm.stats()
        print(json.dumps(dict(outs=[o.tolist() for o in outs], xla=st["xla_compiles"],
                              loads=st["stored_loads"], compiles=st["compiles"])))
    """)


SCRIPT = _script("""
    def f(x):  # a size comparison: two cases in one program
        s = jnp.sum(x) if x.shape[0] >= 3 else -jnp.sum(x)
        return jnp.cumsum(x) * scale + s

    rm = pm.ragged_map(f, ("n",), buckets=B.pow2(4), batch_size=4, numpy_outputs=True,
                       compile_ahead=False, layout="padded")
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=n).astype(np.float32) for n in (0, 1, 2, 3, 5, 9, 16, 4)]
""")


def _reference(scale):
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=n).astype(np.float32) for n in (0, 1, 2, 3, 5, 9, 16, 4)]
    return [np.cumsum(x) * scale + (x.sum() if len(x) >= 3 else -x.sum()) for x in xs]


PACKED_SCRIPT = _script("""
    def f(x):  # attention-like: a block-diagonal softmax, then a per-example mean
        w = jax.nn.softmax(x @ x.T * scale, axis=-1)
        return jnp.mean(w @ x, axis=0)

    rm = pm.ragged_map(f, "n, 4", layout="packed", row_size=16, rows_per_call=2,
                       numpy_outputs=True)
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 4)).astype(np.float32) for n in (3, 16, 1, 7, 9, 2)]
""")


def _packed_reference(scale):
    import jax

    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 4)).astype(np.float32) for n in (3, 16, 1, 7, 9, 2)]
    return [np.asarray(jnp.mean(jax.nn.softmax(x @ x.T * scale, -1) @ x, 0)) for x in xs]


def _run(tmp_path, cache, scale, script_text=SCRIPT):
    script = tmp_path / "store_script.py"
    script.write_text(script_text)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one device: the store's condition
    p = subprocess.run([sys.executable, str(script), str(cache), str(scale)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_a_later_process_loads_the_programs_and_a_changed_function_compiles(tmp_path):
    cache = tmp_path / "cache"
    first = _run(tmp_path, cache, 2.0)
    programs = first["compiles"]
    assert programs == 2 and first["xla"] == programs and first["loads"] == 0
    stored = sorted((cache / program_store.SUBDIR).glob("*.xla"))
    assert len(stored) == programs
    second = _run(tmp_path, cache, 2.0)
    assert second["loads"] == programs and second["xla"] == 0  # no trace to HLO, no XLA
    for out in (first, second):
        for o, r in zip(out["outs"], _reference(2.0)):
            np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)
    # a different constant in the function: other keys, compiled, right values
    changed = _run(tmp_path, cache, 3.0)
    assert changed["loads"] == 0 and changed["xla"] == programs
    for o, r in zip(changed["outs"], _reference(3.0)):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)
    # a damaged file is ignored: compiled again and rewritten
    for path in stored:
        path.write_bytes(b"not an executable")
    again = _run(tmp_path, cache, 2.0)
    assert again["loads"] == 0 and again["xla"] == programs
    for o, r in zip(again["outs"], _reference(2.0)):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)
    assert _run(tmp_path, cache, 2.0)["loads"] == programs


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_a_later_process_loads_the_packed_row_program(tmp_path):
    """The packed layout's row program from the store: a later process neither
    traces it through the packed interpreter nor lowers it (0 XLA compiles),
    with the same values; a changed constant misses."""
    cache = tmp_path / "cache"
    first = _run(tmp_path, cache, 0.5, PACKED_SCRIPT)
    assert first["compiles"] == 1 and first["xla"] == 1 and first["loads"] == 0
    second = _run(tmp_path, cache, 0.5, PACKED_SCRIPT)
    assert second["compiles"] == 1 and second["xla"] == 0 and second["loads"] == 1
    assert second["outs"] == first["outs"]  # bitwise: one executable
    for o, r in zip(second["outs"], _packed_reference(0.5)):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)
    changed = _run(tmp_path, cache, 0.25, PACKED_SCRIPT)
    assert changed["loads"] == 0 and changed["xla"] == 1
    for o, r in zip(changed["outs"], _packed_reference(0.25)):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)


PACKED_NAN_SCRIPT = PACKED_SCRIPT.replace(
    "outs = rm(xs)", "xs[3][2, 1] = np.nan  # a row's rare path: the call reruns exactly\nouts = rm(xs)")


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_a_later_process_loads_the_packed_exact_program_too(tmp_path):
    """A NaN in one example sends its call to the exact row program, which the
    store keeps as well: a later process loads both programs (0 XLA compiles),
    the NaN stays in its own example, the others equal plain JAX."""
    cache = tmp_path / "cache"
    first = _run(tmp_path, cache, 0.5, PACKED_NAN_SCRIPT)
    assert first["compiles"] == 2 and first["xla"] == 2 and first["loads"] == 0
    second = _run(tmp_path, cache, 0.5, PACKED_NAN_SCRIPT)
    assert second["compiles"] == 2 and second["xla"] == 0 and second["loads"] == 2
    ref = _packed_reference(0.5)
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 4)).astype(np.float32) for n in (3, 16, 1, 7, 9, 2)]
    xs[3][2, 1] = np.nan
    ref[3] = np.asarray(jnp.mean(jax.nn.softmax(xs[3] @ xs[3].T * 0.5, -1) @ xs[3], 0))
    assert np.isnan(ref[3]).any()
    for out in (first, second):
        outs = [np.asarray(o, np.float32) for o in out["outs"]]
        for o, r in zip(outs, ref):
            np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)  # NaN where plain JAX's is


def test_keys_depend_on_constants_avals_and_parts(tmp_path):
    store = program_store.ProgramStore(tmp_path)

    def parts(c, extra="p"):
        mf = pm.mask(lambda x: x * c, ("n",))
        tree, _ = mf.cases(pm.Masked(jnp.zeros(8), (3,)))
        return [*program_store.tree_fingerprint(tree), extra]

    a = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    k = store.key(parts(np.float32(2.0)), [a])
    assert k == store.key(parts(np.float32(2.0)), [a])
    assert k != store.key(parts(np.arange(8, dtype=np.float32)), [a])
    assert k != store.key(parts(np.float32(2.0)), [jax.ShapeDtypeStruct((4, 8), jnp.int32)])
    assert k != store.key(parts(np.float32(2.0), "q"), [a])
    assert not store.has(k) and store.load(k) is None


def test_a_closed_over_prng_key_is_a_constant_of_the_key_and_loads(tmp_path):
    """A typed PRNG key closed over (flax.nnx's Rngs state made pure with
    nnx.split/merge) crashed the store's key (np.asarray of a key<fry>
    constant): hashed by its implementation and key data, and the stored
    program runs as plain jax.jit in a second runner."""
    prev = pm.enable_compilation_cache(tmp_path / "c")
    try:
        def make(seed):
            key = jax.random.key(seed)
            return lambda x: x + jax.random.normal(key, (8,))

        xs = [np.full((k, 8), 0.5, np.float32) for k in (0, 3, 5)]
        outs = []
        for seed in (1, 1, 2):
            rm = pm.ragged_map(make(seed), ("n, 8",), buckets=B.pow2(8), numpy_outputs=True)
            got = rm(xs)
            for x, o in zip(xs, got):
                np.testing.assert_allclose(o, jax.jit(make(seed))(x), rtol=1e-6)
            outs.append((got, rm.stats()["stored_loads"]))
        assert outs[1][1] >= 1 and outs[2][1] == 0  # same key loads; another key compiles
        store = program_store.ProgramStore(tmp_path)

        def key_of(seed, impl="threefry2x32"):
            k = jax.random.key(seed, impl=impl)
            tree, _ = pm.mask(lambda x: x + jax.random.normal(k, (8,)), ("n, 8",)).cases(
                pm.Masked(jnp.zeros((8, 8)), (3, 8)))
            return store.key(program_store.tree_fingerprint(tree), [])

        assert key_of(1) == key_of(1) != key_of(2)
        assert key_of(1) != key_of(1, "rbg")
    finally:
        pm.disable_compilation_cache(prev)


def test_no_store_without_the_persistent_cache():
    prev = pm.disable_compilation_cache()
    try:
        assert program_store.active_store() is None
        rm = pm.ragged_map(lambda x: x * 2, ("n",), buckets=B.pow2(4), numpy_outputs=True)
        np.testing.assert_allclose(rm([np.ones(3, np.float32)])[0], 2 * np.ones(3))
        assert rm.stats()["stored_loads"] == 0
    finally:
        pm.disable_compilation_cache(prev)


@pytest.mark.parametrize("n", [0, 5])
def test_store_hit_in_process_matches_plain_jax(tmp_path, n):
    prev = pm.enable_compilation_cache(tmp_path / "c")
    try:
        f = lambda w, x: jnp.tanh(x @ w).sum(0)
        w = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
        xs = [np.full((k, 3), 0.25, np.float32) for k in (n, 2, 7)]
        first = pm.ragged_map(f, ("n, 3",), buckets=B.pow2(8), numpy_outputs=True)
        a = first(xs, w)
        second = pm.ragged_map(f, ("n, 3",), buckets=B.pow2(8), numpy_outputs=True)
        b = second(xs, w)
        assert second.stats()["stored_loads"] == second.stats()["compiles"] >= 1
        for x, o1, o2 in zip(xs, a, b):
            np.testing.assert_allclose(o1, f(w, x), rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(o1, o2)
    finally:
        pm.disable_compilation_cache(prev)


def test_named_programs_load_without_a_trace(tmp_path, monkeypatch):
    from polymask.runners.ragged import RaggedMap

    prev = pm.enable_compilation_cache(tmp_path / "c")
    try:
        f = lambda w, x: jnp.tanh(x @ w).sum(0)  # a fixed output shape: storable by name
        w = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
        xs = [np.full((k, 3), 0.25, np.float32) for k in (0, 2, 7)]
        ref = [np.asarray(f(w, x)) for x in xs]
        traced = RaggedMap(f, ("n, 3",), buckets=B.pow2(8), numpy_outputs=True)
        traced(xs, w)  # stored under the traced key only
        by_trace = pm.ragged_map(f, ("n, 3",), buckets=B.pow2(8), numpy_outputs=True,
                                 program_id="tanh-sum-v1")  # the public form (docs/runners.md)
        for o, r in zip(by_trace(xs, w), ref):  # found by trace, copied under the name
            np.testing.assert_allclose(o, r, rtol=1e-6, atol=1e-6)
        assert by_trace.stats()["stored_loads"] == by_trace.stats()["compiles"] >= 1

        def no_trace(tree):
            raise AssertionError("a named load traced the function")

        monkeypatch.setattr(program_store, "tree_fingerprint", no_trace)
        by_name = pm.ragged_map(f, ("n, 3",), buckets=B.pow2(8), numpy_outputs=True,
                                program_id="tanh-sum-v1")
        for o, r in zip(by_name(xs, w), ref):
            np.testing.assert_allclose(o, r, rtol=1e-6, atol=1e-6)
        assert by_name.stats()["stored_loads"] == by_name.stats()["compiles"] >= 1
        assert by_name.stats()["xla_compiles"] == 0
    finally:
        pm.disable_compilation_cache(prev)


@pytest.mark.parametrize("where", ["jit", "cond", "scan"])
def test_keys_see_constants_of_nested_jaxprs(tmp_path, where):
    store = program_store.ProgramStore(tmp_path)

    def key(v):
        c = np.array([v, 2 * v], np.float32)  # a constant inside a nested jaxpr only
        if where == "jit":
            inner = jax.jit(lambda y: y * c)
        elif where == "cond":
            inner = lambda y: jax.lax.cond(y[0, 0] > 0, lambda z: z * c, lambda z: z - c, y)
        else:
            inner = lambda y: jax.lax.scan(lambda s, r: (s + r * c, s), jnp.zeros(2), y)[1]
        mf = pm.mask(lambda x: inner(x).sum(1), ("n, 2",))
        tree, _ = mf.cases(pm.Masked(jnp.zeros((8, 2)), (3, 2)))
        return store.key(program_store.tree_fingerprint(tree), [])

    assert key(1.0) == key(1.0)
    assert key(1.0) != key(4.0)


def test_a_file_under_another_key_is_not_loaded(tmp_path):
    store = program_store.ProgramStore(tmp_path)
    x = np.ones(4, np.float32)
    store.save("a" * 64, jax.jit(lambda x: x + 1).lower(x).compile(
        compiler_options=pm._jax_compat.fresh_compile_options()))
    assert store.load("a" * 64) is not None
    (tmp_path / ("b" * 64 + ".xla")).write_bytes((tmp_path / ("a" * 64 + ".xla")).read_bytes())
    assert store.has("b" * 64) and store.load("b" * 64) is None


def test_a_partial_batch_runs_in_a_stored_full_batch_program(tmp_path):
    prev = pm.enable_compilation_cache(tmp_path / "c")
    try:
        f = lambda x: jnp.cumsum(x) * 2.0
        warm = pm.ragged_map(f, ("n",), buckets=B.pow2(8), batch_size=4, numpy_outputs=True)
        warm.precompile(jax.ShapeDtypeStruct((8,), jnp.float32))  # what `polymask warmup` does
        later = pm.ragged_map(f, ("n",), buckets=B.pow2(8), batch_size=4, numpy_outputs=True)
        xs = [np.arange(n, dtype=np.float32) for n in (3, 0)]  # 2 of 4 rows: a partial batch
        for x, o in zip(xs, later(xs)):
            np.testing.assert_allclose(o, np.cumsum(x) * 2.0)
        st = later.stats()
        assert st["stored_loads"] == st["compiles"] == 1 and st["xla_compiles"] == 0
    finally:
        pm.disable_compilation_cache(prev)


def test_compiler_options_are_part_of_the_key(tmp_path):
    prev = pm.enable_compilation_cache(tmp_path / "c")
    try:
        f = lambda x: jnp.cumsum(x) * 2
        xs = [np.arange(n, dtype=np.float32) for n in (0, 3, 7)]
        runs = []
        for opts in (None, {"xla_cpu_experimental_ynn_fusion_type": ""}, None):
            rm = pm.ragged_map(f, ("n",), buckets=B.pow2(8), numpy_outputs=True,
                               compiler_options=opts)
            outs = rm(xs)
            for o, x in zip(outs, xs):
                np.testing.assert_array_equal(o, np.cumsum(x) * 2)
            runs.append(rm.stats()["stored_loads"])
        assert runs == [0, 0, 1]  # other options: compiled and stored under their own key
    finally:
        pm.disable_compilation_cache(prev)


def test_a_stored_program_called_with_other_argument_types_counts_its_compile():
    fn = lambda s, x: jnp.cumsum(x) * s
    compiled = jax.jit(fn).lower(np.float32(2.0), np.ones(4, np.float32)).compile()
    heard = []
    prog = program_store.StoredProgram(compiled, fn, on_compile=heard.append)
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(prog(np.float32(2.0), x), np.cumsum(x) * 2)
    assert heard == []
    for _ in range(2):  # an int scalar: not the compiled signature (TypeError)
        np.testing.assert_array_equal(prog(np.int32(2), x), np.cumsum(x) * 2)
    assert len(heard) == 1 and heard[0].compiles == 1  # the fallback compile, once
