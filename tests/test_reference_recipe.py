"""The reference recipe as speculators resolves it: in docs/training.md, in our trainer and in the recipe audit.

Tiny drafters trained for two steps by `dflash-audit train` on a tiny random target: what is
checked is the recipe they record and how the audit holds it, not what they learned.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_audit.audit.sides import load_side
from dflash_audit.audit.static import static_audit
from dflash_audit.cli import main
from drafter_files.checkpoint import load_checkpoint
from drafter_files.zlab_format import save_zlab_dir
from impl.recipe import KNOBS
from reference_adapters import speculators_recipe as refs

RECIPE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "training.md"
# Two steps in seconds. Block size, draft layers and the loss come from --recipe; 512 anchors of 16
# slots would make every step 100x slower, so every run says --max-anchors 8 (an explicit flag wins).
RUN = ["--steps", "2", "--seq-len", "48", "--fc-layers", "0,1,2", "--batch-size", "2", "--lr", "3e-3",
       "--warmup", "1", "--max-anchors", "8"]


def train(root, out: Path, *flags: str) -> Path:
    args = ["train", "--target", str(root / "target"), "--data", str(root / "data.jsonl"), "--out", str(out),
            *RUN, *flags]
    assert main(args) == 0
    return out


def recipe_findings(ours: Path, ref: Path):
    result = static_audit(load_side(ours), load_side(ref))
    return [f for f in result.findings if f.component == "recipe"], result.recipes


@pytest.fixture(scope="module")
def checkpoints(tiny_world, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("recipes")
    return {
        # The reference: the whole TrainConfig-resolved recipe, one flag.
        "ref": train(tiny_world, root / "ref.pt", "--recipe", "speculators", "--seed", "1"),
        # Ours, D-PACE asked for flag by flag.
        "dpace": train(tiny_world, root / "dpace.pt", "--loss-weighting", "dpace", "--dpace-alpha", "0.5",
                       "--loss", "ce", "--block-size", "16", "--draft-layers", "5"),
        # The same run with fixed decay instead.
        "fixed": train(tiny_world, root / "fixed.pt", "--recipe", "speculators", "--loss-weighting",
                       "fixed-exp-decay"),
    }


def test_docs_reference_table_is_the_generated_one():
    text = RECIPE_PAGE.read_text()
    assert refs.reference_table_markdown() in text  # regenerate with reference_table_markdown() when it fails


def test_recipe_speculators_trains_the_whole_resolved_recipe(checkpoints):
    resolved = refs.trainer("dflash")
    ckpt = load_checkpoint(checkpoints["ref"])
    assert ckpt.recipe.max_anchors == 8  # the explicit flag beats the recipe
    for name in set(refs.RECIPE_TABLE_FIELDS) - {"max_anchors"}:
        assert getattr(ckpt.recipe, name) == getattr(resolved.recipe, name), name
    assert (ckpt.spec.block_size, ckpt.spec.num_hidden_layers) == (resolved.block_size, resolved.draft_layers)


def test_dpace_trained_checkpoint_has_no_recipe_finding_against_the_resolved_recipe(checkpoints):
    found, _ = recipe_findings(checkpoints["dpace"], checkpoints["ref"])
    assert found == []


def test_fixed_decay_checkpoint_differs_in_exactly_the_weighting(checkpoints):
    found, _ = recipe_findings(checkpoints["fixed"], checkpoints["ref"])
    assert [(f.component, f.key) for f in found] == [("recipe", "per_position_loss_weight")]
    assert (found[0].ours, found[0].ref) == ("fixed-exp-decay", "dpace")


def test_a_side_without_recipe_is_held_to_the_recipe_the_other_side_follows(checkpoints, tmp_path):
    ref = load_checkpoint(checkpoints["ref"])
    save_zlab_dir(tmp_path / "zlab", ref.spec, ref.state_dict)  # z-lab format keeps no recipe
    found, recipes = recipe_findings(checkpoints["dpace"], tmp_path / "zlab")
    assert [(f.key, f.severity) for f in found] == [("max_anchors", "warning")]  # 8 here, 512 resolved
    assert re.search(r"held to speculators [\d.]+ TrainConfig-resolved dflash recipe", recipes["ref"]["source"])
    assert re.search(r"per_position_loss_weight=dpace", recipes["ref"]["source"])


def test_a_kl_fixed_decay_recipe_is_held_to_the_model_level_defaults(tiny_world, checkpoints, tmp_path):  # noqa: F811
    ours = train(tiny_world, tmp_path / "kl.pt", "--recipe", "speculators", "--loss", "kl_div",
                 "--loss-weighting", "fixed-exp-decay", "--gamma", "7")
    ref = load_checkpoint(checkpoints["ref"])
    save_zlab_dir(tmp_path / "zlab", ref.spec, ref.state_dict)
    found, recipes = recipe_findings(ours, tmp_path / "zlab")
    # KL and fixed decay are the model-level defaults; its gamma 4 and 512 anchors are not ours.
    assert [(f.key, f.severity) for f in found] == [("gamma", "divergence"), ("max_anchors", "warning")]
    assert "model-level defaults" in recipes["ref"]["source"] and "model-level" in found[0].message


def test_dpace_with_kl_is_refused(tiny_world, tmp_path, capsys):  # noqa: F811
    args = ["train", "--target", str(tiny_world / "target"), "--data", str(tiny_world / "data.jsonl"),
            "--out", str(tmp_path / "x.pt"), *RUN, "--loss", "kl_div", "--loss-weighting", "dpace"]
    assert main(args) == 2
    assert "--per-position-loss-weight: dpace needs loss_fn ce" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["dflash2", "dspark", "xpress"])
def test_our_family_drafter_defaults_are_speculators_defaults(family):
    from impl.run_settings import RunSettings
    from impl.train import knob_recipe

    resolved, ours = refs.trainer(family), RunSettings(target="", out="", family=family)
    for name, value in resolved.architecture.items():
        if name != "sliding_window_non_causal":  # ours: None = the family's default, checked below
            assert getattr(ours, name) == value, name
    own = [name for name, info in KNOBS.items() if info.json_schema_extra["family"] == family]
    assert own and all(getattr(knob_recipe(ours), name) == getattr(resolved.recipe, name) for name in own)


def test_our_dflash2_defaults_are_speculators_dflash2_defaults():
    resolved = refs.trainer("dflash2")
    assert resolved.architecture["sliding_window_non_causal"] is True


def test_recipe_speculators_trains_the_resolved_dflash2_drafter(tiny_world, tmp_path):  # noqa: F811
    out = train(tiny_world, tmp_path / "d2.pt", "--family", "dflash2", "--recipe", "speculators",
                "--layer-types", ",".join(["sliding_attention"] * 4 + ["full_attention"]), "--sliding-window", "12")
    resolved, ckpt = refs.trainer("dflash2"), load_checkpoint(out)
    assert ckpt.spec.family == "dflash2"
    for name, value in resolved.architecture.items():
        assert getattr(ckpt.spec, name) == value, name
    assert (ckpt.spec.block_size, ckpt.spec.num_hidden_layers) == (resolved.block_size, resolved.draft_layers)
    assert (ckpt.recipe.loss_fn, ckpt.recipe.per_position_loss_weight) == (resolved.recipe.loss_fn,
                                                                             resolved.recipe.per_position_loss_weight)
    assert ckpt.recipe.selector_loss_alpha == resolved.recipe.selector_loss_alpha


def test_a_dflash2_flag_without_the_family_is_refused(tiny_world, tmp_path, capsys):  # noqa: F811
    args = ["train", "--target", str(tiny_world / "target"), "--data", str(tiny_world / "data.jsonl"),
            "--out", str(tmp_path / "x.pt"), *RUN, "--selector-top-k", "8"]
    assert main(args) == 2
    assert "--selector-top-k is a DFlash2 setting; add --family dflash2" in capsys.readouterr().err


def test_a_dflash2_setting_that_cannot_build_is_one_line_naming_it(tiny_world, tmp_path, capsys):  # noqa: F811
    args = ["train", "--target", str(tiny_world / "target"), "--data", str(tiny_world / "data.jsonl"),
            "--out", str(tmp_path / "x.pt"), *RUN, "--family", "dflash2", "--conv-group-size", "7"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "conv_group_size" in err and "not divisible" in err
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark", "xpress"])
def test_every_yardstick_says_where_each_recipe_field_it_is_compared_on_comes_from(family):
    """A side without a recipe is held to a reference; each field compared for its family needs that reference's
    source (a DFlash2 drafter's selector loss weight was missing: the comparison ended in a KeyError)."""
    from catalogue.pitfalls import RECIPE_ENTRIES
    from dflash_audit.audit.static_recipe import DRAFTER_FIELDS, FAMILY_RECIPE_FIELDS

    compared = [name for name in RECIPE_ENTRIES if name not in DRAFTER_FIELDS
                and FAMILY_RECIPE_FIELDS.get(name, family) == family]
    for other in (None, refs.trainer("dflash").recipe, refs.model_level().recipe):
        reference, _ = refs.yardstick_for(other, family=family)
        assert [name for name in compared if name not in reference.sources] == [], (family, reference.title)


def test_a_dflash2_selector_weight_against_a_folder_without_recipe_is_one_finding(tiny_world, tmp_path):  # noqa: F811
    ours = train(tiny_world, tmp_path / "d2.pt", "--family", "dflash2", "--selector-loss-alpha", "0.5")
    ckpt = load_checkpoint(ours)
    save_zlab_dir(tmp_path / "zlab", ckpt.spec, ckpt.state_dict)  # z-lab format keeps no recipe
    found, _ = recipe_findings(ours, tmp_path / "zlab")
    alpha = [f for f in found if f.key == "selector_loss_alpha"]
    assert len(alpha) == 1 and (alpha[0].ours, alpha[0].ref) == (0.5, refs.trainer("dflash2").recipe.selector_loss_alpha)
    assert "DFlash2Args.selector_loss_alpha" in alpha[0].message


# -- compare's yardstick and the trace read one rule: a setting speculators' TrainConfig accepts is no divergence --
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_hidden_layers=2, target_vocab_size=512, target_layer_ids=(1, 3, 5, 7, 9), num_target_layers=12,
             mask_token_id=511, block_size=16)


