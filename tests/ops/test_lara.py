"""LARA (ops/lara.py): the linear estimator against its naive reference (outputs and gradients,
fp64), padding, landmarks, and the approximation of softmax attention (the paper's section 5.1
kind of test: the mean squared error to exact softmax attention on fixed q, k, v).

Layouts: q, k, v ``[B, H, T, K]`` (queries and keys scaled: softmax attention is
``softmax(q k^T) v``), noise ``[H, C, K]`` or ``[B, H, C, K]``, key_padding_mask ``[B, T]``.
"""
import pytest
import torch

from rfa_fairseq.ops.feature_maps import favor_features, sample_random_matrix
from rfa_fairseq.ops.lara import lara, naive_lara, randomized_attention, segment_landmarks, softmax_attention


def heads(gen, B, H, T, K, scale=0.7):
    return [torch.randn(B, H, T, K, generator=gen, dtype=torch.float64) * s for s in (scale, scale, 1.0)]


def left_padding(lengths, T):
    """fairseq's source layout: padding on the left; True at padding."""
    return torch.stack([torch.arange(T) < T - n for n in lengths])


@pytest.mark.parametrize("B,T,K,C,lengths", [
    (1, 7, 3, 3, None),
    (2, 9, 4, 4, (9, 5)),      # a padded row
    (2, 5, 3, 8, (5, 2)),      # more landmarks than positions: one-position segments, empty ones left out
], ids=["no-pad", "left-pad", "C>T"])
@pytest.mark.parametrize("noise_rows", [False, True], ids=["shared-noise", "per-row-noise"])
def test_lara_equals_naive_reference(gen, B, T, K, C, lengths, noise_rows):
    H = 2
    q, k, v = heads(gen, B, H, T, K)
    mask = None if lengths is None else left_padding(lengths, T)
    noise = torch.randn(*((B,) if noise_rows else ()), H, C, K, generator=gen, dtype=torch.float64)
    out = lara(q, k, v, noise, mask)
    ref = naive_lara(q, k, v, noise, mask)
    assert out.dtype == torch.float64 and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_lara_gradients_equal_naive_reference(gen):
    B, H, T, K, C = 2, 1, 6, 3, 3
    q, k, v = (x.requires_grad_() for x in heads(gen, B, H, T, K))
    noise = torch.randn(H, C, K, generator=gen, dtype=torch.float64)
    mask = left_padding((6, 4), T)
    w = torch.randn(B, H, T, K, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((lara(q, k, v, noise, mask) * w).sum(), (q, k, v))
    ref = torch.autograd.grad((naive_lara(q, k, v, noise, mask) * w).sum(), (q, k, v))
    for name, g, r in zip("qkv", grads, ref):
        assert r.abs().max() > 0, name
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10, msg=lambda m: f"d/d{name}: {m}")
    assert torch.autograd.gradcheck(lambda a, b, c: lara(a, b, c, noise, mask), (q, k, v))


def test_lara_padding_invariance(gen):
    """Appending (or prepending) padding changes no output at the real positions."""
    H, T, K, C = 2, 10, 4, 4
    q, k, v = heads(gen, 1, H, T, K)
    noise = torch.randn(H, C, K, generator=gen, dtype=torch.float64)
    base = lara(q, k, v, noise)
    junk = [torch.randn(1, H, 5, K, generator=gen, dtype=torch.float64) * 50 for _ in range(3)]
    right = lara(*(torch.cat([x, j], 2) for x, j in zip((q, k, v), junk)), noise,
                 torch.arange(T + 5).unsqueeze(0) >= T)
    left = lara(*(torch.cat([j, x], 2) for x, j in zip((q, k, v), junk)), noise,
                torch.arange(T + 5).unsqueeze(0) < 5)
    torch.testing.assert_close(right[:, :, :T], base, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(left[:, :, 5:], base, rtol=1e-12, atol=1e-12)


def test_segment_landmarks_are_segment_means():
    x = torch.arange(10.0).reshape(1, 1, 10, 1)
    mask = torch.tensor([[True, True] + [False] * 8])  # 8 real positions 2..9
    land, present = segment_landmarks(x, mask, 3)
    # ranks 0..7 -> segments floor(3 r / 8): [0, 0, 0], [1, 1, 1], [2, 2]
    assert land.flatten().tolist() == [3.0, 6.0, 8.5] and present.all()
    land, present = segment_landmarks(x, mask, 12)
    assert int(present.sum()) == 8 and sorted(land[0, 0, present[0], 0].tolist()) == list(range(2, 10))


def test_lara_is_finite_with_large_logits(gen):
    """Everything is in log space: logits in the hundreds neither overflow nor divide by zero."""
    q, k, v = heads(gen, 1, 2, 16, 8, scale=6.0)
    out = lara(q.float(), k.float(), v.float(), torch.randn(2, 4, 8, generator=gen))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_randomized_attention_is_unbiased(gen):
    """RA's mean over many samples tends to softmax attention: its error falls like 1/S."""
    q, k, v = heads(gen, 1, 1, 12, 4, scale=0.8)
    mask = left_padding((10,), 12)
    exact = softmax_attention(q, k, v, mask)
    mse = [((randomized_attention(q, k, v, s, mask, generator=gen) - exact)[:, :, 2:] ** 2).mean().item()
           for s in (1, 4000)]
    assert mse[1] < mse[0] / 300 and mse[1] < 1e-3, mse


# The approximation tests (the paper's section 5.1 kind: MSE to exact softmax attention on fixed
# q, k, v; length 256, head dim 64, four heads). "regional": queries and keys like a pretrained
# model's, sixteen contiguous regions whose tokens share a direction (attention mostly within the
# region); "random": i.i.d. Gaussian heads with logits of standard deviation about 1 or 1.5.
T, K, REGIONS, HEADS = 256, 64, 16, 4
SAMPLES = (4, 16, 64, 256)


def regional_heads(seed):
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(HEADS, REGIONS, K, generator=g, dtype=torch.float64), dim=-1)
    base = centres[:, torch.arange(T) * REGIONS // T]
    q = base + 0.1 * torch.randn(HEADS, T, K, generator=g, dtype=torch.float64)
    k = base + 0.1 * torch.randn(HEADS, T, K, generator=g, dtype=torch.float64)
    return q[None], k[None], torch.randn(1, HEADS, T, K, generator=g, dtype=torch.float64)


def random_heads(seed, scale):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, HEADS, T, K, generator=g, dtype=torch.float64) * s for s in (scale, scale, 1.0)]


