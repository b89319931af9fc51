"""Loading the kernels: which version of the loops runs, and a build lock left by a killed build."""
import os
import subprocess
import sys
import time

import pytest
from rfa_test_utils import has_x86_64_v3

from rfa_fairseq import kernels


def test_the_wide_loops_run_where_the_cpu_has_them():
    """On a CPU with AVX2 + FMA (x86-64-v3) the library picks the wide loops by itself, in a fresh
    process (GCC's target_clones("arch=haswell"), used before, did not on AMD CPUs: its resolver
    asks whether the CPU is a Haswell, not whether it has the features)."""
    code = "from rfa_fairseq import kernels; print(kernels.simd())"
    chosen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1]
    assert chosen == ("x86-64-v3" if has_x86_64_v3() else "baseline")
    with pytest.raises(RuntimeError, match="simd level must be"):
        kernels.load().set_simd("avx512")


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    """torch's loader waits without end for the lock of a build that was killed."""
    lock = tmp_path / "lock"
    lock.write_text("")
    assert not kernels.clear_stale_lock(str(tmp_path)) and lock.exists()  # a build in progress
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert kernels.clear_stale_lock(str(tmp_path)) and not lock.exists()
    assert not kernels.clear_stale_lock(str(tmp_path))  # nothing to remove
