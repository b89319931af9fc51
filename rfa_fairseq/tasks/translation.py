"""``--task rfa_translation``: fairseq's translation task whose beam search (:class:`LeanBeamSearch`) gives fairseq's
hypotheses in fewer operators a step (docs/benchmarks.md#the-beam-search)."""
import math

import torch
from fairseq import search
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask


class LeanBeamSearch(SequenceGenerator):
    """fairseq's SequenceGenerator, whose beam search it runs with these differences, none in the hypotheses: a step
    where no candidate ends (most steps) skips the bookkeeping of ending ones (fairseq's own code otherwise); ``NaN``,
    pad and ``--unkpen`` are one addition; the encoder's output is reordered only when sentences leave the batch (a
    sentence's beams share it). Anything else (sampling, other searches, prefixes,
    constraints, ``--match-source-len``, ``--no-repeat-ngram-size``): fairseq's generator. The hypotheses' attention is
    empty (fairseq's command lines read it only for ``--print-alignment``)."""

    def _generate(self, sample, prefix_tokens=None, constraints=None, bos_token=None):
        if (type(self.search) is not search.BeamSearch or self.match_source_len or self.repeat_ngram_blocker is not None
                or self.lm_model is not None or prefix_tokens is not None or constraints is not None
                or bos_token is not None or "src_tokens" not in sample["net_input"]):
            return super()._generate(sample, prefix_tokens, constraints, bos_token)
        model, beam, eos, src = self.model, self.beam_size, self.eos, sample["net_input"]["src_tokens"]
        bsz, vocab = src.size(0), self.vocab_size
        max_len = min(int(self.max_len_a * src.size(1) + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"
        encoder_outs = model.reorder_encoder_out(model.forward_encoder(sample["net_input"]),
                                                 torch.arange(bsz, device=src.device).repeat_interleave(beam))
        engine = getattr(model.single_model.decoder, "step_engine", None) if model.models_size == 1 else None
        if hasattr(engine, "generate"):  # the whole search in the engine, where it runs it
            found = engine.generate(self, encoder_outs[0], bsz, max_len)
            if found is not None:
                return found
        states = [{} for _ in range(model.models_size)]
        scores = torch.zeros(bsz * beam, max_len + 1, device=src.device)
        tokens = torch.full((bsz * beam, max_len + 2), self.pad, dtype=torch.long, device=src.device)
        tokens[:, 0] = eos
        finalized, finished, remaining = [[] for _ in range(bsz)], [False] * bsz, bsz
        offsets = torch.arange(bsz, device=src.device)[:, None] * beam
        ignore, ignoring, reorder, kept = torch.zeros(bsz, beam, dtype=torch.bool, device=src.device), False, None, None
        bias = self.bias(vocab, src.device)
        for step in range(max_len + 1):
            if reorder is not None:
                if kept is not None:  # sentences left: the order was within the kept ones
                    reorder.view(-1, beam).add_((kept - torch.arange(kept.numel(), device=src.device))[:, None] * beam)
                    encoder_outs = model.reorder_encoder_out(encoder_outs, reorder)
                model.reorder_incremental_state(states, reorder)
            lprobs = model.forward_decoder(tokens[:, :step + 1], encoder_outs, states, self.temperature)[0]
            lprobs = torch.nan_to_num_(lprobs, nan=-math.inf, posinf=math.inf, neginf=-math.inf).add_(bias)
            if step >= max_len:
                lprobs[:, :eos], lprobs[:, eos + 1:] = -math.inf, -math.inf
            elif step < self.min_len:
                lprobs[:, eos] = -math.inf
            lprobs = lprobs.view(bsz, beam, vocab)  # fairseq's BeamSearch.step
            if step == 0:
                lprobs = lprobs[:, :1].contiguous()
            else:
                lprobs = lprobs + scores.view(bsz, beam, -1)[:, :, step - 1, None]
            cand_scores, cand = torch.topk(lprobs.view(bsz, -1), k=min(2 * beam, lprobs[0].numel() - 1))
            cand_beams, cand_tokens = torch.div(cand, vocab, rounding_mode="trunc"), cand.fmod(vocab)
            ends, kept = cand_tokens.eq(eos), None
            if not ignoring and not ends.any():  # no candidate ends: the first `beam` go on
                rows, new_tokens, new_scores = (t[:, :beam] for t in (cand_beams + offsets, cand_tokens, cand_scores))
            else:  # fairseq's step: ending candidates among the first beam finish, the first beam others go on
                ends &= cand_scores.ne(-math.inf)
                ends[:, :beam][ignore] = False
                if ends[:, :beam].any():
                    rows, first = (cand_beams + offsets)[:, :beam], ends[:, :beam]
                    done = self.finalize_hypos(step, rows[first], cand_scores[:, :beam][first], tokens, scores,
                                               finalized, finished, beam, None, None, max_len)
                    remaining -= len(done)
                    if remaining == 0:
                        break
                    if done:
                        keep = torch.ones(bsz, dtype=torch.bool, device=src.device)
                        keep[done] = False
                        kept = torch.arange(bsz, device=src.device).masked_select(keep)
                        ends, cand_beams, cand_scores, cand_tokens, ignore = (
                            t[kept] for t in (ends, cand_beams, cand_scores, cand_tokens, ignore))
                        scores, tokens = (t.view(bsz, -1)[kept].view(kept.numel() * beam, -1) for t in (scores, tokens))
                        bsz, offsets = kept.numel(), offsets[:kept.numel()]
                assert step < max_len, f"{step} < {max_len}"
                ends[:, :beam] |= ignore
                order = ends.long() * (2 * beam) + torch.arange(ends.size(1), device=src.device)
                ignored, chosen = torch.topk(order, k=beam, dim=1, largest=False)
                ignore = ignored.ge(2 * beam)[:, :beam]
                ignoring = bool(ignore.any())
                rows, new_tokens, new_scores = (t.gather(1, chosen)
                                                for t in (cand_beams + offsets, cand_tokens, cand_scores))
            reorder = rows.reshape(-1)
            tokens[:, :step + 1] = tokens[:, :step + 1].index_select(0, reorder)
            tokens.view(bsz, beam, -1)[:, :, step + 1] = new_tokens
            if step > 0:
                scores[:, :step] = scores[:, :step].index_select(0, reorder)
            scores.view(bsz, beam, -1)[:, :, step] = new_scores
        return self.best_first(finalized)

    def bias(self, vocab: int, device) -> torch.Tensor:
        """What fairseq writes into every step's log-probabilities: -inf at pad (and tokens suppressed), --unkpen."""
        bias = torch.zeros(vocab, device=device)
        bias[self.unk] = -self.unk_penalty
        bias[self.pad] = -math.inf
        if getattr(self, "token_indices_to_suppress", None) is not None:
            bias[self.token_indices_to_suppress] = -math.inf
        return bias

    @staticmethod
    def best_first(finalized: list) -> list:
        """Each sentence's hypotheses best first, as fairseq sorts them."""
        for i, hypos in enumerate(finalized):
            order = torch.sort(torch.tensor([float(h["score"].item()) for h in hypos]), descending=True)[1]
            finalized[i] = [hypos[j] for j in order]
        return finalized


@register_task("rfa_translation", dataclass=TranslationConfig)
class RFATranslationTask(TranslationTask):
    """fairseq's ``translation`` task whose beam search is :class:`LeanBeamSearch`; fairseq's where the hypotheses'
    attention is asked for (``--print-alignment``, a decoder's ``--decoding-attention``)."""

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None):
        if seq_gen_cls is None and not getattr(args, "print_alignment", False) and not any(
                getattr(getattr(m, "decoder", None), "decoding_attention", False) for m in models):
            seq_gen_cls = LeanBeamSearch
        return super().build_generator(models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
