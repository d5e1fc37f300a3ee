"""A masked program on a ragged batch sharded over every process's devices.

The multi-host recipe: every process runs this same script with its own
``--process-id``; ``jax.distributed.initialize`` connects them through the
coordinator, the batch axis is sharded over the global mesh (each process
supplies its own rows), and ``jax.jit(jax.vmap(polymask.mask(f, spec)))`` runs
as one SPMD program. Sizes travel with the data, so the program compiles once
whatever lengths each process holds.

Install: ``pip install -e .`` (polymask alone) on every machine.

On one machine (two processes, CPU devices)::

    python examples/multihost.py --launch 2 --out result.npz

On N machines (same command on each, process id 0..N-1)::

    python examples/multihost.py --coordinator HOST0:PORT --num-processes N --process-id I
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

B, BOUND, D = 8, 12, 4  # batch, per-example length bound, features


def example_data():
    import numpy as np
    rng = np.random.default_rng(0)
    return [rng.normal(size=(n, D)).astype(np.float32) for n in (0, 3, 12, 5, 1, 7, 9, 2)]


def f(x):  # one exact example (n, D) -> ((n, D), ()): attention-like mixing + a mean
    import jax
    import jax.numpy as jnp
    w = jax.nn.softmax(x @ x.T / jnp.sqrt(D), axis=-1)
    return w @ x, jnp.sum(x ** 2) / jnp.maximum(x.shape[0], 1)


def run(process_id: int, num_processes: int, coordinator: str, local_devices: int, out: str):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={local_devices}")
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import polymask as pm

    if num_processes > 1:
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=num_processes, process_id=process_id)
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    sharding = NamedSharding(mesh, P("batch"))

    batch = pm.stack(example_data(), bound=(BOUND, D))  # every process builds the same host batch
    rows = B // jax.process_count()
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)

    def global_array(host):  # this process's rows -> one global array over the mesh
        return jax.make_array_from_process_local_data(sharding, np.asarray(host)[mine],
                                                      np.shape(host))

    gbatch = jax.tree_util.tree_map(global_array, batch)
    # checks=False: sizes from pm.stack are valid by construction, and the staged
    # check (a host callback) would pin part of the program to one device
    step = jax.jit(jax.vmap(pm.mask(f, "n, 4", checks=False)))
    mixed, mean_sq = step(gbatch)
    total = jax.jit(lambda m: jnp_sum(m.filled(0.0)))(mixed)  # a cross-process reduction
    mixed_data = multihost_utils.process_allgather(mixed.data, tiled=True)
    mean_sq = multihost_utils.process_allgather(mean_sq.data, tiled=True)
    if jax.process_index() == 0 and out:
        np.savez(out, mixed=np.asarray(mixed_data), mean_sq=np.asarray(mean_sq),
                 total=np.asarray(total), devices=len(jax.devices()),
                 processes=jax.process_count())
    print(f"process {jax.process_index()}/{jax.process_count()}: {len(jax.devices())} devices, "
          f"total {float(total):.5f}")


def jnp_sum(x):
    import jax.numpy as jnp
    return jnp.sum(x)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launch", type=int, default=0,
                    help="start this many local processes (coordinator on localhost)")
    ap.add_argument("--coordinator", default=None)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--local-devices", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.launch:
        coord = f"localhost:{_free_port()}"
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--coordinator", coord, "--num-processes",
             str(args.launch), "--process-id", str(i), "--local-devices",
             str(args.local_devices), "--out", args.out if i == 0 else ""])
            for i in range(args.launch)]
        codes = [p.wait(timeout=300) for p in procs]
        return max(codes)
    run(args.process_id, args.num_processes, args.coordinator or "", args.local_devices,
        args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
