"""The recipes end to end in smoke mode (SMOKE=1: stand-in archives made from data/multi30k in
each task's official layout and unpacked as the downloads are, a tiny model, a few CPU updates,
no network): prepare.sh, train.sh and evaluate.sh of every task, the resume markers (a second
run redoes nothing), the softmax variant, an ablation variant and the refusal of colliding runs,
the speed table of trained models, and the hydra configs through fairseq-hydra-train.

Each fairseq command line costs ~4 s of start-up, so the runs are shared through module-scoped
fixtures; the whole file takes about 4 minutes on a 2-core CPU.
"""
import math
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # runs the recipes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(REPO, "recipes")
BIN = os.path.dirname(sys.executable)
TRANSLATION = ["iwslt14_de_en", "wmt14_en_de", "wmt14_en_fr"]
TASKS = TRANSLATION + ["wikitext103"]
TEST_SENTENCES = {"iwslt14_de_en": 20, "wmt14_en_de": 12, "wmt14_en_fr": 12}
STEP_STARTED = re.compile(r"step (\S+): start")


def _env(work, **extra):
    # The recipes run in the test's own environment (RFA_USE_CURRENT_ENV=1, its bin/ first on PATH).
    return dict(os.environ, SMOKE="1", WORK=str(work), RFA_USE_CURRENT_ENV="1", PYTHONWARNINGS="ignore",
                OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ.get("PATH", ""), **extra)


