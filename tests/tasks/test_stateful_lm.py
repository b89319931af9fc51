"""Task rfa_stateful_lm: contiguous streams per batch row (and per rank) for validation and
evaluation, the burn-in of shuffled training blocks, the state carried over blocks equal to one pass
over their concatenation (valid steps, eval-lm's loop, the burn-in), the refusals (softmax models,
removed settings in a command line, a config or a checkpoint), and the command lines."""
import re

import pytest
import torch
from fairseq import checkpoint_utils, options, tasks, utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.sequence_scorer import SequenceScorer
from omegaconf import OmegaConf

from rfa_fairseq.tasks.stateful_lm import stream_layout
from rfa_test_utils import TINY_DECODER, USER_DIR, build_from_cli, multi30k_lm_bin, run_cli

BLOCK = 16
TRAIN = ["--optimizer", "adam", "--lr", "1e-3", "--no-progress-bar", "--log-interval", "1", "--cpu",
         "--num-workers", "0", "--seed", "3"]
SMALL = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
         "--decoder-attention-heads", "4", "--rfa-chunk-size", "8", "--rfa-causal-feature-dim", "16"]
# a gate that starts near 0.95 remembers across blocks, so carried state and none differ
MEMORY = ["--no-token-positional-embeddings", "--rfa-gate", "--rfa-gate-bias", "3"]


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return multi30k_lm_bin(tmp_path_factory.mktemp("lm"), (("train", 200), ("valid", 30), ("test", 30)))


def cli(data, *extra, arch="rfa_transformer_lm"):
    return [str(data), "--user-dir", USER_DIR, "--task", "rfa_stateful_lm", "--tokens-per-sample", str(BLOCK),
            "--arch", arch, *TINY_DECODER, *extra]


def stateful(data, *extra, arch="rfa_transformer_lm", splits=("train", "valid")):
    """The task (with ``splits`` loaded) and a tiny model."""
    torch.manual_seed(0)
    task, model, _ = build_from_cli(data, cli(data, *extra, arch=arch)[3:])
    for split in splits:
        task.load_dataset(split)
    return task, model


def criterion(task, data):
    return task.build_criterion(build_from_cli(data, cli(data)[3:])[2])


def text_tokens(task, split):
    """The whole split as fairseq's indexed dataset holds it: one token stream."""
    blocks = task.dataset(split)
    return torch.cat([blocks.dataset[i] for i in range(len(blocks.dataset))])


def batches(task, split, rows, num_shards=1, shard_id=0, epoch=1):
    itr = task.get_batch_iterator(task.dataset(split), max_sentences=rows, num_shards=num_shards, shard_id=shard_id,
                                  seed=3, epoch=epoch)
    return list(itr.next_epoch_itr(shuffle=True))


def row_streams(task, samples):
    """Per row: (sources, targets) concatenated over the batches, pads dropped."""
    pad = task.dictionary.pad()
    out = []
    for r in range(samples[0]["target"].size(0)):
        src = torch.cat([s["net_input"]["src_tokens"][r] for s in samples])
        tgt = torch.cat([s["target"][r] for s in samples])
        out.append((src[src.ne(pad)], tgt[tgt.ne(pad)]))
    return out


def test_stream_layout():
    lay = stream_layout(10, 2, num_shards=2, shard_id=1)
    assert lay.tolist() == [[6, 7, 8], [9, -1, -1]]
    whole = torch.cat([stream_layout(10, 2, 2, s) for s in (0, 1)])
    assert whole.flatten()[whole.flatten() >= 0].tolist() == list(range(10)), "every block once, in row order"
    with pytest.raises(ValueError, match="--batch-size"):
        stream_layout(10, 0)


@pytest.mark.parametrize("shards", [1, 2], ids=["1-rank", "2-ranks"])
def test_every_row_continues_its_text(lm_data, shards):
    """Read row by row, the valid batches of every rank give back the text in order: each row's
    targets are a contiguous piece of the text, rows follow each other (rank 0's, then rank 1's),
    every token is a target exactly once, each block's first input is the previous block's last
    target, and every rank has the same number of batches, columns 0, 1, ... in order."""
    task, _ = stateful(lm_data, splits=("valid",))
    text, rows, targets, counts = text_tokens(task, "valid"), 3, [], set()
    for shard in range(shards):
        samples = batches(task, "valid", rows, shards, shard)
        assert [s["block"] for s in samples] == list(range(len(samples)))
        assert all(s["target"].size(0) == rows and "burn_in" not in s for s in samples)
        counts.add(len(samples))
        for r, (src, tgt) in enumerate(row_streams(task, samples)):
            targets.append(tgt)
            if len(tgt):
                assert torch.equal(src[1:], tgt[:-1]), f"rank {shard} row {r}: inputs are not the targets shifted"
    assert torch.equal(torch.cat(targets), text)
    assert len(counts) == 1


