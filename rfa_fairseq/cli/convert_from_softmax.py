"""Convert a trained fairseq softmax transformer into the matching RFA model, ready to finetune.

    rfa-convert-from-softmax --input softmax.pt --output rfa.pt [--rfa-gate] [--rfa-* ...]
    fairseq-train DATA --user-dir rfa_fairseq --finetune-from-model rfa.pt --arch <printed arch> ...

The swap of Kasai et al. (2021, "Finetuning Pretrained Transformers into RNNs") for fairseq ``transformer*`` and
``transformer_lm*`` checkpoints: the RFA architecture ``rfa_`` + the source's (else the base one with its dimensions),
its task arguments and every shared weight copied; the RFA parameters (sigma, random matrices, gate) initialised as in a
new model, seeded by ``--seed``; the optimizer state, which belonged to other parameters, dropped."""
import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from fairseq import models
from fairseq.checkpoint_utils import _upgrade_state_dict
from fairseq.data import Dictionary
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer_lm import TransformerLanguageModel
from omegaconf import OmegaConf, open_dict

# importing the package registers the RFA models and allow-lists fairseq's checkpoint classes
from ..config import RFA_FIELDS, RFAConfig, flag, rfa_config_from
from ..models.translation_config import (CROSS_ATTENTIONS, DECODER_ATTENTIONS, TranslationAttentionConfig,
                                         attention_config_from)

# source model class -> the base RFA architecture for source archs with no rfa_ twin
BASE_RFA_ARCH = {TransformerModel: "rfa_transformer", TransformerLanguageModel: "rfa_transformer_lm"}


def load_checkpoint(path) -> dict:
    """The checkpoint, loaded safely and upgraded as fairseq upgrades it (legacy ``args`` become ``cfg``)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{path} is not a fairseq checkpoint (no 'model' entry)")
    if state.get("cfg") is not None:
        state["cfg"] = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
    elif state.get("args") is None:
        raise ValueError(f"{path} has neither 'cfg' nor 'args': not a fairseq checkpoint")
    state.setdefault("extra_state", {})  # fairseq's upgrade expects it
    return _upgrade_state_dict(state)


def _get(cfg, name):
    return cfg.get(name) if OmegaConf.is_config(cfg) or isinstance(cfg, dict) else getattr(cfg, name, None)


def _set(cfg, name, value):
    if OmegaConf.is_config(cfg):
        with open_dict(cfg):
            cfg[name] = value
    else:
        setattr(cfg, name, value)


def rfa_arch_for(model_cfg, weights) -> str:
    """The RFA architecture matching the source's, or a ValueError saying why there is none."""
    arch = _get(model_cfg, "_name") or _get(model_cfg, "arch")
    if "decoder.rfa_version" in weights or str(arch).startswith("rfa_"):
        raise ValueError(f"this checkpoint is already an RFA model (arch {arch}): nothing to convert")
    source = ARCH_MODEL_REGISTRY.get(arch)
    if source not in BASE_RFA_ARCH:
        raise ValueError(
            f"arch {arch!r} ({getattr(source, '__name__', 'not a registered fairseq architecture')}) is not a fairseq "
            "softmax transformer: rfa-convert-from-softmax converts transformer* (translation) and transformer_lm* "
            "checkpoints")
    twin = "rfa_" + arch
    return twin if twin in ARCH_MODEL_REGISTRY else BASE_RFA_ARCH[source]


def _dictionary(size: int) -> Dictionary:
    """A stand-in dictionary of ``size`` symbols: the model needs only its size and special indices."""
    d = Dictionary()
    for i in range(size - len(d)):
        d.add_symbol(f"<w{i}>")
    return d


def _vocab_size(weights, prefix: str) -> int:
    for key in (f"{prefix}.embed_tokens.weight", f"{prefix}.output_projection.weight"):
        if key in weights:
            return weights[key].size(0)
    bands = [v for k, v in weights.items()
             if k.startswith(f"{prefix}.embed_tokens.embeddings.") and k.endswith(".0.weight")]
    if bands:  # adaptive input: one embedding per frequency band
        return sum(b.size(0) for b in bands)
    raise ValueError(f"cannot tell the vocabulary size of {prefix} (no embedding or output projection)")


def stand_in_task(weights, language_model: bool):
    tgt = _dictionary(_vocab_size(weights, "decoder"))
    if language_model:
        return SimpleNamespace(source_dictionary=tgt, target_dictionary=tgt, dictionary=tgt)
    n_src = _vocab_size(weights, "encoder")
    return SimpleNamespace(source_dictionary=tgt if n_src == len(tgt) else _dictionary(n_src), target_dictionary=tgt)


