"""Every kernel test runs once per version of the loops this CPU can run: the x86-64-v3 build
(AVX2 + FMA) where the CPU has it, and always the baseline build that other CPUs get."""
import pytest
from rfa_test_utils import has_x86_64_v3

from rfa_fairseq import kernels

LEVELS = ["baseline"] + (["x86-64-v3"] if has_x86_64_v3() else [])


@pytest.fixture(params=LEVELS, autouse=True)
def simd_level(request):
    module = kernels.load()
    before = module.simd()
    module.set_simd(request.param)
    yield request.param
    module.set_simd(before)
