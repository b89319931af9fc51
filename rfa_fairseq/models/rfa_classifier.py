"""Long-text classification: model ``rfa_classifier`` (an encoder-only transformer: the translation model's encoder,
with its ``--encoder-attention``, a pooling of its output and an MLP head) and its Long Range Arena architectures, for
fairseq's own ``sentence_prediction`` task and criterion (``fairseq-train DATA --user-dir rfa_fairseq --task
sentence_prediction --criterion sentence_prediction --num-classes 10 --arch rfa_classifier_lra_listops ...``).

Two documents (LRA's Retrieval): the task joins ``input0`` and ``input1`` into one row ``doc1 </s> [separator] doc2
</s>`` (right-padded), which ``--classifier-head dual`` cuts in two. Pooling ``mean`` averages over the non-padding
positions only (LRA's code includes the padding), so no pooled vector depends on a batch's padding."""
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
import torch.nn as nn
from fairseq.dataclass import ChoiceEnum
from fairseq.models import BaseFairseqModel, register_model, register_model_architecture
from fairseq.models.transformer import Embedding, TransformerConfig
from fairseq.utils import safe_getattr
from omegaconf import II
from torch import Tensor

from ..config import read_fields
from ..validation import divisible_heads, flag, non_negative_int, one_of, positive_int
from .rfa_encoder import EncoderAttentionConfig, RFATransformerEncoder, encoder_attention_config_from

POOLINGS = ("mean", "cls")
CLASSIFIER_HEADS = ("single", "dual")
PAIR_INTERACTIONS = ("nli", "concat")


@dataclass
class RFAClassifierConfig(EncoderAttentionConfig):
    """The classifier's flags: the encoder's attention choices and sizes, the pooling and the head."""
    encoder_layers: int = field(default=4, metadata={"help": "number of encoder layers"})
    encoder_embed_dim: int = field(default=256, metadata={"help": "encoder embedding (model) dimension"})
    encoder_ffn_embed_dim: int = field(default=1024, metadata={"help": "encoder feed-forward inner dimension"})
    encoder_attention_heads: int = field(default=4, metadata={"help": "number of encoder attention heads"})
    encoder_normalize_before: bool = field(default=True, metadata={"help": "pre-norm (as LRA), a final layer norm"})
    encoder_learned_pos: bool = field(default=False, metadata={"help": "learned positions, not LRA's sinusoidal ones"})
    no_scale_embedding: bool = field(default=True, metadata={"help": "no sqrt(dim) scale of embeddings (as LRA)"})
    activation_fn: ChoiceEnum(["relu", "gelu"]) = field(default="gelu", metadata={"help": "FFN activation"})
    dropout: float = field(default=0.1, metadata={"help": "dropout probability"})
    attention_dropout: float = field(default=0.1, metadata={"help": "dropout probability of attention weights"})
    activation_dropout: float = field(default=0.0, metadata={"help": "dropout probability after the FFN activation"})
    classifier_pooling: ChoiceEnum(list(POOLINGS)) = field(default="cls", metadata={
        "help": "what the head reads: cls (the first position, <s>: --init-token 0) or mean (the mean "
                "over the non-padding positions)"})
    classifier_head: ChoiceEnum(list(CLASSIFIER_HEADS)) = field(default="single", metadata={
        "help": "single: one text per example; dual: two documents (input0 and input1), encoded by the "
                "same encoder and compared (LRA's Retrieval)"})
    # nli: the LRA paper's description; concat: LRA's released code
    pair_interaction: ChoiceEnum(list(PAIR_INTERACTIONS)) = field(default="nli", metadata={
        "help": "with --classifier-head dual: the head reads [u, v, u*v, u-v] (nli) or [u, v] (concat)"})
    classifier_mlp_dim: int = field(default=0, metadata={"help": "head MLP size (0: --encoder-ffn-embed-dim, as LRA)"})
    max_positions: int = II("task.max_positions")


