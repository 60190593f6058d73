"""`compare --target`: the drafters' mask token and vocabulary held to the target's (`mask_token_validity` #34,
`vocab_sizes` #36). The target is a tiny random Qwen3 whose embedding has 320 rows for a 258-token tokenizer (a
padded vocabulary; eos = pad = 0), with row 319 zeroed like an untrained padding row."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_audit.audit.sides import load_side
from dflash_audit.audit.static import static_audit
from dflash_audit.cli import main
from dflash_world.tokenizer import train_tokenizer
from foundation.target_vocab import TargetVocabulary, embedding_tensor, row_norms
from drafter_files.checkpoint import save_checkpoint
from impl.model import DFlashDrafter
from drafter_files.zlab_format import save_zlab_dir
from tests.helpers import TEXTS, tiny_spec, tiny_target

ROWS, PADDING_ROW = 320, 319


@pytest.fixture(scope="module")
def padded_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("padded-target")
    tokenizer = train_tokenizer(TEXTS, vocab_size=64)  # the byte alphabet + eos + mask: 258 tokens
    assert len(tokenizer) == 258 and tokenizer.eos_token_id == tokenizer.pad_token_id == 0
    model = tiny_target(vocab=ROWS)
    with torch.no_grad():
        model.get_input_embeddings().weight[PADDING_ROW] = 0.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def drafters(tmp_path, ours: dict, ref: dict | None = None):
    """Our checkpoint and a z-lab reference directory, `tiny_spec` with the overrides given."""
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ours.pt", DFlashDrafter(tiny_spec(**ours)))
    torch.manual_seed(1)
    reference = DFlashDrafter(tiny_spec(**(ref if ref is not None else ours)))
    save_zlab_dir(tmp_path / "ref", reference.spec, reference.state_dict())
    return tmp_path / "ours.pt", tmp_path / "ref"


def compare(tmp_path, target, ours: dict, ref: dict | None = None, *flags: str):
    ours_path, ref_path = drafters(tmp_path, ours, ref)
    out = tmp_path / "out"
    status = main(["compare", "--ours", str(ours_path), "--ref", str(ref_path), "--target", str(target),
                   "--out", str(out), *flags])
    return status, json.loads((out / "report.json").read_text())


def found(report, *severities):
    return sorted((f["component"], f["key"]) for f in report["findings"] if f["severity"] in severities
                  and f["component"] in ("mask_token_validity", "vocab_sizes", "mask_token", "architecture"))


def one(report, component, key):
    return next(f for f in report["findings"] if f["component"] == component and f["key"] == key)


def test_mask_id_equal_to_eos_is_one_divergence(tmp_path, padded_target):
    status, report = compare(tmp_path, padded_target, dict(target_vocab_size=ROWS, mask_token_id=0), None, "--static-only")
    assert status == 1
    assert found(report, "divergence") == [("mask_token_validity", "mask token 0")]  # both drafters: one root cause
    finding = one(report, "mask_token_validity", "mask token 0")
    assert finding["pitfall"] == 34 and "is the target's eos and pad token" in finding["message"]
    assert finding["ours"]["problems"] == ["special"] and finding["ours"]["looks_trained"] is True
    assert found(report, "warning", "info") == [("vocab_sizes", "target padding")]
    assert report["target_vocabulary"]["special_ids"] == {"eos": [0], "pad": [0], "bos": []}


def test_mask_id_outside_the_embedding(tmp_path, padded_target):
    """A drafter built for a vocabulary of 400 with mask 399: its vocabulary and its mask id are two findings
    (each field must change); the drafters' equal vocab_size gives no architecture finding; τ is not measured
    (each side says why), never a traceback."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "def add(x, y):"}) + "\n")
    status, report = compare(tmp_path, padded_target, dict(target_vocab_size=400, mask_token_id=399), None,
                             "--prompts", str(prompts), "--max-new-tokens", "4")
    assert status == 1
    assert found(report, "divergence") == [("mask_token_validity", "mask token 399"),
                                          ("vocab_sizes", "draft vocabulary 400")]
    mask = one(report, "mask_token_validity", "mask token 399")
    assert "outside the target's vocabulary and embedding of 320 rows" in mask["message"]
    assert mask["ours"]["row_norm"] is None  # no row to measure
    assert report["tau"]["not_measured"] == dict.fromkeys(("ours", "ref"), "vocabulary of 400 but the target's is 320")


