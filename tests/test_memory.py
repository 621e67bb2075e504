"""core/memory.py: a process that frees and allocates the same large tensors every iteration keeps their pages."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from imerge.core.memory import user_allocator

ITERATION = """
import resource, sys, torch
from imerge.core.memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
large = torch.empty(5 << 20)  # 20 MiB: glibc's defaults map it alone, and unmap it when it is freed
address = large.data_ptr()
home = next(rest.split()[-1] if rest.split()[-1] == "[heap]" else "mapping" for span, rest in
            (line.split(None, 1) for line in open("/proc/self/maps"))
            if int(span.split("-")[0], 16) <= address < int(span.split("-")[1], 16))
del large
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def iteration():  # as a backward: two 16 MiB weight gradients made, added into the accumulator, freed
    first = torch.empty(1 << 22).fill_(1.0)
    second = torch.empty(1 << 22).fill_(1.0)
    del first, second
for _ in range(5):
    iteration()
before = faults()
for _ in range(20):
    iteration()
print(kept, home, faults() - before)
"""


def _run(mode: str, **env: str) -> tuple[str, str, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", ITERATION, mode], env={**environ, **env}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kept, home, count = done.stdout.split()
    return kept, home, int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc's malloc only")
def test_a_large_tensor_lives_in_the_heap_and_its_pages_are_reused_not_faulted_in_again() -> None:
    assert _run("default")[:2] == ("None", "mapping")  # glibc's defaults: unmapped when freed
    kept, home, faults = _run("keep")
    assert (kept, home) == ("True", "[heap]")
    pages = 20 * 2 * (16 << 20) // 4096  # every page of both gradients, every iteration
    assert faults < pages // 10, f"{faults} page faults in 20 iterations with the pages kept"


def test_the_users_own_allocator_settings_win() -> None:
    kept, home, _ = _run("keep", MALLOC_MMAP_THRESHOLD_="131072")
    assert (kept, home) == ("False", "mapping")
    assert user_allocator({"MALLOC_MMAP_THRESHOLD_": "65536"}) == "MALLOC_MMAP_THRESHOLD_"
    assert user_allocator({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) == "GLIBC_TUNABLES"
    assert user_allocator({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) == \
        "LD_PRELOAD (jemalloc)"
    assert user_allocator({"LD_PRELOAD": "", "PATH": "/bin"}) is None
