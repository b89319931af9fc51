"""The plugin's flags, in one place: every ``--rfa-*`` option with its default and help text.

Both model families read them: the translation model adds them to its argparse parser, the
language model inherits them into its dataclass config (so hydra configs see them too).
"""
from dataclasses import dataclass, field, fields

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from .ops import DEFAULT_EPS, KERNELS, RANDOM_MATRICES
from .modules.encoder_attention import ENCODER_ATTENTIONS
from .ops.causal_rfa import DEFAULT_CHUNK_SIZE, GATE_FORMS


@dataclass
class RFAConfig(FairseqDataclass):
    rfa_causal_feature_dim: int = field(
        default=64,
        metadata={"help": "number of random features D for causal (self) attention; phi has 2D values "
                          "with the gaussian kernel"},
    )
    rfa_cross_feature_dim: int = field(
        default=128, metadata={"help": "number of random features D for cross (encoder-decoder) attention"}
    )
    rfa_kernel: ChoiceEnum(list(KERNELS)) = field(
        default="gaussian",
        metadata={"help": "feature map phi: gaussian (sin/cos random Fourier features, the paper's RFA), "
                          "arccos (order-1 arc-cosine, ReLU features), favor (Performer's positive "
                          "features, exp kernel) or elu (elu(x) + 1, deterministic: no random features, "
                          "phi has head-dim values and the feature-dim flags do not apply)"},
    )
    rfa_random_matrix: ChoiceEnum(list(RANDOM_MATRICES)) = field(
        default="orthogonal",
        metadata={"help": "distribution of the random projection rows: i.i.d. gaussian, or orthogonal "
                          "blocks with chi-distributed norms (lower variance)"},
    )
    rfa_gate: bool = field(
        default=False, metadata={"help": "RFA-Gate: a learned recency gate on causal attention"}
    )
    rfa_gate_form: ChoiceEnum(list(GATE_FORMS)) = field(
        default="convex",
        metadata={"help": "with --rfa-gate: convex, the paper's S = g S + (1 - g) phi(k) v^T, or decay, "
                          "S = g S + phi(k) v^T (the RFA slides, gated linear attention)"},
    )
    rfa_gate_bias: float = field(
        default=2.0,
        metadata={"help": "with --rfa-gate: initial bias of the gate projection; the gate starts near "
                          "sigmoid(bias): 2 (g about 0.88, a memory of about eight tokens; as rfa-doc-mt) "
                          "trained better in our Multi30k study than the paper's 0 (g about 0.5, about two tokens)"},
    )
    rfa_init_sigma: float = field(
        default=1.0,
        metadata={"help": "initial value of the learned per-head, per-dimension scale sigma of the random "
                          "matrix (the inverse kernel width; attention logits ~ sigma^2 q.k on unit q, k)"},
    )
    rfa_eps: float = field(
        default=DEFAULT_EPS,
        metadata={"help": "lower clamp of the RFA denominator phi(q).z (computed in fp32; see "
                          "rfa_fairseq/ops/denominator.py for how it compares with the authors' floor)"},
    )
    rfa_cross_abs_denominator: bool = field(
        default=False,
        metadata={"help": "cross attention clamps |phi(q).z| instead of phi(q).z, as the authors' code does"},
    )
    rfa_cross_norm_rescale: bool = field(
        default=False,
        metadata={"help": "cross attention weights each source key's features by exp(|k|^2 / 2 head_dim), so "
                          "a key's norm (which the unit normalisation of the features drops) sets how much it is "
                          "attended to (rfa-doc-mt's --norm-rescale)"},
    )
    rfa_chunk_size: int = field(
        default=DEFAULT_CHUNK_SIZE,
        metadata={"help": "chunk length of the chunked parallel form of causal RFA used in training"},
    )
    rfa_recompute: bool = field(
        default=False,
        metadata={"help": "in training, keep only q, k, v of the decoder's RFA attention for the backward pass "
                          "and compute the random features and the attention again there (training memory about "
                          "0.6-0.9x of the default, for a second forward pass of the attention; see docs/benchmarks.md)"},
    )


RFA_FIELDS = tuple(f.name for f in fields(RFAConfig) if f.name.startswith("rfa_"))
# Flags of earlier releases that no longer change anything; checkpoints saved with them still load
# (drop_removed_fields takes them out of the saved arguments before the model is built).
REMOVED_FIELDS = ("rfa_decode_kernel",)
_DEFAULTS = RFAConfig()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def fill_rfa_defaults(args):
    """Architecture helper: set every missing ``rfa_*`` attribute to its default."""
    for name in RFA_FIELDS:
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(_DEFAULTS, name))


