"""fairseq modules: RFA attention layers with fairseq's incremental-state protocol, the encoder self-attentions
(softmax, RFA, FAVOR+, LARA) behind one builder, and fairseq's softmax attention with leaner decoding caches."""
from .causal_rfa_attention import CausalRFAttention
from .cross_rfa_attention import CrossRFAttention
from .encoder_attention import ENCODER_ATTENTIONS, EncoderRFAttention, build_encoder_self_attention
from .lara_attention import LARAttention
from .random_feature_map import RandomFeatureMap
from .softmax_attention import SoftmaxCrossAttention

__all__ = ["CausalRFAttention", "CrossRFAttention", "ENCODER_ATTENTIONS", "EncoderRFAttention", "LARAttention",
           "RandomFeatureMap", "SoftmaxCrossAttention", "build_encoder_self_attention"]
