"""Host -> device upload of the runners' unpadded outputs; the persistent
compilation cache's reset; executables' serialization and XLA compile options."""

from __future__ import annotations

import jax
import numpy as np

from .versions import JAX_VERSION


# ----------------------------------------------------------------------------
# Host -> device upload of a fresh NumPy array (the runners' unpadded outputs)
# ----------------------------------------------------------------------------
def upload(a, weak_type: bool = False):
    """An uncommitted ``jax.Array`` on the default device (``jax.default_device``
    where set, else the first) holding the NumPy array ``a``
    (weakly typed with ``weak_type``, as a program's output may be, which
    ``jax.device_put`` cannot make: a Python scalar's promotion).

    ``jax.device_put`` binds a primitive through Python (about 5x slower per
    call); ``xla_client.batched_device_put`` (C++) is what it ends in. ``a`` must not be
    modified afterwards (it may be aliased on CPU). Falls back to
    ``jax.device_put`` where the private API moved.
    """
    global _upload_impl
    if _upload_impl is None:
        _upload_impl = _make_upload()
    return _upload_impl(a, weak_type)


_upload_impl = None


def is_made(x) -> bool | None:
    """Whether the ``jax.Array`` ``x`` is computed (its execution has ended);
    None once it is deleted (donated), when JAX cannot say. ``is_ready`` of a
    deleted array crashes the process on jaxlib 0.10.2 (and raises on 0.12), so
    ``is_deleted`` is asked first. A typed PRNG key array is asked through
    its data (it has no ``is_ready``)."""
    if not hasattr(x, "is_ready") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.is_deleted():
        return None
    try:
        return x.is_ready()
    except RuntimeError:  # deleted by another thread in between (0.12)
        return None


def buffer_address(x) -> int | None:
    """The address of a single-device ``jax.Array``'s data (None where JAX
    cannot say): whether an upload aliases the host memory it came from."""
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - sharded, deleted, or no such method
        return None


def _make_upload():
    try:
        from jax._src import core as _core
        from jax._src.lib import xla_client as _xc

        first = jax.devices()[0]
        placements: dict = {None: (jax.sharding.make_single_device_sharding(first), [first])}
        avals: dict = {}
        config = jax.config

        def placement(default):
            """(sharding, devices) of ``jax.default_device``'s value: as
            ``jax.device_put``, which uploads to it (a Device or a platform)."""
            dev = default if not isinstance(default, str) else jax.devices(default)[0]
            placements[default] = jax.sharding.make_single_device_sharding(dev), [dev]
            return placements[default]

        def up(a, weak_type=False):
            dt = jax.dtypes.canonicalize_dtype(a.dtype)
            if dt != a.dtype:  # as jax.device_put: float64 -> float32 without x64
                a = a.astype(dt)
            key = (a.shape, dt, weak_type)
            aval = avals.get(key)
            if aval is None:
                aval = avals[key] = _core.ShapedArray(a.shape, dt, weak_type=weak_type)
            default = config.jax_default_device
            sharding, devs = placements.get(default) or placement(default)
            return _xc.batched_device_put(aval, sharding, [a], devs, False)

        probe = np.arange(3, dtype=np.float32)
        out, weak = up(probe), up(probe, True)
        if not (isinstance(out, jax.Array) and np.array_equal(np.asarray(out), probe)
                and not out.committed and weak.weak_type and not out.weak_type):
            raise RuntimeError("unexpected batched_device_put result")
        return up
    except Exception:  # pragma: no cover - private API moved
        def put(a, weak_type=False):  # (a weak type is lost here)
            return jax.device_put(a)

        return put


def reset_compilation_cache() -> None:
    """Make JAX's persistent compilation cache re-read its directory setting
    (the cache object is created once per process); a no-op where the private
    API moved."""
    try:
        from jax._src import compilation_cache as cc

        cc.reset_cache()
    except (ImportError, AttributeError):  # pragma: no cover - private API moved
        pass


# ----------------------------------------------------------------------------
# Compiled executables as bytes (polymask.runners.program_store)
# ----------------------------------------------------------------------------
def serialize_executable(compiled) -> bytes:
    """A ``jax.stages.Compiled`` as bytes (``jax.experimental.serialize_executable``:
    the XLA executable with its argument and result pytrees)."""
    import pickle

    from jax.experimental import serialize_executable as se

    return pickle.dumps(se.serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)


def load_executable(blob: bytes):
    """The ``jax.stages.Compiled`` of ``serialize_executable``'s bytes, loaded on
    the default backend's devices (raises whatever XLA or pickle raise)."""
    import pickle

    from jax.experimental import serialize_executable as se

    payload, in_tree, out_tree = pickle.loads(blob)
    return se.deserialize_and_load(payload, in_tree, out_tree)


