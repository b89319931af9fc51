"""What the plugin's encoders and decoders share with fairseq's: how a built layer is wrapped."""
from fairseq.distributed import fsdp_wrap
from fairseq.modules.checkpoint_activations import checkpoint_wrapper


def wrap_layer(layer, cfg):
    """As fairseq's transformer wraps its layers: activation checkpointing, then FSDP."""
    if cfg.checkpoint_activations:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not cfg.checkpoint_activations else 0)
