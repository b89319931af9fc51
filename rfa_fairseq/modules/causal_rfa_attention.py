"""CausalRFAttention: RFA / RFA-Gate self-attention for decoders and language models.

Drop-in for fairseq's MultiheadAttention in a decoder layer's ``self_attn`` slot (same call
signature). Layout: Time x Batch x Channel in and out. Causality is structural (the recurrence
only looks back), so the decoder's future mask adds nothing and is only checked for shape.
During incremental decoding the state per layer is just ``S [B, H, F, K]`` and ``z [B, H, F]``
in fp32, packed as one tensor ``Sz [B, H, F, K + 1]`` (``z`` the last column; see
``ops.causal_rfa.recurrent``): its size does not depend on how many tokens have been decoded.
The first tokens of a decode are kept in the attention form instead (``ops.causal_rfa.keys``),
in a buffer of the same shape, until they would outgrow the summary.
"""
from collections.abc import Mapping
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .. import kernels
from ..ops import causal_keys_step, chunk_causal_rfa, gather_keys, keys_capacity, keys_to_summary, pack_state
from ..ops import recurrent_causal_rfa_step_packed, unpack_state
from ..ops.causal_rfa import DEFAULT_CHUNK_SIZE
from ..ops.denominator import DEFAULT_EPS
from .heads import merge_heads, split_heads
from .random_feature_map import RandomFeatureMap

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]

_ARANGE: Dict[Tuple[int, torch.device], Tensor] = {}


def _is_identity(order: Tensor, rows: int) -> bool:
    """Whether a beam order keeps all ``rows`` in place (compared with an ``arange`` made once per
    size and device)."""
    if order.numel() != rows:
        return False
    key = (rows, order.device)
    if key not in _ARANGE:
        with torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
            _ARANGE[key] = torch.arange(rows, device=order.device)
    return torch.equal(order, _ARANGE[key])


def init_projection(linear: nn.Linear, gain: float = 1.0):
    nn.init.xavier_uniform_(linear.weight, gain=gain)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


