"""The ``--rfa-*`` flags in one place, with their defaults, help and checks (``rfa_fairseq.validation``'s);
the translation model adds them to its argparse parser, the language model's dataclass config inherits them."""
from dataclasses import dataclass, field, fields
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from .ops import DEFAULT_EPS, KERNELS, RANDOM_MATRICES
from .ops.causal_rfa import DEFAULT_CHUNK_SIZE, DEFAULT_RECOMPUTE_SEGMENT, GATE_FORMS
from .ops.causal_rfa.fla import BACKENDS
from .validation import finite, flag, non_negative_int, one_of, positive_finite, positive_int


@dataclass
class RFAConfig(FairseqDataclass):
    rfa_causal_feature_dim: int = field(default=64, metadata={
        "help": "random features D of causal (self) attention (the gaussian kernel's phi has 2D values)"})
    rfa_cross_feature_dim: int = field(default=128, metadata={
        "help": "number of random features D for cross (encoder-decoder) attention"})
    rfa_kernel: ChoiceEnum(list(KERNELS)) = field(default="gaussian", metadata={
        "help": "feature map phi: gaussian (sin/cos random Fourier features, the paper's RFA), arccos "
                "(order-1 arc-cosine, ReLU features), favor (Performer's positive features, exp kernel) "
                "or elu (elu(x) + 1: no random features, head-dim values, no feature-dim flags)"})
    rfa_random_matrix: ChoiceEnum(list(RANDOM_MATRICES)) = field(default="orthogonal", metadata={
        "help": "random projection rows: i.i.d. gaussian, or orthogonal blocks with chi norms (lower variance)"})
    rfa_fixed_features: bool = field(default=False, metadata={
        "help": "keep the decoder's random matrices drawn at build time, instead of new draws every update"})
    rfa_gate: bool = field(default=False, metadata={"help": "RFA-Gate: a learned recency gate on causal attention"})
    rfa_gate_form: ChoiceEnum(list(GATE_FORMS)) = field(default="convex", metadata={
        "help": "with --rfa-gate: convex, the paper's S = g S + (1 - g) phi(k) v^T, or decay, "
                "S = g S + phi(k) v^T (the RFA slides, gated linear attention)"})
    rfa_gate_bias: float = field(default=2.0, metadata={
        "help": "with --rfa-gate: initial gate bias; g starts near sigmoid(bias): 2 (g ~ 0.88, about eight tokens "
                "of memory; better in our Multi30k study) or the paper's 0 (g ~ 0.5, about two tokens)"})
    rfa_gate_bias_last: Optional[float] = field(default=None, metadata={
        "help": "with --rfa-gate: the last head's initial gate bias, the heads' evenly spaced from --rfa-gate-bias "
                "(the first head's) to it: memories at several scales, about 1 + e^bias tokens each; unset: every "
                "head at --rfa-gate-bias"})
    rfa_short_conv: int = field(default=0, metadata={
        "help": "causal attention: a causal depthwise convolution of this width over q, k and v after their "
                "projection (0: none), what RFA needs to recall (docs/quality.md, Associative recall); decoding keeps "
                "the last width - 1 projections beside the state"})
    rfa_init_sigma: float = field(default=1.0, metadata={
        "help": "initial learned per-head, per-dimension scale sigma (the inverse kernel width: "
                "attention logits ~ sigma^2 q.k on unit q, k)"})
    rfa_eps: float = field(default=DEFAULT_EPS, metadata={
        "help": "lower clamp of the RFA denominator phi(q).z, in fp32 (compared with the authors' "
                "floor in rfa_fairseq/ops/denominator.py)"})
    rfa_chunk_size: int = field(default=DEFAULT_CHUNK_SIZE, metadata={
        "help": "chunk length of the chunked parallel form of causal RFA used in training"})
    rfa_backend: ChoiceEnum(list(BACKENDS)) = field(default="auto", metadata={
        "help": "kernels of causal RFA in training and scoring: torch (the chunked form, any device), fla "
                "(flash-linear-attention's Triton kernels: pip install .[gpu]) or auto (fla on a CUDA device with "
                "fla-core and a Triton fla trains with, else torch; docs/benchmarks.md); decoding steps are torch's"})
    rfa_recompute: bool = field(default=False, metadata={
        "help": "in training, keep only each causal RFA attention's input (cross attention's q, k, v) for the "
                "backward pass, which recomputes the rest (also below --rfa-recompute-segment; docs/benchmarks.md)"})
    rfa_recompute_segment: int = field(default=DEFAULT_RECOMPUTE_SEGMENT, metadata={
        "help": "in training, causal RFA recomputes a longer sequence segment by segment, keeping only each "
                "segment's input and entering state (0: no segments, all intermediates kept unless --rfa-recompute)"})


