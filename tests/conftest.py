import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tiered buckets compile in a background thread; off here so compile counts are
# deterministic (tests of tiered buckets pass tiered=True and call .wait()).
os.environ.setdefault("POLYMASK_TIERED", "0")
# The CLI turns the persistent compilation cache on by default: not in tests
# (it is process-global JAX config); tests that want it pass --cache-dir.
os.environ.setdefault("POLYMASK_CACHE_DIR", "off")
# The CLI makes glibc malloc keep freed memory (polymask.runners.hostmem), process-wide:
# not in the test workers that call cli.main in-process; tests of it set this.
os.environ.setdefault("POLYMASK_REUSE_HOST_MEMORY", "off")

# Compiles are most of the suite's time: XLA:CPU's cheap-compile flags (set before
# any backend starts; subprocesses of the CLI, serving and distributed tests
# inherit them). POLYMASK_TEST_FULL_COMPILE=1 keeps XLA's defaults (CI's jax
# 0.11 leg runs the version-sensitive core that way).
if os.environ.get("POLYMASK_TEST_FULL_COMPILE", "") in ("", "0"):
    from polymask._jax_compat.versions import fast_compile_xla_flags  # noqa: E402

    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), *fast_compile_xla_flags()]).strip()

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# -- CI shards ---------------------------------------------------------------------
# POLYMASK_TEST_SHARD="k/N" keeps the tests whose node id hashes to k (mod N), plus
# every test of EVERY_SHARD (the version-sensitive core: the compatibility layer,
# the acceptance cases, error reporting). .ci/run gives each end of the supported
# JAX range one shard, so every test runs on one end and the core on both, and the
# whole run fits CI's time budget (README "Tests"). Unset: every test runs.
EVERY_SHARD = frozenset({"test_jax_compat.py", "test_core_acceptance.py", "test_errors.py",
                         "test_compose.py", "test_architecture.py", "test_docs.py"})


def _shard():
    spec = os.environ.get("POLYMASK_TEST_SHARD", "").strip()
    if not spec:
        return None
    try:
        k, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise ValueError(f"POLYMASK_TEST_SHARD={spec!r}: expected 'k/N' with 0 <= k < N") from None
    if not 0 <= k < n:
        raise ValueError(f"POLYMASK_TEST_SHARD={spec!r}: expected 'k/N' with 0 <= k < N")
    return k, n


def pytest_collection_modifyitems(config, items):
    shard = _shard()
    if shard is None:
        return
    import zlib

    k, n = shard
    keep, drop = [], []
    for item in items:
        in_core = item.path.name in EVERY_SHARD
        mine = zlib.crc32(item.nodeid.encode()) % n == k
        (keep if in_core or mine else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
