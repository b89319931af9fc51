"""Task ``rfa_stateful_lm``: RFA language models that carry their recurrent state across blocks.

Training (``--burn-in-blocks N``, default 2): shuffled blocks of ``--tokens-per-sample`` tokens,
``--batch-size`` a batch, as ``language_modeling`` takes them, each starting from the state every
causal RFA layer builds, without gradient and with the update's random draw, over the N blocks
before it in the text (a burn-in). Validation and ``fairseq-eval-lm`` carry the state through the
whole split, block after block, so a model is trained for the state it is scored with, while its
updates see the text in random order. With ``--burn-in-blocks 0`` training carries the state
along contiguous streams instead (below); on the WikiText text of ``results/stateful_lm.py``
successive updates then read the same few articles and generalise much worse (docs/quality.md).

Streams (validation, evaluation, and training with ``--burn-in-blocks 0``):
The text of a split is cut into blocks of ``--tokens-per-sample`` tokens exactly as fairseq's
``language_modeling`` task cuts it (``--sample-break-mode none``: same inputs, same targets, every
token a target once), then laid out as ``rows x L`` contiguous streams: with ``R`` rows in all
(``--batch-size`` per process times the number of processes), row ``r`` holds blocks
``r L .. r L + L - 1`` and batch ``i`` is column ``i`` (fairseq's ``truncated_bptt_lm`` example does
the same). Each process takes its own ``--batch-size`` consecutive rows, so every rank has its own
contiguous streams and the same number of batches. The last rows are padded where the text runs out.

``--stream-groups G`` lays the text out as ``G x rows`` streams instead and lets consecutive batches
take turns among G groups of ``rows`` streams (batch ``i``: group ``i mod G``, column ``i div G``).
With one group every update reads the continuation of the passages the previous update read, so
successive gradients come from the same few articles, unlike the shuffled blocks of
``language_modeling``; with G groups an update sees other text than the G - 1 updates before it.

Each causal RFA module of the model gets a :class:`CarriedState` per group of streams: a batch starts from
the state the previous batch of its stream left behind, and leaves its own, detached (truncated
backpropagation through time). Train and each valid split are separate streams; a stream starts
from zero at its first batch, so at the start of every epoch and validation, and after a resume
(the data position is kept by fairseq's iterator; the state is not saved in checkpoints).

Positions: by default fairseq's positional embeddings restart at every block (1 ..
tokens-per-sample), as in training without state; the history beyond the block reaches the model
only through the carried state, so a model trained with or without state evaluates either way,
at any block length up to the one it was built for. With ``--carry-positions`` the (sinusoidal)
positions continue along each stream instead, as they would over the text taken whole
(:class:`ContinuingPositions`). A model without positions (``--no-token-positional-embeddings``)
sees no block boundary at all.

``fairseq-eval-lm`` calls the model directly, batch after batch in order: the task gives the
model one stream's carries when it builds it, so evaluation carries the state from the first
block to the last (one stream unless ``--batch-size`` says more).
"""
import logging
import math
import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from fairseq import utils
from fairseq.data import Dictionary, FairseqDataset, TokenBlockDataset, data_utils, iterators
from fairseq.data.indexed_dataset import get_available_dataset_impl
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.modules import SinusoidalPositionalEmbedding
from fairseq.tasks import FairseqTask, register_task
from omegaconf import II
from torch import nn

from ..modules.causal_rfa_attention import CarriedState, CausalRFAttention
from ..validation import non_negative_int, positive_int

logger = logging.getLogger(__name__)


