#!/usr/bin/env python
"""Per-GPU batch and --update-freq that give every update the recipe's reference batch, whatever
the number of GPUs (train.sh runs it through set_batch in recipes/common.sh).

    python recipes/tools/batch_plan.py --ref-batches 8 --gpu-tokens 4096 --world 16
    MAX_TOKENS=2048 UPDATE_FREQ=1 BATCH_TOKENS=32768 REF_TOKENS=32768 BATCH_WARNING=''

The reference batch is ``ref_batches x gpu_tokens`` tokens per update: the GPU batches one update
sees in the reference setup (GPUs x update frequency; WMT: 8 x 4,096, the LM: 8 x 3 x 3,072).
With W GPUs, --update-freq is the fewest accumulation steps that keep each GPU's batch at most
``gpu_tokens``, and --max-tokens is then shrunk so that W x max_tokens x update_freq equals the
reference (an exact split is preferred when one exists within twice the fewest steps). Batches
are counted in units of ``--unit`` tokens: 1 for translation (fairseq fills batches with whole
sentences, so the count is approximate anyway) and the block length for language models (every
sample is one block, so a --max-tokens between two multiples of it wastes the remainder). Each
GPU keeps at least ``--min-gpu-tokens`` (or the reference's own per-GPU batch, if smaller) so
that the longest training example fits in a batch; when that, or a --max-tokens / --update-freq
given by the user, moves the batch more than 5% away from the reference, BATCH_WARNING says by
how much and what to do.
"""
import argparse
import shlex
import sys

TOLERANCE = 0.05


def plan(ref_batches, gpu_tokens, world, unit=1, max_tokens=None, update_freq=None, min_gpu_tokens=1024):
    """(max_tokens, update_freq, tokens_per_update, ref_tokens, warning or '')."""
    for name, value in (("ref_batches", ref_batches), ("gpu_tokens", gpu_tokens), ("world", world), ("unit", unit)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if gpu_tokens % unit:
        raise ValueError(f"gpu_tokens ({gpu_tokens}) must be a multiple of unit ({unit})")
    ref_tokens = ref_batches * gpu_tokens
    ref_units = ref_tokens // unit
    cap = gpu_tokens // unit
    floor_units = max(1, -(-min(min_gpu_tokens, gpu_tokens) // unit))
    user_units = None
    if max_tokens is not None:
        if max_tokens < unit:
            raise ValueError(f"MAX_TOKENS ({max_tokens}) is below one sample of {unit} tokens")
        user_units = max_tokens // unit
    if update_freq is not None and update_freq < 1:
        raise ValueError(f"UPDATE_FREQ must be a positive integer, got {update_freq}")

    if user_units is not None and update_freq is not None:
        units, freq = user_units, update_freq
    elif user_units is not None:
        units = user_units
        freq = max(1, round(ref_units / (world * units)))
    elif update_freq is not None:
        freq = update_freq
        units = max(floor_units, -(-ref_units // (world * freq)))
    else:
        fewest = max(1, -(-ref_units // (world * cap)))
        freq = next((f for f in range(fewest, 2 * fewest + 1) if ref_units % (world * f) == 0), fewest)
        units = max(floor_units, -(-ref_units // (world * freq)))
    tokens = world * freq * units * unit
    warning = ""
    if abs(tokens - ref_tokens) > TOLERANCE * ref_tokens:
        why = ("as MAX_TOKENS / UPDATE_FREQ ask" if (max_tokens is not None or update_freq is not None)
               else f"each GPU needs at least {floor_units * unit} tokens for the longest examples")
        warning = (f"{world} GPU(s) x --max-tokens {units * unit} x --update-freq {freq} = {tokens} tokens per "
                   f"update, {tokens / ref_tokens:.2f}x the reference batch of {ref_tokens} ({ref_batches} x "
                   f"{gpu_tokens}) that the learning rate and the number of updates were set for ({why}). "
                   f"Use fewer GPUs (CUDA_VISIBLE_DEVICES, --distributed-world-size), or scale the learning "
                   f"rate and MAX_UPDATE yourself.")
    return units * unit, freq, tokens, ref_tokens, warning


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref-batches", type=int, required=True,
                        help="GPU batches per update in the reference setup (GPUs x update frequency)")
    parser.add_argument("--gpu-tokens", type=int, required=True, help="--max-tokens per GPU of the reference setup")
    parser.add_argument("--world", type=int, required=True, help="GPUs this run trains on")
    parser.add_argument("--unit", type=int, default=1, help="tokens per sample for block-based tasks (LM), else 1")
    parser.add_argument("--max-tokens", type=int, help="per-GPU batch fixed by the user")
    parser.add_argument("--update-freq", type=int, help="update frequency fixed by the user")
    parser.add_argument("--min-gpu-tokens", type=int, default=1024, help="smallest per-GPU batch chosen automatically")
    args = parser.parse_args(argv)
    try:
        max_tokens, freq, tokens, ref_tokens, warning = plan(
            args.ref_batches, args.gpu_tokens, args.world, args.unit, args.max_tokens, args.update_freq,
            args.min_gpu_tokens)
    except ValueError as e:
        sys.exit(f"batch_plan.py: {e}")
    print(f"MAX_TOKENS={max_tokens} UPDATE_FREQ={freq} BATCH_TOKENS={tokens} REF_TOKENS={ref_tokens} "
          f"BATCH_WARNING={shlex.quote(warning)}")


if __name__ == "__main__":
    main()
