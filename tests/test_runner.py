"""polymask.jit, ragged_map and bucketing policies (values only, never timings)."""

import functools
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import channel_batches, eventually
from jax import lax

import polymask as pm
from polymask import buckets as B
from polymask.runners.static_args import StaticArg


# ----------------------------------------------------------------------------
# buckets
# ----------------------------------------------------------------------------
def test_bucket_policies():
    p = B.pow2(8)
    assert [p(n) for n in (0, 1, 8, 9, 16, 17, 100)] == [8, 8, 8, 16, 16, 32, 128]
    assert [B.pow2(1)(n) for n in (0, 1, 2, 3, 5)] == [1, 1, 2, 4, 8]
    m = B.multiple(10)
    assert [m(n) for n in (0, 1, 10, 11)] == [10, 10, 10, 20]
    e = B.explicit([32, 8, 100])
    assert [e(n) for n in (0, 8, 9, 33, 100)] == [8, 8, 32, 100, 100]
    with pytest.raises(pm.ShapeError, match="largest bucket"):
        e(101)
    assert B.fixed(64)(3) == 64
    assert B.exact()(0) == 1 and B.exact()(7) == 7
    assert B.as_policy(None)(9) == 16
    assert B.as_policy([4, 16])(5) == 16
    assert B.as_policy(50)(3) == 50
    assert B.as_policy("exact")(5) == 5
    with pytest.raises(ValueError):
        B.as_policy("nope")
    # a largest bucket: the last bucket is cut to it, larger sizes refused
    pc = B.pow2(8, maximum=100)
    assert [pc(n) for n in (0, 9, 64, 65, 100)] == [8, 16, 64, 100, 100]
    assert pc.largest == 100 and B.pow2(8).largest is None and e.largest == 100
    with pytest.raises(pm.ShapeError, match="largest bucket 100"):
        pc(101)
    mc = B.multiple(10, maximum=35)
    assert [mc(n) for n in (1, 30, 31, 35)] == [10, 30, 35, 35] and mc.largest == 35
    with pytest.raises(pm.ShapeError, match="largest bucket 35"):
        mc(36)
    with pytest.raises(ValueError, match="maximum"):
        B.pow2(16, maximum=8)
    # a minimum that is no power of two is a bucket of its own: 9..12 fit 12
    assert [B.pow2(12)(n) for n in (0, 9, 12, 13, 16, 17)] == [12, 12, 12, 16, 16, 32]


def test_pow2_steps_split_each_doubling():
    p2 = B.pow2(16, steps=2)
    assert sorted({p2(n) for n in range(300)}) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384]
    assert [p2(n) for n in (0, 16, 17, 24, 25, 148, 193)] == [16, 16, 24, 24, 32, 192, 256]
    assert sorted({B.pow2(8, steps=4)(n) for n in range(65)}) == [8, 10, 12, 14, 16, 20, 24,
                                                                  28, 32, 40, 48, 56, 64]
    for steps in (1, 2, 3, 5):  # every size fits, monotone, at most ~1/(steps+1) padding
        p, prev = B.pow2(1, steps=steps), 0
        for n in range(1, 3000):
            b = p(n)
            assert n <= b and prev <= b
            assert n < 64 or (b - n) / b <= 1 / (steps + 1) + 1e-9
            prev = b
    assert repr(B.pow2(16, steps=2)) == "pow2(minimum=16, steps=2)"
    assert B.pow2(16, maximum=200, steps=2)(193) == 200
    with pytest.raises(ValueError, match="steps"):
        B.pow2(8, steps=0)


def test_stack_uses_bucket_policy():
    m = pm.stack([np.ones(3), np.ones(5)], buckets=B.pow2(4))
    assert m.data.shape == (2, 8)
    np.testing.assert_array_equal(m.shape[0], [3, 5])


# ----------------------------------------------------------------------------
# polymask.jit
# ----------------------------------------------------------------------------
def test_jit_exact_in_exact_out_one_compile_per_bucket():
    traces = []

    def f(x):
        traces.append(1)
        return jnp.cumsum(x) * 2 + jnp.sum(x)

    pf = pm.jit(f, buckets=B.pow2(8))
    for n in (0, 1, 3, 8, 5, 9, 16, 12, 2):
        x = np.arange(n, dtype=np.float32) + 1
        y = pf(x)
        assert isinstance(y, jax.Array)
        assert y.shape == (n,)
        np.testing.assert_allclose(y, np.cumsum(x) * 2 + x.sum(), rtol=1e-6)
    st = pf.stats()
    assert st["compiles"] == 2 == len(traces)  # buckets 8 and 16
    assert st["calls"] == 9 and st["cache_hits"] == 7
    assert 0 < st["padding_fraction"] < 1


def test_jit_specs_shared_names_and_static_args():
    def f(w, x, y):
        return jnp.tanh(x @ w) + y[:, None], jnp.mean(x)

    pf = pm.jit(f, (None, "n, 4", "n"))
    w = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    for n in (1, 5, 7):
        x = np.random.default_rng(n).normal(size=(n, 4)).astype(np.float32)
        y = np.arange(n, dtype=np.float32)
        a, m = pf(w, x, y)
        ea, em = f(w, x, y)
        assert a.shape == (n, 3)
        np.testing.assert_allclose(a, ea, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m, em, rtol=1e-5)
    assert pf.stats()["compiles"] == 1
    with pytest.raises(pm.ShapeError, match="dim var 'n'"):
        pf(w, np.ones((3, 4), np.float32), np.ones(4, np.float32))
    with pytest.raises(pm.ShapeError):
        pf(w, np.ones((3, 5), np.float32), np.ones(3, np.float32))


def test_jit_all_axes_dynamic_by_default_and_pytrees():
    pf = pm.jit(lambda d: {"s": d["a"].sum(0), "t": d["b"] * 2})
    out = pf({"a": np.ones((3, 5), np.float32), "b": np.arange(4, dtype=np.int32)})
    np.testing.assert_array_equal(out["s"], np.full(5, 3.0))
    np.testing.assert_array_equal(out["t"], np.arange(4) * 2)
    assert out["t"].dtype == jnp.int32


def test_jit_constraints_and_affine_specs():
    pf = pm.jit(lambda x: x[2] + x.shape[0], "n", constraints=["n >= 3"])
    assert float(pf(np.arange(5.0, dtype=np.float32))) == 7.0
    with pytest.raises(pm.ShapeError, match="n >= 3"):
        pf(np.arange(2.0, dtype=np.float32))
    pr = pm.jit(lambda x: x.reshape(-1, 2).sum(1), "2*k")
    np.testing.assert_array_equal(pr(np.arange(6.0, dtype=np.float32)), [1, 5, 9])
    with pytest.raises(pm.ShapeError, match="2\\*k"):
        pr(np.arange(5.0, dtype=np.float32))


def test_jit_dict_buckets_and_numpy_outputs():
    pf = pm.jit(lambda x, y: jnp.outer(x, y), ("n", "m"),
                buckets={"n": B.fixed(10), None: B.exact()}, numpy_outputs=True)
    out = pf(np.ones(3, np.float32), np.ones(2, np.float32))
    assert isinstance(out, np.ndarray) and out.shape == (3, 2)
    pf(np.ones(4, np.float32), np.ones(2, np.float32))
    pf(np.ones(4, np.float32), np.ones(5, np.float32))
    assert pf.stats()["compiles"] == 2  # n always 10; m exact: 2 and 5
    # a dim var no spec defines is a typo (it would leave n at the default policy)
    typo = pm.jit(lambda x: x.sum(), "n", buckets={"nn": B.fixed(64)})
    with pytest.raises(pm.SpecError, match=r"buckets names dim vars \['nn'\] that no spec "
                                           r"defines \(the specs define \['n'\]\)"):
        typo(np.ones(4, np.float32))


def test_jit_cache_size_limit_evicts():
    pf = pm.jit(jnp.sum, buckets=B.exact(), cache_size=2)
    for n in (1, 2, 3, 1):
        assert float(pf(np.ones(n, np.float32))) == n
    st = pf.stats()
    assert st["compiles"] == 4 and st["evictions"] == 2 and st["cache_size"] == 2


def test_jit_steady_path_counts_calls_and_follows_eviction():
    # the steady path (one array in, one exact output) must see new values every
    # call, count its calls, and stop using an evicted program
    pf = pm.jit(lambda x: jnp.sum(x * x), "n", buckets=B.exact(), cache_size=1)
    rng = np.random.default_rng(0)
    for kind in (np.asarray, jnp.asarray):
        for _ in range(5):
            x = kind(rng.normal(size=7).astype(np.float32))
            np.testing.assert_allclose(pf(x), np.sum(np.asarray(x) ** 2), rtol=1e-5)
    assert pf.stats()["calls"] == 10 and pf.stats()["compiles"] == 1
    pf(np.ones(3, np.float32))  # evicts the n = 7 program (cache_size=1)
    x = rng.normal(size=7).astype(np.float32)
    np.testing.assert_allclose(pf(x), np.sum(x ** 2), rtol=1e-5)
    st = pf.stats()
    assert st["calls"] == 12 and st["compiles"] == 3 and st["evictions"] == 2


@pytest.mark.parametrize("tiered", [True, False])
def test_evictions_count_programs_and_the_cache_keeps_its_size(tiered):
    """Every compiled program is either in the cache or counted as evicted
    (a bucket evicted while it compiled in the background was counted at
    eviction and then installed anyway, outside the cache: 23 evictions for
    21 compiles with cache_size=1)."""
    f = pm.jit(lambda x: jnp.cumsum(x) * 2, "n", cache_size=1, tiered=tiered)
    for _ in range(2):
        for n in (0, 1, 2, 5, 9, 17, 20, 33):
            x = np.arange(n, dtype=np.float32)
            np.testing.assert_allclose(f(x), np.cumsum(x) * 2)
    f.wait()
    st = f.stats()
    assert st["cache_size"] == 1
    assert st["evictions"] == st["compiles"] - 1
    assert sum(e.live for e in f.cache.entries()) == 1


def _in_threads(work, n: int) -> None:
    """``work(i)`` for i < n, each in its own thread, started together; the
    first exception a thread raised is raised here."""
    errors = []

    def guarded(i):
        try:
            work(i)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_jit_thread_safe_single_compile():
    pf = pm.jit(jnp.cumsum)
    results = {}

    def work(i):
        n = 3 + i % 5
        results[i] = (n, np.asarray(pf(np.ones(n, np.float32))))

    _in_threads(work, 12)
    for n, r in results.values():
        np.testing.assert_array_equal(r, np.arange(1, n + 1))
    assert pf.stats()["compiles"] == 1
    assert pf.stats()["calls"] == 12


def test_jit_accepts_jax_arrays_and_scalars():
    pf = pm.jit(lambda x, a: x * a, ("n", None))
    y = pf(jnp.arange(3.0), 2.0)
    np.testing.assert_array_equal(y, [0, 2, 4])
    y = pf(jnp.arange(8.0), 3.0)  # exactly at the bucket: passed through unpadded
    np.testing.assert_array_equal(y, np.arange(8.0) * 3)
    assert pf.stats()["compiles"] == 1


def test_jit_dict_in_specs_are_keyed_by_parameter_never_read_as_their_keys():
    x, w = np.ones((3, 4), np.float32), np.ones((4, 2), np.float32)
    f = pm.jit(lambda x, w: x @ w, {"x": "n, 4"})  # w: None, static
    assert f.in_specs == ("n, 4", None)
    np.testing.assert_array_equal(f(x, w), x @ w)
    assert pm.jit(lambda x, w: x @ w, {1: "4, m"}).in_specs == (None, "4, m")
    # a user's dict of specs for one dict argument: said how to write it
    with pytest.raises(pm.ShapeError, match=r"names 'a', which is not a positional parameter "
                       r".*in a tuple of one: in_specs=\(\{'a': 'n', 'b': 'm'\},\)"):
        pm.jit(lambda d: d["a"].sum() + d["b"].sum(), {"a": "n", "b": "m"})
    g = pm.jit(lambda d: d["a"].sum() + d["b"].sum(), ({"a": "n", "b": "m"},))
    assert float(g({"a": np.ones(3), "b": np.ones(5)})) == 8.0
    with pytest.raises(pm.ShapeError, match="ragged_map: in_specs is a dict"):
        pm.ragged_map(lambda d: d, {"a": "n"})


# Large inputs (64 KiB and up) are padded into host buffers the runner reuses
# (runners.hostio.HostPadBuffers): these shapes all fall in one bucket, so each
# call reuses a buffer that held another shape's values.
_LARGE_SHAPES = [(300, 200), (180, 240), (300, 250), (90, 60), (256, 256), (300, 200)]


def _integer_valued(rng, shape):  # exact float32 sums: any stale value shows
    return rng.integers(-3, 4, size=shape).astype(np.float32)


def test_jit_reused_padding_buffers_hold_no_earlier_values():
    rng = np.random.default_rng(5)
    total = pm.jit(lambda x: jnp.sum(x, axis=0), "n, m", buckets=[320], tiered=False)  # relies on 0 padding
    for shape in _LARGE_SHAPES * 2:
        x = _integer_valued(rng, shape)
        np.testing.assert_array_equal(total(x), x.sum(axis=0))
    assert total.stats()["compiles"] == 1


def test_jit_outputs_that_share_memory_with_a_padded_input_are_never_overwritten():
    rng = np.random.default_rng(6)
    for numpy_outputs in (False, True):
        ident = pm.jit(lambda x: x, "n", buckets=[32768], tiered=False, numpy_outputs=numpy_outputs)
        pairs = []
        for n in (20000, 30000, 25000, 32000, 20000):
            x = _integer_valued(rng, (n,))
            pairs.append((x.copy(), ident(x)))
        for x, y in pairs:
            np.testing.assert_array_equal(np.asarray(y), x)


def test_jit_never_refills_a_padding_buffer_a_dispatched_program_still_reads():
    rng = np.random.default_rng(7)
    # calls not waited for: where dispatch is asynchronous, a program may still
    # read its padded input when the next call pads (values only are asserted)
    gram = pm.jit(lambda x: jnp.sum(jnp.tanh(x @ x.T) @ x, axis=0), "n, m", buckets=[384],
                  tiered=False)
    xs = [rng.normal(size=(380, 300)).astype(np.float32) for _ in range(4)]
    for x in xs:
        gram(x)  # compile, warm
    outs = [gram(x) for x in xs]  # not waited for between calls
    for x, y in zip(xs, outs):
        np.testing.assert_allclose(y, np.sum(np.tanh(x @ x.T) @ x, axis=0), rtol=2e-3, atol=2e-2)


def test_padding_buffer_pool_keeps_its_byte_bound_least_recent_shapes_first():
    from polymask.runners.hostio import HostPadBuffers

    rng = np.random.default_rng(8)
    pool = HostPadBuffers(max_bytes=3 * 2**20)
    bounds = [(512, 512 + 8 * k) for k in range(4)]  # float32: 1 MiB and a little more
    for rounds in range(3):
        for bound in bounds:
            x = _integer_valued(rng, (500 - rounds, 500))
            out = pool.padder(bound, np.float32)(x, (slice(0, x.shape[0]), slice(0, 500)))
            np.testing.assert_array_equal(out[:x.shape[0], :500], x)
            assert not out[x.shape[0]:].any() and not out[:, 500:].any()
            assert pool.pooled_bytes <= pool.max_bytes
    # the two most recent shapes (a third would pass 3 MiB)
    assert [b for b, _ in pool._slots] == [(512, 528), (512, 536)]
    huge = pool.padder((1024, 1024), np.float32)  # larger than the bound: fresh each call
    huge(np.ones((3, 3), np.float32), (slice(0, 3), slice(0, 3)))
    assert pool.pooled_bytes <= pool.max_bytes


def test_jit_reused_padding_buffers_across_threads():
    total = pm.jit(lambda x: jnp.sum(x, axis=0), "n, m", buckets=[320], tiered=False)

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(15):
            shape = _LARGE_SHAPES[rng.integers(len(_LARGE_SHAPES))]
            x = _integer_valued(rng, shape)
            np.testing.assert_array_equal(total(x), x.sum(axis=0))

    _in_threads(work, 6)


