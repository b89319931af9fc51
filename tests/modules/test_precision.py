"""Low-precision behaviour: long incremental decoding and training steps in fp32, fp16 and bf16.

(a) CausalRFAttention cast with ``.to(dtype)`` decodes 16384 tokens one at a time (fairseq's
incremental state, eval mode, no grad). The state ``(S, z)`` must stay fp32 and of constant size,
the outputs finite and in the module dtype, and close to an fp64 reference: the same weights
(the module cast to the dtype, then to fp64) and inputs, run over the whole sequence at once by
the chunked parallel form (a different algorithm). Rounding the weights themselves is fairseq's
cast, not this code's, and moves the outputs by an amount that depends on the draw (up to 16 u
seen in bf16, where sin/cos of a rounded random projection amplify it). Tolerances are in units
of the dtype's unit roundoff u (fp32 2^-24, fp16 2^-11, bf16 2^-8; 16 u allowed, up to 9 u seen):
rounding the activations to the dtype perturbs every linear layer by O(u) relative, and the fp32 state adds
at most 16384 * 2^-24 ~ 1e-3 relative in the worst case
(about sqrt(16384) * 2^-24 ~ 1e-5 typically). A state kept in fp16/bf16 instead would stop
growing once z is ~2^11 (fp16) or ~2^8 (bf16) times its increments, an O(1) error.

(b) One training step (forward + backward) of the tiny LM and translation models converted with
``.half()`` / ``.to(torch.bfloat16)``: loss and every gradient finite, also in an adversarial
regime where sigma = 20 makes the random-feature kernel estimates ~0 and the denominator clamp
(eps) is active at a large fraction of positions.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from rfa_test_utils import random_tokens
from rfa_fairseq.modules import CausalRFAttention, CrossRFAttention, RandomFeatureMap
from rfa_fairseq.modules.heads import merge_heads, split_heads
from rfa_fairseq.ops import chunk_causal_rfa, cross_rfa_apply, cross_rfa_state

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
GATES = [pytest.param(False, id="rfa"), pytest.param(True, id="gate")]


@pytest.fixture(autouse=True)
def _single_thread():
    """Thousands of tiny ops: one intra-op thread is fastest on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- (a) long decoding

STEPS = 16384
BATCH, EMBED, HEADS, FEATURES = 2, 32, 4, 64
HEAD_DIM, PHI_DIM = EMBED // HEADS, 2 * FEATURES  # Gaussian map: 2D values per feature


@pytest.fixture(scope="module")
def long_run_reference():
    """(gate, dtype) -> (the module in ``dtype``, inputs [STEPS, B, C] in ``dtype``, reference
    outputs and final state in fp64 from the chunked parallel form over the whole sequence)."""
    cache = {}

    def get(gate, dtype):
        if (gate, dtype) not in cache:
            torch.manual_seed(7 if gate else 3)
            attn = CausalRFAttention(EMBED, HEADS, RandomFeatureMap(HEADS, HEAD_DIM, FEATURES), gate=gate).eval()
            attn = attn.to(dtype)
            x = torch.randn(STEPS, BATCH, EMBED, generator=torch.Generator().manual_seed(11)).to(dtype)
            ref_attn = copy.deepcopy(attn).double()
            with torch.no_grad():
                q, k, v, log_g = ref_attn._inputs(x.double(), None)[:4]
                o, state = chunk_causal_rfa(q, k, v, log_g, output_final_state=True, eps=attn.eps,
                                            chunk_size=attn.chunk_size)
                S, z = state[..., :-1], state[..., -1]
                out = ref_attn.out_proj(merge_heads(o))
            cache[gate, dtype] = (attn, x, out, S, z)
        return cache[gate, dtype]

    return get


