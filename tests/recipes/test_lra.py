"""Long Range Arena: the ListOps generator against the independent evaluator, the converters of
the official files (recipes/lra/prepare.py), and the recipes end to end in smoke mode
(prepare.sh, train.sh, evaluate.sh: fairseq-preprocess, fairseq-train and fairseq-validate with
the sentence_prediction task) for ListOps with every attention and for Text and Retrieval.

The recipe runs are shared through a module-scoped fixture; each fairseq command line costs a few
seconds of start-up, and the file takes about 3 minutes on one core.
"""
import csv
import os
import random
import re
import subprocess
import sys

import pytest

from rfa_test_utils import REPO, load_script

LRA = os.path.join(REPO, "recipes", "lra")
BIN = os.path.dirname(sys.executable)
ATTENTIONS = ("softmax", "rfa", "favor", "lara")
MODULE_CLASS = {"softmax": "MultiheadAttention", "rfa": "EncoderRFAttention", "favor": "EncoderRFAttention",
                "lara": "LARAttention"}
STEP_STARTED = re.compile(r"step (\S+): start")


def load(name):
    return load_script("recipes", "lra", f"{name}.py")


listops = load("listops")
listops_eval = load("listops_eval")
prepare = load("prepare")


# ---------------------------------------------------------------- ListOps generator and evaluator

@pytest.mark.parametrize("expression,value", [
    ("( ( ( [MED 1 ) 4 ) ] )", 2),                        # two middle values: their mean, rounded down
    ("[MED 1 4 ]", 2),                                      # the model's form, without parentheses
    ("[MED 9 0 8 ]", 8),
    ("[MED 3 3 8 9 ]", 5),                                  # (3 + 8) // 2
    ("[SM 7 8 9 ]", 4),                                     # 24 mod 10
    ("[MIN 4 [MAX 1 9 ] 6 ]", 4),
    ("[MAX 2 [SM 3 4 ] [MIN 8 [MED 5 6 ] ] ]", 7),
    ("7", 7),
])
def test_evaluator_on_written_cases(expression, value):
    assert listops_eval.evaluate(expression) == value


@pytest.mark.parametrize("bad", ["[MIN 1 2", "[MIN ] ", "1 2", "[MAX 1 12 ]", "]", "[AVG 1 2 ]"])
def test_evaluator_refuses_malformed_expressions(bad):
    with pytest.raises(ValueError):
        listops_eval.evaluate(bad)


def test_median_is_lras_numpy_median_rounded_down():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for _ in range(500):
        values = [rng.randrange(10) for _ in range(rng.randint(2, 10))]
        assert listops.median_lra(values) == int(np.median(values))


@pytest.mark.parametrize("settings", [
    dict(min_length=5, max_length=60, max_depth=4, max_args=4, n=400),
    dict(min_length=500, max_length=2000, max_depth=10, max_args=10, n=30),   # the LRA settings
], ids=["small", "lra"])
def test_generator_labels_agree_with_the_evaluator(settings):
    n = settings.pop("n")
    rows = listops.make_examples(n, random.Random(7), **settings)
    assert len({s for s, _ in rows}) == n  # unique
    for s, label in rows:
        assert listops_eval.evaluate(s) == label
        length = len([t for t in s.split() if t not in ("(", ")")])
        assert settings["min_length"] < length < settings["max_length"]
    if n >= 400:
        assert len({label for _, label in rows}) == 10  # every class occurs


def test_generator_writes_the_official_layout(tmp_path):
    args = ["--out-dir", str(tmp_path), "--train", "20", "--valid", "5", "--test", "5", "--min-length", "5",
            "--max-length", "40", "--max-depth", "4", "--max-args", "4", "--seed", "3"]
    listops.main(args)
    files = {split: list(csv.reader(open(tmp_path / f"basic_{split}.tsv"), delimiter="\t"))
             for split in ("train", "val", "test")}
    assert all(rows[0] == ["Source", "Target"] for rows in files.values())
    assert [len(rows) - 1 for rows in files.values()] == [20, 5, 5]
    sources = [r[0] for rows in files.values() for r in rows[1:]]
    assert len(set(sources)) == 30 and all(s.startswith("( ") for s in sources if len(s) > 1)
    first = open(tmp_path / "basic_train.tsv").read()
    listops.main(args)  # the seed fixes the data
    assert open(tmp_path / "basic_train.tsv").read() == first
    with pytest.raises(SystemExit):
        listops.main(["--out-dir", str(tmp_path), "--max-depth", "2", "--max-args", "3", "--min-length", "20"])


