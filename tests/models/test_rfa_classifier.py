"""The ``rfa_classifier`` model, built through fairseq's own parser and ``sentence_prediction``
task: padding invariance of the pooled output for every attention and pooling, the split of
two-document rows, the checkpoint round trip, the architectures and the flag errors."""
import pytest
import torch

from rfa_test_utils import build_from_cli, random_tokens, write_dict

ATTENTIONS = ("softmax", "rfa", "favor", "lara")
TINY = ["--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
        "--encoder-attention-heads", "4", "--dropout", "0.0", "--attention-dropout", "0.0"]


def attention_flags(kind):
    return {"rfa": ["--encoder-feature-dim", "16"], "favor": ["--encoder-feature-dim", "16"],
            "lara": ["--lara-landmarks", "4"]}.get(kind, [])


@pytest.fixture
def classifier(tmp_path):
    """factory(*extra) -> (task, model) for a tiny rfa_classifier in eval mode (vocab 30, 3 classes)."""
    (tmp_path / "input0").mkdir()
    (tmp_path / "label").mkdir()
    write_dict(tmp_path / "input0" / "dict.txt", 26)
    write_dict(tmp_path / "label" / "dict.txt", 3)

    def make(*extra, arch="rfa_classifier", seed=0):
        torch.manual_seed(seed)
        task, model, _ = build_from_cli(tmp_path, ["--task", "sentence_prediction", "--num-classes", "3",
                                                   "--max-positions", "64", "--criterion", "sentence_prediction",
                                                   "--arch", arch, *TINY, *extra])
        return task, model.eval()

    return make


