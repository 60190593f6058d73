"""Class 2, wrong verdicts: integer tensors where a drafter has floating-point weights are a dtype-class
divergence (never "rounding"), and a config.json that is not a regular file is refused (never ignored)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.bad_inputs.cli_run import assert_refused, run, tree_digest

REPO = Path(__file__).resolve().parents[2]


def test_a_drafter_reinterpreted_as_int32_is_a_dtype_class_divergence(world, tmp_path, capsys):
    ints = tmp_path / "int-zlab"
    shutil.copytree(world / "zref", ints)
    tensors = load_file(ints / "model.safetensors")
    save_file({k: v.contiguous().view(-1).view(__import__("torch").int32).view(v.shape) if v.element_size() == 4
               else v for k, v in tensors.items()}, ints / "model.safetensors", metadata={"format": "pt"})
    code, out, err = run(["compare", "--ours", world / "zref", "--ref", ints, "--out", tmp_path / "r"], capsys)
    assert code == 1, err
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    found = {f["key"]: f for f in report["findings"] if f["component"] == "weights"}
    assert found["dtype-class"]["severity"] == "divergence", found
    assert "rounding" not in found["dtype-class"]["message"] and "int32" in found["dtype-class"]["message"]
    assert "dtype" not in found  # no "outputs differ by rounding" beside it


def test_eval_refuses_integer_weights(world, tmp_path, capsys):
    ints = tmp_path / "int-zlab"
    shutil.copytree(world / "zref", ints)
    import torch

    tensors = load_file(ints / "model.safetensors")
    save_file({k: v.to(torch.int32) for k, v in tensors.items()}, ints / "model.safetensors")
    code, _, err = run(["eval", "--drafter", ints, "--target", world / "target", "--prompts", world / "prompts.jsonl",
                        "--max-new-tokens", "4"], capsys)
    assert_refused(code, err, "int-zlab", "int32", "floating-point")


def _cli(argv, cwd):
    return subprocess.run([sys.executable, "-m", "dflash_audit.cli", *map(str, argv)], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_drafter_config_that_is_a_fifo_is_refused(world, tmp_path):
    fifo = tmp_path / "fifo-zlab"
    shutil.copytree(world / "zref", fifo)
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    before = tree_digest(fifo)
    done = _cli(["compare", "--ours", world / "ours.pt", "--ref", fifo, "--out", tmp_path / "r"], tmp_path)
    assert_refused(done.returncode, done.stderr, "fifo-zlab/config.json", "not a regular file")
    assert tree_digest(fifo) == before


def test_a_fifo_config_beside_a_foreign_checkpoint_is_refused(world, tmp_path):
    (tmp_path / "run").mkdir()
    shutil.copy(world / "plain.pt", tmp_path / "run" / "model.pt")
    os.mkfifo(tmp_path / "run" / "config.json")
    done = _cli(["compare", "--ours", tmp_path / "run" / "model.pt", "--ref", world / "zref", "--out",
                 tmp_path / "r"], tmp_path)
    assert_refused(done.returncode, done.stderr, "run/config.json", "not a regular file")
