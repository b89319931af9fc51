"""Cross attention's readout kernel (rfa_fairseq/kernels) against ops.cross_rfa_apply (the
summary) and ops.cross_rfa_apply_keys (the attention form)."""
import pytest
import torch

from rfa_fairseq import kernels
from rfa_fairseq.ops import cross_rfa_apply, cross_rfa_apply_keys, cross_rfa_keys, cross_rfa_state

H, FD, K, S = 3, 40, 8, 5


def _inputs(gen, sources, beams, T, strided):
    k = torch.rand(sources, H, S, FD, generator=gen) / FD ** 0.5  # positive features: a real denominator
    v = torch.randn(sources, H, S, K, generator=gen)
    pad = torch.zeros(sources, S, dtype=torch.bool)
    pad[0, -2:] = True  # a padded source
    B = sources * beams
    if strided:  # [B, H, T, F] as a view of [T, B, H, F]
        q = torch.rand(T, B, H, FD, generator=gen).permute(1, 2, 0, 3)
    else:
        q = torch.rand(B, H, T, FD, generator=gen)
    return q / FD ** 0.5, k, v, pad


@pytest.mark.parametrize("form", ["summary", "attention form"])
@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("strided", [False, True])
def test_cross_readout_equals_the_pytorch_ops(form, beams, T, strided):
    gen = torch.Generator().manual_seed(0)
    q, k, v, pad = _inputs(gen, 2, beams, T, strided)
    if form == "summary":
        state = cross_rfa_state(k, v, pad, packed=True)
        ref = cross_rfa_apply(q, state, eps=1e-2)
    else:
        state = cross_rfa_keys(k, v, pad)
        ref = cross_rfa_apply_keys(q, state, eps=1e-2)
    got = kernels.cross_readout(q, state, eps=1e-2)
    assert got.shape == ref.shape == (2 * beams, H, T, K)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["summary", "attention form"])
def test_cross_readout_clamps_small_and_negative_denominators(form):
    """Sin/cos features can make phi(q).z small or negative: the ratio's denominator is
    max(phi(q).z, eps), as in the reference."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, pad = _inputs(gen, 2, 2, 1, False)
    k = k - k.mean()  # features of both signs
    q[1] = -q[1]
    state = cross_rfa_state(k, v, pad, packed=True) if form == "summary" else cross_rfa_keys(k, v, pad)
    readout = cross_rfa_apply if form == "summary" else cross_rfa_apply_keys
    eps = 0.02
    z = cross_rfa_state(k, v, pad)[1]  # [Bs, H, F]
    den = torch.einsum("sbhtf,shf->sbht", q.reshape(2, 2, H, 1, FD), z)
    assert (den < eps).any() and (den > eps).any()
    torch.testing.assert_close(kernels.cross_readout(q, state, eps=eps), readout(q, state, eps=eps),
                               rtol=1e-5, atol=1e-6)


def test_cross_readout_refuses_bad_arguments_by_name():
    gen = torch.Generator().manual_seed(2)
    q, k, v, pad = _inputs(gen, 2, 2, 1, False)
    Sz = cross_rfa_state(k, v, pad, packed=True)
    kT, v1 = cross_rfa_keys(k, v, pad)
    with pytest.raises(ValueError, match="q must be a 4-d float32 CPU tensor"):
        kernels.cross_readout(q.double(), Sz, 1e-2)
    with pytest.raises(ValueError, match="Sz must be a 4-d float32 CPU tensor"):
        kernels.cross_readout(q, Sz[0], 1e-2)
    with pytest.raises(ValueError, match=r"Sz has shape \[2, 3, 39, 9\]"):
        kernels.cross_readout(q, Sz[:, :, 1:], 1e-2)
    with pytest.raises(ValueError, match=r"v1 has shape \[2, 3, 4, 9\]"):
        kernels.cross_readout(q, (kT, v1[:, :, 1:]), 1e-2)
    with pytest.raises(ValueError, match="3 query rows cannot share 2 source states"):
        kernels.cross_readout(q[:3], Sz, 1e-2)