def make_rows(dictionary, lengths, pairs=False, cls=True, generator=None):
    """Right-padded rows as sentence_prediction builds them: [<s>] doc </s> ([<s>] doc2 </s>)."""
    rows = []
    for n in lengths:
        parts = [random_tokens(dictionary, 1, n, generator)[0]]
        if pairs:
            parts.append(random_tokens(dictionary, 1, max(1, n // 2 + 1), generator)[0])
        row = []
        for p in parts:
            row += ([dictionary.bos()] if cls else []) + p.tolist() + [dictionary.eos()]
        rows.append(torch.tensor(row))
    return rows


def pad_rows(rows, pad, width=None):
    width = width or max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("kind", ATTENTIONS)
def test_pooled_output_ignores_padding(classifier, kind, pooling):
    """Each example's pooled vector (and logits) is the same alone and in a padded batch with
    extra padding columns: padding is excluded from the keys, the values and the mean."""
    task, model = classifier("--encoder-attention", kind, "--classifier-pooling", pooling, *attention_flags(kind))
    d = task.source_dictionary
    rows = make_rows(d, [5, 17, 9], cls=True, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        batch = pad_rows(rows, d.pad(), width=30)
        together, _ = model(batch)
        logits, extra = model(batch, classification_head_name="sentence_classification_head")
        for i, r in enumerate(rows):
            alone, _ = model(r.unsqueeze(0))
            torch.testing.assert_close(together[i], alone[0], rtol=1e-5, atol=1e-5)
    assert logits.shape == (3, 3) and torch.equal(extra["pooled"], together)
    # the pooled vectors differ between examples (the check above could not pass on a constant)
    assert (together[0] - together[1]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ATTENTIONS)
def test_dual_head_ignores_padding_and_reads_both_documents(classifier, kind):
    task, model = classifier("--classifier-head", "dual", "--encoder-attention", kind, *attention_flags(kind))
    d = task.source_dictionary
    rows = make_rows(d, [4, 12, 7], pairs=True, generator=torch.Generator().manual_seed(2))
    head = "sentence_classification_head"
    with torch.no_grad():
        together, _ = model(pad_rows(rows, d.pad(), width=40), classification_head_name=head)
        for i, r in enumerate(rows):
            torch.testing.assert_close(together[i], model(r.unsqueeze(0), classification_head_name=head)[0][0],
                                       rtol=1e-5, atol=1e-5)
        # changing only the second document changes the prediction
        changed = rows[0].clone()
        changed[-2] = d.nspecial if changed[-2] != d.nspecial else d.nspecial + 1
        assert not torch.allclose(model(changed.unsqueeze(0), classification_head_name=head)[0][0], together[0])


def test_split_pairs():
    from rfa_fairseq.models.rfa_classifier import split_pairs

    pad, eos = 1, 2
    src = torch.tensor([[0, 5, 6, 2, 0, 7, 2, 1, 1],
                        [0, 8, 2, 0, 9, 9, 9, 9, 2]])
    first, second = split_pairs(src, eos, pad)
    assert first.tolist() == [[0, 5, 6, 2], [0, 8, 2, 1]]
    assert second.tolist() == [[0, 7, 2, 1, 1, 1], [0, 9, 9, 9, 9, 2]]
    with pytest.raises(ValueError, match="two documents per example"):
        split_pairs(torch.tensor([[0, 5, 2, 1]]), eos, pad)


def test_cls_pooling_needs_the_init_token(classifier):
    task, model = classifier("--classifier-pooling", "cls")
    d = task.source_dictionary
    with pytest.raises(ValueError, match="--init-token 0"):
        model(make_rows(d, [5], cls=False)[0].unsqueeze(0))


@pytest.mark.parametrize("kind", ATTENTIONS)
def test_checkpoint_round_trip(classifier, tmp_path, kind):
    """A saved state dict (random matrices included) loads into a model built afresh from another
    seed and gives the same logits."""
    task, model = classifier("--encoder-attention", kind, *attention_flags(kind))
    d = task.source_dictionary
    batch = pad_rows(make_rows(d, [6, 11]), d.pad())
    head = "sentence_classification_head"
    with torch.no_grad():
        before, _ = model(batch, classification_head_name=head)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    _, other = classifier("--encoder-attention", kind, *attention_flags(kind), seed=5)
    with torch.no_grad():
        assert not torch.allclose(other(batch, classification_head_name=head)[0], before)
        other.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
        torch.testing.assert_close(other(batch, classification_head_name=head)[0], before)


@pytest.mark.parametrize("arch,dim,heads,ffn,head", [
    ("rfa_classifier_lra_listops", 512, 8, 1024, "single"),
    ("rfa_classifier_lra_text", 256, 4, 1024, "single"),
    ("rfa_classifier_lra_retrieval", 128, 4, 512, "dual"),
])
def test_lra_architectures(tmp_path, arch, dim, heads, ffn, head):
    from fairseq import options

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=[str(tmp_path), "--user-dir", "rfa_fairseq", "--task",
                                                           "sentence_prediction", "--num-classes", "2", "--arch", arch])
    assert (args.encoder_layers, args.encoder_embed_dim, args.encoder_attention_heads,
            args.encoder_ffn_embed_dim) == (4, dim, heads, ffn)
    assert args.classifier_head == head and args.classifier_pooling == "cls" and args.encoder_normalize_before
    assert args.encoder_attention == "softmax" and not args.encoder_learned_pos


@pytest.mark.parametrize("extra,message", [
    (["--encoder-attention", "lara", "--encoder-feature-dim", "8"], "--encoder-feature-dim"),
    (["--encoder-attention", "rfa", "--lara-landmarks", "8"], "--lara-landmarks"),
    (["--encoder-attention-heads", "5"], "--encoder-attention-heads"),
    (["--classifier-mlp-dim", "-1"], "--classifier-mlp-dim"),
])
def test_bad_flags_are_named(classifier, extra, message):
    with pytest.raises(ValueError, match=message):
        classifier(*extra)


def test_learned_positions_and_mlp_dim(classifier):
    _, model = classifier("--encoder-learned-pos", "--classifier-mlp-dim", "48")
    assert type(model.encoder.embed_positions).__name__ == "LearnedPositionalEmbedding"
    assert model.classification_heads["sentence_classification_head"].mlp[0].out_features == 48


def test_checkpoint_heads_missing_from_the_model_are_registered(classifier):
    """A state dict with a head the model was not built with (another --classification-head-name)
    loads strictly: the head is registered with its saved class count and MLP size."""
    _, model = classifier("--classifier-mlp-dim", "24")
    model.register_classification_head("other", num_classes=5, inner_dim=12)
    state = model.state_dict()
    _, fresh = classifier("--classifier-mlp-dim", "24")
    assert "other" not in fresh.classification_heads
    fresh.load_state_dict(state)  # fairseq's load_state_dict runs upgrade_state_dict first
    assert fresh.classification_heads["other"].out_proj.out_features == 5
    assert fresh.classification_heads["other"].mlp[0].out_features == 12
