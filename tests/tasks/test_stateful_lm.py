"""Task rfa_stateful_lm: contiguous streams per batch row (and per rank), the state carried over
blocks equal to one pass over their concatenation, resume, the softmax refusal, and the command
lines (train, eval-lm with and without state, either kind of checkpoint)."""
import re

import pytest
import torch

from rfa_fairseq.modules.causal_rfa_attention import CarriedState
from rfa_fairseq.tasks.stateful_lm import causal_rfa_modules, stream_layout
from rfa_test_utils import TINY_DECODER, USER_DIR, build_from_cli, multi30k_lm_bin, run_cli

BLOCK = 16
TRAIN = ["--optimizer", "adam", "--lr", "1e-3", "--no-progress-bar", "--log-interval", "1", "--cpu",
         "--num-workers", "0", "--seed", "3"]
SMALL = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
         "--decoder-attention-heads", "4", "--rfa-chunk-size", "8", "--rfa-causal-feature-dim", "16"]


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return multi30k_lm_bin(tmp_path_factory.mktemp("lm"), (("train", 200), ("valid", 30), ("test", 30)))


def stateful(data, *extra, arch="rfa_transformer_lm"):
    """The task and a tiny model; training on contiguous streams (--burn-in-blocks 0) unless ``extra`` says."""
    torch.manual_seed(0)
    extra = extra if "--burn-in-blocks" in extra else ("--burn-in-blocks", "0") + extra
    task, model, _ = build_from_cli(data, ["--task", "rfa_stateful_lm", "--tokens-per-sample", str(BLOCK),
                                           "--arch", arch] + TINY_DECODER + list(extra))
    return task, model


def text_tokens(task, split):
    """The whole split as fairseq's indexed dataset holds it: one token stream."""
    blocks = task.dataset(split).blocks
    return torch.cat([blocks.dataset[i] for i in range(len(blocks.dataset))])


def batches(task, split, rows, num_shards=1, shard_id=0, groups=None):
    itr = task.get_batch_iterator(task.dataset(split), max_sentences=rows, num_shards=num_shards, shard_id=shard_id,
                                  groups=groups)
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


@pytest.mark.parametrize("shards,groups", [(1, 1), (2, 1), (1, 3), (2, 2)],
                         ids=["1-rank", "2-ranks", "1-rank-3-groups", "2-ranks-2-groups"])
def test_every_row_continues_its_text(lm_data, shards, groups):
    """Read row by row, the batches of every rank and group give back the text in order: each
    row's targets are a contiguous piece of the text, rows follow each other (rank 0's groups in
    turn, then rank 1's), every token is a target exactly once, and each block's first input is
    the previous block's last target (the token before it in the text). Consecutive batches take
    turns among the groups."""
    task, _ = stateful(lm_data, "--stream-groups", str(groups))
    task.load_dataset("train")
    text = text_tokens(task, "train")
    rows, targets = 3, []
    for shard in range(shards):
        samples = batches(task, "train", rows, shards, shard)
        assert all(s["target"].size(0) == rows and s["stream"] == "train" for s in samples)
        turns = [(s["group"], s["block"]) for s in samples]
        assert turns == sorted(turns, key=lambda gb: (gb[1], gb[0])), "groups take turns column by column"
        assert len(set(turns)) == len(turns)
        if shards == 1:
            assert all(s["ntokens"] > 0 for s in samples), "a batch of padding only is skipped"
        for g in range(groups):
            mine = [s for s in samples if s["group"] == g]
            assert [s["block"] for s in mine] == list(range(len(mine)))
            for r, (src, tgt) in enumerate(row_streams(task, mine)):
                targets.append(tgt)
                if len(tgt):
                    assert torch.equal(src[1:], tgt[:-1]), f"rank {shard} group {g} row {r}: inputs are not the targets shifted"
    assert torch.equal(torch.cat(targets), text)


def test_batches_have_whole_blocks_and_count_real_tokens(lm_data):
    task, _ = stateful(lm_data)
    task.load_dataset("valid")
    samples = batches(task, "valid", 4)
    pad = task.dictionary.pad()
    for s in samples:
        assert s["target"].size(1) == BLOCK or s is samples[-1]
        assert s["ntokens"] == int(s["target"].ne(pad).sum())
        assert torch.equal(s["net_input"]["src_tokens"].eq(pad), s["target"].eq(pad))
    assert sum(s["ntokens"] for s in samples) == len(text_tokens(task, "valid"))