@pytest.mark.parametrize("loss_fn", ["kl_div", "ce"])
@pytest.mark.parametrize("weighting", ["fixed-exp-decay", "dpace"])
def test_a_side_without_recipe_takes_the_other_sides_setting_as_the_trace_does(loss_fn, weighting):
    """A declared loss kind and weighting against a side without a recipe: no divergence in either exactly when
    speculators' TrainConfig accepts the pair (`trainer_setting`, which the trace's recipe audit reads too)."""
    from dflash_audit.audit.sides import Side
    from dflash_audit.audit.static_recipe import recipe_findings as static_recipe_findings
    from impl.recipe import RECIPE_FIELDS, Recipe
    from impl.spec import DraftSpec

    spec = DraftSpec(**SMALL)
    declared = {"loss_fn": loss_fn, "per_position_loss_weight": weighting}
    ours = Side("ckpt.pt", "foreign", None, {}, Recipe(**declared), list(spec.target_layer_ids), "zlab",
                recipe_unknown=[name for name in RECIPE_FIELDS if name not in declared])
    ref = Side("zlab", "zlab", spec, {}, None, list(spec.target_layer_ids), "zlab")
    found, recipes = static_recipe_findings(ours, ref)
    held = {f.key for f in found if f.severity == "divergence"} & set(declared)
    accepted = refs.trainer_setting(loss_fn, weighting)
    assert accepted == ((loss_fn, weighting) != ("kl_div", "dpace"))  # speculators' _validate_dpace
    assert (held == set()) == accepted, (found, recipes["ref"]["source"])


