"""Class 5, messages that name the wrong thing: each refusal names what is actually wrong (a spec that is a
string, a recipe value of the wrong type and its field, a FIFO or directory where a file is expected, an empty
argument), not a symptom further on; a file name that is not UTF-8 is audited, shown escaped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.bad_inputs.cli_run import assert_refused, run

REPO = Path(__file__).resolve().parents[2]


def static(world, ours, tmp_path, *extra):
    return ["compare", "--ours", ours, "--ref", world / "zref", "--out", tmp_path / "report", *extra]


def our_checkpoint_with(world, tmp_path, name, **entries):
    payload = torch.load(world / "ours.pt", weights_only=True)
    for key, value in entries.items():
        if "." in key:
            section, field = key.split(".")
            payload[section] = dict(payload.get(section) or {}, **{field: value})
        else:
            payload[key] = value
    torch.save(payload, tmp_path / name)
    return tmp_path / name


def test_a_spec_given_as_a_string_is_named_as_such(world, tmp_path, capsys):
    ckpt = our_checkpoint_with(world, tmp_path, "string-spec.pt", spec="hello")
    code, _, err = run(static(world, ckpt, tmp_path), capsys)
    line = assert_refused(code, err, "string-spec.pt", "spec", "mapping", "hello")
    assert "unknown fields" not in line


def test_a_recipe_value_of_the_wrong_type_names_its_field(world, tmp_path, capsys):
    for field, value in (("gamma", "four"), ("max_anchors", [1]), ("loss_fn", 3), ("dpace_alpha", None)):
        ckpt = our_checkpoint_with(world, tmp_path, f"{field}.pt", **{f"recipe.{field}": value})
        code, _, err = run(static(world, ckpt, tmp_path), capsys)
        assert_refused(code, err, f"{field}.pt", field)


def test_a_directory_or_fifo_key_map_is_not_called_missing(world, tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo.map")
    for key_map in (world / "folder", tmp_path / "fifo.map"):
        code, _, err = run(static(world, world / "plain.pt", tmp_path, "--key-map", key_map), capsys)
        line = assert_refused(code, err, str(key_map), "not a regular file")
        assert "no such" not in line


def test_an_empty_path_is_named_empty(world, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv, flag in ((["compare", "--ours", "", "--ref", world / "zref"], "--ours"),
                       (["compare", "--ours", world / "ours.pt", "--ref=", "--out", tmp_path / "r"], "--ref"),
                       (["eval", "--drafter", world / "ours.pt", "--target", world / "target", "--prompts", ""],
                        "--prompts")):
        code, _, err = run(argv, capsys)
        line = assert_refused(code, err, flag, "empty")
        assert "inside" not in line
    assert list(tmp_path.iterdir()) == []


def test_a_file_name_that_is_not_utf8_is_audited_and_shown_escaped(world, tmp_path):
    """Through a real process: the names reach argv as bytes, as a shell passes them (Linux allows any bytes in a
    name). The drafter, the ref folder and the report folder are read and written; every place that shows a name
    (the terminal, report.json, index.html) shows its undecodable bytes as \\xNN."""
    import json
    import shutil

    folder = os.fsencode(tmp_path)
    with open(folder + b"/caf\xe9.pt", "wb") as handle:
        handle.write((world / "ours.pt").read_bytes())
    shutil.copytree(os.fsencode(world / "zref"), folder + b"/ref-\xff")
    done = subprocess.run([os.fsencode(sys.executable), b"-m", b"dflash_audit.cli", b"compare", b"--ours",
                           folder + b"/caf\xe9.pt", b"--ref", folder + b"/ref-\xff", b"--out", folder + b"/r\xfe"],
                          cwd=tmp_path, capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    out, err = done.stdout.decode("utf-8"), done.stderr.decode("utf-8")  # both UTF-8: the names escaped
    assert done.returncode in (0, 1) and "error" not in err, err
    assert "r\\xfe/index.html" in err, err  # where the report is, on stderr
    report = json.loads((Path(os.fsdecode(folder + b"/r\xfe")) / "report.json").read_bytes().decode("utf-8"))
    assert report["ours"]["path"].endswith("caf\\xe9.pt") and report["ref"]["path"].endswith("ref-\\xff"), report
    html = (Path(os.fsdecode(folder + b"/r\xfe")) / "index.html").read_bytes().decode("utf-8")
    assert "caf\\xe9.pt" in html and "ref-\\xff" in html


def test_a_fifo_safetensors_is_named_not_missing(world, tmp_path):
    import shutil

    fifo = tmp_path / "fifo-weights"
    shutil.copytree(world / "zref", fifo)
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    done = subprocess.run([sys.executable, "-m", "dflash_audit.cli", "compare", "--ours", str(world / "ours.pt"),
                           "--ref", str(fifo), "--out", str(tmp_path / "r")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = assert_refused(done.returncode, done.stderr, "fifo-weights/model.safetensors", "not a regular file")
    assert "no model.safetensors" not in line


def test_a_target_whose_weights_do_not_fit_its_config_is_one_line(world, tmp_path):
    """Checked from the safetensors headers before the load, so that transformers' many-line load report of the
    misfit tensors never reaches stderr: one line naming the first tensor and both shapes."""
    import json
    import shutil

    target = tmp_path / "misfit"
    shutil.copytree(world / "target", target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] - 32}))
    done = subprocess.run([sys.executable, "-m", "dflash_audit.cli", "eval", "--drafter", str(world / "ours.pt"),
                           "--target", str(target), "--prompts", str(world / "prompts.jsonl"), "--max-new-tokens",
                           "2"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # (transformers logs to the real stderr)
    line = assert_refused(done.returncode, done.stderr, target, "its weights do not fit its config.json", "mlp")
    assert "config.json gives" in line
