"""Decoding steps run by ONNX Runtime (``--onnx-runtime``).

A decoding step of a small batch is hundreds of small operators, and on the CPU its time is their dispatch, not their
arithmetic. RFA's step has fixed-size inputs and state, so it is a pure function (:class:`StepFunction`).
:class:`OnnxStep` exports it from the model's own :meth:`RFATransformerDecoder.forward_step` (``torch.onnx.export``,
dynamic in the rows, the sources, their length, sentences and windows), runs it with ONNX Runtime on the tensors where
they lie (I/O binding) and writes the advanced states into the buffers beside them (``spare_state``: the two alternate).

The beam reorder is folded into the step: each causal layer defers its ``new_order`` (``parents`` in its buffer), and
the next step gathers the parents' rows as it reads the state. A step the engine does not run (the first, a layout it
cannot export) runs eagerly. The exported graph (and, with ``int8``, ONNX Runtime's dynamic int8 quantization of its
matrix products) is cached on disk by a hash of the weights and the layout: a second process loads it, not exports."""
import hashlib
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .modules import CausalRFAttention

logger = logging.getLogger(__name__)

# Per decoding-state field, its dynamic axes: rows (R: this step's), P (the previous step's rows, the causal state's),
# S (sources), T (the source's length), J (sentences), W (the widest window).
AXES = {"state": {0: "P"}, "prev_key": {0: "S", 2: "T"}, "prev_value": {0: "S", 2: "T"}, "k": {0: "S", 2: "T"},
        "prev_key_padding_mask": {0: "S", 1: "T"}, "window_kv": {0: "S", 2: "T"}, "window_spans": {0: "S", 1: "J"},
        "window_offsets": {0: "S", 1: "W"}, "v": {0: "S", 2: "T"}, "key_padding_mask": {0: "S", 1: "T"}}
EXAMPLE = {"S": 3, "T": 37, "J": 7, "W": 11}  # sizes to trace at, none 0 or 1 (which torch.export specializes)
# Steps of more rows run eagerly: there the state's bytes outweigh the dispatch, and the eager step reads and writes the
# state once (ops/causal_rfa/fused.py) where ONNX Runtime's nodes each pass over it (docs/benchmarks.md)
MAX_ROWS = 16


def available() -> bool:
    try:
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError:
        return False
    return True


def cache_dir() -> Path:
    return Path(os.environ.get("RFA_ONNX_CACHE") or Path.home() / ".cache" / "rfa_fairseq" / "onnx")


class StepFunction(nn.Module):
    """:meth:`forward_step` as a function of tensors: ``tokens [R, 1]``, ``position [1]``, ``parents [R]`` (each
    row's row in the previous step's causal states), ``sentence [R]`` (with ``--sentence-index``), then the decoding
    state's tensors in ``layout``'s order; returns the scores ``[R, 1, V]`` and the causal states advanced."""

    def __init__(self, decoder: nn.Module, layout: List[Tuple[str, str, bool]], sentence: bool, source: bool):
        super().__init__()
        self.decoder, self.layout, self.sentence, self.source = decoder, layout, sentence, source

    def forward(self, tokens: Tensor, position: Tensor, parents: Tensor, *tensors: Tensor):
        sentence = tensors[0] if self.sentence else None
        state: Dict[str, Dict[str, Tensor]] = {}
        for (key, name, causal), t in zip(self.layout, tensors[self.sentence:]):
            state.setdefault(key, {})[name] = t.index_select(0, parents) if causal else t
        # cross attention reads its cache; the encoder output only tells fairseq's layer to run it
        enc = {"encoder_out": [tokens.new_zeros(1, 1, 1, dtype=torch.float32)]} if self.source else None
        out = self.decoder.forward_step(tokens, position, enc, state, sentence)
        return (out, *[state[key][name] for key, name, causal in self.layout if causal])