def test_batches_have_whole_blocks_and_count_real_tokens(lm_data):
    task, _ = stateful(lm_data, splits=("valid",))
    samples = batches(task, "valid", 4)
    pad = task.dictionary.pad()
    for s in samples:
        assert s["target"].size(1) == BLOCK or s is samples[-1]
        assert s["ntokens"] == int(s["target"].ne(pad).sum())
        assert torch.equal(s["net_input"]["src_tokens"].eq(pad), s["target"].eq(pad))
    assert sum(s["ntokens"] for s in samples) == len(text_tokens(task, "valid"))


@pytest.mark.parametrize("gate", [[], ["--rfa-gate"], ["--rfa-gate", "--rfa-gate-form", "decay"]],
                         ids=["rfa", "gate", "gate-decay"])
def test_stream_state_over_blocks_equals_one_pass(lm_data, gate):
    """The whole decoder (no positional embeddings: they restart at every block by design) over
    blocks with one stream state equals one pass over the concatenation, fp32, <= 1e-5."""
    _, model = stateful(lm_data, "--no-token-positional-embeddings", *gate, splits=())
    model.eval()
    tokens = torch.randint(4, 50, (3, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, _ = model(tokens)
        state = {}
        blocks = torch.cat([model(tokens[:, a:a + BLOCK], stream_state=state)[0] for a in range(0, 70, BLOCK)], dim=1)
    assert (blocks - whole).abs().max().item() <= 1e-5


def test_valid_steps_carry_the_stream(lm_data):
    """Through the task: the valid loss of a split, batch after batch, equals the loss of one pass
    over each row's whole text (no positional embeddings) and differs from blocks without state; a
    second validation starts the state afresh at the split's first batch and gives the same loss."""
    task, model = stateful(lm_data, *MEMORY, splits=("valid",))
    crit = criterion(task, lm_data)
    samples = batches(task, "valid", 2)
    carried = [sum(task.valid_step(s, model, crit)[0].item() for s in samples) for _ in range(2)]
    pad = task.dictionary.pad()
    whole = 0.0
    with torch.no_grad():
        for src, tgt in row_streams(task, samples):
            logits, _ = model(src[None])
            whole += torch.nn.functional.cross_entropy(logits[0], tgt, reduction="sum", ignore_index=pad).item()
        blocks = sum(crit(model, s)[0].item() for s in samples)
    assert carried[0] == pytest.approx(whole, rel=1e-5) and carried[1] == pytest.approx(carried[0], rel=1e-6)
    assert abs(blocks - whole) > 1e-3 * whole, "the test cannot tell carried state from none"
    assert all("stream_state" not in s["net_input"] for s in samples), "the task leaves fairseq's sample as it was"


def test_eval_lm_carries_one_state_through_the_pass(lm_data):
    """fairseq-eval-lm's loop, in process: the task's dataloader, fairseq's move_to_cuda (which
    rebuilds dicts) and SequenceScorer calling the model directly. The scores of every test token
    equal one pass over the whole text (fp32, <= 1e-4 in log-probability) and differ from blocks
    alone; the iterator has the length and count fairseq's progress bar reads."""
    task, model = stateful(lm_data, *MEMORY, splits=("test",))
    model.eval()
    itr = task.eval_lm_dataloader(task.dataset("test"), batch_size=1, max_positions=model.max_positions())
    assert itr.n == 0 and len(itr) == len(task.dataset("test"))
    scorer = SequenceScorer(task.target_dictionary)
    carried, alone, states = [], [], set()
    for sample in itr:
        sample = utils.move_to_cuda(sample, device=torch.device("cpu"))
        states.add(id(sample["net_input"]["stream_state"]))
        carried.append(scorer.generate([model], sample)[0][0]["positional_scores"])
        del sample["net_input"]["stream_state"]
        alone.append(scorer.generate([model], sample)[0][0]["positional_scores"])
    assert itr.n == len(itr) and len(states) == 1
    text = text_tokens(task, "test")
    with torch.no_grad():
        source = torch.cat([torch.tensor([task.dictionary.eos()]), text[:-1]])  # as the first block's
        logp = model.get_normalized_probs(model(source[None]), log_probs=True)[0]
    whole = logp.gather(1, text[:, None])[:, 0]
    carried, alone = torch.cat(carried), torch.cat(alone)
    assert len(carried) == len(text) and (carried - whole).abs().max().item() <= 1e-4
    assert (alone - whole).abs().max().item() > 1e-2


@pytest.mark.parametrize("n", [1, 2])
def test_burn_in_batches_shuffle_every_block_with_the_blocks_before_it(lm_data, n):
    """--burn-in-blocks N: each epoch every train block is a row once, in an order that changes from
    epoch to epoch; before each row come the N blocks that precede it in the text, oldest first
    (pads before the text starts), so the burn-in and the row together are a contiguous piece of
    the text; two ranks share the blocks."""
    task, _ = stateful(lm_data, "--burn-in-blocks", str(n), splits=("train",))
    pad, blocks = task.dictionary.pad(), task.dataset("train")
    orders = []
    for epoch in (1, 2):
        samples = batches(task, "train", 3, epoch=epoch)
        ids = torch.cat([s["id"] for s in samples]).tolist()
        assert sorted(ids) == list(range(len(blocks)))
        orders.append(ids)
        for s in samples:
            for r, i in enumerate(s["id"].tolist()):
                assert torch.equal(s["target"][r][s["target"][r].ne(pad)], blocks[i][1])
                before = [b[r][b[r].ne(pad)] for b in s["burn_in"]]
                want = [blocks[j][0] for j in range(max(i - n, 0), i)]
                assert torch.equal(torch.cat(before), torch.cat(want) if want else torch.zeros(0, dtype=torch.long))
    assert orders[0] != orders[1] and orders[0] != sorted(orders[0])
    sharded = [s["id"].tolist() for k in (0, 1) for s in batches(task, "train", 3, 2, k) if s]
    assert sorted(sum(sharded, [])) == list(range(len(blocks)))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_burn_in_gives_each_row_the_state_of_the_text_before_it(lm_data, mode):
    """After the task's burn-in, the whole decoder over a training batch (no positional
    embeddings) equals one pass over each row's two preceding blocks and the row together, fp32,
    <= 1e-5; the row that starts the text equals a pass over it alone. In training mode (dropout 0)
    too: the burn-in reads the text with the update's random draw, as the training block does."""
    task, model = stateful(lm_data, "--no-token-positional-embeddings", "--rfa-gate", splits=("train",))
    model.train(mode == "train")
    model.set_num_updates(7)
    blocks = task.dataset("train")
    sample = next(s for s in batches(task, "train", 4) if 0 in s["id"].tolist() or 1 in s["id"].tolist())
    with torch.no_grad():
        state = task.stream_state(model, sample)
        out, _ = model(**sample["net_input"], stream_state=state)
        for r, i in enumerate(sample["id"].tolist()):
            whole, _ = model(torch.cat([blocks[j][0] for j in range(max(i - 2, 0), i + 1)])[None])
            length = len(blocks[i][0])
            assert (out[r, :length] - whole[0, -length:]).abs().max().item() <= 1e-5


def test_train_step_trains_the_block_from_its_burn_in(lm_data):
    """The task's train step: the loss and gradients are those of the block read from its burn-in
    state (taken as a constant), not of the block alone; fairseq's sample is left as it was (the
    trainer keeps its first sample as the dummy batch)."""
    task, model = stateful(lm_data, *MEMORY, splits=("train",))
    crit = criterion(task, lm_data)
    sample = next(s for s in batches(task, "train", 4) if min(s["id"].tolist()) >= 2)
    class Optimizer:  # fairseq's optimizer, as far as train_step uses it
        backward = staticmethod(torch.Tensor.backward)

    model.zero_grad()
    loss, _, _ = task.train_step(sample, model, crit, Optimizer(), 0)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert "stream_state" not in sample["net_input"]
    model.zero_grad()
    state = task.stream_state(model, sample)
    want, _, _ = crit(model, {**sample, "net_input": {**sample["net_input"], "stream_state": state}})
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert all(torch.allclose(a, p.grad, atol=1e-7) for a, p in zip(grads, [p for p in model.parameters()
                                                                           if p.grad is not None]))
    assert abs(crit(model, sample)[0].item() - loss.item()) > 1e-3 * loss.item()


def test_softmax_model_is_refused(lm_data):
    with pytest.raises(ValueError, match=r"rfa_stateful_lm.*\(transformer_lm\) has no RFA attention.*convert_from_softmax"):
        stateful(lm_data, arch="transformer_lm", splits=())


def test_batch_size_is_required_and_block_within_positions(lm_data):
    task, _ = stateful(lm_data, splits=("valid",))
    with pytest.raises(ValueError, match="needs --batch-size"):
        task.get_batch_iterator(task.dataset("valid"), max_tokens=4096)
    with pytest.raises(ValueError, match="exceeds the model's 8 positions"):
        task.get_batch_iterator(task.dataset("valid"), max_sentences=1, max_positions=8)
    with pytest.raises(ValueError, match="--burn-in-blocks must be a positive integer, got -1"):
        stateful(lm_data, "--burn-in-blocks", "-1", splits=())


def old_checkpoint(data, path, **task_cfg):
    """A checkpoint of a tiny model as an earlier version of fairseq-train wrote one: each causal layer's separate
    q, k, v and gate projections, and the task config with ``task_cfg`` added."""
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, cli(data, "--batch-size", "2", "--rfa-gate"))
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    saved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    saved["task"].update(task_cfg)
    weights = {}
    for name, t in model.state_dict().items():
        if ".self_attn.in_proj." not in name:
            weights[name] = t
            continue
        C = cfg.model.decoder_embed_dim
        for proj, part in zip(("q_proj", "k_proj", "v_proj", "gate_proj"), t.split([C, C, C, t.size(0) - 3 * C])):
            weights[name.replace("in_proj", proj)] = part.clone()
    history = [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam", "lr_scheduler_state": {},
                "num_updates": 0}]
    torch.save({"cfg": saved, "args": None, "model": weights, "optimizer_history": history,
                "extra_state": {}, "task_state": {}}, path)
    return model