def fresh_compile_options() -> dict:
    """XLA compile options that make ``Lowered.compile`` a fresh XLA compile.

    JAX's persistent cache cannot be bypassed for one compile
    (``compilation_cache.is_cache_used`` caches its answer per process), and
    an executable it loaded cannot be serialized again on XLA:CPU. A random
    value of a debug-only option (how many buffers an out-of-memory message
    lists) gives the compile a cache key no earlier compile had; the code is
    the same.
    """
    import random

    return {"xla_debug_buffer_assignment_show_max": random.randrange(1 << 20, 1 << 30)}


def xla_cpu_run_speed_options() -> dict:
    """XLA compile options that trade compile time for run time on XLA:CPU
    ({} on other backends).

    They turn off XLA:CPU's YNNPACK library fusions (``DebugOptions.
    xla_cpu_experimental_ynn_fusion_type``, empty list; the option exists in
    jaxlib 0.10.x). An informal measurement, not a benchmark-suite figure
    (hand-written MiniLM batch programs, 6 buckets of 32 x 16..128 tokens, two
    fresh processes each on the 2-core box, load not recorded): compiles took
    3.15-3.53 s against 2.54-2.81 s, and the six first runs 1.69-1.76 s
    against 2.15-2.30 s (YNNPACK sets itself up on an executable's first run;
    later runs were equal). So they suit programs compiled in the background
    for repeated use, not a first pass that waits for its compiles.

    Only for jax 0.10.x ({} from 0.11): from jaxlib 0.11 the fusions run the
    float32 MiniLM faster once set up. Informal, one process each on the
    2-core AMX Xeon (``SentenceEncoder.embed`` of 1,400 docstrings, steady
    pass median of 3): jax 0.12.0.1 packed 11.25 s with these options, 8.83
    s without (first pass 12.1 -> 9.2 s), padded length buckets 9.97 ->
    8.60 s; the packed row program alone 289 -> 230 ms per call on jax
    0.11.2 (298 -> 244 on 0.12); jax 0.10.2 within 3% either way (packed
    10.27 vs 10.56 s, padded 9.60 vs 9.81 s).

    Not for bfloat16 programs: YNNPACK's fusions are how XLA:CPU runs
    bfloat16 dots on AMX / AVX512-BF16. Informal, one process each on such a
    2-core Xeon, not benchmark-suite figures: the bfloat16 MiniLM's refined
    length buckets ran 133 texts/s steady with these options, 237 without; a
    masked 32 x 64 bucket 212 ms against 79 ms (median of 20 runs); float32
    unchanged. The suite's 2-round figures are README's (bfloat16 239 texts/s
    against float32's 123). So ``SentenceEncoder`` uses them for float32 only.
    """
    if jax.default_backend() != "cpu" or JAX_VERSION >= (0, 11):
        return {}
    return {"xla_cpu_experimental_ynn_fusion_type": ""}


def native_bfloat16() -> bool:
    """Whether this backend multiplies bfloat16 natively: accelerators do; a
    CPU does with AMX or AVX512-BF16 (Linux ``/proc/cpuinfo`` flags), where
    XLA's bfloat16 dots (float32 accumulation) run about 4x its float32 rate;
    elsewhere XLA:CPU emulates bfloat16, about 3x slower than float32."""
    if jax.default_backend() != "cpu":
        return True
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("amx_bf16", "avx512_bf16"))


# ----------------------------------------------------------------------------
# Failures of a compiled program while it runs
# ----------------------------------------------------------------------------
# absl status codes, the prefix jaxlib writes on a run-time failure's message
_STATUS_CODES = frozenset((
    "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED"))


def is_runtime_error(e: BaseException) -> bool:
    """Whether ``e`` is XLA's failure of a program while it runs (a host
    callback that raised: equinox's ``error_if``, a failed size check), not a
    failure to trace or lower it. jaxlib reports it as ``JaxRuntimeError``,
    and for some calls with NumPy arguments (``polymask.jit``'s programs, jax
    0.10.2 and 0.12) as a plain ``ValueError`` whose message starts with the
    status code (``INTERNAL: CpuCallback error calling callback: ...``)."""
    if isinstance(e, jax.errors.JaxRuntimeError):
        return True
    return type(e) is ValueError and str(e).split(":", 1)[0] in _STATUS_CODES


def as_jax_runtime_error(e: BaseException) -> BaseException:
    """A run-time failure (``is_runtime_error``) as the ``JaxRuntimeError``
    ``jax.jit`` raises for it (same message and traceback)."""
    if isinstance(e, jax.errors.JaxRuntimeError):
        return e
    return jax.errors.JaxRuntimeError(str(e)).with_traceback(e.__traceback__)
