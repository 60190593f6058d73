"""The reference pipeline at a small size (examples/reference_pipeline.py; `make pipeline` runs it larger): hidden
states from vLLM in speculators' layout, speculators' own Trainer on them, and each stage's audit clean: data-check,
trace (a trainer that never runs the target: the target from --target, the token ids the drafter's own), compare
against the z-lab conversion, serve-check --live. Then, on the same generated data and trainer, a planted fault at each
audited stage of the data and the run is exactly one finding there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving_engines.live.vllm_env import DEFAULT_PYTHON

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not DEFAULT_PYTHON.is_file(), reason="no .venv-vllm (make setup builds it)")


# Held faster in `make test`, stage by stage: vLLM's extract_hidden_states and data-check reading it by
# tests/test_vllm_hidden_states.py; the planted short record by tests/test_data_check.py
# (test_exact_on_the_independent_writer[short_record]); speculators' own Trainer traced across two steps, clean, and at
# 10x its lr one finding by tests/test_trace_field.py (test_speculators_own_run_across_two_steps_is_clean_and_ten_times_
# its_lr_is_one_finding); the conversion to z-lab by tests/test_convert.py (test_ours_equals_speculators_own_converter,
# test_round_trip_through_each_format_is_bit_identical); serve-check --live on a speculators-format drafter by
# tests/test_live_check.py. What only this case holds is the chain: each stage reading what the one before wrote.
@pytest.mark.full
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
    # Clean means no finding of any severity: the packed row's padding is no input noise, the per-row loss weights
    # (as long as the vocabulary here: 512 anchors x 4 = 2048) no vocabulary-wide tensor.
    assert traced["findings"] == [], [f["message"] for f in traced["findings"]]
    context = [t for t in traced["tensors"] if t["role"] == "drafter_input" and "context features" in t["what"]]
    assert len(context) == 2 and all("hidden_states[3]" in t["what"] and "rows of padding" in t["what"]
                                      for t in context), context
    assert traced["flow"]["fc_layers"] == [2]  # speculators' aux id 3 is z-lab's layer 2
    assert traced["facts"]["run"]["steps"] == 2  # the run across its steps audited too: Muon + AdamW, clean
    assert {o["class"].rsplit(":", 1)[-1] for o in traced["facts"]["run"]["optimizers"]} == {"Muon", "AdamW"}
    compared = json.loads((out / "compare" / "report.json").read_text())
    assert compared["exit_status"] == 0 and compared["tau"] is not None
    # Its only findings are what compare always says: each τ method's result (equal on both sides), and the mask
    # token (the drafter's mask id 1 is a token of the target's vocabulary, which a decode loop must keep).
    assert sorted((f["component"], f["key"], f["severity"]) for f in compared["findings"]) == [
        ("mask_token_validity", "mask token 1", "info"), ("tau", "ddtree", "info"), ("tau", "dflash", "info")]
    assert all(f["ours"] == f["ref"] for f in compared["findings"])
    served = json.loads((out / "serve-check" / "serving.json").read_text())
    # vLLM's only finding: it drafts the argmax at every temperature, where z-lab samples its drafts at T > 0 (info).
    assert served["exit_status"] == 0 and [(f["field"], f["severity"]) for f in served["serving"]["vllm"]["findings"]] \
        == [("draft_sampling", "info")]
    planted_data_fault_is_one_finding(test_world, out, tmp_path)
    planted_run_fault_is_one_finding(test_world, out, tmp_path, traced)


def planted_data_fault_is_one_finding(world, out: Path, tmp_path: Path) -> None:
    """vLLM's prefix-caching bug (vllm#44485) planted in the pipeline's own data: record 1's hidden states shorter
    than its token ids is one data-check finding, for that record only."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_audit.cli import main

    data = tmp_path / "data-short"
    shutil.copytree(out / "data", data)
    record = data / "hidden_states" / "hs_1.safetensors"
    tensors = load_file(record)
    save_file({**tensors, "hidden_states": tensors["hidden_states"][:-8].contiguous()}, record)
    command = json.loads((out / "pipeline.json").read_text())["stages"][1]["command"].split()
    ids = command[command.index("--layer-ids") + 1]
    assert main(["data-check", str(data), "--target", str(world.target), "--layer-ids", ids, "--out",
                 str(tmp_path / "data-check-short")]) == 1
    findings = json.loads((tmp_path / "data-check-short" / "report.json").read_text())["findings"]
    assert [f["key"] for f in findings] == ["short_record"], findings
    assert "hs_1.safetensors" in json.dumps(findings[0]) and "hs_0.safetensors" not in json.dumps(findings[0])


def planted_run_fault_is_one_finding(world, out: Path, tmp_path: Path, sound: dict) -> None:
    """speculators' own Trainer, unmodified, run at lr 1e-2 (10x its resolved 1e-3) and traced as the pipeline traces
    it (2 steps): the one finding beside the sound trace's is the lr, with no line added to the script."""
    from dflash_audit.cli import main

    command = json.loads((out / "pipeline.json").read_text())["stages"][3]["command"].split()
    train = command[command.index("--") + 1:command.index("--save")]
    report = tmp_path / "trace-lr"
    main(["trace", "--steps", "2", "--target", str(world.target), "--out", str(report), "--", *train, "--lr", "1e-2",
          "--save", str(tmp_path / "drafter-lr")])
    traced = json.loads((report / "report.json").read_text())
    before = {(f["component"], f["key"]) for f in sound["findings"]}
    new = [(f["component"], f["key"], f["severity"]) for f in traced["findings"]
           if (f["component"], f["key"]) not in before]
    assert new == [("recipe", "lr", "divergence")], traced["findings"]
