"""Helpers shared by the tests: tiny fairseq models built through fairseq's own argument parser.

(A module of its own, not conftest.py: pytest registers every conftest.py under the same name,
so ``from conftest import ...`` could pick tests/ops/conftest.py.)"""
import gzip
import importlib.util
import os
import platform
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
USER_DIR = os.path.join(REPO, "rfa_fairseq")
BIN = os.path.dirname(sys.executable)

TINY_DECODER = [
    "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
    "--decoder-attention-heads", "4", "--dropout", "0.0",
]
TINY_RFA = ["--rfa-causal-feature-dim", "64", "--rfa-cross-feature-dim", "96", "--rfa-chunk-size", "8"]
TINY_MODEL = TINY_DECODER + TINY_RFA
TINY_ENCODER = [
    "--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "4",
]


def load_script(*path):
    """Import a script that is not part of the package (scripts/, results/, recipes/), from its
    path relative to the repository root."""
    file = os.path.join(REPO, *path)
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(file))[0], file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_dict(path, size):
    with open(path, "w") as f:
        for i in range(size):
            f.write(f"w{i} {1000 - i}\n")


def build_from_cli(data_dir, args):
    """Build (task, model, args) exactly as fairseq-train would, from command-line words."""
    from fairseq import options, tasks

    parser = options.get_training_parser()
    parsed = options.parse_args_and_arch(parser, input_args=[str(data_dir), "--user-dir", os.path.join(REPO, "rfa_fairseq")] + args)
    task = tasks.setup_task(parsed)
    model = task.build_model(parsed)
    return task, model, parsed


def random_tokens(dictionary, batch, length, generator=None):
    """Tokens drawn from the dictionary's real words (no special symbols)."""
    low = dictionary.nspecial
    return torch.randint(low, len(dictionary), (batch, length), generator=generator)


def run_cli(tool, *args, check=True):
    """Run a fairseq command line from the venv (single-threaded: tiny models on a shared CPU).
    Returns its output, or the CompletedProcess with ``check=False``."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run([os.path.join(BIN, tool), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    if not check:
        return proc
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"{tool} failed ({proc.returncode}):\n{out[-4000:]}")
    return out


def head_gz(src, dst, n):
    """The first ``n`` lines of a gzip text file, written to ``dst``."""
    with gzip.open(src, "rt", encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for i, line in enumerate(f):
            if i >= n:
                break
            out.write(line)


def multi30k_bin(directory, sizes=(("train", 300), ("valid", 40), ("test", 12)), destdir="bin", *extra):
    """The first sentences of the shipped Multi30k de-en splits (``sizes``: split -> count), as raw
    text in ``directory`` and binarised with a joined dictionary in ``directory / destdir``."""
    for split, n in sizes:
        for lang in ("de", "en"):
            head_gz(os.path.join(REPO, "data", "multi30k", f"{split}.{lang}.gz"), directory / f"{split}.{lang}", n)
    run_cli("fairseq-preprocess", "--source-lang", "de", "--target-lang", "en", "--joined-dictionary",
            "--trainpref", directory / "train", "--validpref", directory / "valid", "--testpref", directory / "test",
            "--destdir", directory / destdir, "--workers", "1", *extra)
    return directory / destdir


def multi30k_lm_bin(directory, sizes):
    """The first sentences of the shipped Multi30k English splits (``sizes``: split -> count), as raw
    text in ``directory`` and binarised for language modelling in ``directory / "bin"``."""
    for split, n in sizes:
        head_gz(os.path.join(REPO, "data", "multi30k", f"{split}.en.gz"), directory / f"{split}.en", n)
    run_cli("fairseq-preprocess", "--only-source", "--trainpref", directory / "train.en", "--validpref",
            directory / "valid.en", "--testpref", directory / "test.en", "--destdir", directory / "bin", "--workers", "1")
    return directory / "bin"


# the CPU features of x86-64-v3 as /proc/cpuinfo names them
X86_64_V3_FLAGS = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}


def cpu_flags():
    """The CPU's feature flags (Linux), or None where /proc/cpuinfo does not list them."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def has_x86_64_v3() -> bool:
    flags = cpu_flags()
    return platform.machine() == "x86_64" and flags is not None and X86_64_V3_FLAGS <= flags