# ---------------------------------------------------------------- converters of the official files

def test_listops_conversion_drops_parentheses_and_checks_labels(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    rows = {"train": [("( ( ( [MAX 2 ) 9 ) ] )", "9")], "val": [("( ( ( [SM 3 ) 4 ) ] )", "7")],
            "test": [("5", "5")]}
    for split, part in rows.items():
        listops.write_tsv(str(raw / f"basic_{split}.tsv"), part)
    prepare.main(["listops", "--raw", str(raw), "--out", str(out)])
    assert (out / "train.input0").read_text() == "[MAX 2 9 ]\n" and (out / "valid.label").read_text() == "7\n"
    assert (out / "dict.input0.txt").read_text().split("\n")[:5] == ["[MIN 1", "[MAX 1", "[MED 1", "[SM 1", "] 1"]
    assert len((out / "dict.label.txt").read_text().splitlines()) == 10
    listops.write_tsv(str(raw / "basic_val.tsv"), [("( ( ( [SM 3 ) 4 ) ] )", "6")])
    with pytest.raises(SystemExit, match=r"basic_val.tsv:2: label 6 but the expression evaluates to 7"):
        prepare.main(["listops", "--raw", str(raw), "--out", str(out)])
    prepare.main(["listops", "--raw", str(raw), "--out", str(out), "--no-check-labels"])
    assert (out / "valid.label").read_text() == "6\n"


def test_byte_level_text_and_retrieval(tmp_path):
    raw = tmp_path / "imdb"
    for part in ("train", "test"):
        for polarity in ("pos", "neg"):
            (raw / "aclImdb" / part / polarity).mkdir(parents=True)
    (raw / "aclImdb" / "train" / "pos" / "0_9.txt").write_text("Caf\u00e9\tok", encoding="utf-8")
    (raw / "aclImdb" / "train" / "neg" / "0_1.txt").write_bytes(b"ab\ncd")
    (raw / "aclImdb" / "test" / "pos" / "0_8.txt").write_bytes(b"x" * 50)
    out = tmp_path / "text"
    prepare.main(["text", "--raw", str(raw), "--out", str(out), "--max-length", "5"])
    # one symbol per UTF-8 byte (e-acute is two), cut to --max-length bytes; pos is 1, neg 0
    assert (out / "train.input0").read_text().splitlines() == ["43 61 66 c3 a9", "61 62 0a 63 64"]
    assert (out / "train.label").read_text() == "1\n0\n"
    assert (out / "valid.input0").read_text() == (out / "test.input0").read_text() == "78 78 78 78 78\n"
    assert len((out / "dict.input0.txt").read_text().splitlines()) == 256

    aan = tmp_path / "aan"
    aan.mkdir()
    for name in ("train", "eval", "test"):
        (aan / f"new_aan_pairs.{name}.tsv").write_text("1.0\tp1\tp2\tabc\tde\n0.0\tp3\tp4\t\tfghij\n")
    out = tmp_path / "retrieval"
    prepare.main(["retrieval", "--raw", str(aan), "--out", str(out), "--max-length", "4"])
    assert (out / "train.input0").read_text() == "61 62 63\n\n"
    assert (out / "train.input1").read_text() == "64 65\n66 67 68 69\n"
    assert (out / "valid.label").read_text() == "1\n0\n"
    (aan / "new_aan_pairs.eval.tsv").write_text("1.0\tp1\tabc\tde\n")
    with pytest.raises(SystemExit, match=r"new_aan_pairs.eval.tsv:1: expected 5 tab-separated fields"):
        prepare.main(["retrieval", "--raw", str(aan), "--out", str(out)])


# ---------------------------------------------------------------- the recipes in smoke mode

def _env(work):
    return dict(os.environ, SMOKE="1", WORK=str(work), RFA_USE_CURRENT_ENV="1", PYTHONWARNINGS="ignore",
                OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ.get("PATH", ""))


def recipe(script, *args, work, check=True):
    proc = subprocess.run(["bash", os.path.join(LRA, script), *args], env=_env(work), capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(f"lra/{script} {' '.join(args)} failed ({proc.returncode}):\n{out[-4000:]}")
    return proc.returncode, out


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(task, attention) -> (work dir, {script: output}) after prepare.sh, train.sh and evaluate.sh."""
    works, done = {}, {}

    def run(task, attention):
        if task not in works:
            works[task] = tmp_path_factory.mktemp(task)
            done[task, "prepare"] = recipe("prepare.sh", task, work=works[task])[1]
        if (task, attention) not in done:
            done[task, attention] = {script: recipe(script, task, attention, work=works[task])[1]
                                     for script in ("train.sh", "evaluate.sh")}
            done[task, attention]["prepare.sh"] = done[task, "prepare"]
        return works[task], done[task, attention]

    return run


TEST_EXAMPLES = {"listops": 24, "text": 16, "retrieval": 12}


def accuracy(evaluate_output):
    m = re.search(r"valid on 'test' subset \| loss ([\d.]+) \| .*accuracy ([\d.]+) \| .*bsz (\d+)", evaluate_output)
    assert m, evaluate_output[-2000:]
    return float(m.group(1)), float(m.group(2)), int(m.group(3))


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.slow
def test_listops_recipe_every_attention(smoke, attention):
    """Generated ListOps, binarised with the fixed dictionaries, trained with fairseq-train and
    scored with fairseq-validate: each attention builds its own module and reports accuracy on
    every test example."""
    work, out = smoke("listops", attention)
    assert "generating ListOps" not in out["prepare.sh"] and "wrote 96 examples" in out["prepare.sh"]
    assert (work / "data-bin" / "input0" / "dict.txt").read_text().startswith("[MIN 1\n")
    train = out["train.sh"]
    assert "RFAClassifierModel" in train and "num_updates 6" in train
    assert f"(self_attn): {MODULE_CLASS[attention]}(" in train
    assert re.search(r"valid on 'valid' subset .*accuracy [\d.]+", train)
    loss, acc, n = accuracy(out["evaluate.sh"])
    assert 0 <= acc <= 100 and loss > 0 and n == TEST_EXAMPLES["listops"]
    assert (work / "checkpoints" / attention / "checkpoint_best.pt").exists()


@pytest.mark.parametrize("task,attention", [("text", "favor"), ("retrieval", "rfa")])
@pytest.mark.slow
def test_byte_level_recipes(smoke, task, attention):
    """Text (from a stand-in aclImdb_v1.tar.gz, unpacked as the download would be) and Retrieval
    (AAN pairs in two input folders, the dual encoder) end to end."""
    work, out = smoke(task, attention)
    fields = ["input0", "input1", "label"] if task == "retrieval" else ["input0", "label"]
    assert sorted(p.name for p in (work / "data-bin").iterdir()) == fields
    assert len((work / "data-bin" / "input0" / "dict.txt").read_text().splitlines()) == 256
    if task == "text":
        assert "unpacking aclImdb_v1.tar.gz" in out["prepare.sh"]
    else:
        train = out["train.sh"]
        assert "'classifier_head': dual" in train and "'separator_token': 0" in train
        # the head reads [u, v, u*v, u-v] of the 32-dimensional smoke encoder
        assert re.search(r"\(mlp\): Sequential\(\s*\(0\): Linear\(in_features=128,", train)
    assert f"(self_attn): {MODULE_CLASS[attention]}(" in out["train.sh"]
    assert accuracy(out["evaluate.sh"])[2] == TEST_EXAMPLES[task]


@pytest.mark.slow
def test_validate_reproduces_training_validation(smoke):
    """Checkpoint round trip through the command lines: fairseq-validate on the valid split with
    the last checkpoint gives the loss and accuracy fairseq-train logged at its last update
    (the random matrices are saved and fixed in evaluation)."""
    work, out = smoke("listops", "rfa")
    last = re.findall(r"valid on 'valid' subset \| loss ([\d.]+) \| nll_loss [\d.]+ \| accuracy ([\d.]+) .*num_updates 6",
                      out["train.sh"])
    assert last, out["train.sh"][-2000:]
    proc = subprocess.run([os.path.join(BIN, "fairseq-validate"), str(work / "data-bin"), "--user-dir",
                           os.path.join(REPO, "rfa_fairseq"), "--task", "sentence_prediction", "--criterion",
                           "sentence_prediction", "--path", str(work / "checkpoints" / "rfa" / "checkpoint_last.pt"),
                           "--valid-subset", "valid", "--batch-size", "8", "--cpu"],
                          env=_env(work), capture_output=True, text=True, timeout=300)
    got = re.search(r"valid on 'valid' subset \| loss ([\d.]+) \| nll_loss [\d.]+ \| accuracy ([\d.]+)",
                    proc.stdout + proc.stderr)
    assert got, (proc.stdout + proc.stderr)[-2000:]
    assert got.groups() == last[-1]


@pytest.mark.slow
def test_second_run_skips_finished_steps_and_bad_arguments(smoke):
    work, first = smoke("listops", "softmax")
    for script, args in (("prepare.sh", ("listops",)), ("train.sh", ("listops", "softmax")),
                         ("evaluate.sh", ("listops", "softmax"))):
        started = STEP_STARTED.findall(first[script])
        assert started, first[script][-2000:]
        again = recipe(script, *args, work=work)[1]
        assert not STEP_STARTED.findall(again) and "fairseq_cli" not in again
    assert re.search(r"accuracy [\d.]+", again)  # evaluate.sh still prints the stored result
    code, msg = recipe("train.sh", "listops", "linear", work=work, check=False)
    assert code != 0 and "one of softmax, rfa, favor, lara" in msg
    code, msg = recipe("prepare.sh", "image", work=work, check=False)
    assert code != 0 and "one of listops, text, retrieval" in msg
    # the same run name with other flags is refused rather than resumed
    code, msg = recipe("train.sh", "listops", "softmax", "--encoder-layers", "2", work=work, check=False)
    assert code != 0 and "run 'softmax'" in msg


# ---------------------------------------------------------------- the commands train.sh builds

@pytest.mark.parametrize("task,arch,updates,warmup,lr,positions,classes", [
    ("listops", "rfa_classifier_lra_listops", "5000", "1000", "1.58e-3", "2002", "10"),
    ("text", "rfa_classifier_lra_text", "20000", "8000", "5.59e-4", "4002", "2"),
    ("retrieval", "rfa_classifier_lra_retrieval", "5000", "8000", "5.59e-4", "8004", "2"),
])
def test_train_command_has_lras_budget(tmp_path, task, arch, updates, warmup, lr, positions, classes):
    import shlex

    (tmp_path / "data-bin" / "input0").mkdir(parents=True)
    (tmp_path / "data-bin" / "input0" / "dict.txt").write_text("00 1\n")
    env = dict(_env(tmp_path), SMOKE="0", DRY_RUN="1", WORLD_SIZE="2", FP16="0")
    proc = subprocess.run(["bash", os.path.join(LRA, "train.sh"), task, "lara"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cmd = shlex.split(next(line for line in proc.stdout.splitlines() if line.startswith("fairseq-train ")))

    def flag(name):
        return cmd[cmd.index(name) + 1]

    assert (flag("--arch"), flag("--encoder-attention"), flag("--max-update"), flag("--warmup-updates"),
            flag("--lr"), flag("--max-positions"), flag("--num-classes")) == (arch, "lara", updates, warmup, lr,
                                                                               positions, classes)
    assert flag("--task") == "sentence_prediction" and flag("--criterion") == "sentence_prediction"
    assert flag("--init-token") == "0" and ("--separator-token" in cmd) == (task == "retrieval")
    assert flag("--batch-size") == "16"  # LRA's 32 examples per update over 2 GPUs
    assert flag("--weight-decay") == "0.1" and flag("--adam-betas") == "(0.9, 0.98)"
    env["WORLD_SIZE"] = "3"
    proc = subprocess.run(["bash", os.path.join(LRA, "train.sh"), task, "lara"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "do not split over 3 GPUs" in proc.stderr
