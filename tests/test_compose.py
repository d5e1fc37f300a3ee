"""Composition with jax.export (serialize + call) and sharding."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm


def _run_on_two_host_devices(code: str, timeout: int) -> None:
    """Run ``code`` in a fresh process with two CPU devices; it prints OK."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def _masked_cummean(checks):
    f = pm.mask(lambda x: jnp.cumsum(x) / x.shape[0], "n", checks=checks)

    def g(data, n):
        out = f(pm.Masked(data, (n,)))
        return out.data, out.shape[0]

    return g


def test_export_roundtrip_with_dynamic_sizes():
    g = _masked_cummean(checks=False)
    exp = jax.export.export(jax.jit(g))(
        jax.ShapeDtypeStruct((8,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    exp2 = jax.export.deserialize(exp.serialize())
    for n in (0, 3, 8):
        data, size = exp2.call(jnp.arange(8.0), jnp.int32(n))
        assert int(size) == n
        np.testing.assert_allclose(np.asarray(data)[:n], np.cumsum(np.arange(n)) / max(n, 1))


def test_export_with_a_symbolic_padded_shape_says_to_export_per_bound():
    g = _masked_cummean(checks="functional")
    (b,) = jax.export.symbolic_shape("b")
    with pytest.raises(pm.ShapeError, match=r"padded to the symbolic shape \(b,\).*per bound"):
        jax.export.export(jax.jit(g))(jax.ShapeDtypeStruct((b,), jnp.float32),
                                      jax.ShapeDtypeStruct((), jnp.int32))
    # a symbolic batch of examples (vmap outside mask) exports
    (k,) = jax.export.symbolic_shape("k")
    exp = jax.export.export(jax.jit(jax.vmap(g)))(jax.ShapeDtypeStruct((k, 8), jnp.float32),
                                                  jax.ShapeDtypeStruct((k,), jnp.int32))
    data, sizes = exp.call(jnp.ones((3, 8)), jnp.int32([2, 8, 5]))
    np.testing.assert_allclose(np.asarray(data)[1], np.arange(1, 9) / 8)
    np.testing.assert_array_equal(sizes, [2, 8, 5])


def test_sharded_ragged_batch_on_two_devices():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import polymask as pm
        assert jax.device_count() == 2
        mesh = jax.make_mesh((2,), ("b",))
        f = jax.jit(jax.vmap(pm.mask(lambda x: jnp.sum(x ** 2) / x.shape[0], "n")))
        data = jax.device_put(jnp.arange(40.0).reshape(4, 10), NamedSharding(mesh, P("b")))
        sizes = jax.device_put(jnp.array([1, 3, 10, 0], jnp.int32), NamedSharding(mesh, P("b")))
        out = f(pm.Masked(data, (sizes,)))
        ref = [np.sum(np.arange(40.0).reshape(4, 10)[i, :n] ** 2) / max(n, 1)
               for i, n in enumerate([1, 3, 10, 0])]
        ref[3] = np.nan  # 0/0 as in the unpadded program
        np.testing.assert_allclose(np.asarray(out.data), ref, rtol=1e-6)
        assert len(out.data.sharding.device_set) == 2
        print("OK")
    """)
    _run_on_two_host_devices(code, timeout=300)


def test_mask_inside_shard_map_on_two_devices():
    # the masked trace binds its primitives with one set of varying manual axes
    # (as jax.lax does), a case split's branches return one type, and a failed
    # check raises on the device whose shard fails (no gather: no deadlock)
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import polymask as pm
        shard_map = getattr(jax, "shard_map", None)
        if shard_map is None:
            from jax.experimental.shard_map import shard_map
        fns = {
            "affine": lambda x: x * 3.0 + 1.0,
            "max": lambda x: x - jnp.max(x),  # a case split (and an error at n = 0)
            "shift": lambda x: jnp.sqrt(jnp.abs(x[1:] - x[:-1]) + 1.0),
            "sort": lambda x: jnp.sort(-x),
            "scan": lambda x: jax.lax.scan(lambda c, v: (c * 0.5 + v, c), 0.0, x)[1],
            "grad": jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2) + jnp.max(x)),
        }
        rng = np.random.default_rng(0)
        data = rng.normal(size=(4, 8)).astype(np.float32)
        first_times_two = lambda x: x[0] * 2.0  # (a case split: x[0] fails at n = 0)

        def run(fn, checks, kind, sizes):
            types = (getattr(jax.sharding.AxisType, kind),)
            mesh = jax.make_mesh((2,), ("b",), axis_types=types)
            garbage = data.copy()
            for i, n in enumerate(sizes):
                garbage[i, n:] = np.nan
            d = jax.device_put(garbage, NamedSharding(mesh, P("b")))
            s = jax.device_put(np.int32(sizes), NamedSharding(mesh, P("b")))
            m = pm.mask(fn, "n", checks=checks)

            def per_shard(dd, ss):
                out = jax.vmap(lambda a, b: m(pm.Masked(a, (b,))))(dd, ss)
                return out.data, out.shape[0]

            out, n_out = jax.jit(shard_map(per_shard, mesh=mesh, in_specs=(P("b"), P("b")),
                                           out_specs=(P("b"), P("b"))))(d, s)
            return np.asarray(out), np.asarray(n_out)

        for kind in ("Auto", "Explicit"):
            for checks in (True, False, "functional"):
                for name, fn in fns.items():
                    sizes = [1, 5, 8, 3] if name in ("max", "grad") else [0, 1, 5, 8]
                    out, n_out = run(fn, checks, kind, sizes)
                    for i, n in enumerate(sizes):
                        ref = np.asarray(fn(jnp.asarray(data[i, :n])))
                        assert n_out[i] == ref.shape[0], (kind, checks, name, n)
                        np.testing.assert_allclose(out[i, :n_out[i]], ref, rtol=1e-5,
                                                   atol=1e-6, err_msg=f"{kind} {name} {n}")
            # jax.jit(vmap) under jax.set_mesh: a trace made under the Auto mesh is
            # not reused under the Explicit one (its values are typed by the mesh)
            mesh = jax.make_mesh((2,), ("b",), axis_types=(getattr(jax.sharding.AxisType, kind),))
            with jax.set_mesh(mesh):
                d = jax.device_put(data, NamedSharding(mesh, P("b")))
                s = jax.device_put(np.int32([1, 5, 8, 3]), NamedSharding(mesh, P("b")))
                out = jax.jit(jax.vmap(pm.mask(first_times_two, "n")))(pm.Masked(d, (s,)))
                np.testing.assert_allclose(np.asarray(out.data), data[:, 0] * 2.0, rtol=1e-6)
            try:  # jnp.max of an empty shard row, as plain JAX: an error, never a value
                with pm.shape_errors():
                    run(fns["max"], True, kind, [1, 5, 0, 3])
            except pm.ShapeError as e:
                assert "n in {0}" in str(e)
            else:
                raise AssertionError("no error at n = 0")
        print("OK")
    """)
    _run_on_two_host_devices(code, timeout=600)
