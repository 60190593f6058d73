"""Conversion ours <-> zlab <-> speculators: bit-identical round trips, agreement with speculators' converter."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from dflash_audit.cli import main
from dflash_audit.conversion import convert
from dflash_audit.formats import load_any
from foundation.errors import AuditError
from drafter_files.checkpoint import save_checkpoint
from impl.model import DFlashDrafter
from impl.recipe import Recipe
from drafter_files.zlab_format import save_zlab_dir
from tests.helpers import tiny_spec, tiny_target


@pytest.fixture
def ours_pt(tmp_path, drafter):
    save_checkpoint(tmp_path / "ours.pt", drafter, recipe=Recipe(gamma=7.0), step=12)
    return tmp_path / "ours.pt"


def tensors_of(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("via", ["zlab", "speculators"])
def test_round_trip_through_each_format_is_bit_identical(tmp_path, ours_pt, target_dir, via):
    convert(ours_pt, tmp_path / via, via, target=target_dir)
    convert(tmp_path / via, tmp_path / "back.pt", "ours", target=target_dir)
    before, after = load_any(ours_pt), load_any(tmp_path / "back.pt")
    assert after.spec == before.spec
    assert_bit_identical(before.state_dict, after.state_dict)


def test_bf16_weights_stay_bf16(tmp_path, spec, drafter, target_dir):
    save_zlab_dir(tmp_path / "z", spec, {k: v.bfloat16() for k, v in drafter.state_dict().items()})
    convert(tmp_path / "z", tmp_path / "s", "speculators", target=target_dir)
    convert(tmp_path / "s", tmp_path / "z2", "zlab")  # the recorded verifier is local: no --target needed
    assert_bit_identical(tensors_of(tmp_path / "z"), tensors_of(tmp_path / "z2"))


def test_ours_equals_speculators_own_converter(tmp_path, spec, drafter, target_dir):
    from speculators.convert.dflash import DFlashConverter

    save_zlab_dir(tmp_path / "zlab", spec, drafter.state_dict())
    DFlashConverter().convert(tmp_path / "zlab", tmp_path / "theirs", base_model=str(target_dir))
    convert(tmp_path / "zlab", tmp_path / "ours", "speculators", target=target_dir)
    assert_bit_identical(tensors_of(tmp_path / "theirs"), tensors_of(tmp_path / "ours"))
    theirs_config = json.loads((tmp_path / "theirs" / "config.json").read_text())
    ours_config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert ours_config == theirs_config
    assert ours_config["aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert load_any(tmp_path / "ours").spec == load_any(tmp_path / "theirs").spec == spec


def test_a_final_layer_id_is_refused_unless_lossy_is_allowed(tmp_path, target_dir):
    spec = tiny_spec(target_layer_ids=(1, 5, 3))  # 5 is the final layer of the 6-layer target
    torch.manual_seed(1)
    model = DFlashDrafter(spec)
    save_zlab_dir(tmp_path / "zlab", spec, model.state_dict())
    with pytest.raises(AuditError, match="target layer 5 is the verifier's final layer.*--allow-lossy"):
        convert(tmp_path / "zlab", tmp_path / "spec", "speculators", target=target_dir)
    assert not (tmp_path / "spec").exists()
    result = convert(tmp_path / "zlab", tmp_path / "spec", "speculators", target=target_dir, allow_lossy=True)
    assert any(note.startswith("lossy: target layer 5") for note in result.notes)
    converted = load_any(tmp_path / "spec")
    assert converted.raw.layer_ids == [2, 4]  # speculators' converter drops the final layer the same way
    h = spec.hidden_size
    fc = model.state_dict()["fc.weight"]
    assert torch.equal(converted.state_dict["fc.weight"], torch.cat([fc[:, :h], fc[:, 2 * h:]], dim=1))


def test_recipe_is_a_note_not_a_loss(tmp_path, ours_pt):
    result = convert(ours_pt, tmp_path / "zlab", "zlab")
    assert result.source_format == "ours" and result.format == "zlab"
    assert any("recipe (gamma 7.0" in note for note in result.notes)
    assert not any(note.startswith("lossy") for note in result.notes)


def test_cli_convert_and_its_errors(tmp_path, ours_pt, target_dir, capsys):
    assert main(["convert", "--from", str(ours_pt), "--to", str(tmp_path / "spec"), "--format", "speculators",
                 "--target", str(target_dir)]) == 0
    out = capsys.readouterr().out
    assert "(ours) ->" in out and "(speculators)" in out and "note: the training recipe" in out
    for argv, message in [
        (["--to", str(tmp_path / "s2"), "--format", "speculators"], "needs --target DIR"),
        (["--to", str(tmp_path / "x.bin"), "--format", "ours"], "single \\*.pt file"),
        (["--to", str(tmp_path / "y"), "--format", "onnx"], "onnx"),
    ]:
        assert main(["convert", "--from", str(ours_pt), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("dflash-audit: error: ")
        assert re.search(message, err), err
    small = tmp_path / "small"
    tiny_target(num_layers=4).save_pretrained(small)
    assert main(["convert", "--from", str(ours_pt), "--to", str(tmp_path / "s3"), "--format", "speculators",
                 "--target", str(small)]) == 2
    assert "built for a target of 6 layers, this one has 4" in capsys.readouterr().err


def test_a_target_folder_without_weights_is_refused_for_speculators(tmp_path, ours_pt, target_dir, capsys):
    """speculators' format records the verifier's weights: a target folder holding its config alone is one line
    (exit 2) naming what is missing, and nothing is written."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((target_dir / "config.json").read_text())
    assert main(["convert", "--from", str(ours_pt), "--to", str(tmp_path / "spec"), "--format", "speculators",
                 "--target", str(config_only)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dflash-audit: error: ")
    assert "no model.safetensors.index.json and no model.safetensors" in err, err
    assert not (tmp_path / "spec").exists()
