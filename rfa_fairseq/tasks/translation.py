"""``--task rfa_translation``: fairseq's translation task whose beam search runs in the compiled step's C++
(:class:`CompiledSearch`) where the model's step engine has one (``--compiled-step``, ``--int8-inference``)."""
from fairseq import search
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask


class CompiledSearch(SequenceGenerator):
    """fairseq's SequenceGenerator whose beam search, for one model whose step engine searches
    (:meth:`engines.compiled.CompiledStep.generate`), is that engine's: fairseq's hypotheses (tested against fairseq's
    search over the same steps), their attention empty (fairseq's command lines read it only for
    ``--print-alignment``). Anything else (sampling, other searches, prefixes, constraints, ``--match-source-len``,
    ``--no-repeat-ngram-size``, ensembles, eager steps): fairseq's search."""

    def _generate(self, sample, prefix_tokens=None, constraints=None, bos_token=None):
        model, net_input = self.model, sample["net_input"]
        engine = getattr(model.single_model.decoder, "step_engine", None) if model.models_size == 1 else None
        if (not hasattr(engine, "generate") or type(self.search) is not search.BeamSearch or self.match_source_len
                or self.repeat_ngram_blocker is not None or self.lm_model is not None or prefix_tokens is not None
                or constraints is not None or bos_token is not None or "src_tokens" not in net_input):
            return super()._generate(sample, prefix_tokens, constraints, bos_token)
        src = net_input["src_tokens"]
        max_len = min(int(self.max_len_a * src.size(1) + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"
        found = engine.generate(self, net_input, max_len)
        return super()._generate(sample) if found is None else found  # None: the engine does not run here


@register_task("rfa_translation", dataclass=TranslationConfig)
class RFATranslationTask(TranslationTask):
    """fairseq's ``translation`` task whose beam search is :class:`CompiledSearch`; fairseq's where the hypotheses'
    attention is asked for (``--print-alignment``, a decoder's ``--decoding-attention``)."""

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None):
        if seq_gen_cls is None and not getattr(args, "print_alignment", False) and not any(
                getattr(getattr(m, "decoder", None), "decoding_attention", False) for m in models):
            seq_gen_cls = CompiledSearch
        return super().build_generator(models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
