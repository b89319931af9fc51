"""results/quality_study.py: the table it reports from recorded runs, and its refusals."""
import json

import pytest

from rfa_test_utils import load_script


def study():
    return load_script("results", "quality_study.py")


def record(variant, seed, valid, test, spu, threads=2):
    return {"variant": variant, "setting": "final", "seed": seed, "valid_bleu": valid, "test_bleu": test,
            "s_per_update": spu, "train_threads": threads}


def test_report_gives_mean_and_spread_over_seeds(tmp_path, capsys):
    out = tmp_path / "study.jsonl"
    rows = [record("rfa_gate", 1, 30.0, 29.0, 1.5), record("softmax", 1, 33.0, 32.0, 1.0),
            record("rfa_gate", 2, 31.0, 30.0, None), record("rfa_gate", 3, 32.0, 31.5, 2.5),
            record("rfa_gate", 4, 31.0, 30.5, 3.0, threads=1)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    study().main(["--report", "--out", str(out)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| final")]
    # softmax first (the order of VARIANTS), then RFA-Gate over its four seeds; the time per
    # update averages the runs that have one, per number of training threads
    assert lines == ["| final | softmax | 1 | 33.00 | 32.00 | 1.00 (2 thr) |",
                     "| final | rfa_gate | 1,2,3,4 | 31.00 | 30.25 (29.00-31.50) | 3.00 (1 thr); 2.00 (2 thr) |"]


def test_unknown_variant_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        study().main(["--variants", "rfa_gate", "gate_sideways"])
    assert "gate_sideways" in capsys.readouterr().err


def test_diagnostics_run_where_the_model_has_rfa_modules():
    """scripts/rfa_diagnostics.py reads RFA attention modules: an RFA decoder or an rfa / favor
    encoder; softmax and a LARA encoder behind fairseq's decoder have none."""
    q = study()
    assert [v for v in q.VARIANTS if not q.has_rfa_modules(v)] == ["softmax", "softdec_enc_lara"]
    assert q.VARIANTS["softdec_enc_rfa"][-2:] == ["--encoder-attention", "rfa"]
    assert "--decoder-attention" not in q.VARIANTS["enc_lara"] and "--rfa-gate" in q.VARIANTS["enc_lara"]


def test_every_variant_parses_with_fairseq_train_options():
    """Each variant's flags are accepted by fairseq-train's own parser, so no run of the queue
    fails on a misspelt option hours after it was started."""
    from fairseq import options
    q = study()
    for variant, flags in q.VARIANTS.items():
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(parser, ["data-bin", *flags])
        assert args.arch in ("transformer_iwslt_de_en", "rfa_transformer_iwslt_de_en"), variant
    f32 = options.parse_args_and_arch(options.get_training_parser(), ["data-bin", *q.VARIANTS["gate_softcross_f32"]])
    assert f32.rfa_causal_feature_dim == 32 and f32.rfa_gate
