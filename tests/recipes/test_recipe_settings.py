"""The recipes' settings without training: the fairseq-train commands train.sh builds (DRY_RUN=1)
per task, size, variant and GPU count, the hydra configs against those commands, the batch plan,
the download/unpack helpers of common.sh, the BLEU tool's tokenisation, and the bash 4.3 rule
for empty arrays. Fast: no fairseq command runs."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from rfa_test_utils import REPO, load_script

RECIPES = os.path.join(REPO, "recipes")
BIN = os.path.dirname(sys.executable)
TASK_DICTS = {"iwslt14_de_en": ("de", "en"), "wmt14_en_de": ("en", "de"), "wmt14_en_fr": ("en", "fr"),
              "wikitext103": (None,)}
# tokens per update of the reference setups (recipes/README.md): IWSLT one GPU x 4,096; WMT base
# 8 x 4,096; WMT en-fr big 8 x 3,584 (Ott et al.); the LM 8 GPUs x 3 x 3,072 (Baevski and Auli)
REFERENCE_TOKENS = {("iwslt14_de_en", "base"): 4096, ("wmt14_en_de", "base"): 32768,
                    ("wmt14_en_fr", "base"): 32768, ("wmt14_en_fr", "big"): 28672,
                    ("wikitext103", "big"): 73728, ("wikitext103", "small"): 73728}


def load_tool(name):
    return load_script("recipes", "tools", f"{name}.py")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """task -> a work folder whose data-bin holds the dictionaries train.sh looks for."""
    root = tmp_path_factory.mktemp("dry")
    for task, langs in TASK_DICTS.items():
        data = root / task / "data-bin"
        data.mkdir(parents=True)
        for lang in langs:
            (data / (f"dict.{lang}.txt" if lang else "dict.txt")).write_text("a 1\n")
    return root


def dry_run(work, task, variant, *extra, check=True, **env):
    """The fairseq-train command train.sh would run (as a list) and the script's log."""
    environ = dict(os.environ, WORK=str(work / task), RFA_USE_CURRENT_ENV="1", DRY_RUN="1", SMOKE="0",
                   FP16="0", WORLD_SIZE="1", PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    for name in ("SIZE", "RUN", "MAX_TOKENS", "UPDATE_FREQ", "MAX_UPDATE"):
        environ.pop(name, None)
    environ.update(env)
    proc = subprocess.run(["bash", os.path.join(RECIPES, task, "train.sh"), variant, *extra], env=environ,
                          capture_output=True, text=True, timeout=120)
    if not check:
        return proc.returncode, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("fairseq-train "))
    return shlex.split(line), proc.stderr


def flag(cmd, name):
    assert name in cmd, f"{name} not in {cmd}"
    return cmd[cmd.index(name) + 1]


# ---------------------------------------------------------------- what train.sh runs

@pytest.mark.parametrize("task,size,softmax_arch,rfa_arch,max_update", [
    ("iwslt14_de_en", None, "transformer_iwslt_de_en", "rfa_transformer_iwslt_de_en", 50000),
    ("wmt14_en_de", None, "transformer_wmt_en_de", "rfa_transformer_wmt_en_de", 350000),
    ("wmt14_en_fr", None, "transformer_wmt_en_de", "rfa_transformer_wmt_en_de", 350000),
    ("wmt14_en_fr", "big", "transformer_vaswani_wmt_en_fr_big", "rfa_transformer_vaswani_wmt_en_fr_big", 350000),
    ("wikitext103", None, "transformer_lm_wiki103", "rfa_transformer_lm_wiki103", 150000),
    ("wikitext103", "small", "transformer_lm_wiki103", "rfa_transformer_lm_wiki103_small", 150000),
], ids=lambda v: str(v))
def test_architecture_and_update_count(work, task, size, softmax_arch, rfa_arch, max_update):
    env = {"SIZE": size} if size else {}
    softmax, _ = dry_run(work, task, "softmax", **env)
    rfa, _ = dry_run(work, task, "rfa_gate", **env)
    assert flag(softmax, "--arch") == softmax_arch and flag(rfa, "--arch") == rfa_arch
    assert int(flag(softmax, "--max-update")) == int(flag(rfa, "--max-update")) == max_update
    suffix = f".{size}" if size else ""
    assert flag(rfa, "--save-dir").endswith(f"/checkpoints/rfa_gate{suffix}")
    assert flag(softmax, "--save-dir").endswith(f"/checkpoints/softmax{suffix}")
    # apart from the architecture, the --rfa-* flags (and translation's --cross-attention rfa, the paper's) and the
    # run folder, the commands are the same
    assert without_rfa(softmax) == without_rfa(rfa)