# Small inputs (under 64 KiB) on XLA:CPU are written into host buffers that a
# jax.Array aliases (runners.hostio.AliasedPadBuffers): a later call writes the
# same memory, so every test below checks that no earlier output changes and
# no later call sees an earlier value.
_ALIASES = jax.default_backend() == "cpu"


def _aliased_keys(runner):
    return {key: slots for key, slots in runner._aliased._slots.items()}


def test_jit_small_inputs_in_reused_aliased_buffers_hold_no_earlier_values():
    rng = np.random.default_rng(15)
    total = pm.jit(lambda x: jnp.sum(x, axis=0), "n, m", buckets=[16], tiered=False)
    shapes = [(13, 7), (9, 11), (16, 3), (2, 16), (13, 7), (5, 5), (16, 16), (1, 1)] * 2
    pairs = []
    for k, shape in enumerate(shapes):
        x = _integer_valued(rng, shape)
        pairs.append((x.sum(axis=0), total(x if k % 2 else jnp.asarray(x))))
    for want, got in pairs:  # (each output after every later call)
        np.testing.assert_array_equal(got, want)
    assert total.stats()["compiles"] == 1
    if _ALIASES:  # one bucket shape, its buffers in use
        assert [bool(slots) for slots in _aliased_keys(total).values()] == [True]


@pytest.mark.parametrize("numpy_outputs", [False, True])
def test_jit_outputs_forwarded_from_an_aliased_buffer_are_copies(numpy_outputs):
    rng = np.random.default_rng(16)
    ident = pm.jit(lambda x: x, "n", buckets=[16], tiered=False, numpy_outputs=numpy_outputs)
    both = pm.jit(lambda x: (x, jnp.sum(x)), "n", buckets=[16], tiered=False,
                  numpy_outputs=numpy_outputs)
    pairs = []
    for n in (5, 9, 16, 12, 1, 5, 15, 9):
        x = _integer_valued(rng, (n,))
        pairs.append((x.copy(), ident(x), both(jnp.asarray(x))))
    for x, y, (z, s) in pairs:
        np.testing.assert_array_equal(np.asarray(y), x)
        np.testing.assert_array_equal(np.asarray(z), x)
        assert float(s) == x.sum()


def test_jit_never_refills_an_aliased_buffer_a_dispatched_program_still_reads():
    # an exact (scalar) output is handed back without waiting: where dispatch
    # is asynchronous, the next call finds the buffer still read
    def slow(x):
        m = jnp.outer(x, x) / (1 + x.shape[0])
        v = jax.lax.fori_loop(0, 4000, lambda i, v: jnp.tanh(m @ v + v), x)
        return jnp.sum(v * x)  # x is read again after the loop: a late overwrite shows

    rng = np.random.default_rng(17)
    run = pm.jit(slow, "n", buckets=[128], tiered=False)
    plain = jax.jit(slow)
    xs = [rng.normal(size=100 + k % 2).astype(np.float32) for k in range(8)]
    jax.block_until_ready([run(xs[0]), run(xs[1])])  # (a new shape's first call pads NumPy)
    outs = [run(x) for x in xs]  # not waited for between calls
    for x, y in zip(xs, outs):
        np.testing.assert_allclose(y, plain(x), rtol=1e-5, atol=1e-6)


def test_an_aliased_buffer_returned_as_it_is_is_handed_out_as_a_copy():
    # (JAX may return an unchanged input as it is; the buffer is rewritten later)
    from polymask.runners.hostio import AliasedPadBuffers

    if not _ALIASES:
        pytest.skip("aliased buffers are XLA:CPU's")
    pool = AliasedPadBuffers()
    padded_numpy = []

    def pad(a):
        padded_numpy.append(a)
        return np.concatenate([a, np.zeros(4 - len(a), a.dtype)])

    sizes = jnp.asarray([3], jnp.int32)
    run = pool.runner((4,), np.float32, (3,), pad, sizes)
    made = jnp.ones(2)
    seen = []

    def forwards(arr, sizes):  # returns its input as it is, and an array it made
        seen.append(arr)
        return [arr, [made]]

    out = run(forwards, np.float32([1.0, 2.0, 3.0]))
    assert isinstance(seen[0], jax.Array) and not padded_numpy  # the aliased buffer
    assert out[0] is not seen[0] and out[1][0] is made
    again = run(forwards, np.float32([7.0, 8.0, 9.0]))  # ``made`` is ready: rewritten
    np.testing.assert_array_equal(out[0], [1.0, 2.0, 3.0, 0.0])  # the copy kept its values
    np.testing.assert_array_equal(again[0], [7.0, 8.0, 9.0, 0.0])
    assert seen[1] is seen[0]
    run(lambda arr, sizes: [arr], np.float32([4.0, 5.0, 6.0]))  # nothing made tells
    run(forwards, np.float32([1.0, 1.0, 1.0]))  # when it ended: given up, NumPy this time
    assert len(padded_numpy) == 1
    run(forwards, np.float32([2.0, 2.0, 2.0]))
    assert seen[-1] is not seen[0] and isinstance(seen[-1], jax.Array)  # a fresh buffer


def test_jit_aliased_buffers_whose_reader_is_deleted_or_donated_are_given_up():
    rng = np.random.default_rng(18)
    norm = pm.jit(lambda x: jnp.sum(x * x), "n", buckets=[8], tiered=False)
    donate = jax.jit(lambda v: v + 1, donate_argnums=0)
    for k in range(12):
        x = _integer_valued(rng, (7,))
        y = norm(x)
        assert float(y) == float((x * x).sum())
        y.delete() if k % 2 else donate(y)  # when y was made can no longer be asked
    if _ALIASES:  # after a few such losses the bucket shape pads NumPy arrays
        assert list(_aliased_keys(norm).values()) == [None]
    x = _integer_valued(rng, (5,))
    assert float(norm(x)) == float((x * x).sum())


def test_jit_aliased_buffers_forgotten_by_clear_cache_are_never_written_again():
    # a steady-state call keeps the slot it found; once the runner forgets the
    # slot (clear_cache), the call finds a fresh one: the old buffer keeps its values
    total = pm.jit(lambda x: jnp.sum(x * 2), "n", buckets=[8], tiered=False)
    x = np.float32([1, 2, 3, 4, 5])
    for _ in range(3):
        assert float(total(jnp.asarray(x))) == 30.0
    if not _ALIASES:
        pytest.skip("aliased buffers are XLA:CPU's")
    (old,) = _aliased_keys(total).values()
    old_buffer = old.view
    old_view = old_buffer.copy()
    total.clear_cache()
    # the forgotten slot keeps no memory alive (buffers and last output released)
    assert old.view is None and old.array is None and old.reader is None
    for k in range(3):
        y = np.float32([k, k, k])
        assert float(total(jnp.asarray(y))) == 6.0 * k
    np.testing.assert_array_equal(old_buffer, old_view)
    assert not old.kept and all(s is not old for s in _aliased_keys(total).values())


def test_jit_aliased_buffers_across_threads():
    total = pm.jit(lambda x: jnp.sort(x, axis=0) * 3 + jnp.sum(x), "n, m", buckets=[32],
                   tiered=False)

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(40):
            x = _integer_valued(rng, (int(rng.integers(1, 33)), 3))
            y = total(x if rng.random() < 0.5 else jnp.asarray(x))
            np.testing.assert_array_equal(y, np.sort(x, axis=0) * 3 + x.sum())

    _in_threads(work, 4)


# ----------------------------------------------------------------------------
# ragged_map
# ----------------------------------------------------------------------------
def test_ragged_map_matches_per_example():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(3, 2)).astype(np.float32)

    def f(w, x):
        return jnp.tanh(x @ w).mean(0), x.shape[0] * jnp.ones(())

    rm = pm.ragged_map(f, ("n, 3",), batch_size=4)
    sizes = [1, 2, 5, 9, 3, 4, 17, 0, 8, 8, 8, 8, 8]
    exs = [rng.normal(size=(n, 3)).astype(np.float32) for n in sizes]
    outs = rm(exs, w)
    assert len(outs) == len(exs)
    for e, (m, c) in zip(exs, outs):
        if e.shape[0]:
            np.testing.assert_allclose(m, np.tanh(e @ w).mean(0), rtol=1e-5, atol=1e-6)
        assert float(c) == e.shape[0]
    st = rm.stats()
    assert st["compiles"] <= 6
    outs2 = rm(exs, w)  # second pass: no new compiles
    assert rm.stats()["compiles"] == st["compiles"]
    for a, b in zip(outs, outs2):
        np.testing.assert_array_equal(a[1], b[1])


def _sorted_batch_programs(sizes, policy, rows):
    """(bucket, rows) of each program ragged_map runs: sizes sorted largest
    first, cut into batches of ``rows``, each padded to its longest's bucket; a
    partial final batch runs in the full program of its bucket when another
    batch uses it, else in the power of two of rows that holds it."""
    desc, chunks, i = sorted(sizes, reverse=True), [], 0
    rows_of = rows if callable(rows) else (lambda bucket: rows)
    while i < len(desc):
        r = rows_of(policy(desc[i]))
        chunks.append((desc[i:i + r], r))
        i += r
    full = {policy(c[0]) for c, r in chunks if len(c) == r}
    return {(policy(c[0]), r if len(c) == r or policy(c[0]) in full
             else 1 << (len(c) - 1).bit_length()) for c, r in chunks}


@pytest.mark.parametrize("ahead", [True, False])
def test_ragged_map_compile_ahead_compiles_each_program_once(ahead, monkeypatch):
    from polymask.runners import ragged

    rng = np.random.default_rng(2)
    queued = []  # programs handed to the background compiler (which thread wins is timing)
    real = ragged.background_executor

    class Counting:
        def submit(self, fn, *a):
            queued.append(fn)
            return real().submit(fn, *a)

    monkeypatch.setattr(ragged, "background_executor", Counting)

    def f(x):
        return jnp.cumsum(x, axis=0)[-1] * 2.0 if x.shape[0] else jnp.zeros(3)

    rm = pm.ragged_map(f, ("n, 3",), buckets=B.pow2(2), batch_size=4, compile_ahead=ahead, layout="padded")
    sizes = [1, 2, 3, 5, 7, 9, 16, 30, 2, 6, 12]
    exs = [rng.normal(size=(n, 3)).astype(np.float32) for n in sizes]
    outs = rm(exs)
    for e, o in zip(exs, outs):
        np.testing.assert_allclose(o, e.sum(0) * 2.0, rtol=1e-5, atol=1e-5)
    rm.wait()
    st = rm.stats()
    groups = len(_sorted_batch_programs(sizes, B.pow2(2), 4))
    assert groups == 3
    assert st["compiles"] == groups, st
    # every program but the first batch's is queued ahead; the main thread
    # compiles a queued one itself when it gets there first (the entry lock)
    assert len(queued) == (groups - 1 if ahead else 0)
    assert st["background_compiles"] <= len(queued)
    assert st["cache_size"] == groups
    rm(exs)
    assert rm.stats()["compiles"] == groups


def test_stats_cache_size_counts_compiled_programs_only():
    rm = pm.ragged_map(lambda x: x * 2, ("n",), buckets=B.pow2(4), batch_size=2)
    rm.cache.entry(("a queued program",), hit=False)  # created, not compiled yet
    assert rm.stats()["cache_size"] == 0
    outs = rm([np.ones(3, np.float32)])
    np.testing.assert_allclose(outs[0], 2 * np.ones(3))
    assert rm.stats()["cache_size"] == 1