def test_a_checkpoint_of_an_earlier_version_loads(lm_data, tmp_path):
    """Separate projections and the task settings removed since (--stream-groups, --no-carry-state,
    --carry-positions, at their defaults): the checkpoint loads, for evaluation and to resume."""
    path = tmp_path / "old.pt"
    model = old_checkpoint(lm_data, path, stream_groups=1, no_carry_state=False, carry_positions=False)
    task, _ = stateful(lm_data, splits=())
    for given in (task, None):
        (loaded,), _, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)], task=given)
        assert loaded.state_dict().keys() == model.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def _eval_lm(data, ckpt, task, *extra):
    out = run_cli("fairseq-eval-lm", data, "--user-dir", USER_DIR, "--task", task, "--path", ckpt,
                  "--gen-subset", "test", "--tokens-per-sample", str(BLOCK), "--max-tokens", "2048", "--cpu", *extra)
    m = re.search(r"Evaluated ([\d,]+) tokens.*\n.*Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", out)
    assert m, out[-2000:]
    return int(m.group(1).replace(",", "")), float(m.group(3))


@pytest.mark.slow
def test_command_lines_train_and_evaluate_either_way(lm_data, tmp_path):
    """fairseq-train with the task (its default burn-in) and without; fairseq-eval-lm with and
    without state on either checkpoint: every run scores every test token."""
    ppl = {}
    for trained in ("rfa_stateful_lm", "language_modeling"):
        ckpt = tmp_path / trained
        log = run_cli("fairseq-train", lm_data, "--task", trained, "--user-dir", USER_DIR, "--arch",
                      "rfa_transformer_lm", "--rfa-gate", "--tokens-per-sample", BLOCK, *SMALL, *TRAIN,
                      "--batch-size", "4", "--max-update", "4", "--save-dir", ckpt)
        assert "num_updates 4" in log
        for evaluated in ("rfa_stateful_lm", "language_modeling"):
            ppl[trained, evaluated] = _eval_lm(lm_data, ckpt / "checkpoint_last.pt", evaluated)
    counts = {n for n, _ in ppl.values()}
    assert len(counts) == 1, ppl
    assert all(1 < p < 1e4 for _, p in ppl.values()), ppl
    assert ppl["rfa_stateful_lm", "rfa_stateful_lm"][1] != ppl["rfa_stateful_lm", "language_modeling"][1]
