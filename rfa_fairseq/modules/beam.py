"""The layout of fairseq's beam search, for the modules that keep decoding state.

fairseq's SequenceGenerator repeats each source ``beam`` times, sentence-major, tells the model the beam through
``set_beam_size`` (for beams above 1), and after every step reorders the state with ``new_order``: each row's index in
the previous step, always among its own sentence's rows; the batch shrinks when finished sentences leave. Modules rely
on that layout instead of checking it, which would read the order on the host every step."""
import torch
from torch import Tensor


class BeamLayout:
    """Mixin: ``beam_size`` as the generator sets it, and what it implies."""

    beam_size = 1

    def set_beam_size(self, beam_size: int):
        self.beam_size = beam_size

    def rows_per_source(self, batch: int) -> int:
        """How many consecutive rows of a decoding batch share one source: the beam."""
        if batch % self.beam_size != 0:
            raise ValueError(f"beam search with beam {self.beam_size} needs a batch of whole sentences (a multiple of "
                             f"{self.beam_size} rows, each sentence's beams side by side), got {batch} rows")
        return self.beam_size

    def source_order(self, new_order: Tensor) -> Tensor:
        """The sentences that ``new_order``'s rows continue, one index per sentence."""
        return new_order.reshape(-1, self.beam_size)[:, 0] // self.beam_size


def reorder_rows_(buffer: dict, names, new_order: Tensor):
    """Beam search's reorder of each ``buffer[name]`` to the rows ``new_order`` picks; without autograd into a spare
    beside it, ``spare_<name>`` (the two then swap roles; into its front when finished sentences shrink the batch): a
    step allocates no state-sized memory (zeroed page by page); the state alternates in two places (step_graphs)."""
    rows = new_order.numel()
    for name in names:
        state, spare = buffer[name], buffer.pop("spare_" + name, None)
        if torch.is_grad_enabled() or state.requires_grad:
            buffer[name] = state.index_select(0, new_order)
            continue
        if spare is None or spare.size(0) < rows or spare.shape[1:] != state.shape[1:]:
            spare = state.new_empty((rows,) + state.shape[1:])
        torch.index_select(state, 0, new_order, out=spare[:rows])
        buffer[name], buffer["spare_" + name] = spare[:rows], state
    return buffer