def without_rfa(cmd):
    out, i = [], 0
    while i < len(cmd):
        if cmd[i].startswith("--rfa-") or cmd[i] == "--cross-attention":
            i += 2 if i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else 1
            continue
        out.append("ARCH" if i and cmd[i - 1] == "--arch" else "DIR" if i and cmd[i - 1] == "--save-dir" else cmd[i])
        i += 1
    return out


def test_small_language_model_dimensions_for_every_variant(work):
    """SIZE=small gives softmax and RFA the same 6 x 512 model; the plugin's small architecture
    has the same dimensions of its own."""
    dims = {"--decoder-layers": "6", "--decoder-embed-dim": "512", "--decoder-input-dim": "512",
            "--decoder-output-dim": "512", "--decoder-ffn-embed-dim": "2048", "--decoder-attention-heads": "8"}
    for variant in ("softmax", "rfa", "rfa_gate"):
        cmd, _ = dry_run(work, "wikitext103", variant, SIZE="small")
        assert {k: flag(cmd, k) for k in dims} == dims
    big, _ = dry_run(work, "wikitext103", "rfa")
    assert "--decoder-layers" not in big
    from argparse import Namespace

    from rfa_fairseq.models.rfa_transformer_lm import rfa_transformer_lm_wiki103_small
    args = Namespace()
    rfa_transformer_lm_wiki103_small(args)
    assert (args.decoder_layers, args.decoder_embed_dim, args.decoder_ffn_embed_dim, args.decoder_attention_heads,
            args.decoder_input_dim, args.decoder_output_dim) == (6, 512, 2048, 8, 512, 512)


def test_language_model_cosine_period_follows_max_update(work):
    """No fixed --lr-period-updates: fairseq derives max_update - warmup, so MAX_UPDATE=N anneals by N."""
    cmd, _ = dry_run(work, "wikitext103", "rfa", MAX_UPDATE="50000")
    assert "--lr-period-updates" not in cmd and flag(cmd, "--max-update") == "50000"
    assert flag(cmd, "--lr-scheduler") == "cosine"


@pytest.mark.parametrize("variant,flags", [
    ("rfa", []),
    ("rfa_gate", ["--rfa-gate"]),
    ("rfa_gate_paper", ["--rfa-gate", "--rfa-gate-form", "convex", "--rfa-gate-bias", "0"]),
    ("rfa_arccos", ["--rfa-kernel", "arccos"]),
    ("rfa_gate_arccos", ["--rfa-kernel", "arccos", "--rfa-gate"]),
    ("rfa_elu", ["--rfa-kernel", "elu"]),
    ("rfa_favor", ["--rfa-kernel", "favor"]),
])
def test_variants_have_their_flags_and_their_own_run(work, variant, flags):
    cmd, _ = dry_run(work, "wmt14_en_de", variant)
    i = cmd.index("rfa_transformer_wmt_en_de") + 1
    assert cmd[i:cmd.index("--share-all-embeddings")] == \
        ["--rfa-causal-feature-dim", "64", "--rfa-cross-feature-dim", "128", "--cross-attention", "rfa"] + flags
    assert flag(cmd, "--save-dir").endswith(f"/checkpoints/{variant}")
    custom, _ = dry_run(work, "wmt14_en_de", variant, RUN="my-ablation.1")
    assert flag(custom, "--save-dir").endswith("/checkpoints/my-ablation.1")


@pytest.mark.parametrize("env,message", [
    ({"SIZE": "huge"}, "SIZE must be one of: big small"),
    ({"RUN": "../elsewhere"}, "RUN (the run name) may hold"),
    ({"WORLD_SIZE": "two"}, "the number of GPUs must be a positive integer"),
])
def test_bad_settings_are_refused_by_name(work, env, message):
    code, out = dry_run(work, "wikitext103", "rfa", check=False, **env)
    assert code != 0 and message in out


@pytest.mark.parametrize("task,size", sorted(REFERENCE_TOKENS), ids=lambda v: str(v))
@pytest.mark.parametrize("world", [1, 3, 8, 16])
def test_update_keeps_the_reference_batch_on_any_gpu_count(work, task, size, world):
    cmd, log = dry_run(work, task, "rfa", SIZE=size, WORLD_SIZE=str(world))
    max_tokens, update_freq = int(flag(cmd, "--max-tokens")), int(flag(cmd, "--update-freq"))
    ref = REFERENCE_TOKENS[task, size]
    if task == "wikitext103":
        assert max_tokens % 512 == 0  # whole 512-token blocks
    tokens = world * update_freq * max_tokens
    if abs(tokens - ref) <= 0.05 * ref:
        assert "WARNING" not in log
    else:
        # only IWSLT's one-GPU reference cannot be split over many GPUs (1,024 tokens per GPU at least)
        assert task == "iwslt14_de_en" and world >= 8, (tokens, ref)
        assert "WARNING" in log and "the reference batch of 4096" in log