@with_incremental_state
class CausalRFAttention(nn.Module):
    """Causal random feature attention, optionally gated (RFA-Gate).

    Args:
        embed_dim: model dimension ``C``; num_heads: ``H`` (``K = C / H``).
        feature_map: the :class:`RandomFeatureMap` shared by queries and keys.
        gate: learn ``g_t = sigmoid(w_g . x_t + b_g)`` per head and step.
        recompute: under autograd, keep only the heads ``q, k, v`` (and log-gates) of a
            whole-sequence call for the backward pass, and compute the feature maps and the
            chunked form again there, instead of keeping their intermediates (about four times
            the heads' size): the bytes held for the backward pass fall to a fifth, for a second
            forward pass of the attention (see docs/benchmarks.md). Decoding is not affected.
        decode_kernel: how a decoding step (one token, no gradient) runs on the CPU: ``"cpp"`` the
            fused compiled kernel (``rfa_fairseq.kernels``: beam gather, decay, update and
            readout in one pass over the state), ``"torch"`` the PyTorch ops, ``"auto"`` the
            kernel for fp32 CPU steps when it builds, else the PyTorch ops. (The feature map has
            its own choice, see :class:`RandomFeatureMap`; the models set both from
            ``--rfa-decode-kernel``.)
    """

    STATE_KEY = "rfa_state"

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        feature_map: RandomFeatureMap,
        gate: bool = False,
        bias: bool = True,
        eps: float = DEFAULT_EPS,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        recompute: bool = False,
        decode_kernel: str = "auto",
    ):
        super().__init__()
        self.decode_kernel = kernels.check_choice(decode_kernel)
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.eps, self.chunk_size, self.recompute = eps, chunk_size, recompute
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.feature_map = feature_map
        self.gate_proj = nn.Linear(embed_dim, num_heads) if gate else None
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            init_projection(proj, gain=2**-0.5)
        init_projection(self.out_proj)
        if self.gate_proj is not None:
            init_projection(self.gate_proj)

    def _heads(self, x: Tensor, key_padding_mask: Optional[Tensor]):
        """The heads ``q, k, v [B, H, T, K]`` (before the feature map), ``log g [B, H, T]`` (or
        None) and the padding ``[B, 1, T]`` (or None)."""
        q = split_heads(self.q_proj(x), self.num_heads)
        k = split_heads(self.k_proj(x), self.num_heads)
        v = split_heads(self.v_proj(x), self.num_heads)
        log_g = pad = None
        if self.gate_proj is not None:
            log_g = F.logsigmoid(self.gate_proj(x).float()).permute(1, 2, 0)  # [B, H, T]
        if key_padding_mask is not None:
            # A padded step neither writes (k = 0) nor decays (log g = 0) the state.
            pad = key_padding_mask.to(torch.bool)[:, None, :]
            if log_g is not None:
                log_g = log_g.masked_fill(pad, 0.0)
        return q, k, v, log_g, pad

    def _features(self, q: Tensor, k: Tensor, pad: Optional[Tensor], random_matrix: Optional[Tensor] = None):
        """phi(q), phi(k) ``[B, H, T, F]``, with phi(k) = 0 at the pads."""
        # One feature-map call for queries and keys (they share the map): half the small ops.
        # Stacked on the batch axis, each head's rows keep one stride, so the projection's bmm
        # reads them without another copy.
        B = q.size(0)
        qk = self.feature_map(torch.cat([q, k], dim=0), random_matrix)
        q, k = qk[:B], qk[B:]
        if pad is not None:
            k = k.masked_fill(pad.unsqueeze(-1), 0.0)
        return q, k

    def _project(self, x: Tensor, key_padding_mask: Optional[Tensor]):
        """The inputs of the ops: phi(q), phi(k) (0 at the pads), v and log g (or None)."""
        q, k, v, log_g, pad = self._heads(x, key_padding_mask)
        q, k = self._features(q, k, pad)
        return q, k, v, log_g

    def _chunked(self, q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor], pad: Optional[Tensor],
                 random_matrix: Optional[Tensor] = None) -> Tensor:
        """The whole sequence at once (training, scoring): features, then the chunked form."""
        q, k = self._features(q, k, pad, random_matrix)
        return chunk_causal_rfa(q, k, v, log_g, eps=self.eps, chunk_size=self.chunk_size)

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[IncrementalState] = None,
        need_weights: bool = False,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """query: ``[T, B, C]``; key_padding_mask: ``[B, T]`` (True = pad).

        Returns ``([T, B, C], None)``: RFA has no attention matrix to return for
        self-attention (``need_weights`` is accepted for compatibility and yields None).
        """
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("CausalRFAttention is self-attention: key and value must be the query tensor")
        if static_kv or before_softmax:
            raise ValueError("CausalRFAttention supports neither static_kv nor before_softmax")
        T, B, _ = query.shape
        if attn_mask is not None and tuple(attn_mask.shape[-2:]) != (T, T):
            raise ValueError(f"attn_mask must be the {T}x{T} causal mask, got shape {tuple(attn_mask.shape)}")
        if incremental_state is not None:
            out = self._decode(incremental_state, *self._project(query, key_padding_mask))
            return self.out_proj(merge_heads(out)), None
        q, k, v, log_g, pad = self._heads(query, key_padding_mask)
        if self.recompute and torch.is_grad_enabled():
            # Keep only the heads for the backward pass and compute the features and the
            # chunked form again there (see ``recompute``).
            out = checkpoint(self._chunked, q, k, v, log_g, pad, self.feature_map.matrix_for_recompute(),
                             use_reentrant=False, preserve_rng_state=False)
        else:
            out = self._chunked(q, k, v, log_g, pad)
        return self.out_proj(merge_heads(out)), None

    def _decode(self, incremental_state: IncrementalState, q: Tensor, k: Tensor, v: Tensor,
                log_g: Optional[Tensor]) -> Tensor:
        """Incremental decoding: advance this layer's state by the new tokens and read them out.

        A decode that starts one token at a time keeps the attention form (``keys``: phi(k),
        ``[v | 1]`` and gate weights of the tokens so far, in a buffer the summary's size, see
        ``ops.causal_rfa.keys``) while it holds fewer numbers than the summary, then folds it into
        the summary ``Sz``: the same outputs, fewer bytes read and copied in the first steps.
        Several tokens in one call (a prompt) go through the chunked form and the summary.
        """
        if q.size(2) == 1 and kernels.usable(self.decode_kernel, q, v):
            return self._decode_fused(incremental_state, q, k, v, log_g)
        saved = self._current_state(incremental_state)
        if saved is None:
            saved = {}
            self.set_incremental_state(incremental_state, self.STATE_KEY, saved)
        # A state this module made (or gathered in _current_state) is ours alone, so without
        # autograd it is updated in place.
        inplace = not torch.is_grad_enabled()
        T = q.size(2)
        last = None if log_g is None else log_g[:, :, 0]
        if T == 1 and "Sz" not in saved and saved.get("len", 0) < self.keys_capacity:
            length = saved.get("len", 0)
            o, saved["keys"] = causal_keys_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], last, saved.get("keys"), length,
                                                eps=self.eps, inplace=inplace)
            saved["len"] = length + 1
            return o.unsqueeze(2)
        if "keys" in saved:
            self._fold_keys(saved)
        Sz = saved.get("Sz")
        if T == 1:
            o, Sz = recurrent_causal_rfa_step_packed(q[:, :, 0], k[:, :, 0], v[:, :, 0], last, Sz, eps=self.eps,
                                                     inplace=inplace)
            out = o.unsqueeze(2)
        else:
            out, final = chunk_causal_rfa(
                q, k, v, log_g, initial_state=None if Sz is None else unpack_state(Sz),
                output_final_state=True, eps=self.eps, chunk_size=self.chunk_size,
            )
            Sz = pack_state(*final)
        saved["Sz"] = Sz  # the reorder's spare buffer, if any, stays beside it
        return out

    def _decode_fused(self, incremental_state: IncrementalState, q: Tensor, k: Tensor, v: Tensor,
                      log_g: Optional[Tensor]) -> Tensor:
        """:meth:`_decode` of one token with the fused CPU kernel: a pending beam reorder is done by
        the kernel as it reads the state (into the spare buffer), not by a separate gather."""
        saved = self.get_incremental_state(incremental_state, self.STATE_KEY)
        if saved is None:
            saved = {}
            self.set_incremental_state(incremental_state, self.STATE_KEY, saved)
        length = saved.get("len", 0)
        keys = "Sz" not in saved and length < self.keys_capacity
        order = saved.get("order")
        name = "keys" if keys else "Sz"
        if (not keys and "keys" in saved) or (order is not None and order.numel() != saved[name].size(0)):
            # Folding into the summary (once per decode) or a batch that shrank: gather first.
            saved = self._current_state(incremental_state)
            order = None
            if "keys" in saved and not keys:
                self._fold_keys(saved)
        src = saved.get(name)
        if src is None:  # the first token
            B, H, Fd = q.shape[0], q.shape[1], q.shape[3]
            shape = (B, H, Fd, v.shape[3] + 1)
            src = q.new_empty(shape) if keys else q.new_zeros(shape)
        dst = src
        if order is not None:
            del saved["order"]
            if _is_identity(order, src.size(0)):
                order = None
            else:
                dst = saved.pop("spare", None)
                if dst is None:
                    dst = torch.empty_like(src)
                saved["spare"] = src
        last = None if log_g is None else log_g[:, :, 0]
        if keys:
            o = kernels.fused_keys_step(src, dst, order, length, q[:, :, 0], k[:, :, 0], v[:, :, 0], last, self.eps)
            saved["len"] = length + 1
        else:
            o = kernels.fused_summary_step(src, dst, order, q[:, :, 0], k[:, :, 0], v[:, :, 0], last, self.eps)
        saved[name] = dst
        return o.unsqueeze(2)

    @property
    def keys_capacity(self) -> int:
        """How many tokens a decode keeps in the attention form before folding them."""
        return keys_capacity(self.feature_map.output_dim, self.head_dim, self.gate_proj is not None)

    def _fold_keys(self, saved: Dict) -> None:
        """The attention form -> the summary ``Sz`` (a new tensor of the same size; the keys
        buffer is dropped, not kept as a spare that a decode without reorders would never use)."""
        buf, length = saved.pop("keys"), saved.pop("len")
        saved["Sz"] = keys_to_summary(buf, length, self.gate_proj is not None)

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        """Beam search: the rows of the state that the surviving hypotheses continue.

        The gather is deferred to this layer's next step (:meth:`_current_state`), which does it
        just before the update reads the state again: fairseq reorders every layer before the
        step runs, and in between the other layers' weights would evict a gathered state from
        the caches. Reorders before a step compose; a reader of the state sees them applied.
        """
        saved = self.get_incremental_state(incremental_state, self.STATE_KEY)
        if saved is None:
            return incremental_state
        pending = saved.get("order")
        saved["order"] = new_order.clone() if pending is None else pending.index_select(0, new_order)
        return incremental_state

    def _current_state(self, incremental_state: IncrementalState) -> Optional[Dict[str, Optional[Tensor]]]:
        """The saved state with any pending reorder applied.

        Without autograd the rows are gathered into a spare buffer kept in the state (then the
        two swap roles), so a decoding step allocates no new state-sized memory: on CPU a fresh
        multi-MiB tensor per layer and step costs more in page faults than the copy itself. The
        identity order (beam size 1) copies nothing.
        """
        saved = self.get_incremental_state(incremental_state, self.STATE_KEY)
        if saved is None or saved.get("order") is None:
            return saved
        order = saved.pop("order")
        name = "keys" if "keys" in saved else "Sz"
        buf, spare = saved[name], saved.pop("spare", None)
        rows = buf.size(0)
        if _is_identity(order, rows):
            pass
        elif torch.is_grad_enabled() or buf.requires_grad or spare is None or order.numel() != rows:
            # The first reorder, a batch that shrank, or autograd: a fresh tensor (the old one
            # becomes the spare when the shapes match, so later steps stop allocating).
            keep = not (torch.is_grad_enabled() or buf.requires_grad) and order.numel() == rows
            buf, spare = self._gather(saved, buf, order), (buf if keep else None)
        else:
            buf, spare = self._gather(saved, buf, order, out=spare), buf
        saved[name] = buf
        if spare is not None:
            saved["spare"] = spare
        return saved

    def _gather(self, saved: Dict, buf: Tensor, order: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """``buf``'s batch rows in ``order``: of the attention form only the keys in use."""
        if "keys" in saved:
            return gather_keys(buf, saved["len"], order, self.gate_proj is not None, out=out)
        return buf.index_select(0, order) if out is None else torch.index_select(buf, 0, order, out=out)

    # fairseq's decoder layer reads these on MultiheadAttention; keep the same names.
    def _get_input_buffer(self, incremental_state: Optional[IncrementalState]) -> Mapping:
        """The state, with any pending reorder applied when it is first read. fairseq's decoder
        layer calls this before every self-attention step and does not read the result (unless
        ``--cross-self-attention``, which RFA refuses), so the gather stays with the step, where
        the fused kernel does it as it reads the state."""
        if incremental_state is None:
            return {}
        return _ReadOnFirstUse(lambda: self._current_state(incremental_state) or {})

    def _set_input_buffer(self, incremental_state: IncrementalState, buffer: Dict[str, Optional[Tensor]]):
        return self.set_incremental_state(incremental_state, self.STATE_KEY, buffer)


class _ReadOnFirstUse(Mapping):
    """A mapping that calls ``resolve`` for its contents when it is first read."""

    def __init__(self, resolve: Callable[[], Dict]):
        self._resolve, self._contents = resolve, None

    def _get(self) -> Dict:
        if self._contents is None:
            self._contents = self._resolve()
        return self._contents

    def __getitem__(self, name):
        return self._get()[name]

    def __iter__(self):
        return iter(self._get())

    def __len__(self):
        return len(self._get())
