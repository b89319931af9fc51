"""CausalRFAttention carrying its state from block to block, as a stateful language model's
``stream_state`` drives it (several tokens at a time with ``incremental_state`` and the padding
mask): blocks equal one pass over their concatenation, the state equals the naive reference's,
gradients reach the state carried in (the caller detaches it, or not), and pads leave it."""
import pytest
import torch

from rfa_fairseq.modules import CausalRFAttention, RandomFeatureMap
from rfa_fairseq.modules.heads import merge_heads
from rfa_fairseq.ops import naive_causal_rfa

C, H = 24, 3
GATES = [pytest.param({}, id="rfa"), pytest.param({"gate": True}, id="gate-convex"),
         pytest.param({"gate": True, "gate_form": "decay", "gate_bias": 2.0}, id="gate-decay")]


def attention(recompute=False, **gate):
    torch.manual_seed(0)
    return CausalRFAttention(C, H, RandomFeatureMap(H, C // H, 40), chunk_size=5, recompute=recompute, **gate)


def block(attn, x, state, pad=None):
    """One block ``x [T, B, C]`` from the state in ``state`` (a dict), as the decoder passes it."""
    pad = torch.zeros(x.size(1), x.size(0), dtype=torch.bool) if pad is None else pad
    return attn(x, key_padding_mask=pad, incremental_state=state)[0]


def carried(attn, state):
    return attn._get_input_buffer(state)["state"]


@pytest.mark.parametrize("recompute", [False, True], ids=["store", "recompute"])
@pytest.mark.parametrize("gate", GATES)
def test_blocks_with_carried_state_equal_one_pass(gate, recompute):
    """fp32, under autograd: outputs and final state within 1e-5 of one pass over the concatenation
    (the concatenation's own state is the naive reference's)."""
    attn = attention(recompute, **gate).eval()
    x = torch.randn(37, 4, C)
    whole, _ = attn(x)
    _, final = naive_causal_rfa(*attn._inputs(x, None)[:4], output_final_state=True, convex=attn.convex)
    state = {}
    blocks = [block(attn, x[a:b], state) for a, b in ((0, 11), (11, 12), (12, 30), (30, 37))]
    torch.testing.assert_close(torch.cat(blocks), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(carried(attn, state), final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gate", GATES)
def test_gradients_reach_the_carried_state(gate):
    """Training on the second block: outputs and gradients (parameters, the block's input and the
    state carried in) equal the naive reference started from the first block's state (fp64)."""
    attn = attention(**gate).double().eval()
    x1, x2 = torch.randn(9, 2, C, dtype=torch.float64), torch.randn(13, 2, C, dtype=torch.float64, requires_grad=True)
    state = {}
    with torch.no_grad():
        block(attn, x1, state)
    start = carried(attn, state).clone().requires_grad_()
    attn._set_input_buffer(state, {"state": start})
    out = block(attn, x2, state)
    o, _ = naive_causal_rfa(*attn._inputs(x2, None)[:4], initial_state=start, convex=attn.convex)
    ref = attn.out_proj(merge_heads(o))
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    params = [p for p in attn.parameters() if p.requires_grad] + [x2, start]
    grads = torch.autograd.grad(out.square().sum(), params)
    for a, b in zip(grads, torch.autograd.grad(ref.square().sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)
    assert grads[-1].abs().sum() > 0


def test_padding_at_the_end_of_a_block_leaves_the_carried_state():
    """A short last block is right-padded: the pads neither write nor decay the state."""
    attn = attention(gate=True).eval()
    x = torch.randn(6, 2, C)
    short, padded = {}, {}
    with torch.no_grad():
        block(attn, x[:4], short)
        block(attn, x, padded, pad=torch.arange(6)[None, :].expand(2, 6) >= 4)
    torch.testing.assert_close(carried(attn, padded), carried(attn, short), rtol=1e-6, atol=1e-6)
