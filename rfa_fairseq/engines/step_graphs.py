"""A decoding step replayed as one CUDA graph (``--cuda-graphs``).

A small batch's decoding step is hundreds of small kernels whose launches set its time on a GPU. RFA's state never
changes size, so the step (:meth:`RFATransformerDecoder.forward_step`) is captured once and replayed with one launch. A
graph reads and writes the memory it was captured on: it is keyed by the batch size and the address, shape and dtype of
every state tensor (and of the position table). Beam search's reorder alternates the causal states between two buffers,
so a batch size takes two graphs; a layout is captured when seen a second time (once: eager). Capture warms up on
copies of the state on a side stream (CUDA's lazy initialisation must not happen under capture), then records the step
on the live state without running it. On the CPU and under autograd, steps run eagerly."""
from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import Tensor, nn


def captures_on(device: torch.device) -> bool:
    """Whether steps on ``device`` are captured: CUDA devices (tests emulate capture elsewhere)."""
    return device.type == "cuda"


def capture_cuda_graph(step: Callable[[], Tensor], warmup: Callable[[], Tensor], pool) -> Callable[[], Tensor]:
    """``step`` as a CUDA graph in ``pool``, after ``warmup`` (the step on copies of the state): the replay runs it
    and returns its output (the same tensor each time). The capture itself runs nothing."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warmup()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()

    def replay() -> Tensor:
        graph.replay()
        return out
    return replay


class StepGraphs:
    """CUDA graphs of ``decoder.forward_step`` (an :class:`RFATransformerDecoder`'s), one per batch size and state
    layout (see the module docstring), at most ``max_graphs`` (the least recently used dropped)."""

    def __init__(self, decoder: nn.Module, max_graphs: int = 16):
        if not hasattr(decoder, "forward_step"):
            raise ValueError("--cuda-graphs replays RFA's fixed-size decoding step: it needs an RFA decoder "
                             "(not --decoder-attention softmax, whose cache grows every step)")
        if not isinstance(decoder.embed_tokens, nn.Embedding):
            raise ValueError(f"--cuda-graphs: the token embedding {type(decoder.embed_tokens).__name__} "
                             "(--adaptive-input, --character-embeddings) reads its masks back to the host and cannot "
                             "be captured")
        if any(getattr(layer.self_attn, "conv", None) is not None for layer in decoder.layers):
            raise ValueError("--cuda-graphs: --rfa-short-conv's last inputs are new tensors each step, not captured")
        self.decoder, self.max_graphs = decoder, max_graphs
        self.graphs: "OrderedDict[tuple, tuple]" = OrderedDict()  # key -> (tokens, position, sentence buffers, replay)
        self.seen_once, self.pool = set(), None

    def __call__(self, tokens: Tensor, position: int, encoder_out, incremental_state,
                 sentence: Optional[Tensor] = None) -> Optional[Tensor]:
        """The step's output from a graph, or None where the step is to run eagerly."""
        if torch.is_grad_enabled() or not captures_on(tokens.device) or not incremental_state:  # (the first: eager)
            return None
        key = self._key(tokens, incremental_state)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen_once:
                if len(self.seen_once) > 4 * self.max_graphs:
                    self.seen_once.clear()
                self.seen_once.add(key)
                return None
            self.seen_once.discard(key)
            try:
                entry = self.graphs[key] = self._capture(tokens, position, encoder_out, incremental_state, sentence)
            except RuntimeError as e:
                raise RuntimeError(f"--cuda-graphs: capturing the decoding step of {tokens.size(0)} rows failed "
                                   f"({e}); decode without --cuda-graphs") from e
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        token_buffer, position_buffer, sentence_buffer, replay = entry
        token_buffer.copy_(tokens)
        position_buffer.fill_(position)
        if sentence is not None:
            sentence_buffer.copy_(sentence)
        return replay()

    def _key(self, tokens: Tensor, incremental_state) -> tuple:
        own = self.decoder._incremental_state_id  # the decoder's own state (sentence counts) is read outside the step
        state = tuple((name, field, t.data_ptr(), t.shape, t.dtype) for name, fields in incremental_state.items()
                      if not name.startswith(own) for field, t in fields.items() if t is not None)
        table = self.decoder._position_table() if self.decoder.embed_positions is not None else None
        return (tokens.shape, tokens.device, None if table is None else table.data_ptr(), state)

    def _capture(self, tokens: Tensor, position: int, encoder_out, incremental_state, sentence: Optional[Tensor]):
        token_buffer, sentence_buffer = tokens.clone(), None if sentence is None else sentence.clone()
        position_buffer = torch.full((1,), position, dtype=torch.long, device=tokens.device)
        if self.pool is None and tokens.is_cuda:
            self.pool = torch.cuda.graph_pool_handle()
        copies = {name: {f: None if t is None else t.clone() for f, t in fields.items()}
                  for name, fields in incremental_state.items()}
        step = self.decoder.forward_step
        return token_buffer, position_buffer, sentence_buffer, capture_cuda_graph(
            lambda: step(token_buffer, position_buffer, encoder_out, incremental_state, sentence_buffer),
            lambda: step(token_buffer, position_buffer, encoder_out, copies, sentence_buffer), self.pool)