def fla_on_this_machine():
    """Make fla-core's kernels runnable here, or skip the calling test where fla-core is not installed.

    Without CUDA they run in Triton's interpreter (``TRITON_INTERPRET=1``, which tests/conftest.py sets before
    anything imports Triton), with two adaptations for it, for the tests alone: the autotuner, which times its
    configurations through a GPU driver, takes the first configuration untimed; and the state kernels'
    loop indices, plain Python ints in the interpreter, become Triton tensors (fla calls ``i_t.to(...)``)."""
    import pytest

    from rfa_fairseq.ops.causal_rfa.fla import fla_installed

    if not fla_installed():
        pytest.skip("fla-core and Triton are not installed (pip install .[gpu])")
    if torch.cuda.is_available():
        return
    if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it before anything imports Triton
        pytest.fail("TRITON_INTERPRET=1 must be set before Triton is first imported")
    import builtins

    import fla.ops.common.chunk_h as chunk_h
    from triton.runtime import autotuner
    from triton.runtime.interpreter import _implicit_cvt

    autotuner.Autotuner.do_bench = property(lambda self: lambda fn, quantiles=None: [0.0, 0.0, 0.0])
    def index(bound):  # Triton 3.6's interpreter passes the loop bound as a one-element tensor, 3.7's as an int
        return int(bound.handle.data.reshape(-1)[0]) if hasattr(bound, "handle") else bound
    chunk_h.range = lambda *args: (_implicit_cvt(i) for i in builtins.range(*map(index, args)))


def skip_where_fla_refuses_gated_backward(gated: bool):
    """Skip a test of RFA-Gate's gradients through fla on a GPU stack where fla refuses them (Hopper with
    Triton >= 3.4 and < 3.7.1, its issue 640): users get fla's error there, and ``--rfa-backend auto`` torch."""
    from rfa_fairseq.ops.causal_rfa.fla import fla_chosen

    if gated and torch.cuda.is_available() and not fla_chosen("auto", torch.device("cuda"), gated=True):
        pytest.skip("fla refuses RFA-Gate's backward on this GPU's stack (Hopper, Triton < 3.7.1: fla issue 640)")


def fx_capture(step, warmup, pool=None):
    """A CUDA graph's capture (``rfa_fairseq.engines.step_graphs.capture_cuda_graph``'s signature) emulated on any device:
    ``step`` traced once into an operator graph (torch.fx, real tensors). As in a CUDA graph, the tensors it reads
    and writes are those of the capture (the same objects, so in-place writes reach the live state) and every
    Python value is frozen. The trace runs the step on the live state, which a CUDA capture does not: so the
    first replay returns the trace's output, and the later ones run the graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    warmup()
    traced = []
    graph = make_fx(lambda: traced.append(step()) or traced[-1])()
    return lambda: traced.pop() if traced else graph()


def causal_state(buffer: dict) -> torch.Tensor:
    """A causal RFA layer's decoding state, its deferred beam reorder (``parents``) applied."""
    parents = buffer.get("parents")
    return buffer["state"] if parents is None else buffer["state"].index_select(0, parents)


def emulate_cuda_graphs(monkeypatch, capture=fx_capture):
    """Make ``rfa_fairseq.engines.step_graphs`` capture steps on every device, with ``capture``; beam reorders happen at
    once, as they do on CUDA (on the CPU they wait for the next step)."""
    from rfa_fairseq.engines import step_graphs
    from rfa_fairseq.modules import causal_rfa_attention

    monkeypatch.setattr(step_graphs, "captures_on", lambda device: True)
    monkeypatch.setattr(causal_rfa_attention, "deferrable", lambda state: False)
    monkeypatch.setattr(step_graphs, "capture_cuda_graph", capture)
