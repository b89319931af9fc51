"""Int8Linear (rfa_fairseq/modules/int8_linear.py): int8 weights with one scale per output row,
inputs quantized per row, in plain PyTorch ops; quantize_linears_ swaps a model's linear layers."""
import copy
import io
import warnings

import pytest
import torch
from fairseq.modules import MultiheadAttention
from torch import nn

from rfa_test_utils import needs_int8_kernel

from rfa_fairseq.modules import int8_linear
from rfa_fairseq.inference import quantize_linears_
from rfa_fairseq.modules.int8_linear import Int8Linear, quantize_input

KERNELS = ["int_mm", "blocked"]
pytestmark = needs_int8_kernel


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Which product several rows take: torch._int_mm, or oneDNN's with the blocked weight (the
    module's choice by weight size, moved here so that small layers take either)."""
    if request.param == "blocked" and not int8_linear.has_blocked_kernel():
        pytest.skip("this PyTorch has no oneDNN qlinear")
    monkeypatch.setattr(int8_linear, "_BLOCKED_MIN_NUMEL", 0 if request.param == "blocked" else 2 ** 62)
    return request.param


def took(module, kernel):
    return (module._derived[1] is not None) == (kernel == "blocked")


def make_linear(in_features=96, out_features=80, bias=True, seed=0):
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias).eval()
    if bias:
        nn.init.normal_(linear.bias)
    return linear


def naive_int8(x, module):
    """Dequantize the input (as the module quantizes it) and the weight, then multiply in float."""
    x_u8, m = quantize_input(x.reshape(-1, x.shape[-1]))
    x_deq = (x_u8.float() - 128) * (m / 127)
    out = x_deq @ (module.weight.float() * module.scale[:, None]).T
    out = out if module.bias is None else out + module.bias
    return out.view(*x.shape[:-1], module.out_features)


def test_input_rows_are_quantized_within_half_a_step():
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(7)) * torch.tensor([1, 10, 1e-3, 1, 1, 1])[:, None]
    x[3] = 0
    x_u8, m = quantize_input(x)
    assert x_u8.dtype == torch.uint8 and m.shape == (6, 1)
    torch.testing.assert_close(m[[0, 1, 2, 4, 5]], x.abs().amax(1, keepdim=True)[[0, 1, 2, 4, 5]], rtol=0, atol=0)
    steps = x_u8.int() - 128
    assert steps.abs().amax(1).tolist() == [127, 127, 127, 0, 127, 127]  # each row's largest |x| maps to 127
    assert ((steps * (m / 127) - x).abs() <= m / 254 * (1 + 1e-5)).all()


def test_weight_is_int8_with_one_scale_per_row_each_weight_within_half_a_step():
    linear = make_linear()
    q = Int8Linear.from_float(linear)
    assert q.weight.dtype == torch.int8 and q.weight.shape == linear.weight.shape
    assert q.scale.dtype == torch.float32 and q.scale.shape == (linear.out_features,)
    assert not any(t.is_quantized for t in q.state_dict().values())
    assert torch.equal(q.weight.abs().amax(1), torch.full((linear.out_features,), 127, dtype=torch.int8))
    w = linear.weight.detach()
    torch.testing.assert_close(q.scale, w.abs().amax(1) / 127)
    assert ((q.weight.float() * q.scale[:, None] - w).abs() <= q.scale[:, None] / 2 * (1 + 1e-5)).all()
    assert torch.equal(q.bias, linear.bias.detach())


@pytest.mark.parametrize("shape", [(5, 96), (7, 3, 96), (1, 96), (0, 96)], ids=["N,C", "T,B,C", "one row", "none"])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_is_the_dequantized_product(shape, bias, kernel):
    """The int32 product rescaled is the float product of the dequantized operands (the integer
    products and their sums are exact in float32 below 2**24: 127 * 128 * 96 is)."""
    q = Int8Linear.from_float(make_linear(bias=bias))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    out = q(x)
    assert out.shape == (*shape[:-1], 80) and out.dtype == torch.float32
    torch.testing.assert_close(out, naive_int8(x, q), rtol=1e-5, atol=1e-5)
    assert (q.bias is None) == (not bias)
    assert took(q, kernel)


def test_odd_sizes_and_a_large_layer_take_either_product(kernel):
    for in_features, out_features in [(7, 3), (33, 17), (1024, 512)]:
        q = Int8Linear.from_float(make_linear(in_features, out_features))
        x = torch.randn(9, in_features, generator=torch.Generator().manual_seed(8))
        torch.testing.assert_close(q(x), naive_int8(x, q), rtol=1e-5, atol=1e-4)
        assert took(q, kernel)


def test_the_module_takes_the_blocked_weight_for_large_layers_only():
    small, large = Int8Linear.from_float(make_linear(256, 512)), Int8Linear.from_float(make_linear(512, 1024))
    for q in (small, large):
        q(torch.randn(4, q.in_features))
    assert small._derived[1] is None and (large._derived[1] is not None) == int8_linear.has_blocked_kernel()


