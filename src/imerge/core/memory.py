"""Keep the memory a process frees for its next iteration, instead of giving it back to the kernel.

glibc's malloc serves a large block (above a threshold that adapts up to 32 MiB) from pages of its own
and gives them back to the kernel when the block is freed; memory freed at the top of the heap goes back
too, beyond a second threshold. A training iteration on the CPU frees and allocates the same large
tensors every time (a 2048 x 2048 layer's weight gradient is 16 MiB), so every iteration faults all of
their pages in again, each cleared by the kernel: 8% of a worker's CPU in ``imerge bench datapath``
before this. Fixing both thresholds keeps those pages in the process (its resident memory stays at its
peak, as with jemalloc or tcmalloc, which PyTorch recommends on the CPU for the same reason).

Pure: no grpc, no redis. The user's choice wins: nothing is changed where glibc's own variables
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``) are set, where another
allocator is preloaded, or where the C library is not glibc (there is no ``mallopt``). GPU memory is
PyTorch's caching allocator's and is not concerned.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): larger blocks are mapped
TRIM_THRESHOLD_BYTES = 1 << 30   # free memory at the heap's top kept up to this much
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def user_allocator(environ: Mapping[str, str]) -> str | None:
    """What of the user's decides the allocator's behaviour (a variable's name, or the preloaded library); None
    if nothing does."""
    for name in USER_SETTINGS:
        if environ.get(name):
            return name
    preload = environ.get("LD_PRELOAD", "")
    return next((f"LD_PRELOAD ({lib})" for lib in ("jemalloc", "tcmalloc", "mimalloc") if lib in preload), None)


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, OSError, ValueError):  # no confstr (Windows), or a C library that does not know it (musl)
        return False


@functools.cache
def keep_freed_memory() -> bool:
    """Fix glibc's thresholds (see the module's doc) unless the user decides them; whether they are fixed now.
    Idempotent: the first call of a process decides."""
    return _apply(os.environ)


def _apply(environ: Mapping[str, str]) -> bool:
    choice = user_allocator(environ)
    if choice is not None:
        log.debug("malloc: left as %s sets it", choice)
        return False
    try:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    except (OSError, TypeError):  # no C library to open by name (Windows)
        mallopt = None
    if mallopt is None or not _glibc():  # another C library's allocator is left alone
        log.debug("malloc: not glibc's; left alone")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    fixed = all(mallopt(option, value) == 1 for option, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                                                                  (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))
    log.debug("malloc: freed memory %s", "kept for reuse" if fixed else "left to glibc's defaults (mallopt refused)")
    return fixed
