"""Write a copy of an RFA checkpoint with newly drawn random matrices, optionally more of them.

    rfa-redraw-features CKPT OUT --seed 2
    rfa-redraw-features CKPT OUT --seed 2 --causal-feature-dim 256 --cross-feature-dim 512
    rfa-redraw-features CKPT OUT --seed 2 --feature-scale 4     # 4x the features of each

Decoding with other draws (--seed) shows how much of a model's BLEU or perplexity depends on the feature
noise; more features (--*-feature-dim) lower that noise at a higher decoding cost. Only the decoder's
matrices are redrawn, as in training (the checkpoint's --rfa-random-matrix, seeded from --seed and the
module); all else (weights, sigma, optimizer state, a linear encoder's matrices) is kept."""
import argparse

import torch

# importing the package allow-lists what fairseq checkpoints pickle
from ..modules.random_feature_map import draw_seed, feature_map_id
from ..ops import sample_random_matrix
from ..validation import positive_int


def redraw(state: dict, seed: int, causal_dim=None, cross_dim=None, scale: int = 1) -> int:
    """Redraw every random matrix of ``state`` (a loaded checkpoint) in place, with ``causal_dim``
    and ``cross_dim`` random rows (default: ``scale`` times the saved number); returns how many."""
    cfg = state.get("cfg") or {}
    args = cfg.get("model") if isinstance(cfg, dict) else getattr(cfg, "model", None)
    args = state.get("args") if args is None else args  # a legacy checkpoint's
    kind = args.get("rfa_random_matrix") if isinstance(args, dict) else getattr(args, "rfa_random_matrix", None)
    if kind is None:
        raise ValueError("this checkpoint has no RFA model arguments (not an rfa_fairseq model?)")
    weights = state["model"]
    names = sorted(n for n in weights if n.endswith(".feature_map.random_matrix") and n.startswith("decoder."))
    if not names:
        raise ValueError("this checkpoint has no random matrices in its decoder (not an RFA model?)")
    if cross_dim is not None and not any(".encoder_attn." in n for n in names):
        raise ValueError("--cross-feature-dim: this model's cross attention has no random features "
                         "(--cross-attention softmax)")
    dims = {}
    for name in names:
        H, D, K = weights[name].shape
        cross = ".encoder_attn." in name
        new_d = (cross_dim if cross else causal_dim) or scale * D
        dims["rfa_cross_feature_dim" if cross else "rfa_causal_feature_dim"] = new_d
        layer = int(name.split(".layers.")[1].split(".")[0])
        gen = torch.Generator().manual_seed(draw_seed(seed, 0, feature_map_id(layer, cross)))
        weights[name] = sample_random_matrix(str(kind), H, new_d, K, gen).to(weights[name].dtype)
    for flag, value in dims.items():
        if isinstance(args, dict):
            args[flag] = value
        else:
            setattr(args, flag, value)
    return len(names)


def main(argv=None):
    p = argparse.ArgumentParser(prog="rfa-redraw-features", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--seed", type=int, required=True, help="seed of the new draws")
    p.add_argument("--causal-feature-dim", type=int, default=None, help="random features of causal attention")
    p.add_argument("--cross-feature-dim", type=int, default=None, help="random features of cross attention")
    p.add_argument("--feature-scale", type=int, default=1,
                   help="without the two flags above: this many times the saved number of random features")
    args = p.parse_args(argv)
    for flag in ("causal_feature_dim", "cross_feature_dim", "feature_scale"):
        if getattr(args, flag) is not None:
            try:
                positive_int("--" + flag.replace("_", "-"), getattr(args, flag))
            except ValueError as e:
                p.error(str(e))
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
    try:
        n = redraw(state, args.seed, args.causal_feature_dim, args.cross_feature_dim, args.feature_scale)
    except ValueError as e:
        p.error(f"{args.checkpoint}: {e}")
    torch.save(state, args.out)
    print(f"{args.out}: {n} random matrices drawn with seed {args.seed}")


if __name__ == "__main__":
    main()
