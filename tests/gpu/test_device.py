"""The GPU subset: the fast paths and whole-model decoding on an accelerator.

The tests run on CUDA where torch sees a device and on the CPU otherwise (as in CI), so their
logic is checked on every run; ``RFA_TEST_DEVICE`` picks the device explicitly. On a GPU machine
``pytest tests/gpu`` is the subset to run first. References are computed on the CPU in fp64, so a
device's result is compared with something that did not run on it.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from rfa_test_utils import random_tokens

from rfa_fairseq.ops import chunk_causal_rfa, naive_causal_rfa, naive_cross_rfa
from rfa_fairseq.ops.cross_rfa.state import cross_rfa_apply, cross_rfa_state

DEVICE = torch.device(os.environ.get("RFA_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                                reason="RFA_TEST_DEVICE=cuda, but torch sees no CUDA device")


@pytest.fixture(autouse=True)
def exact_matmuls():
    """TF32 would round the fp32 matmuls to 10 bits; these tests compare fp32 results."""
    if DEVICE.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _features(gen, *shape):
    return torch.rand(*shape, generator=gen, dtype=torch.float64) / shape[-1] ** 0.5 + 1e-3


@pytest.mark.parametrize("gated", [False, True])
def test_chunked_causal_rfa_on_the_device_matches_the_naive_loop(gated):
    gen = torch.Generator().manual_seed(0)
    B, H, T, Fd, K = 2, 3, 75, 16, 8
    q, k = _features(gen, B, H, T, Fd), _features(gen, B, H, T, Fd)
    v = torch.randn(B, H, T, K, generator=gen, dtype=torch.float64)
    log_g = F.logsigmoid(torch.randn(B, H, T, generator=gen, dtype=torch.float64) + 2) if gated else None
    inputs = [t for t in (q, k, v, log_g) if t is not None]
    ref_inputs = [t.clone().requires_grad_() for t in inputs]
    dev_inputs = [t.float().to(DEVICE).requires_grad_() for t in inputs]

    def run(fn, ts):
        q_, k_, v_ = ts[:3]
        g_ = ts[3] if gated else None
        out, state = fn(q_, k_, v_, g_)
        S, z = state[..., :-1], state[..., -1]
        (out.sum() + S.sum() + z.sum()).backward()
        return out, S, z

    out_r, S_r, z_r = run(lambda *a: naive_causal_rfa(*a, output_final_state=True), ref_inputs)
    out_d, S_d, z_d = run(lambda *a: chunk_causal_rfa(*a, output_final_state=True, chunk_size=16), dev_inputs)
    assert out_d.device.type == DEVICE.type
    for got, ref in ((out_d, out_r), (S_d, S_r), (z_d, z_r)):
        torch.testing.assert_close(got.detach().cpu().double(), ref.detach(), rtol=1e-4, atol=1e-5)
    for got, ref in zip(dev_inputs, ref_inputs):
        torch.testing.assert_close(got.grad.cpu().double(), ref.grad, rtol=1e-4, atol=1e-4)


def test_cross_rfa_on_the_device_matches_the_naive_loop():
    gen = torch.Generator().manual_seed(1)
    B, H, Tq, S, Fd, K = 3, 2, 4, 9, 16, 8
    q, k = _features(gen, B, H, Tq, Fd), _features(gen, B, H, S, Fd)
    v = torch.randn(B, H, S, K, generator=gen, dtype=torch.float64)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -3:] = True
    ref = naive_cross_rfa(q, k, v, pad)
    state = cross_rfa_state(k.float().to(DEVICE), v.float().to(DEVICE), pad.to(DEVICE))
    got = cross_rfa_apply(q.float().to(DEVICE), state)
    torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("extra", [[], ["--rfa-gate"]], ids=["rfa", "rfa-gate"])
def test_translation_decoding_on_the_device_matches_the_full_pass(translation_model, extra):
    """One token at a time with the state in incremental_state, on the device, equals the full
    forward pass there, and the CPU model's output."""
    task, model = translation_model(*extra)
    model.eval()
    g = torch.Generator().manual_seed(2)
    src = random_tokens(task.source_dictionary, 3, 11, g)
    src[0, :4] = task.source_dictionary.pad()
    lengths = src.ne(task.source_dictionary.pad()).sum(1)
    prev = random_tokens(task.target_dictionary, 3, 60, g)
    prev[:, 0] = task.target_dictionary.eos()
    with torch.no_grad():
        cpu_full, _ = model(src, lengths, prev)
        model.to(DEVICE)
        src, lengths, prev = src.to(DEVICE), lengths.to(DEVICE), prev.to(DEVICE)
        full, _ = model(src, lengths, prev)
        enc = model.encoder(src, src_lengths=lengths)
        state, steps = {}, []
        for t in range(prev.size(1)):
            logits, _ = model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)
            steps.append(logits[:, -1])
        incr = torch.stack(steps, dim=1)
    assert (full - incr).abs().max().item() <= 1e-4
    assert (full.cpu() - cpu_full).abs().max().item() <= 1e-4


def test_bf16_autocast_training_step_on_the_device_is_finite(translation_model):
    task, model = translation_model("--rfa-gate")
    model.train().to(DEVICE)
    g = torch.Generator().manual_seed(3)
    src = random_tokens(task.source_dictionary, 4, 13, g).to(DEVICE)
    lengths = torch.full((4,), 13, device=DEVICE)
    prev = random_tokens(task.target_dictionary, 4, 17, g).to(DEVICE)
    target = random_tokens(task.target_dictionary, 4, 17, g).to(DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        logits, _ = model(src, lengths, prev)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), target.view(-1))
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(gr).all() for gr in grads)


@pytest.mark.parametrize("extra", [["--rfa-gate"], ["--rfa-gate", "--cross-attention", "softmax"]],
                         ids=["rfa-gate", "gate-softmax-cross"])
def test_beam_search_replayed_as_cuda_graphs_equals_eager(translation_model, extra, monkeypatch):
    """--cuda-graphs: beam search over steps replayed as CUDA graphs (on the CPU: their emulation,
    rfa_test_utils.fx_capture) gives the eager hypotheses; sentences finish at different steps, so graphs
    are captured for several batch sizes and state layouts."""
    from fairseq.sequence_generator import SequenceGenerator
    from rfa_fairseq.engines.step_graphs import StepGraphs
    from rfa_test_utils import emulate_cuda_graphs

    task, model = translation_model(*extra, rfa_flags="--cross-attention" not in extra)
    model.eval().to(DEVICE)
    with torch.no_grad():
        model.decoder.output_projection.weight[task.target_dictionary.eos()] *= 3.0
    src = random_tokens(task.source_dictionary, 6, 9, torch.Generator().manual_seed(0))
    src[:, -1] = task.source_dictionary.eos()
    sample = {"id": torch.arange(6), "net_input": {"src_tokens": src.to(DEVICE),
                                                   "src_lengths": torch.full((6,), 9, device=DEVICE)}}
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=30, min_len=1)
    with torch.no_grad():
        eager = gen.forward(sample)
        if DEVICE.type != "cuda":
            emulate_cuda_graphs(monkeypatch)
        model.decoder.step_engine = graphs = StepGraphs(model.decoder)
        graphed = gen.forward(sample)
    assert len(graphs.graphs) >= 2
    for nbest_e, nbest_g in zip(eager, graphed, strict=True):
        for e, g in zip(nbest_e, nbest_g, strict=True):
            assert torch.equal(e["tokens"], g["tokens"])
            assert (e["positional_scores"] - g["positional_scores"]).abs().max().item() <= 1e-5
