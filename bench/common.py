"""Shared pieces of the benchmarks: the machine description, peak-memory probes, timing.

Peak memory (``PeakMemory``), in bytes above what was allocated when the measurement began
(so the model weights are not counted):
- CUDA: ``torch.cuda.max_memory_allocated`` since a reset (tensors only, exact).
- CPU: the larger of two probes. (1) The process's resident-set high-water mark (VmHWM),
  reset through ``/proc/self/clear_refs``, above the resident set at the reset; glibc's
  ``malloc_trim`` runs first so that memory freed by an earlier run is handed back. (2) The
  bytes malloc has handed out and not taken back (glibc ``mallinfo2``: heap in use plus
  mmapped blocks), sampled around every module call of the models given to ``watch`` (and
  as each parameter gradient is produced), and at the start and end. (1) misses memory that
  the allocator reuses without the OS seeing it; (2) misses transients between samples; each
  is a lower bound, and both are recorded. Where neither is available the result is None.
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallinfo2.restype = _MallInfo2
except (OSError, AttributeError):
    _libc = None


def malloc_live_bytes() -> Optional[int]:
    """Bytes currently handed out by glibc malloc (in-use heap + mmapped blocks), or None."""
    if _libc is None:
        return None
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakMemory:
    """``with PeakMemory(device, watch=[model]) as m: ...``; then ``m.peak_bytes`` (None if
    unmeasurable), plus ``m.peak_rss_bytes`` and ``m.peak_live_bytes`` on CPU."""

    def __init__(self, device: str, watch=()):
        self.device = device
        self.peak_bytes: Optional[int] = None
        self.peak_rss_bytes: Optional[int] = None
        self.peak_live_bytes: Optional[int] = None
        self._active = False
        self._handles = []
        if device != "cuda":
            for model in watch:
                self.watch(model)

    def watch(self, model: torch.nn.Module):
        """Sample live bytes before and after every submodule call and at every parameter gradient."""
        sample = lambda *args: self.sample()  # noqa: E731
        for module in model.modules():
            self._handles.append(module.register_forward_pre_hook(sample))
            self._handles.append(module.register_forward_hook(sample))
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(lambda grad: self.sample()))

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def sample(self):
        if self._active and self._live_base is not None:
            live = malloc_live_bytes()
            if live > self._live_max:
                self._live_max = live

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            _malloc_trim()
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the peak RSS to the current RSS
                self._base = _status_kib("VmRSS") * 1024
            except (OSError, TypeError):
                self._base = None
            self._live_base = malloc_live_bytes()
            self._live_max = self._live_base
            self._active = True
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self._base
            return False
        self.sample()
        self._active = False
        if self._base is not None:
            hwm = _status_kib("VmHWM")
            self.peak_rss_bytes = None if hwm is None else max(hwm * 1024 - self._base, 0)
        if self._live_base is not None:
            self.peak_live_bytes = self._live_max - self._live_base
        probes = [b for b in (self.peak_rss_bytes, self.peak_live_bytes) if b is not None]
        self.peak_bytes = max(probes) if probes else None
        return False


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn: Callable[[], object], device: str, repeats: int, warmup: int = 1, clock: str = "wall") -> List[float]:
    """Seconds of ``repeats`` calls after ``warmup`` untimed calls: wall-clock, or with
    ``clock="cpu"`` the CPU time of this process (all its threads; the time other tenants of a
    shared machine take from it is not counted, their use of caches and memory still is)."""
    if clock == "cpu" and device != "cpu":
        raise ValueError(f"clock 'cpu' measures only CPU work; use the wall clock on {device}")
    now = CLOCKS[clock]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = now()
        fn()
        sync(device)
        times.append(now() - t)
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