@dataclass
class StatefulLMConfig(FairseqDataclass):
    data: Optional[str] = field(
        default=None, metadata={"help": "data directory (fairseq-preprocess --only-source output: dict.txt, train.*, ...)"}
    )
    tokens_per_sample: int = field(
        default=512,
        metadata={"help": "block length: tokens per row of a batch (backpropagation reaches this far back; "
                          "the carried state reaches back to the start of the stream)"},
    )
    stream_groups: int = field(
        default=1,
        metadata={"help": "lay the text out as this many times --batch-size streams, and let consecutive batches "
                          "take turns among the groups of --batch-size streams (each group carries its own state), "
                          "so that successive updates read different parts of the text"},
    )
    max_target_positions: Optional[int] = field(
        default=None, metadata={"help": "positions the model is built for (default: --tokens-per-sample)"}
    )
    no_carry_state: bool = field(
        default=False,
        metadata={"help": "start every block from a zero state (the streams' order without the carried state: the "
                          "control that tells the state's effect from the order's)"},
    )
    burn_in_blocks: int = field(
        default=2,
        metadata={"help": "train on shuffled blocks, as --task language_modeling does, each starting from the state "
                          "the model builds, without gradient, over the N blocks before it in the text (0: carry the "
                          "state along contiguous streams, which --stream-groups, --no-carry-state and "
                          "--carry-positions need). Validation and fairseq-eval-lm carry the state through the split "
                          "either way"},
    )
    carry_positions: bool = field(
        default=False,
        metadata={"help": "positions continue along each stream from block to block (sinusoidal positions only), "
                          "instead of restarting at every block"},
    )
    # Read by fairseq's language model config; blocks continue the text, so there is no BOS to add.
    add_bos_token: bool = field(default=False, metadata={"help": "not supported by rfa_stateful_lm"})
    dataset_impl: Optional[ChoiceEnum(get_available_dataset_impl())] = II("dataset.dataset_impl")
    train_subset: str = II("dataset.train_subset")
    seed: int = II("common.seed")


def causal_rfa_modules(model) -> List[CausalRFAttention]:
    return [m for m in model.modules() if isinstance(m, CausalRFAttention)]


