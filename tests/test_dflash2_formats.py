"""DFlash2 checkpoints: ours, z-lab and speculators directories, `convert` between them exactly, each
loadable by the reference's own `from_pretrained`, and what `compare` says of DFlash2 pairs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash_audit.audit.sides import load_side
from dflash_audit.audit.static import static_audit
from dflash_audit.cli import main
from dflash_audit.conversion import convert
from dflash_audit.formats import load_any
from drafter_files.checkpoint import save_checkpoint
from impl.model import DFlashDrafter
from drafter_files.zlab_format import save_zlab_dir
from tests.helpers import tiny_spec

DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
               sliding_window_non_causal=True)


def dflash2_drafter(seed: int = 0, **overrides) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(tiny_spec(**{**DFLASH2, **overrides}))
    with torch.no_grad():  # convolutions away from their identity initialization
        for name, parameter in model.named_parameters():
            if "_conv." in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def tensors_of(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def kinds(result, severity="divergence"):
    return sorted((f.component, f.key) for f in result.findings if f.severity == severity)


@pytest.mark.parametrize("non_causal", [True, False])
@pytest.mark.parametrize("via", ["zlab", "speculators"])
def test_dflash2_round_trip_through_each_format_is_bit_identical(tmp_path, target_dir, via, non_causal):
    model = dflash2_drafter(sliding_window_non_causal=non_causal)
    save_checkpoint(tmp_path / "ours.pt", model)
    convert(tmp_path / "ours.pt", tmp_path / via, via, target=target_dir)
    convert(tmp_path / via, tmp_path / "back.pt", "ours", target=target_dir)
    before, middle, after = load_any(tmp_path / "ours.pt"), load_any(tmp_path / via, target_dir), \
        load_any(tmp_path / "back.pt")
    assert before.spec.family == middle.spec.family == "dflash2"
    assert middle.spec == after.spec == before.spec
    assert before.state_dict.keys() == after.state_dict.keys()
    for key, tensor in before.state_dict.items():
        assert torch.equal(tensor, after.state_dict[key]), key


def test_each_reference_loads_our_dflash2_directories_with_their_own_from_pretrained(tmp_path, target_dir):
    from reference_adapters.speculators_adapter import DFlash2DraftModel as SpeculatorsDFlash2
    from reference_adapters.speculators_adapter import load_speculators_model
    from reference_adapters.zlab_adapter import load_zlab_model

    model = dflash2_drafter(seed=1)
    save_checkpoint(tmp_path / "ours.pt", model)
    convert(tmp_path / "ours.pt", tmp_path / "zlab", "zlab")
    convert(tmp_path / "ours.pt", tmp_path / "spec", "speculators", target=target_dir)
    zlab_model, spec_model = load_zlab_model(tmp_path / "zlab"), load_speculators_model(tmp_path / "spec")
    assert type(zlab_model).__name__ == "DFlash2DraftModel" and isinstance(spec_model, SpeculatorsDFlash2)
    zlab_state, spec_state = zlab_model.state_dict(), spec_model.state_dict()
    for key, tensor in model.state_dict().items():
        zlab_key = f"{key}.weight" if key.endswith("_codebook") else key  # z-lab's Embeddings
        assert torch.equal(zlab_state[zlab_key], tensor), key
        assert torch.equal(spec_state[key], tensor), key
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["speculators_model_type"] == "dflash2"
    config = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert "candidate_selector.predecessor_codebook" in tensors_of(tmp_path / "zlab")  # as z-lab's files name it


def test_a_speculators_dflash2_directory_against_its_zlab_twin_is_no_divergence(tmp_path, target_dir, capsys):
    model = dflash2_drafter(seed=2)
    save_zlab_dir(tmp_path / "zlab", model.spec, model.state_dict())
    convert(tmp_path / "zlab", tmp_path / "spec", "speculators", target=target_dir)
    result = static_audit(load_side(tmp_path / "spec", target_dir), load_side(tmp_path / "zlab"),
                          expect_identical=True)
    assert kinds(result) == [] and kinds(result, "warning") == []
    assert main(["compare", "--ours", str(tmp_path / "spec"), "--ref", str(tmp_path / "zlab"), "--target",
                 str(target_dir), "--static-only", "--expect-identical", "--out", str(tmp_path / "report")]) == 0


def test_dflash_against_dflash2_is_one_architecture_finding_naming_what_differs(tmp_path):
    torch.manual_seed(0)
    dflash = DFlashDrafter(tiny_spec(sliding_window_non_causal=True))
    save_checkpoint(tmp_path / "ours.pt", dflash)
    twin = dflash2_drafter()
    save_zlab_dir(tmp_path / "ref", twin.spec, twin.state_dict())
    result = static_audit(load_side(tmp_path / "ours.pt"), load_side(tmp_path / "ref"))
    assert kinds(result) == [("architecture", "family")]
    message = next(f.message for f in result.findings if f.key == "family")
    assert "ours is DFlash (no convolutions, no selector)" in message
    assert "2-tap convolutions in groups of 16" in message and "rank-8 selector reranking the top 4" in message
    only_ref = [row for row in result.tensor_rows if row.status == "missing in ours"]
    assert only_ref and all(row.explained_by == "architecture" for row in only_ref)
    assert {row.key for row in only_ref} == {k for k in twin.state_dict() if "_conv." in k or "selector" in k}


@pytest.mark.parametrize("change, expected, explained", [
    ({"selector_top_k": 6}, [("selector", "selector_top_k")], None),
    ({"selector_rank": 4}, [("selector", "selector_rank")], "selector"),
    ({"conv_kernel_size": 3}, [("conv", "conv_kernel_size")], "conv"),
    ({"conv_group_size": 8}, [("conv", "conv_group_size")], "conv"),
    ({"sliding_window_non_causal": False}, [("window_direction", "sliding_window_non_causal")], None),
])
def test_each_dflash2_setting_is_its_own_finding(tmp_path, change, expected, explained):
    ours, ref = dflash2_drafter(seed=4, **change), dflash2_drafter(seed=4)
    save_checkpoint(tmp_path / "ours.pt", ours)
    save_zlab_dir(tmp_path / "ref", ref.spec, ref.state_dict())
    result = static_audit(load_side(tmp_path / "ours.pt"), load_side(tmp_path / "ref"))
    assert [(c, k) for c, k in kinds(result) if c != "weights" or k != "values"] == expected
    shaped = [row for row in result.tensor_rows if row.status == "shape"]
    if explained:
        assert shaped and all(row.explained_by == explained for row in shaped)
    else:
        assert shaped == []


def test_selector_loss_weight_is_a_recipe_finding_between_dflash2_drafters_only(tmp_path):
    from impl.recipe import Recipe

    model = dflash2_drafter(seed=5)
    save_checkpoint(tmp_path / "a.pt", model, recipe=Recipe(selector_loss_alpha=0.5))
    save_checkpoint(tmp_path / "b.pt", model, recipe=Recipe())
    result = static_audit(load_side(tmp_path / "a.pt"), load_side(tmp_path / "b.pt"))
    assert kinds(result) == [("recipe", "selector_loss_alpha")]
    torch.manual_seed(0)
    dflash = DFlashDrafter(tiny_spec())
    save_checkpoint(tmp_path / "c.pt", dflash, recipe=Recipe(selector_loss_alpha=0.5))
    save_checkpoint(tmp_path / "d.pt", dflash, recipe=Recipe())
    assert kinds(static_audit(load_side(tmp_path / "c.pt"), load_side(tmp_path / "d.pt"))) == []


def test_a_foreign_dflash2_state_dict_needs_its_top_k_declared(tmp_path, capsys):
    """Shapes show the convolution and the selector rank, never the top-k: unknown until declared."""
    model = dflash2_drafter(seed=6)
    save_zlab_dir(tmp_path / "ref", model.spec, model.state_dict())
    torch.save({"model": model.state_dict(), "args": {
        "target_layer_ids": list(model.spec.target_layer_ids), "num_target_layers": model.spec.num_target_layers,
        "mask_token_id": model.spec.mask_token_id, "block_size": model.spec.block_size,
        "vocab_size": model.spec.target_vocab_size, "layer_types": list(model.spec.layer_types),
        "sliding_window": model.spec.sliding_window, "sliding_window_non_causal": True}}, tmp_path / "theirs.pt")
    side = load_side(tmp_path / "theirs.pt")
    assert side.value("conv_kernel_size") == 2 and side.value("conv_group_size") == 16
    assert side.value("selector_rank") == 8 and not side.is_known("selector_top_k")
    assert side.foreign["key_map"]["unmapped"] == []  # DFlash2's names are canonical names
    declared = ["--ours-spec", "selector_top_k=4"]
    assert main(["compare", "--ours", str(tmp_path / "theirs.pt"), "--ref", str(tmp_path / "ref"), "--static-only",
                 "--expect-identical", "--out", str(tmp_path / "report"), *declared]) == 0


def test_ddtree_eval_on_a_dflash2_drafter_is_a_clean_refusal(tmp_path, dflash2_pair, test_world, capsys):
    from dflash_world.drafter import cached_dflash2_drafter

    code = main(["eval", "--drafter", str(cached_dflash2_drafter(test_world)), "--target", str(test_world.target),
                 "--prompts", str(test_world.prompts), "--method", "ddtree", "--max-new-tokens", "8"])
    assert code == 2
    assert "DDTree is defined on DFlash drafters only" in capsys.readouterr().err


def test_a_dflash2_spec_with_half_its_fields_is_refused_by_name():
    from impl.spec import SpecError

    with pytest.raises(SpecError, match="selector_rank"):
        tiny_spec().replace(conv_kernel_size=2, conv_group_size=16)


def test_compare_a_trained_dflash2_drafter_with_its_zlab_twin_on_the_world(tmp_path, test_world):
    """Dynamic compare on DFlash2: τ per prompt through the selector, equal for the identical pair; DDTree n/a."""
    from dflash_audit.audit.compare import run_compare
    from dflash_audit.flags.compare import CompareFlags
    from dflash_world.drafter import cached_dflash2_drafter

    ckpt = cached_dflash2_drafter(test_world)
    convert(ckpt, tmp_path / "zlab", "zlab")
    report = run_compare(CompareFlags(ours=ckpt, ref=tmp_path / "zlab", target=test_world.target,
                                      prompts=test_world.prompts, out=tmp_path / "out", max_new_tokens=32, budget=8,
                                      cache_dir=tmp_path / "cache"))
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(data["tau"]["methods"]) == {"dflash"}
    assert all(p["ours_rounds"] == p["ref_rounds"] for p in data["tau"]["prompts"])
    assert max(p["ours"] for p in data["tau"]["prompts"]) > 1.5  # the selector's proposals are accepted
    assert [f.key for f in report.findings if f.severity == "divergence"] == []
    assert any(f.key == "ddtree not measured" and "DFlash2" in f.message for f in report.findings)
    assert "DFlash2" in (tmp_path / "out" / "index.html").read_text()


def test_zlab_save_pretrained_codebook_names_are_the_same_tensors(tmp_path):
    """z-lab's own `save_pretrained` writes `candidate_selector.*_codebook.weight`; its published files the
    bare name. Both read as one drafter: no finding between them, and a foreign dict in either spelling maps."""
    from reference_adapters.zlab_adapter import ZlabImplementation

    model = dflash2_drafter(seed=7)
    ZlabImplementation().build_drafter(model.spec, model.state_dict()).save_pretrained(tmp_path / "saved")
    assert "candidate_selector.predecessor_codebook.weight" in tensors_of(tmp_path / "saved")
    save_zlab_dir(tmp_path / "published", model.spec, model.state_dict())
    result = static_audit(load_side(tmp_path / "saved"), load_side(tmp_path / "published"), expect_identical=True)
    assert kinds(result) == [] and kinds(result, "warning") == []
    side = load_side(tmp_path / "saved")
    assert "candidate_selector.predecessor_codebook" in side.state_dict
    mapped = load_side(tmp_path / "published")
    assert not mapped.foreign.get("key_map", {}).get("unmapped")