class OnnxStep:
    """The decoder's step engine (``decoder.step_engine``) that runs :class:`StepFunction` in ONNX Runtime: called as
    :class:`StepGraphs` is, it returns the step's scores, or None where the step is to run eagerly."""

    def __init__(self, decoder: nn.Module, int8: bool = False, int8_min_weights: int = 0):
        if not hasattr(decoder, "forward_step"):
            raise ValueError("--onnx-runtime runs RFA's fixed-size decoding step: it needs an RFA decoder "
                             "(not --decoder-attention softmax, whose cache grows every step)")
        self.decoder, self.int8, self.int8_min_weights = decoder, int8, int8_min_weights
        self.causal = [m for m in decoder.modules() if isinstance(m, CausalRFAttention)]
        # the layers' places in the decoder (ids differ by process); the decoder's own state is read outside the step
        self.index = {m._incremental_state_id: i for i, m in enumerate(decoder.modules())
                      if hasattr(m, "_incremental_state_id") and m is not decoder}
        self.graphs, self._weights_hash, self.setup_seconds = {}, None, 0.0  # graphs: by the step's layout

    def __call__(self, tokens: Tensor, position: int, encoder_out, incremental_state,
                 sentence: Optional[Tensor] = None) -> Optional[Tensor]:
        rows, beam = tokens.size(0), max(getattr(self.decoder, "_beam_size", 1), 1)  # fairseq's set_beam_size
        layout, d = self._layout(incremental_state), self.decoder
        if (rows > MAX_ROWS or layout is None or torch.is_grad_enabled() or tokens.device.type != "cpu"
                or any(not causal and t.size(0) * beam != rows for _, _, causal, t in layout)  # rows: the beams
                or d.embed_positions is not None and position >= d._position_table().size(0)):
            return None
        key = (beam, sentence is not None, encoder_out is not None,
               tuple((self.index[k.split(".")[0]], n, causal, t.dtype, t.dim()) for k, n, causal, t in layout))
        if key not in self.graphs:
            int8, start = f"-int8-{self.int8_min_weights}" if self.int8 else "", time.perf_counter()
            path = cache_dir() / f"step-{self._hash(key)}{int8}.onnx"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                self._export(key, layout, sentence, path)
            self.graphs[key] = Graph(path)
            self.setup_seconds += time.perf_counter() - start  # the export or the load
        parents, states = None, []
        for k, _, causal, t in layout:  # the advanced states go to the spare buffers, which then hold the state
            if causal:
                buffer = incremental_state[k]
                pending = buffer.pop("parents", None)
                parents = pending if pending is not None else parents
                spare = buffer.get("spare_state")
                if spare is None or spare.size(0) < rows or spare.shape[1:] != t.shape[1:]:
                    spare = t.new_empty((max(rows, t.size(0)),) + t.shape[1:])
                buffer["state"], buffer["spare_state"] = spare[:rows], t
                states.append(spare[:rows])
        step = [tokens, torch.tensor([position]), torch.arange(rows) if parents is None else parents, sentence]
        return self.graphs[key].run([t for t in step if t is not None], [t for *_, t in layout], states)

    def _layout(self, incremental_state) -> Optional[List[tuple]]:
        """The decoding state's tensors in fixed order as (key, field, causal, tensor); None at a field not in AXES."""
        layout = []
        for key in sorted((k for k in incremental_state if k.split(".")[0] in self.index),
                          key=lambda k: self.index[k.split(".")[0]]):
            causal = any(key.startswith(m._incremental_state_id) for m in self.causal)
            for name, t in sorted(incremental_state[key].items()):
                if name in ("spare_state", "parents") or t is None:
                    continue
                if name not in AXES:
                    logger.warning("--onnx-runtime: the decoding state's field %s is not one it knows; decoding "
                                   "eagerly", name)
                    return None
                layout.append((key, name, causal, t.contiguous()))
        return layout

    def _hash(self, key) -> str:
        if self._weights_hash is None:
            h = hashlib.sha256()
            for name, t in sorted(self.decoder.state_dict().items()):
                h.update(name.encode())
                h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            self._weights_hash = h.hexdigest()
        from . import __version__
        import onnxruntime
        text = repr((self._weights_hash, key, __version__, torch.__version__, onnxruntime.__version__))
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def _export(self, key, layout, sentence, path: Path):
        """Trace :class:`StepFunction` at example sizes (EXAMPLE, the rows the sources' beams) and write the graph to
        ``path`` (int8: quantized), through a temporary file (another process may be writing the same)."""
        from torch.export import Dim
        beam, source = key[0], any(not causal for _, _, causal, _ in layout)
        sizes = dict(EXAMPLE, R=EXAMPLE["S"] * beam, P=EXAMPLE["S"] * beam + 2)
        dims = {name: Dim(f"rows_{name}" if name in "RP" else f"size_{name}", min=1) for name in sizes}
        if source:  # a row is a beam of a source: R = beam S (one dim where beam is 1)
            dims["R"] = dims["S"] * beam if beam > 1 else dims["S"]
        step = StepFunction(self.decoder, [entry[:3] for entry in layout], sentence is not None, source).eval()
        args, shapes = [torch.zeros(sizes["R"], 1, dtype=torch.long), torch.tensor([2]),
                        torch.arange(sizes["R"])], [{0: dims["R"]}, None, {0: dims["R"]}]
        if sentence is not None:
            args.append(torch.zeros(sizes["R"], dtype=torch.long))
            shapes.append({0: dims["R"]})
        for _, name, causal, t in layout:
            axes = AXES[name] if causal or name != "state" else {0: "S"}  # CrossRFAttention's state [S, H, F, K + 1]
            shape = [sizes[axes[i]] if i in axes else n for i, n in enumerate(t.shape)]
            args.append(torch.arange(shape[1]).repeat(shape[0], 1) if name == "window_offsets"
                        else torch.zeros(shape, dtype=t.dtype))
            shapes.append({i: dims[a] for i, a in axes.items()})
        tmp, start = path.with_suffix(f".{os.getpid()}.tmp"), time.perf_counter()
        levels = {log: log.level for log in map(logging.getLogger, ("", "onnxscript", "onnx_ir", "torch.onnx"))}
        try:  # the exporter's passes log every node, the quantizer advice to the root logger
            for log in levels:
                log.setLevel(logging.ERROR)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(step, tuple(args), dynamic_shapes=(*shapes[:3], tuple(shapes[3:])), dynamo=True,
                                  optimize=True, verbose=False).save(str(tmp))
                if self.int8:
                    quantize(tmp, self.int8_min_weights)
        finally:
            for log, level in levels.items():
                log.setLevel(level)
        tmp.replace(path)
        logger.info("--onnx-runtime: exported the decoding step in %.1f s to %s", time.perf_counter() - start, path)


