"""Format detection and `load_any`: normalized spec, raw convention, verifier tensors kept apart."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_audit.cli import main
from dflash_audit.formats import LoadedCheckpoint, detect_format, load_any
from foundation.errors import AuditError, CheckpointError
from drafter_files.checkpoint import Checkpoint, save_checkpoint
from drafter_files.zlab_format import save_zlab_dir


@pytest.fixture(scope="module")
def speculators_dir(tmp_path_factory, spec, drafter, target_dir):
    """Written by speculators itself, with the target as its verifier."""
    from reference_adapters.speculators_adapter import DFlashDraftModel, save_speculators_model, speculators_config

    model = DFlashDraftModel(speculators_config(spec, target_dir))
    model.load_state_dict(drafter.state_dict(), strict=False)
    model.load_verifier_weights()
    path = tmp_path_factory.mktemp("spec") / "drafter"
    save_speculators_model(model, path)
    return path


def test_detects_each_format(tmp_path, spec, drafter, speculators_dir):
    save_checkpoint(tmp_path / "ckpt.pt", drafter)
    save_zlab_dir(tmp_path / "zlab", spec, drafter.state_dict())
    assert detect_format(tmp_path / "ckpt.pt") == "ours"
    assert detect_format(tmp_path / "zlab") == "zlab"
    # speculators writes architectures ["DFlashDraftModel"] too; its model type decides.
    assert json.loads((speculators_dir / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert detect_format(speculators_dir) == "speculators"


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "absent", "no such file or directory"),
    (lambda p: _write(p / "weights.onnx", "x"), "not a checkpoint file \\(expected \\*.pt, \\*.pth"),
    (lambda p: _write(p / "d" / "notes.txt", "x").parent, "no drafter in it.*\\(found \\['notes.txt'\\]\\)"),
    (lambda p: _write(p / "d" / "config.json", "{oops").parent, "not valid JSON"),
    (lambda p: _write(p / "d" / "config.json", '{"speculators_model_type": "eagle3"}').parent, "'eagle3' model"),
    (lambda p: _write(p / "d" / "config.json", '{"architectures": ["LlamaForCausalLM"]}').parent,
     "describes \\['LlamaForCausalLM'\\], a language model, not a DFlash drafter"),
])
def test_detection_errors_say_what_was_found(tmp_path, make, message):
    with pytest.raises(AuditError, match=message):
        detect_format(make(tmp_path))


def test_cli_reports_detection_errors_in_one_line_with_exit_2(tmp_path, target_dir, capsys):
    status = main(["convert", "--from", str(target_dir), "--to", str(tmp_path / "out"), "--format", "zlab"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("dflash-audit: error: ")
    assert "not a DFlash drafter" in err


def test_ours_and_zlab_load_to_the_same_checkpoint(tmp_path, spec, drafter):
    save_checkpoint(tmp_path / "ckpt.pt", drafter)
    save_zlab_dir(tmp_path / "zlab", spec, drafter.state_dict())
    ours, zlab = load_any(tmp_path / "ckpt.pt"), load_any(tmp_path / "zlab")
    assert isinstance(ours, Checkpoint) and isinstance(zlab, LoadedCheckpoint)
    assert ours.spec == zlab.spec == spec
    assert (ours.format, zlab.format) == ("ours", "zlab")
    assert zlab.raw.layer_ids == [1, 3, 4] and zlab.raw.layer_id_convention == "zlab"
    assert zlab.raw.config["dflash_config"]["mask_token_id"] == spec.mask_token_id
    assert ours.state_dict.keys() == zlab.state_dict.keys()
    assert all(torch.equal(ours.state_dict[k], zlab.state_dict[k]) for k in ours.state_dict)


def test_speculators_ids_are_translated_and_raw_ids_kept(speculators_dir, spec, drafter):
    loaded = load_any(speculators_dir)  # its verifier is a local directory: the layer count comes from there
    assert loaded.format == "speculators"
    assert loaded.raw.layer_ids == [2, 4, 5] and loaded.raw.layer_id_convention == "speculators"
    assert loaded.spec == spec  # z-lab ids (1, 3, 4), the verifier's 6 layers, sliding + full layers
    assert loaded.state_dict.keys() == drafter.state_dict().keys()
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in drafter.state_dict().items())


def test_speculators_verifier_tensors_are_kept_apart(tmp_path, speculators_dir, spec, drafter):
    copy = tmp_path / "with_verifier"
    copy.mkdir()
    (copy / "config.json").write_text((speculators_dir / "config.json").read_text())
    tensors = {k: v.clone() for k, v in drafter.state_dict().items()}
    tensors["embed_tokens.weight"] = torch.randn(spec.target_vocab_size, spec.hidden_size)
    tensors["verifier_norm.weight"] = torch.ones(spec.hidden_size)
    save_file(tensors, str(copy / "model.safetensors"))
    loaded = load_any(copy)
    assert sorted(loaded.verifier_tensors) == ["embed_tokens.weight", "verifier_norm.weight"]
    assert "embed_tokens.weight" not in loaded.state_dict


def test_speculators_without_a_known_verifier_needs_the_target(tmp_path, speculators_dir, target_dir):
    config = json.loads((speculators_dir / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = "Qwen/Qwen3-8B"  # a hub id: not readable offline
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "config.json").write_text(json.dumps(config))
    (moved / "model.safetensors").write_bytes((speculators_dir / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="verifier's layer count.*--target"):
        load_any(moved)
    assert load_any(moved, target_dir=target_dir).spec.num_target_layers == 6


def test_a_pickle_is_never_executed(tmp_path):
    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"model": Boom(), "spec": {}}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="it pickles builtins.print, which is a function call"):
        load_any(tmp_path / "evil.pt")


def test_a_shard_index_may_only_name_files_in_its_own_folder(tmp_path, spec, drafter):
    save_zlab_dir(tmp_path / "z", spec, drafter.state_dict())
    outside = tmp_path / "outside.safetensors"
    (tmp_path / "z" / "model.safetensors").rename(outside)
    for name in ("../outside.safetensors", str(outside), "/etc/passwd"):
        index = {"weight_map": {k: name for k in drafter.state_dict()}}
        (tmp_path / "z" / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="outside the index's own folder; refused"):
            load_any(tmp_path / "z")


def test_fractional_layer_ids_are_refused_not_truncated(tmp_path, spec, drafter):
    save_zlab_dir(tmp_path / "z", spec, drafter.state_dict())
    config = json.loads((tmp_path / "z" / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0.7, 2.2, 4]
    (tmp_path / "z" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"target_layer_ids: \[0.7, 2.2\] are not integer layer ids"):
        load_any(tmp_path / "z")


def test_two_names_for_one_tensor_are_never_collapsed(tmp_path, spec, drafter):
    save_checkpoint(tmp_path / "ours.pt", drafter)
    payload = torch.load(tmp_path / "ours.pt", weights_only=True)
    payload["model"]["module.fc.weight"] = payload["model"]["fc.weight"] * 2
    torch.save(payload, tmp_path / "ours.pt")
    with pytest.raises(CheckpointError, match="'fc.weight' and 'module.fc.weight' are both 'fc.weight'"):
        load_any(tmp_path / "ours.pt")
    torch.save({"model": payload["model"]}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="both map to 'fc.weight'"):
        load_any(tmp_path / "foreign.pt")


def test_a_config_its_own_fc_contradicts_is_one_finding_of_that_side(tmp_path, spec, drafter, capsys):
    import dataclasses

    from impl.model import DFlashDrafter

    save_zlab_dir(tmp_path / "ref", spec, drafter.state_dict())
    tensors = dict(drafter.state_dict())
    tensors["fc.weight"] = DFlashDrafter(dataclasses.replace(spec, target_layer_ids=(1, 3))).state_dict()["fc.weight"]
    save_zlab_dir(tmp_path / "bad", spec, tensors)
    assert main(["compare", "--ours", str(tmp_path / "bad"), "--ref", str(tmp_path / "ref"), "--static-only",
                 "--out", str(tmp_path / "r")]) == 1
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    divergences = [(f["component"], f["key"]) for f in report["findings"] if f["severity"] == "divergence"]
    assert divergences == [("fc_dims", "contradiction in ours")]
    assert "its config names 3 target layers [1, 3, 4], but fc.weight in_features 128 = 2 layers" in \
        report["findings"][0]["message"]
    fc = next(r for r in report["tensors"] if r["key"] == "fc.weight")
    assert fc["explained_by"] == "contradiction in ours"


@pytest.mark.parametrize("extra, component, words", [
    ("layers.0.extra_gate.weight", "weights", "that a DFlash drafter of its spec does not have"),
    ("layers.0.conv.weight", "architecture", "of the DFlash2"),
])
def test_every_tensor_is_accounted_for(tmp_path, spec, drafter, extra, component, words):
    save_zlab_dir(tmp_path / "ref", spec, drafter.state_dict())
    save_zlab_dir(tmp_path / "ours", spec, {**drafter.state_dict(), extra: torch.ones(4)})
    assert main(["compare", "--ours", str(tmp_path / "ours"), "--ref", str(tmp_path / "ref"), "--static-only",
                 "--out", str(tmp_path / "r")]) == 1
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    divergences = [f for f in report["findings"] if f["severity"] == "divergence"]
    assert [f["component"] for f in divergences] == [component] and words in divergences[0]["message"]
    assert {r["key"] for r in report["tensors"]} == set(drafter.state_dict()) | {extra}
