"""Shared pieces of the benchmarks: the machine description, peak-memory probes, timing.

Peak memory:
- CUDA: ``torch.cuda.max_memory_allocated`` since a reset (tensors only).
- CPU: the process's resident-set high-water mark (VmHWM), reset through
  ``/proc/self/clear_refs`` (Linux), minus the resident set at the reset. That is real memory
  as the OS sees it: tensors plus allocator slack, without the model weights already resident.
  Before the reset glibc's ``malloc_trim`` hands freed heap memory back to the OS, so memory a
  previous run freed but the allocator kept cannot hide this run's growth. Where the reset is
  unavailable the probe reports None rather than a wrong number.
"""
import ctypes
import json
import os
import platform
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(REPO, "rfa_fairseq")


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model or platform.processor() or 'cpu'} ({os.cpu_count()} cores)"


def machine_info(device: str) -> Dict:
    return {
        "device": device_name(device),
        "device_kind": device,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _status_kib(field: str) -> Optional[int]:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def _malloc_trim():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """``with PeakMemory(device) as m: ...``; then ``m.peak_bytes`` (None if unmeasurable)."""

    def __init__(self, device: str):
        self.device = device
        self.peak_bytes: Optional[int] = None

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            try:
                _malloc_trim()
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the peak RSS to the current RSS
                self._base = _status_kib("VmRSS") * 1024
            except (OSError, TypeError):
                self._base = None
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self._base
        elif self._base is not None:
            hwm = _status_kib("VmHWM")
            self.peak_bytes = None if hwm is None else max(hwm * 1024 - self._base, 0)
        return False


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, repeats: int, warmup: int = 1) -> List[float]:
    """Wall seconds of ``repeats`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return times


def median(xs: List[float]) -> float:
    return statistics.median(xs)


def write_json(path: str, meta: Dict, rows: List[Dict]):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def fake_dictionary(directory: str, size: int, names=("dict.src.txt", "dict.tgt.txt", "dict.txt")):
    """A fairseq dictionary of ``size`` entries (4 specials + ``size - 4`` words) under each name."""
    os.makedirs(directory, exist_ok=True)
    for name in names:
        with open(os.path.join(directory, name), "w") as f:
            f.writelines(f"w{i} 1\n" for i in range(size - 4))
    return directory


@contextmanager
def threads(n: Optional[int]):
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
