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
