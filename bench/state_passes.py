#!/usr/bin/env python
"""The passes a decoding step of causal RFA makes over one layer's recurrent state, timed alone.

In PyTorch ops a step of RFA-Gate in beam search reads or writes the whole packed state
``[B, H, F, K + 1]`` four times: the beam reorder's gather into the spare buffer, the gate's
decay, the update with ``phi(k) [v | 1]^T``, and the readout ``phi(q) [S | z]``. The state does
not depend on the output length, so at short lengths these passes are most of what RFA costs
beyond softmax. Each pass is timed on a state that is not in the caches, as in a real step,
where the other layers' weights and states pass through them in between (``--flush-mib`` of
memory is written before each timed pass, untimed).

    python bench/state_passes.py --threads 1

Prints microseconds per layer and pass: the fastest of ``--repeats`` runs, by the process's CPU
time with one thread (least disturbed by other tenants), by the wall clock with more.
"""
import argparse
import time

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="batch x beam (default 2 sentences x beam 4)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--features", type=int, default=128, help="F: 2 x --rfa-causal-feature-dim")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--flush-mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, H, Fd, K1 = args.rows, args.heads, args.features, args.head_dim + 1
    state, spare = torch.randn(B, H, Fd, K1), torch.empty(B, H, Fd, K1)
    flush = torch.empty(args.flush_mib * 2**18)
    order = torch.arange(B).roll(1)
    decay = torch.rand(B, H)[..., None, None]
    k, v1, q = torch.randn(B, H, Fd, 1), torch.randn(B, H, 1, K1), torch.randn(B, H, 1, Fd)
    passes = {
        "gather (beam reorder)": lambda s, o: torch.index_select(s, 0, order, out=o),
        "decay (RFA-Gate)": lambda s, o: s.mul_(decay),
        "update": lambda s, o: s.addcmul_(k, v1),
        "readout": lambda s, o: torch.matmul(q, s),
    }
    print(f"state per layer: {B * H * Fd * K1 * 4 / 2**20:.2f} MiB ([{B}, {H}, {Fd}, {K1}] fp32), "
          f"{args.threads} thread(s)")
    clock = time.process_time if args.threads == 1 else time.perf_counter
    with torch.inference_mode():
        for name, fn in passes.items():
            times = []
            for _ in range(args.repeats):
                flush.fill_(1.0)
                start = clock()
                fn(state, spare)
                times.append(clock() - start)
            print(f"  {name:22s} {min(times) * 1e6:7.0f} us per layer (fastest of {len(times)})")


if __name__ == "__main__":
    main()
