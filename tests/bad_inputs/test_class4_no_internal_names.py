"""Class 4, internal exception names as the user's message: every bad value is named where it is read
(file, field, what was expected), every OS fault is one line naming the path and the fault (read-only, full
disk, name too long, loops, not a directory), nothing is left behind, and a fault nobody foresaw is one line
ending "rerun with --debug"."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import safetensors.torch
import torch

from foundation import atomic
from tests.bad_inputs.cli_run import CLASS_NAME, assert_refused, run, tree_digest


def zlab_with(world, tmp_path, name, **fields):
    folder = tmp_path / name
    shutil.copytree(world / "zref", folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in fields.items():
        if key.startswith("dflash_config."):
            config["dflash_config"][key.split(".", 1)[1]] = value
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def static(world, ref, tmp_path):
    return ["compare", "--ours", world / "ours.pt", "--ref", ref, "--out", tmp_path / "report"]


def eval_argv(world, *extra, prompts=None):
    return ["eval", "--drafter", world / "ours.pt", "--target", world / "target", "--prompts",
            prompts or world / "prompts.jsonl", "--max-new-tokens", "4", *extra]


def train_argv(world, tmp_path, *extra):
    return ["train", "--target", world / "target", "--data", world / "data.jsonl", "--out", tmp_path / "c.pt",
            "--steps", "1", "--seq-len", "48", "--block-size", "4", "--fc-layers", "0,1", *extra]


@pytest.mark.parametrize("field, value", [("intermediate_size", 10**21), ("hidden_size", 2**40),
                                          ("vocab_size", 10**30), ("num_hidden_layers", True)])
def test_absurd_drafter_sizes_name_the_field(world, tmp_path, capsys, field, value):
    ref = zlab_with(world, tmp_path, "huge", **{field: value})
    code, _, err = run(static(world, ref, tmp_path), capsys)
    assert_refused(code, err, "huge", field)


def test_a_section_of_the_wrong_type_names_it(world, tmp_path, capsys):
    ref = zlab_with(world, tmp_path, "list-section", dflash_config=[1, 2])
    code, _, err = run(static(world, ref, tmp_path), capsys)
    assert_refused(code, err, "list-section/config.json", "dflash_config")


def test_a_step_in_words_names_the_entry(world, tmp_path, capsys):
    payload = torch.load(world / "ours.pt", weights_only=True)
    payload["step"] = "three"
    torch.save(payload, tmp_path / "words.pt")
    code, _, err = run(static(world, tmp_path / "words.pt", tmp_path), capsys)
    assert_refused(code, err, "words.pt", "'step'", "three")


def test_symlink_loops_are_named(world, tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for argv, names in ((eval_argv(world, prompts=loop), ["loop"]),
                        (eval_argv(world, "--json", loop / "x.json"), ["--json", "loop"]),
                        (eval_argv(world, "--mode", "offline", "--cache-dir", loop / "c"), ["loop"]),
                        (["compare", "--ours", world / "plain.pt", "--ref", world / "zref", "--out", tmp_path / "r",
                          "--key-map", loop], ["loop"]),
                        (["eval", "--drafter", world / "ours.pt", "--target", loop, "--prompts",
                          world / "prompts.jsonl"], ["--target", "loop"]),
                        (static(world, loop, tmp_path), ["loop"])):
        code, _, err = run(argv, capsys)
        assert_refused(code, err, *names)


def test_a_path_through_a_file_is_named(world, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine\n")
    for argv, flag in ((eval_argv(world, "--json", tmp_path / "notes.txt" / "out.json"), "--json"),
                       (static(world, world / "zref", tmp_path)[:-1] + [tmp_path / "notes.txt" / "r"], "--out"),
                       (["train", "--target", world / "target", "--data", world / "data.jsonl", "--out",
                         tmp_path / "notes.txt" / "c.pt", "--steps", "1"], "--out")):
        code, _, err = run(argv, capsys)
        assert_refused(code, err, flag, "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def _no_temp_left(folder):
    return not any(p.name == atomic.TMP_DIR for p in folder.rglob("*"))


def test_a_read_only_destination_is_named(world, tmp_path, capsys, monkeypatch):
    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(atomic.Path, "mkdir", read_only)
    code, _, err = run(["convert", "--from", world / "zref", "--to", tmp_path / "z", "--format", "zlab"], capsys)
    assert_refused(code, err, str(tmp_path / "z"), "Read-only file system")


@pytest.mark.parametrize("fmt, writer, fault", [
    ("zlab", "safetensors", safetensors.SafetensorError("Error while serializing: I/O error: No space left on "
                                                        "device (os error 28)")),
    ("ours", "torch", RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")),
    ("ours", "torch", RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing "
                                   "file data/0: file write failed")),
])
def test_a_full_disk_is_named_and_leaves_nothing(world, tmp_path, capsys, monkeypatch, fmt, writer, fault):
    """The exact exceptions safetensors and torch raise on a full tmpfs (measured on a 32 KiB tmpfs)."""
    def full(*args, **kwargs):
        raise fault

    if writer == "safetensors":
        import drafter_files.zlab_format

        monkeypatch.setattr(drafter_files.zlab_format, "save_file", full)
    else:
        monkeypatch.setattr(torch, "save", full)
    dest = tmp_path / ("z" if fmt == "zlab" else "o.pt")
    code, _, err = run(["convert", "--from", world / "zref", "--to", dest, "--format", fmt], capsys)
    line = assert_refused(code, err, str(dest), "cannot write")
    assert "disk" in line.lower() or "space" in line.lower()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_legal_long_name_is_written_and_a_too_long_one_named(world, tmp_path, capsys):
    legal = tmp_path / ("r" * 250 + ".json")
    assert run(static(world, world / "zref", tmp_path) + ["--json", legal], capsys)[0] in (0, 1)
    assert json.loads(legal.read_text())["schema"] == "dflash-audit/1"
    too_long = tmp_path / ("r" * 300 + ".json")
    code, _, err = run(static(world, world / "zref", tmp_path) + ["--json", too_long, "--force"], capsys)
    assert_refused(code, err, "--json", "file name too long")
    assert _no_temp_left(tmp_path)


@pytest.mark.parametrize("flag, value", [("--lr", "-1"), ("--lr", "0"), ("--warmup", "-3"), ("--seq-len", "10000000000")])
def test_train_settings_out_of_range_are_named(world, tmp_path, capsys, flag, value):
    argv = train_argv(world, tmp_path)
    argv = argv[:argv.index(flag) + 1] + [value] + argv[argv.index(flag) + 2:] if flag in argv else argv + [flag, value]
    code, _, err = run(argv, capsys)
    assert_refused(code, err, flag + ":")  # the flag typed, never the field
    assert not (tmp_path / "c.pt").exists()


def test_deeply_nested_prompts_are_named(world, tmp_path, capsys):
    prompts = tmp_path / "deep.jsonl"
    prompts.write_text('{"id": "a", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    code, _, err = run(eval_argv(world, prompts=prompts), capsys)
    assert_refused(code, err, "deep.jsonl:1", "nested too deeply")


def test_a_lone_surrogate_in_a_prompt_is_named(world, tmp_path, capsys):
    prompts = tmp_path / "surrogate.jsonl"
    prompts.write_text('{"id": "a", "prompt": "def f(): \\ud800"}\n')
    code, _, err = run(eval_argv(world, prompts=prompts), capsys)
    assert_refused(code, err, "surrogate.jsonl:1", "surrogate")


def test_a_target_whose_weights_do_not_fit_its_config(world, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(world / "target", target)
    tensors = safetensors.torch.load_file(target / "model.safetensors")
    name = next(k for k in tensors if k.endswith("mlp.up_proj.weight"))
    tensors[name] = tensors[name][:-1].contiguous()
    safetensors.torch.save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run(["eval", "--drafter", world / "ours.pt", "--target", target, "--prompts",
                        world / "prompts.jsonl", "--max-new-tokens", "4"], capsys)
    line = assert_refused(code, err, str(target), name)
    assert "ignore_mismatched_sizes" not in line


@pytest.mark.unforeseen
def test_an_unforeseen_fault_is_one_line_ending_rerun_with_debug(world, tmp_path, capsys, monkeypatch):
    import dflash_audit.audit.compare as compare

    def broken(*args, **kwargs):
        raise KeyError("something nobody foresaw")

    monkeypatch.setattr(compare, "static_audit", broken)
    code, _, err = run(static(world, world / "zref", tmp_path), capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].endswith("rerun with --debug"), err
    assert "something nobody foresaw" in lines[0] and not CLASS_NAME.search(lines[0])
    assert tree_digest(world)  # the world is still there to read


@pytest.mark.unforeseen
def test_an_unforeseen_fault_in_a_subprocess_is_recorded_for_the_test_that_ran_it(unforeseen_log):
    """A demo or CLI run in a subprocess that reaches the catch-all appends its line to the session's log (the
    environment names it), and the suite's refusal scan fails the test that ran it (this one is marked)."""
    import subprocess
    import sys
    from pathlib import Path

    start = unforeseen_log.stat().st_size
    subprocess.run([sys.executable, "-c", "from dflash_audit.faults import unforeseen; "
                    "unforeseen(ValueError('planted'))"], check=True, cwd=Path(__file__).resolve().parents[2])
    with unforeseen_log.open(encoding="utf-8") as log:
        log.seek(start)
        (line,) = log.read().splitlines()
    assert line.endswith("unexpected failure: planted; rerun with --debug")


