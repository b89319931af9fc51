"""Task ``rfa_stateful_lm``: RFA language models that carry their recurrent state across blocks.

Training: shuffled blocks of ``--tokens-per-sample`` tokens, each starting from the state every causal RFA layer
builds (without gradient) over the ``--burn-in-blocks`` blocks before it. Validation and ``fairseq-eval-lm`` carry
the state through the split along contiguous streams of blocks (:func:`stream_layout`). Positions restart at every
block: older text reaches the model only through the state, ``model(src_tokens, stream_state=STATE)``."""
import logging
import os
from collections import UserDict
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq import utils
from fairseq.data import Dictionary, TokenBlockDataset, data_utils, iterators
from fairseq.data.indexed_dataset import get_available_dataset_impl
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.tasks import FairseqTask, register_task
from omegaconf import II

from ..modules import CausalRFAttention
from ..validation import positive_int

logger = logging.getLogger(__name__)


@dataclass
class StatefulLMConfig(FairseqDataclass):
    data: Optional[str] = field(default=None, metadata={
        "help": "data directory (fairseq-preprocess --only-source output: dict.txt, train.*, ...)"})
    tokens_per_sample: int = field(default=512, metadata={
        "help": "block length: tokens per row of a batch (backpropagation reaches this far back; the carried state "
                "reaches further)"})
    max_target_positions: Optional[int] = field(
        default=None, metadata={"help": "positions the model is built for (default: --tokens-per-sample)"})
    burn_in_blocks: int = field(default=2, metadata={
        "help": "each shuffled training block starts from the state built, without gradient, over the N >= 1 "
                "blocks before it (validation and fairseq-eval-lm carry it through the whole split)"})
    # Read by fairseq's language model config; blocks continue the text, so there is no BOS to add.
    add_bos_token: bool = field(default=False, metadata={"help": "not supported by rfa_stateful_lm"})
    dataset_impl: Optional[ChoiceEnum(get_available_dataset_impl())] = II("dataset.dataset_impl")
    train_subset: str = II("dataset.train_subset")
    seed: int = II("common.seed")