class ClassificationHead(nn.Module):
    """LRA's classifier MLP on pooled vectors (Batch x Channel): of one text, or of two documents combined."""

    def __init__(self, input_dim: int, mlp_dim: int, num_classes: int, pair_interaction: Optional[str] = None):
        super().__init__()
        self.pair_interaction = pair_interaction
        if pair_interaction is None:
            self.mlp = nn.Sequential(nn.Linear(input_dim, mlp_dim), nn.ReLU())
        else:
            width = {"nli": 4, "concat": 2}[pair_interaction] * input_dim
            self.mlp = nn.Sequential(nn.Linear(width, mlp_dim), nn.ReLU(), nn.Linear(mlp_dim, mlp_dim // 2), nn.ReLU())
        self.out_proj = nn.Linear(self.mlp[-2].out_features, num_classes)  # after the MLP's last Linear

    def forward(self, u: Tensor, v: Optional[Tensor] = None) -> Tensor:
        if self.pair_interaction == "nli":
            u = torch.cat([u, v, u * v, u - v], dim=-1)
        elif self.pair_interaction == "concat":
            u = torch.cat([u, v], dim=-1)
        return self.out_proj(self.mlp(u))


def split_pairs(src_tokens: Tensor, eos: int, pad: int) -> Tuple[Tensor, Tensor]:
    """Cut right-padded rows ``doc1 </s> doc2 </s> <pad>...`` (Batch x Time) after their first
    ``</s>``; returns the first and the second documents, each Batch x Time', right-padded."""
    is_eos = src_tokens.eq(eos)
    if bool((is_eos.sum(dim=1) < 2).any()):
        raise ValueError("--classifier-head dual needs two documents per example, each ended by </s> "
                         "(binarised input0/ and input1/ folders, as recipes/lra/prepare.py writes them)")
    len1 = is_eos.int().argmax(dim=1) + 1  # up to and including the first </s>
    len2 = src_tokens.ne(pad).sum(dim=1) - len1
    pos = torch.arange(src_tokens.size(1), device=src_tokens.device).unsqueeze(0)
    first = src_tokens.masked_fill(pos >= len1.unsqueeze(1), pad)[:, :int(len1.max())]
    index = (len1.unsqueeze(1) + pos).clamp(max=src_tokens.size(1) - 1)
    return first, src_tokens.gather(1, index).masked_fill(pos >= len2.unsqueeze(1), pad)[:, :int(len2.max())]


@register_model("rfa_classifier", dataclass=RFAClassifierConfig)
class RFAClassifierModel(BaseFairseqModel):
    """Encoder-only classifier for fairseq's ``sentence_prediction`` task (see the module docstring)."""

    def __init__(self, args, encoder: RFATransformerEncoder):
        super().__init__()
        self.args, self.encoder, self.classification_heads = args, encoder, nn.ModuleDict()
        self.pooling, self.dual = str(args.classifier_pooling), str(args.classifier_head) == "dual"

    @classmethod
    def build_model(cls, args, task):
        rfa_classifier_base_architecture(args)  # fill what an older checkpoint's arguments may lack
        for name in ("encoder_layers", "encoder_embed_dim", "encoder_ffn_embed_dim", "encoder_attention_heads",
                     "max_positions"):
            positive_int(flag(name), safe_getattr(args, name))
        non_negative_int(flag("classifier_mlp_dim"), args.classifier_mlp_dim)  # 0: the FFN size
        attention = encoder_attention_config_from(args)  # the checks of the translation model's encoder
        for name, choices in (("classifier_pooling", POOLINGS), ("classifier_head", CLASSIFIER_HEADS),
                              ("pair_interaction", PAIR_INTERACTIONS)):
            one_of(flag(name), safe_getattr(args, name), choices)
        divisible_heads(args.encoder_embed_dim, args.encoder_attention_heads,
                        "--encoder-embed-dim", "--encoder-attention-heads")
        cfg = TransformerConfig.from_namespace(args)
        cfg.max_source_positions = args.max_positions
        dictionary = task.source_dictionary
        embed_tokens = Embedding(len(dictionary), args.encoder_embed_dim, dictionary.pad())
        return cls(args, RFATransformerEncoder(cfg, dictionary, embed_tokens, attention))

    def register_classification_head(self, name, num_classes=None, inner_dim=None, **kwargs):
        """Called by ``sentence_prediction`` with ``--num-classes``; ``inner_dim`` overrides the MLP size."""
        self.classification_heads[name] = ClassificationHead(
            self.args.encoder_embed_dim, inner_dim or self.args.classifier_mlp_dim or self.args.encoder_ffn_embed_dim,
            num_classes, pair_interaction=str(self.args.pair_interaction) if self.dual else None)

    def pooled(self, src_tokens: Tensor) -> Tensor:
        """Encode Batch x Time tokens and pool them to Batch x Channel."""
        dictionary = self.encoder.dictionary
        if self.pooling == "cls" and bool(src_tokens[:, 0].ne(dictionary.bos()).any()):
            raise ValueError("--classifier-pooling cls reads the first position, which must be <s>: train with "
                             "--init-token 0 (and --separator-token 0 for two documents)")
        x = self.encoder(src_tokens, return_all_hiddens=False)["encoder_out"][0]  # Time x Batch x Channel
        if self.pooling == "cls":
            return x[0]
        keep = src_tokens.ne(dictionary.pad()).t().unsqueeze(-1).type_as(x)  # Time x Batch x 1
        return (x * keep).sum(dim=0) / keep.sum(dim=0).clamp(min=1)

    def forward(self, src_tokens: Tensor, src_lengths: Optional[Tensor] = None, features_only: bool = True,
                classification_head_name: Optional[str] = None, **kwargs):
        """Returns (logits Batch x classes, {"pooled": Batch x Channel}) with a head name, else
        (pooled, {}). For two documents "pooled" is [u; v], 2B x Channel."""
        if self.dual:
            pad = self.encoder.dictionary.pad()
            docs = split_pairs(src_tokens, self.encoder.dictionary.eos(), pad)
            width = max(doc.size(1) for doc in docs)  # the first documents, then the second, as one batch
            src_tokens = torch.cat([nn.functional.pad(doc, (0, width - doc.size(1)), value=pad) for doc in docs])
        pooled = self.pooled(src_tokens)
        u, v = pooled.chunk(2, dim=0) if self.dual else (pooled, None)
        if classification_head_name is None:
            return pooled, {}
        return self.classification_heads[classification_head_name](u, v), {"pooled": pooled}

    def max_positions(self):
        return self.encoder.max_positions()

    def upgrade_state_dict_named(self, state_dict, name):
        super().upgrade_state_dict_named(state_dict, name)
        # Register saved heads this model lacks (another --classification-head-name), so strict loading keeps them.
        prefix = name + "." if name else ""
        for key in list(state_dict):
            if key.startswith(prefix + "classification_heads.") and key.endswith(".out_proj.weight"):
                head = key[len(prefix + "classification_heads."):-len(".out_proj.weight")]
                if head not in self.classification_heads:
                    inner = state_dict[prefix + f"classification_heads.{head}.mlp.0.weight"].size(0)
                    self.register_classification_head(head, state_dict[key].size(0), inner_dim=inner)


# ``rfa_classifier`` itself takes the dataclass's defaults; the named architectures fill them with this.
def rfa_classifier_base_architecture(args):
    for name, value in read_fields(RFAClassifierConfig, args).items():
        if name != "max_positions":  # the task's, by interpolation
            setattr(args, name, value)


# Long Range Arena (Tay et al., ICLR 2021; google-research/long-range-arena cd31e5c, base_listops_config.py,
# base_tc_config.py, base_match_config.py): pre-norm, sinusoidal positions, GELU FFN, dropout 0.1, CLS pooling
# and a head MLP as wide as the FFN.
def _lra_architecture(args, embed_dim: int, heads: int, ffn_dim: int, **more):
    for name, value in dict(encoder_layers=4, encoder_embed_dim=embed_dim, encoder_attention_heads=heads,
                            encoder_ffn_embed_dim=ffn_dim, **more).items():
        if safe_getattr(args, name, None) is None:
            setattr(args, name, value)
    rfa_classifier_base_architecture(args)


@register_model_architecture("rfa_classifier", "rfa_classifier_lra_listops")
def rfa_classifier_lra_listops(args):
    """ListOps: 4 layers, 512 dims, 8 heads, FFN 1024; 10 classes, up to 2,000 tokens."""
    _lra_architecture(args, 512, 8, 1024)


@register_model_architecture("rfa_classifier", "rfa_classifier_lra_text")
def rfa_classifier_lra_text(args):
    """Text (byte-level IMDb): 4 layers, 256 dims, 4 heads, FFN 1024; 2 classes."""
    _lra_architecture(args, 256, 4, 1024)


@register_model_architecture("rfa_classifier", "rfa_classifier_lra_retrieval")
def rfa_classifier_lra_retrieval(args):
    """Retrieval (byte-level AAN pairs): 4 layers, 128 dims, 4 heads, FFN 512, the dual head; 2 classes."""
    _lra_architecture(args, 128, 4, 512, classifier_head="dual")
