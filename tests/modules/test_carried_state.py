"""CausalRFAttention with a CarriedState (stateful language models): blocks chained through the
carried state equal one pass over their concatenation, the state equals the naive reference's,
gradients stay inside the block (truncated BPTT), and the draw is held while a state is carried."""
import pytest
import torch

from rfa_fairseq.modules import CausalRFAttention, RandomFeatureMap
from rfa_fairseq.modules.causal_rfa_attention import CarriedState
from rfa_fairseq.modules.heads import merge_heads
from rfa_fairseq.ops import naive_causal_rfa

C, H = 24, 3
GATES = [pytest.param({}, id="rfa"), pytest.param({"gate": True}, id="gate-convex"),
         pytest.param({"gate": True, "gate_form": "decay", "gate_bias": 2.0}, id="gate-decay")]


def attention(recompute=False, **gate):
    torch.manual_seed(0)
    return CausalRFAttention(C, H, RandomFeatureMap(H, C // H, 40), chunk_size=5, recompute=recompute, **gate)


@pytest.mark.parametrize("recompute", [False, True], ids=["store", "recompute"])
@pytest.mark.parametrize("gate", GATES)
def test_blocks_with_carried_state_equal_one_pass(gate, recompute):
    """fp32, outputs and final state within 1e-5 of one pass over the concatenation (the
    concatenation's own state is the naive reference's)."""
    attn = attention(recompute, **gate).eval()
    x = torch.randn(37, 4, C)
    whole, _ = attn(x)
    q, k, v, log_g = attn._project(x, None)
    _, final = naive_causal_rfa(q, k, v, log_g, return_state=True, convex=attn.convex)
    attn.carry = CarriedState()
    blocks = [attn(x[a:b])[0] for a, b in ((0, 11), (11, 12), (12, 30), (30, 37))]
    torch.testing.assert_close(torch.cat(blocks), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn.carry.state, final, rtol=1e-5, atol=1e-5)
    assert not attn.carry.state.requires_grad


@pytest.mark.parametrize("gate", GATES)
def test_gradients_stop_at_the_carried_state(gate):
    """Training on the second block: outputs and gradients equal the naive reference started from
    the first block's state as a constant (fp64, tight)."""
    attn = attention(**gate).double().eval()
    x1, x2 = torch.randn(9, 2, C, dtype=torch.float64), torch.randn(13, 2, C, dtype=torch.float64, requires_grad=True)
    attn.carry = CarriedState()
    attn(x1)
    start = attn.carry.state.clone()
    out, _ = attn(x2)
    q, k, v, log_g = attn._project(x2, None)
    ref = attn.out_proj(merge_heads(naive_causal_rfa(q, k, v, log_g, state=start,
                                                     convex=attn.convex)))
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    params = [p for p in attn.parameters() if p.requires_grad] + [x2]
    for a, b in zip(torch.autograd.grad(out.square().sum(), params), torch.autograd.grad(ref.square().sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_padding_at_the_end_of_a_block_leaves_the_carried_state():
    """A short last block is right-padded: the pads neither write nor decay the state."""
    attn = attention(gate=True).eval()
    x = torch.randn(6, 2, C)
    attn.carry = CarriedState()
    attn(x[:4])
    short = attn.carry.state
    attn.carry = CarriedState()
    attn(x, key_padding_mask=torch.arange(6)[None, :].expand(2, 6) >= 4)
    torch.testing.assert_close(attn.carry.state, short, rtol=1e-6, atol=1e-6)


def test_training_holds_the_draw_while_a_state_is_carried():
    """In training the feature map redraws at every update; a carried state keeps the draw it
    was written with, and a fresh carry takes the current update's draw."""
    attn = attention().train()
    x = torch.randn(5, 2, C)
    attn.feature_map.set_num_updates(1)
    attn.carry = CarriedState()
    attn(x)
    held = attn.carry.random_matrix.clone()
    torch.testing.assert_close(held, attn.feature_map.random_matrix, rtol=0, atol=0)
    attn.feature_map.set_num_updates(2)
    attn(x)
    assert torch.equal(attn.carry.random_matrix, held)
    attn.carry = CarriedState()
    attn(x)
    assert not torch.equal(attn.carry.random_matrix, held)


def test_carried_state_rows_must_match_the_batch():
    attn = attention().eval()
    attn.carry = CarriedState()
    attn(torch.randn(3, 2, C))
    with pytest.raises(ValueError, match="2 rows but this batch has 3"):
        attn(torch.randn(3, 3, C))


def test_incremental_decoding_ignores_the_carry():
    """Decoding keeps its own state in incremental_state; a carry set on the module is untouched."""
    attn = attention(gate=True).eval()
    attn.carry = CarriedState()
    x = torch.randn(4, 2, C)
    with torch.no_grad():
        state = {}
        for t in range(4):
            attn(x[t:t + 1], incremental_state=state)
    assert attn.carry.state is None