def drop_removed_fields(args):
    """Remove :data:`REMOVED_FIELDS` from a checkpoint's model arguments (a namespace or config)."""
    for name in REMOVED_FIELDS:
        if name in getattr(args, "__dict__", {}):
            delattr(args, name)
        elif hasattr(args, "pop") and name in args:
            args.pop(name)


def rfa_config_from(args) -> RFAConfig:
    """Read and validate the ``rfa_*`` options from a namespace, dataclass or DictConfig.

    Raises ValueError naming the offending flag."""
    values = {}
    for name in RFA_FIELDS:
        value = getattr(args, name, None)
        values[name] = getattr(_DEFAULTS, name) if value is None else value
    for name in ("rfa_causal_feature_dim", "rfa_cross_feature_dim", "rfa_chunk_size"):
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag(name)} must be a positive integer, got {v!r}")
    for name in ("rfa_init_sigma", "rfa_eps"):
        v = values[name]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or v != v or v == float("inf"):
            raise ValueError(f"{flag(name)} must be a positive finite number, got {v!r}")
    values["rfa_kernel"] = str(values["rfa_kernel"])
    values["rfa_random_matrix"] = str(values["rfa_random_matrix"])
    if values["rfa_kernel"] not in KERNELS:
        raise ValueError(f"--rfa-kernel must be one of {', '.join(KERNELS)}, got {values['rfa_kernel']!r}")
    if values["rfa_random_matrix"] not in RANDOM_MATRICES:
        raise ValueError(
            f"--rfa-random-matrix must be one of {', '.join(RANDOM_MATRICES)}, got {values['rfa_random_matrix']!r}"
        )
    values["rfa_gate_form"] = str(values["rfa_gate_form"])
    if values["rfa_gate_form"] not in GATE_FORMS:
        raise ValueError(f"--rfa-gate-form must be one of {', '.join(GATE_FORMS)}, got {values['rfa_gate_form']!r}")
    v = values["rfa_gate_bias"]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or abs(v) == float("inf"):
        raise ValueError(f"--rfa-gate-bias must be a finite number, got {v!r}")
    values["rfa_gate"] = bool(values["rfa_gate"])
    # Without the gate, a bias other than a default (2 now, 0 before: a checkpoint's saved arguments
    # carry the default of its day) can only be a mistake.
    if not values["rfa_gate"] and (values["rfa_gate_form"] != _DEFAULTS.rfa_gate_form
                                   or values["rfa_gate_bias"] not in (_DEFAULTS.rfa_gate_bias, 0.0)):
        raise ValueError("--rfa-gate-form and --rfa-gate-bias shape the gate: they need --rfa-gate")
    values["rfa_cross_abs_denominator"] = bool(values["rfa_cross_abs_denominator"])
    values["rfa_cross_norm_rescale"] = bool(values["rfa_cross_norm_rescale"])
    values["rfa_recompute"] = bool(values["rfa_recompute"])
    return RFAConfig(**values)


DECODER_ATTENTIONS = ("rfa", "softmax")
CROSS_ATTENTIONS = ("rfa", "softmax")
# the --rfa-* flags that shape RFA cross attention only
RFA_CROSS_FIELDS = ("rfa_cross_feature_dim", "rfa_cross_abs_denominator", "rfa_cross_norm_rescale")


@dataclass
class TranslationAttentionConfig(FairseqDataclass):
    """Which attention the translation model's encoder and decoder use (``rfa_transformer`` only).

    Not ``--rfa-*`` flags: they choose between attentions, and the ``--rfa-*`` flags shape the RFA
    decoder. A checkpoint saved before these flags existed has a softmax encoder and an RFA decoder
    with RFA cross attention: it loads with the defaults but ``cross_attention="rfa"`` (the model
    says so by name when it is loaded without)."""

    encoder_attention: ChoiceEnum(list(ENCODER_ATTENTIONS)) = field(
        default="softmax",
        metadata={"help": "the encoder's self-attention, non-causal over the source with padding excluded: softmax "
                          "(fairseq's, quadratic in the source length), rfa (random Fourier features with a learned "
                          "sigma, as the RFA decoder), favor (Performer's positive random features) or lara (linear "
                          "randomized attention, Zheng et al. 2022, from --lara-landmarks landmarks); the linear "
                          "kinds form no attention probabilities, so --attention-dropout does not apply to them"},
    )
    encoder_feature_dim: int = field(
        default=64,
        metadata={"help": "random features D per head of --encoder-attention rfa (phi has 2D values) or favor"},
    )
    lara_landmarks: int = field(
        default=16,
        metadata={"help": "landmarks C per head of --encoder-attention lara: segment means of the source's queries and "
                          "keys, one proposal and one sample each (cost O(source length x C) per head)"},
    )
    decoder_attention: ChoiceEnum(list(DECODER_ATTENTIONS)) = field(
        default="rfa",
        metadata={"help": "the decoder's attention: rfa (causal RFA self-attention shaped by the --rfa-* flags, "
                          "cross attention as --cross-attention says) or softmax (fairseq's own decoder; the --rfa-* "
                          "flags then must keep their defaults)"},
    )
    cross_attention: ChoiceEnum(list(CROSS_ATTENTIONS)) = field(
        default="softmax",
        metadata={"help": "the RFA decoder's cross attention: softmax (fairseq's, over the cached encoder output: its "
                          "cost per step grows with the source length, not the output length; the better BLEU, see "
                          "docs/quality.md) or rfa (the paper's: random features, a source summary of fixed size). "
                          "A checkpoint saved without this choice has rfa: --model-overrides "
                          "\"{'cross_attention': 'rfa'}\" loads it"},
    )