def sinusoidal(positions: torch.Tensor, dim: int, padding_idx: int) -> torch.Tensor:
    """fairseq's sinusoidal embedding of each position (``SinusoidalPositionalEmbedding.get_embedding``
    row by row, the same arithmetic), computed for the positions given rather than read from a
    table, which would grow with the stream; zero where the position is ``padding_idx``."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float, device=positions.device) * -(math.log(10000) / (half - 1)))
    angles = positions.float().unsqueeze(-1) * freqs
    emb = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    if dim % 2:
        emb = torch.nn.functional.pad(emb, (0, 1))
    return emb.masked_fill(positions.eq(padding_idx).unsqueeze(-1), 0.0)


class ContinuingPositions(nn.Module):
    """Sinusoidal positions that continue from block to block of a stream: a block's tokens get the
    positions they would have in the text taken whole. ``offset`` is the stream position of the
    next block's first token: the task sets it from the batch's column before each step, and each
    call advances it by the block's length (so fairseq-eval-lm, which calls the model batch after
    batch without the task, continues one stream)."""

    def __init__(self, embed: SinusoidalPositionalEmbedding):
        super().__init__()
        self.embedding_dim, self.padding_idx, self.max_positions = embed.embedding_dim, embed.padding_idx, int(1e9)
        self.offset = 0

    def forward(self, tokens: torch.Tensor, incremental_state=None, **_):
        if incremental_state is not None:
            raise ValueError("--carry-positions applies to blocks of a stream, not to incremental decoding: generate "
                             "with --task language_modeling")
        positions = utils.make_positions(tokens, self.padding_idx, onnx_trace=False)
        positions = torch.where(positions.ne(self.padding_idx), positions + self.offset, positions)
        self.offset += tokens.size(1)
        return sinusoidal(positions, self.embedding_dim, self.padding_idx)


def stream_layout(num_blocks: int, rows: int, num_shards: int = 1, shard_id: int = 0) -> torch.Tensor:
    """Block indices ``[rows, L]`` of one process: its rows of the ``rows * num_shards`` contiguous
    streams, ``L = ceil(num_blocks / (rows * num_shards))``; -1 where the text has run out."""
    positive_int("--batch-size", rows)
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"shard {shard_id} out of {num_shards}")
    total_rows = rows * num_shards
    length = -(-num_blocks // total_rows)
    blocks = torch.arange(total_rows * length).view(total_rows, length)
    blocks[blocks >= num_blocks] = -1
    return blocks[shard_id * rows:(shard_id + 1) * rows]


class TextBlocks(FairseqDataset):
    """The blocks of one split in text order, each ``(source, target)``, and the split's name
    (the stream the carried states belong to)."""

    def __init__(self, blocks: TokenBlockDataset, name: str):
        self.blocks, self.name = blocks, name

    def __getitem__(self, index):
        source, target, _ = self.blocks[index]
        return source, target

    def __len__(self):
        return len(self.blocks)


class StreamBatches(torch.utils.data.Dataset):
    """Item ``i`` is batch ``i`` of a :func:`stream_layout` of ``groups x rows`` streams: the rows
    of group ``i mod groups`` at column ``i div groups``."""

    def __init__(self, text: TextBlocks, layout: torch.Tensor, groups: int = 1):
        self.text, self.groups = text, groups
        self.layout = layout.view(groups, layout.size(0) // groups, layout.size(1))

    def __getitem__(self, i):
        group, column = i % self.groups, i // self.groups
        blocks = self.layout[group, :, column]
        return group, column, blocks, [self.text[b] if b >= 0 else None for b in blocks.tolist()]

    def __len__(self):
        return self.groups * self.layout.size(2)


class BurnInBlocks(torch.utils.data.Dataset):
    """Item ``i``: block ``i`` of the text (``(source, target)``) and the sources of the ``n`` blocks
    before it, oldest first (None before the text's first block)."""

    def __init__(self, text: TextBlocks, n: int):
        self.text, self.n = text, n

    def __getitem__(self, i):
        return i, self.text[i], [self.text[j][0] if j >= 0 else None for j in range(i - self.n, i)]

    def __len__(self):
        return len(self.text)


@register_task("rfa_stateful_lm", dataclass=StatefulLMConfig)
class StatefulLanguageModelingTask(FairseqTask):
    """Language modelling over contiguous streams with the RFA state carried across batches."""

    def __init__(self, cfg: StatefulLMConfig, dictionary: Dictionary):
        super().__init__(cfg)
        if cfg.add_bos_token:
            raise ValueError("--add-bos-token is not supported by --task rfa_stateful_lm: blocks continue the text")
        non_negative_int("--burn-in-blocks", cfg.burn_in_blocks)
        if cfg.burn_in_blocks:
            clash = [name for name, on in (("--stream-groups", cfg.stream_groups != 1), ("--no-carry-state",
                     cfg.no_carry_state), ("--carry-positions", cfg.carry_positions)) if on]
            if clash:
                raise ValueError(f"--burn-in-blocks {cfg.burn_in_blocks} trains on shuffled blocks, which {clash[0]} "
                                 "does not apply to: drop it, or train on streams with --burn-in-blocks 0")
        self.dictionary = dictionary
        self.carries = {}  # (split, group) -> one CarriedState per causal RFA module

    @classmethod
    def setup_task(cls, cfg: StatefulLMConfig, **kwargs):
        if not cfg.data:
            raise ValueError("--task rfa_stateful_lm needs the data directory")
        dictionary = Dictionary.load(os.path.join(utils.split_paths(cfg.data)[0], "dict.txt"))
        logger.info(f"dictionary: {len(dictionary)} types")
        return cls(cfg, dictionary)

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.dictionary

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        modules = causal_rfa_modules(model)
        if not modules:
            arch = getattr(cfg, "arch", None) or getattr(cfg, "_name", None) or type(model).__name__
            raise ValueError(
                f"--task rfa_stateful_lm carries the recurrent state of RFA attention, and this model ({arch}) has "
                "no RFA attention: use an rfa_transformer_lm architecture, train a softmax model with --task "
                "language_modeling, or convert a softmax checkpoint with scripts/convert_from_softmax.py"
            )
        # fairseq-eval-lm calls the model without the task: one stream, carried through the whole pass.
        for m in modules:
            m.carry = CarriedState()
        if self.cfg.carry_positions:
            embed = getattr(model.decoder, "embed_positions", None)
            if not isinstance(embed, SinusoidalPositionalEmbedding):
                raise ValueError("--carry-positions continues sinusoidal positions along a stream; this model has "
                                 + ("no positional embeddings" if embed is None else "learned positions, which end at "
                                    "--max-target-positions") + ": drop --carry-positions, or train with sinusoidal "
                                 "positions (no --decoder-learned-pos)")
            model.decoder.embed_positions = ContinuingPositions(embed)
        return model

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        paths = utils.split_paths(self.cfg.data)
        split_path = os.path.join(paths[(epoch - 1) % len(paths)], split)
        tokens = data_utils.load_indexed_dataset(split_path, self.dictionary, self.cfg.dataset_impl, combine=combine)
        if tokens is None:
            raise FileNotFoundError(f"Dataset not found: {split} ({split_path})")
        blocks = TokenBlockDataset(tokens, tokens.sizes, self.cfg.tokens_per_sample, pad=self.dictionary.pad(),
                                   eos=self.dictionary.eos(), break_mode="none", include_targets=True)
        self.datasets[split] = TextBlocks(blocks, split)

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, max_positions=None,
                           ignore_invalid_inputs=False, required_batch_size_multiple=1, seed=1, num_shards=1,
                           shard_id=0, num_workers=0, epoch=1, data_buffer_size=0, disable_iterator_cache=False,
                           skip_remainder_batch=False, grouped_shuffling=False, update_epoch_batch_itr=False,
                           groups=None):
        """Batches in stream order, never shuffled (each row continues the row of its group's
        previous batch). ``max_sentences`` (``--batch-size``) is the number of streams of a batch;
        ``groups`` (default ``--stream-groups``) how many groups of them take turns; ``max_tokens``
        plays no part."""
        if max_sentences is None:
            raise ValueError("--task rfa_stateful_lm needs --batch-size: the number of text streams per process "
                             "(each row of a batch continues one stream)")
        if isinstance(max_positions, int) and self.cfg.tokens_per_sample > max_positions:
            raise ValueError(f"--tokens-per-sample {self.cfg.tokens_per_sample} exceeds the model's {max_positions} "
                             "positions; with the carried state a shorter block loses no context")
        if self.cfg.burn_in_blocks and dataset.name == self.cfg.train_subset and groups is None:
            return self.burn_in_iterator(dataset, max_sentences, seed, num_shards, shard_id, num_workers, epoch,
                                         data_buffer_size, skip_remainder_batch)
        groups = self.cfg.stream_groups if groups is None else groups
        positive_int("--stream-groups", groups)
        batches = StreamBatches(dataset, stream_layout(len(dataset), max_sentences * groups, num_shards, shard_id),
                                groups)
        # A batch whose streams have all run out (a group's last columns) is skipped; every rank
        # skips the same ones, so all ranks keep the same number of batches.
        everywhere = stream_layout(len(dataset), max_sentences * groups * num_shards)
        real = (everywhere.view(num_shards, groups, max_sentences, -1) >= 0).any(2).any(0)  # [groups, L]
        return iterators.EpochBatchIterator(
            dataset=batches,
            collate_fn=lambda items: self.collate(items, dataset.name),
            batch_sampler=[[i] for i in range(len(batches)) if real[i % groups, i // groups]],
            epoch=epoch,
            num_workers=num_workers,
            buffer_size=data_buffer_size,
            disable_shuffling=True,
            skip_remainder_batch=skip_remainder_batch,
        )

    def burn_in_iterator(self, dataset, rows, seed, num_shards, shard_id, num_workers, epoch, data_buffer_size,
                         skip_remainder_batch):
        """Training with ``--burn-in-blocks N``: every block once per epoch, ``rows`` blocks a batch,
        shuffled anew each epoch (seed + epoch), each with the N blocks before it."""
        def batches(_, epoch):
            order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            return [order[i:i + rows] for i in range(0, len(order), rows)]

        return iterators.EpochBatchIterator(
            dataset=BurnInBlocks(dataset, self.cfg.burn_in_blocks),
            collate_fn=self.collate_burn_in,
            batch_sampler=batches,
            seed=seed,
            num_shards=num_shards,
            shard_id=shard_id,
            num_workers=num_workers,
            epoch=epoch,
            buffer_size=data_buffer_size,
            skip_remainder_batch=skip_remainder_batch,
        )

    def collate_burn_in(self, items):
        """Shuffled blocks, right-padded, and ``burn_in``: for each of the N blocks before them, oldest
        first, their sources ``[rows, L]`` (pads where the text has not begun; a pad neither writes
        nor decays the state). Steps before the text for every row are left out."""
        if not items:
            return {}  # a rank's filler batch (fairseq makes it a dummy step)
        pad = self.dictionary.pad()
        ids, pairs, before = zip(*items)
        source = data_utils.collate_tokens([p[0] for p in pairs], pad)
        target = data_utils.collate_tokens([p[1] for p in pairs], pad)
        empty = source.new_empty(0)
        burn_in = [data_utils.collate_tokens([b[j] if b[j] is not None else empty for b in before], pad)
                   for j in range(self.cfg.burn_in_blocks) if any(b[j] is not None for b in before)]
        return {
            "id": torch.tensor(ids),
            "net_input": {"src_tokens": source, "src_lengths": source.ne(pad).sum(1)},
            "target": target,
            "nsentences": len(pairs),
            "ntokens": int(target.ne(pad).sum()),
            "burn_in": burn_in,
        }

    def burn_in(self, model, blocks: List[torch.Tensor]):
        """Fresh states for the batch's rows, advanced without gradient over the blocks before them
        (with this update's random draw, which the training block then reads them with)."""
        for m in causal_rfa_modules(model):
            m.carry = CarriedState()
        with torch.no_grad():
            for tokens in blocks:
                model(tokens, features_only=True)

    def collate(self, items, stream: str):
        """One batch: the rows' blocks right-padded to the longest (a row whose text has run out is
        one pad). ``stream``, ``group`` and ``block`` (the column) tell train_step/valid_step which
        carried states continue here."""
        (group, block, ids, pairs), = items
        pad = self.dictionary.pad()
        empty = torch.tensor([pad])
        source = data_utils.collate_tokens([p[0] if p else empty for p in pairs], pad)
        target = data_utils.collate_tokens([p[1] if p else empty for p in pairs], pad)
        return {
            "id": ids,  # block indices in the text (-1: padding)
            "net_input": {"src_tokens": source, "src_lengths": source.ne(pad).sum(1)},
            "target": target,
            "nsentences": len(pairs),
            "ntokens": int(target.ne(pad).sum()),
            "stream": stream,
            "group": group,
            "block": block,
        }

    def use_stream(self, model, sample):
        """Point the model's causal RFA modules at the carried states of the sample's group of
        streams; its first batch, or the first one seen (after a resume), starts from zero (every
        batch with ``--no-carry-state``)."""
        modules = causal_rfa_modules(model)
        stream = sample["stream"], sample["group"]
        if sample["block"] == 0 or stream not in self.carries or self.cfg.no_carry_state:
            self.carries[stream] = [CarriedState() for _ in modules]
        for module, carry in zip(modules, self.carries[stream]):
            module.carry = carry
        if isinstance(model.decoder.embed_positions, ContinuingPositions):
            model.decoder.embed_positions.offset = sample["block"] * self.cfg.tokens_per_sample

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs):
        if "burn_in" in sample:
            self.burn_in(model, sample["burn_in"])
        else:
            self.use_stream(model, sample)
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad, **kwargs)

    def valid_step(self, sample, model, criterion, **kwargs):
        self.use_stream(model, sample)
        return super().valid_step(sample, model, criterion, **kwargs)

    def eval_lm_dataloader(self, dataset, max_tokens=None, batch_size=None, max_positions=None, num_shards=1,
                           shard_id=0, num_workers=1, data_buffer_size=10, context_window=0):
        if context_window > 0:
            raise ValueError("--context-window does not apply to --task rfa_stateful_lm: the carried state holds "
                             "all the text before each block")
        # the model carries one set of states here (see build_model): one group of streams
        return self.get_batch_iterator(dataset, max_sentences=batch_size or 1, max_positions=max_positions,
                                       num_shards=num_shards, shard_id=shard_id, num_workers=num_workers,
                                       data_buffer_size=data_buffer_size, groups=1).next_epoch_itr(shuffle=False)