def test_batches_of_padding_only_are_skipped(lm_data):
    """Many groups over a short split: the last groups' streams run out early (or hold no text at
    all); their empty batches are skipped, and every token is still a target once."""
    task, _ = stateful(lm_data, "--stream-groups", "8")
    task.load_dataset("valid")
    blocks = len(task.dataset("valid"))
    samples = batches(task, "valid", 2)
    columns = -(-blocks // 16)
    assert len(samples) < 8 * columns, "the test needs a layout with empty batches"
    assert all(s["ntokens"] > 0 for s in samples)
    assert sum(s["ntokens"] for s in samples) == len(text_tokens(task, "valid"))


def test_resume_keeps_the_stream_position(lm_data):
    """fairseq saves the iterator's position in the checkpoint: a new iterator loaded from it
    continues with the next batch of every row; the task then starts the carried states afresh."""
    task, model = stateful(lm_data)
    task.load_dataset("train")
    whole = batches(task, "train", 2)
    itr = task.get_batch_iterator(task.dataset("train"), max_sentences=2)
    epoch = itr.next_epoch_itr(shuffle=True)
    for _ in range(3):
        next(epoch)
    saved = itr.state_dict()
    task2, _ = stateful(lm_data)
    task2.load_dataset("train")
    itr2 = task2.get_batch_iterator(task2.dataset("train"), max_sentences=2)
    itr2.load_state_dict(saved)
    resumed = list(itr2.next_epoch_itr(shuffle=True))
    assert len(resumed) == len(whole) - 3
    for a, b in zip(resumed, whole[3:]):
        assert a["block"] == b["block"] and torch.equal(a["net_input"]["src_tokens"], b["net_input"]["src_tokens"])
    task2.use_stream(model, resumed[0])
    assert all(m.carry.state is None for m in causal_rfa_modules(model))


@pytest.mark.parametrize("gate", [[], ["--rfa-gate"], ["--rfa-gate", "--rfa-gate-form", "decay"]],
                         ids=["rfa", "gate", "gate-decay"])
def test_carried_state_over_blocks_equals_one_pass(lm_data, gate):
    """The whole decoder (no positional embeddings: they restart at every block by design) over
    blocks with the carried state equals one pass over the concatenation, fp32, <= 1e-5."""
    _, model = stateful(lm_data, "--no-token-positional-embeddings", *gate)
    model.eval()
    tokens = torch.randint(4, 50, (3, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, _ = model(tokens)
        for m in causal_rfa_modules(model):
            m.carry = CarriedState()
        blocks = torch.cat([model(tokens[:, a:a + BLOCK])[0] for a in range(0, 70, BLOCK)], dim=1)
    assert (blocks - whole).abs().max().item() <= 1e-5


def test_carried_positions_over_blocks_equal_one_pass(lm_data):
    """With --carry-positions the whole decoder, sinusoidal positions included, over blocks with
    the carried state equals one pass over the concatenation; with positions restarting it does
    not."""
    tokens = torch.randint(4, 50, (3, 70), generator=torch.Generator().manual_seed(1))
    _, plain = stateful(lm_data, "--rfa-gate")  # the same weights as below (seed 0)
    plain.eval()
    with torch.no_grad():
        for a in causal_rfa_modules(plain):
            a.carry = None
        whole, _ = plain(tokens)  # fairseq's own positions 1 .. 70
    ends = {}
    for name, flags in (("carried", ["--carry-positions"]), ("restarting", [])):
        _, model = stateful(lm_data, "--rfa-gate", *flags)
        model.eval()
        with torch.no_grad():
            ends[name] = torch.cat([model(tokens[:, a:a + BLOCK])[0] for a in range(0, 70, BLOCK)], dim=1)
    assert (ends["carried"] - whole).abs().max().item() <= 1e-5
    assert (ends["restarting"] - whole).abs().max().item() > 1e-2


def test_carried_positions_follow_the_batch_column(lm_data):
    """The task sets the offset from the batch's column, so every group of streams and a resumed
    stream get the positions of their place in the text."""
    task, model = stateful(lm_data, "--carry-positions", "--stream-groups", "2")
    task.load_dataset("valid")
    samples = batches(task, "valid", 2)
    embed = model.decoder.embed_positions
    for s in samples[:5]:
        task.use_stream(model, s)
        assert embed.offset == s["block"] * BLOCK
        model(s["net_input"]["src_tokens"])
        assert embed.offset == (s["block"] + 1) * BLOCK


@pytest.mark.parametrize("flags, message", [(["--no-token-positional-embeddings"], "no positional embeddings"),
                                            (["--decoder-learned-pos"], "learned positions")])
def test_carried_positions_need_sinusoidal_positions(lm_data, flags, message):
    with pytest.raises(ValueError, match=f"--carry-positions.*{message}"):
        stateful(lm_data, "--carry-positions", *flags)


@pytest.mark.parametrize("groups", [1, 2])
def test_valid_steps_carry_the_stream(lm_data, groups):
    """Through the task: the valid loss of a split, batch after batch, equals the loss of one pass
    over each row's whole text (no positional embeddings), and differs from blocks without state
    (a gate that starts near 0.95 remembers across blocks); with two groups taking turns, each
    group carries its own states."""
    task, model = stateful(lm_data, "--no-token-positional-embeddings", "--rfa-gate", "--rfa-gate-bias", "3",
                           "--stream-groups", str(groups))
    task.load_dataset("valid")
    criterion = task.build_criterion(build_from_cli(lm_data, ["--task", "rfa_stateful_lm", "--arch",
                                                             "rfa_transformer_lm"])[2])
    samples = batches(task, "valid", 2)
    carried = sum(task.valid_step(s, model, criterion)[0].item() for s in samples)
    pad = task.dictionary.pad()
    whole = 0.0
    with torch.no_grad():
        for m in causal_rfa_modules(model):
            m.carry = None
        for src, tgt in [st for g in range(groups) for st in row_streams(task, [s for s in samples if s["group"] == g])]:
            logits, _ = model(src[None])
            whole += torch.nn.functional.cross_entropy(logits[0], tgt, reduction="sum", ignore_index=pad).item()
        blocks = sum(criterion(model, s)[0].item() for s in samples)
    assert carried == pytest.approx(whole, rel=1e-5)
    assert abs(blocks - whole) > 1e-3 * whole, "the test cannot tell carried state from none"


def test_no_carry_state_starts_every_block_from_zero(lm_data):
    """--no-carry-state: the same batches in the same order, but each block's loss is that of the
    block alone (no state from the block before)."""
    task, model = stateful(lm_data, "--no-token-positional-embeddings", "--rfa-gate", "--rfa-gate-bias", "3",
                           "--no-carry-state")
    task.load_dataset("valid")
    criterion = task.build_criterion(build_from_cli(lm_data, ["--task", "rfa_stateful_lm", "--arch",
                                                             "rfa_transformer_lm"])[2])
    samples = batches(task, "valid", 2)
    stepped = [task.valid_step(s, model, criterion)[0].item() for s in samples]
    with torch.no_grad():
        for m in causal_rfa_modules(model):
            m.carry = None
        alone = [criterion(model, s)[0].item() for s in samples]
    assert stepped == pytest.approx(alone, rel=1e-5)


def burn_in_batches(task, rows, epoch=1, num_shards=1, shard_id=0):
    itr = task.get_batch_iterator(task.dataset("train"), max_sentences=rows, seed=3, epoch=epoch,
                                  num_shards=num_shards, shard_id=shard_id)
    return list(itr.next_epoch_itr(shuffle=True))


@pytest.mark.parametrize("n", [1, 2])
def test_burn_in_batches_shuffle_every_block_with_the_blocks_before_it(lm_data, n):
    """--burn-in-blocks N: each epoch every train block is a row once, in an order that changes from
    epoch to epoch; before each row come the N blocks that precede it in the text, oldest first
    (pads before the text starts), so the burn-in and the row together are a contiguous piece of
    the text. Validation keeps the streams."""
    task, _ = stateful(lm_data, "--burn-in-blocks", str(n))
    task.load_dataset("train")
    task.load_dataset("valid")
    pad, blocks = task.dictionary.pad(), task.dataset("train")
    orders = []
    for epoch in (1, 2):
        samples = burn_in_batches(task, 3, epoch)
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
    sharded = [s["id"].tolist() for k in (0, 1) for s in burn_in_batches(task, 3, 1, 2, k) if s]
    assert sorted(sum(sharded, [])) == list(range(len(blocks))), "two ranks share the blocks"
    assert all("burn_in" not in s and "block" in s for s in batches(task, "valid", 2))


@pytest.mark.parametrize("gate", [[], ["--rfa-gate"]], ids=["rfa", "gate"])
def test_burn_in_gives_each_row_the_state_of_the_text_before_it(lm_data, gate):
    """After the task's burn-in, the whole decoder over a training batch (no positional
    embeddings) equals one pass over each row's preceding blocks and the row together, fp32,
    <= 1e-5; the row that starts the text equals a pass over it alone."""
    task, model = stateful(lm_data, "--no-token-positional-embeddings", "--burn-in-blocks", "2", *gate)
    model.eval()
    task.load_dataset("train")
    pad, blocks = task.dictionary.pad(), task.dataset("train")
    sample = next(s for s in burn_in_batches(task, 4) if 0 in s["id"].tolist() or 1 in s["id"].tolist())
    with torch.no_grad():
        task.burn_in(model, sample["burn_in"])
        out, _ = model(sample["net_input"]["src_tokens"])
        for m in causal_rfa_modules(model):
            m.carry = None
        for r, i in enumerate(sample["id"].tolist()):
            text = torch.cat([blocks[j][0] for j in range(max(i - 2, 0), i + 1)])
            whole, _ = model(text[None])
            length = len(blocks[i][0])
            assert (out[r, :length] - whole[0, -length:]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("flag", [["--stream-groups", "2"], ["--no-carry-state"], ["--carry-positions"]])
def test_burn_in_refuses_the_stream_flags(lm_data, flag):
    with pytest.raises(ValueError, match=f"--burn-in-blocks 1 trains on shuffled blocks, which {flag[0]}"):
        stateful(lm_data, "--burn-in-blocks", "1", *flag)


def test_softmax_model_is_refused(lm_data):
    with pytest.raises(ValueError, match=r"rfa_stateful_lm.*\(transformer_lm\) has no RFA attention.*convert_from_softmax"):
        stateful(lm_data, arch="transformer_lm")


def test_batch_size_is_required_and_block_within_positions(lm_data):
    task, _ = stateful(lm_data)
    task.load_dataset("valid")
    with pytest.raises(ValueError, match="needs --batch-size"):
        task.get_batch_iterator(task.dataset("valid"), max_tokens=4096)
    with pytest.raises(ValueError, match="exceeds the model's 8 positions"):
        task.get_batch_iterator(task.dataset("valid"), max_sentences=1, max_positions=8)
    with pytest.raises(ValueError, match="--stream-groups must be a positive integer, got 0"):
        task.get_batch_iterator(task.dataset("valid"), max_sentences=1, groups=0)


def _eval_lm(data, ckpt, task, *extra):
    out = run_cli("fairseq-eval-lm", data, "--user-dir", USER_DIR, "--task", task, "--path", ckpt,
                  "--gen-subset", "test", "--tokens-per-sample", str(BLOCK), "--max-tokens", "2048", "--cpu", *extra)
    m = re.search(r"Evaluated ([\d,]+) tokens.*\n.*Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", out)
    assert m, out[-2000:]
    return int(m.group(1).replace(",", "")), float(m.group(3))


@pytest.mark.slow
def test_command_lines_train_and_evaluate_either_way(lm_data, tmp_path):
    """fairseq-train with the task; fairseq-eval-lm with and without state on a checkpoint
    trained with state and on one trained without: every run scores every test token."""
    ppl = {}
    for trained, extra in (("rfa_stateful_lm", []), ("language_modeling", [])):  # the task's default: burn-in
        ckpt = tmp_path / trained
        log = run_cli("fairseq-train", lm_data, "--task", trained, "--user-dir", USER_DIR, "--arch",
                      "rfa_transformer_lm", "--rfa-gate", "--tokens-per-sample", BLOCK, *SMALL, *TRAIN, *extra,
                      "--batch-size", "4", "--max-update", "4", "--save-dir", ckpt)
        assert "num_updates 4" in log
        for evaluated in ("rfa_stateful_lm", "language_modeling"):
            ppl[trained, evaluated] = _eval_lm(lm_data, ckpt / "checkpoint_last.pt", evaluated)
    counts = {n for n, _ in ppl.values()}
    assert len(counts) == 1, ppl
    assert all(1 < p < 1e4 for _, p in ppl.values()), ppl
    assert ppl["rfa_stateful_lm", "rfa_stateful_lm"][1] != ppl["rfa_stateful_lm", "language_modeling"][1]
