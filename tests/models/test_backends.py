"""``--rfa-backend``: the tiny language and translation models give the same loss and gradients on torch's
chunked form and on fla's kernels (Triton's interpreter on a CPU; skipped without fla-core), with padding;
``auto`` picks torch on a CPU; the refusals name the flags."""
import pytest
import torch
import torch.nn.functional as F

from rfa_test_utils import fla_on_this_machine, random_tokens, skip_where_fla_refuses_gated_backward

from rfa_fairseq.modules import CausalRFAttention
from rfa_fairseq.ops.causal_rfa.fla import fla_chosen

GATES = [pytest.param([], id="rfa"), pytest.param(["--rfa-gate"], id="gate"),
         pytest.param(["--rfa-gate", "--rfa-gate-form", "decay"], id="decay")]


def loss_and_grads(model, backend, run):
    for m in model.modules():
        if isinstance(m, CausalRFAttention):
            m.backend = backend
    model.zero_grad()
    loss = run()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        scale = grads_a[name].abs().max().item()
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-4 * scale + 1e-8, msg=name)


@pytest.mark.slow  # Triton's interpreter: about 15 s each on the CPU
@pytest.mark.parametrize("gate", GATES)
def test_lm_loss_and_gradients_equal_across_backends(lm_model, gate):
    fla_on_this_machine()
    skip_where_fla_refuses_gated_backward("--rfa-gate" in gate)
    task, model = lm_model("--rfa-fixed-features", *gate)
    model.train()
    pad = task.dictionary.pad()
    tokens = random_tokens(task.dictionary, 3, 80, torch.Generator().manual_seed(1))
    tokens[1, 50:] = pad  # padding, which must neither write nor decay the state

    def run():
        logits = model(tokens[:, :-1])[0]
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=pad)

    assert_same(loss_and_grads(model, "torch", run), loss_and_grads(model, "fla", run))


@pytest.mark.slow
def test_translation_loss_and_gradients_equal_across_backends(translation_model):
    fla_on_this_machine()
    skip_where_fla_refuses_gated_backward(True)
    task, model = translation_model("--rfa-fixed-features", "--rfa-gate")
    model.train()
    gen = torch.Generator().manual_seed(2)
    src = random_tokens(task.source_dictionary, 2, 30, gen)
    tgt = random_tokens(task.target_dictionary, 2, 70, gen)
    tgt[0, 60:] = task.target_dictionary.pad()
    lengths = torch.full((2,), 30)

    def run():
        logits = model(src, lengths, tgt[:, :-1])[0]
        return F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=task.target_dictionary.pad())

    assert_same(loss_and_grads(model, "torch", run), loss_and_grads(model, "fla", run))


def test_auto_is_torch_on_a_cpu_and_the_flag_reaches_every_layer(lm_model):
    assert not fla_chosen("auto", torch.device("cpu"), gated=True)
    assert fla_chosen("fla", torch.device("cpu"), gated=True) and not fla_chosen("torch", torch.device("cuda"), True)
    _, model = lm_model("--rfa-backend", "torch")
    backends = {m.backend for m in model.modules() if isinstance(m, CausalRFAttention)}
    assert backends == {"torch"}
