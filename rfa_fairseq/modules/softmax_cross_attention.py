"""SoftmaxCrossAttention: fairseq's encoder-decoder attention, with one copy of the source's keys
and values per sentence in beam search.

fairseq's SequenceGenerator repeats each source ``beam`` times, and fairseq's transformer projects
and caches keys and values for every copy: ``beam`` times the memory and the projections that one
copy needs, which at long sources is the largest part of the decoding state. fairseq's
MultiheadAttention has a path that keeps one copy per sentence (``set_beam_size``), but once set it
applies to every call, so a model that trains or scores after a beam search (validation BLEU
during training) would attend from each sentence to another sentence's source. Here it applies
only while decoding (with an incremental state), where the generator's sentence-major layout
holds; the numbers are fairseq's either way, and so are the weights and their names.
"""
from fairseq.modules import MultiheadAttention


class SoftmaxCrossAttention(MultiheadAttention):
    """fairseq's ``MultiheadAttention(encoder_decoder_attention=True)``; ``set_beam_size`` takes
    effect in incremental decoding only."""

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, *args, **kwargs):
        if incremental_state is not None or self.beam_size == 1:
            return super().forward(query, key, value, key_padding_mask, incremental_state, *args, **kwargs)
        # A whole target (training, scoring) has one row per sentence, not the generator's beams.
        beam, self.beam_size = self.beam_size, 1
        try:
            return super().forward(query, key, value, key_padding_mask, incremental_state, *args, **kwargs)
        finally:
            self.beam_size = beam