def test_padded_target_with_a_matching_drafter_is_info_only(tmp_path, padded_target):
    status, report = compare(tmp_path, padded_target, dict(target_vocab_size=ROWS, mask_token_id=PADDING_ROW), None,
                             "--static-only")
    assert status == 0 and found(report, "divergence", "warning") == []
    assert found(report, "info") == [("mask_token_validity", "mask token 319"), ("vocab_sizes", "target padding")]
    padding = one(report, "vocab_sizes", "target padding")
    assert "320 rows" in padding["message"] and "258 tokenizer tokens" in padding["message"]
    mask = one(report, "mask_token_validity", "mask token 319")
    assert mask["ours"]["row_norm"] == 0.0 and mask["ours"]["looks_trained"] is False
    assert "looks untrained" in mask["message"] and "padding row past the tokenizer's 258 tokens" in mask["message"]


def test_head_sized_to_the_tokenizer_is_the_vocab_sizes_root_cause(tmp_path, padded_target):
    """Ours built for the tokenizer's 258 tokens, ref for the padded 320: one vocab_sizes divergence for ours, and
    no second architecture finding for the drafters' differing vocab_size."""
    ours, ref = drafters(tmp_path, dict(target_vocab_size=258, mask_token_id=200), dict(target_vocab_size=ROWS, mask_token_id=200))
    target = TargetVocabulary.read(padded_target, train_tokenizer(TEXTS, vocab_size=64))
    findings = static_audit(load_side(ours), load_side(ref), target=target).findings
    divergences = [(f.component, f.key) for f in findings if f.severity == "divergence"]
    assert divergences == [("vocab_sizes", "draft vocabulary 258")]
    finding = next(f for f in findings if f.component == "vocab_sizes" and f.severity == "divergence")
    assert finding.ours == {"draft_head_rows": 258, "target_vocab_size": 258} and finding.ref is None
    assert "the tokenizer's length, not the target's padded vocabulary" in finding.message
    # Without a target the same pair is the architecture finding it always was.
    plain = static_audit(load_side(ours), load_side(ref)).findings
    assert [(f.component, f.key) for f in plain if f.severity == "divergence"] == [("architecture", "target_vocab_size")]


def test_bos_and_unknowns_are_read_never_guessed(tmp_path, padded_target):
    """A bos id declared in config.json counts; with no tokenizer its length is unknown, so no padding is claimed."""
    config = json.loads((padded_target / "config.json").read_text())
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({**config, "bos_token_id": 200}))
    (target / "model.safetensors").symlink_to(padded_target / "model.safetensors")
    vocab = TargetVocabulary.read(target)
    assert vocab.tokenizer_length is None and vocab.padding is None and vocab.special_ids == {
        "eos": [], "pad": [], "bos": [200]}
    ours, ref = drafters(tmp_path, dict(target_vocab_size=ROWS, mask_token_id=200))
    findings = static_audit(load_side(ours), load_side(ref), target=vocab).findings
    assert [(f.component, f.severity) for f in findings if f.component in ("vocab_sizes", "mask_token_validity")] \
        == [("mask_token_validity", "divergence")]
    mask = next(f for f in findings if f.component == "mask_token_validity")
    assert "is the target's bos token" in mask.message and "no eos, pad or bos" not in mask.message


def test_row_norms_stream_the_embedding_in_slices(padded_target, monkeypatch):
    import foundation.target_vocab

    embedding = embedding_tensor(padded_target)
    whole = row_norms(embedding, [3, PADDING_ROW, ROWS])
    monkeypatch.setattr(foundation.target_vocab, "ROWS_PER_SLICE", 7)  # 46 slices, the last one short
    assert row_norms(embedding, [3, PADDING_ROW, ROWS]) == whole and set(whole) == {3, PADDING_ROW}
    weights = tiny_target(vocab=ROWS).get_input_embeddings().weight.detach().clone()
    weights[PADDING_ROW] = 0.0
    assert whole[3].median == pytest.approx(float(weights.norm(dim=-1).median()), rel=1e-6)