def test_ragged_map_auto_specs_and_ragged_outputs():
    rm = pm.ragged_map(lambda x: jnp.cumsum(x, axis=0) * 2, batch_size=3)
    exs = [np.arange(n * 2, dtype=np.float32).reshape(n, 2) for n in (1, 4, 2, 6, 3)]
    outs = rm(exs, progress=False)
    for e, o in zip(exs, outs):
        assert o.shape == e.shape
        np.testing.assert_allclose(o, np.cumsum(e, 0) * 2)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_ragged_map_auto_specs_give_axes_of_equal_sizes_one_dim_var(layout):
    # x of (n, 16) and y of (n,): one dim var, so x @ W - y traces as on each
    # example (two dim vars ran per exact shape in the padded layout, and the
    # packed layout refused them)
    rng = np.random.default_rng(8)
    w = _integer_valued(rng, (16, 4))

    def residual(x, y):
        return (x @ w).sum(-1) - y

    exs = [(_integer_valued(rng, (n, 16)), _integer_valued(rng, (n,))) for n in (1, 4, 2, 7, 3)]
    rm = pm.ragged_map(residual, layout=layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        outs = rm(exs)
    for (x, y), o in zip(exs, outs):
        np.testing.assert_array_equal(o, residual(x, y))
    assert rm.stats()["exact_compiles"] == 0


@pytest.mark.parametrize("layout", ["auto", "padded"])
def test_ragged_map_auto_specs_relate_an_axis_one_longer(layout):
    """``r + v[1:]`` with ``v`` one longer than ``r`` in every example: two dim
    vars compiled one program per exact shape (6 for 6 lengths, a fallback
    warning naming ``l0_0``); the axes are now ``l0_0`` and ``l0_0 + 1``, in
    either argument order, as polymask.jit finds by tracing."""
    from polymask.runners.ragged_batches import auto_specs

    assert auto_specs([(np.zeros(3), np.zeros(4)), (np.zeros(5), np.zeros(6))]) == (
        "l0_0", "l0_0 + 1")
    assert auto_specs([(np.zeros(4), np.zeros(3)), (np.zeros(6), np.zeros(5))]) == (
        "l1_0 + 1", "l1_0")
    # one example, or sizes that do not vary together: no relation read off
    assert auto_specs([(np.zeros(3), np.zeros(4))], leading_if_uniform=True) == ("l0_0", "l1_0")
    assert auto_specs([(np.zeros(3), np.zeros(4)), (np.zeros(5), np.zeros(7))]) == (
        "l0_0", "l1_0")
    rng = np.random.default_rng(3)
    exs = [(_integer_valued(rng, (n,)), _integer_valued(rng, (n + 1,))) for n in range(3, 9)]
    for fun, order in ((lambda r, v: r + v[1:], lambda e: e),
                       (lambda v, r: r * v[:-1], lambda e: e[::-1])):
        rm = pm.ragged_map(fun, layout=layout)
        with warnings.catch_warnings():
            warnings.simplefilter("error", pm.FallbackWarning)
            outs = rm([order(e) for e in exs])
        for e, o in zip(exs, outs):
            np.testing.assert_array_equal(o, fun(*order(e)))
        assert rm.stats()["exact_compiles"] == 0


def test_ragged_map_tuple_examples_and_progress(capsys):
    rm = pm.ragged_map(lambda x, y: jnp.sum(x) * jnp.sum(y), ("n", "m"), batch_size=2,
                       progress=True, numpy_outputs=True)
    exs = [(np.ones(a, np.float32), np.ones(b, np.float32)) for a, b in
           [(1, 2), (3, 1), (2, 2), (5, 3)]]
    outs = rm(exs)
    assert [float(o) for o in outs] == [2.0, 3.0, 4.0, 15.0]
    assert rm([]) == []


def test_jit_data_dependent_output_size():
    pf = pm.jit(lambda x: x[pm.nonzero(x)] * 2, "n")
    np.testing.assert_array_equal(pf(np.array([0, 5, 0, 6, 0, 7], np.float32)), [10, 12, 14])
    assert pf(np.zeros(5, np.float32)).shape == (0,)
    assert pf(np.ones(3, np.float32)).shape == (3,)
    assert pf.stats()["compiles"] == 1


def test_jit_output_shapes_from_host_expressions():
    pf = pm.jit(lambda x, y: (jnp.concatenate([x, y, x]), x[::2]), ("n", "m"))
    a, b = pf(np.arange(3, dtype=np.float32), np.ones(2, np.float32))
    np.testing.assert_array_equal(a, [0, 1, 2, 1, 1, 0, 1, 2])
    np.testing.assert_array_equal(b, [0, 2])
    a, b = pf(np.arange(4, dtype=np.float32), np.ones(1, np.float32))
    assert a.shape == (9,) and b.shape == (2,)


def test_jit_unpadding_compiles_nothing_per_length():
    """Outputs are sliced on the host: no program per output length, all compiles counted."""
    pf = pm.jit(lambda x: x * 3, "n", buckets=B.pow2(16))
    with pm.compile_counter() as cc:
        for _ in range(3):
            for n in range(1, 17):
                xn = np.arange(n, dtype=np.float32)
                for x in (xn, jax.device_put(xn)):  # device_put: no compile
                    y = pf(x)
                    assert isinstance(y, jax.Array) and y.shape == (n,)
                    np.testing.assert_array_equal(y, np.arange(n) * 3)
    st = pf.stats()
    assert st["compiles"] == 1 and "slice_compiles" not in st  # the dead stat is gone
    assert cc.compiles == st["xla_compiles"] >= 1  # every XLA compile is in stats()
    with pm.compile_counter() as cc2:
        pf(np.arange(7, dtype=np.float32))
    assert cc2.compiles == 0


def test_jit_precompile_then_no_compile_on_call():
    pf = pm.jit(lambda w, x: jnp.tanh(x @ w), (None, "n, 4"), buckets=B.pow2(8))
    w = np.ones((4, 2), np.float32)
    pf.precompile(w, jax.ShapeDtypeStruct((16, 4), jnp.float32))
    st = pf.stats()
    assert st["compiles"] == 1 and st["precompiles"] == 1 and st["calls"] == 0
    with pm.compile_counter() as cc:
        for n in (9, 12, 16):
            x = np.random.default_rng(n).normal(size=(n, 4)).astype(np.float32)
            np.testing.assert_allclose(pf(w, x), np.tanh(x @ w), rtol=1e-5, atol=1e-6)
    assert cc.compiles == 0 and pf.stats()["compiles"] == 1


def test_jit_tiered_buckets_serve_then_switch():
    traces = []

    def f(x):
        traces.append(x.shape)
        return jnp.cumsum(x) + jnp.max(x)

    pf = pm.jit(f, "n", buckets=B.pow2(4, headroom=1), tiered=True)  # no headroom bucket
    big = np.arange(60, dtype=np.float32)
    np.testing.assert_allclose(pf(big), np.cumsum(big) + big.max())  # bucket 64, foreground
    for n in (3, 5, 9, 17, 33, 2, 6):
        x = np.arange(n, dtype=np.float32)[::-1].copy()
        np.testing.assert_allclose(pf(x), np.cumsum(x) + x.max())  # served at once
    assert pf.stats()["tiered_calls"] >= 1
    pf.wait()
    st = pf.stats()
    assert st["compiles"] == 1 + 4  # 64 in the foreground; 4, 8, 16, 32 in the background
    assert st["background_compiles"] == 4
    tiered = st["tiered_calls"]
    for n in (3, 5, 9, 17, 33):
        x = np.arange(n, dtype=np.float32)
        np.testing.assert_allclose(pf(x), np.cumsum(x) + x.max())
    assert pf.stats()["tiered_calls"] == tiered  # tight buckets now
    assert pf.stats()["compiles"] == 5


def test_jit_tiered_compiles_the_largest_bucket_first():
    # with a largest bucket, a first pass over many sizes costs one foreground compile
    pf = pm.jit(lambda x: jnp.cumsum(x) * 2.0, "n", buckets=B.pow2(4, maximum=64), tiered=True)
    for n in (3, 40, 9, 0, 64, 17):
        x = np.arange(n, dtype=np.float32)
        np.testing.assert_allclose(pf(x), np.cumsum(x) * 2.0)
    st = pf.stats()
    assert st["compiles"] - st["background_compiles"] == 1  # bucket 64
    assert st["calls"] - st["cache_hits"] == 1 and st["tiered_calls"] >= 1
    pf.wait()
    st = pf.stats()
    assert st["compiles"] == 4 and st["background_compiles"] == 3  # 4, 16 and 32
    tiered = st["tiered_calls"]
    for n in (3, 9, 17):
        x = np.arange(n, dtype=np.float32)
        np.testing.assert_allclose(pf(x), np.cumsum(x) * 2.0)
    assert pf.stats()["tiered_calls"] == tiered  # tight buckets now
    with pytest.raises(pm.ShapeError, match="largest bucket 64"):
        pf(np.ones(65, np.float32))


def test_policy_headroom():
    assert B.pow2().headroom == 16 and B.multiple(4).headroom == 16
    assert B.pow2(8, headroom=1).headroom == 1 and B.exact().headroom == 1
    assert B.explicit([4, 8]).headroom == 1 and B.as_policy(None).headroom == 16
    assert repr(B.pow2()) == "pow2(minimum=8)"
    assert repr(B.pow2(4, headroom=2)) == "pow2(minimum=4, headroom=2)"
    assert repr(B.multiple(4, headroom=1)) == "multiple(4, headroom=1)"
    with pytest.raises(ValueError, match="headroom"):
        B.pow2(headroom=0)
    with pytest.raises(TypeError, match="headroom"):
        B.multiple(4, headroom=2.0)


def _plain(f, x):
    return np.asarray(jax.jit(f)(x))


def test_jit_default_policy_compiles_a_headroom_bucket_first():
    # (integer values: every sum is exact, padded or not)
    # the default pow2(): the first size (5, bucket 8) gets bucket 8 * 16 = 128 in the
    # foreground; larger sizes within it run at once while their own buckets compile
    # in the background
    def f(x):
        return jnp.cumsum(x, axis=0) * 2.0 + jnp.sum(x)

    pf = pm.jit(f, "n, 3", tiered=True)
    rng = np.random.default_rng(0)
    xs = {n: rng.integers(-9, 9, size=(n, 3)).astype(np.float32) for n in (5, 40, 100, 0, 128)}
    np.testing.assert_array_equal(pf(xs[5]), _plain(f, xs[5]))
    st = pf.stats()
    assert st["compiles"] - st["background_compiles"] == 1 and st["tiered_calls"] == 1
    assert {e.buckets["n"] for e in pf.cache.entries() if e.live} >= {128}
    for n in (40, 100, 0, 128):  # within the headroom: no foreground compile
        np.testing.assert_array_equal(pf(xs[n]), _plain(f, xs[n]))
    st = pf.stats()
    assert st["calls"] == 5 and st["calls"] - st["cache_hits"] == 1
    assert st["compiles"] - st["background_compiles"] == 1
    pf.wait()
    st = pf.stats()
    assert st["compiles"] == 3 and st["background_compiles"] == 2  # 128; then 8 and 64
    tiered = st["tiered_calls"]
    for n in (5, 40, 0):  # the steady state: tight buckets
        np.testing.assert_array_equal(pf(xs[n]), _plain(f, xs[n]))
    assert pf.stats()["tiered_calls"] == tiered
    # a size past every compiled bucket gets a headroom bucket of its own: 300 -> 512 * 16,
    # halved to 4096 (8192 rows of 3 float32 are over the 64 KiB budget; 4096 are 48 KiB)
    x = rng.integers(-9, 9, size=(300, 3)).astype(np.float32)
    np.testing.assert_array_equal(pf(x), _plain(f, x))
    st = pf.stats()
    assert st["calls"] - st["cache_hits"] == 2
    assert max(e.buckets["n"] for e in pf.cache.entries() if e.live) == 4096
    pf.wait()
    np.testing.assert_array_equal(pf(x), _plain(f, x))
    assert pf.stats()["compiles"] == 5  # + 4096 (foreground) and 512


def test_jit_headroom_is_capped_by_bytes_and_constraints():
    f = lambda x: jnp.sum(x, axis=0)
    # rows of 1024 float32 (4 KiB): at most HEADROOM_BYTES_CPU (64 KiB) = 16 rows
    from polymask.runners import tiering

    pf = pm.jit(f, "n, 1024", tiered=True)
    plan = pf.plans.plan((np.ones((3, 1024), np.float32),))[0]
    assert plan.buckets == {"n": 8}
    assert pf.tiering.first_buckets(plan) == {"n": tiering.HEADROOM_BYTES_CPU // 4096}
    x = np.ones((3, 1024), np.float16)  # half the bytes per row: 32 rows
    assert pf.tiering.first_buckets(pf.plans.plan((x,))[0]) == {"n": 32}
    # a size whose own bucket is over the budget gets no headroom
    assert pf.tiering.first_buckets(pf.plans.plan((np.ones((20, 1024), np.float32),))[0]) \
        is None
    # an upper bound from the constraints caps it: n <= 20 gives the bucket of 20
    pc = pm.jit(f, "n, 2", constraints=("n <= 20",), tiered=True)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert pc.tiering.first_buckets(pc.plans.plan((x,))[0]) == {"n": 32}
    np.testing.assert_allclose(pc(x), _plain(f, x))
    for n in (12, 20):  # 12 runs in bucket 32 (its own is 16), 20 in its own (32)
        xn = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
        np.testing.assert_allclose(pc(xn), _plain(f, xn))
    st = pc.stats()
    assert st["calls"] - st["cache_hits"] == 1 and st["tiered_calls"] == 2
    pc.wait()
    # headroom=1, exact() and a plain callable: the call's own bucket, as before
    for buckets in (B.pow2(8, headroom=1), B.exact(), lambda n: max(n, 1)):
        pn = pm.jit(f, "n, 2", buckets=buckets, tiered=True)
        assert pn.tiering.first_buckets(pn.plans.plan((x,))[0]) is None
    # two dim vars: each gets headroom while the padded inputs fit the budget
    g = lambda a, b: jnp.sum(a) + jnp.sum(b)
    p2 = pm.jit(g, ("n", "m"), tiered=True)
    args = (np.ones(3, np.float32), np.ones(30, np.float32))
    assert p2.tiering.first_buckets(p2.plans.plan(args)[0]) == {"n": 128, "m": 512}
    # a largest bucket still wins for its dim var
    p3 = pm.jit(g, ("n", "m"), buckets={"n": B.pow2(8, maximum=64), None: B.pow2()},
                tiered=True)
    assert p3.tiering.first_buckets(p3.plans.plan(args)[0]) == {"n": 64, "m": 512}
    assert float(p3(*args)) == 33.0
    # ... capped by a constraint's upper bound too (it raised ShapeError at n = 64 before)
    p4 = pm.jit(jnp.sum, "n", buckets=B.pow2(8, maximum=64), constraints=("n <= 20",),
                tiered=True)
    assert float(p4(np.ones(3, np.float32))) == 3.0
    assert [e.buckets for e in p4.cache.entries() if e.live] == [{"n": 32}]


def test_jit_headroom_bucket_that_cannot_trace_falls_back_to_the_own_bucket():
    # a size used as a Python int is traced per size up to a bucket of 2 * max_cases
    # (32): bucket 3 traces (4 sizes: one program, PER_SIZE_SHARED_MAX), the
    # covering bucket 64 does not (a larger bucket of such cases runs per exact
    # shape: test_fallback.py::test_a_bucket_whose_every_size_is_a_case_runs_per_exact_shape)
    def f(x):
        return sum(x[i] * i for i in range(x.shape[0])) + jnp.zeros(())

    pf = pm.jit(f, "n", tiered=True, buckets=pm.buckets.explicit([3, 64]))
    assert float(pf(np.arange(3, dtype=np.float32))) == 5.0
    st = pf.stats()
    assert st["compiles"] == 1 and st["tiered_calls"] == 0 and pf.tiering.first_sizes(
        pf.plans.plan((np.ones(3, np.float32),))[0]) is None  # off for this runner
    assert float(pf(np.arange(2, dtype=np.float32))) == 1.0
    # bucket 64 cannot trace per size: its sizes run per exact shape, as jax.jit
    with pytest.warns(pm.FallbackWarning, match=r"(?s)n <= 64.*Python int"):
        assert float(pf(np.arange(50, dtype=np.float32))) == float(f(np.arange(50.0)))
    assert pf.stats()["exact_compiles"] == 1 and list(pf.fallbacks()) == ["n <= 64"]


def test_jit_deferred_background_compiles_still_run_without_wait():
    # background compiles yield to a burst of calls, but start once calls pause
    pf = pm.jit(lambda x: x * 2.0, "n", tiered=True)
    for n in (3, 20, 9):
        np.testing.assert_allclose(pf(np.ones(n, np.float32)), np.full(n, 2.0))
    assert pf.stats()["compiles"] - pf.stats()["background_compiles"] == 1
    eventually(lambda: pf.stats()["background_compiles"] >= 3, "the deferred compiles ran")
    assert pf.stats()["background_compiles"] == 3  # 8, 16, 32 (128 in the foreground)
    pf.wait()


def test_jit_repeated_shape_starts_its_deferred_compile(monkeypatch):
    # deferred compiles that would never start by themselves (no pause, no deadline):
    # calling a shape again while it waits for its bucket starts that compile
    from polymask.runners import compiling

    monkeypatch.setattr(compiling, "YIELD_QUIET_S", 1e6)
    monkeypatch.setattr(compiling, "YIELD_MAX_S", 1e6)
    pf = pm.jit(lambda x: x + 1.0, "n", tiered=True)
    for n in (5, 20):  # 128 in the foreground; 8 and 32 deferred
        np.testing.assert_array_equal(pf(np.zeros(n, np.float32)), np.ones(n))
    assert pf.stats()["background_compiles"] == 0
    np.testing.assert_array_equal(pf(np.zeros(5, np.float32)), np.ones(5))  # again: urged
    eventually(lambda: pf.stats()["background_compiles"] >= 1, "the urged compile ran")
    assert pf.stats()["background_compiles"] == 1  # bucket 8; 32 still waits
    pf.wait()  # starts the rest
    assert pf.stats()["background_compiles"] == 2 and pf.stats()["compiles"] == 3


def test_jit_tiered_off_compiles_in_foreground():
    pf = pm.jit(jnp.sum, "n", buckets=B.pow2(4), tiered=False)
    pf(np.ones(30, np.float32))
    pf(np.ones(3, np.float32))
    st = pf.stats()
    assert st["compiles"] == 2 and st["tiered_calls"] == 0 and st["background_compiles"] == 0


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_persistent_compilation_cache_writes_files(tmp_path):
    d = tmp_path / "xla"
    prev = pm.enable_compilation_cache(d)
    try:
        pf = pm.jit(lambda x: jnp.sin(x) * 7 + 0.125, "n", buckets=B.fixed(48))
        np.testing.assert_allclose(pf(np.ones(5, np.float32)), np.sin(np.ones(5)) * 7 + 0.125,
                                   rtol=1e-6)
        assert any(p.is_file() for p in d.rglob("*"))
        jax.clear_caches()  # as a new process would: the program comes from disk
        pf2 = pm.jit(lambda x: jnp.sin(x) * 7 + 0.125, "n", buckets=B.fixed(48))
        pf2(np.ones(6, np.float32))
        st = pf2.stats()
        assert st["persistent_cache_hits"] >= 1 and st["xla_compiles"] == 0
    finally:
        pm.disable_compilation_cache(prev)


def test_ragged_map_sorted_batches_keep_input_order_and_no_partial_compiles():
    rng = np.random.default_rng(3)
    sizes = [int(n) for n in rng.integers(1, 30, size=37)]
    exs = [rng.normal(size=n).astype(np.float32) for n in sizes]
    rm = pm.ragged_map(lambda x: (jnp.sum(x), x.shape[0] * jnp.ones(())), "n",
                       buckets=B.pow2(8), batch_size=4, numpy_outputs=True, layout="padded")
    outs = rm(exs)
    for e, (s, n) in zip(exs, outs):  # input order
        assert float(n) == e.shape[0]
        np.testing.assert_allclose(s, e.sum(), rtol=1e-5, atol=1e-5)
    programs = _sorted_batch_programs(sizes, B.pow2(8), 4)
    assert {r for _, r in programs} == {4}  # the partial final batch: full-batch program
    assert rm.stats()["compiles"] == len(programs)
    tok = pm.ragged_map(lambda x: jnp.sum(x), "n", buckets=B.pow2(8), batch_tokens=256,
                        numpy_outputs=True, layout="padded")
    for e, s in zip(exs, tok(exs)):
        np.testing.assert_allclose(s, e.sum(), rtol=1e-5, atol=1e-5)
    assert tok.stats()["compiles"] == len(_sorted_batch_programs(sizes, B.pow2(8),
                                                                lambda b: 256 // b))
    assert tok.stats()["calls"] < rm.stats()["calls"]  # 32 rows of 8, 16 of 16, 8 of 32


def test_ragged_map_precompile():
    rm = pm.ragged_map(lambda w, x: jnp.tanh(x @ w).sum(0), ("n, 3",), buckets=B.pow2(8),
                       batch_size=4, numpy_outputs=True)
    w = np.ones((3, 2), np.float32)
    rm.precompile(jax.ShapeDtypeStruct((8, 3), jnp.float32), w)
    assert rm.stats()["compiles"] == 1
    exs = [np.full((n, 3), 0.1, np.float32) for n in (1, 5, 8, 3, 2)]
    with pm.compile_counter() as cc:
        outs = rm(exs, w)
    assert cc.compiles == 0 and rm.stats()["compiles"] == 1
    for e, o in zip(exs, outs):
        np.testing.assert_allclose(o, np.tanh(e @ w).sum(0), rtol=1e-5)


def test_jit_takes_jax_jits_arguments_and_ahead_of_time_methods():
    x = np.arange(5.0, dtype=np.float32)
    f = pm.jit(lambda x, k: jnp.sum(x) * k, static_argnums=1, donate_argnums=0,
               keep_unused=True, inline=True)
    plain = jax.jit(lambda x, k: jnp.sum(x) * k, static_argnums=1)
    assert float(f(x, 2)) == 20.0 and x[4] == 4.0  # nothing donated: x stays valid
    struct = jax.ShapeDtypeStruct((7,), jnp.float32)
    assert f.eval_shape(struct, k=3) == plain.eval_shape(struct, 3)
    assert float(f.lower(x, 2).compile()(x)) == 20.0  # jax.jit's program for x's shape
    assert str(f.trace(x, 2).jaxpr) == str(plain.trace(x, 2).jaxpr)
    bounded = pm.jit(lambda x: x, "n", buckets=[8])
    for method in (bounded.eval_shape, bounded.lower, bounded.trace):
        with pytest.raises(pm.ShapeError, match="largest bucket 8"):
            method(np.ones(9, np.float32))
    # a donated position or name fun does not take, or also static: jax.jit's error
    for bad in ({"donate_argnums": 3}, {"donate_argnames": "y"},
                {"donate_argnums": 0, "static_argnums": 0}):
        with pytest.raises(ValueError) as plain_error:
            jax.jit(lambda x: x, **bad)
        with pytest.raises(ValueError) as ours:
            pm.jit(lambda x: x, **bad)
        assert str(ours.value) == str(plain_error.value)
    for option in ("in_shardings", "out_shardings", "device", "backend"):
        value = "cpu" if option == "backend" else jax.devices()[0]
        with pytest.raises(NotImplementedError, match=r"polymask.mask\(f, in_specs\), in_sh"):
            pm.jit(lambda x: x, **{option: value})


def test_runners_follow_jax_default_device_as_jax_jit_of_numpy_inputs():
    script = textwrap.dedent("""
        import numpy as np, jax, jax.numpy as jnp, polymask as pm
        total, double = pm.jit(lambda x: jnp.sum(x * x), "n"), pm.jit(lambda x: x * 2, "n")
        each = pm.ragged_map(lambda x: x.sum(), ("n",))
        x = np.ones(5, np.float32)
        for _ in range(3):  # (first calls, then the steady state)
            total(x), double(x)
        with jax.default_device(jax.devices()[1]):
            outs = [total(x), double(x), *each([x, x[:3]])]
            print(sorted({d.id for o in outs for d in o.devices()}))
        print(sorted({d.id for o in (total(x), double(x)) for d in o.devices()}))
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[1]", "[0]"]


def test_jit_closing_over_the_callers_tracers_is_traced_into_the_caller():
    # concrete inputs, but fun closes over a tracer of the caller's grad / jit /
    # vmap (functools.partial(apply, params) inside a loss): as jax.jit nested
    x = np.arange(3, dtype=np.float32)

    def loss(w, wrap):
        return wrap(lambda v: jnp.sin(v) * w)(x).sum()

    for transform in (jax.grad, jax.jit, jax.vmap):
        args = (jnp.arange(3.0),) if transform is jax.vmap else (2.0,)
        np.testing.assert_allclose(transform(lambda w: loss(w, pm.jit))(*args),
                                   transform(lambda w: loss(w, jax.jit))(*args), rtol=1e-6)
    # a runner in its steady state, called inside a transformation: not its bucket program
    g = pm.jit(lambda v: v * 2)
    for _ in range(3):
        g(x)
    assert float(jax.grad(lambda w: jnp.sum(g(x) * w))(1.0)) == 6.0
    np.testing.assert_array_equal(jax.jit(lambda w: g(x) * w)(3.0), x * 6)
    assert g.stats()["traced_calls"] == 2


def test_jit_under_grad_jit_and_vmap_is_plain_jax():
    fun = lambda x, w: jnp.sum(jnp.sin(x * w) ** 2) / x.shape[0]
    f = pm.jit(fun, ("n", None), buckets=B.pow2(8, maximum=16))
    x = np.linspace(-1, 1, 5, dtype=np.float32)
    w = np.float32(1.5)
    np.testing.assert_allclose(jax.grad(f)(x, w), jax.grad(fun)(x, w), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f, argnums=1)(x, w), jax.grad(fun, argnums=1)(x, w),
                               rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(x, w), fun(x, w), rtol=1e-6)
    xs = np.stack([x, -x, 2 * x])
    np.testing.assert_allclose(jax.vmap(f, in_axes=(0, None))(xs, w),
                               jax.vmap(fun, in_axes=(0, None))(xs, w), rtol=1e-6)
    assert f.stats()["compiles"] == 0  # the caller's transformation compiles
    assert f.stats()["traced_calls"] >= 4 and f.stats()["calls"] == 0
    # sizes are still checked: above the largest bucket is a ShapeError, as eagerly
    big = np.ones(17, np.float32)
    with pytest.raises(pm.ShapeError, match="largest bucket 16"):
        jax.grad(f)(big, w)
    with pytest.raises(pm.ShapeError, match="largest bucket 16"):
        f(big, w)


def test_size_above_the_largest_bucket_names_the_dim_var_and_input():
    f = pm.jit(lambda x, y: x.sum() + y.sum(), ("n", "m"), buckets=B.pow2(8, maximum=16))
    with pytest.raises(pm.ShapeError, match=r"dim var 'm' = 17 \(from args\[1\]\.shape\[0\]\): "
                                            r"size 17 is larger than the largest bucket 16"):
        f(np.ones(3, np.float32), np.ones(17, np.float32))


def test_jit_keyword_arguments_take_their_parameters_position():
    def f(x, w, scale=2.0, offset=0.0):
        return jnp.cumsum(x * w) * scale + offset

    g = pm.jit(f, ("n", "n", None, None), buckets=B.pow2(4))
    rng = np.random.default_rng(5)
    for n in (0, 1, 3, 8):
        x, w = (rng.normal(size=n).astype(np.float32) for _ in range(2))
        want = np.cumsum(x * w) * 2.0
        for got in (g(x, w), g(x, w=w), g(x=x, w=w), g(w=w, x=x)):
            assert got.shape == (n,)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # a skipped parameter takes its default
        np.testing.assert_allclose(g(x, w, offset=1.5), want + 1.5, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g(x, w=w, scale=3.0), np.cumsum(x * w) * 3.0,
                                   rtol=1e-5, atol=1e-6)
    # buckets 4 and 8, for each form of call: (x, w) however passed; offset given
    # (scale skipped: its default is an input); scale given (offset left out:
    # fun's own default, as under jax.jit, never traced)
    assert g.stats()["compiles"] == 2 * 3

    def h(x, axis=-1, mode="sum"):  # defaults as Python configuration
        return jnp.sum(x, axis=axis) if mode == "sum" else jnp.max(x, axis=axis)

    for specs in (("n, 3", None, None), {"x": "n, 3"}):
        np.testing.assert_allclose(pm.jit(h, specs)(np.ones((4, 3), np.float32)), [3.0] * 4)


def test_jit_static_arguments_are_python_values_keyed_as_jax_jit_keys_them():
    import functools

    def top(x, k, mode="sum", *, scale=1.0):
        v = lax.top_k(x, k)[0]
        return (v.sum() if mode == "sum" else v.max()) * scale

    # (jax.jit given both derives neither from the other: k by keyword needs its name)
    plain = jax.jit(top, static_argnames=("k", "mode", "scale"))
    f = pm.jit(top, ("n", None), static_argnums=1, static_argnames=("mode", "scale"),
               buckets=B.pow2(8), tiered=False)
    rng = np.random.default_rng(3)
    for n in (3, 5, 8, 11):
        x = rng.normal(size=n).astype(np.float32)
        for call in (lambda g: g(x, 2), lambda g: g(x, k=3), lambda g: g(x, 2, "max"),
                     lambda g: g(x, 1, mode="max", scale=2.0), lambda g: g(x, k=2, scale=3.0)):
            np.testing.assert_allclose(call(f), call(plain), rtol=1e-6)
    # programs per (bucket, static values), none per shape: buckets 8 and 16
    s = f.stats()
    assert s["exact_compiles"] == 0 and s["compiles"] == 2 * 5, s
    # the static value's type is part of the key, as the result dtype follows it
    g = pm.jit(lambda x, k: x * k, static_argnums=1, tiered=False)
    xi = np.arange(4, dtype=np.int32)
    assert [g(xi, k).dtype for k in (1, True, 1.0)] == [jnp.int32, jnp.int32, jnp.float32]
    # a decorator, a required keyword-only static parameter
    @functools.partial(pm.jit, static_argnames="train")
    def drop(x, *, train):
        return x * (2.0 if train else 1.0)

    np.testing.assert_array_equal(drop(np.ones(3, np.float32), train=True), [2, 2, 2])
    assert drop.stats()["exact_compiles"] == 0
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'train'"):
        drop(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="takes 1 positional argument but 2 were given"):
        drop(np.ones(3, np.float32), True)
    # under jax.grad / jax.jit the static value reaches fun as it is
    h = pm.jit(lambda x, p: jnp.sum(x ** p), static_argnums=1)
    np.testing.assert_allclose(jax.grad(lambda x: h(x, 2))(jnp.arange(3.0)), [0, 2, 4])
    # jax.jit's errors, where jax.jit raises them
    with pytest.raises(ValueError, match="static_argnums=\\(3,\\), but only accepts 3"):
        pm.jit(top, static_argnums=3)
    with pytest.raises(ValueError, match="invalid argnames \\{'q'\\}"):
        pm.jit(top, static_argnames="q")
    with pytest.raises(ValueError, match="Non-hashable static arguments"):
        f(np.ones(3, np.float32), [1])
    with pytest.raises(pm.SpecError, match="argument 1 of top is static"):
        pm.jit(top, ("n", "m"), static_argnums=1)
    # a keyword-only argument that is not static: the remedy names static_argnames
    with pytest.warns(pm.FallbackWarning, match="static_argnames='scale'"):
        pm.jit(top, ("n", None), static_argnums=1)(np.ones(3, np.float32), 1, scale=2.0)
    # explain and precompile take the static values as a call does
    text = str(pm.explain(f, np.ones(5, np.float32), 2, "max"))
    assert "reduce_max" in text
    p = pm.jit(top, "n", static_argnames=("k", "mode"), tiered=False, buckets=B.pow2(8))
    p.precompile(jax.ShapeDtypeStruct((5,), jnp.float32), 2)
    p.precompile(jax.ShapeDtypeStruct((5,), jnp.float32), k=2, mode="max")
    assert p.stats()["compiles"] == 2
    np.testing.assert_allclose(p(np.ones(6, np.float32), 2), 2.0)
    assert p.stats()["compiles"] == 2  # served by the precompiled program
    # a missing argument is Python's TypeError, as under jax.jit (not a failure at
    # every size of the trace)
    with pytest.raises(TypeError, match="missing a required argument: 'k'"):
        p(np.ones(3, np.float32))


def test_a_static_keyword_taken_by_kwargs_is_bound_and_shares_programs():
    """flax's ``apply(variables, *args, rngs=None, ..., **kwargs)`` takes a
    module's ``train`` flag through ``**kwargs``: with ``static_argnames=
    "train"`` (the remedy the keyword error names) each value is bound into
    the function and its sizes share a program, as ``functools.partial(apply,
    train=...)`` does; it ran per exact shape."""
    def apply(params, *args, rngs=None, **kwargs):
        (x,) = args
        scale = 2.0 if kwargs["train"] else 1.0
        return jnp.cumsum(x * params["w"]) * scale + (0.0 if rngs is None else 1.0)

    params = {"w": np.float32(3.0)}
    plain = jax.jit(apply, static_argnames="train")
    f = pm.jit(apply, (None, "n"), static_argnames="train", tiered=False, buckets=B.pow2(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        for n in (0, 1, 3, 5, 8):
            x = np.arange(n, dtype=np.float32)
            for train in (False, True):
                np.testing.assert_allclose(f(params, x, train=train),
                                           plain(params, x, train=train))
    s = f.stats()
    assert (s["compiles"], s["exact_compiles"], s["calls"]) == (2, 0, 10)
    assert f.fallbacks() == {}
    # a keyword that is no static one beside it: per exact shape, said (as before)
    with pytest.warns(pm.FallbackWarning, match="'rngs'"):
        out = f(params, np.ones(3, np.float32), train=False, rngs={"dropout": 1})
    np.testing.assert_allclose(out, plain(params, np.ones(3, np.float32), train=False,
                                          rngs={"dropout": 1}))
    assert f.stats()["exact_compiles"] == 1 and "(train=False)" in " ".join(f.fallbacks())
    # explain takes the call's keywords: the static one explains the runner it binds
    x = np.ones(5, np.float32)
    for train in (True, False):
        text = pm.explain(f, params, x, train=train, print_output=False)
        assert "args[1]: f32[n]" in text and "cumsum" in text
        bound = f._bound_runner({"train": StaticArg(train)})  # (the runner its calls ran)
        assert text == pm.explain(bound, params, x, print_output=False)
    with pytest.raises(TypeError, match=r"\['rngs'\] have no position"):
        pm.explain(f, params, x, train=False, rngs={"dropout": 1})
    with pytest.raises(TypeError, match="keyword arguments of a polymask.jit call only"):
        pm.explain(apply, (None, "n"), params, x, train=False)


def test_jit_is_also_a_decorator_factory_as_jax_jit():
    @pm.jit(in_specs="n", buckets=B.pow2(4))
    def f(x):
        return jnp.cumsum(x)

    @pm.jit()
    def g(x):
        return jnp.cumsum(x)

    for h in (f, g):
        assert type(h).__name__ == "PolyJit"
        np.testing.assert_array_equal(h(np.arange(3.0)), [0, 1, 3])
    with pytest.raises(TypeError, match=r"takes the function first.*@polymask.jit\(in_specs='n'\)"):
        pm.jit("n")


def test_ragged_map_static_broadcast_arguments_in_both_layouts():
    def red(mode, w, x):
        return (x.sum() if mode == "sum" else x.max()) * w

    exs = [np.arange(float(n), dtype=np.float32) for n in (2, 3, 5)]
    for layout in ("padded", "packed"):
        rm = pm.ragged_map(red, ("n",), layout=layout, static_argnums=0)
        for mode in ("max", "sum", "max"):
            np.testing.assert_allclose(rm(exs, mode, 2.0), [red(mode, 2.0, e) for e in exs])
        assert rm.stats()["layout"]["packed" if layout == "packed" else "padded"] == 3
    with pytest.raises(ValueError, match="only broadcast arguments can be static"):
        pm.ragged_map(red, ("n",), static_argnums=2)(exs, "max", 1.0)
    with pytest.raises(ValueError, match="Non-hashable static arguments"):
        pm.ragged_map(red, ("n",), static_argnums=0)(exs, ["max"], 1.0)
    rm = pm.ragged_map(red, ("n",), static_argnums=0)
    assert rm.explain(exs[1], "max", 1.0).runs
    assert "reduce_max" in str(pm.explain(rm, None, "max", 1.0, exs[1], print_output=False))


def test_outputs_keep_jax_jits_weak_types_and_prng_key_dtype():
    # A weakly typed output (a bool mask times 2, a size returned as a number)
    # promotes as a Python scalar: out + int8 is int8 under jax.jit. Outputs
    # unpadded on the host lost it; typed key outputs crashed there.
    def f(x):
        return (x > 0) * 2, x.shape[0], jnp.zeros_like(x) + 1.0, jnp.sum(x)

    x = np.arange(5, dtype=np.float32) - 2
    want = [(r.dtype, r.weak_type) for r in jax.jit(f)(x)]
    assert want[0] == (jnp.int32, True) and want[1] == (jnp.int32, True)
    runs = {"jit": lambda: pm.jit(f, "n")(x),
            "mask": lambda: [m.data for m in pm.mask(f, "n")(pm.Masked(np.pad(x, (0, 3)),
                                                                       (5,)))],
            "padded": lambda: pm.ragged_map(f, ("n",), layout="padded")([x, x[:3]])[0],
            "packed": lambda: pm.ragged_map(f, ("n",), layout="packed")([x, x[:3]])[0]}
    for name, run in runs.items():
        assert [(g.dtype, g.weak_type) for g in run()] == want, name
    i8 = np.ones(5, np.int8)
    assert (pm.jit(f, "n")(x)[0] + i8).dtype == jnp.int8

    def split(key, x):
        return jax.random.split(key, x.shape[0])

    key = jax.random.key(0)
    for n in (5, 3):
        want = jax.random.key_data(jax.jit(split)(key, x[:n]))
        for got in (pm.jit(split, (None, "n"))(key, x[:n]),
                    pm.jit(split, (None, "n"), numpy_outputs=True)(key, x[:n]),
                    pm.ragged_map(split, ("n",))([x[:n], x[:1]], key)[0]):
            assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
            np.testing.assert_array_equal(jax.random.key_data(got), want)


def test_jit_keyword_arguments_that_cannot_be_positional_run_as_jax_jit():
    def f(x, w, scale=2.0):
        return x * w * scale

    x = np.ones(3, np.float32)
    # no spec position for them: per exact shape under jax.jit (warned, with the remedy)
    with pytest.warns(pm.FallbackWarning, match=r"'scale' \(passed by keyword\) is argument "
                                                 r"2, and in_specs has 2 entries.*functools"):
        np.testing.assert_allclose(pm.jit(f, ("n", "n"))(x, x, scale=3.0), 3 * x)
    with pytest.raises(pm.ShapeError, match=r"'scale' \(passed by keyword\) is argument 2"):
        pm.jit(f, ("n", "n"), fallback=False)(x, x, scale=3.0)
    with pytest.raises(pm.ShapeError, match="in_specs has 2 entries but the function was "
                                            "called with 3 positional arguments"):
        pm.jit(f, ("n", "n"))(x, x, 3.0)  # the same mistake by position: the same error type
    with pytest.raises(pm.ShapeError, match=r"in_specs has 4 entries but f takes 3 positional "
                                            r"parameters \(x, w, scale\)"):
        pm.jit(f, ("n", "n", None, "m"))(x, x)

    def kw_only(x, *, k):
        return x * k

    g = pm.jit(kw_only, ("n",))
    with pytest.warns(pm.FallbackWarning, match=r"'k' is keyword-only .*functools.partial\("
                                                r"kw_only, k=\.\.\.\)"):
        np.testing.assert_allclose(g(x, k=2.0), 2 * x)
    np.testing.assert_allclose(g(x, k=3.0), 3 * x)  # the same program (k traced, as jax.jit)
    assert g.stats()["exact_compiles"] == 1 and g.stats()["exact_calls"] == 2
    with pytest.raises(pm.ShapeError, match=r"'k' is keyword-only"):
        pm.jit(kw_only, ("n",), fallback=False)(x, k=2.0)
    with pytest.raises(TypeError, match=r"f\(\): missing a required argument: 'w'"):
        pm.jit(f, ("n", "n"))(x, scale=1.0)
    with pytest.raises(TypeError, match="multiple values"):
        pm.jit(f, ("n", "n"))(x, x, w=x)
    import functools

    np.testing.assert_allclose(pm.jit(functools.partial(kw_only, k=2.0), ("n",))(x), 2 * x)


def _refined_programs(sizes, coarse, fine, rows):
    """Bucket of each batch of ``sizes`` (sorted largest first, cut into batches
    of ``rows``): the coarse one, and min(coarse, fine) of the batch's longest."""
    desc = sorted(sizes, reverse=True)
    longest = [desc[i] for i in range(0, len(desc), rows)]
    return [coarse(n) for n in longest], [min(coarse(n), fine(n)) for n in longest]


def test_ragged_map_refined_buckets_compile_after_the_call_and_serve_later_calls():
    rng = np.random.default_rng(4)
    sizes = [0, 1, 3, 5, 17, 18, 19, 20, 33, 40, 9, 2, 6, 7]
    exs = [rng.normal(size=(n, 2)).astype(np.float32) for n in sizes]
    ref = [np.cumsum(e, 0) * e.sum() for e in exs]

    def f(x):
        return jnp.cumsum(x, axis=0) * jnp.sum(x)

    rm = pm.ragged_map(f, ("n, 2",), buckets=B.pow2(16), refine_buckets=B.multiple(4),
                       batch_size=4, numpy_outputs=True, layout="padded")
    coarse, fine = _refined_programs(sizes, B.pow2(16), B.multiple(4), 4)
    assert coarse == [64, 32, 16, 16] and fine == [40, 20, 8, 4]
    for p in range(3):
        with pm.compile_counter() as cc:
            outs = rm(exs)
        for o, r in zip(outs, ref):
            assert o.shape == r.shape
            np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)
        if p:  # later calls run in the refined programs: nothing compiles
            assert cc.compiles == 0
        rm.wait()
        st = rm.stats()
        # the first call compiles the 3 coarse programs; the 4 refined ones compile after it
        assert st["refined_compiles"] == 4 and st["compiles"] == 3 + 4
    rows = [4, 4, 4, 2]  # examples per batch (the last batch is partial)
    padded = 2 * sum(r * b for r, b in zip(rows, coarse)) + 2 * 2 * sum(
        r * b for r, b in zip(rows, fine))
    assert st["padding_fraction"] == pytest.approx(1 - 3 * 2 * sum(sizes) / padded)


def test_ragged_map_refined_buckets_per_dim_var_and_off_by_default():
    rng = np.random.default_rng(5)
    pairs = [(3, 9), (12, 2), (5, 5), (9, 17), (1, 1), (0, 4)]
    exs = [(rng.normal(size=a).astype(np.float32), rng.normal(size=b).astype(np.float32))
           for a, b in pairs]

    def f(x, y):
        return jnp.outer(x, y).sum(1) + jnp.max(y, initial=-1.0)

    # only "m" is refined; its bucket never exceeds the coarse one
    rm = pm.ragged_map(f, ("n", "m"), buckets=B.pow2(8), batch_size=3, numpy_outputs=True,
                       refine_buckets={"m": B.exact(), None: B.fixed(1024)})
    for _ in range(2):
        outs = rm(exs)
        rm.wait()
        for (x, y), o in zip(exs, outs):
            np.testing.assert_allclose(o, np.outer(x, y).sum(1) + max(y.max(initial=-1), -1),
                                       rtol=1e-5, atol=1e-5)
    st = rm.stats()
    assert st["refined_compiles"] >= 1
    plain = pm.ragged_map(f, ("n", "m"), buckets=B.pow2(8), batch_size=3)
    plain(exs)
    plain.wait()
    assert plain.stats()["refined_compiles"] == 0


def test_compiler_options_reach_xla_and_keep_values():
    opts = {"xla_cpu_experimental_ynn_fusion_type": ""}  # YNNPACK fusions off (XLA:CPU)
    f = lambda x: jnp.tanh(x @ x.T).sum(0)
    g = pm.jit(f, "n, 3", compiler_options=opts)
    for n in (0, 1, 5):
        x = np.linspace(-1, 1, 3 * n, dtype=np.float32).reshape(n, 3)
        np.testing.assert_allclose(np.asarray(g(x)), f(x), rtol=1e-5, atol=1e-6)
    bad = pm.jit(f, "n, 3", compiler_options={"xla_no_such_option": 1})
    with pytest.raises(Exception, match="xla_no_such_option"):  # XLA names it
        bad(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="compiler_options"):
        pm.jit(f, "n, 3", compiler_options=["xla_cpu_experimental_ynn_fusion_type"])
    with pytest.raises(TypeError, match="compiler_options"):
        pm.ragged_map(f, ("n, 3",), compiler_options={"xla_dump_to": None})


def test_refined_compiler_options_give_every_batch_a_refined_program():
    opts = {"xla_cpu_experimental_ynn_fusion_type": ""}
    sizes = [0, 1, 3, 4, 7, 8, 9, 16]
    exs = [np.arange(n, dtype=np.float32) for n in sizes]
    f = lambda x: jnp.cumsum(x) / (1 + jnp.sum(x))
    rm = pm.ragged_map(f, ("n",), buckets=B.pow2(4), refine_buckets=B.pow2(4),
                       refined_compiler_options=opts, batch_size=4, numpy_outputs=True, layout="padded")
    for p in range(2):
        with pm.compile_counter() as cc:
            outs = rm(exs)
        for o, x in zip(outs, exs):
            np.testing.assert_allclose(o, np.cumsum(x) / (1 + x.sum()), rtol=1e-6)
        if p:
            assert cc.compiles == 0  # refined programs compiled after the first call
        rm.wait()
    # the same buckets, but other options: each batch's program is refined once
    st = rm.stats()
    assert st["refined_compiles"] == 2 and st["compiles"] == 4
    refined = [e for e in rm.cache.entries() if e.compiler_options]
    assert len(refined) == 2 and all(e.compiler_options == opts for e in refined)


def test_compiler_options_checks_and_stats_of_a_failed_compile():
    f = lambda x: jnp.sum(x * x)
    g = pm.jit(f, "n", compiler_options={"xla_cpu_experimental_ynn_fusion_type": "",
                                         "xla_debug_buffer_assignment_show_max": np.int64(5)})
    np.testing.assert_allclose(np.asarray(g(np.arange(4.0, dtype=np.float32))), 14.0)
    with pytest.raises(TypeError, match="refined_compiler_options: the value of 'a'"):
        pm.ragged_map(f, ("n",), refine_buckets=B.multiple(4),
                      refined_compiler_options={"a": None})
    with pytest.raises(ValueError, match="pass refine_buckets too"):
        pm.ragged_map(f, ("n",), refined_compiler_options={})
    bad = pm.jit(f, "n", compiler_options={"xla_no_such_option": True})
    for _ in range(2):
        with pytest.raises(Exception, match="xla_no_such_option"):
            bad(np.ones(5, np.float32))
    st = bad.stats()
    assert st["calls"] == 2 and st["cache_hits"] == 0 and st["compiles"] == 0


def test_ragged_map_errors_name_the_example():
    rm = pm.ragged_map(lambda x: jnp.abs(jnp.fft.rfft(x)).sum(), "n")
    with pytest.raises(pm.ShapeError, match=r"(?s)examples\[1\]: .*rfft of an axis of length 0"):
        rm([np.ones(3, np.float32), np.ones(0, np.float32), np.ones(5, np.float32)])
    rm2 = pm.ragged_map(lambda x, y: x + y, ("n", "n"))
    with pytest.raises(pm.ShapeError, match=r"examples\[2\]: "):
        rm2([(np.ones(2), np.ones(2)), (np.ones(1), np.ones(1)), (np.ones(3), np.ones(4))])


def test_refine_buckets_with_a_largest_bucket_keep_longer_batches_coarse():
    exs = [np.arange(n, dtype=np.float32) for n in (0, 1, 5, 30)]
    for fine in (B.pow2(4, maximum=16), B.explicit([8, 16])):
        rm = pm.ragged_map(lambda x: jnp.sum(x), ("n",), buckets=B.pow2(16), batch_size=1,
                           refine_buckets=fine, numpy_outputs=True, layout="padded")
        for _ in range(2):  # the example of 30 has no refined bucket: its coarse one
            np.testing.assert_allclose(rm(exs), [x.sum() for x in exs])
            rm.wait()
        assert rm.stats()["refined_compiles"] >= 1


def test_a_bound_below_what_the_function_needs_fails_like_plain_jax():
    top3 = lambda x: lax.top_k(x, 3)[0]
    g = pm.jit(top3, "n", buckets=B.exact())
    with pytest.raises(pm.ShapeError, match=r"(?s)every logical size within the bounds "
                       r"\(n in \{0\.\.2\}\).*test_runner.py.*got k=3 with shape=\[2\]"):
        g(np.ones(2, np.float32))
    np.testing.assert_allclose(np.asarray(g(np.arange(4.0, dtype=np.float32))), [3, 2, 1])


def test_a_refined_program_that_fails_to_compile_warns_once_and_keeps_the_coarse_one():
    exs = [np.arange(n, dtype=np.float32) for n in (0, 1, 5, 30)]
    rm = pm.ragged_map(lambda x: jnp.sum(x), "n", refine_buckets=B.multiple(4),
                       refined_compiler_options={"xla_no_such_option": True}, layout="padded")
    with pytest.warns(RuntimeWarning, match="refined program could not be compiled"):
        np.testing.assert_allclose([float(o) for o in rm(exs)], [x.sum() for x in exs])
        rm.wait()  # (the warning comes from the background compiler's thread)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):  # not retried: no warning, the same values
            np.testing.assert_allclose([float(o) for o in rm(exs)], [x.sum() for x in exs])
            rm.wait()
    assert not [w for w in seen if "refined program" in str(w.message)]
    assert rm.stats()["refined_compiles"] == 0


def test_ragged_map_examples_with_different_static_arguments_never_share_them():
    # a batch passes one example's static leaves to every row: examples whose
    # static values differ go to different batches (they all ran with one before)
    exs = [(np.float32(s), np.ones(n, np.float32)) for s, n in [(10, 1), (20, 3), (30, 7), (40, 5)]]
    for spec, sort in ((None, True), ("", True), (None, False)):
        rm = pm.ragged_map(lambda s, x: x * s, (spec, "n"), batch_size=4, numpy_outputs=True)
        rm.sort = sort
        for (s, x), o in zip(exs, rm(exs)):
            np.testing.assert_array_equal(o, x * s)
    vecs = [(np.full(3, s, np.float32), np.ones(n, np.float32)) for s, n in [(1, 2), (2, 4)]]
    rm = pm.ragged_map(lambda v, x: x * v.sum(), ("_", "n"), numpy_outputs=True)
    for (v, x), o in zip(vecs, rm(vecs)):
        np.testing.assert_array_equal(o, x * v.sum())
    keys = jax.random.split(jax.random.key(0), 3)  # per-example PRNG keys
    drop = lambda k, x: jnp.where(jax.random.bernoulli(k, 0.5, x.shape), x, 0.0)
    xs = [np.arange(1.0, n + 1, dtype=np.float32) for n in (2, 6, 4)]
    rm = pm.ragged_map(drop, (None, "n"), numpy_outputs=True)
    for k, x, o in zip(keys, xs, rm(list(zip(keys, xs)))):
        np.testing.assert_array_equal(o, drop(k, jnp.asarray(x)))
    # equal static values still share one batch
    same = pm.ragged_map(lambda s, x: x * s, (None, "n"), batch_size=4)
    same([(np.float32(2), np.ones(n, np.float32)) for n in (1, 3, 5, 7)])
    assert same.stats()["calls"] == 1


def test_ragged_map_stacks_static_arrays_that_differ_per_example():
    # arrays and PRNG keys that differ per example are stacked as a batched
    # input (one batch, each row its own value)
    keys = jax.random.split(jax.random.key(1), 4)
    drop = lambda k, x: jnp.where(jax.random.bernoulli(k, 0.5, x.shape), x, jnp.nan)
    xs = [np.arange(1.0, n + 1, dtype=np.float32) for n in (3, 7, 1, 5)]
    rm = pm.ragged_map(drop, (None, "n"), batch_size=4, numpy_outputs=True)
    for k, x, o in zip(keys, xs, rm(list(zip(keys, xs)))):
        np.testing.assert_array_equal(o, drop(k, jnp.asarray(x)))
    assert rm.stats()["calls"] == 1
    scale = lambda s, w, x: (x * s) @ w
    exs = [(np.float32(s), np.full((n, 2), s, np.float32), np.ones(n, np.float32))
           for s, n in [(1, 2), (2, 6), (3, 4)]]
    rm = pm.ragged_map(scale, (None, "n, 2", "n"), batch_size=4, numpy_outputs=True)
    for (s, w, x), o in zip(exs, rm(exs)):
        np.testing.assert_array_equal(o, scale(s, w, x))
    assert rm.stats()["calls"] == 1
    mat = lambda w, x: x @ w  # a per-example static matrix, stacked
    exs = [(np.full((2, 3), s, np.float32), np.ones((n, 2), np.float32)) for s, n in [(1, 2), (2, 5)]]
    rm = pm.ragged_map(mat, (None, "n, 2"), batch_size=4, numpy_outputs=True)
    for (w, x), o in zip(exs, rm(exs)):
        np.testing.assert_array_equal(o, x @ w)
    assert rm.stats()["calls"] == 1
    # weak types: a Python float (or a weak jax scalar) that differs per
    # example is stacked too, and keeps bfloat16 outputs bfloat16
    bf = [(s, np.ones(n, jnp.bfloat16)) for s, n in [(2.0, 3), (3.0, 5), (0.5, 1)]]
    for scalar in (lambda s: s, lambda s: jnp.asarray(s)):  # Python float, weak jax scalar
        rm = pm.ragged_map(lambda s, x: x * s, (None, "n"), batch_size=4)
        outs = rm([(scalar(s), x) for s, x in bf])
        for (s, x), o in zip(bf, outs):
            assert o.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(x, np.float32) * s)
        assert rm.stats()["calls"] == 1


@pytest.mark.parametrize("kind", ["int", "float", "complex", "bool"])
def test_ragged_map_stacks_python_numbers_keeping_their_weak_types(kind):
    # each row sees its own Python number, promoted as the number would be:
    # int8 * int stays int8, bfloat16 * float stays bfloat16, float32 *
    # complex is complex64, a bool stays a bool; one batch, one program
    dtype, vals = {"int": (np.int8, [3, -2, 5, 0]), "float": (jnp.bfloat16, [2.0, 0.5, -1.5, 3.0]),
                   "complex": (np.float32, [1j, 2.0 + 1j, -1j, 0j]),
                   "bool": (np.float32, [True, False, True, False])}[kind]
    f = (lambda s, x: jnp.where(s, x, -x)) if kind == "bool" else (lambda s, x: x * s)
    exs = [(v, (np.arange(1, n + 1) % 7).astype(dtype)) for v, n in zip(vals, (3, 0, 8, 1))]
    rm = pm.ragged_map(f, (None, "n"), batch_size=4, numpy_outputs=True)
    for (v, x), o in zip(exs, rm(exs)):
        want = f(v, jnp.asarray(x))
        assert o.dtype == want.dtype and o.shape == want.shape
        np.testing.assert_array_equal(o, np.asarray(want))
    assert rm.stats()["calls"] == 1 and rm.stats()["compiles"] == 1


def test_ragged_map_python_int_out_of_range_raises_as_plain_jax():
    f = lambda k, x: x * k
    with pytest.raises(OverflowError):
        f(2 ** 40, jnp.ones(3))
    rm = pm.ragged_map(f, (None, "n"))
    with pytest.raises(OverflowError):
        rm([(2 ** 40, np.ones(3, np.float32)), (3, np.ones(2, np.float32))])


def _attention(x):
    return jax.nn.softmax(x @ x.T) @ x


@pytest.mark.parametrize("layout", ["padded", "auto"])
def test_a_static_axis_of_each_examples_own_size_is_never_batched_with_another_size(layout):
    """``"_"`` takes each example's own size: examples whose ``_`` sizes differ
    run in batches of their own (they shared one, padded to the larger size:
    an extra column of zeros, a (5, 4) attention output where plain JAX has (5, 3))."""
    rng = np.random.default_rng(0)
    ex = [rng.normal(size=s).astype(np.float32) for s in [(3, 4), (5, 3), (2, 4), (1, 3)]]
    out = pm.ragged_map(_attention, "n, _", layout=layout)(ex)
    for o, x in zip(out, ex):
        assert o.shape == x.shape
        np.testing.assert_allclose(o, _attention(x), rtol=1e-5, atol=1e-6)


def test_jit_with_a_static_axis_never_runs_in_a_bucket_of_another_static_size():
    """Tiering runs a new size in a larger compiled bucket of the same kind; a
    ``"_"`` axis of another size is another kind (it raised 'logical size 4 is
    outside [0, 3]')."""
    f = pm.jit(_attention, "n, _", tiered=True)
    rng = np.random.default_rng(1)
    for shape in [(3, 4), (5, 3), (3, 4), (2, 3), (7, 4)]:
        x = rng.normal(size=shape).astype(np.float32)
        np.testing.assert_allclose(f(x), _attention(x), rtol=1e-5, atol=1e-6)
    f.wait()


def test_packed_refusal_of_several_kinds_names_the_examples_and_their_leaves():
    a = np.ones((3, 4), np.float32)
    with pytest.raises(pm.PackedUnsupported, match=r"examples\[0\] has args\[0\] float32 "
                       r"\(3, 4\), examples\[1\] has args\[0\] int32 \(3, 4\)"):
        pm.ragged_map(lambda x: x * 2, "n, 4", layout="packed")([a, a.astype(np.int32)])


@pytest.mark.parametrize("bad", [5, np.ones((3, 4), np.float32), "abc"])
def test_ragged_map_of_something_not_a_list_of_examples_is_a_shape_error(bad):
    """A lone array was read as a batch of its rows; a number raised a raw TypeError."""
    with pytest.raises(pm.ShapeError, match="examples must be a list of examples"):
        pm.ragged_map(lambda x: x * 2, "n, 4")(bad)


def test_ragged_map_of_a_padded_batch_says_what_it_got():
    """A stacked batch was named "an array of shape (array([3, 2]),)": its sizes."""
    batch = pm.stack([np.ones((3, 4), np.float32), np.ones((2, 4), np.float32)])
    with pytest.raises(pm.ShapeError, match=r"got a padded batch \(polymask.Masked of data "
                       r"shape \(2, 3, 4\)\); pass the exact arrays .*jax.vmap"):
        pm.ragged_map(lambda x: x * 2, "n, 4")(batch)


def test_ragged_map_takes_a_numpy_object_array_of_examples():
    xs = [np.ones((3, 4), np.float32), np.full((5, 4), 2.0, np.float32)]
    arr = np.empty(2, dtype=object)
    arr[:] = xs
    out = pm.ragged_map(lambda x: x.sum(0), "n, 4")(arr)
    for o, x in zip(out, xs):
        np.testing.assert_allclose(o, x.sum(0))


def test_64_bit_numpy_inputs_warn_no_more_than_jax_jit():
    """A tiered first call with int64/float64 NumPy inputs (x64 off) printed
    JAX's 'Explicitly requested dtype int64 ... truncated' UserWarning from
    polymask's own abstract arguments; ``jax.jit`` prints none."""
    table = np.ones((10, 3), np.float32)
    ids = np.array([1, 2, 3])  # int64
    x = np.random.default_rng(0).normal(size=5)  # float64
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        out = pm.jit(lambda t, i: t[i].sum(-1), (None, "n"))(table, ids)
        np.testing.assert_allclose(out, [3.0, 3.0, 3.0])
        f = pm.jit(jnp.cumsum, "n")
        np.testing.assert_allclose(f(x), np.cumsum(x), rtol=1e-5)
        f.precompile(jax.ShapeDtypeStruct((9,), np.float64))
        assert f.example_arguments()[0].dtype == jnp.float32
        loss = lambda p, t: jnp.sum(p["e"][t])  # noqa: E731
        p = {"e": jnp.ones((10, 2))}
        for layout in ("padded", "packed"):
            v, _ = pm.value_and_grad(loss, "n", layout=layout)(p, [ids, np.array([4])])
            assert float(v) == 4.0
        out = pm.mask(lambda t: jnp.sum(t), "n")(pm.Masked(np.array([1, 2, 3, 9]), (3,)))
        assert int(out.data) == 6


def test_64_bit_numpy_inputs_share_the_32_bit_program_as_jax_jit():
    """``jax.jit`` canonicalises float64/int64/complex128 NumPy input (x64 off)
    and runs it in float32's program; polymask compiled a second program per
    64-bit dtype."""
    fn = lambda x, y: jnp.cumsum(x) * y[0]  # noqa: E731
    f, g = pm.jit(fn, tiered=False), jax.jit(fn)
    rng = np.random.default_rng(0)
    y = np.array([1.5, 2.0])
    for n in (0, 1, 5, 8, 17):
        for dt in (np.float32, np.float64, np.int32, np.int64, np.complex128):
            x = (rng.normal(size=n) * 100).astype(dt)
            a, b = f(x, y), g(x, y)
            assert (a.dtype, a.shape) == (b.dtype, b.shape)
            np.testing.assert_array_equal(a, b)
    # one program per bucket (8, 32) and canonical dtype (float32, int32, complex64)
    assert f.stats()["compiles"] == 6


def test_tiered_is_off_by_default_when_the_cache_cannot_hold_a_cover(monkeypatch):
    monkeypatch.setenv("POLYMASK_TIERED", "1")
    assert not pm.jit(jnp.sum, "n", cache_size=3).tiered
    assert pm.jit(jnp.sum, "n", cache_size=4).tiered
    assert pm.jit(jnp.sum, "n", cache_size=1, tiered=True).tiered  # asked for: kept


def test_jit_without_specs_gives_equal_sizes_of_a_call_one_dim_var():
    # x + y and a square matrix trace as plain JAX sees them (one size), so the
    # default specs share programs; other equalities plan apart
    rng = np.random.default_rng(21)
    add = pm.jit(lambda x, y: x + y, tiered=False)
    inv = pm.jit(jnp.linalg.inv, tiered=False)
    total = pm.jit(lambda x: x.sum(0), tiered=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        for n in (3, 5, 7, 12):
            a, b = _integer_valued(rng, (n,)), _integer_valued(rng, (n,))
            np.testing.assert_array_equal(add(a, b), a + b)
            m = rng.normal(size=(n, n)).astype(np.float32) + 3 * np.eye(n, dtype=np.float32)
            np.testing.assert_allclose(inv(m), np.linalg.inv(m), rtol=1e-4, atol=1e-5)
        for shape in ((5, 5), (5, 7), (6, 6), (3, 7)):
            x = _integer_valued(rng, shape)
            np.testing.assert_array_equal(total(x), x.sum(0))
    assert (add.stats()["compiles"], add.stats()["exact_compiles"]) == (2, 0)  # buckets 8, 16
    assert (inv.stats()["compiles"], inv.stats()["exact_compiles"]) == (2, 0)
    assert (total.stats()["compiles"], total.stats()["exact_compiles"]) == (2, 0)  # n == m or not


def test_jit_decorates_a_method_with_the_instance_static_as_jax_jit():
    class Model:
        def __init__(self, scale):
            self.scale = scale

        @functools.partial(pm.jit, static_argnums=0)
        def apply(self, x):
            return x * self.scale

    x = np.ones(3, np.float32)
    np.testing.assert_array_equal(Model(3.0).apply(x), x * 3.0)
    np.testing.assert_array_equal(Model(2.0).apply(x[:2]), x[:2] * 2.0)
    from polymask.runners.polyjit import PolyJit

    assert isinstance(Model.apply, PolyJit)  # on the class: the runner itself


def test_jit_without_specs_serves_a_first_call_from_its_covering_bucket():
    # the covering bucket is planned with the call's dim vars: its own sizes
    # (all equal) would otherwise name one dim var, and the call could not use it
    f = pm.jit(lambda x: jnp.sum(x), tiered=True)
    x = np.ones((5, 6), np.float32)
    assert float(f(x)) == 30.0
    st = f.stats()
    assert (st["compiles"], st["tiered_calls"], st["cache_hits"]) == (1, 1, 0)
    f.wait()
    assert float(f(np.ones((7, 3), np.float32))) == 21.0


@pytest.mark.parametrize("tiered", [True, False])
def test_jit_without_specs_makes_an_axis_meeting_a_fixed_size_static(tiered):
    # x @ W, x + b with W, b closed over: the feature axis cannot be a dim var, so
    # the call that finds it plans it static and traces again; every later size
    # of the other axis shares programs (no call per exact shape)
    rng = np.random.default_rng(5)
    w, b = _integer_valued(rng, (16, 4)), _integer_valued(rng, (4,))

    def dense(x):
        return x @ w + b

    def bias(x):
        return x * 2 + b  # broadcasting (n, 4) against (4,)

    def branchy(x):  # the fixed size is met in one case of the trace only
        return (x @ w).sum(0) if x.shape[0] > 4 else x.sum(0)[:4]

    runners = {fn: pm.jit(fn, tiered=tiered) for fn in (dense, bias, branchy)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        for n in (3, 5, 0, 9, 1, 4, 7, 2):
            for fn, run in runners.items():
                x = _integer_valued(rng, (n, 4) if fn is bias else (n, 16))
                np.testing.assert_array_equal(run(x), jax.jit(fn)(x))
    for run in runners.values():
        run.wait()
        stats = run.stats()
        assert stats["exact_compiles"] == 0 and run.fallbacks() == {}
        assert stats["compiles"] <= 6  # the first trace and the static plan's buckets
    # a feature size the weights do not take fails as under jax.jit
    with pytest.raises(TypeError):
        runners[dense](np.ones((3, 8), np.float32))
    with pytest.raises(TypeError):
        pm.jit(dense, tiered=tiered)(np.ones((3, 8), np.float32))


def test_precompile_without_specs_makes_an_axis_meeting_a_fixed_size_static():
    w = jnp.arange(32.0).reshape(16, 2)
    f = pm.jit(lambda x: x @ w, tiered=False).precompile(
        jax.ShapeDtypeStruct((8, 16), jnp.float32))
    x = np.arange(5 * 16, dtype=np.float32).reshape(5, 16)
    np.testing.assert_array_equal(f(x), x @ np.asarray(w))
    assert (f.stats()["compiles"], f.stats()["cache_hits"]) == (1, 1)


def test_tiered_jit_without_specs_never_covers_a_call_with_another_equal_size_pattern():
    # the default specs name a call's equal sizes alike: (1, 1, 16) is s0, s0, s1
    # and (1, 16, 16) is s0, s1, s1; a covering bucket of one pattern computes the
    # other's sizes on the wrong axes (it returned (1, 1, 16), and wrong means)
    # (tiered, the default outside the tests: conftest turns it off)
    x3 = np.arange(256, dtype=np.float32).reshape(1, 16, 16)
    for fn in (lambda x: x * 2.0, lambda x: x.mean(axis=1)):
        f = pm.jit(fn, tiered=True)
        f(np.ones((1, 1, 16), np.float32))
        np.testing.assert_array_equal(f(x3), jax.jit(fn)(x3))
    add = pm.jit(lambda a, b: a.sum() + b, tiered=True)
    a = np.ones((4, 8), np.float32)
    add(a, np.arange(4, dtype=np.float32))  # a's rows == b's length
    np.testing.assert_array_equal(add(a, np.arange(8, dtype=np.float32)),
                                  32 + np.arange(8, dtype=np.float32))  # a's columns


def test_an_argument_holding_none_shares_programs_as_jax_jit_takes_it():
    # eqx.partition(model, eqx.is_array) leaves None where a leaf is filtered out:
    # no array there, so no spec either (the default specs put a None leaf there
    # and every call ran per exact shape)
    w = np.arange(64, dtype=np.float32).reshape(16, 4) % 5

    def apply(params, x):
        return x @ params["w"] + (0.0 if params["act"] is None else 1.0)

    f = pm.jit(apply, tiered=False)
    g = pm.jit(apply, ({"w": None, "act": None}, "n, 16"), tiered=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        for n in (3, 5, 7):
            x = np.ones((n, 16), np.float32)
            for run in (f, g):
                np.testing.assert_array_equal(run({"w": w, "act": None}, x), x @ w)
    assert f.stats()["exact_compiles"] == g.stats()["exact_compiles"] == 0
    assert g.stats()["compiles"] == 1


def test_jit_without_specs_makes_a_convs_channel_axis_static():
    # conv_general_dilated checks channels with a comparison JAX cannot make on
    # a dim var ("s1 // 1 != 3"): that axis meets the kernel's fixed size too
    kernel = jnp.asarray(np.arange(8 * 3 * 5, dtype=np.float32).reshape(8, 3, 5) % 3 - 1)

    def conv(x):
        return lax.conv_general_dilated(x, kernel, (1,), "SAME")

    f = pm.jit(conv, tiered=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        for b, t in [(2, 5), (2, 7), (3, 17), (1, 9)]:
            x = np.arange(b * 3 * t, dtype=np.float32).reshape(b, 3, t) % 7
            np.testing.assert_allclose(f(x), jax.jit(conv)(x), rtol=1e-6)
    assert f.stats()["exact_compiles"] == 0


def test_jit_without_specs_makes_a_fixed_size_axis_static_in_a_case_of_another_size():
    """AlphaFold's distogram loss: ``assert positions.shape[-1] == 3`` splits
    the trace on that size, and in its case s2 == 3 the bins axis meets
    one_hot's 16. A case pinning s2 dropped s1's fixed size (it may be the
    pinned var's), so every size ran per exact shape (helper A)."""
    def loss(logits, pos):
        assert pos.shape[-1] == 3
        return jax.nn.one_hot(jnp.sum(pos > 0, -1), 16) * jnp.sum(logits, 0)

    f = pm.jit(loss, tiered=False)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        for n in (0, 1, 5, 8):
            logits = rng.normal(size=(n, n, 16)).astype(np.float32)
            pos = rng.normal(size=(n, 3)).astype(np.float32)
            np.testing.assert_allclose(f(logits, pos), jax.jit(loss)(logits, pos), rtol=1e-6)
    assert (f.stats()["compiles"], f.stats()["exact_compiles"]) == (1, 0)


def test_jit_without_specs_makes_an_axis_compared_with_many_constants_static():
    # a size looked up in a table of its values (flax's check of a parameter's
    # shape compares it with the module's feature count) splits the trace on
    # 'n == c' past max_cases: that axis meets fixed sizes, so it is planned
    # static and the other axis shares programs (it ran per exact shape)
    def scaled(x):
        scale = 1.0
        for c in range(1, 20):
            if x.shape[1] == c:
                scale = float(c)
        return x.sum(0) * scale

    f = pm.jit(scaled, tiered=False, max_cases=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        for n in (3, 5, 9, 2):
            x = np.ones((n, 6), np.float32)
            np.testing.assert_array_equal(f(x), scaled(x))
    assert (f.stats()["compiles"], f.stats()["exact_compiles"]) == (2, 0)  # buckets 8, 16


def test_jit_without_specs_makes_an_axis_needed_as_a_python_number_static():
    # attention's scale from the head size as a Python number (math.sqrt, np.sqrt,
    # d ** -0.5, int(d)): past the per-size limit that axis is planned static and
    # the sequence axis shares programs (every call ran per exact shape)
    import math

    def scaled_attention(x, how):
        d = x.shape[-1]
        scale = {"math": lambda: 1 / math.sqrt(d), "numpy": lambda: 1 / np.sqrt(d),
                 "power": lambda: d ** -0.5, "int": lambda: 1 / int(d)}[how]()
        return jax.nn.softmax(x @ x.T * scale, axis=-1) @ x

    rng = np.random.default_rng(4)
    for how in ("math", "numpy", "power", "int"):
        f = pm.jit(functools.partial(scaled_attention, how=how), tiered=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", pm.FallbackWarning)
            for n in (3, 5, 9, 20):
                x = rng.normal(size=(n, 40)).astype(np.float32)
                np.testing.assert_allclose(f(x), scaled_attention(x, how), rtol=2e-5, atol=1e-6)
        assert f.stats()["exact_compiles"] == 0, how


def test_ragged_map_without_specs_packs_examples_of_one_length_and_keeps_error_types():
    rm = pm.ragged_map(lambda x: jnp.cumsum(x) * 2, layout="packed")
    for lengths in [(3, 5), (4, 4), (1,)]:
        xs = [np.arange(n, dtype=np.float32) for n in lengths]
        for x, out in zip(xs, rm(xs)):
            np.testing.assert_array_equal(out, np.cumsum(x) * 2)
    w = jnp.ones((16, 4))
    for layout in ("padded", "auto"):
        with pytest.raises(TypeError):  # plain jax.jit's TypeError, as polymask.jit raises it
            pm.ragged_map(lambda x: x @ w, layout=layout)([np.ones((4, 12), np.float32)])


def test_jit_without_specs_broadcasts_size_one_axes_and_concatenated_features():
    # (n, 1) * (1, m): the two 1s are one dim var, which cannot broadcast; and a
    # feature axis that meets the weights after a concatenate ((s1 + 8,) against
    # (24,)): both are planned static, the other axes share programs
    w = jnp.asarray(np.arange(24 * 3, dtype=np.float32).reshape(24, 3) % 5 - 2)

    def outer(x, y):
        return x * y

    def gru_like(x, h):
        return jnp.tanh(jnp.concatenate([x, h], -1) @ w)

    runs = {outer: pm.jit(outer, tiered=False), gru_like: pm.jit(gru_like, tiered=False)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        for n, m in [(3, 4), (5, 4), (6, 7), (9, 2)]:
            x, y = np.arange(n, dtype=np.float32)[:, None], np.arange(m, dtype=np.float32)[None]
            np.testing.assert_array_equal(runs[outer](x, y), x * y)
            xs, hs = np.ones((n, 16), np.float32), np.full((n, 8), 0.5, np.float32)
            np.testing.assert_allclose(runs[gru_like](xs, hs), gru_like(xs, hs), rtol=1e-6)
    for run in runs.values():
        assert run.stats()["exact_compiles"] == 0
    # a first call of all 1s ((1, 1) * (1, 1)): the 1s are static at size 1 only,
    # so n and m stay dynamic (it pinned n for good: a compile per n)
    grid = pm.jit(outer, tiered=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pm.FallbackWarning)
        for n in range(1, 8):
            for m in range(1, 8):
                x, y = np.arange(n, dtype=np.float32)[:, None], np.arange(m, dtype=np.float32)[None]
                np.testing.assert_array_equal(grid(x, y), x * y)
    assert grid.stats()["compiles"] <= 6 and grid.stats()["exact_compiles"] == 0  # 49 calls


def test_tiered_jit_under_cache_pressure_compiles_no_more_than_it_is_called():
    # a covering bucket and the own bucket behind it each evicted another: more
    # compiles than calls (and than jax.jit's one per shape)
    f = pm.jit(lambda x, s: x * s + 1, tiered=True, cache_size=6)
    calls = 0
    for n in (3, 5, 9):
        for dt in (np.float16, np.float32, np.int32, np.int8, np.uint8):
            for s in (0.5, 2):
                x = (np.arange(n) % 3).astype(dt)
                np.testing.assert_array_equal(f(x, s), jax.jit(lambda x, s: x * s + 1)(x, s))
                calls += 1
    f.wait()
    st = f.stats()
    # at most one foreground compile a call, and background ones only until the
    # cache first evicts (at most about what it holds; 20 before)
    assert st["evictions"] > 0 and st["compiles"] - st["background_compiles"] <= calls
    assert st["background_compiles"] <= 6 + 1


def test_ragged_map_warns_when_a_broadcast_argument_is_a_second_list_of_examples():
    # rm(xs, ys) meant as pairs passes ys whole, first, to every example
    w = jnp.ones((16, 4))
    rm = pm.ragged_map(lambda x, y: (x @ w).sum(-1) - y)
    xs = [np.ones((n, 16), np.float32) for n in (2, 5)]
    ys = [np.ones(n, np.float32) for n in (2, 5)]
    with pytest.warns(UserWarning, match=r"rm\(list\(zip\(xs, ys\)\)\)") as caught:
        with pytest.raises(TypeError):
            rm(xs, ys)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = rm(list(zip(xs, ys)))
        params = [np.ones((3, 3), np.float32), np.ones((5, 2), np.float32)]  # not per example
        pm.ragged_map(lambda p, x: x.sum() + p[0].sum())(xs, params)
    np.testing.assert_array_equal(outs[1], np.full(5, 63.0, np.float32))  # 16 * 4 - 1


@pytest.mark.parametrize("layout", ["padded", "auto"])
def test_ragged_map_without_specs_shares_programs_across_batches_of_one_length(layout):
    """A length-bucketed loader's batches hold examples of one length each:
    read off one call, that axis looked like a feature axis and every length
    compiled its own program. An axis whose size changed between calls stays
    dynamic."""
    rng = np.random.default_rng(0)
    W = rng.normal(size=(16, 4)).astype(np.float32)
    f = lambda x: jnp.tanh(x @ W).mean(0)  # noqa: E731
    rm = pm.ragged_map(f, layout=layout)
    lengths = (10, 20, 13, 30, 7, 20, 25)
    for L in lengths:
        xs = [np.random.default_rng(0).normal(size=(L, 16)).astype(np.float32) for _ in range(3)]
        for o, x in zip(rm(xs), xs):
            np.testing.assert_allclose(o, f(x), rtol=1e-5, atol=1e-6)
    # 10 (the first call: static), then buckets 32 (20, 30, 25), 16 (13), 8 (7);
    # auto: and the packed row program, in which the calls of 20 ran
    assert rm.stats()["compiles"] == 4 + (layout == "auto") < len(set(lengths))
    assert rm.stats().get("packed", {}).get("compiles", 0) == (layout == "auto")


def test_ragged_map_without_specs_keeps_a_leading_axis_static_where_it_must_be():
    """A leading axis that changed size between calls is made dynamic, but
    ``W @ x`` needs x's channels as a constant: that axis is static again and
    the call runs as before (no per-example fallback, no warning)."""
    f = lambda W, x: jnp.tanh(W @ x).sum(1)  # noqa: E731
    rm = pm.ragged_map(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for W, xs in channel_batches():
            for o, x in zip(rm(xs, W), xs):
                np.testing.assert_allclose(o, f(W, x), rtol=1e-5, atol=1e-6)
    assert rm.fallbacks() == {} and rm.stats()["compiles"] == 3  # one per channel count


def test_axis_history_keeps_each_threads_promoted_axes_its_own():
    """Two threads' calls of one runner: one call's start must not drop the
    axes another call promoted (its rerun would then pin nothing and fail),
    and one call's pin must not pin the other's. (The other call runs in a
    thread joined before this one goes on: the interleaving is fixed.)"""
    import threading

    from polymask.runners.ragged_batches import AxisHistory

    h = AxisHistory()
    a, b = ("tree", 0, 0), ("tree", 1, 0)
    h.varies(a, {3}), h.varies(b, {4})  # first calls: one size each
    h.start_call()  # this thread's call: a has another size than before
    assert h.varies(a, {5})
    other = {}

    def other_call():  # starts, reads b at its old size, pins what it promoted
        h.start_call()
        other["varies"] = h.varies(b, {4})
        other["pinned"] = h.pin_promoted()
        other["promoted"] = set(h.promoted)

    t = threading.Thread(target=other_call)
    t.start()
    t.join()
    assert other == {"varies": False, "pinned": False, "promoted": set()}
    assert h.promoted == {a}  # not dropped by the other call's start
    assert h.pin_promoted()  # this call's a, pinned static
    h.start_call()
    assert not h.varies(a, {7}) and h.promoted == set()


def test_jit_without_specs_runs_per_shape_only_the_sizes_whose_comparison_changes_the_output():
    """``jnp.cov`` returns a scalar for one row and a matrix for more: the cases
    of ``rows == 1`` differ in rank, which a padded program cannot follow. The
    whole bucket ran per exact shape; now the rows == 1 case alone is left out
    (an error case that runs per exact shape) and every other size shares one
    program (columns are compared with constants too, but they do not separate
    the two cases)."""
    f = pm.jit(jnp.cov, tiered=False)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for shape in ((3, 5), (4, 6), (3, 1), (5, 7), (2, 4)):
            x = rng.normal(size=shape).astype(np.float32)
            np.testing.assert_allclose(f(x), jax.jit(jnp.cov)(x), rtol=1e-5, atol=1e-6,
                                       equal_nan=True)
    s = f.stats()
    assert (s["compiles"], s["exact_compiles"], s["calls"], s["cache_hits"]) == (1, 0, 5, 4)
    with pytest.warns(pm.FallbackWarning, match=r"s0 in \{1\}, s1 in \{1\.\.8\}"):
        x = rng.normal(size=(1, 6)).astype(np.float32)
        got = f(x)
    assert got.shape == () and np.allclose(got, jnp.cov(x))
    assert f.stats()["exact_compiles"] == 1
    # mask keeps the rank of most sizes; a = 1 (a scalar in plain JAX) alone raises
    cov = pm.mask(jnp.cov, "a, b")
    x = rng.normal(size=(3, 5)).astype(np.float32)
    np.testing.assert_allclose(cov(pm.pad(x, (4, 8), fill=np.nan)).unpad(), jnp.cov(x),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(pm.ShapeError, match=r"a == 1 and b >= 1.*different outputs.*rank 0"):
        cov(pm.pad(x[:1], (4, 8), fill=np.nan))


_W3 = np.eye(3, dtype=np.float32)
_RELATED = {
    # (function, argument shapes of T): each later one found from outside
    "tail_slice_3": (lambda r, v: r - v[3:], lambda T: [(T,), (T + 3,)]),
    "head_slice": (lambda r, v: r - v[:-1], lambda T: [(T,), (T + 1,)]),
    "two_relations": (lambda a, b, c: a + b[1:] + c[2:], lambda T: [(T,), (T + 1,), (T + 2,)]),
    "chain": (lambda a, b, c: (c[1:] * b).sum() + (b[1:] * a).sum(),
              lambda T: [(T,), (T + 1,), (T + 2,)]),
    "stack": (lambda r, v: jnp.stack([r, v[1:], v[:-1]]), lambda T: [(T,), (T + 1,)]),
    # the first T + 1 = 3 is also the width of W (closed over) and of h's features
    "rnn_states": (lambda x, h: x @ _W3 + h[1:] @ _W3, lambda T: [(T, 3), (T + 1, 3)]),
}


@pytest.mark.parametrize("tiered", [False, True])
@pytest.mark.parametrize("name", sorted(_RELATED))
def test_jit_without_specs_finds_relations_through_slices_chains_and_coinciding_sizes(
        name, tiered):
    """Relations JAX prints as ``max(0, s1 - 3)`` or reaches through a chain
    (``c`` of ``b`` of ``a``), under tiered buckets (whose covering bucket
    traces sizes one by one: a pinned size read as a weight's made axes
    static, and JAX's decision procedure failed on the pinned case's
    constant constraints, '_sorted_terms'), and after a first call whose
    sizes coincide. They ran per shape (silently), or the chain recursed."""
    f, shapes = _RELATED[name]
    pf = pm.jit(f, tiered=tiered)
    rng = np.random.default_rng(0)
    Ts = (2, 4, 0, 6, 9, 1, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for T in Ts:
            args = [rng.normal(size=s).astype(np.float32) for s in shapes(T)]
            np.testing.assert_allclose(pf(*args), jax.jit(f)(*args), rtol=1e-5, atol=1e-6)
        pf.wait()
    s = pf.stats()
    # buckets 8 and 16 (and a covering bucket), a first program where sizes coincided
    assert s["exact_compiles"] == 0 and s["compiles"] <= 3 + tiered < len(Ts), s
    assert pf.fallbacks() == {}
    assert not [a for a in pf.plans.static_axes if len(a) == 2]  # none static for good


@pytest.mark.parametrize("tiered", [False, True])
def test_a_call_that_breaks_a_relation_raises_and_leaves_the_axes_dynamic(tiered):
    """``r + v[1:]`` called once with ``v`` two longer: it raises as under
    ``jax.jit``. The tiered covering bucket's trace of that call read an
    empty slice (``(s0,)`` against ``(0,)``) as a fixed size, and every later
    call compiled per shape, silently."""
    f = lambda r, v: r + v[1:]  # noqa: E731
    pf = pm.jit(f, tiered=tiered)
    o = lambda n: np.ones(n, np.float32)  # noqa: E731
    pf(o(5), o(6))
    with pytest.raises(TypeError, match="incompatible shapes"):
        jax.jit(f)(o(5), o(7))
    with pytest.raises(TypeError, match="incompatible shapes"):
        pf(o(5), o(7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for T in (3, 6, 2, 7):
            np.testing.assert_allclose(pf(o(T), o(T + 1)), jax.jit(f)(o(T), o(T + 1)))
        pf.wait()
    assert pf.stats()["exact_compiles"] == 0 and not pf.plans.static_axes
    assert pf.stats()["compiles"] <= 1 + tiered
    # the call that failed as under jax.jit is no fallback and ran no exact program
    assert pf.fallbacks() == {} and pf.stats()["exact_calls"] == 0


def test_traces_at_pinned_sizes_warn_of_no_numpy_arithmetic_no_call_does():
    """Sizes traced one by one include 0, where ``1 / np.sqrt(n)`` divides by
    zero: NumPy's RuntimeWarning came from a size no call had."""
    f = lambda x: x * (1 / np.sqrt(x.shape[-1]))  # noqa: E731
    pf = pm.jit(f)
    with warnings.catch_warnings():
        # (each size of that axis is a case of its own: static, said at its
        # second size; the warning this test is about is NumPy's)
        warnings.simplefilter("ignore", pm.FallbackWarning)
        warnings.simplefilter("error", RuntimeWarning)
        for n in (4, 7):
            x = np.ones((2, n), np.float32)
            np.testing.assert_allclose(pf(x), jax.jit(f)(x), rtol=1e-6)
        pf.wait()


def test_a_first_call_whose_sizes_coincide_fixes_no_axis_for_good():
    """``jnp.cov`` first called at (3, 3): both axes share one dim var, which
    the rows' comparison names, so both were made static for every later call
    (one compile per shape from then on, no warning). Then they were static at
    3 only, and calls of other sizes made the rows static (the comparison
    named them). Now the comparison's differing case (one row: a scalar) is
    left out of the program, and rows and columns share buckets."""
    f = pm.jit(jnp.cov, tiered=False)
    rng = np.random.default_rng(0)
    shapes = [(3, 3), (3, 5), (3, 7), (4, 4), (4, 6), (5, 9), (5, 11), (5, 13), (5, 5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for shape in shapes:
            x = rng.normal(size=shape).astype(np.float32)
            np.testing.assert_allclose(f(x), jax.jit(jnp.cov)(x), rtol=1e-5, atol=1e-6)
    s = f.stats()
    # buckets: square (s0 <= 8) | (s0 <= 8, s1 <= 8) | (s0 <= 8, s1 <= 16); before: 6
    # (rows static: (3, 4) (3, 8) | (4, 4) (4, 8) | (5, 16) (5, 8)), and one per shape
    assert (s["compiles"], s["exact_compiles"], s["calls"]) == (3, 0, 9)
    assert f.stats()["cache_hits"] == 6


@pytest.mark.parametrize("tiered", [False, True])
def test_jit_without_specs_relates_an_axis_one_longer_than_another(tiered):
    """rlax's GAE ``td_errors(r (T,), d (T,), v (T + 1,))``: ``r + d * v[1:]``
    needs ``v``'s length to be ``r``'s plus one, which independent dim vars
    cannot prove. It ran per exact shape (tiered: with every axis made static
    and no warning, the pinned size read as a fixed size). Now the trace's
    ``(s0,)`` against ``(s1 - 1,)`` plans ``v``'s axis as ``s0 + 1``, as
    ``in_specs=("T", "T", "T + 1")`` would, and the calls share buckets; a
    call whose sizes break the relation fails as under ``jax.jit``."""
    def td_errors(r, d, v):
        return r + d * v[1:] - v[:-1]

    f = pm.jit(td_errors, tiered=tiered)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for T in (5, 7, 9, 12, 3, 20, 0, 1):
            r, d, v = (rng.normal(size=n).astype(np.float32) for n in (T, T, T + 1))
            np.testing.assert_allclose(f(r, d, v), jax.jit(td_errors)(r, d, v), rtol=1e-6)
        f.wait()
    s = f.stats()
    # buckets of T: 8 (5, 7, 3, 0, 1), 16 (9, 12), 32 (20); tiered: and the
    # covering bucket, the one compile in the foreground
    assert (s["compiles"], s["exact_compiles"], s["calls"]) == (3 + tiered, 0, 8)
    assert f.fallbacks() == {}
    r, d, v = np.ones(5, np.float32), np.ones(5, np.float32), np.ones(7, np.float32)
    with pytest.raises(TypeError, match="incompatible shapes"):
        jax.jit(td_errors)(r, d, v)
    with pytest.raises(TypeError, match="incompatible shapes"), warnings.catch_warnings():
        warnings.simplefilter("ignore", pm.FallbackWarning)
        f(r, d, v)


def test_outputs_of_a_function_with_cases_keep_jax_jits_weak_types():
    """``x[0]`` splits the trace (n == 0); the switch between the cases returned
    ``x.shape[0]`` strongly typed, so ``int8 array * count`` was int32 (flax
    sst2's ``Metrics.count``)."""
    def f(x):
        return x.shape[0], x[0].sum()

    x = np.ones((5, 3), np.float32)
    want = jax.jit(f)(x)
    for got in (pm.jit(f, tiered=False)(x),
                [o.data for o in jax.jit(pm.mask(f, "n, 3"))(pm.pad(x, (8, 3)))]):
        assert [(o.dtype, o.weak_type) for o in got] == [(o.dtype, o.weak_type) for o in want]
        assert (jnp.ones(2, jnp.int8) * got[0]).dtype == jnp.int8


def test_jit_called_inside_another_jit_shares_as_a_jax_jit_inside_would():
    """The inner runner planned its call's buckets from symbolic sizes (the outer
    masked trace's) and needed them as ints: the outer runner made the axis
    static and compiled per shape (jraph's sat.py: ``@jit`` loss under ``@jit``
    update)."""
    def loss_fn(nodes, senders):
        return jnp.sum(nodes[senders])

    rng = np.random.default_rng(0)
    inner = pm.jit(loss_fn)
    outer = pm.jit(lambda *g: inner(*g) * 2, tiered=False)
    for n, e in [(5, 8), (7, 12), (9, 20), (6, 10), (12, 30), (11, 25)]:
        g = rng.normal(size=(n,)).astype(np.float32), rng.integers(0, n, e).astype(np.int32)
        np.testing.assert_allclose(outer(*g), 2 * loss_fn(*g), rtol=1e-6)
    assert outer.stats()["compiles"] == 3 and outer.stats()["exact_compiles"] == 0


def test_a_legacy_uint32_prng_key_argument_shares_programs():
    """``jax.random.PRNGKey(n)`` is a uint32 array of shape (2,): without specs
    its axis got a dim var, JAX's "expected key_data.shape to end with (2,);
    got shape=(s0,)" was not read as a fixed size, and every call ran per
    exact shape."""
    def dropout(key, x, rate):
        keep = jax.random.bernoulli(key, 1 - rate, x.shape)
        return jnp.where(keep, x / (1 - rate), 0)

    f = pm.jit(dropout, tiered=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (3, 5, 6, 7, 9, 10, 11, 12):
            x = np.ones((n, 3), np.float32)
            key = jax.random.PRNGKey(n)
            np.testing.assert_array_equal(f(key, x, 0.3), jax.jit(dropout)(key, x, 0.3))
    assert f.stats()["exact_compiles"] == 0 and f.stats()["compiles"] <= 3


def test_numpy_outputs_of_a_per_shape_call_keep_key_arrays():
    """A call run per exact shape converted every output with np.asarray, which
    a typed key array refuses: "JAX array with PRNGKey dtype cannot be
    converted to a NumPy array" (the padded path kept keys already)."""
    def f(key, x):  # np.ones(x.shape[0]) needs the size as an int: per exact shape
        return jax.random.split(key, x.shape[0]), jnp.asarray(np.ones(x.shape[0], np.float32)) * x

    g = pm.jit(f, (None, "n"), numpy_outputs=True, tiered=False)
    x = np.arange(5, dtype=np.float32)
    with pytest.warns(pm.FallbackWarning):
        keys, y = g(jax.random.key(0), x)
    want = jax.jit(f)(jax.random.key(0), x)
    assert isinstance(y, np.ndarray) and jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(keys), jax.random.key_data(want[0]))
    np.testing.assert_array_equal(y, want[1])


def test_big_endian_inputs_give_the_values_of_native_ones():
    """``>f4`` arrays (read from a big-endian file): the masked trace failed on
    their dtype, and the per-shape fallback passed them to ``jax.jit``, which
    copies their bytes as they are (garbage once the float32 program is
    cached: NaN from ragged_map, found from outside). They are converted to
    the native byte order as they come in."""
    f = lambda x: jnp.cumsum(x * 2.0, axis=0)  # noqa: E731
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in (5, 8, 2)]
    want = [np.cumsum(x * 2.0, axis=0) for x in xs]
    jitted = pm.jit(f, "n, 3")
    for x, w in zip(xs, want):
        np.testing.assert_allclose(jitted(x), w, rtol=1e-5, atol=1e-6)  # native first: cached
        np.testing.assert_allclose(jitted(x.astype(">f4")), w, rtol=1e-5, atol=1e-6)
    exact = pm.jit(f, "n, 3", buckets=B.exact())
    np.testing.assert_allclose(exact(xs[0].astype(">f4")), want[0], rtol=1e-5, atol=1e-6)
    for layout in ("padded", "packed", "auto"):
        outs = pm.ragged_map(f, ("n, 3",), layout=layout)([x.astype(">f4") for x in xs])
        for got, w in zip(outs, want):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    # polymask.mask too (it raised "Error interpreting argument to stage" from inside)
    m = pm.mask(f, "n, 3")
    for x, w in zip(xs, want):
        padded = pm.pad(x.astype(">f4"), (8, 3))
        np.testing.assert_allclose(m(padded).unpad(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tiered", [False, True])
def test_functions_without_array_outputs_or_with_a_key_output_run_again(tiered):
    """A second call at a size reuses the kept input buffer: with no array
    output (``None``, ``()``) it read ``out[0]`` (IndexError), and a typed
    PRNG key output was asked ``is_ready`` (AttributeError); helper D."""
    for f, check in [(lambda x: None, lambda got, want: got is None),
                     (lambda x: ((), {"a": None}), lambda got, want: got == want),
                     (lambda x: (jax.random.key(0), x.sum()),
                      lambda got, want: bool((jax.random.key_data(got[0])
                                              == jax.random.key_data(want[0])).all())
                      and float(got[1]) == float(want[1]))]:
        pf = pm.jit(f, tiered=tiered)
        for _ in range(3):
            for n in (0, 3, 8, 0):
                x = np.ones(n, np.float32)
                assert check(pf(x), jax.jit(f)(x)), (f, n)
            pf.wait()


def test_a_weakly_typed_array_input_keeps_its_weak_type():
    """A weakly typed JAX array of varying size (``jnp.broadcast_to(2.0,
    (n,))``) was padded on the host into a strong one: ``x_f16 * w`` came back
    float32 where jax.jit gives float16 (helper D). The program makes it weak
    again, and weak and strong inputs of one shape get their own programs."""
    def f(x, w):
        return x * w, w

    g = pm.jit(f)
    for n in (3, 5, 3, 0):
        x = np.ones(n, np.float16)
        for w in (jnp.broadcast_to(jnp.asarray(2.0), (n,)), jnp.full((n,), 2.0, jnp.float32)):
            got, want = g(x, w), jax.jit(f)(x, w)
            assert [o.dtype for o in got] == [o.dtype for o in want], (n, w.weak_type)
            assert got[1].weak_type == want[1].weak_type
    for layout in ("padded", "packed"):
        exs = [(np.ones(n, np.float16), jnp.broadcast_to(jnp.asarray(2.0), (n,)))
               for n in (3, 5, 2)]
        for got, ex in zip(pm.ragged_map(f, layout=layout)(exs), exs):
            assert got[0].dtype == jax.jit(f)(*ex)[0].dtype == np.float16, layout


def test_an_axis_made_static_for_a_size_needed_as_a_value_is_said_at_its_second_size():
    """Without in_specs, an axis whose size the function needs as a Python
    value (``np.arange(x.shape[0])``) is made static: one program per size, as
    jax.jit. That was silent (no FallbackWarning, nothing in fallbacks(), and
    fallback=False did not stop it; new-user check); it is said as a per-shape
    fallback is once the axis is seen at a second size, and fallback=False
    raises there instead. An axis of one size (a weight's, read as
    ``fan_in`` by an initialiser) is static for free: nothing is said."""
    def sq(x):
        return jnp.asarray(np.arange(x.shape[0]) ** 2) * x

    g = pm.jit(sq, tiered=False)
    with warnings.catch_warnings():  # bucket 8 is a case per size (one program would
        warnings.simplefilter("error")  # hold 9 copies): static at its first size
        outs = [g(np.ones(n, np.float32)) for n in (3, 3)]
    with pytest.warns(pm.FallbackWarning, match=r"needs the size of args\[0\]\.shape\[0\] as a "
                                                r"Python value, so that axis is static"):
        outs.append(g(np.ones(5, np.float32)))
    outs += [g(np.ones(n, np.float32)) for n in (40, 41)]
    for n, out in zip((3, 3, 5, 40, 41), outs):
        np.testing.assert_array_equal(out, sq(jnp.ones(n)))
    assert list(g.fallbacks()) == ["args[0].shape[0] (static)"]
    strict = pm.jit(sq, tiered=False, fallback=False)
    np.testing.assert_array_equal(strict(np.ones(40, np.float32)), sq(jnp.ones(40)))
    with pytest.raises(pm.ShapeError, match="cannot trace the function with symbolic sizes"):
        strict(np.ones(41, np.float32))

    def scaled(w, x):  # w's axis 0 is read as a Python value; x's axis varies
        return x @ w.T * (1.0 / np.sqrt(w.shape[0]))

    h = pm.jit(scaled, tiered=False, fallback=False)
    w = np.ones((48, 2), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (3, 5, 9, 1, 70):
            x = np.full((n, 2), 2.0, np.float32)
            np.testing.assert_allclose(h(w, x), scaled(w, x), rtol=1e-6)
    assert list(h._value_axes) == [("args[0]", 0)] and not h.fallbacks()