def _rel_err(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.slow  # 16,384 decoding steps per case
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate", GATES)
def test_16k_step_decoding_stays_finite_bounded_and_accurate(long_run_reference, gate, dtype):
    """The step fairseq-generate takes (without autograd: the gaussian feature map from precomputed weights)."""
    attn, x, ref, S_ref, z_ref = long_run_reference(gate, dtype)
    outs = torch.empty(STEPS, BATCH, EMBED, dtype=dtype)
    state = {}
    checkpoints = {1, 2, 100, 1024, 4096, 8192, STEPS}
    with torch.no_grad():
        for t in range(STEPS):
            o, _ = attn(x[t:t + 1], incremental_state=state)
            outs[t] = o[0]
            if t + 1 in checkpoints:
                buf = attn._get_input_buffer(state)
                # the state, and the spare buffer a beam reorder alternates with
                assert set(buf) <= {"state", "spare_state"}, f"step {t + 1}: state holds {sorted(buf)}"
                S, z = buf["state"][..., :-1], buf["state"][..., -1]
                assert S.dtype == torch.float32 and z.dtype == torch.float32, f"step {t + 1}: {S.dtype}/{z.dtype}"
                assert S.shape == (BATCH, HEADS, PHI_DIM, HEAD_DIM), f"step {t + 1}: S {tuple(S.shape)}"
                assert z.shape == (BATCH, HEADS, PHI_DIM), f"step {t + 1}: z {tuple(z.shape)}"
    assert o.dtype == dtype
    assert torch.isfinite(outs).all(), "non-finite decoder output"
    assert torch.isfinite(S).all() and torch.isfinite(z).all(), "non-finite state"

    # Bounded: RFA's output is a kernel-weighted average of values, whose scale does not grow with
    # t. A lost or underflowing denominator (clamped to eps for good) would instead let
    # |num| / eps grow linearly: ~164x from the first 100 to the last 1000 steps.
    first, last = outs[:100].abs().max().item(), outs[-1000:].abs().max().item()
    assert last <= 50 * first, f"|out| grew from {first:.3g} (first 100 steps) to {last:.3g} (last 1000)"

    # Accurate: against the fp64 chunked pass of the fp32 master module (see the module docstring).
    tol = max(16 * UNIT_ROUNDOFF[dtype], 1e-4)
    err_all = _rel_err(outs, ref)
    err_last = _rel_err(outs[-1000:], ref[-1000:])
    err_S, err_z = _rel_err(S, S_ref), _rel_err(z, z_ref)
    assert err_all <= tol, f"output error {err_all:.3g} > {tol:.3g} (relative to max |ref|)"
    assert err_last <= tol, f"output error over the last 1000 steps {err_last:.3g} > {tol:.3g}"
    assert err_S <= tol and err_z <= tol, f"final state error S {err_S:.3g}, z {err_z:.3g} > {tol:.3g}"


# ----------------------------------------------------------------------------- (b) training steps


def _train_step(kind, task, model, seed=0, loss_scale=1.0):
    """Forward + backward on a random batch, as fairseq's cross-entropy criterion computes it
    (the backward of ``loss * loss_scale``, as fairseq's fp16 loss scaler does).
    Returns (loss, output dtype)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "translation":
        src = random_tokens(task.source_dictionary, 3, 15, g)
        src[0, :5] = task.source_dictionary.pad()  # left-padded source
        lengths = src.ne(task.source_dictionary.pad()).sum(1)
        target = random_tokens(task.target_dictionary, 3, 20, g)
        prev = torch.cat([torch.full((3, 1), task.target_dictionary.eos()), target[:, :-1]], dim=1)
        net = model(src, lengths, prev)
    else:
        tokens = random_tokens(task.dictionary, 3, 21, g)
        target = tokens[:, 1:]
        net = model(tokens[:, :-1])
    lprobs = model.get_normalized_probs(net, log_probs=True)
    loss = F.nll_loss(lprobs.reshape(-1, lprobs.size(-1)), target.reshape(-1))
    (loss * loss_scale).backward()
    return loss, net[0].dtype


def _build(kind, lm_model, translation_model, gate):
    extra = ["--rfa-gate"] if gate else []
    return (translation_model if kind == "translation" else lm_model)(*extra)


def _assert_finite_grads(model, dtype):
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    wrong = [n for n, p in model.named_parameters() if p.grad.dtype != dtype]
    assert not wrong, f"gradients not in {dtype}: {wrong}"
    bad = {n: p.grad.float().abs().max().item() for n, p in model.named_parameters()
           if not torch.isfinite(p.grad).all()}
    assert not bad, f"non-finite gradients: {sorted(bad)}"


KINDS = [pytest.param("lm", id="lm"), pytest.param("translation", id="mt")]
LOW = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_training_step(kind, gate, dtype, lm_model, translation_model):
    task, model = _build(kind, lm_model, translation_model, gate)
    model.train()
    ref_loss, _ = _train_step(kind, task, model)  # fp32, same weights and batch
    model.zero_grad()
    model = model.half() if dtype == torch.float16 else model.to(torch.bfloat16)
    loss, out_dtype = _train_step(kind, task, model)
    assert out_dtype == dtype
    assert torch.isfinite(loss), f"loss {loss.item()}"
    # Same loss up to the dtype's rounding of weights and activations: the loss averages 60 token
    # log-probabilities, so its relative error stays well below u (measured: < 0.1 u).
    assert abs(loss.item() - ref_loss.item()) <= 2 * UNIT_ROUNDOFF[dtype] * abs(ref_loss.item()), \
        f"{dtype} loss {loss.item():.6f} vs fp32 {ref_loss.item():.6f}"
    _assert_finite_grads(model, dtype)


class _ClampedFraction:
    """Forward pre-hooks on every RFA module: the fraction of (query, head) positions whose
    denominator phi(q).z is below eps, i.e. where the guard's clamp is active. Computed in fp32
    with v = 1, for which the op returns den / max(den, eps) (< 1 exactly when clamped)."""

    def __init__(self, model):
        self.fractions = {"self": [], "cross": []}
        self.handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True)
                        for m in model.modules() if isinstance(m, (CausalRFAttention, CrossRFAttention))]

    @torch.no_grad()
    def _hook(self, module, args, kwargs):
        query = kwargs["query"] if "query" in kwargs else args[0]
        if isinstance(module, CausalRFAttention):
            q, k, _, log_g = module._inputs(query, kwargs.get("key_padding_mask"))[:4]
            ratio, _ = chunk_causal_rfa(q, k, q.new_ones(*q.shape[:3], 1), log_g, eps=module.eps)
            self.fractions["self"].append((ratio < 1).float().mean().item())
        else:
            key = kwargs["key"] if "key" in kwargs else args[1]
            q = module.feature_map(split_heads(module.q_proj(query), module.num_heads))
            k = module.feature_map(split_heads(module.k_proj(key), module.num_heads))
            state = cross_rfa_state(k, k.new_ones(*k.shape[:3], 1), kwargs.get("key_padding_mask"))
            ratio = cross_rfa_apply(q, state, eps=module.eps, out_dtype=torch.float32)
            self.fractions["cross"].append((ratio < 1).float().mean().item())

    def remove(self):
        for h in self.handles:
            h.remove()


def _grads_finite(model):
    return all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("kind,dtype", [
    pytest.param("lm", torch.float16, id="lm-fp16"),
    pytest.param("lm", torch.bfloat16, id="lm-bf16"),
    pytest.param("translation", torch.float16, id="mt-fp16"),
    pytest.param("translation", torch.bfloat16, id="mt-bf16"),
])
@pytest.mark.parametrize("gate", GATES)
def test_low_precision_training_step_with_clamped_denominators(kind, dtype, gate, lm_model, translation_model):
    task, model = _build(kind, lm_model, translation_model, gate)
    model = model.half() if dtype == torch.float16 else model.to(torch.bfloat16)
    model.train()
    for m in model.modules():
        if isinstance(m, RandomFeatureMap):
            m.sigma.data.fill_(20.0)  # kernel exp(-400 |q - k|^2 / 2): ~0 off the diagonal
    probe = _ClampedFraction(model)
    # In this regime the true gradient of the translation model exceeds fp16's range (fp32 shows
    # ~2e5 at decoder.layers.0.self_attn.q_proj: two clamped layers, x100 each from 1/eps, x20 from
    # sigma). No fp16 tensor can hold it; fairseq's --fp16 handles this with its dynamic loss
    # scaler, which skips the overflowing step and halves the scale (down to --min-loss-scale
    # 1e-4). Do the same and require a finite step at a scale fairseq would reach.
    scale = 1.0
    try:
        while True:
            model.zero_grad(set_to_none=True)
            loss, out_dtype = _train_step(kind, task, model, loss_scale=scale)
            if dtype != torch.float16 or _grads_finite(model) or scale <= 1e-4:
                break
            scale /= 2
    finally:
        probe.remove()
    assert dtype == torch.float16 or scale == 1.0, "bf16 needs no loss scaling"
    # The regime really is adversarial: the clamp is active at a large share of positions
    # (about half here; with sigma = 1 it is never active in these models).
    for name, fr in probe.fractions.items():
        if fr:
            assert min(fr) >= 0.2, f"{name}-attention clamp active at only {fr} of positions"
    assert probe.fractions["self"] and (kind == "lm" or probe.fractions["cross"])
    assert out_dtype == dtype
    assert torch.isfinite(loss), f"loss {loss.item()}"
    _assert_finite_grads(model, dtype)