def recipe(task, script, *args, work, check=True, **env):
    proc = subprocess.run(["bash", os.path.join(RECIPES, task, script), *args], env=_env(work, **env),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(f"{task}/{script} {' '.join(args)} failed ({proc.returncode}):\n{out[-4000:]}")
    return proc.returncode, proc.stdout, out


def hydra_train(config_dir, config_name, work, save_dir):
    cmd = [os.path.join(BIN, "fairseq-hydra-train"), "--config-dir", config_dir, "--config-name", config_name,
           f"task.data={work / 'data-bin'}", f"common.user_dir={os.path.join(REPO, 'rfa_fairseq')}",
           f"checkpoint.save_dir={save_dir}"]
    proc = subprocess.run(cmd, env=_env(work), capture_output=True, text=True, timeout=300, cwd=str(work))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def archives(task):
    """The archive names prepare.sh fetches (ARCHIVES entries, or its `step fetch fetch NAME`)."""
    text = open(os.path.join(RECIPES, task, "prepare.sh"), encoding="utf-8").read()
    return sorted(set(re.findall(r'"(\S+\.(?:tgz|tar)) ', text) + re.findall(r"step fetch fetch (\S+)", text)))


def learning_rates(log):
    """update -> lr of fairseq's per-update log lines (--log-interval 1)."""
    return {int(n): float(lr) for n, lr in re.findall(r"num_updates=(\d+), lr=([\d.e-]+)", log)}


def params(log):
    m = re.search(r"num\. shared model params: ([\d,]+)", log)
    assert m, log[-2000:]
    return int(m.group(1).replace(",", ""))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """task -> (work dir, {script: combined output of the first run}) after prepare, train rfa_gate, evaluate rfa_gate."""
    done = {}

    def run(task):
        if task not in done:
            work = tmp_path_factory.mktemp(task)
            outputs = {}
            for script, args in (("prepare.sh", ()), ("train.sh", ("rfa_gate",)), ("evaluate.sh", ("rfa_gate",))):
                outputs[script] = recipe(task, script, *args, work=work)[2]
            done[task] = (work, outputs)
        return done[task]

    return run


@pytest.mark.parametrize("task", TRANSLATION)
def test_translation_recipe_smoke(smoke, task):
    work, out = smoke(task)
    assert (work / "data-bin" / "dict.en.txt").exists() and (work / "spm.model").exists()
    # the raw data came out of archives, as downloads do (en-fr: giga-fren's .tar holds .gz files)
    assert sorted(re.findall(r"unpacking (\S+) \(", out["prepare.sh"])) == archives(task)
    assert "RFATransformerModel" in out["train.sh"] and "num_updates 6" in out["train.sh"]
    assert "gate=convex" in out["train.sh"]  # RFA-Gate really built (the module's repr)
    ckpts = sorted(p.name for p in (work / "checkpoints" / "rfa_gate").glob("checkpoint_*_*.pt"))
    assert ckpts == ["checkpoint_1_2.pt", "checkpoint_1_4.pt", "checkpoint_1_6.pt"], ckpts
    ev = out["evaluate.sh"]
    assert "averaging 3 checkpoints" in ev
    n = TEST_SENTENCES[task]
    assert f"Translated {n} sentences" in ev  # every test sentence decoded (no batch dropped)
    m = re.search(rf"sacreBLEU \([^)]*, {n} sentences, detokenised\): ([\d.]+)", ev)
    assert m and 0.0 <= float(m.group(1)) <= 100.0, ev[-2000:]
    assert re.search(r"signature: nrefs:1\|case:mixed\|eff:no\|tok:13a\|smooth:exp\|version:[\d.]+", ev)
    # sacreBLEU first (the primary score), then BLEU on Moses tokens
    if task == "wmt14_en_de":
        tokenised = re.search(r"tokenised BLEU with compound splitting \(##AT##-##AT##\) \(.*, Moses tokens\): [\d.]+", ev)
    else:
        tokenised = re.search(r"tokenised BLEU \(.*, Moses tokens\): [\d.]+", ev)
    assert tokenised and ev.index("sacreBLEU (") < tokenised.start()
    assert "tok:none" in ev[tokenised.start():]
    hyp = next((work / "eval" / "rfa_gate").glob("test.*.hyp.*"))
    assert len(hyp.read_text(encoding="utf-8").splitlines()) == n


def test_language_model_recipe_smoke(smoke):
    work, out = smoke("wikitext103")
    assert (work / "data-bin" / "dict.txt").exists()
    assert sorted(re.findall(r"unpacking (\S+) \(", out["prepare.sh"])) == archives("wikitext103")
    train = out["train.sh"]
    assert "RFATransformerLanguageModel" in train and "AdaptiveInput" in train and "gate=convex" in train
    assert "num_updates 6" in train
    ev = out["evaluate.sh"]
    preprocess = (work / "logs" / "preprocess.log").read_text()
    for split in ("valid", "test"):
        expected = re.search(rf"wiki\.{split}\.tokens: \d+ sents, (\d+) tokens", preprocess).group(1)
        blocks = re.search(rf"^{split} perplexity, 64-token blocks, --context-window 0 \(the RFA paper's setting\): "
                           r"([\d.]+) \(Evaluated ([\d,]+) tokens", ev, re.M)
        sliding = re.search(rf"^{split} perplexity, sliding window, --context-window 32 in 64-token blocks: "
                            r"([\d.]+) \(Evaluated ([\d,]+) tokens", ev, re.M)
        assert blocks and sliding, ev[-2000:]
        for m in (blocks, sliding):
            assert math.isfinite(float(m.group(1))) and float(m.group(1)) > 1.0
            # Every token of the split is scored (fairseq would drop a last partial batch otherwise).
            assert m.group(2).replace(",", "") == expected
        # the two ways of scoring differ (context carried into the scored tokens or not)
        assert blocks.group(1) != sliding.group(1)
        # an RFA run is scored a third time, its state carried through the split
        state = re.search(rf"^{split} perplexity, state carried through the split in 64-token blocks "
                          r"\(--task rfa_stateful_lm, the paper's stateful setting\): ([\d.]+) \(Evaluated ([\d,]+) tokens",
                          ev, re.M)
        assert state and state.group(2).replace(",", "") == expected, ev[-2000:]
        assert state.group(1) != blocks.group(1)


def test_language_model_stateful_recipe(smoke):
    """STATEFUL=1: train.sh trains with the state carried across batches under its own run name,
    evaluate.sh scores that run (the carried state included); softmax has no state and is refused."""
    work, out = smoke("wikitext103")
    command = recipe("wikitext103", "train.sh", "rfa_gate", work=work, STATEFUL="1", DRY_RUN="1")[1]
    assert "--task rfa_stateful_lm --batch-size 8 " in command and "language_modeling" not in command
    train = recipe("wikitext103", "train.sh", "rfa_gate", work=work, STATEFUL="1")[2]
    assert "task: StatefulLanguageModelingTask" in train and "num_updates 6" in train
    assert (work / "checkpoints" / "rfa_gate.stateful" / "checkpoint_last.pt").exists()
    ev = recipe("wikitext103", "evaluate.sh", "rfa_gate", work=work, STATEFUL="1")[2]
    assert "rfa_gate.stateful" in ev and ev.count("perplexity, state carried through the split") == 2, ev[-2000:]
    code, _, msg = recipe("wikitext103", "train.sh", "softmax", work=work, check=False, STATEFUL="1")
    assert code != 0 and "STATEFUL=1 needs an RFA variant" in msg
    code, _, msg = recipe("wikitext103", "train.sh", "rfa", work=work, check=False, STATEFUL="yes")
    assert code != 0 and "STATEFUL must be 0 or 1, got 'yes'" in msg


@pytest.mark.parametrize("task", TASKS)
def test_second_run_skips_finished_steps(smoke, task):
    work, first = smoke(task)
    for script, args in (("prepare.sh", ()), ("train.sh", ("rfa_gate",)), ("evaluate.sh", ("rfa_gate",))):
        started = STEP_STARTED.findall(first[script])
        assert started, first[script][-2000:]
        out = recipe(task, script, *args, work=work)[2]
        assert not STEP_STARTED.findall(out), out[-2000:]
        for step in started:
            assert f"step {step}: already done" in out
        assert "fairseq_cli" not in out  # no fairseq tool ran
    # evaluate.sh still prints the stored results
    assert ("sacreBLEU" in out) if task in TRANSLATION else ("test perplexity, " in out)


def test_softmax_variant_and_bad_variant(smoke):
    work, _ = smoke("iwslt14_de_en")
    train = recipe("iwslt14_de_en", "train.sh", "softmax", work=work)[2]
    assert "--arch transformer_iwslt_de_en" in train and "model: TransformerModel" in train
    assert "rfa" not in re.search(r"variant softmax, run softmax: (.*)", train).group(1)
    ev = recipe("iwslt14_de_en", "evaluate.sh", "softmax", work=work)[2]
    assert "Translated 20 sentences" in ev and re.search(r"sacreBLEU .*: [\d.]+\n  signature: nrefs:1\|", ev)
    code, _, out = recipe("iwslt14_de_en", "train.sh", "linear", work=work, check=False)
    assert code != 0 and "one of softmax, rfa, rfa_gate, rfa_gate_paper" in out


def test_runs_with_other_flags_do_not_collide(smoke):
    """A finished rfa_gate run is neither skipped nor resumed by a command with other flags: it
    is refused, and the same command under its own RUN trains from scratch in its own folder."""
    work, _ = smoke("iwslt14_de_en")
    code, _, out = recipe("iwslt14_de_en", "train.sh", "rfa_gate", "--rfa-kernel", "arccos", work=work, check=False)
    assert code != 0 and "run 'rfa_gate'" in out and "RUN=<name>" in out and "--rfa-kernel arccos" in out
    assert "fairseq_cli" not in out
    # an ablation variant: the paper's gate, pinned, in checkpoints/rfa_gate_paper
    train = recipe("iwslt14_de_en", "train.sh", "rfa_gate_paper", work=work)[2]
    assert "rfa_gate=True" in train and "rfa_gate_form='convex'" in train and "rfa_gate_bias=0.0" in train
    assert "num_updates 6" in train and "gate=convex" in train
    assert (work / "checkpoints" / "rfa_gate_paper" / "checkpoint_1_6.pt").exists()


def test_speed_table_of_trained_models(smoke):
    """speed.sh decodes newstest2014 with the trained softmax and RFA-Gate models and writes the table."""
    work, _ = smoke("wmt14_en_de")
    recipe("wmt14_en_de", "train.sh", "softmax", work=work)
    out = recipe("wmt14_en_de", "speed.sh", "softmax", "rfa_gate", work=work)[2]
    table = (work / "eval" / "speed.md").read_text()
    assert "--beam 4 --lenpen 0.6" in table
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in table.splitlines() if r.startswith("| softmax") or r.startswith("| rfa_gate")}
    assert set(rows) == {"softmax", "rfa_gate"}
    for run, cells in rows.items():
        assert cells[0] == str(TEST_SENTENCES["wmt14_en_de"])  # the whole test set
        assert float(cells[4]) > 0 and float(cells[6]) > 0  # tokens/s, peak memory
    assert rows["softmax"][5] == "1.00x" and rows["softmax"][7] == "1.00x"
    # the averaged checkpoint of evaluate.sh decodes for rfa_gate, checkpoint_last.pt for softmax
    assert re.search(r"speed: rfa_gate <- \S+/eval/rfa_gate/checkpoint\.u6\.avg3\.pt", out)
    assert re.search(r"speed: softmax <- \S+/checkpoints/softmax/checkpoint_last\.pt", out)


