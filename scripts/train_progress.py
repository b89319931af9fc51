#!/usr/bin/env python
"""Read fairseq-train's log on stdin and print one progress line per log entry: updates done
out of ``--max-update``, the elapsed time and the expected time left at the pace so far.

    fairseq-train ... --log-format simple 2>&1 | python scripts/train_progress.py 330 train.log
"""
import re
import sys
import time


def main():
    total, log_path = int(sys.argv[1]), sys.argv[2]
    start = time.time()
    with open(log_path, "w") as log:
        for line in sys.stdin:
            log.write(line)
            log.flush()
            m = re.search(r"num_updates[= ](\d+)", line)
            if "train_inner" in line and m:
                done = int(m.group(1))
                elapsed = time.time() - start
                left = elapsed / done * (total - done) if done else float("nan")
                loss = re.search(r"loss[= ]([\d.]+)", line)
                print(f"  update {done:4d}/{total}  loss {loss.group(1) if loss else '?':>6s}  "
                      f"elapsed {elapsed / 60:4.1f} min  about {left / 60:4.1f} min left", flush=True)
            elif "valid on" in line:
                loss, ppl = re.search(r"\| loss ([\d.]+)", line), re.search(r"\| ppl ([\d.]+)", line)
                print(f"  validation: loss {loss.group(1) if loss else '?'}, perplexity {ppl.group(1) if ppl else '?'}",
                      flush=True)
            elif "done training" in line:
                print("  " + line.split("|")[-1].strip(), flush=True)


if __name__ == "__main__":
    main()
