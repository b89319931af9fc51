"""Average the parameters of the last N checkpoints of an (RFA) fairseq model.

Same flags as fairseq's scripts/average_checkpoints.py (not in the fairseq-fixed wheel), e.g.

    rfa-average-checkpoints --inputs ckpt/ --num-update-checkpoints 10 --output ckpt/avg10.pt
    rfa-average-checkpoints --inputs a.pt b.pt c.pt --output avg.pt

Floating-point parameters and buffers are averaged, except the random feature matrices
(``*.feature_map.random_matrix``): an average of independent draws is not a random feature matrix
(its rows shrink towards zero, biasing the kernel estimate), so those, like integer buffers, come from
the newest checkpoint (the highest update count). Checkpoints are read with ``weights_only=True``;
importing rfa_fairseq allow-lists what fairseq stores."""
import argparse
import os
import re

import torch


def last_checkpoints(directory, count, by_update, upper_bound=None):
    pattern = re.compile(r"checkpoint_\d+_(\d+)\.pt$" if by_update else r"checkpoint(\d+)\.pt$")
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
             if (m := pattern.match(name)) and (upper_bound is None or int(m.group(1)) <= upper_bound)]
    if len(found) < count:
        raise SystemExit(f"found {len(found)} matching checkpoints in {directory}, need {count}")
    return [path for _, path in sorted(found, reverse=True)[:count]]


def _num_updates(state):
    return (state.get("optimizer_history") or [{}])[-1].get("num_updates", 0)


def average_checkpoints(paths):
    """Return the newest checkpoint's dict with its ``model`` replaced by the average."""
    total, newest = None, None
    for path in paths:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model = state["model"]
        if total is None:
            keys = list(model)
            total = {k: t.double().clone() for k, t in model.items() if t.is_floating_point()}
        elif list(model) != keys:
            raise SystemExit(f"{path} has different parameters than {paths[0]}: not the same architecture")
        else:
            for k in total:
                total[k] += model[k].double()
        if newest is None or _num_updates(state) >= _num_updates(newest):
            newest = state
    newest["model"] = {k: t if k not in total or k.endswith("feature_map.random_matrix")
                       else (total[k] / len(paths)).to(t.dtype) for k, t in newest["model"].items()}
    return newest


def main(argv=None):
    parser = argparse.ArgumentParser(prog="rfa-average-checkpoints", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", required=True, nargs="+", help="checkpoint files, or one directory")
    parser.add_argument("--output", required=True, help="where to write the averaged checkpoint")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--num-epoch-checkpoints", type=int, help="average the last N checkpointEPOCH.pt")
    group.add_argument("--num-update-checkpoints", type=int, help="average the last N checkpoint_E_UPDATE.pt")
    parser.add_argument("--checkpoint-upper-bound", type=int, help="ignore checkpoints after this epoch/update")
    args = parser.parse_args(argv)
    paths = args.inputs
    if args.num_epoch_checkpoints or args.num_update_checkpoints:
        if len(args.inputs) != 1 or not os.path.isdir(args.inputs[0]):
            parser.error("--num-*-checkpoints needs --inputs to be a single directory")
        paths = last_checkpoints(args.inputs[0], args.num_update_checkpoints or args.num_epoch_checkpoints,
                                 bool(args.num_update_checkpoints), args.checkpoint_upper_bound)
    print(f"averaging {len(paths)} checkpoints: {', '.join(paths)}")
    torch.save(average_checkpoints(paths), args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