def test_forward_stays_within_the_rounding_bound_of_float32():
    """Each weight is off by at most scale_j / 2 and each input by at most x_scale_i / 2, so
    |y_ij - y'_ij| <= (|x_i|_1 * max|w_j| + |w'_j|_1 * max|x_i|) / 254 (w' the dequantized weight);
    the errors being of either sign, the whole output is off by much less: under 2 %."""
    linear = make_linear(256, 64)
    q = Int8Linear.from_float(linear)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, out = linear(x), q(x)
    w = linear.weight.detach()
    w_deq = q.weight.float() * q.scale[:, None]
    bound = (x.abs().sum(1, keepdim=True) * w.abs().amax(1) + x.abs().amax(1, keepdim=True) * w_deq.abs().sum(1)) / 254
    err = (out - ref).abs()
    assert (err <= bound * 1.001 + 1e-6).all()
    assert 0 < (out - ref).norm() / ref.norm() < 0.02


def test_each_row_is_quantized_alone(kernel):
    """A row's result does not depend on the rows beside it (one scale per input row): a decoding
    step gives what the full pass gives for that position, a batch what its sentences alone give
    (one row alone always takes torch._int_mm: both products are exact in int32)."""
    q = Int8Linear.from_float(make_linear())
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(3))
    x[2] *= 100  # a large row beside small ones
    together = q(x)
    alone = torch.cat([q(row[None]) for row in x])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_a_zero_input_row_gives_the_bias(kernel):
    q = Int8Linear.from_float(make_linear())
    x = torch.randn(3, 96)
    x[1] = 0
    out = q(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1], q.bias, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trip(bias, kernel):
    """Only the buffers are saved; a module that already ran (its kernel inputs made from its
    zero weight) takes the loaded weight."""
    q = Int8Linear.from_float(make_linear(bias=bias))
    x = torch.randn(4, 96)
    state = q.state_dict()
    assert set(state) == ({"weight", "scale", "bias"} if bias else {"weight", "scale"})
    fresh = Int8Linear(96, 80, bias=bias).eval()
    assert not fresh(x).abs().any()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.weight, q.weight) and torch.equal(fresh.scale, q.scale)
    torch.testing.assert_close(fresh(x), q(x), rtol=0, atol=0)
    assert took(fresh, kernel)


def test_made_and_run_in_inference_mode(kernel):
    """fairseq-generate may build and run the model under torch.inference_mode (its tensors keep no
    version counters)."""
    with torch.inference_mode():
        q = Int8Linear.from_float(make_linear())
        x = torch.randn(4, 96)
        out = q(x)
    torch.testing.assert_close(out, naive_int8(x, q), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q(x), out, rtol=0, atol=0)
    assert took(q, kernel)


def test_copies_and_pickles_drop_the_blocked_weight(kernel):
    q = Int8Linear.from_float(make_linear())
    x = torch.randn(4, 96)
    out = q(x)
    for clone in (copy.deepcopy(q), torch.load(_saved(q), weights_only=False)):
        assert clone._derived is None
        torch.testing.assert_close(clone(x), out, rtol=0, atol=0)


def _saved(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer


def test_an_int8_layer_does_not_train():
    q = Int8Linear.from_float(make_linear())
    assert not q.training
    with pytest.raises(RuntimeError, match="cannot train"):
        q.train()(torch.randn(2, 96))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.inner = nn.Sequential(nn.ReLU(), nn.Linear(32, 16, bias=False))
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.inner(self.proj(x)))


def toy_model():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(8, 16), Block(), nn.Sequential(Block(), nn.Linear(16, 5))).eval()


def test_quantize_linears_swaps_every_linear_layer_in_place():
    model = toy_model()
    x = torch.randn(3, 4, 8)
    with torch.no_grad():
        ref = model(x)
    n = sum(type(m) is nn.Linear for m in model.modules())
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    assert n == 6
    assert quantize_linears_(model) is model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert [name for name, m in model.named_modules() if isinstance(m, Int8Linear)] == names
    assert model[1].inner[1].bias is None and isinstance(model[1].norm, nn.LayerNorm)
    out = model(x)
    assert 0 < (out - ref).abs().max() < 0.1 * ref.abs().max()


def test_quantize_linears_refuses_training_mode_and_other_devices():
    with pytest.raises(ValueError, match=r"call model\.eval\(\) first"):
        quantize_linears_(toy_model().train())
    with pytest.raises(ValueError, match="CPU only"):
        quantize_linears_(nn.Sequential(nn.Linear(4, 4, device="meta")).eval())



def test_quantize_linears_keeps_fairseq_multihead_attention_working():
    """fairseq's MultiheadAttention would hand its projections' weights to torch's fused attention:
    quantize_linears_ sets its skip_embed_dim_check flag, so it calls the int8 projections."""
    torch.manual_seed(5)
    attn = MultiheadAttention(32, 4, self_attention=True).eval()
    x = torch.randn(6, 2, 32)  # T, B, C
    with torch.no_grad():
        ref, _ = attn(x, x, x, need_weights=False)
        quantize_linears_(attn)
        out, _ = attn(x, x, x, need_weights=False)
    assert attn.skip_embed_dim_check and isinstance(attn.q_proj, Int8Linear) and isinstance(attn.out_proj, Int8Linear)
    assert out.shape == ref.shape and 0 < (out - ref).norm() / ref.norm() < 0.05


def test_quantize_and_forward_raise_no_deprecation_warning():
    """No torch.ao, no quantized dtypes (PyTorch 2.13 deprecates both)."""
    model = toy_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantize_linears_(model)
        model(torch.randn(2, 8))
    deprecations = [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert not deprecations, [str(w.message) for w in deprecations]
    assert all(not t.is_quantized for t in model.state_dict().values())
