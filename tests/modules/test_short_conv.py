"""CausalRFAttention's short convolution (``--rfa-short-conv``): the convolution equals its naive
sum over the last W inputs (outputs and gradients); one pass equals token-by-token steps, blocks
with the carried state and convolution inputs, and checkpointed segments (outputs and gradients);
pads at either end of a sequence leave what the unpadded one gives; the decoding buffers do not
grow."""
import pytest
import torch

from rfa_fairseq.config import rfa_config_from
from rfa_fairseq.modules import CausalRFAttention, RandomFeatureMap

C, H, W = 24, 3, 4


def attention(gate=True, **kw):
    torch.manual_seed(0)
    return CausalRFAttention(C, H, RandomFeatureMap(H, C // H, 40), gate=gate, chunk_size=5, short_conv=W, **kw)


def naive_convolution(attn, qkv, past):
    """out[t] = bias + sum_j w[j] x[t - W + 1 + j] over ``past`` then ``qkv``, one product at a time."""
    inputs = torch.cat([past.transpose(0, 1), qkv])
    weight = attn.conv.weight[:, 0]  # [3C, W]
    out = [attn.conv.bias + sum(weight[:, j] * inputs[t + j] for j in range(W)) for t in range(qkv.size(0))]
    return torch.stack(out)


def test_the_convolution_equals_its_naive_sum_with_gradients():
    attn = attention().double()
    qkv = torch.randn(9, 2, 3 * C, dtype=torch.float64, requires_grad=True)
    past = torch.randn(2, W - 1, 3 * C, dtype=torch.float64, requires_grad=True)
    out, last = attn._convolve(qkv, None, past)
    ref = naive_convolution(attn, qkv, past)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, qkv[-(W - 1):].transpose(0, 1))
    params = [qkv, past, attn.conv.weight, attn.conv.bias]
    for a, b in zip(torch.autograd.grad(out.sin().sum(), params), torch.autograd.grad(ref.sin().sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("gate", [False, True], ids=["rfa", "gate"])
def test_steps_and_blocks_equal_one_pass(gate):
    """Token by token (with a padding mask of no pads, as the decoder passes one) and in blocks with
    the carried state and convolution inputs: the outputs of one pass, and the same final buffers."""
    attn = attention(gate).double().eval()
    x = torch.randn(13, 2, C, dtype=torch.float64)
    with torch.no_grad():
        whole = attn(x)[0]
        stepped, steps = {}, []
        for t in range(13):
            steps.append(attn(x[t:t + 1], key_padding_mask=torch.zeros(2, 1, dtype=torch.bool),
                              incremental_state=stepped)[0])
        blocked = {}
        blocks = [attn(x[a:b], incremental_state=blocked)[0] for a, b in ((0, 2), (2, 3), (3, 13))]
    torch.testing.assert_close(torch.cat(steps), whole, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(torch.cat(blocks), whole, rtol=1e-10, atol=1e-11)
    for name in ("state", "conv"):
        torch.testing.assert_close(attn._get_input_buffer(stepped)[name], attn._get_input_buffer(blocked)[name])
    assert attn._get_input_buffer(stepped)["conv"].shape == (2, W - 1, 3 * C)  # the last W - 1 inputs, whatever T


def test_checkpointed_segments_carry_the_convolution():
    """Segments of 5 tokens (each a checkpoint from the state and inputs before) give one pass's
    outputs and gradients: the parameters', the input's."""
    x = torch.randn(17, 2, C, dtype=torch.float64, requires_grad=True)
    results = []
    for segment in (0, 5):
        attn = attention(recompute_segment=segment).double()
        out = attn(x)[0]
        params = [x] + [p for p in attn.parameters() if p.requires_grad]
        results.append((out, torch.autograd.grad(out.square().sum(), params)))
    (out0, grads0), (out5, grads5) = results
    torch.testing.assert_close(out5, out0, rtol=1e-10, atol=1e-11)
    for a, b in zip(grads5, grads0):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_pads_at_either_end_leave_the_unpadded_results():
    """Left pads (a fresh state): the tokens' outputs are the unpadded row's. Right pads at the end
    of a block: the carried state and convolution inputs are the short block's, so the next block
    continues as it would. A step at a pad leaves both buffers as they were."""
    attn = attention().eval()
    x = torch.randn(8, 2, C)
    with torch.no_grad():
        lead = torch.arange(8)[None, :].expand(2, 8) < 3
        padded = attn(torch.cat([torch.randn(3, 2, C), x[:5]]), key_padding_mask=lead, incremental_state={})[0]
        torch.testing.assert_close(padded[3:], attn(x[:5])[0], rtol=1e-5, atol=1e-6)
        short, long = {}, {}
        attn(x[:5], incremental_state=short)
        attn(torch.cat([x[:5], torch.randn(3, 2, C)]), key_padding_mask=lead.flip(1), incremental_state=long)
        for name in ("state", "conv"):
            torch.testing.assert_close(attn._get_input_buffer(long)[name], attn._get_input_buffer(short)[name])
        before = {k: v.clone() for k, v in attn._get_input_buffer(short).items()}
        attn(torch.randn(1, 2, C), key_padding_mask=torch.ones(2, 1, dtype=torch.bool), incremental_state=short)
        for name in ("state", "conv"):
            torch.testing.assert_close(attn._get_input_buffer(short)[name], before[name])


def test_the_width_is_checked():
    with pytest.raises(ValueError, match="--rfa-short-conv"):
        rfa_config_from(type("Args", (), {"rfa_short_conv": -1})())
    with pytest.raises(ValueError, match="short_conv"):
        CausalRFAttention(C, H, RandomFeatureMap(H, C // H, 40), short_conv=-2)