def test_eval_says_when_the_mask_id_is_the_targets_eos(tmp_path, padded_target, capsys):
    """eval still measures τ (the drafter is what it is) but names the clash, once."""
    ours, _ = drafters(tmp_path, dict(target_vocab_size=ROWS, mask_token_id=0))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "def add(x, y):"}) + "\n")
    assert main(["eval", "--drafter", str(ours), "--target", str(padded_target), "--prompts", str(prompts),
                 "--max-new-tokens", "4"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("mask token 0 is the target's eos and pad token (PITFALLS #34") == 1


def test_the_report_carries_the_size_table(tmp_path, padded_target):
    _, report = compare(tmp_path, padded_target, dict(target_vocab_size=258, mask_token_id=200), None, "--static-only")
    table = report["target_vocabulary"]
    assert (table["config_vocab_size"], table["tokenizer_length"], table["embedding_rows"]) == (ROWS, 258, ROWS)
    assert table["drafters"] == {side: {"draft_head_rows": 258, "target_vocab_size": 258} for side in ("ours", "ref")}
    html = (tmp_path / "out" / "index.html").read_text()
    assert "Vocabulary sizes" in html and "len(tokenizer)" in html


def test_without_a_target_nothing_is_claimed(tmp_path):
    ours, ref = drafters(tmp_path, dict(target_vocab_size=ROWS, mask_token_id=0))
    assert main(["compare", "--ours", str(ours), "--ref", str(ref), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert not [f for f in report["findings"] if f["component"] in ("mask_token_validity", "vocab_sizes")]
    assert "target_vocabulary" not in report and any("not held to a target" in note for note in report["notes"])


def test_no_safetensors_embedding_leaves_the_row_unknown(tmp_path, padded_target):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text((padded_target / "config.json").read_text())
    vocab = TargetVocabulary.read(target)
    assert vocab.embedding_rows is None and vocab.padded_size == ROWS  # the config's vocab_size still counts
    ours, ref = drafters(tmp_path, dict(target_vocab_size=ROWS, mask_token_id=PADDING_ROW))
    mask = next(f for f in static_audit(load_side(ours), load_side(ref), target=vocab).findings
                if f.component == "mask_token_validity")
    assert mask.severity == "info" and mask.ours["looks_trained"] is None
    assert "whether its row looks trained is unknown" in mask.message


def reduced(vocab: int, seed: int) -> DFlashDrafter:
    """A reduced draft vocabulary of 48 target ids (its map is well formed: #32 has nothing to say)."""
    from impl.vocab_mapping import d2t_from_target_ids

    torch.manual_seed(seed)
    drafter = DFlashDrafter(tiny_spec(target_vocab_size=vocab, mask_token_id=200, draft_vocab_size=48))
    drafter.set_vocab_mapping(d2t_from_target_ids(list(range(0, 96, 2))), tiny_target(vocab=vocab).lm_head)
    return drafter


@pytest.mark.parametrize("vocab, expected", [(ROWS, []), (258, [("vocab_sizes", "draft vocabulary 258")])])
def test_a_reduced_head_is_held_to_the_vocabulary_it_maps_into(tmp_path, padded_target, vocab, expected):
    """48 draft rows are the reduced vocabulary's business (draft_vocab); the vocabulary they map into must be the
    target's padded one."""
    save_checkpoint(tmp_path / "ours.pt", reduced(vocab, 0))
    save_checkpoint(tmp_path / "ref.pt", reduced(vocab, 1))
    target = TargetVocabulary.read(padded_target, train_tokenizer(TEXTS, vocab_size=64))
    findings = static_audit(load_side(tmp_path / "ours.pt"), load_side(tmp_path / "ref.pt"), target=target).findings
    assert [(f.component, f.key) for f in findings if f.severity == "divergence"] == expected
    if expected:
        finding = next(f for f in findings if f.component == "vocab_sizes" and f.severity == "divergence")
        assert "a reduced draft head of 48 rows mapped into a vocabulary of 258" in finding.message
        assert finding.ours == {"draft_head_rows": 48, "target_vocab_size": 258}
