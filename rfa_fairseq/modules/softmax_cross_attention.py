"""SoftmaxCrossAttention: fairseq's encoder-decoder attention, with one copy of the source's keys
and values per sentence in beam search.

fairseq's transformer projects and caches keys and values for each of a source's ``beam`` copies:
at long sources the largest part of the decoding state. fairseq's MultiheadAttention can keep one
copy per sentence (``set_beam_size``), but then in every call, so a model that trains or scores
after a beam search (validation BLEU) would attend to another sentence's source. Here it applies only
while decoding, where the generator's sentence-major layout holds; numbers and weights are fairseq's.
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
