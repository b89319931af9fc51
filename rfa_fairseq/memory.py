"""glibc malloc's mmap threshold, which decides how much of RFA's training memory the CPU gives back.

glibc's malloc serves an allocation below its mmap threshold from its heap and keeps the memory
resident after the block is freed, for reuse; a block at or above the threshold gets a memory map of
its own, returned to the system when freed. The threshold adapts: every freed mapped block up to
32 MiB raises it to that block's size. Causal RFA's chunked training allocates and frees many
medium-sized temporaries (a segment's features and chunk states, a few MiB each), so the threshold
soon rises above them, they land in the heap, and the heap's free holes stay resident: the training
process's resident set then exceeds what torch holds by up to 80%, and exceeds softmax's.
A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, which also switches the adaptation off) keeps the
resident set at what torch holds, but every block above it is mapped afresh and faulted in page by
page, which costs training steps time. ``--rfa-mmap-threshold`` (off by default) sets it when an RFA
decoder is built.
"""
import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own setting, read at startup
_set = None


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc malloc's mmap threshold at ``nbytes`` for the whole process (0: leave malloc as it
    is). Returns whether it was set; not on other C libraries, nor when the environment sets it."""
    global _set
    if nbytes == 0 or nbytes == _set or ENV in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    try:
        ok = ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)) == 1
    except (OSError, AttributeError):
        ok = False
    if ok:
        _set = nbytes
        logger.info(f"glibc malloc: mmap threshold fixed at {nbytes} bytes (--rfa-mmap-threshold; 0 leaves it)")
    return ok
