"""Bring your own checkpoint: the layouts teams actually save, each opened as it is.

Every gallery layout holds the same drafter as a z-lab reference directory; `compare
--static-only` must find nothing, and `report.json` must say where every spec field came
from. Layouts that cannot be opened give one line saying what was found and what is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from dflash_audit.cli import main
from dflash_audit.formats import detect_format, load_any
from impl.model import DFlashDrafter
from impl.spec import SPEC_FIELDS
from drafter_files.zlab_format import save_zlab_dir
from tests.trainer_layouts import SPEC, TRAINER_GALLERY, drafter, fsdp2_copy, fsdp2_dcp, ref_dir  # noqa: F401

# What a team's args declare, under names of their own choosing (z-lab convention ids).
DECLARED = {"fc_layers": [1, 3, 4], "target_num_layers": 6, "mask_id": 127, "block_size": 8, "vocab_size": 128}


@dataclasses.dataclass
class TeamConfig:  # pickled as a class the loader cannot import: read as data, never run
    target_layers: tuple = (1, 3, 4)
    num_target_layers: int = 6
    mask_token_id: int = 127
    block_size: int = 8
    vocab_size: int = 128
    gamma: float = 4.0


def state(drafter, prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + k: v.clone() for k, v in drafter.state_dict().items()}


def optimizer_state(drafter):
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    return optimizer.state_dict()


# -- the gallery: each builder writes one layout into `root` and returns the path to pass --------
def bare_state_dict_with_args_json(root: Path, drafter) -> Path:
    torch.save(state(drafter), root / "drafter.pt")
    (root / "args.json").write_text(json.dumps(DECLARED))
    return root / "drafter.pt"


def training_dict_with_namespace(root: Path, drafter) -> Path:
    args = argparse.Namespace(**DECLARED, gamma=np.float64(4.0), lr=np.float32(3e-4),
                              output_dir=pathlib.Path("/runs/7"), seed=np.int64(1))
    torch.save({"model_state_dict": state(drafter), "optimizer_state_dict": optimizer_state(drafter),
                "args": args, "epoch": 3}, root / "ckpt.pth")
    return root / "ckpt.pth"


def lightning_style_ckpt(root: Path, drafter) -> Path:
    optimizer = optimizer_state(drafter)
    torch.save({"state_dict": state(drafter, "model."), "optimizer_states": [optimizer],
                "lr_schedulers": [{"base_lrs": [1e-3], "last_epoch": 10, "_step_count": 11}],
                "hyper_parameters": {"model": {"target_layer_ids": [1, 3, 4], "num_target_layers": 6,
                                               "mask_token_id": 127, "block_size": 8, "vocab_size": 128}},
                "epoch": 1, "global_step": 10, "pytorch-lightning_version": "2.4.0"}, root / "last.ckpt")
    return root / "last.ckpt"


def ddp_compiled_with_dataclass_config(root: Path, drafter) -> Path:
    torch.save({"model": state(drafter, "module._orig_mod."), "config": TeamConfig(),
                "scaler": {"scale": 65536.0, "growth_factor": 2.0}, "rng_state": torch.get_rng_state()},
               root / "drafter.bin")
    return root / "drafter.bin"


def ema_and_model_picked_by_entry(root: Path, drafter) -> Path:
    torch.save({"model": state(drafter), "ema": state(drafter), "args": DECLARED}, root / "ema.pt")
    return root / "ema.pt"


def bare_safetensors_with_stem_yaml(root: Path, drafter) -> Path:
    save_file(state(drafter), str(root / "drafter.safetensors"))
    (root / "drafter.yaml").write_text(yaml.safe_dump({"model": DECLARED}))
    return root / "drafter.safetensors"


def save_pretrained_directory(root: Path, drafter) -> Path:
    folder = root / "my-drafter"
    folder.mkdir()
    save_file(state(drafter), str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "team_dflash", "hidden_size": 64, "num_draft_layers": 3, **DECLARED}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def sharded_safetensors_with_training_config(root: Path, drafter) -> Path:
    folder = root / "sharded"
    folder.mkdir()
    tensors = state(drafter)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard))
        weight_map.update({k: shard for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "training_config.json").write_text(json.dumps({"drafter": DECLARED, "optim": {"lr": 1e-4}}))
    return folder


def pytorch_model_bin_with_config_yaml(root: Path, drafter) -> Path:
    folder = root / "hf-bin"
    folder.mkdir()
    torch.save(state(drafter), folder / "pytorch_model.bin")
    (folder / "config.yaml").write_text(yaml.safe_dump({"dflash": DECLARED, "trainer": {"max_steps": 1000}}))
    return folder


def omegaconf_config_in_the_file(root: Path, drafter) -> Path:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"model": {"target_layers": [1, 3, 4], "mask_token_id": 127, "block_size": 8},
                            "target": {"num_hidden_layers": 6, "vocab_size": 128},
                            "train": {"loss_decay_gamma": 4.0, "loss_fn": "kl_div"}})
    torch.save({"draft_model": state(drafter), "cfg": cfg}, root / "omega.pt")
    return root / "omega.pt"


def speculators_train_config_args(root: Path, drafter) -> Path:
    # speculators' TrainConfig names, its target_layer_ids in its own convention (id + 1).
    args = {"speculator_type": "dflash", "target_layer_ids": [2, 4, 5], "block_size": 8, "dflash_decay_gamma": 4.0,
            "max_anchors": 512, "loss_fn": "kl_div", "per_position_loss_weight": "fixed-exp-decay",
            "mask_token_id": 127}
    torch.save({"drafter": state(drafter, "drafter."), "train_config": args}, root / "spec.pt")
    (root / "config.json").write_text(json.dumps({"verifier": {"num_hidden_layers": 6, "vocab_size": 128}}))
    return root / "spec.pt"


GALLERY = {
    "bare state dict + args.json": (bare_state_dict_with_args_json, [], "args.json: fc_layers"),
    "training dict + argparse.Namespace": (training_dict_with_namespace, [], "ckpt.pth: args.fc_layers"),
    "Lightning-style .ckpt": (lightning_style_ckpt, [], "last.ckpt: hyper_parameters.model.target_layer_ids"),
    "DDP + compile prefixes, dataclass config (.bin)": (ddp_compiled_with_dataclass_config, [],
                                                        "drafter.bin: config.target_layers"),
    "model + ema, --ours-entry ema": (ema_and_model_picked_by_entry, ["--ours-entry", "ema"], "ema.pt: args.fc_layers"),
    "bare .safetensors + <stem>.yaml": (bare_safetensors_with_stem_yaml, [], "drafter.yaml: model.fc_layers"),
    "save_pretrained directory": (save_pretrained_directory, [], "config.json: fc_layers"),
    "sharded safetensors + index + training_config.json": (sharded_safetensors_with_training_config, [],
                                                           "training_config.json: drafter.fc_layers"),
    "pytorch_model.bin + config.yaml": (pytorch_model_bin_with_config_yaml, [], "config.yaml: dflash.fc_layers"),
    "OmegaConf config pickled in the file": (omegaconf_config_in_the_file, [], "omega.pt: cfg.model.target_layers"),
    "speculators TrainConfig args": (speculators_train_config_args, [],
                                     "spec.pt: train_config.target_layer_ids (speculators convention, id - 1)"),
}
GALLERY.update(TRAINER_GALLERY)  # the layouts training frameworks save in (tests/trainer_layouts.py)


@pytest.mark.parametrize("name", list(GALLERY))
def test_each_gallery_layout_audits_clean_with_provenance(tmp_path, drafter, ref_dir, name, capsys, request):
    build, flags, ids_from = GALLERY[name]
    path = build(tmp_path, drafter, *([request.getfixturevalue("fsdp2_dcp")] if build is fsdp2_copy else []))
    assert detect_format(path) == "foreign"
    status = main(["compare", "--ours", str(path), "--ref", str(ref_dir), "--static-only", "--out",
                   str(tmp_path / "report"), *flags])
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert status == 0, [f["message"] for f in report["findings"] if f["severity"] == "divergence"]
    ours = report["ours"]
    assert ours["format"] == "foreign" and ours["spec_complete"]
    assert ours["spec"]["target_layer_ids"] == [1, 3, 4] and ours["spec"]["num_target_layers"] == 6
    provenance = ours["provenance"]
    assert provenance["target_layer_ids"] == {"source": "declared", "detail": ids_from}
    for field in ("hidden_size", "num_hidden_layers", "head_dim", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size"):
        assert provenance[field]["source"] == "inferred", field
    assert provenance["rope_theta"]["source"] == "default"
    window = next(row for row in report["spec_diff"] if row["name"] == "sliding_window")
    assert window["ours_raw"] is None and window["ours"] is None  # a known "no window", not "unknown"
    assert set(provenance) >= set(SPEC_FIELDS)
    # Every tensor of both sides is in the table, and all are equal.
    tensors = {row["key"]: row["status"] for row in report["tensors"]}
    assert set(tensors) == set(drafter.state_dict()) and set(tensors.values()) == {"equal"}
    html = (tmp_path / "report" / "index.html").read_text()
    assert "ours provenance" in html and ids_from.split(" (")[0] in html


def test_the_ignored_training_state_is_named(tmp_path, drafter, ref_dir):
    path = ddp_compiled_with_dataclass_config(tmp_path, drafter)
    main(["compare", "--ours", str(path), "--ref", str(ref_dir), "--static-only", "--out", str(tmp_path / "r")])
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["ours"]["foreign"]["entry"] == "model"
    assert report["ours"]["foreign"]["ignored_entries"] == {"scaler": "grad-scaler state", "rng_state": "RNG state"}
    assert report["ours"]["foreign"]["key_map"]["renamed"]["module._orig_mod.fc.weight"] == "fc.weight"
    info = [f for f in report["findings"] if f["key"] == "ignored entries of ours"]
    assert len(info) == 1 and "scaler (grad-scaler state)" in info[0]["message"]


def test_undeclared_fields_stay_unknown_and_name_their_flag(tmp_path, drafter, ref_dir, capsys):
    torch.save(state(drafter), tmp_path / "weights-only.pt")
    status = main(["compare", "--ours", str(tmp_path / "weights-only.pt"), "--ref", str(ref_dir), "--static-only",
                   "--out", str(tmp_path / "r")])
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert status == 0 and not report["ours"]["spec_complete"]
    provenance = report["ours"]["provenance"]
    for field in ("target_layer_ids", "num_target_layers", "mask_token_id", "block_size", "target_vocab_size"):
        assert provenance[field]["source"] == "unknown" and report["ours"]["spec"][field] is None
    assert "--ours-spec target_layer_ids=" in provenance["target_layer_ids"]["detail"]
    warnings = {f["key"] for f in report["findings"] if f["severity"] == "warning"}
    assert "unknown in ours: target_layer_ids" in warnings
    # Given on the command line, the same fields are known, with "cli" as their source.
    status = main(["compare", "--ours", str(tmp_path / "weights-only.pt"), "--ref", str(ref_dir), "--static-only",
                   "--out", str(tmp_path / "r2"), "--ours-spec", "target_layer_ids=1,3,4", "--ours-spec",
                   "num_target_layers=6", "--ours-spec", "mask_token_id=127", "--ours-spec", "block_size=8",
                   "--ours-spec", "vocab_size=128"])
    report = json.loads((tmp_path / "r2" / "report.json").read_text())
    assert status == 0 and report["ours"]["spec_complete"]
    assert report["ours"]["provenance"]["target_layer_ids"] == {"source": "cli",
                                                                 "detail": "--ours-spec target_layer_ids=1,3,4"}


def test_fc_width_is_a_divergence_even_when_the_layers_are_unknown(tmp_path, ref_dir):
    torch.manual_seed(1)
    four_of_five = DFlashDrafter(SPEC.replace(target_layer_ids=(1, 3)))
    torch.save({"model_state_dict": state(four_of_five)}, tmp_path / "ckpt.pt")
    status = main(["compare", "--ours", str(tmp_path / "ckpt.pt"), "--ref", str(ref_dir), "--static-only",
                   "--out", str(tmp_path / "r")])
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    divergences = [(f["component"], f["key"]) for f in report["findings"] if f["severity"] == "divergence"]
    assert status == 1 and divergences == [("fc_dims", "")]
    fc = next(f for f in report["findings"] if f["component"] == "fc_dims")
    assert "fc reads 2 target layers in ours but 3 in ref" in fc["message"] and "which layers ours reads is unknown" \
        in fc["message"]


def test_several_state_dicts_are_never_picked_silently(tmp_path, drafter, ref_dir, capsys):
    path = ema_and_model_picked_by_entry(tmp_path, drafter)
    status = main(["compare", "--ours", str(path), "--ref", str(ref_dir), "--static-only", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert "several entries hold state dicts (ema, model)" in err and "--ours-entry KEY" in err


def test_a_tensor_that_maps_to_nothing_is_a_weights_finding(tmp_path, drafter, ref_dir):
    tensors = state(drafter)
    tensors["layers.0.extra_gate.weight"] = torch.ones(4)
    torch.save({"model": tensors, "args": DECLARED}, tmp_path / "extra.pt")
    status = main(["compare", "--ours", str(tmp_path / "extra.pt"), "--ref", str(ref_dir), "--static-only",
                   "--out", str(tmp_path / "r")])
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    divergences = [(f["component"], f["key"]) for f in report["findings"] if f["severity"] == "divergence"]
    assert status == 1 and divergences == [("weights", "unexpected in ours")]
    row = next(r for r in report["tensors"] if r["key"] == "layers.0.extra_gate.weight")
    assert row["status"] == "unexpected in ours"


def test_unknown_names_get_a_proposed_key_map_that_works(tmp_path, drafter, ref_dir, capsys):
    rename = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
              "self_attn.o_proj": "attn.wo", "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
              "mlp.gate_proj": "ffn.w1", "mlp.up_proj": "ffn.w3", "mlp.down_proj": "ffn.w2",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}

    top = {"fc.weight": "fc_proj.weight", "hidden_norm.weight": "ctx_norm.weight", "norm.weight": "out_norm.weight"}

    def team_name(key: str) -> str:
        if key in top:
            return top[key]
        for a, b in rename.items():
            key = key.replace(a, b)
        return key.replace("layers.", "blocks.")

    tensors = {team_name(k): v for k, v in state(drafter).items()}
    assert not any(k.startswith("layers.") for k in tensors)
    torch.save({"model_state_dict": tensors, "args": DECLARED}, tmp_path / "team.pt")
    args = ["compare", "--ours", str(tmp_path / "team.pt"), "--ref", str(ref_dir), "--static-only",
            "--out", str(tmp_path / "r")]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "match no known scheme" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()  # nothing was applied, nothing written
    (tmp_path / "map.txt").write_text(captured.out)
    assert main(args + ["--key-map", str(tmp_path / "map.txt")]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    renamed = report["ours"]["foreign"]["key_map"]["renamed"]
    assert renamed["blocks.2.ffn.w2.weight"] == "layers.2.mlp.down_proj.weight"
    assert renamed["ctx_norm.weight"] == "hidden_norm.weight" and renamed["out_norm.weight"] == "norm.weight"
    assert report["ours"]["foreign"]["key_map"]["scheme"].startswith("--key-map")


@pytest.mark.parametrize("make, message", [
    (lambda root: torch.save({"epoch": 3, "args": DECLARED}, root / "x.pt"), r"x\.pt: no entry holds a state dict"),
    (lambda root: torch.save([torch.ones(2)], root / "x.pt"), r"x\.pt: holds a list, not a state dict"),
    (lambda root: (root / "x.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"),
     r"x\.safetensors: unreadable safetensors file"),
    (lambda root: (root / "x.pt").write_bytes(b"not a pickle"), r"x\.pt: not a readable torch checkpoint"),
    (lambda root: (root / "d").mkdir() or (root / "d" / "notes.txt").write_text("hi"),
     r"d: a directory with no drafter in it"),
    (lambda root: (root / "x.onnx").write_bytes(b"onnx"), r"x\.onnx: not a checkpoint file"),
])
def test_unloadable_layouts_say_what_was_found(tmp_path, ref_dir, capsys, make, message):
    make(tmp_path)
    path = next(p for p in tmp_path.iterdir())
    status = main(["compare", "--ours", str(path), "--ref", str(ref_dir), "--static-only", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    import re

    assert re.search(message, err), err


def test_an_incomplete_spec_blocks_eval_and_convert_naming_the_fields(tmp_path, drafter, capsys):
    torch.save(state(drafter), tmp_path / "w.pt")
    status = main(["convert", "--from", str(tmp_path / "w.pt"), "--to", str(tmp_path / "out"), "--format", "zlab"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert "convert needs the whole spec" in err and "target_layer_ids" in err and "--spec target_layer_ids=" in err
    assert not (tmp_path / "out").exists()


def test_foreign_converts_to_each_format_exactly(tmp_path, drafter):
    path = training_dict_with_namespace(tmp_path, drafter)
    assert main(["convert", "--from", str(path), "--to", str(tmp_path / "z"), "--format", "zlab"]) == 0
    assert main(["convert", "--from", str(path), "--to", str(tmp_path / "o.pt"), "--format", "ours"]) == 0
    for converted in (load_any(tmp_path / "z"), load_any(tmp_path / "o.pt")):
        assert converted.spec == SPEC
        assert all(torch.equal(converted.state_dict[k], v) for k, v in drafter.state_dict().items())
    ours = load_any(tmp_path / "o.pt")
    assert ours.recipe.gamma == 4.0 and "loss_fn" in ours.recipe_unknown  # never declared: still unknown


def test_eval_runs_a_foreign_checkpoint(tmp_path, test_world):
    from tests.helpers import world_drafter

    torch.manual_seed(0)
    model = world_drafter(test_world, (0, 2), seed=0)  # the test target has 4 layers: none is the final one
    spec = model.spec
    torch.save({"model_state_dict": state(model, "module."),
                "args": argparse.Namespace(target_layers=[0, 2], mask_token_id=spec.mask_token_id,
                                           block_size=spec.block_size)}, tmp_path / "ckpt.pt")
    out = tmp_path / "foreign.json"
    assert main(["eval", "--drafter", str(tmp_path / "ckpt.pt"), "--target", str(test_world.target), "--prompts",
                 str(test_world.prompts), "--max-new-tokens", "8", "--json", str(out)]) == 0
    save_zlab_dir(tmp_path / "z", spec, model.state_dict())
    assert main(["eval", "--drafter", str(tmp_path / "z"), "--target", str(test_world.target), "--prompts",
                 str(test_world.prompts), "--max-new-tokens", "8", "--json", str(tmp_path / "z.json")]) == 0
    foreign, zlab = json.loads(out.read_text()), json.loads((tmp_path / "z.json").read_text())
    assert [p["rounds"] for p in foreign["prompts"]] == [p["rounds"] for p in zlab["prompts"]]

    # compare's τ audit and convert to speculators take the same file (target depth and vocab from --target).
    status = main(["compare", "--ours", str(tmp_path / "ckpt.pt"), "--ref", str(tmp_path / "z"), "--target",
                   str(test_world.target), "--prompts", str(test_world.prompts), "--max-new-tokens", "8",
                   "--out", str(tmp_path / "report")])
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert status == 0 and report["tau"]["mean"]["ours"] == report["tau"]["mean"]["ref"]
    assert report["ours"]["provenance"]["num_target_layers"]["source"] == "inferred"
    assert main(["convert", "--from", str(tmp_path / "ckpt.pt"), "--to", str(tmp_path / "spec"), "--format",
                 "speculators", "--target", str(test_world.target)]) == 0
    converted = load_any(tmp_path / "spec", target_dir=test_world.target)
    assert converted.spec == spec
    assert all(torch.equal(converted.state_dict[k], v) for k, v in model.state_dict().items())


CANARY_MODULE = '''
import pathlib
CANARY = pathlib.Path(__file__).with_name("canary")

class TrainArgs:
    """A class whose every hook would leave the canary behind, were it ever run."""
    def __init__(self, *args, **kwargs):
        CANARY.write_text("__init__ ran")
    def __setstate__(self, state):
        CANARY.write_text("__setstate__ ran")
    def __reduce__(self):
        return (TrainArgs, (), {"gamma": 7.0})
'''


def test_no_pickled_code_ever_runs(tmp_path, drafter, ref_dir, capsys, monkeypatch):
    import os
    import subprocess
    import sys

    # A class that is importable right now: it must still be read as data, never imported or run.
    (tmp_path / "team_args.py").write_text(CANARY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import team_args

    canary = tmp_path / "canary"
    torch.save({"model": state(drafter), "args": team_args.TrainArgs.__new__(team_args.TrainArgs)},
               tmp_path / "class.pt")
    canary.unlink(missing_ok=True)
    del sys.modules["team_args"]
    status = main(["compare", "--ours", str(tmp_path / "class.pt"), "--ref", str(ref_dir), "--static-only",
                   "--out", str(tmp_path / "r")])
    assert not canary.exists() and "team_args" not in sys.modules
    report = json.loads((tmp_path / "r" / "report.json").read_text())  # its state was still read, as data
    assert report["ours"]["provenance"]["recipe.gamma"] == {"source": "declared", "detail": "class.pt: args.gamma"}
    assert status == 1 and [f["key"] for f in report["findings"] if f["severity"] == "divergence"] == ["gamma"]
    capsys.readouterr()

    class SystemCall:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    class Spawn:
        def __reduce__(self):
            return (subprocess.Popen, (["touch", str(canary)],))

    class Exec:
        def __reduce__(self):
            return (exec, (f"open({str(canary)!r}, 'w')",))

    # Function calls (the usual payloads) refuse the file, naming the function.
    for payload, named in ((SystemCall(), "system"), (Exec(), "exec")):
        for legacy in (False, True):
            path = tmp_path / f"evil-{named}-{legacy}.pt"
            torch.save({"model": state(drafter), "args": payload}, path, _use_new_zipfile_serialization=not legacy)
            status = main(["compare", "--ours", str(path), "--ref", str(ref_dir), "--static-only",
                           "--out", str(tmp_path / "r2")])
            err = capsys.readouterr().err.strip()
            assert status == 2 and len(err.splitlines()) == 1 and "refusing to load it (nothing was run)" in err
            assert named in err and not canary.exists()
    # A class-like global (here subprocess.Popen, under whatever module name the pickler records) is either
    # refused or stood in for: its constructor never runs.
    torch.save({"model": state(drafter), "args": Spawn()}, tmp_path / "spawn.pt")
    status = main(["compare", "--ours", str(tmp_path / "spawn.pt"), "--ref", str(ref_dir), "--static-only",
                   "--out", str(tmp_path / "r3")])
    assert status in (0, 2) and not canary.exists()
