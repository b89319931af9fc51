#!/usr/bin/env python
"""Where the time of a decoding step goes: softmax vs RFA, split by component.

Runs fairseq's SequenceGenerator (as bench/decode_speed.py does: transformer-base sized
translation models, beam 4, forced length) once per model and length, with timers on the
decoder's parts (forward hooks; on CUDA each timer synchronises, which adds a little time).
Components, as shares of the whole generation:

- self-attention, cross-attention: the attention computation of the decoder layers'
  ``self_attn`` and ``encoder_attn``, without their linear projections (RFA: feature maps,
  state update and readout; softmax: scores, softmax, weighted sum, key/value cache);
- attention projections: the q/k/v/out (and RFA-Gate's gate) linear layers of both, which every
  transformer of these dimensions pays;
- state reorder: ``reorder_incremental_state`` (beam bookkeeping of the attention states; RFA
  defers its gather to the next step, so there it is counted under self-attention);
- FFN: ``fc1`` + ``fc2`` of every layer;
- output projection + log-softmax: the 32k-way output layer and the normalisation;
- rest of the decoder: embeddings, layer norms, residuals;
- encoder; beam search and the rest: everything outside the model (top-k, bookkeeping).

    python bench/profile_decode.py --lengths 32 512 --out bench/results/profile_decode.json
"""
import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import decode_speed as ds  # noqa: E402
from bench.common import fake_dictionary, machine_info, sync, write_json  # noqa: E402

COMPONENTS = ["self-attention", "cross-attention", "attention projections", "state reorder", "FFN",
              "output projection + log-softmax", "rest of the decoder", "encoder", "beam search and the rest"]
ATTENTION = ("self-attention", "cross-attention", "state reorder")  # the attention computation proper
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj", "gate_proj")


class Timers:
    """Seconds per component name. A component entered again while it is already being timed
    (a wrapped method called from inside the hooked module) is not counted twice."""

    def __init__(self, device):
        self.device = device
        self.total = defaultdict(float)
        self._open = defaultdict(list)  # name -> start times of the calls in progress

    def _enter(self, name):
        sync(self.device)
        self._open[name].append(time.perf_counter())

    def _exit(self, name):
        sync(self.device)
        start = self._open[name].pop()
        if not self._open[name]:
            self.total[name] += time.perf_counter() - start

    def hook_module(self, module, name):
        module.register_forward_pre_hook(lambda mod, inputs: self._enter(name))
        module.register_forward_hook(lambda mod, inputs, output: self._exit(name))

    def wrap(self, owner, attr, name, unless=()):
        """Time ``owner.attr`` under ``name``, except while a component in ``unless`` is timed."""
        original = getattr(owner, attr)

        def timed(*a, **kw):
            if any(self._open[other] for other in unless):
                return original(*a, **kw)
            self._enter(name)
            try:
                return original(*a, **kw)
            finally:
                self._exit(name)

        setattr(owner, attr, timed)


def profile(model, gen_fn, device):
    timers = Timers(device)
    dec = model.decoder
    for layer in dec.layers:
        for attr, name in (("self_attn", "self-attention"), ("encoder_attn", "cross-attention")):
            attn = getattr(layer, attr, None)
            if attn is None:
                continue
            timers.hook_module(attn, name)
            # fairseq's decoder layer reads the self-attention state before calling it: that read
            # is self-attention's time (a read inside the reorder stays with the reorder)
            timers.wrap(attn, "_get_input_buffer", name, unless=("state reorder",))
            for proj in PROJECTIONS:
                if isinstance(getattr(attn, proj, None), torch.nn.Module):
                    timers.hook_module(getattr(attn, proj), name + " projections")
        timers.hook_module(layer.fc1, "FFN")
        timers.hook_module(layer.fc2, "FFN")
    # The generator calls decoder.forward and encoder.forward_torchscript directly (no hooks fire).
    timers.wrap(dec, "forward", "decoder")
    timers.wrap(dec, "output_layer", "output projection")
    timers.wrap(model, "get_normalized_probs", "log-softmax")
    timers.wrap(dec, "reorder_incremental_state_scripting", "state reorder")
    if getattr(model, "encoder", None) is not None:
        timers.wrap(model.encoder, "forward_torchscript", "encoder")
    sync(device)
    t = time.perf_counter()
    gen_fn()
    sync(device)
    whole = time.perf_counter() - t
    tt = timers.total
    projections = tt["self-attention projections"] + tt["cross-attention projections"]
    parts = {
        "self-attention": tt["self-attention"] - tt["self-attention projections"],
        "cross-attention": tt["cross-attention"] - tt["cross-attention projections"],
        "attention projections": projections,
        "state reorder": tt["state reorder"],
        "FFN": tt["FFN"],
        "output projection + log-softmax": tt["output projection"] + tt["log-softmax"],
    }
    # The decoder's forward covers its layers and the output projection (not the log-softmax).
    inside = tt["self-attention"] + tt["cross-attention"] + tt["FFN"] + tt["output projection"]
    parts["rest of the decoder"] = max(tt["decoder"] - inside, 0.0)
    parts["encoder"] = tt["encoder"]
    parts["beam search and the rest"] = max(whole - sum(parts.values()), 0.0)
    return whole, parts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 512])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--src-len", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--models", nargs="+", default=["softmax", "rfa_gate"], choices=list(ds.MODELS["translation"]))
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = fake_dictionary(tempfile.mkdtemp(), args.vocab)
    rows = []
    for name in args.models:
        for length in args.lengths:
            torch.manual_seed(0)
            task, model = ds.build("translation", ds.MODELS["translation"][name], tmp, max(args.lengths), tiny=args.tiny)
            model.to(device)
            sample = ds.make_sample("translation", task, args.batch, args.src_len, 0, device)
            with torch.inference_mode():
                ds.generate_fn("translation", task, model, sample, args.beam, min(args.lengths), 0)()  # warm-up
                gen = ds.generate_fn("translation", task, model, sample, args.beam, length, 0)
                whole, parts = profile(model, gen, device)
            row = {"model": name, "length": length, "seconds": whole,
                   "ms_per_step": 1000 * whole / length,
                   "seconds_by_component": parts,
                   "share_by_component": {k: v / whole for k, v in parts.items()},
                   "attention_share": sum(parts[k] for k in ATTENTION) / whole}
            rows.append(row)
            print(f"\n{name} length {length}: {row['ms_per_step']:.2f} ms per step", flush=True)
            for k in COMPONENTS:
                print(f"  {k:34s} {1000 * parts[k] / length:8.2f} ms/step  {100 * parts[k] / whole:5.1f}%")
            print(f"  attention computation (self + cross + reorder, no projections): "
                  f"{100 * row['attention_share']:.1f}%")
    if args.out:
        write_json(args.out, dict(machine_info(device), args=vars(args)), rows)
    return rows


if __name__ == "__main__":
    main()
