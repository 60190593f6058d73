"""The layouts training frameworks save in: what opens (the gallery in test_foreign_checkpoints.py audits
each clean against a z-lab twin), and what is refused, with one line saying what was found and what to
pass. No internal exception name ever reaches the user, and nothing in a checkpoint is ever run."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import tarfile

import pytest
import torch
import yaml

from dflash_audit.cli import main
from dflash_audit.formats import detect_format, load_any
from tests.trainer_layouts import (  # noqa: F401 (drafter, ref_dir, fsdp2_dcp: fixtures)
    SPEC,
    drafter,
    fsdp2_dcp,
    ref_dir,
    HYDRA_CONFIG,
    accelerate_folder_in_hydra_run,
    add_member,
    dcp_folder_in_hydra_run,
    dcp_folder_with_args,
    megatron_folder,
    nemo_archive,
    state,
    zero2_folder,
    zero3_folder,
)

INTERNAL_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback")


def compare(path, ref_dir, out, *flags) -> tuple[int, dict | None]:
    status = main(["compare", "--ours", str(path), "--ref", str(ref_dir), "--static-only", "--out", str(out), *flags])
    report = out / "report.json"
    return status, json.loads(report.read_text()) if report.is_file() else None


def refused(capsys, path, ref_dir, tmp_path, *flags) -> str:
    status, _ = compare(path, ref_dir, tmp_path / "refused", *flags)
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("dflash-audit: error: ") and not INTERNAL_NAME.search(err), err
    assert not (tmp_path / "refused").exists()
    return err


# -- DeepSpeed ZeRO-3 ------------------------------------------------------------------------------------
def test_zero3_weights_are_rebuilt_exactly_from_the_rank_partitions(tmp_path, drafter):
    loaded = load_any(zero3_folder(tmp_path, drafter, world=3))  # 3 ranks: every parameter padded
    assert loaded.spec == SPEC
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in drafter.state_dict().items())
    assert loaded.foreign["layout"].startswith("DeepSpeed ZeRO-3 (3 partitions")
    assert loaded.foreign["placeholders"] == []  # every placeholder was replaced by its rebuilt weight


def test_a_zero3_model_states_file_passed_alone_reads_its_sibling_partitions(tmp_path, drafter):
    folder = zero3_folder(tmp_path, drafter)
    loaded = load_any(folder / "global_step10" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in drafter.state_dict().items())


def test_a_zero3_model_states_file_without_its_partitions_names_the_cause_and_the_command(
        tmp_path, drafter, ref_dir, capsys):
    """The reported failure: `ZeroDivisionError: integer modulo by zero` on the placeholders."""
    folder = zero3_folder(tmp_path, drafter)
    lone = tmp_path / "lone"
    lone.mkdir()
    os.replace(folder / "global_step10" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
               lone / "mp_rank_00_model_states.pt")
    err = refused(capsys, lone / "mp_rank_00_model_states.pt", ref_dir, tmp_path)
    assert "DeepSpeed ZeRO-3" in err and "0-element placeholders" in err and "_optim_states.pt" in err
    assert "python zero_to_fp32.py" in err


def test_a_missing_rank_partition_is_refused(tmp_path, drafter, ref_dir, capsys):
    folder = zero3_folder(tmp_path, drafter)
    (folder / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    err = refused(capsys, folder, ref_dir, tmp_path)
    assert "partition_count 2, but 1 *_optim_states.pt file(s)" in err and "python zero_to_fp32.py" in err


def test_latest_naming_no_folder_is_refused(tmp_path, drafter, ref_dir, capsys):
    folder = zero2_folder(tmp_path, drafter)
    (folder / "latest").write_text("global_step99")
    err = refused(capsys, folder, ref_dir, tmp_path)
    assert "latest: names the tag 'global_step99'" in err and "pass the tag folder" in err


def test_zero2_reads_the_model_states_and_names_the_engine_entries(tmp_path, drafter, ref_dir):
    folder = zero2_folder(tmp_path, drafter)
    status, report = compare(folder / "global_step10" / "mp_rank_00_model_states.pt", ref_dir, tmp_path / "r")
    assert status == 0
    foreign = report["ours"]["foreign"]
    assert foreign["entry"] == "module" and foreign["layout"] == "DeepSpeed ZeRO-1/2 model states"
    assert "param_shapes" in foreign["ignored_entries"]["DeepSpeed engine entries"]
    assert "random_ltd" not in foreign["ignored_entries"]  # not RNG state, whatever its name says


# -- placeholders -------------------------------------------------------------------------------------
def test_a_file_of_only_empty_tensors_is_trouble_not_a_verdict(tmp_path, drafter, ref_dir, capsys):
    torch.save({k: torch.empty(0) for k in drafter.state_dict()}, tmp_path / "empty.pt")
    err = refused(capsys, tmp_path / "empty.pt", ref_dir, tmp_path)
    assert f"all {len(drafter.state_dict())} tensors are 0-element placeholders" in err


def test_some_empty_tensors_are_left_out_and_reported_missing(tmp_path, drafter, ref_dir):
    tensors = state(drafter)
    tensors["layers.0.mlp.up_proj.weight"] = torch.empty(0)
    torch.save({"model": tensors, "args": {"fc_layers": [1, 3, 4], "target_num_layers": 6, "mask_id": 127,
                                           "block_size": 8, "vocab_size": 128}}, tmp_path / "partial.pt")
    status, report = compare(tmp_path / "partial.pt", ref_dir, tmp_path / "r")
    assert status == 1 and report["ours"]["foreign"]["placeholders"] == ["layers.0.mlp.up_proj.weight"]
    row = next(r for r in report["tensors"] if r["key"] == "layers.0.mlp.up_proj.weight")
    assert row["status"] == "missing in ours"


# -- torch.distributed.checkpoint -------------------------------------------------------------------------
def test_dcp_accounts_for_optimizer_state_and_reads_only_the_drafter(tmp_path, drafter, ref_dir):
    folder = dcp_folder_in_hydra_run(tmp_path, drafter)
    assert detect_format(folder) == "foreign"
    status, report = compare(folder, ref_dir, tmp_path / "r")
    foreign = report["ours"]["foreign"]
    assert status == 0 and foreign["entry"] == "model" and foreign["ignored_entries"] == {
        "optimizer": "optimizer state"}
    assert [os.path.basename(f) for f in foreign["files"]] == [".metadata", "__0_0.distcp"]
    assert report["ours"]["provenance"]["recipe.gamma"] == {"source": "declared",
                                                           "detail": "../../.hydra/config.yaml: loss.gamma"}


def test_dcp_with_two_state_dicts_asks_for_the_entry(tmp_path, drafter, ref_dir, capsys):
    err = refused(capsys, dcp_folder_with_args(tmp_path, drafter), ref_dir, tmp_path)
    assert "several entries hold state dicts (ema, model)" in err and "--ours-entry KEY" in err


class Payload:
    def __reduce__(self):
        return (os.system, ("touch canary",))


def test_dcp_metadata_is_never_unpickled_with_plain_pickle(tmp_path, drafter, ref_dir, capsys, monkeypatch):
    folder = dcp_folder_with_args(tmp_path, drafter)
    monkeypatch.chdir(tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    err = refused(capsys, folder, ref_dir, tmp_path)
    assert "posix.system" in err or "os.system" in err
    assert "refusing to load it (nothing was run)" in err and not (tmp_path / "canary").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / ".metadata").write_bytes(b"\x80\x04garbage"), "not a readable torch.distributed.checkpoint"),
    (lambda f: (f / "__0_0.distcp").unlink(), "the *.distcp data cannot be read"),
])
def test_a_damaged_dcp_folder_is_one_line(tmp_path, drafter, ref_dir, capsys, damage, message):
    folder = dcp_folder_with_args(tmp_path, drafter)
    damage(folder)
    assert message in refused(capsys, folder, ref_dir, tmp_path, "--ours-entry", "model")


# -- Megatron, NeMo, accelerate -------------------------------------------------------------------------
def test_megatron_split_across_ranks_is_refused_naming_them(tmp_path, drafter, ref_dir, capsys):
    folder = megatron_folder(tmp_path, drafter)
    (folder / "iter_0000100" / "mp_rank_01").mkdir()
    err = refused(capsys, folder, ref_dir, tmp_path)
    assert "split across 2 model-parallel ranks (mp_rank_00, mp_rank_01)" in err and "merged file" in err


def nemo_with(tmp_path, members: dict[str, bytes]):
    path = tmp_path / "odd.nemo"
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            add_member(archive, name, data)
    return path


def test_nemo_layouts_that_cannot_be_read_say_what_was_found(tmp_path, drafter, ref_dir, capsys):
    buffer = io.BytesIO()
    torch.save(state(drafter), buffer)
    sharded = nemo_with(tmp_path, {"mp_rank_00/model_weights.ckpt": buffer.getvalue(),
                                   "mp_rank_01/model_weights.ckpt": buffer.getvalue()})
    assert "a model-parallel .nemo archive (mp_rank_00/model_weights.ckpt" in refused(capsys, sharded, ref_dir,
                                                                                       tmp_path)
    escaping = nemo_with(tmp_path, {"../model_weights.ckpt": buffer.getvalue()})
    assert "no model_weights.ckpt in the archive" in refused(capsys, escaping, ref_dir, tmp_path)
    assert not (tmp_path.parent / "model_weights.ckpt").exists()
    (tmp_path / "broken.nemo").write_bytes(b"not a tar at all")
    assert "not a readable .nemo archive" in refused(capsys, tmp_path / "broken.nemo", ref_dir, tmp_path)


def test_nemo_weights_behind_a_link_are_refused(tmp_path, drafter, ref_dir, capsys):
    path = tmp_path / "link.nemo"
    with tarfile.open(path, "w:") as archive:
        link = tarfile.TarInfo("model_weights.ckpt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        archive.addfile(link)
    assert "is not a regular file in the archive" in refused(capsys, path, ref_dir, tmp_path)


def test_nemo_leaves_no_temporary_files(tmp_path, drafter, monkeypatch):
    import tempfile

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    loaded = load_any(nemo_archive(tmp_path, drafter))
    assert loaded.spec == SPEC and list(scratch.iterdir()) == []


def test_accelerate_pickles_are_listed_never_unpickled(tmp_path, drafter, ref_dir):
    folder = accelerate_folder_in_hydra_run(tmp_path, drafter)
    status, report = compare(folder, ref_dir, tmp_path / "r")
    assert status == 0 and not (tmp_path / "canary").exists()
    assert report["ours"]["foreign"]["ignored_entries"]["random_states_0.pkl"].startswith("RNG state")
    assert [os.path.basename(f) for f in report["ours"]["foreign"]["files"]] == ["model.safetensors"]


# -- declarations in nested configs ----------------------------------------------------------------------
def test_a_hydra_gamma_is_reported_with_its_file_and_dotted_key(tmp_path, drafter, ref_dir):
    folder = dcp_folder_in_hydra_run(tmp_path, drafter)
    run = folder.parents[1]
    config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    config["loss"]["gamma"] = 7.0
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["loss.gamma=7"]))
    status, report = compare(folder, ref_dir, tmp_path / "r")
    assert status == 1 and [f["key"] for f in report["findings"] if f["severity"] == "divergence"] == ["gamma"]
    assert report["ours"]["provenance"]["recipe.gamma"]["detail"] == "../../.hydra/config.yaml: loss.gamma"


def test_two_values_for_one_field_name_both_places(tmp_path, drafter, ref_dir):
    folder = dcp_folder_in_hydra_run(tmp_path, drafter)
    (folder.parents[1] / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["training.block_size=16"]))
    status, report = compare(folder, ref_dir, tmp_path / "r")
    contradiction = next(f for f in report["findings"] if f["key"] == "contradiction in ours: block_size")
    assert status == 1 and contradiction["severity"] == "divergence"
    assert "8 (../../.hydra/config.yaml: training.block_size)" in contradiction["message"]
    assert "16 (../../.hydra/overrides.yaml: training.block_size)" in contradiction["message"]


def test_hydra_interpolations_are_resolved_or_left_unread(tmp_path, drafter):
    folder = dcp_folder_in_hydra_run(tmp_path, drafter)
    config = json.loads(json.dumps(HYDRA_CONFIG))
    config["data"] = {"block": 8}
    config["training"]["block_size"] = "${data.block}"
    config["model"]["mask_token_id"] = "${oc.env:MASK_ID}"
    (folder.parents[1] / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    loaded = load_any(folder)
    assert loaded.provenance["block_size"].detail == "../../.hydra/config.yaml: training.block_size"
    assert loaded.known_spec["block_size"] == 8 and "mask_token_id" not in loaded.known_spec


def test_fsdp2_shards_are_joined_into_whole_tensors(fsdp2_dcp, drafter):
    folder = fsdp2_dcp
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    loaded = load_any(folder)
    assert loaded.spec == SPEC and loaded.foreign["ignored_entries"] == {"optimizer": "optimizer state"}
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in drafter.state_dict().items())


def test_an_hf_trainer_folder_around_a_zero3_checkpoint_is_rebuilt_and_its_files_named(tmp_path, drafter, ref_dir):
    """HF Trainer under ZeRO-3 (no gathered 16-bit weights): checkpoint-10/ holds `latest`, global_step10/
    and the trainer's own files, but no model.safetensors."""
    folder = zero3_folder(tmp_path, drafter)
    torch.save({"state": "not read"}, folder / "scheduler.pt")
    torch.save({"python": "not read"}, folder / "rng_state_0.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10, "log_history": []}))
    status, report = compare(folder, ref_dir, tmp_path / "r")
    ignored = report["ours"]["foreign"]["ignored_entries"]
    assert status == 0 and ignored["scheduler.pt"] == "scheduler state (not read)"
    assert ignored["rng_state_0.pth"] == "RNG state (not read)"
    assert report["ours"]["foreign"]["layout"].startswith("DeepSpeed ZeRO-3")


def test_an_unforeseen_failure_while_reading_never_shows_an_exception_name(tmp_path, drafter, ref_dir, capsys,
                                                                           monkeypatch):
    """The guard behind every named refusal: a fault no check foresaw still reads as one line about the file."""
    import dflash_audit.formats.foreign as foreign

    def modulo_by_zero(*args, **kwargs):
        return 1 % 0

    torch.save(state(drafter), tmp_path / "drafter.pt")
    monkeypatch.setattr(foreign, "infer", modulo_by_zero)
    err = refused(capsys, tmp_path / "drafter.pt", ref_dir, tmp_path)
    assert "drafter.pt: cannot be read as a drafter checkpoint (integer modulo by zero)" in err
    assert main(["compare", "--ours", str(tmp_path / "drafter.pt"), "--ref", str(ref_dir), "--static-only",
                 "--out", str(tmp_path / "r2"), "--debug"]) == 2
    assert "ZeroDivisionError" in capsys.readouterr().err  # --debug still shows the traceback


def test_dcp_loads_no_optimizer_tensor(tmp_path, drafter, monkeypatch):
    from dflash_audit.formats.layouts import dcp

    asked: list[set[str]] = []
    real = dcp.load_keys
    monkeypatch.setattr(dcp, "load_keys", lambda folder, metadata, keys: asked.append(set(keys)) or real(
        folder, metadata, keys))
    loaded = load_any(dcp_folder_in_hydra_run(tmp_path, drafter))
    assert loaded.spec == SPEC
    tensors_read = asked[-1]
    assert tensors_read == {f"model.{k}" for k in drafter.state_dict()}  # the drafter's tensors, nothing else
    from dflash_audit.formats.layouts.dcp import read_metadata

    saved = read_metadata(dcp_folder_in_hydra_run(tmp_path / "again", drafter)).state_dict_metadata
    assert any("exp_avg" in key for key in saved)  # the moments are there, and were never read
    assert not any(key.startswith("optimizer.") and "exp_avg" in key for keys in asked for key in keys)
