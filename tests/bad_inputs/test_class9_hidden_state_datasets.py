"""Class 9, hidden-state datasets fed to `data-check`: corrupt safetensors (garbage, truncated, a header past any
file, a header of the wrong kind), pickles that need more than `weights_only=True`, records of the wrong dtype or
shape, records of zero tokens, folders with nothing to read, symlink loops and special files in a record's name.
Each is one line naming what is wrong and exit 2 (never the catch-all), nothing the user made is changed, and no
report folder is left behind."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.bad_inputs.cli_run import assert_refused, run, tree_digest

TOKENS = 12


def config(world: Path) -> dict:
    return json.loads((world / "target" / "config.json").read_text())


def sound(world: Path, tokens: int = TOKENS, layers: int = 2) -> dict[str, torch.Tensor]:
    """A record shaped as vLLM's connector writes one: `hidden_states` [T, L, H] and `token_ids` [T]."""
    hidden = config(world)["hidden_size"]
    torch.manual_seed(0)
    return {"hidden_states": torch.randn(tokens, layers, hidden), "token_ids": torch.arange(tokens) % 50}


def safetensors(path: Path, tensors: dict) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


class Hostile:
    def __reduce__(self):  # a pickle that runs a command when loaded without weights_only
        return (os.system, ("echo never",))


def _header(path: Path, header: bytes, body: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)


