"""What the benchmarks share: timing, peak memory, the machine, ratios, common flags, JSON output.

Peak memory (``PeakMemory``): bytes above what was allocated at the start, so weights are not
counted. CUDA: ``torch.cuda.max_memory_allocated``. CPU: the larger of two lower bounds, the
resident-set high-water mark (reset through ``/proc/self/clear_refs`` after ``malloc_trim``) above
the resident set at the start, which misses memory malloc reuses unseen by the OS, and malloc's
live bytes (``mallinfo2``) sampled around every module call of the ``watch`` models and every half
millisecond. Both are also kept apart (``resident_bytes``, ``allocated_bytes``): the resident set
also holds what glibc's malloc keeps of freed memory, which depends on the order and sizes of
earlier allocations more than on what the model needs; the allocated bytes are what torch holds,
the CPU counterpart of the CUDA figure.
"""
import argparse
import ctypes
import json
import os
import platform
import statistics
import threading
import time
import traceback

import torch

try:  # glibc with mallinfo2 (2.33 and later), else None: malloc's live bytes, and malloc_trim
    _LIBC = ctypes.CDLL("libc.so.6") if platform.libc_ver()[0] == "glibc" else None
    _LIBC.mallinfo2.restype = type("MallInfo2", (ctypes.Structure,), {"_fields_": [
        (n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]})
except (OSError, AttributeError):
    _LIBC = None


def _live_bytes() -> int:
    """The bytes malloc has handed out and not had back: in its heap, and in blocks of their own."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
STATISTICS = {"median": statistics.median, "min": min}


def machine(device, argv):
    """The device, the thread count, the versions, the date and the command, for the JSON's meta."""
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    if device == "cpu" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
        name += f" ({os.cpu_count()} cores)"
    return {"device": name, "device_kind": device, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(argv)}


class PeakMemory:
    """``with PeakMemory(device, watch=[model]) as m: ...`` then ``m.peak_bytes`` (None if unmeasurable)."""

    def __init__(self, device, watch=()):
        self.device, self.peak_bytes, self._live, self._hooks = device, None, None, []
        self.allocated_bytes = self.resident_bytes = None  # CPU: malloc's live bytes, the resident set
        for module in (m for model in watch for m in model.modules()) if device == "cpu" else ():
            self._hooks += [module.register_forward_pre_hook(lambda *a: self.sample()),
                            module.register_forward_hook(lambda *a: self.sample())]

    def sample(self):
        if self._live is not None:
            self._live[1] = max(self._live[1], _live_bytes())

    def _sample_often(self):
        """Live bytes every half millisecond (the module hooks miss what an op holds inside a
        module, and the backward pass); a thread, so only the untimed warm-up pays for it."""
        while not self._stop.wait(0.0005):
            self.sample()

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        if _LIBC is not None:
            _LIBC.malloc_trim(0)
            self._live = [_live_bytes()] * 2
            self._stop = threading.Event()
            self._sampler = threading.Thread(target=self._sample_often, daemon=True)
            self._sampler.start()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
            self._base = _status_bytes("VmRSS")
        except OSError:
            self._base = None
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self._base
        else:
            if self._live is not None:
                self._stop.set()
                self._sampler.join()
                self.sample()
                self.allocated_bytes = self._live[1] - self._live[0]
            if self._base is not None:
                self.resident_bytes = max(_status_bytes("VmHWM") - self._base, 0)
            probes = [b for b in (self.resident_bytes, self.allocated_bytes) if b is not None]
            self.peak_bytes, self._live = max(probes) if probes else None, None
        for h in self._hooks:
            h.remove()


def _status_bytes(field):  # VmRSS, VmHWM
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def timed(fn, device, repeats=1, clock="wall"):
    """Seconds of each of ``repeats`` calls: wall clock, or with ``clock="cpu"`` this process's CPU
    time (all its threads; CPU only). The caller warms up (``measure`` does)."""
    if clock == "cpu" and device != "cpu":
        raise ValueError(f"--clock cpu measures CPU work only; use the wall clock on {device}")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        t = CLOCKS[clock]()
        fn()
        sync()
        times.append(CLOCKS[clock]() - t)
    return times


def measure(step, device, repeats, clock="wall", statistic="median", watch=()):
    """A warm-up call of ``step`` under ``PeakMemory`` (watching ``watch``), then ``repeats`` timed calls."""
    with PeakMemory(device, watch) as mem:
        step()
    times = timed(step, device, repeats, clock=clock)
    return {"seconds": STATISTICS[statistic](times), "times": times, "peak_bytes": mem.peak_bytes,
            **({"allocated_bytes": mem.allocated_bytes, "resident_bytes": mem.resident_bytes} if device == "cpu" else {})}


def is_oom(e):
    return isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)) or "out of memory" in str(e) or "t allocate" in str(e)


def failure(e: Exception) -> str:
    """A row's ``error`` for ``e``: "out of memory", or its type and first line, its traceback printed, so
    that one model's failure leaves the other models' rows of the run."""
    if is_oom(e):
        return "out of memory"
    traceback.print_exc()
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def exit_status(rows) -> int:
    """The command's exit status: 1 where a row failed for a reason other than memory, else 0."""
    return int(any(r.get("error") not in (None, "out of memory") for r in rows))


def add_ratios(rows, reference, key="tokens_per_s", field="ratio", group=("length",)):
    """``row[field]`` = ``row[key]`` over the ``reference`` model's at the same ``group`` values (same run)."""
    refs = {tuple(r.get(g) for g in group): r[key] for r in rows if r["model"] == reference and r.get(key) is not None}
    for r in rows:
        if refs.get(tuple(r.get(g) for g in group)) and r.get(key) is not None:
            r[field] = r[key] / refs[tuple(r.get(g) for g in group)]
    return rows


def positive(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return int(text)


def common_flags(p, repeats):
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--threads", type=positive, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--repeats", type=positive, default=repeats, help=f"timed runs after a warm-up (default {repeats})")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall, or cpu: this process's CPU time (CPU only; best with --threads 1)")
    p.add_argument("--statistic", choices=sorted(STATISTICS), default="median", help="how the repeats combine")
    p.add_argument("--out", help="write the results here as JSON")


def setup(p, args):
    """Resolve --device, apply --threads, and refuse what cannot be measured."""
    args.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if args.clock == "cpu" and args.device != "cpu":
        p.error("--clock cpu measures CPU work only; use --clock wall on a GPU")
    if args.threads:
        torch.set_num_threads(args.threads)


def user_dir():
    """The plugin's folder, for fairseq's --user-dir (the package is imported normally)."""
    import rfa_fairseq

    return os.path.dirname(rfa_fairseq.__file__)


def fake_dictionary(directory, size, names=("dict.src.txt", "dict.tgt.txt", "dict.txt")):
    """A fairseq dictionary of ``size`` entries (4 specials + ``size - 4`` words) under each name."""
    for name in names:
        with open(os.path.join(directory, name), "w") as f:
            f.writelines(f"w{i} 1\n" for i in range(size - 4))
    return directory


def mib(x):
    return "-" if x is None else f"{x / 2**20:.1f}"


def write_json(path, meta, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