RETIRED = {  # options the studies retired: a checkpoint that used one is refused by name
    "rfa_softmax_layers": ("softmax self-attention layers in the RFA decoder",
                           "documents take --sentence-index --cross-sentence-window 1"),
    "rfa_local_window": ("an exact window of the last keys in causal RFA",
                         "documents take --sentence-index --cross-sentence-window 1; language models, plain RFA-Gate"),
    "rfa_cross_abs_denominator": ("the authors' absolute denominator in cross attention", "the default guard"),
    "rfa_cross_norm_rescale": ("cross attention's keys weighted by their norms", "softmax cross attention")}
RFA_FIELDS = tuple(f.name for f in fields(RFAConfig) if f.name.startswith("rfa_"))
_DEFAULTS = RFAConfig()


def read_fields(config_class, args) -> dict:
    """The fields of ``config_class`` read from a namespace, dataclass or DictConfig (missing or None: the default)."""
    defaults = config_class()
    return {f.name: getattr(defaults, f.name) if getattr(args, f.name, None) is None else getattr(args, f.name)
            for f in fields(config_class)}


def fill_defaults(config_class, args):
    """Architecture helper: set every missing attribute of ``config_class``'s fields to its default."""
    for name, value in read_fields(config_class, args).items():
        setattr(args, name, value)


def rfa_config_from(args) -> RFAConfig:
    """The ``rfa_*`` options of a namespace, dataclass or DictConfig, validated (ValueError names a bad flag)."""
    values = read_fields(RFAConfig, args)
    for name, (what, instead) in RETIRED.items():  # a checkpoint of a retired option
        if getattr(args, name, None):
            raise ValueError(f"{flag(name)} ({what}) is no longer supported: {instead} (docs/quality.md)")
    for name in ("rfa_causal_feature_dim", "rfa_cross_feature_dim", "rfa_chunk_size"):
        positive_int(flag(name), values[name])
    for name in ("rfa_init_sigma", "rfa_eps"):
        positive_finite(flag(name), values[name])
    finite(flag("rfa_gate_bias"), values["rfa_gate_bias"])
    if values["rfa_gate_bias_last"] is not None:
        values["rfa_gate_bias_last"] = finite(flag("rfa_gate_bias_last"), values["rfa_gate_bias_last"])
    for name, valid in (("rfa_kernel", KERNELS), ("rfa_random_matrix", RANDOM_MATRICES), ("rfa_gate_form", GATE_FORMS)):
        values[name] = one_of(flag(name), values[name], valid)
    for name in ("rfa_gate", "rfa_fixed_features", "rfa_recompute"):
        values[name] = bool(values[name])
    if not values["rfa_gate"] and (values["rfa_gate_form"] != _DEFAULTS.rfa_gate_form
                                   or values["rfa_gate_bias"] != _DEFAULTS.rfa_gate_bias
                                   or values["rfa_gate_bias_last"] is not None):
        raise ValueError("--rfa-gate-form, --rfa-gate-bias and --rfa-gate-bias-last shape the gate: they need "
                         "--rfa-gate")
    for name in ("rfa_recompute_segment", "rfa_short_conv"):
        non_negative_int(flag(name), values[name])
    values["rfa_backend"] = one_of(flag("rfa_backend"), values["rfa_backend"], BACKENDS)
    return RFAConfig(**values)


def refuse_changed(args, names, shaped: str, why: str):
    """ValueError naming each flag of ``names`` set away from its default: it would shape ``shaped``, absent here."""
    changed = [flag(name) for name in names
               if getattr(args, name, None) is not None and getattr(args, name) != getattr(_DEFAULTS, name)]
    if changed:
        raise ValueError(f"{', '.join(changed)} shape{'s' if len(changed) == 1 else ''} {shaped}; {why}")
