"""rfa_fairseq.memory: glibc malloc's mmap threshold, fixed; malloc's free memory, returned."""
import os
import platform
import subprocess
import sys

import pytest

from rfa_fairseq import memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


CHECK = """
import sys, torch
from rfa_fairseq import memory
libc = memory.LIBC
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


TRIM = """
import torch
from rfa_fairseq import memory
assert memory.set_malloc_trim(32 << 20)
blocks = [torch.empty(16 << 10) for _ in range(2000)]  # 64 KiB each: below malloc's mmap threshold, in its heap
for b in blocks:
    b.fill_(1)  # resident
del blocks[::2]  # 62 MiB of holes, kept resident: the heap's top is in use
before = memory.resident_bytes()
print(memory.trim_free_memory(), (before - memory.resident_bytes()) >> 20, memory.trim_free_memory())
"""


def test_trimming_returns_the_free_holes_once_they_pass_the_limit():
    """In a fresh process (a test process's heap has holes of every size): 62 MiB of holes in the
    heap are over a 32 MiB limit, so they go back to the system; right after, nothing is over it."""
    out = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True, check=True)
    trimmed, returned_mib, again = out.stdout.split()
    assert (trimmed, again) == ("True", "False") and int(returned_mib) >= 50


def test_trimming_is_off_until_set(monkeypatch):
    monkeypatch.setattr(memory, "_trim_above", 0)
    assert not memory.trim_free_memory()
    assert memory.set_malloc_trim(1 << 40) and not memory.trim_free_memory()  # far below the limit


def test_building_an_rfa_decoder_passes_the_trim_flag(lm_model, monkeypatch):
    from rfa_fairseq.models import rfa_decoder
    asked = []
    monkeypatch.setattr(rfa_decoder, "set_malloc_trim", asked.append)
    lm_model("--rfa-malloc-trim", "0")
    lm_model()
    assert asked == [0, memory.DEFAULT_MALLOC_TRIM]


def test_causal_rfa_offers_a_trim_before_each_segment_of_the_forward_pass(monkeypatch):
    """Three segments: three trims in the forward pass, none in the backward pass's recomputation nor
    without autograd (decoding, scoring); one for a sequence of one segment."""
    import torch

    from rfa_fairseq.modules import RandomFeatureMap
    from rfa_fairseq.modules import causal_rfa_attention as causal
    calls = []
    monkeypatch.setattr(causal, "trim_free_memory", lambda: calls.append(torch.is_grad_enabled()))
    attn = causal.CausalRFAttention(16, 2, RandomFeatureMap(2, 8, 8), gate=True, chunk_size=2, recompute_segment=4)
    x = torch.randn(10, 2, 16, requires_grad=True)
    out = attn(x)[0]
    assert calls == [True] * 3
    out.sum().backward()
    with torch.no_grad():
        attn(x)
    assert calls == [True] * 3
    attn(x[:4])
    assert calls == [True] * 4