ZERO_SIZED = {  # the tensors planted, and the one finding each must give
    "head_dim 0": ({"layers.0.self_attn.q_norm.weight": (0,)},
                   "its config implies layers.0.self_attn.q_norm.weight of shape [16], the tensor is [0]"),
    "a convolution of zero taps": ({"layers.0.attention_conv.base_kernel": (4, 0, 2),
                                    "layers.0.attention_conv.kernel_projection.weight": (8, 64)},
                                   "of the DFlash2 (grouped causal convolutions, candidate selector) family"),
}


@pytest.mark.parametrize("case", list(ZERO_SIZED))
def test_a_zero_sized_tensor_is_one_finding_not_a_fault(world, tmp_path, capsys, case):
    """A zero-sized q_norm (head_dim 0) or a convolution of zero taps: shape inference reads the zero and divides
    by nothing (it divided by zero before, the catch-all), so the audit says what the tensors contradict."""
    planted, message = ZERO_SIZED[case]
    folder = tmp_path / "zero"
    shutil.copytree(world / "zref", folder)
    tensors = safetensors.torch.load_file(folder / "model.safetensors")
    tensors.update({name: torch.zeros(shape) for name, shape in planted.items()})
    safetensors.torch.save_file(tensors, folder / "model.safetensors")
    code, out, err = run(static(world, folder, tmp_path), capsys)
    assert code == 1, err
    findings = json.loads((tmp_path / "report" / "report.json").read_text())["findings"]
    diverging = [f["message"] for f in findings if f["severity"] == "divergence"]
    assert len(diverging) == 1 and message in diverging[0], diverging