ATTENTION_FIELDS = tuple(f.name for f in fields(TranslationAttentionConfig))
_ATTENTION_DEFAULTS = TranslationAttentionConfig()


def fill_attention_defaults(args):
    """Architecture helper of the translation model: set every missing attention choice
    (:data:`ATTENTION_FIELDS`) to its default, as :func:`fill_rfa_defaults` does for ``rfa_*``."""
    for name in ATTENTION_FIELDS:
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(_ATTENTION_DEFAULTS, name))


def attention_config_from(args) -> TranslationAttentionConfig:
    """Read and validate the attention choices (and, with a softmax decoder, that no ``--rfa-*``
    flag was changed). Raises ValueError naming the offending flag."""
    values = {}
    for name in ATTENTION_FIELDS:
        value = getattr(args, name, None)
        values[name] = getattr(_ATTENTION_DEFAULTS, name) if value is None else value
    for name, choices in (("encoder_attention", ENCODER_ATTENTIONS), ("decoder_attention", DECODER_ATTENTIONS),
                          ("cross_attention", CROSS_ATTENTIONS)):
        values[name] = str(values[name])
        if values[name] not in choices:
            raise ValueError(f"{flag(name)} must be one of {', '.join(choices)}, got {values[name]!r}")
    for name in ("encoder_feature_dim", "lara_landmarks"):
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag(name)} must be a positive integer, got {v!r}")
    encoder = values["encoder_attention"]
    if encoder not in ("rfa", "favor") and values["encoder_feature_dim"] != _ATTENTION_DEFAULTS.encoder_feature_dim:
        raise ValueError(f"--encoder-feature-dim sets the random features of --encoder-attention rfa or favor; "
                         f"it does nothing with --encoder-attention {encoder}"
                         + (" (LARA's samples are its landmarks: --lara-landmarks)" if encoder == "lara" else ""))
    if encoder != "lara" and values["lara_landmarks"] != _ATTENTION_DEFAULTS.lara_landmarks:
        raise ValueError(f"--lara-landmarks needs --encoder-attention lara (got --encoder-attention {encoder})")
    if values["decoder_attention"] == "softmax":
        _refuse_changed(args, RFA_FIELDS, "the RFA decoder", "with --decoder-attention softmax the decoder is fairseq's own")
        if values["cross_attention"] != "softmax":
            raise ValueError("--cross-attention rfa shapes the RFA decoder; with --decoder-attention softmax the "
                             "decoder, its cross attention too, is fairseq's own (a checkpoint saved with both loads "
                             "with --model-overrides \"{'cross_attention': 'softmax'}\")")
    if values["cross_attention"] == "softmax":
        _refuse_changed(args, RFA_CROSS_FIELDS, "RFA cross attention",
                        "with --cross-attention softmax (the default) the cross attention is fairseq's own (a "
                        "checkpoint saved without a --cross-attention choice has rfa: --model-overrides "
                        "\"{'cross_attention': 'rfa'}\" loads it)")
    return TranslationAttentionConfig(**values)


def _refuse_changed(args, names, shaped: str, why: str):
    """ValueError naming every ``--rfa-*`` flag of ``names`` set away from its default: it would
    shape a part (``shaped``) that the chosen attention does not have."""
    changed = [flag(name) for name in names
               if getattr(args, name, None) is not None and getattr(args, name) != getattr(_DEFAULTS, name)]
    if changed:
        raise ValueError(f"{', '.join(changed)} shape{'s' if len(changed) == 1 else ''} {shaped}; {why}")
