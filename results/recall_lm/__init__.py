"""The recall study's fairseq plugin (``--user-dir results/recall_lm``, results/recall.py): rfa_fairseq's models and
criterion ``recall_answers``, the loss on the answers alone as Zoology trains MQAR. An answer is the token after a key
that occurred earlier in its block (a query); the criterion also logs ``recall``, the % of answers predicted best."""
import math

import torch.nn.functional as F
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.logging import metrics

import rfa_fairseq  # noqa: F401 (its models)


@register_criterion("recall_answers")
class RecallAnswers(FairseqCriterion):
    def __init__(self, task):
        super().__init__(task)
        self.key_symbols = [s.startswith("k") for s in task.source_dictionary.symbols]  # k0, k1, ...

    def forward(self, model, sample, reduce=True):
        tokens, target = sample["net_input"]["src_tokens"], sample["target"]
        is_key = tokens.new_tensor(self.key_symbols, dtype=bool)[tokens]
        seen = (tokens[:, :, None] == tokens[:, None, :]).tril(-1).any(-1)  # seen[b, i]: tokens[b, i] occurs before i
        answer = is_key & seen & target.ne(self.padding_idx)
        lprobs = model.get_normalized_probs(model(**sample["net_input"]), log_probs=True)[answer]
        loss = F.nll_loss(lprobs, target[answer], reduction="sum")
        answers = int(answer.sum())
        hits = (lprobs.argmax(-1) == target[answer]).sum()
        return loss, answers, {"loss": loss.data, "hits": hits.data, "sample_size": answers, "ntokens": sample["ntokens"],
                               "nsentences": tokens.size(0)}

    @staticmethod
    def reduce_metrics(logs) -> None:
        answers = max(sum(log.get("sample_size", 0) for log in logs), 1)
        metrics.log_scalar("loss", sum(log.get("loss", 0) for log in logs) / answers / math.log(2), answers, round=3)
        metrics.log_scalar("recall", 100.0 * sum(log.get("hits", 0) for log in logs) / answers, answers, round=2)
