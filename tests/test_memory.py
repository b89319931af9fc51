"""rfa_fairseq.memory: glibc malloc's mmap threshold, fixed."""
import ctypes
import platform

import pytest
import torch

from rfa_fairseq import memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


def mapped_blocks() -> int:
    """malloc's count of blocks with a memory map of their own (mallinfo2's hblks)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = type("MallInfo2", (ctypes.Structure,), {"_fields_": [
        (n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]})
    return libc.mallinfo2().hblks


def test_a_fixed_threshold_maps_every_large_block_again(monkeypatch):
    """glibc's adaptive threshold rises to the size of a freed mapped block, so the same size
    allocated again would come from the heap (and stay resident when freed); fixed, every block
    at or above the threshold is mapped, each time."""
    monkeypatch.delenv(memory.ENV, raising=False)
    monkeypatch.setattr(memory, "_set", None)
    assert memory.set_mmap_threshold(1 << 20)
    assert not memory.set_mmap_threshold(1 << 20)  # already so
    for _ in range(3):
        before = mapped_blocks()
        block = torch.empty(3 << 20, dtype=torch.uint8)
        assert mapped_blocks() == before + 1
        del block
    small = torch.empty(1 << 19, dtype=torch.uint8)  # below the threshold: the heap
    assert mapped_blocks() == before
    del small
    assert memory.set_mmap_threshold(memory.RFA_DEFAULT)  # what the models set


def test_zero_and_the_environment_leave_malloc_alone(monkeypatch):
    monkeypatch.setattr(memory, "_set", None)
    assert not memory.set_mmap_threshold(0)
    monkeypatch.setenv(memory.ENV, "65536")
    assert not memory.set_mmap_threshold(1 << 20)


def test_building_an_rfa_decoder_fixes_the_threshold(lm_model, monkeypatch):
    monkeypatch.delenv(memory.ENV, raising=False)
    monkeypatch.setattr(memory, "_set", None)
    lm_model("--rfa-mmap-threshold", str(2 << 20))
    assert memory._set == 2 << 20
    monkeypatch.setattr(memory, "_set", None)
    lm_model("--rfa-mmap-threshold", "0")
    assert memory._set is None
    memory.set_mmap_threshold(memory.RFA_DEFAULT)
