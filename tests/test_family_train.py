"""`train --family dspark|xpress`: each family trains with its own loss and its defaults as speculators' trainer
resolves the family, and its checkpoint is read by `compare` against speculators' own copy of the same drafter."""

from __future__ import annotations

import json

import pytest

from dflash_audit.cli import main
from drafter_files.checkpoint import load_checkpoint
from impl.recipe import KNOBS, train_recipe
from tests.family_fixtures import without_final_layer, world_backbone, write_speculators_drafter
from tests.helpers import TEXTS

FAMILIES = ("dspark", "xpress")
# A few fixed steps of a small drafter: seconds of CPU.
RUN = ["--steps", "2", "--seq-len", "64", "--block-size", "4", "--batch-size", "2", "--max-anchors", "4",
       "--warmup", "1", "--eval-sequences", "0", "--seed", "0"]
HEAD = {"dspark": ["--markov-rank", "8"], "xpress": ["--xpress-rank", "8", "--num-jacobi-passes", "2"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_train_defaults_are_speculators_trainer_resolution(family):
    from reference_adapters.speculators_recipe import trainer

    ours, reference = train_recipe(family), trainer(family).recipe
    for name, info in KNOBS.items():
        if info.json_schema_extra["family"] in (None, family):
            assert getattr(ours, name) == getattr(reference, name), name


@pytest.fixture(scope="module")
def trained(test_world, tmp_path_factory):
    """Per family: our checkpoint from `train --family`, and speculators' own copy of the same weights."""
    base, _ = without_final_layer(*world_backbone(test_world))  # speculators never feeds the final layer to fc
    root = tmp_path_factory.mktemp("family-train")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    out = {}
    for family in FAMILIES:
        ckpt = root / f"{family}.pt"
        code = main(["train", "--target", str(test_world.target), "--data", str(data), "--out", str(ckpt),
                     "--family", family, "--target-layer-ids", ",".join(map(str, base.target_layer_ids)),
                     "--json", str(root / f"{family}.json"), *RUN, *HEAD[family]])
        assert code == 0
        loaded = load_checkpoint(ckpt)
        copy = write_speculators_drafter(root / f"{family}-speculators", loaded.spec, loaded.state_dict,
                                         test_world.target)
        out[family] = (ckpt, loaded, copy, json.loads((root / f"{family}.json").read_text()))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_train_family_trains_with_its_own_loss_and_defaults(trained, family):
    _, loaded, _, stats = trained[family]
    assert loaded.spec.family == family and loaded.step == 2
    expected = train_recipe(family).replace(max_anchors=4)
    for name in KNOBS:
        if name != "verifier_source_layer":
            assert getattr(loaded.recipe, name) == getattr(expected, name), name
    assert loaded.spec.sample_from_anchor == expected.sample_from_anchor  # DSpark: every slot proposes
    assert len(stats["losses"]) == 2 and all(loss > 0 for loss in stats["losses"])


@pytest.mark.parametrize("family", FAMILIES)
def test_compare_holds_the_trained_checkpoint_to_speculators_own_copy(trained, test_world, family, tmp_path):
    ckpt, _, copy, _ = trained[family]
    assert main(["compare", "--ours", str(ckpt), "--ref", str(copy), "--out", str(tmp_path / "r")]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [f for f in report["findings"] if f["severity"] == "divergence"] == []
    # The copy carries no recipe: it is held to its own family's trainer recipe, which ours trained with.
    assert f"TrainConfig-resolved {family} recipe" in report["recipes"]["ref"]["source"]
    assert report["recipes"]["ref"]["recipe"]["loss_fn"] == report["recipes"]["ours"]["recipe"]["loss_fn"]


def test_a_family_knob_needs_its_family(tiny_world, tmp_path, capsys):
    code = main(["train", "--target", str(tiny_world / "target"), "--data", str(tiny_world / "data.jsonl"),
                 "--out", str(tmp_path / "o.pt"), "--consistency-weight", "0.5"])
    assert code == 2
    assert capsys.readouterr().err.strip().endswith("--consistency-weight is a XPress setting; add --family xpress")
