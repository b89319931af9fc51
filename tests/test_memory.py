"""rfa_fairseq.memory: glibc malloc's mmap threshold, fixed."""
import os
import platform
import subprocess
import sys

import pytest

from rfa_fairseq import memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


CHECK = """
import ctypes, sys, torch
from rfa_fairseq import memory
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = type("MallInfo2", (ctypes.Structure,), {"_fields_": [
    (n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]})
if sys.argv[1] != "adaptive":
    assert memory.set_mmap_threshold(1 << 20) and not memory.set_mmap_threshold(1 << 20)  # the second: already so
mapped = []
for _ in range(3):
    before = libc.mallinfo2().hblks  # blocks with a memory map of their own
    block = torch.empty(3 << 20, dtype=torch.uint8)
    mapped.append(libc.mallinfo2().hblks - before)
    del block
print(mapped)
"""


@pytest.mark.parametrize("mode, mapped", [("fixed", "[1, 1, 1]"), ("adaptive", "[1, 0, 0]")])
def test_a_fixed_threshold_maps_every_large_block_again(mode, mapped):
    """glibc's adaptive threshold rises to the size of a freed mapped block, so the same size
    allocated again comes from the heap (and stays resident when freed); fixed, every block at or
    above the threshold is mapped, each time. In a fresh process: malloc serves a block from a
    free hole in its heap before it maps one, and a test process has holes of every size."""
    env = {k: v for k, v in os.environ.items() if k != memory.ENV}
    out = subprocess.run([sys.executable, "-c", CHECK, mode], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == mapped


def test_zero_and_the_environment_leave_malloc_alone(monkeypatch):
    monkeypatch.setattr(memory, "_set", None)
    assert not memory.set_mmap_threshold(0)
    monkeypatch.setenv(memory.ENV, "65536")
    assert not memory.set_mmap_threshold(1 << 20)


def test_building_an_rfa_decoder_passes_the_flag(lm_model, monkeypatch):
    """The decoder hands --rfa-mmap-threshold to set_mmap_threshold (recorded here, so this test
    process keeps malloc's adaptive threshold)."""
    from rfa_fairseq.models import rfa_decoder
    asked = []
    monkeypatch.setattr(rfa_decoder, "set_mmap_threshold", asked.append)
    lm_model("--rfa-mmap-threshold", str(2 << 20))
    lm_model()
    assert asked == [2 << 20, 0]
