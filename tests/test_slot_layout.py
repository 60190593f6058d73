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
from impl.checkpoint import save_checkpoint
from impl.decoding import dflash_decode
from impl.model import DFlashDrafter
from impl.offline import load_or_build_cache
from impl.spec import Recipe, SpecError
from impl.train_step import trained_layout
from impl.zlab_format import save_zlab_dir
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
    from impl.errors import AuditError

    save_checkpoint(tmp_path / "ours.pt", drafter(True), recipe=Recipe(sample_from_anchor=True))
    with pytest.raises(AuditError, match="sample_from_anchor = True"):
        convert_for(tmp_path / "ours.pt", tmp_path / "served", engine, target=target_dir)
    assert not (tmp_path / "served").exists()


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
    from impl.checkpoint import load_checkpoint
    from impl.train import train_drafter
    from tests.helpers import TEXTS

    stats = train_drafter(tiny_world / "target", TEXTS, tmp_path / "anchor.pt", steps=2, seq_len=48, block_size=4,
                          max_anchors=6, target_layer_ids=[0, 1, 2], batch_size=2, lr=3e-3, warmup=2,
                          eval_sequences=2, progress=False, sample_from_anchor=True)
    ckpt = load_checkpoint(tmp_path / "anchor.pt")
    assert ckpt.spec.sample_from_anchor and ckpt.recipe.sample_from_anchor
    assert len(stats["evals"][-1]["position_acc"]) == 4  # every slot proposes: four accuracies for B = 4