def stream_layout(num_blocks: int, rows: int, num_shards: int = 1, shard_id: int = 0) -> torch.Tensor:
    """Block indices ``[rows, L]`` of one process's rows of ``R = rows * num_shards`` contiguous streams: row ``r``
    holds blocks ``r L .. r L + L - 1`` (-1 past the text), ``L = ceil(num_blocks / R)``; batch ``i``: column ``i``."""
    positive_int("--batch-size", rows)
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"shard {shard_id} out of {num_shards}")
    total_rows = rows * num_shards
    blocks = torch.arange(total_rows * -(-num_blocks // total_rows)).view(total_rows, -1)  # [R, L]
    blocks[blocks >= num_blocks] = -1
    return blocks[shard_id * rows:(shard_id + 1) * rows]


class Rows(torch.utils.data.Dataset):
    """Item ``i``: ``(i, rows)``, a batch's rows ``(block index, (source, target), the sources of the
    n blocks before it)`` (None for a block before the text or past its end, index -1): block ``i``
    alone, or with a ``layout`` (:func:`stream_layout`) its column ``i``."""

    def __init__(self, blocks: TokenBlockDataset, n: int = 0, layout: Optional[torch.Tensor] = None):
        self.blocks, self.n, self.layout = blocks, n, layout

    def __getitem__(self, i):
        get = self.blocks.__getitem__
        return i, [(b, get(b)[:2] if b >= 0 else None, [get(j)[0] if j >= 0 else None for j in range(b - self.n, b)])
                   for b in ([i] if self.layout is None else self.layout[:, i].tolist())]

    def __len__(self):
        return len(self.blocks) if self.layout is None else self.layout.size(1)


@register_task("rfa_stateful_lm", dataclass=StatefulLMConfig)
class StatefulLanguageModelingTask(FairseqTask):
    """Language modelling with the RFA state carried from block to block (module docstring)."""

    def __init__(self, cfg: StatefulLMConfig, dictionary: Dictionary):
        super().__init__(cfg)
        if cfg.add_bos_token:
            raise ValueError("--add-bos-token is not supported by --task rfa_stateful_lm: blocks continue the text")
        positive_int("--burn-in-blocks", cfg.burn_in_blocks)
        self.dictionary, self.valid_state = dictionary, {}

    @classmethod
    def setup_task(cls, cfg: StatefulLMConfig, **kwargs):
        if not cfg.data:
            raise ValueError("--task rfa_stateful_lm needs the data directory")
        dictionary = Dictionary.load(os.path.join(utils.split_paths(cfg.data)[0], "dict.txt"))
        logger.info(f"dictionary: {len(dictionary)} types")
        return cls(cfg, dictionary)

    source_dictionary = target_dictionary = property(lambda self: self.dictionary)

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        if not any(isinstance(m, CausalRFAttention) for m in model.modules()):
            arch = getattr(cfg, "arch", None) or getattr(cfg, "_name", None) or type(model).__name__
            raise ValueError(f"--task rfa_stateful_lm carries the recurrent state of RFA attention, and this model "
                             f"({arch}) has no RFA attention: use an rfa_transformer_lm architecture, train a softmax "
                             "model with --task language_modeling, or convert a softmax checkpoint with "
                             "scripts/convert_from_softmax.py")
        return model

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        paths = utils.split_paths(self.cfg.data)
        split_path = os.path.join(paths[(epoch - 1) % len(paths)], split)
        tokens = data_utils.load_indexed_dataset(split_path, self.dictionary, self.cfg.dataset_impl, combine=combine)
        if tokens is None:
            raise FileNotFoundError(f"Dataset not found: {split} ({split_path})")
        self.datasets[split] = TokenBlockDataset(tokens, tokens.sizes, self.cfg.tokens_per_sample, break_mode="none",
                                                 pad=self.dictionary.pad(), eos=self.dictionary.eos(),
                                                 include_targets=True)

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, max_positions=None, seed=1,
                           num_shards=1, shard_id=0, num_workers=0, epoch=1, data_buffer_size=0,
                           skip_remainder_batch=False, streams=None, **kwargs):
        """Shuffled blocks with their burn-in for the train split, streams in order for the others (or
        as ``streams`` says). ``max_sentences`` (``--batch-size``): rows per batch; ``max_tokens``: unused."""
        if max_sentences is None:
            raise ValueError("--task rfa_stateful_lm needs --batch-size: the number of blocks (of text streams in "
                             "validation and evaluation) per batch and process")
        if isinstance(max_positions, int) and self.cfg.tokens_per_sample > max_positions:
            raise ValueError(f"--tokens-per-sample {self.cfg.tokens_per_sample} exceeds the model's {max_positions} "
                             "positions; with the carried state a shorter block loses no context")
        if streams if streams is not None else dataset is not self.datasets.get(self.cfg.train_subset):
            layout = stream_layout(len(dataset), max_sentences, num_shards, shard_id)
            return iterators.EpochBatchIterator(
                dataset=Rows(dataset, layout=layout), collate_fn=self.collate, epoch=epoch, num_workers=num_workers,
                batch_sampler=[[c] for c in range(layout.size(1))], buffer_size=data_buffer_size,
                disable_shuffling=True)

        def batches(_, epoch):  # every block once per epoch, shuffled anew each epoch
            order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            return [order[i:i + max_sentences] for i in range(0, len(order), max_sentences)]

        return iterators.EpochBatchIterator(
            dataset=Rows(dataset, self.cfg.burn_in_blocks), collate_fn=self.collate, batch_sampler=batches, seed=seed,
            num_shards=num_shards, shard_id=shard_id, num_workers=num_workers, epoch=epoch,
            buffer_size=data_buffer_size, skip_remainder_batch=skip_remainder_batch)

    def collate(self, items):
        """The rows right-padded (a row past the end of the text: one pad). Shuffled blocks get ``burn_in``,
        the sources of the N blocks before them, oldest first (pads before the text; steps before the
        text for every row left out); streams get ``block``, the column."""
        if not items:
            return {}  # a rank's filler batch (fairseq makes it a dummy step)
        ids, pairs, before = zip(*[row for _, rows in items for row in rows])
        pad, empty = self.dictionary.pad(), torch.zeros(0, dtype=torch.long)
        source, target = (data_utils.collate_tokens([p[k] if p else torch.tensor([pad]) for p in pairs], pad)
                          for k in (0, 1))
        burn_in = [data_utils.collate_tokens([b[j] if b[j] is not None else empty for b in before], pad)
                   for j in range(len(before[0])) if any(b[j] is not None for b in before)]
        return {"id": torch.tensor(ids), "net_input": {"src_tokens": source, "src_lengths": source.ne(pad).sum(1)},
                "target": target, "nsentences": len(pairs), "ntokens": int(target.ne(pad).sum()),
                **({"burn_in": burn_in} if before[0] else {"block": items[0][0]})}

    def stream_state(self, model, sample) -> dict:
        """Shuffled blocks: a fresh state advanced without gradient over their burn-in (with this update's
        random draw, as the blocks then read it). Streams: the split's state, afresh at its first batch."""
        if "burn_in" not in sample:
            self.valid_state = {} if sample["block"] == 0 else self.valid_state
            return self.valid_state
        state = {}
        with torch.no_grad():
            for tokens in sample["burn_in"]:
                model(tokens, features_only=True, stream_state=state)
        return state

    def with_state(self, model, sample, state=None):
        """A copy of ``sample`` whose net_input passes ``state`` (by default :meth:`stream_state`'s)."""
        state = self.stream_state(model, sample) if state is None else state
        return {**sample, "net_input": {**sample["net_input"], "stream_state": state}}

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs):
        return super().train_step(self.with_state(model, sample), model, criterion, optimizer, update_num, ignore_grad,
                                  **kwargs)

    def valid_step(self, sample, model, criterion, **kwargs):
        return super().valid_step(self.with_state(model, sample), model, criterion, **kwargs)

    def eval_lm_dataloader(self, dataset, max_tokens=None, batch_size=None, max_positions=None, num_shards=1,
                           shard_id=0, num_workers=1, data_buffer_size=10, context_window=0):
        """Streams in order (one unless ``--batch-size`` says more) and one state for the whole pass, added
        here (fairseq-eval-lm calls the model without the task), not as a dict: ``move_to_cuda`` would copy it."""
        if context_window > 0:
            raise ValueError("--context-window does not apply to --task rfa_stateful_lm: the carried state holds "
                             "all the text before each block")
        itr = self.get_batch_iterator(dataset, max_sentences=batch_size or 1, max_positions=max_positions,
                                      num_shards=num_shards, shard_id=shard_id, num_workers=num_workers,
                                      data_buffer_size=data_buffer_size, streams=True).next_epoch_itr(shuffle=False)
        state = UserDict()
        return iterators.CountingIterator((self.with_state(None, s, state) for s in itr), start=itr.n, total=len(itr))
