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

The other way back: ``malloc_trim`` returns the free pages inside the heap to the system. It walks
the heap, and the pages it returns fault in again when reused, so calling it at every segment costs
time; ``--rfa-malloc-trim BYTES`` (256 MiB by default) calls it only when more than BYTES of the
resident set is malloc's free memory (the resident set less what ``mallinfo2`` counts in use), in
the forward pass of training, before each causal RFA segment (``trim_free_memory``). The peak of a
training step is at the end of its forward pass; trimming there brings RFA-Gate's resident set
below softmax's for about 5% of the step (docs/benchmarks.md). Trimming in the backward pass too
saved nothing more and cost more than 10% of the step at 2,048 tokens.
"""
import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own setting, read at startup
DEFAULT_MALLOC_TRIM = 256 << 20  # --rfa-malloc-trim
_set = None
_trim_above = _outside = 0
try:  # glibc with mallinfo2 (2.33 and later), else None
    LIBC = ctypes.CDLL("libc.so.6") if platform.libc_ver()[0] == "glibc" else None
    LIBC.mallinfo2.restype = type("MallInfo2", (ctypes.Structure,), {"_fields_": [
        (n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]})
except (OSError, AttributeError):
    LIBC = None


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc malloc's mmap threshold at ``nbytes`` for the whole process (0: leave malloc as it
    is). Returns whether it was set; not on other C libraries, nor when the environment sets it."""
    global _set
    if nbytes == 0 or nbytes == _set or ENV in os.environ or LIBC is None:
        return False
    ok = LIBC.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)) == 1
    if ok:
        _set = nbytes
        logger.info(f"glibc malloc: mmap threshold fixed at {nbytes} bytes (--rfa-mmap-threshold; 0 leaves it)")
    return ok


def set_malloc_trim(nbytes: int) -> bool:
    """From now on trim_free_memory() returns malloc's free memory to the system whenever more than
    ``nbytes`` of it is resident (0: never). Returns whether this system can (glibc 2.33 and later,
    Linux)."""
    global _trim_above, _outside
    can = LIBC is not None and os.path.exists("/proc/self/statm")
    _trim_above = nbytes if can else 0
    if _trim_above:
        _outside = resident_bytes() - live_bytes()
    return can


def resident_bytes() -> int:
    """This process's resident set (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_bytes() -> int:
    """The bytes malloc has handed out and not had back (glibc's mallinfo2)."""
    info = LIBC.mallinfo2()
    return info.uordblks + info.hblkhd  # in use: in the heap, and in blocks of their own


def trim_free_memory() -> bool:
    """``malloc_trim(0)`` if more than set_malloc_trim's bytes are resident but free: the resident set
    less what malloc has in use, less what was resident outside malloc at the last trim (Python's
    own arenas, the libraries). Returns whether it trimmed."""
    global _outside
    if not _trim_above or resident_bytes() - live_bytes() - _outside <= _trim_above:
        return False
    LIBC.malloc_trim(0)
    _outside = resident_bytes() - live_bytes()
    return True