# name -> (write the dataset into the folder given, what the refusal names)
CASES = {
    "garbage_bytes": (lambda d, w: (d / "hs_0.safetensors").write_bytes(b"\xff" * 64), "hs_0.safetensors"),
    "truncated": (lambda d, w: (safetensors(d / "hs_0.safetensors", sound(w)),
                                (d / "hs_0.safetensors").write_bytes((d / "hs_0.safetensors").read_bytes()[:300])),
                  "hs_0.safetensors"),
    "header_past_the_file": (lambda d, w: (d / "hs_0.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"{}"),
                             "hs_0.safetensors"),
    "header_a_list": (lambda d, w: _header(d / "hs_0.safetensors", b"[1, 2, 3]"), "hs_0.safetensors"),
    "header_offsets_past_the_data": (lambda d, w: _header(
        d / "hs_0.safetensors", json.dumps({"hidden_states": {"dtype": "F32", "shape": [4, 4],
                                                              "data_offsets": [0, 1 << 40]}}).encode()),
        "hs_0.safetensors"),
    "empty_file": (lambda d, w: (d / "hs_0.safetensors").write_bytes(b""), "hs_0.safetensors"),
    "states_of_integers": (lambda d, w: safetensors(d / "hs_0.safetensors", {
        **sound(w), "hidden_states": torch.ones(TOKENS, 2, config(w)["hidden_size"], dtype=torch.int64)}),
        "hs_0.safetensors"),
    "states_of_one_dimension": (lambda d, w: safetensors(d / "hs_0.safetensors", {
        **sound(w), "hidden_states": torch.randn(TOKENS)}), "hs_0.safetensors"),
    "states_of_another_width": (lambda d, w: safetensors(d / "hs_0.safetensors", {
        **sound(w), "hidden_states": torch.randn(TOKENS, 2, config(w)["hidden_size"] + 3)}), "hs_0.safetensors"),
    "no_states": (lambda d, w: safetensors(d / "hs_0.safetensors", {"token_ids": torch.arange(TOKENS)}),
                  "hs_0.safetensors"),
    "no_token_ids": (lambda d, w: safetensors(d / "hs_0.safetensors", {"hidden_states": sound(w)["hidden_states"]}),
                     "hs_0.safetensors"),
    "token_ids_of_floats": (lambda d, w: safetensors(d / "hs_0.safetensors", {
        **sound(w), "token_ids": torch.arange(TOKENS, dtype=torch.float32)}), "hs_0.safetensors"),
    "token_ids_past_the_vocabulary": (lambda d, w: safetensors(d / "hs_0.safetensors", {
        **sound(w), "token_ids": torch.full((TOKENS,), 1 << 40)}), "hs_0.safetensors"),
    "negative_token_ids": (lambda d, w: safetensors(d / "hs_0.safetensors", {
        **sound(w), "token_ids": torch.full((TOKENS,), -1)}), "hs_0.safetensors"),
    "token_ids_of_two_dimensions": (lambda d, w: safetensors(d / "hs_0.safetensors", {
        **sound(w), "token_ids": torch.arange(TOKENS).reshape(3, 4)}), "hs_0.safetensors"),
    "zero_tokens": (lambda d, w: safetensors(d / "hs_0.safetensors", sound(w, tokens=0)), "hs_0.safetensors"),
    "zero_layers": (lambda d, w: safetensors(d / "hs_0.safetensors", sound(w, layers=0)), "hs_0.safetensors"),
    "ckpt_states_of_zero_width": (lambda d, w: torch.save({"input_ids": torch.arange(TOKENS),
                                                           "hidden_states": torch.zeros(TOKENS, 0)}, d / "data_0.ckpt"),
                                  "data_0.ckpt"),
    "a_record_beside_a_broken_one": (lambda d, w: (safetensors(d / "hs_0.safetensors", sound(w)),
                                                   (d / "hs_1.safetensors").symlink_to(d / "gone")), "hs_1.safetensors"),
    "pickle_running_a_command": (lambda d, w: (d / "data_0.ckpt").write_bytes(pickle.dumps({"input_ids": Hostile()})),
                                 "data_0.ckpt"),
    "torch_save_of_an_object": (lambda d, w: torch.save({"input_ids": Hostile()}, d / "data_0.ckpt"), "data_0.ckpt"),
    "gzipped_hostile_pickle": (lambda d, w: (d / "data_0.ckpt.gz").write_bytes(gzip.compress(pickle.dumps(Hostile()))),
                               "data_0.ckpt.gz"),
    "gzip_of_garbage": (lambda d, w: (d / "data_0.ckpt.gz").write_bytes(b"\x1f\x8b" + b"\x00" * 30), "data_0.ckpt.gz"),
    "ckpt_holding_a_list": (lambda d, w: torch.save([torch.zeros(3)], d / "data_0.ckpt"), "data_0.ckpt"),
    "ckpt_without_states": (lambda d, w: torch.save({"input_ids": torch.arange(TOKENS),
                                                     "loss_mask": torch.ones(TOKENS)}, d / "data_0.ckpt"),
                            "data_0.ckpt"),
    "ckpt_states_not_a_multiple_of_the_width": (lambda d, w: torch.save({
        "input_ids": torch.arange(TOKENS), "loss_mask": torch.ones(TOKENS),
        "hidden_states": torch.randn(TOKENS, config(w)["hidden_size"] * 2 + 5)}, d / "data_0.ckpt"), "data_0.ckpt"),
    "ckpt_truncated": (lambda d, w: (torch.save({"input_ids": torch.arange(TOKENS)}, d / "data_0.ckpt"),
                                     (d / "data_0.ckpt").write_bytes((d / "data_0.ckpt").read_bytes()[:40])),
                       "data_0.ckpt"),
    "record_name_a_folder": (lambda d, w: (d / "hs_0.safetensors").mkdir(), "hs_0.safetensors"),
    "specforge_record_name_a_folder": (lambda d, w: (d / "data_0.ckpt").mkdir(), "data_0.ckpt"),
    "record_name_a_fifo": (lambda d, w: os.mkfifo(d / "hs_0.safetensors"), "hs_0.safetensors"),
    "record_a_dangling_link": (lambda d, w: (d / "hs_0.safetensors").symlink_to(d / "gone.safetensors"),
                               "hs_0.safetensors"),
    "record_links_in_a_loop": (lambda d, w: ((d / "hs_0.safetensors").symlink_to(d / "hs_1.safetensors"),
                                             (d / "hs_1.safetensors").symlink_to(d / "hs_0.safetensors")),
                               "hs_0.safetensors"),
    "nothing_to_read": (lambda d, w: None, "dataset"),
    "only_other_files": (lambda d, w: ((d / "README.md").write_text("notes\n"), (d / "run.log").write_text("x\n")),
                         "dataset"),
    "a_folder_linking_to_itself": (lambda d, w: (d / "loop").symlink_to(d), "dataset"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_dataset_is_one_line_and_exit_2(world, tmp_path, capsys, case):
    write, named = CASES[case]
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    write(dataset, world)
    before = tree_digest(tmp_path)
    ids = "0,1" if ".ckpt" in named else "1,2"  # z-lab's ids for SpecForge, vLLM's for the safetensors writers
    code, _, err = run(["data-check", dataset, "--target", world / "target", "--out", tmp_path / "report",
                        "--layer-ids", ids], capsys)
    assert_refused(code, err, named)
    assert tree_digest(tmp_path) == before  # the dataset as it was, no report folder, no temp file


def test_a_dataset_that_is_a_link_loop_itself_is_one_line(world, tmp_path, capsys):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    before = tree_digest(tmp_path)
    code, _, err = run(["data-check", tmp_path / "a", "--target", world / "target", "--out", tmp_path / "r"], capsys)
    assert_refused(code, err, str(tmp_path / "a"))
    assert tree_digest(tmp_path) == before
