"""The reference pipeline at a small size (examples/reference_pipeline.py; `make pipeline` runs it larger): hidden
states from vLLM in speculators' layout, speculators' own Trainer on them, and each stage's audit clean: data-check,
trace (a trainer that never runs the target: the target from --target, the token ids the drafter's own), compare
against the z-lab conversion, serve-check --live."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving_engines.live.vllm_env import DEFAULT_PYTHON

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not DEFAULT_PYTHON.is_file(), reason="no .venv-vllm (make setup builds it)")


def test_the_reference_pipeline_runs_and_every_stage_is_clean(test_world, tmp_path):
    out = tmp_path / "pipeline"
    done = subprocess.run([sys.executable, str(REPO / "examples" / "reference_pipeline.py"), "--out", str(out),
                           "--prompts", "3", "--prompt-tokens", "40", "--max-new-tokens", "24", "--steps", "2"],
                          cwd=REPO, capture_output=True, text=True)
    stages = json.loads((out / "pipeline.json").read_text())["stages"]
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert [s["stage"] for s in stages] == ["data (vLLM extract_hidden_states)", "data-check",
                                            "train (speculators' Trainer)", "trace", "convert to z-lab",
                                            "compare vs z-lab conversion", "serve-check --live"]
    assert all(s["exit"] == 0 for s in stages), stages
    checked = json.loads((out / "data-check" / "report.json").read_text())
    assert checked["facts"]["layout"] == "speculators" and checked["findings"] == []
    assert checked["facts"]["loss_mask_coverage"] > 0
    traced = json.loads((out / "trace" / "report.json").read_text())
    assert traced["exit_status"] == 0 and traced["facts"]["drafter"]["class"].startswith("speculators.")
    assert [f for f in traced["findings"] if f["severity"] == "divergence"] == []
    compared = json.loads((out / "compare" / "report.json").read_text())
    assert compared["exit_status"] == 0 and compared["tau"] is not None
    served = json.loads((out / "serve-check" / "serving.json").read_text())
    assert served["exit_status"] == 0
