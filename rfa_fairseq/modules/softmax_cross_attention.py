"""SoftmaxCrossAttention: fairseq's encoder-decoder attention, one copy of the source per sentence in beam search."""
from fairseq.modules import MultiheadAttention


class SoftmaxCrossAttention(MultiheadAttention):
    """fairseq's ``MultiheadAttention(encoder_decoder_attention=True)``, whose ``set_beam_size`` takes effect in
    incremental decoding only. fairseq's transformer projects and caches keys and values for each of a source's
    ``beam`` copies: at long sources the largest part of the decoding state. fairseq's MultiheadAttention can keep
    one copy per sentence (``set_beam_size``), but then in every call, so a model that trains or scores after a beam
    search (validation BLEU) would attend to another sentence's source. Numbers and weights are fairseq's.
    """

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, *args, **kwargs):
        beam = self.beam_size
        if incremental_state is None:
            self.beam_size = 1  # a whole target (training, scoring) has one row per sentence, not beams
        try:
            return super().forward(query, key, value, key_padding_mask, incremental_state, *args, **kwargs)
        finally:
            self.beam_size = beam
