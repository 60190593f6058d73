"""The slot layout (`DraftSpec.sample_from_anchor`, impl/slot_layout.py) end to end: every format records it and
converts it exactly, training refuses a recipe that contradicts it, decoding proposes from the layout's slots with
τ live = offline (DFlash and DDTree), and the audit reports a layout difference as one `slot_layout` finding."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dflash_audit.audit.sides import load_side
from dflash_audit.audit.static import static_audit
from dflash_audit.conversion import convert
from dflash_audit.formats import load_any
from drafter_files.checkpoint import save_checkpoint
from impl.decoding import dflash_decode
from impl.model import DFlashDrafter
from impl.offline import load_or_build_cache
from impl.recipe import Recipe
from impl.spec import SpecError
from impl.train_step import trained_layout
from drafter_files.zlab_format import save_zlab_dir
from tests.helpers import tiny_spec
from tests.test_offline import replay_against_live


def drafter(sample_from_anchor: bool, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(tiny_spec(sample_from_anchor=sample_from_anchor))


def divergences(result):
    return sorted((f.component, f.key) for f in result.findings if f.severity == "divergence")


def test_every_format_records_the_layout_and_convert_is_exact_both_ways(tmp_path, target_dir):
    from reference_adapters.speculators_adapter import load_speculators_model

    ours = drafter(True)
    save_checkpoint(tmp_path / "ours.pt", ours, recipe=Recipe(sample_from_anchor=True))
    convert(tmp_path / "ours.pt", tmp_path / "zlab", "zlab")
    zlab_config = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert zlab_config["dflash_config"]["sample_from_anchor"] is True  # where vLLM reads it from a z-lab dir
    convert(tmp_path / "zlab", tmp_path / "spec", "speculators", target=target_dir)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["sample_from_anchor"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == ours.spec.block_size
    assert load_speculators_model(tmp_path / "spec", target_dir).config.sample_from_anchor is True  # its own reader
    convert(tmp_path / "spec", tmp_path / "back.pt", "ours", target=target_dir)
    back = load_any(tmp_path / "back.pt")
    assert back.spec == ours.spec and back.spec.speculative_tokens == ours.spec.block_size
    assert all(torch.equal(back.state_dict[k], v) for k, v in ours.state_dict().items())
    # An anchor-as-bonus drafter's z-lab config says nothing new: it reads as z-lab's own.
    save_zlab_dir(tmp_path / "plain", drafter(False).spec, drafter(False).state_dict())
    assert "sample_from_anchor" not in json.loads((tmp_path / "plain" / "config.json").read_text())["dflash_config"]
    assert load_any(tmp_path / "plain").spec.speculative_tokens == ours.spec.block_size - 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_no_engine_serves_a_sample_from_anchor_drafter_as_dflash(tmp_path, target_dir, engine):
    from dflash_audit.conversion import convert_for
    from foundation.errors import AuditError

    save_checkpoint(tmp_path / "ours.pt", drafter(True), recipe=Recipe(sample_from_anchor=True))
    with pytest.raises(AuditError, match="sample_from_anchor = True"):
        convert_for(tmp_path / "ours.pt", tmp_path / "served", engine, target=target_dir)
    assert not (tmp_path / "served").exists()


def test_serve_check_reports_each_engines_layout_once(tmp_path, target_dir):
    """vLLM reads dflash_config.sample_from_anchor and its DFlash runner refuses it; SGLang's DFlash worker has no
    such setting and drafts the anchor-as-bonus way: one slot-layout finding per engine, no block-size one."""
    from serving_engines import TargetFacts
    from serving_engines.verdict import engine_report

    anchor = drafter(True)
    save_zlab_dir(tmp_path / "zlab", anchor.spec, anchor.state_dict())
    for engine, served in (("vllm", True), ("sglang", False)):
        report = engine_report(engine, str(tmp_path / "zlab"), anchor.spec, TargetFacts.read(target_dir))
        found = [(f.field, f.pitfall, f.served) for f in report.findings if f.severity == "divergence"]
        assert found == [("sample_from_anchor", 33, served)], engine


def test_drafters_that_differ_only_in_layout_are_one_slot_layout_finding(tmp_path):
    ours, ref = drafter(True), drafter(False)  # the same weights
    save_checkpoint(tmp_path / "ours.pt", ours, recipe=Recipe(sample_from_anchor=True))
    save_zlab_dir(tmp_path / "ref", ref.spec, ref.state_dict())
    result = static_audit(load_side(tmp_path / "ours.pt"), load_side(tmp_path / "ref"))
    assert divergences(result) == [("slot_layout", "sample_from_anchor")]
    assert [f for f in result.findings if f.severity == "warning"] == []
    assert [f.pitfall for f in result.findings if f.severity == "divergence"] == [33]


def test_a_recipe_that_trained_the_other_layout_is_a_slot_layout_finding(tmp_path):
    ours, ref = drafter(False), drafter(False)
    save_checkpoint(tmp_path / "ours.pt", ours, recipe=Recipe(sample_from_anchor=True))
    save_zlab_dir(tmp_path / "ref", ref.spec, ref.state_dict())
    result = static_audit(load_side(tmp_path / "ours.pt"), load_side(tmp_path / "ref"))
    assert divergences(result) == [("slot_layout", "trained layout (ours)")]


def test_training_refuses_a_recipe_that_contradicts_the_drafter():
    assert trained_layout(drafter(True), Recipe(sample_from_anchor=True)) is True
    with pytest.raises(SpecError, match="sample_from_anchor"):
        trained_layout(drafter(True), Recipe())


def test_offline_tau_equals_live_tau_under_both_layouts(trained_pair, test_world, tmp_path):
    trained, target, prompts, stop_ids = trained_pair
    prompts = prompts[:3]
    cache = load_or_build_cache(tmp_path, test_world.target, target, prompts, 48, stop_ids)
    # The trained weights under the sample-from-anchor layout: every slot proposes, B tokens per block.
    anchor = DFlashDrafter(dataclasses.replace(trained.spec, sample_from_anchor=True)).eval()
    anchor.load_state_dict(trained.state_dict())
    anchor.to(next(trained.parameters()).device)
    for model in (trained, anchor):
        mismatches, _ = replay_against_live([model], target, cache, prompts, stop_ids, max_new_tokens=48)
        assert mismatches == []
    live = dflash_decode(anchor, target, prompts[0][1], 48, stop_ids)
    assert max(live.acceptance_lengths) <= anchor.spec.block_size + 1


def test_the_trainer_trains_the_layout_it_writes(tiny_world, tmp_path):
    from dflash_audit.cli import main
    from drafter_files.checkpoint import load_checkpoint

    out, stats = tmp_path / "anchor.pt", tmp_path / "stats.json"
    assert main(["train", "--target", str(tiny_world / "target"), "--data", str(tiny_world / "data.jsonl"),
                 "--out", str(out), "--steps", "2", "--seq-len", "48", "--block-size", "4", "--fc-layers", "0,1,2",
                 "--batch-size", "2", "--max-anchors", "6", "--sample-from-anchor", "--json", str(stats)]) == 0
    ckpt = load_checkpoint(out)
    assert ckpt.spec.sample_from_anchor and ckpt.recipe.sample_from_anchor
    # Every slot proposes: four accuracies for B = 4.
    assert len(json.loads(stats.read_text())["evals"][-1]["position_acc"]) == 4


def test_a_foreign_declaration_of_the_layout_sets_the_drafter_and_its_recipe(tmp_path):
    ours = drafter(True)
    torch.save(ours.state_dict(), tmp_path / "drafter.pt")
    spec = ours.spec
    (tmp_path / "args.json").write_text(json.dumps({
        "target_layer_ids": list(spec.target_layer_ids), "num_target_layers": spec.num_target_layers,
        "mask_token_id": spec.mask_token_id, "block_size": spec.block_size, "vocab_size": spec.target_vocab_size,
        "layer_types": list(spec.layer_types), "sliding_window": spec.sliding_window, "sample_from_anchor": True}))
    loaded = load_any(tmp_path / "drafter.pt")
    assert loaded.spec == spec and loaded.recipe.sample_from_anchor is True
    undeclared = tmp_path / "quiet"
    undeclared.mkdir()
    torch.save(ours.state_dict(), undeclared / "drafter.pt")
    args = json.loads((tmp_path / "args.json").read_text())
    del args["sample_from_anchor"]
    (undeclared / "args.json").write_text(json.dumps(args))
    quiet = load_any(undeclared / "drafter.pt")  # both references' default, said to be one
    assert quiet.spec.sample_from_anchor is False and quiet.provenance["sample_from_anchor"].source == "default"


def test_a_speculators_directory_against_its_zlab_twin(tmp_path, target_dir):
    ours = drafter(True)
    save_checkpoint(tmp_path / "ours.pt", ours, recipe=Recipe(sample_from_anchor=True))
    convert(tmp_path / "ours.pt", tmp_path / "spec", "speculators", target=target_dir)  # speculators' save_pretrained
    save_zlab_dir(tmp_path / "twin", ours.spec, ours.state_dict())
    speculators_side = load_side(tmp_path / "spec", target_dir)
    assert divergences(static_audit(speculators_side, load_side(tmp_path / "twin"), expect_identical=True)) == []
    save_zlab_dir(tmp_path / "plain", drafter(False).spec, ours.state_dict())
    assert divergences(static_audit(speculators_side, load_side(tmp_path / "plain"))) == [
        ("slot_layout", "sample_from_anchor")]