def foreign_checkpoint(path: Path, **declared) -> Path:
    """A team's training checkpoint: the drafter's weights and the run's argparse Namespace, as torch.save keeps it."""
    import argparse

    import torch

    from impl.model import DFlashDrafter
    from impl.spec import DraftSpec

    torch.manual_seed(0)
    drafter = DFlashDrafter(DraftSpec(**SMALL))
    args = argparse.Namespace(target_layers=list(SMALL["target_layer_ids"]), block_size=SMALL["block_size"],
                              num_draft_layers=SMALL["num_hidden_layers"], mask_token_id=SMALL["mask_token_id"],
                              **declared)
    torch.save({"model_state_dict": drafter.state_dict(), "args": args}, path)
    return path


def test_compare_holds_ce_with_fixed_decay_as_a_setting_and_only_its_gamma(tmp_path, capsys):
    import json

    import torch

    from impl.model import DFlashDrafter
    from impl.spec import DraftSpec

    torch.manual_seed(1)
    save_zlab_dir(tmp_path / "zlab", DraftSpec(**SMALL), DFlashDrafter(DraftSpec(**SMALL)).state_dict())

    def recipe_divergences(name: str, **declared) -> list:
        ckpt = foreign_checkpoint(tmp_path / f"{name}.pt", **declared)
        out = tmp_path / name
        status = main(["compare", "--ours", str(ckpt), "--ref", str(tmp_path / "zlab"), "--static-only",
                       "--out", str(out)])
        assert status in (0, 1), capsys.readouterr().err
        report = json.loads((out / "report.json").read_text())
        return [(f["key"], f["ours"], f["ref"]) for f in report["findings"]
                if f["component"] == "recipe" and f["severity"] == "divergence"]

    resolved_gamma = refs.trainer("dflash").recipe.gamma
    assert recipe_divergences("ce-fixed", loss_fn="ce", per_position_loss_weight="fixed-exp-decay",
                              gamma=resolved_gamma) == []
    assert recipe_divergences("ce-fixed-7", loss_fn="ce", per_position_loss_weight="fixed-exp-decay",
                              gamma=7.0) == [("gamma", 7.0, resolved_gamma)]
    # KL under D-PACE is no setting (speculators refuses it): still held to the TrainConfig-resolved loss.
    assert recipe_divergences("kl-dpace", loss_fn="kl_div", per_position_loss_weight="dpace") == \
        [("loss_fn", "kl_div", refs.trainer("dflash").recipe.loss_fn)]
    # A uniform weighting is none of speculators' (DFlashArgs.per_position_loss_weight: fixed-exp-decay, dpace) and
    # the recipe type holds only those: compare says so in one line, exit 2.
    ckpt = foreign_checkpoint(tmp_path / "ce-uniform.pt", loss_fn="ce", per_position_loss_weight="uniform")
    capsys.readouterr()
    assert main(["compare", "--ours", str(ckpt), "--ref", str(tmp_path / "zlab"), "--static-only",
                 "--out", str(tmp_path / "uniform")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'uniform' is not a per_position_loss_weight" in err, err
