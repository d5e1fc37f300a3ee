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

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
