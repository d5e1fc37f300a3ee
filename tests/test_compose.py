"""Composition with jax.export (serialize + call) and sharding."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

import polymask as pm


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
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
