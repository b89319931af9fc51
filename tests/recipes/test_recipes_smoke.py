"""The recipes end to end in smoke mode (SMOKE=1: stand-in raw data made from data/multi30k in
each task's official layout, a tiny model, a few CPU updates, no network): prepare.sh, train.sh
and evaluate.sh of every task, the resume markers (a second run redoes nothing), the softmax
variant once, and the hydra configs through fairseq-hydra-train.

Each fairseq command line costs ~4 s of start-up, so the runs are shared through module-scoped
fixtures; the whole file takes about 2-3 minutes on a 2-core CPU.
"""
import math
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(REPO, "recipes")
BIN = os.path.dirname(sys.executable)
TRANSLATION = ["iwslt14_de_en", "wmt14_en_de", "wmt14_en_fr"]
TASKS = TRANSLATION + ["wikitext103"]
TEST_SENTENCES = {"iwslt14_de_en": 20, "wmt14_en_de": 12, "wmt14_en_fr": 12}
STEP_STARTED = re.compile(r"step (\S+): start")


def _env(work):
    # The recipes run in the test's own environment (RFA_USE_CURRENT_ENV=1, its bin/ first on PATH).
    return dict(os.environ, SMOKE="1", WORK=str(work), RFA_USE_CURRENT_ENV="1", PYTHONWARNINGS="ignore",
                OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ.get("PATH", ""))


def recipe(task, script, *args, work, check=True):
    proc = subprocess.run(["bash", os.path.join(RECIPES, task, script), *args], env=_env(work),
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
    assert "RFATransformerModel" in out["train.sh"] and "num_updates 6" in out["train.sh"]
    assert "gate_proj" in out["train.sh"]  # RFA-Gate really built
    ckpts = sorted(p.name for p in (work / "checkpoints" / "rfa_gate").glob("checkpoint_*_*.pt"))
    assert ckpts == ["checkpoint_1_2.pt", "checkpoint_1_4.pt", "checkpoint_1_6.pt"], ckpts
    ev = out["evaluate.sh"]
    assert "averaging 3 checkpoints" in ev
    n = TEST_SENTENCES[task]
    assert f"Translated {n} sentences" in ev  # every test sentence decoded (no batch dropped)
    m = re.search(rf"sacreBLEU \([^)]*, {n} sentences, detokenised\): ([\d.]+)", ev)
    assert m and 0.0 <= float(m.group(1)) <= 100.0, ev[-2000:]
    assert re.search(r"signature: nrefs:1\|case:mixed\|eff:no\|tok:13a\|smooth:exp\|version:[\d.]+", ev)
    if task == "wmt14_en_de":
        assert re.search(r"tokenised BLEU with compound splitting \(##AT##-##AT##\) .*: [\d.]+", ev)
        assert "tok:none" in ev
    else:
        assert re.search(r"tokenised BLEU \(.*13a tokens\): [\d.]+", ev)
    hyp = next((work / "eval" / "rfa_gate").glob("test.*.hyp.*"))
    assert len(hyp.read_text(encoding="utf-8").splitlines()) == n


def test_language_model_recipe_smoke(smoke):
    work, out = smoke("wikitext103")
    assert (work / "data-bin" / "dict.txt").exists()
    train = out["train.sh"]
    assert "RFATransformerLanguageModel" in train and "AdaptiveInput" in train and "gate_proj" in train
    assert "num_updates 6" in train
    ev = out["evaluate.sh"]
    preprocess = (work / "logs" / "preprocess.log").read_text()
    for split in ("valid", "test"):
        m = re.search(rf"^{split} perplexity: ([\d.]+) \(Evaluated ([\d,]+) tokens", ev, re.M)
        assert m, ev[-2000:]
        assert math.isfinite(float(m.group(1))) and float(m.group(1)) > 1.0
        # Every token of the split is scored (fairseq would drop a last partial batch otherwise).
        expected = re.search(rf"wiki\.{split}\.tokens: \d+ sents, (\d+) tokens", preprocess).group(1)
        assert m.group(2).replace(",", "") == expected


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
    assert ("sacreBLEU" in out) if task in TRANSLATION else ("test perplexity:" in out)


def test_softmax_variant_and_bad_variant(smoke):
    work, _ = smoke("iwslt14_de_en")
    train = recipe("iwslt14_de_en", "train.sh", "softmax", work=work)[2]
    assert "--arch transformer_iwslt_de_en" in train and "model: TransformerModel" in train
    assert "rfa" not in re.search(r"variant softmax: (.*)", train).group(1)
    ev = recipe("iwslt14_de_en", "evaluate.sh", "softmax", work=work)[2]
    assert "Translated 20 sentences" in ev and re.search(r"sacreBLEU .*: [\d.]+\n  signature: nrefs:1\|", ev)
    code, _, out = recipe("iwslt14_de_en", "train.sh", "linear", work=work, check=False)
    assert code != 0 and "one of softmax, rfa, rfa_gate" in out


def test_hydra_language_model_smoke(smoke):
    """recipes/wikitext103/config/smoke.yaml runs with fairseq-hydra-train and builds the same
    model as SMOKE=1 train.sh rfa_gate."""
    work, out = smoke("wikitext103")
    save = work / "checkpoints" / "hydra-smoke"
    log = hydra_train(os.path.join(RECIPES, "wikitext103", "config"), "smoke", work, save)
    assert "model: RFATransformerLanguageModel" in log and "done training" in log and "gate_proj" in log
    assert (save / "checkpoint_last.pt").exists()
    assert params(log) == params(out["train.sh"])


@pytest.fixture(scope="module")
def hydra_translation(smoke):
    work, out = smoke("iwslt14_de_en")
    save = work / "checkpoints" / "hydra-smoke"
    log = hydra_train(os.path.join(RECIPES, "iwslt14_de_en", "config"), "smoke", work, save)
    return log, out["train.sh"], save


def test_hydra_translation_smoke_runs(hydra_translation):
    """The legacy translation model runs through fairseq-hydra-train (the architecture function
    fills the model section, as --arch does)."""
    log, _, save = hydra_translation
    assert "model: RFATransformerModel" in log and "done training" in log
    assert (save / "checkpoint_last.pt").exists()


def test_hydra_translation_builds_the_configured_rfa_gate(hydra_translation):
    log, train_log, _ = hydra_translation
    assert "gate_proj" in log
    assert params(log) == params(train_log)


def test_compound_splitting_follows_fairseq_convention():
    """tools/score_bleu.py splits hyphens as perl's s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("score_bleu", os.path.join(RECIPES, "tools", "score_bleu.py"))
    score_bleu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(score_bleu)
    assert score_bleu.compound_split("Café-Liebhaber") == "Café ##AT##-##AT## Liebhaber"
    assert score_bleu.compound_split("a-b-c - d") == "a ##AT##-##AT## b-c - d"  # non-overlapping, as perl
