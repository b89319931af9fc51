"""What the benchmarks share. Peak memory (``PeakMemory``): bytes above those held at the start; CUDA:
``max_memory_allocated``; CPU: the larger of the resident set's high-water mark (``resident_bytes``) and malloc's live
bytes (``allocated_bytes``: ``mallinfo2``, sampled around the ``watch`` models' module calls and every 0.5 ms)."""
import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback

import torch

import rfa_fairseq

try:  # glibc with mallinfo2 (2.33 and later), else None: malloc's live bytes, and malloc_trim
    _LIBC = ctypes.CDLL("libc.so.6") if platform.libc_ver()[0] == "glibc" else None
    _LIBC.mallinfo2.restype = type("MallInfo2", (ctypes.Structure,), {"_fields_": [
        (n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]})
except (OSError, AttributeError):
    _LIBC = None
USER_DIR = os.path.dirname(rfa_fairseq.__file__)  # the plugin's folder, for fairseq's --user-dir
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
STATISTICS = {"median": statistics.median, "min": min}


def status_bytes(field):  # VmRSS, VmHWM
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak(device):
    """Starts the peak again from now; returns the bytes held now (CUDA: allocated; CPU: resident, None if unknown)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        return status_bytes("VmRSS")
    except OSError:
        return None


class PeakMemory:  # ``with PeakMemory(device, watch=[model]) as m: ...`` then ``m.peak_bytes`` (None if unmeasurable)

    def __init__(self, device, watch=()):
        self.device, self.peak_bytes, self.allocated_bytes, self.resident_bytes, self._live = device, None, None, None, None
        modules = [m for model in watch for m in model.modules()] if device == "cpu" else []
        self._hooks = [hook(self.sample) for m in modules for hook in (m.register_forward_pre_hook, m.register_forward_hook)]

    def sample(self, *_):
        if self._live is not None:
            info = _LIBC.mallinfo2()  # in malloc's heap, and in blocks of their own
            self._live[1] = max(self._live[1], info.uordblks + info.hblkhd)

    def _sample_often(self):  # a thread: the hooks miss what an op holds inside a module, and the backward pass
        while not self._stop.wait(0.0005):
            self.sample()

    def __enter__(self):
        if self.device != "cuda" and _LIBC is not None:
            _LIBC.malloc_trim(0)
            self._live, self._stop = [0, 0], threading.Event()
            self.sample()
            self._live[0], self._sampler = self._live[1], threading.Thread(target=self._sample_often, daemon=True)
            self._sampler.start()
        self._base = reset_peak(self.device)
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
                self.resident_bytes = max(status_bytes("VmHWM") - self._base, 0)
            probes = [b for b in (self.resident_bytes, self.allocated_bytes) if b is not None]
            self.peak_bytes, self._live = max(probes) if probes else None, None
        for h in self._hooks:
            h.remove()


def timed(fn, device, repeats=1, clock="wall"):
    """Seconds of each of ``repeats`` calls (``clock="cpu"``: this process's CPU time, CPU only); no warm-up."""
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


def failure(e: Exception) -> str:
    """A row's ``error``: "out of memory", or the type and first line (traceback printed); the other rows go on."""
    if isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)) or "out of memory" in str(e) or "t allocate" in str(e):
        return "out of memory"
    traceback.print_exc()
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def exit_status(rows) -> int:  # 1 where a row failed for a reason other than memory
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
    args.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if args.clock == "cpu" and args.device != "cpu":
        p.error("--clock cpu measures CPU work only; use --clock wall on a GPU")
    if args.threads:
        torch.set_num_threads(args.threads)


def fake_dictionary(size, names=("dict.src.txt", "dict.tgt.txt", "dict.txt")):  # a new folder: 4 specials, <sep>, words
    directory = tempfile.mkdtemp(prefix="rfa_bench_")
    for name in names:
        with open(os.path.join(directory, name), "w") as f:
            f.writelines(["<sep> 1\n"] + [f"w{i} 1\n" for i in range(size - 5)])
    return directory


def build_model(flags):  # the model of fairseq-train's flags, random weights (seed 0); its task and arguments
    from fairseq import options, tasks
    parsed = options.parse_args_and_arch(options.get_training_parser(), flags + ["--user-dir", USER_DIR])
    torch.manual_seed(0)
    task = tasks.setup_task(parsed)
    return task.build_model(parsed), task, parsed


def save(parsed, argv, bench, rows, **meta):  # rows (returned) and the meta as JSON to --out
    name = torch.cuda.get_device_name() if parsed.device == "cuda" else platform.processor() or "cpu"
    if parsed.device == "cpu" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), name)
        flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
        # what sets int8's gain: AVX-512 (VNNI), AMX or AVX2 alone
        simd = sorted(f for f in flags if f.startswith(("avx512f", "avx512_vnni", "avx512vnni", "amx", "avx_vnni"))
                      or f == "avx2")
        name += f" ({os.cpu_count()} cores; {' '.join(simd) or 'no AVX2'})"
    command = [bench.split("-")[0] + ".py"] + (sys.argv[1:] if argv is None else list(argv))
    meta = {"device": name, "device_kind": parsed.device, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(command),
            "bench": bench, **meta}
    if parsed.out:
        os.makedirs(os.path.dirname(os.path.abspath(parsed.out)), exist_ok=True)
        with open(parsed.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows
