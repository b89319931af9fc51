"""Distributed data-parallel training on CPU (torch.distributed, gloo, 2 processes).

fairseq's own launcher assumes CUDA, so this drives torch's DistributedDataParallel directly and
mimics fairseq's trainer: every update, on every rank, ``torch.manual_seed(seed + step)`` and
``model.set_num_updates(step)`` before the forward. The random-feature draws are seeded from
``(torch.initial_seed(), num_updates, module_id)``, so they must agree on both ranks (DDP is built
with ``broadcast_buffers=False`` so that it cannot hide a mismatch by copying rank 0's buffers),
and 2-rank training on two halves of a batch must equal 1-process training on the whole batch.
"""
import datetime
import os
import sys
import traceback

import pytest
import torch

pytestmark = pytest.mark.slow  # spawns two training processes

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)

WORLD = 2
SEED = 11
STEPS = 3
LR = 0.5
GLOBAL_BATCH, SEQ_LEN = 4, 20  # each rank gets 2 sequences; no padding, so equal token counts
MODEL_ARGS = ["--rfa-gate", "--decoder-layers", "2", "--rfa-causal-feature-dim", "16", "--rfa-chunk-size", "8"]


def _setup_path():
    for p in (TESTS, REPO):
        if p not in sys.path:
            sys.path.insert(0, p)


def _helpers():
    _setup_path()
    import rfa_test_utils

    return rfa_test_utils


def _build_model(data_dir):
    h = _helpers()

    torch.manual_seed(0)  # identical initial parameters everywhere
    task, model, _ = h.build_from_cli(
        data_dir, ["--task", "language_modeling", "--tokens-per-sample", "64", "--arch", "rfa_transformer_lm"]
        + h.TINY_MODEL + MODEL_ARGS)
    return task, model


def _global_batch(dictionary):
    gen = torch.Generator().manual_seed(1234)
    return _helpers().random_tokens(dictionary, GLOBAL_BATCH, SEQ_LEN + 1, generator=gen)


def _loss(model, tokens):
    """Mean token cross entropy of next-token prediction."""
    logits, _ = model(tokens[:, :-1])
    target = tokens[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))


def _train(model, tokens, set_num_updates, losses=None):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    for step in range(STEPS):
        torch.manual_seed(SEED + step)  # fairseq's trainer: seed + num_updates, on every rank
        set_num_updates(step)
        opt.zero_grad()
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(loss.item())


def _random_matrices(model):
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("feature_map.random_matrix")}


def _worker(rank, init_method, data_dir, out_dir):
    _setup_path()
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback only
    # A bounded timeout: a rank left waiting in a collective fails instead of hanging (mp.spawn
    # also terminates the other rank as soon as one exits with an error).
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        task, model = _build_model(data_dir)
        tokens = _global_batch(task.source_dictionary)
        half = GLOBAL_BATCH // WORLD
        shard = tokens[rank * half:(rank + 1) * half]
        ddp = DDP(model, broadcast_buffers=False)
        losses = []
        _train(ddp, shard, model.set_num_updates, losses)

        # Gather every random matrix from both ranks (names sorted: same order on each rank).
        mats = _random_matrices(model)
        gathered = {}
        for name in sorted(mats):
            parts = [torch.empty_like(mats[name]) for _ in range(WORLD)]
            dist.all_gather(parts, mats[name].contiguous())
            gathered[name] = parts
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save({"gathered": gathered, "params": params, "losses": losses},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:
        # Make the failing rank's traceback visible in the pytest output, then re-raise so that
        # mp.spawn reports it (ProcessRaisedException in the parent).
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture
def lm_dict_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    _helpers().write_dict(d / "dict.txt", 46)
    return d


def test_ddp_two_ranks_equals_single_process(tmp_path, lm_dict_dir):
    import torch.multiprocessing as mp

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    init_method = f"file://{tmp_path / 'rendezvous'}"  # a fresh file: no port to race for
    # join=True: a worker exception fails the test here (ProcessRaisedException with its traceback).
    mp.spawn(_worker, args=(init_method, str(lm_dict_dir), str(out_dir)), nprocs=WORLD, join=True)

    results = [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]

    # Reference: one process, the same seeds and steps, the whole batch.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        task, ref = _build_model(lm_dict_dir)
        tokens = _global_batch(task.source_dictionary)
        init = {n: p.detach().clone() for n, p in ref.named_parameters()}
        ref_losses = []
        _train(ref, tokens, ref.set_num_updates, ref_losses)
    finally:
        torch.set_num_threads(threads)

    # Each rank's loss is the mean over its half; the two halves average to the global loss.
    for step in range(STEPS):
        mean = sum(res["losses"][step] for res in results) / WORLD
        assert abs(mean - ref_losses[step]) < 1e-5, (step, mean, ref_losses[step])

    ref_params = dict(ref.named_parameters())
    assert set(results[0]["params"]) == set(ref_params)
    moved = 0.0
    for name, p in ref_params.items():
        moved = max(moved, (p.detach() - init[name]).abs().max().item())
        for r, res in enumerate(results):
            diff = (res["params"][name] - p.detach()).abs().max().item()
            assert diff <= 1e-5, f"rank {r} parameter {name} differs from single-process training by {diff}"
    assert moved > 1e-3, "training did not change the parameters; the comparison would be vacuous"

    # Random matrices: identical across ranks, equal to the single-process draws, distinct per layer.
    gathered = results[0]["gathered"]
    assert len(gathered) == 2, sorted(gathered)  # one causal feature map per LM layer
    assert set(gathered) == set(results[1]["gathered"])
    ref_mats = _random_matrices(ref)
    for name, parts in gathered.items():
        assert torch.equal(parts[0], parts[1]), f"{name} differs between ranks"
        assert torch.equal(parts[0], ref_mats[name]), f"{name} differs from the single-process draw"
        assert parts[0].abs().sum() > 0
    names = sorted(gathered)
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            assert not torch.equal(gathered[names[i]][0], gathered[names[j]][0]), (names[i], names[j])

    # The matrices were redrawn during training: the last step's draw is not the one at build time.
    torch.manual_seed(0)
    _, fresh = _build_model(lm_dict_dir)
    for name, m in _random_matrices(fresh).items():
        assert not torch.equal(m, ref_mats[name]), f"{name} was never redrawn in training"