def test_distributed_world_size_flag_counts_as_the_gpu_count(work):
    cmd, log = dry_run(work, "wmt14_en_de", "rfa", "--distributed-world-size", "4", WORLD_SIZE="")
    assert "batch: 4 GPU(s)" in log and flag(cmd, "--update-freq") == "2" and flag(cmd, "--max-tokens") == "4096"


def test_user_batch_is_kept_with_a_warning_when_off_the_reference(work):
    cmd, log = dry_run(work, "wmt14_en_de", "rfa", UPDATE_FREQ="1", WORLD_SIZE="1")
    assert flag(cmd, "--update-freq") == "1" and flag(cmd, "--max-tokens") == "32768"
    cmd, log = dry_run(work, "wmt14_en_de", "rfa", UPDATE_FREQ="2", MAX_TOKENS="4096", WORLD_SIZE="1")
    assert flag(cmd, "--update-freq") == "2" and "WARNING" in log and "0.25x the reference" in log


def test_batch_plan_rejects_bad_input():
    plan = load_tool("batch_plan").plan
    with pytest.raises(ValueError, match="world"):
        plan(8, 4096, 0)
    with pytest.raises(ValueError, match="multiple of unit"):
        plan(24, 3000, 1, unit=512)
    with pytest.raises(ValueError, match="UPDATE_FREQ"):
        plan(8, 4096, 1, update_freq=0)


# ---------------------------------------------------------------- hydra configs against train.sh

HYDRA_CASES = [
    # (task, config, train.sh variant, SIZE)
    ("iwslt14_de_en", "softmax", "softmax", None), ("iwslt14_de_en", "rfa_gate_paper", "rfa_gate_paper", None),
    ("wmt14_en_de", "rfa", "rfa", None), ("wmt14_en_de", "rfa_gate", "rfa_gate", None),
    ("wmt14_en_fr", "softmax", "softmax", None), ("wmt14_en_fr", "rfa_gate", "rfa_gate", None),
    ("wikitext103", "rfa_gate", "rfa_gate", None), ("wikitext103", "softmax_small", "softmax", "small"),
    ("wikitext103", "rfa_small", "rfa", "small"), ("wikitext103", "rfa_gate_paper", "rfa_gate_paper", None),
]


@pytest.mark.filterwarnings("ignore:.*deprecated keyword in package header")  # fairseq's own configs use it
@pytest.mark.parametrize("task,config,variant,size", HYDRA_CASES, ids=lambda v: str(v))
def test_hydra_config_matches_train_sh(work, task, config, variant, size):
    """The hydra configs hold the command of train.sh on the GPUs their update_freq is for (IWSLT's
    batch is one GPU's, the others' eight)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(RECIPES, task, "config"), version_base="1.1"):
        cfg = compose(config_name=config)
    gpus = "1" if task == "iwslt14_de_en" else "8"
    cmd, _ = dry_run(work, task, variant, WORLD_SIZE=gpus, **({"SIZE": size} if size else {}))
    assert cfg.optimization.max_update == int(flag(cmd, "--max-update"))
    assert cfg.optimization.lr[0] == float(flag(cmd, "--lr"))
    assert cfg.optimization.update_freq == [int(flag(cmd, "--update-freq"))]
    assert cfg.dataset.max_tokens == int(flag(cmd, "--max-tokens"))
    assert cfg.lr_scheduler.warmup_updates == int(flag(cmd, "--warmup-updates"))
    assert cfg.common.fp16 is True  # train.sh passes --fp16 on a GPU
    model = cfg.model
    assert bool(model.get("rfa_gate", False)) == ("--rfa-gate" in cmd)
    if "--rfa-gate-form" in cmd:
        assert model.rfa_gate_form == flag(cmd, "--rfa-gate-form")
        assert float(model.rfa_gate_bias) == float(flag(cmd, "--rfa-gate-bias"))
    if task == "wikitext103":
        assert cfg.lr_scheduler.lr_period_updates == -1 and "--lr-period-updates" not in cmd
        assert model._name == ("transformer_lm" if variant == "softmax" else "rfa_transformer_lm")
        for field in ("decoder_layers", "decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_attention_heads"):
            name = "--" + field.replace("_", "-")
            expected = int(flag(cmd, name)) if name in cmd else {"decoder_layers": 16, "decoder_embed_dim": 1024,
                                                                 "decoder_ffn_embed_dim": 4096,
                                                                 "decoder_attention_heads": 8}[field]
            assert model[field] == expected, field
    else:
        assert model._name == flag(cmd, "--arch")
        assert model.dropout == float(flag(cmd, "--dropout"))
        for field in ("share_all_embeddings", "share_decoder_input_output_embed"):
            assert bool(model.get(field, False)) == ("--" + field.replace("_", "-") in cmd), field


# ---------------------------------------------------------------- downloads and unpacking

def common_sh(script, tmp_path, path=None):
    env = dict(os.environ, RAW_DIR=str(tmp_path))
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["/bin/bash", "-c", f". {shlex.quote(os.path.join(RECIPES, 'common.sh'))}\n{script}"],
                          env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))


def test_fetch_finds_a_gzipped_member_and_names_a_missing_one(tmp_path):
    """giga-fren's .tar holds .gz files: fetch must count CHECK.gz as CHECK after unpacking."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "corpus.en").write_text("hello\n")
    subprocess.run(["gzip", str(src / "corpus.en")], check=True)
    subprocess.run(["tar", "-cf", str(tmp_path / "giga.tar"), "-C", str(src), "corpus.en.gz"], check=True)
    proc = common_sh("fetch giga.tar corpus.en http://unused.invalid/giga.tar && cat_text \"$RAW_DIR/corpus.en\"",
                     tmp_path)
    assert proc.returncode == 0 and proc.stdout == "hello\n", proc.stderr
    subprocess.run(["tar", "-cf", str(tmp_path / "other.tar"), "-C", str(src), "corpus.en.gz"], check=True)
    proc = common_sh("fetch other.tar missing.en http://unused.invalid/other.tar", tmp_path)
    assert proc.returncode != 0 and "other.tar did not contain missing.en" in proc.stderr