DATA = {"regional": regional_heads, "random-1": lambda seed: random_heads(seed, K ** -0.25),
        "random-1.5": lambda seed: random_heads(seed, 1.5 * K ** -0.25)}


def performer(q, k, v, num_features, g):
    """Performer / RFA as self-normalised importance sampling from N(0, I): the project's FAVOR+
    features (orthogonal rows) on the scaled heads, which estimate exp(q . k)."""
    w = sample_random_matrix("orthogonal", q.shape[1], num_features, q.shape[-1], g).double()
    pq, pk = favor_features(q, w), favor_features(k, w)
    return (pq @ (pk.transpose(-1, -2) @ v)) / (pq @ pk.sum(2, keepdim=True).transpose(-1, -2))


@pytest.fixture(scope="module")
def errors():
    """``errors[data][C] = (LARA sampled, LARA at the proposal means, Performer)``: mean squared
    error to exact softmax attention, averaged over 2 inputs x 3 draws, for LARA with C landmarks
    (C samples: one random sample per proposal, or the proposal means as the authors' code and
    our module evaluate) and Performer with C random features."""
    table = {}
    for name, make in DATA.items():
        table[name] = {}
        for C in SAMPLES:
            cells = []
            for seed in range(2):
                q, k, v = make(seed)
                exact = softmax_attention(q, k, v)
                for draw in range(3):
                    g = torch.Generator().manual_seed(100 * seed + draw)
                    noise = torch.randn(HEADS, C, K, generator=g, dtype=torch.float64)
                    cells.append([((est - exact) ** 2).mean().item() for est in (
                        lara(q, k, v, noise), lara(q, k, v, torch.zeros_like(noise)), performer(q, k, v, C, g))])
            table[name][C] = tuple(sum(c[i] for c in cells) / len(cells) for i in range(3))
    return table


def test_lara_approaches_softmax_as_landmarks_grow(errors):
    """On the regional heads LARA's error falls as C grows (measured: sampled 7e-3 at C = 4, 1.4e-3
    at 64, 5e-4 at 256; at the proposal means 6.6e-4 at 4, 6.6e-5 from 16 on)."""
    sampled = [errors["regional"][c][0] for c in SAMPLES]
    assert sampled[2] < sampled[0] / 3 and sampled[3] < sampled[0] / 10, sampled
    means = [errors["regional"][c][1] for c in SAMPLES]
    assert means[1] < means[0] / 5, means


@pytest.mark.parametrize("data", list(DATA))
def test_lara_beats_performer_at_equal_samples(errors, data):
    """At the proposal means (our evaluation mode) LARA's error is several times below
    Performer's with as many features, for 4 to 64 samples. (At C = T, one landmark per position,
    it is not: each proposal mean q_n + k_n then favours key n itself.)"""
    for C in (4, 16, 64):
        _, means, favor = errors[data][C]
        assert means < favor / 2.5, (C, means, favor)


@pytest.mark.parametrize("data", ["random-1", "random-1.5"])
def test_lara_sampled_is_on_par_with_performer(errors, data):
    """With one random sample per proposal (training mode) LARA is no better than Performer to
    speak of: on the random heads within 1.25x of its error (measured 0.85x to 1.0x). On the
    regional heads it is worse where the proposals line up with the regions (C = 16: each query's
    estimate then rests on the one sample of its region's proposal, about 6x Performer's error),
    which this test leaves as a measured limitation rather than asserting either way."""
    for C in (4, 16, 64):
        sampled, _, favor = errors[data][C]
        assert sampled < 1.25 * favor, (C, sampled, favor)


def test_lara_at_the_proposal_means_is_deterministic_and_close(gen):
    """Noise 0 puts each sample at its proposal's mean: no randomness left, the same output on
    every call, and (regional heads) far closer to softmax attention than one random sample."""
    q, k, v = regional_heads(0)
    exact = softmax_attention(q, k, v)
    zeros = torch.zeros(HEADS, 16, K, dtype=torch.float64)
    assert torch.equal(lara(q, k, v, zeros), lara(q, k, v, zeros))
    sampled = ((lara(q, k, v, torch.randn(HEADS, 16, K, generator=gen, dtype=torch.float64)) - exact) ** 2).mean()
    assert ((lara(q, k, v, zeros) - exact) ** 2).mean() < sampled / 5
