"""fairseq modules: RFA attention layers with fairseq's incremental-state protocol, the encoder self-attentions
(softmax, RFA, FAVOR+, LARA) behind one builder, and fairseq's softmax attention with leaner decoding caches."""
from .causal_rfa_attention import CausalRFAttention  # noqa: F401
from .cross_rfa_attention import CrossRFAttention  # noqa: F401
from .encoder_attention import ENCODER_ATTENTIONS, EncoderRFAttention, build_encoder_self_attention  # noqa: F401
from .lara_attention import LARAttention  # noqa: F401
from .random_feature_map import RandomFeatureMap  # noqa: F401
from .softmax_attention import SoftmaxCrossAttention  # noqa: F401
