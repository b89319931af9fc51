"""Fixtures for the pure-torch math layer (rfa_fairseq.ops).

Every test draws its data from an explicit ``torch.Generator``; the autouse fixture below also
pins the global RNG so that nothing depends on the order in which tests run.
"""
import pytest
import torch


@pytest.fixture(autouse=True)
def _fixed_global_seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture
def gen():
    """A fresh CPU generator with a fixed seed."""
    g = torch.Generator()
    g.manual_seed(20210101)
    return g


@pytest.fixture(autouse=True)
def _single_thread():
    """These tests run thousands of tiny ops: with several intra-op threads on a busy 2-core
    machine, OpenMP's spinning makes them up to ~100x slower. One thread is fastest here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
