"""polymask.reuse_host_memory: freed large blocks are reused (no fresh page faults)."""

import subprocess
import sys
import textwrap

import pytest

import polymask
from polymask.runners import hostmem

PROBE = textwrap.dedent("""
    import ctypes, resource, sys
    import polymask
    applied = polymask.reuse_host_memory() if sys.argv[1] == "reuse" else None
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    n = 64 << 20  # above glibc's largest mmap threshold (32 MB)

    def touch():
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        libc.free(p)

    touch()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        touch()
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _probe(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
@pytest.mark.skipif(hostmem._glibc() is None, reason="needs Linux with glibc")
def test_reuse_host_memory_removes_page_faults_of_large_blocks():
    applied, faults_default = _probe("default")
    assert applied == "None"
    # glibc's default: each 64 MB block is a fresh mmap, 16,384 pages touched anew
    assert faults_default >= 3 * (64 << 20) // 4096 // 2
    applied, faults_reuse = _probe("reuse")
    assert applied == "True"
    assert faults_reuse < 100


def test_reuse_host_memory_is_exported_and_idempotent_in_a_subprocess():
    code = "import polymask; print(polymask.reuse_host_memory(), polymask.reuse_host_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    expected = "True" if hostmem._glibc() is not None else "False"
    assert out == [expected, expected]
    assert polymask.reuse_host_memory is hostmem.reuse_host_memory


@pytest.mark.parametrize("value, wanted", [
    (None, True), ("1", True), ("on", True), ("off", False), ("0", False), ("False", False),
    ("no", False), ("", False),
])
def test_reuse_host_memory_wanted_reads_the_environment(monkeypatch, value, wanted):
    if value is None:
        monkeypatch.delenv("POLYMASK_REUSE_HOST_MEMORY", raising=False)
    else:
        monkeypatch.setenv("POLYMASK_REUSE_HOST_MEMORY", value)
    assert hostmem.reuse_host_memory_wanted() is wanted


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("yes", True),
                                      ("/some/dir", True), ("0", False), (" OFF ", False),
                                      ("false", False), ("No", False), ("none", False),
                                      ("", False)])
def test_every_polymask_switch_reads_off_values_alike(monkeypatch, value, on):
    from polymask.runners import compile_cache as cache
    from polymask.runners import envvars, hostmem

    for name in ("POLYMASK_TIERED", "POLYMASK_REUSE_HOST_MEMORY", "POLYMASK_CACHE_DIR"):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert envvars.env_switch("POLYMASK_TIERED") is on
    assert hostmem.reuse_host_memory_wanted() is on
    assert polymask.jit(lambda x: x, "n").tiered is on
    assert (cache.default_cache_dir() is not None) is on
