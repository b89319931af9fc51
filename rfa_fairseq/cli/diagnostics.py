"""What a trained RFA model's attention does on a data split, layer by layer.

Runs a translation or language model over the split as in training (teacher forcing, eval mode, no
gradients; the task from the checkpoint) and prints for every RFA attention module:

- sigma, the learned scale of queries and keys (mean, min, max over heads and dimensions):
  attention logits grow like sigma^2, so sigma near 1 means nearly uniform attention;
- the mean gate g over real (non-padding) tokens, for RFA-Gate: about 1 / (1 - g) tokens of memory;
- how often the denominator phi(q).z fell below --rfa-eps and was clamped (and how often it was
  negative), in percent of the query positions times heads it was computed for."""
import argparse
import itertools
import json
from pathlib import Path

import torch


def main(argv=None):
    p = argparse.ArgumentParser(prog="rfa-diagnostics", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="the fairseq-preprocess output directory")
    p.add_argument("--path", required=True, help="checkpoint file")
    p.add_argument("--gen-subset", default="valid", help="split to run over (default: valid)")
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)

    from fairseq import checkpoint_utils, utils

    from ..modules import CausalRFAttention, CrossRFAttention
    from ..modules.heads import split_heads
    from ..ops import chunk_causal_rfa, cross_rfa_apply, cross_rfa_state

    utils.import_user_module(argparse.Namespace(user_dir=str(Path(__file__).resolve().parents[1])))  # rfa_fairseq
    if not Path(args.path).is_file():
        p.error(f"--path: no checkpoint at {args.path}")
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([args.path], arg_overrides={"data": args.data})
    model = models[0].eval()
    modules = {name: m for name, m in model.named_modules() if isinstance(m, (CausalRFAttention, CrossRFAttention))}
    if not modules:
        p.error(f"{args.path} has no RFA attention modules (a softmax model?)")
    task.load_dataset(args.gen_subset)
    itr = task.get_batch_iterator(
        dataset=task.dataset(args.gen_subset), max_tokens=args.max_tokens,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True, seed=1).next_epoch_itr(shuffle=False)

    gate_sum = {name: 0.0 for name, m in modules.items() if getattr(m, "gated", False)}
    gate_count = {name: 0 for name in gate_sum}
    seen, clamped, negative = ({name: 0 for name in modules} for _ in range(3))
    real = {}  # the current batch's non-padding positions, [T, B, 1]

    def count_denominators(mod, args_, kwargs, out, name):
        """Run the module's op again from its inputs with values of ones: the output is then den / guard(den),
        1 where the denominator was not clamped, below 1 where it was, negative where it was negative."""
        query = kwargs["query"] if "query" in kwargs else args_[0]  # fairseq's layers pass it by name
        key_padding_mask = kwargs.get("key_padding_mask")
        if isinstance(mod, CausalRFAttention):
            q, k, v, log_g = mod._inputs(query, key_padding_mask)[:4]
            ratio, _ = chunk_causal_rfa(q, k, v.new_ones(*v.shape[:3], 1), log_g, eps=mod.eps, convex=mod.convex,
                                        chunk_size=mod.chunk_size)
        else:
            key = kwargs["key"] if "key" in kwargs else args_[1]
            q = mod.feature_map(split_heads(mod.q_proj(query), mod.num_heads))
            k = mod.feature_map(split_heads(mod.k_proj(key), mod.num_heads))
            state = cross_rfa_state(k, k.new_ones(*k.shape[:3], 1), key_padding_mask)
            ratio = cross_rfa_apply(q, state, eps=mod.eps, out_dtype=torch.float32)
        ratio = ratio[..., 0].permute(2, 0, 1)  # [T, B, H]
        mask = real["mask"][: ratio.size(0)].bool().expand_as(ratio)
        seen[name] += int(mask.sum())
        clamped[name] += int(((ratio.abs() < 1) & mask).sum())
        negative[name] += int(((ratio < 0) & mask).sum())

    hooks = []
    for name, m in modules.items():
        hooks.append(m.register_forward_hook(lambda *a, name=name: count_denominators(*a, name), with_kwargs=True))
        if name in gate_sum:
            def record_gate(mod, inp, out, name=name, heads=m.num_heads):  # the gate's logits: in_proj's last columns
                gate_sum[name] += (torch.sigmoid(out[..., -heads:].float()) * real["mask"]).sum().item()
                gate_count[name] += int(real["mask"].sum().item()) * heads
            hooks.append(m.in_proj.register_forward_hook(record_gate))
    batches = 0
    with torch.no_grad():
        for batches, sample in enumerate(itertools.islice(itr, args.max_batches), 1):
            tokens = sample["net_input"].get("prev_output_tokens", sample["net_input"].get("src_tokens"))
            real["mask"] = tokens.ne(task.target_dictionary.pad()).t().unsqueeze(-1).float()
            model(**sample["net_input"])
    for h in hooks:
        h.remove()

    rows = []
    for name, m in modules.items():
        sigma = m.feature_map.sigma.detach().float()
        rows.append({
            "module": name, "kind": type(m).__name__, "kernel": m.feature_map.kernel,
            "sigma_mean": sigma.mean().item(), "sigma_min": sigma.min().item(), "sigma_max": sigma.max().item(),
            "mean_gate": gate_sum[name] / max(gate_count[name], 1) if name in gate_sum else None,
            "clamped_pct": 100.0 * clamped[name] / max(seen[name], 1),
            "negative_pct": 100.0 * negative[name] / max(seen[name], 1), "denominators": seen[name]})
    print(f"{args.path} on {args.gen_subset} ({batches} batches), eps {modules[next(iter(modules))].eps}")
    print(f"{'module':42s} {'sigma mean [min, max]':>24s} {'mean gate':>9s} {'clamped %':>9s} {'neg %':>7s}")
    for r in rows:
        gate = "-" if r["mean_gate"] is None else f"{r['mean_gate']:.3f}"
        print(f"{r['module']:42s} {r['sigma_mean']:8.3f} [{r['sigma_min']:6.3f}, {r['sigma_max']:6.3f}] "
              f"{gate:>9s} {r['clamped_pct']:9.3f} {r['negative_pct']:7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"checkpoint": args.path, "split": args.gen_subset,
                                               "batches": batches, "modules": rows}, indent=1))


if __name__ == "__main__":
    main()