def convert(state: dict, rfa_flags: dict, seed: int = 1, cross_attention: str | None = None,
            decoder_attention: str | None = None):
    """Convert a loaded softmax checkpoint; returns ``(rfa checkpoint, rfa arch, RFA-only names)``.
    ``cross_attention``, ``decoder_attention``: a translation model's, as the flags of the same names
    (default None: the model's defaults, softmax cross attention kept as trained, an RFA decoder)."""
    cfg, weights, source_cfg = state["cfg"], state["model"], state["cfg"].model
    target = rfa_arch_for(source_cfg, weights)
    language_model = target.startswith("rfa_transformer_lm")
    task = stand_in_task(weights, language_model)

    # Loaded strictly: fairseq upgrades old key layouts, and a checkpoint unfit for its own arch fails here, not later.
    source = models.build_model(source_cfg, task, from_checkpoint=True)
    source.load_state_dict(weights, strict=True, model_cfg=source_cfg)

    rfa_cfg = OmegaConf.create(OmegaConf.to_container(source_cfg)) if OmegaConf.is_config(source_cfg) \
        else argparse.Namespace(**vars(source_cfg))
    _set(rfa_cfg, "_name", target)
    if not OmegaConf.is_config(rfa_cfg):
        rfa_cfg.arch = target
    for name in RFA_FIELDS:
        _set(rfa_cfg, name, rfa_flags.get(name))
    rfa = rfa_config_from(rfa_cfg)  # validated, defaults filled
    for name in RFA_FIELDS:
        _set(rfa_cfg, name, getattr(rfa, name))
    if language_model and (cross_attention is not None or decoder_attention is not None):
        raise ValueError("--cross-attention and --decoder-attention apply to translation models")
    if not language_model:
        for name, value in (("cross_attention", cross_attention), ("decoder_attention", decoder_attention)):
            _set(rfa_cfg, name, value or getattr(TranslationAttentionConfig(), name))
        attention_config_from(rfa_cfg)  # validated against the --rfa-cross-* flags
    torch.manual_seed(seed)  # the RFA parameters' initialisation and random-matrix draws
    model = models.build_model(rfa_cfg, task, from_checkpoint=True)

    src, dst, places = source.state_dict(), model.state_dict(), {}
    for name in src:  # causal RFA's in_proj stacks q, k, v (and the gate, which keeps its initialisation)
        layer, proj, part = (name.rsplit(".", 2) + ["", ""])[:3]
        fused = f"{layer}.in_proj.{part}"
        if proj in ("q_proj", "k_proj", "v_proj") and fused in dst:
            rows = src[name].size(0)
            places[name] = dst[fused].narrow(0, "qkv".index(proj[0]) * rows, rows)
        elif name in dst:
            places[name] = dst[name]  # state_dict tensors share the model's storage
    if not_carried := sorted(set(src) - set(places)):
        raise ValueError(f"the RFA model has no place for these source weights: {', '.join(not_carried)}")
    for name, tensor in src.items():
        if places[name].shape != tensor.shape:
            raise ValueError(f"{name}: source shape {tuple(tensor.shape)}, RFA model {tuple(places[name].shape)}")
        places[name].copy_(tensor)
    rfa_only = sorted(set(dst) - set(src))

    # as fairseq's trainer saves it: plain containers, the model arguments a Namespace or a dict
    to_container = lambda c: OmegaConf.to_container(c, resolve=True, enum_to_str=True)  # noqa: E731
    out_cfg = to_container(cfg)
    out_cfg["model"] = to_container(rfa_cfg) if OmegaConf.is_config(rfa_cfg) else rfa_cfg
    last = state["optimizer_history"][-1]
    checkpoint = {
        "args": None, "cfg": out_cfg, "model": model.state_dict(), "criterion": None,
        # fairseq's loader expects one history entry; update 0: finetuning starts here
        "optimizer_history": [{"criterion_name": last.get("criterion_name", "CrossEntropyCriterion"),
                               "optimizer_name": last.get("optimizer_name", "FairseqAdam"),
                               "lr_scheduler_state": {"best": None}, "num_updates": 0}],
        "task_state": {},
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0}, "converted_from_softmax": {
            "arch": str(_get(source_cfg, "_name") or _get(source_cfg, "arch"))}}}
    return checkpoint, target, rfa_only


def main(argv=None):
    parser = argparse.ArgumentParser(prog="rfa-convert-from-softmax", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="fairseq transformer* or transformer_lm* checkpoint")
    parser.add_argument("--output", required=True, help="where to write the RFA checkpoint")
    parser.add_argument("--seed", type=int, default=1, help="seed of the RFA parameters' initialisation and draws")
    parser.add_argument("--cross-attention", choices=CROSS_ATTENTIONS,
                        help="translation: the converted decoder's cross attention, softmax (the default: the "
                             "source's trained one kept, only self-attention becomes RFA) or rfa (the paper's model)")
    parser.add_argument("--decoder-attention", choices=DECODER_ATTENTIONS,
                        help="translation: rfa (the default) or softmax: fairseq's decoder kept as it is, no weight "
                             "changed but its cross attention's cache: one copy of the source per sentence")
    gen_parser_from_dataclass(parser, RFAConfig())
    args = parser.parse_args(argv)
    try:
        checkpoint, arch, rfa_only = convert(load_checkpoint(args.input), {n: getattr(args, n) for n in RFA_FIELDS},
                                             args.seed, args.cross_attention, args.decoder_attention)
    except ValueError as e:  # what cannot be converted, or a bad --rfa-* value named by rfa_config_from
        sys.exit(f"rfa-convert-from-softmax: {args.input}: {e}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, args.output)
    print(f"wrote {args.output}: {len(checkpoint['model']) - len(rfa_only)} weights copied, "
          f"{len(rfa_only)} RFA tensors initialised")
    # fairseq-train --finetune-from-model loads strictly: the model flags must build this same model
    flags = [f"--arch {arch}"] + [flag(n) if v is True else f"{flag(n)} {v}" for n in RFA_FIELDS
                                  if (v := getattr(args, n)) != getattr(RFAConfig(), n)]
    for name in ("cross_attention", "decoder_attention"):
        if getattr(args, name) not in (None, getattr(TranslationAttentionConfig(), name)):
            flags.append(f"{flag(name)} {getattr(args, name)}")
    print("finetune with: fairseq-train DATA --user-dir rfa_fairseq --finetune-from-model "
          f"{args.output} {' '.join(flags)} (and the source's model dimensions)")


if __name__ == "__main__":
    main()
