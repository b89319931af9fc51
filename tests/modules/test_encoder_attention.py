"""Encoder self-attention modules (modules/encoder_attention.py, modules/lara_attention.py): the
builder's interface, rfa/favor against the naive non-causal reference (outputs and gradients),
LARA against its op, padding invariance, errors. Layout: Time x Batch x Channel."""
import pytest
import torch
from fairseq.modules import MultiheadAttention

from rfa_fairseq.modules import ENCODER_ATTENTIONS, EncoderRFAttention, LARAttention, build_encoder_self_attention
from rfa_fairseq.modules.heads import merge_heads, split_heads
from rfa_fairseq.ops import lara, naive_cross_rfa

C, HEADS = 32, 4
LINEAR = ("rfa", "favor", "lara")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(7)


def build(kind, **kw):
    return build_encoder_self_attention(kind, C, HEADS, **kw).double().eval()


def left_padded(lengths, T):
    return torch.stack([torch.arange(T) < T - n for n in lengths])


def test_interface():
    assert ENCODER_ATTENTIONS == ("softmax", "rfa", "favor", "lara")
    softmax = build_encoder_self_attention("softmax", C, HEADS, dropout=0.1)
    assert isinstance(softmax, MultiheadAttention) and softmax.self_attention and softmax.dropout_module.p == 0.1
    assert isinstance(build_encoder_self_attention("rfa", C, HEADS), EncoderRFAttention)
    favor = build_encoder_self_attention("favor", C, HEADS, feature_dim=24, module_id=5)
    assert favor.feature_map.kernel == "favor" and favor.feature_map.num_features == 24
    assert favor.feature_map.module_id == 5
    lara_module = build_encoder_self_attention("lara", C, HEADS, landmarks=5)
    assert isinstance(lara_module, LARAttention) and lara_module.landmarks == 5
    x = torch.randn(6, 3, C)
    for kind in ENCODER_ATTENTIONS:
        out, weights = build_encoder_self_attention(kind, C, HEADS)(
            query=x, key=x, value=x, key_padding_mask=left_padded((6, 4, 1), 6), need_weights=False, attn_mask=None)
        assert out.shape == (6, 3, C) and weights is None and torch.isfinite(out).all(), kind


@pytest.mark.parametrize("kwargs,match", [
    (dict(kind="performer"), "encoder attention must be one of"),
    (dict(kind="lara", landmarks=0), "landmarks"),
    (dict(kind="rfa", feature_dim=0), "feature_dim"),
    (dict(kind="favor", num_heads=5), "divisible"),
])
def test_builder_errors(kwargs, match):
    kwargs = dict(dict(embed_dim=C, num_heads=HEADS), **kwargs)
    with pytest.raises(ValueError, match=match):
        build_encoder_self_attention(**kwargs)


@pytest.mark.parametrize("kind", LINEAR)
def test_linear_kinds_refuse_other_keys_and_masks(kind):
    module = build(kind)
    x = torch.randn(5, 2, C, dtype=torch.float64)
    with pytest.raises(ValueError, match="self-attention"):
        module(x, x.clone(), x)
    with pytest.raises(ValueError, match="attn_mask"):
        module(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.float64))


def naive_encoder_rfa(module, x, mask):
    """The module's numbers from the naive non-causal RFA loop (ops/cross_rfa/naive.py)."""
    heads = [split_heads(proj(x), HEADS) for proj in (module.q_proj, module.k_proj, module.v_proj)]
    phi_q, phi_k = module.feature_map(heads[0]), module.feature_map(heads[1])
    return module.out_proj(merge_heads(naive_cross_rfa(phi_q, phi_k, heads[2], mask, eps=module.eps)))


@pytest.mark.parametrize("kind", ["rfa", "favor"])
@pytest.mark.parametrize("T", [6, 40], ids=["quadratic-form", "summary-form"])
def test_rfa_and_favor_equal_naive_reference(kind, T):
    """Short sources take the [T, T] feature products, long ones the source summary
    (``quadratic_is_cheaper``): both equal the naive loop, outputs and gradients (fp64)."""
    module = build(kind, feature_dim=16)
    x = torch.randn(T, 2, C, dtype=torch.float64, requires_grad=True)
    mask = left_padded((T, T - 3), T)
    out, _ = module(x, x, x, key_padding_mask=mask)
    ref = naive_encoder_rfa(module, x, mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    params = [x, module.q_proj.weight, module.k_proj.weight, module.feature_map.sigma]
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), params)
    ref_grads = torch.autograd.grad((ref * w).sum(), params)
    for g, r in zip(grads, ref_grads):
        assert r.abs().max() > 0
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-9)


def test_lara_module_is_the_op_on_scaled_heads():
    module = build("lara", landmarks=3)
    x = torch.randn(9, 2, C, dtype=torch.float64)
    mask = left_padded((9, 5), 9)
    out, _ = module(x, key_padding_mask=mask)
    K = C // HEADS
    q, k, v = (split_heads(p(x), HEADS) for p in (module.q_proj, module.k_proj, module.v_proj))
    ref = lara(q * K ** -0.25, k * K ** -0.25, v, torch.zeros(HEADS, 3, K, dtype=torch.float64), mask)
    torch.testing.assert_close(out, module.out_proj(merge_heads(ref)), rtol=1e-10, atol=1e-10)


def test_lara_module_samples_in_training_only():
    module = build("lara", landmarks=3)
    x = torch.randn(9, 2, C, dtype=torch.float64)
    assert torch.equal(module(x)[0], module(x)[0])  # eval: the proposal means, deterministic
    module.train()
    torch.manual_seed(0)
    a = module(x)[0]
    b = module(x)[0]
    torch.manual_seed(0)
    assert not torch.allclose(a, b) and torch.equal(module(x)[0], a)  # fresh samples, from torch's seed


@pytest.mark.parametrize("kind", LINEAR)
def test_padding_invariance(kind):
    """Appending or prepending padding (with junk in it) changes no output at the real positions."""
    module = build(kind, **({"landmarks": 4} if kind == "lara" else {}))
    T, pad = 11, 6
    x = torch.randn(T, 1, C, dtype=torch.float64)
    junk = 30 * torch.randn(pad, 1, C, dtype=torch.float64)
    base, _ = module(x)
    right, _ = module(torch.cat([x, junk]), key_padding_mask=torch.arange(T + pad).unsqueeze(0) >= T)
    left, _ = module(torch.cat([junk, x]), key_padding_mask=torch.arange(T + pad).unsqueeze(0) < pad)
    torch.testing.assert_close(right[:T], base, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(left[pad:], base, rtol=1e-10, atol=1e-10)
    # ... and the padding does change the output when it is not masked: the mask is what excludes it.
    unmasked, _ = module(torch.cat([x, junk]))
    assert not torch.allclose(unmasked[:T], base, atol=1e-6)


@pytest.mark.parametrize("kind", ["rfa", "favor"])
def test_random_matrix_redrawn_per_update_and_fixed_in_eval(kind):
    module = build_encoder_self_attention(kind, C, HEADS, module_id=3).train()
    x = torch.randn(8, 2, C)
    module(x)
    first = module.feature_map.random_matrix.clone()
    module.feature_map.set_num_updates(1)
    module(x)
    assert not torch.equal(first, module.feature_map.random_matrix)
    module.eval()
    drawn = module.feature_map.random_matrix.clone()
    module.feature_map.set_num_updates(2)
    module(x)
    assert torch.equal(drawn, module.feature_map.random_matrix)