def test_hydra_language_model_smoke(smoke):
    """recipes/wikitext103/config/smoke.yaml runs with fairseq-hydra-train and builds the same
    model, with the same learning-rate schedule (the cosine period derived from max_update in
    both), as SMOKE=1 train.sh rfa_gate."""
    work, out = smoke("wikitext103")
    save = work / "checkpoints" / "hydra-smoke"
    log = hydra_train(os.path.join(RECIPES, "wikitext103", "config"), "smoke", work, save)
    assert "model: RFATransformerLanguageModel" in log and "done training" in log and "gate=convex" in log
    assert (save / "checkpoint_last.pt").exists()
    assert params(log) == params(out["train.sh"])
    hydra_lr, script_lr = learning_rates(log), learning_rates(out["train.sh"])
    assert sorted(hydra_lr) == list(range(1, 7)) and hydra_lr == script_lr
    # the schedule anneals within the run: down from the peak after the 2 warm-up updates
    assert hydra_lr[5] < 0.5 * max(hydra_lr.values())


@pytest.fixture(scope="module")
def hydra_translation(smoke):
    done = {}

    def run(task):
        if task not in done:
            work, out = smoke(task)
            save = work / "checkpoints" / "hydra-smoke"
            done[task] = hydra_train(os.path.join(RECIPES, task, "config"), "smoke", work, save), out["train.sh"], save
        return done[task]

    return run


@pytest.mark.parametrize("task", TRANSLATION)
def test_hydra_translation_smoke(hydra_translation, task):
    """The legacy translation model runs through fairseq-hydra-train (the architecture function
    fills the model section, as --arch does) and builds the configured RFA-Gate: the same model
    as SMOKE=1 train.sh rfa_gate."""
    log, train_log, save = hydra_translation(task)
    assert "model: RFATransformerModel" in log and "done training" in log
    assert (save / "checkpoint_last.pt").exists()
    assert "gate=convex" in log
    assert params(log) == params(train_log)