def test_download_without_wget_or_curl_says_so(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("dirname", "basename", "date", "mkdir"):
        os.symlink(subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True,
                                  check=True).stdout.strip(), tools / tool)
    proc = common_sh("fetch data.tgz data/file.txt http://example.invalid/data.tgz", tmp_path, path=str(tools))
    assert proc.returncode != 0
    assert "neither wget nor curl is installed" in proc.stderr and "http://example.invalid/data.tgz" in proc.stderr


# ---------------------------------------------------------------- BLEU tool

def test_tokenised_bleu_uses_the_moses_tokeniser():
    """Moses splits English clitics and punctuation, which sacreBLEU's 13a tokeniser does not."""
    score_bleu = load_tool("score_bleu")
    tokenise = score_bleu.moses_tokeniser("en")
    assert tokenise("I don't know, it's \"fine\".") == "I don 't know , it 's \" fine \" ."
    assert score_bleu.compound_split(tokenise("a well-known fact.")) == "a well ##AT##-##AT## known fact ."


def test_tokenised_bleu_needs_the_language(tmp_path, capsys):
    (tmp_path / "h").write_text("a b\n")
    with pytest.raises(SystemExit):
        load_tool("score_bleu").main(["--hyp", str(tmp_path / "h"), "--ref", str(tmp_path / "h"), "--tokenised"])
    assert "--lang" in capsys.readouterr().err


def test_compound_splitting_follows_fairseq_convention():
    """tools/score_bleu.py splits hyphens as perl's s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g does."""
    score_bleu = load_tool("score_bleu")
    assert score_bleu.compound_split("Café-Liebhaber") == "Café ##AT##-##AT## Liebhaber"
    assert score_bleu.compound_split("a-b-c - d") == "a ##AT##-##AT## b-c - d"  # non-overlapping, as perl


# ---------------------------------------------------------------- bash 4.3

# Arrays the scripts always fill; every other array expansion must be guarded as ${A[@]+"${A[@]}"}
# (bash < 4.4 with set -u fails on "${A[@]}" of an empty array).
NEVER_EMPTY = {"RUN_ARGS", "TEST_SETS", "ARCHIVES", "CORPORA", "URLS", "GENERATE_FLAGS", "args", "pids", "runs",
               "models", "DOC_ARGS"}


def test_possibly_empty_arrays_are_expanded_safely_for_bash_4_3():
    unguarded = re.compile(r'(?<!\[@\]\+)"\$\{(\w+)\[@\]\}"')
    offenders = []
    for folder, _, files in os.walk(RECIPES):
        for name in files:
            if name.endswith(".sh"):
                path = os.path.join(folder, name)
                for n, line in enumerate(open(path, encoding="utf-8"), 1):
                    if not line.lstrip().startswith("#"):
                        offenders += [f"{os.path.relpath(path, REPO)}:{n}: {m.group(1)}"
                                      for m in unguarded.finditer(line) if m.group(1) not in NEVER_EMPTY]
    assert not offenders, offenders