def quantize(path: Path, min_weights: int):
    """The graph at ``path`` with its products by a weight matrix (2-D, at least ``min_weights`` numbers) in int8,
    by ONNX Runtime's dynamic quantization (one scale per output column, the inputs quantized at run time). Weights in
    uint8, as the inputs: int8 weights beside uint8 inputs saturate AVX2's 16-bit sums on CPUs without VNNI (16 times
    uint8's error in the tests' model). A weight the graph transposes at run time (the output projection shares the
    embedding's) becomes a transposed copy."""
    import onnx
    from onnx import numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic
    model = onnx.load(str(path))
    graph = model.graph
    del graph.value_info[:]  # the exporter's intermediate shapes: the quantizer infers its own
    weights = {w.name: w for w in graph.initializer}
    made = {o: n for n in graph.node for o in n.output}
    nodes = []
    for n in graph.node:
        if n.op_type not in ("MatMul", "Gemm"):
            continue
        source = made.get(n.input[1])
        if n.op_type == "MatMul" and source is not None and source.op_type == "Transpose" and source.input[0] in weights:
            transposed = numpy_helper.to_array(weights[source.input[0]]).T.copy()
            graph.initializer.append(numpy_helper.from_array(transposed, n.input[1] + "_weight"))
            weights[n.input[1] + "_weight"] = graph.initializer[-1]
            n.input[1] = n.input[1] + "_weight"
        w = weights.get(n.input[1])
        if w is not None and len(w.dims) == 2 and w.dims[0] * w.dims[1] >= min_weights:
            nodes.append(n.name)
    onnx.save(model, str(path))
    if nodes:  # (an empty list would quantize every product)
        quantize_dynamic(str(path), str(path), per_channel=True, weight_type=QuantType.QUInt8, nodes_to_quantize=nodes)


class Graph:
    """A :class:`StepFunction` graph in ONNX Runtime, run on torch tensors in place (I/O binding)."""

    def __init__(self, path: Path):
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = torch.get_num_threads(), 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.ort = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs, self.outputs = [i.name for i in self.ort.get_inputs()], [o.name for o in self.ort.get_outputs()]
        self.vocab = self.ort.get_outputs()[0].shape[-1]
        # the scores' buffer, the step's small inputs' buffers by rows, the I/O bindings by the tensors' addresses
        self.scores, self.staged, self.bindings = None, {}, {}

    def run(self, step: List[Tensor], held: List[Tensor], states: List[Tensor]) -> Tensor:
        """The graph on ``step`` (tokens, position, parents, sentence: copied into the graph's buffers) and ``held``
        (the decoding state, read where it lies), the causal states advanced into ``states``; returns the scores
        ``[R, 1, V]`` (a buffer the next call overwrites). Bindings are kept by address: the states alternate in two."""
        rows = step[0].size(0)
        if self.scores is None or self.scores.size(0) < rows:
            self.scores, self.bindings = torch.empty(rows, 1, self.vocab), {}
        staged = self.staged.get(rows)
        if staged is None:
            staged = self.staged[rows] = [t.contiguous().clone() for t in step]
        for buffer, t in zip(staged, step):
            buffer.copy_(t)
        scores = self.scores[:rows]
        key = tuple((t.data_ptr(), t.shape) for t in [*staged, *held, *states])
        binding = self.bindings.get(key)
        if binding is None:
            if len(self.bindings) > 16:  # batches of other shapes came before
                self.bindings.clear()
            binding = self.bindings[key] = self.ort.io_binding()
            for name, t in zip(self.inputs, [*staged, *held]):
                bind(binding.bind_input, name, t)
            for name, t in zip(self.outputs, [scores, *states]):
                bind(binding.bind_output, name, t)
        self.ort.run_with_iobinding(binding)
        return scores


def bind(method, name: str, t: Tensor):
    import numpy as np
    dtype = {torch.float32: np.float32, torch.int64: np.int64, torch.bool: np.bool_}[t.dtype]
    method(name, "cpu", 0, dtype, list(t.shape), t.data_ptr())
