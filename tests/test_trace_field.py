"""`dflash-audit trace` on the field's own trainers, unmodified: each codebase's training step recorded as its code
runs it (the drivers in tests/trace_scripts/ set it up on a tiny target and call its own step), and the divergences
the trace finds by value are exactly those the project documents for it (held/*_known_divergences.toml, found there
by the conformance suite), apart from the entries a training step cannot reach, listed here with why.

SpecForge 0.2.0: `DFlashTrainStrategy.forward_loss` on its `OnlineDFlashModel` (tests/trace_scripts/specforge_step.py).
speculators 0.9.0: its `Trainer.train_epoch` on offline data its `ArrowDataset` reads
(tests/trace_scripts/speculators_trainer.py; its CPU settings named there). Model-Optimizer 0.47.0: its converted
`HFDFlashModel`'s training forward, in its own environment (tests/trace_scripts/modelopt_step.py): its drafter found
inside the target, its D-PACE weights refitted by value and its soft-target cross-entropy's divisor read.
No driver adds a line of the trace's.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from dflash_audit.trace.step_audit.audit import audit_recording
from dflash_audit.trace.record.recording import read_recording
from dflash_audit.trace.record.launch import record_script
from dflash_world.target_training import distinct_random_qwen3

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "trace_scripts"

# SpecForge's documented entries a training step does not reach, and why.
SPECFORGE_OUT_OF_REACH = {
    ("layer_types", 11): "inference-only: spec_generate calls the drafter with no mask (is_causal=False)",
    ("tau", 17): "inference-only: spec_generate's verification and acceptance",
    ("mask_token_validity", 34): "inference-only: spec_generate drops every output token equal to the mask id",
    ("loss_weights", 18): "not its default step: D-PACE runs only with loss_type dpace (TrainingConfig: dflash)",
    ("training_mask", 9): "not in what its step records: it takes no document ids, so a packed row reads as one "
                          "document, and the drafter it trains here has no sliding layers",
}
# Each trace finding (component, key) and the documented entry it is, with what its message must say. CE toward the
# data's tokens is one root cause, where the targets come from (hard labels gathered from input_ids instead of the
# target's logits): targets #3 for the conformance suite and the trace alike. Its loss kind, CE, is speculators' own.
SPECFORGE_FOUND = {
    ("anchors", "late_anchors"): (("anchors", 8), "leave no room for a whole block"),
    ("targets", "target_source"): (("targets", 3), "the targets are the data's next tokens"),
    ("recipe", "per_position_loss_weight"): (("loss_weights", 6), "the weights are uniform"),
}


def documented(codebase: str) -> set[tuple[str, int]]:
    data = tomllib.loads((REPO / "held" / f"{codebase}_known_divergences.toml").read_text())
    return {(entry["component"], entry["pitfall"]) for entry in data["divergence"]}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("field-target")
    distinct_random_qwen3(12, 64, 512).save_pretrained(path)
    return path


def test_specforge_training_step_shows_its_documented_divergences(target_dir, tmp_path):
    record_script(SCRIPTS / "specforge_step.py", ["--target", str(target_dir)], tmp_path)
    recording = read_recording(tmp_path)
    assert recording.steps[0]["drafter"]["class"] == "specforge.modeling.draft.dflash:DFlashDraftModel"
    report = audit_recording(recording)
    found = {(f.component, f.key): f for f in report.findings}
    assert all(f.severity == "divergence" for f in report.findings), [f.message for f in report.findings]
    assert set(found) == set(SPECFORGE_FOUND), [f.message for f in report.findings]
    for key, (entry, words) in SPECFORGE_FOUND.items():
        assert words in found[key].message, (key, found[key].message)
    reached = {entry for entry, _ in SPECFORGE_FOUND.values()}
    assert reached | set(SPECFORGE_OUT_OF_REACH) == documented("specforge")
    assert not reached & set(SPECFORGE_OUT_OF_REACH)
    # The numbers: its anchors run into the last block; its labels are the data's next tokens on every trained row.
    late = found[("anchors", "late_anchors")].ours
    assert late and all(a > 48 - 4 for a in late)
    assert report.flow["labels"].startswith("the data's next tokens (100% of")
    assert report.flow["fc_layers"] == [1, 3, 5, 7, 9]
    assert not [row for row in report.tensors if row.what.startswith("unexplained")]


def test_speculators_trainer_step_on_offline_data_has_no_divergence(target_dir, tmp_path):
    """speculators' own Trainer, as `speculators train --speculator-type dflash` resolves it (CE toward the
    verifier's argmax, D-PACE weights): no divergence. Its D-PACE weights, which vary per block with the drafter's
    confidence, are not yet read from the graph: one warning says so, and nothing is guessed from them."""
    record_script(SCRIPTS / "speculators_trainer.py", ["--target", str(target_dir), "--work", str(tmp_path / "work")],
                  tmp_path / "trace")
    recording = read_recording(tmp_path / "trace")
    assert recording.steps[0]["drafter"]["class"] == "speculators.models.dflash.core:DFlashDraftModel"
    report = audit_recording(recording)
    assert report.divergences == [] and report.exit_status == 0, [f.message for f in report.findings]
    assert [(f.component, f.key, f.pitfall) for f in report.findings] == [], [f.message for f in report.findings]
    assert report.flow["weights"].startswith("D-PACE (alpha 0.5, confidences on the targets' argmax")
    assert report.flow["fc_layers"] == [1, 3, 5, 7, 9]
    assert not [row for row in report.tensors if row.what.startswith("unexplained")]


SPECULATORS_TRAIN = REPO / "examples" / "speculators_offline_train.py"
HS_WRITER = Path(__file__).resolve().parent / "hidden_state_corpus" / "speculators_hs_writer.py"


def speculators_data(target: Path, folder: Path, aux: list[int]) -> None:
    """speculators' data folder for `target`: hidden_states/hs_<i>.safetensors at vLLM ids `aux` + N from the
    independent writer (tests/hidden_state_corpus/, the states of a transformers pass, which
    tests/test_vllm_hidden_states.py holds vLLM's capture to), and the `datasets` table of its rows beside them."""
    import importlib.util
    import json

    from datasets import Dataset
    from safetensors import safe_open

    spec = importlib.util.spec_from_file_location("speculators_hs_writer", HS_WRITER)
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    writer.main(["--target", str(target), "--out", str(folder / "hidden_states"), "--records", "3",
                 "--layer-ids", ",".join(map(str, [*aux, layers]))])
    rows = []
    for i in range(3):
        with safe_open(str(folder / "hidden_states" / f"hs_{i}.safetensors"), "pt") as record:
            rows.append(record.get_tensor("token_ids").tolist())
    table = Dataset.from_dict({"input_ids": rows, "loss_mask": [[0] * 8 + [1] * (len(ids) - 8) for ids in rows],
                               "seq_len": [len(ids) for ids in rows]})
    table.set_format("torch")
    table.save_to_disk(str(folder / "table"))
    for entry in (folder / "table").iterdir():  # the table and hidden_states/ in one folder, as speculators reads it
        entry.rename(folder / entry.name)
    (folder / "table").rmdir()


# examples/reference_pipeline.py's training stage (test-full's tests/test_reference_pipeline.py), held here without vLLM.
def test_speculators_own_run_across_two_steps_is_clean_and_ten_times_its_lr_is_one_finding(test_world, tmp_path):
    """speculators' own Trainer, unmodified (examples/speculators_offline_train.py), traced across two steps as the
    reference pipeline traces it (recorded here in this process, the target given as --target gives it, no line
    added; then `trace --from`): no finding of any severity, the run its Muon + AdamW; the same run at lr 1e-2 (10x
    its resolved 1e-3) is one finding more, the lr."""
    import json

    from dflash_audit.cli import main

    data = tmp_path / "data"
    speculators_data(Path(test_world.target), data, [3])
    reports = {}
    for run, extra in (("sound", []), ("lr", ["--lr", "1e-2"])):
        recorded = tmp_path / f"recording-{run}"  # recorded in this process, then the verb on the recording
        record_script(SPECULATORS_TRAIN, ["--target", str(test_world.target), "--data", str(data), "--steps", "2",
                                          "--aux-layer-ids", "3", "--save", str(tmp_path / f"drafter-{run}"), *extra],
                      recorded, steps=2, target=Path(test_world.target))
        assert main(["trace", "--from", str(recorded), "--out", str(tmp_path / f"trace-{run}")]) in (0, 1)
        reports[run] = json.loads((tmp_path / f"trace-{run}" / "report.json").read_text())
    sound = reports["sound"]
    assert sound["exit_status"] == 0 and sound["findings"] == [], [f["message"] for f in sound["findings"]]
    assert sound["facts"]["drafter"]["class"].startswith("speculators.")
    assert sound["flow"]["fc_layers"] == [2]  # speculators' aux id 3 is z-lab's layer 2
    assert sound["facts"]["run"]["steps"] == 2
    assert {o["class"].rsplit(":", 1)[-1] for o in sound["facts"]["run"]["optimizers"]} == {"Muon", "AdamW"}
    before = {(f["component"], f["key"]) for f in sound["findings"]}
    new = [(f["component"], f["key"], f["severity"]) for f in reports["lr"]["findings"]
           if (f["component"], f["key"]) not in before]
    assert new == [("recipe", "lr", "divergence")], reports["lr"]["findings"]


MODELOPT_PYTHON = Path(sys.prefix) / "modelopt-env" / "bin" / "python"


# Model-Optimizer's documented entries its default training step does not reach, and why.
MODELOPT_OUT_OF_REACH = {
    ("target_alignment", 5): "a weight-0 slot: only the anchor slot of an anchor at position 0 is misaligned, and an "
                             "untrained slot's teacher never reaches the loss's gradient",
    ("loss_weights", 6): "not its default objective: the sum(w) divisor under fixed decay (dflash_loss_objective "
                         "decay); under its default D-PACE the same divisor is #18's, found",
    ("anchors", 8): "one anchor fewer than its eligible positions is, in one step, a max_anchors setting by value: "
                    "not separable from the recording",
    ("training_mask", 9): "its step here holds one document a row and no padding: no boundary to attend across",
    ("inference_mask", 10): "inference-only: its generation mask",
    ("layer_types", 11): "the drafter its shipped recipe builds has no sliding layers",
    ("window_direction", 25): "the drafter its shipped recipe builds has no sliding window",
}
# Each trace finding (component, key) and the documented entry it is, with what its message must say.
MODELOPT_FOUND = {
    ("recipe", "loss_fn"): (("loss", 7), "distils the target's whole distribution"),
    ("loss_weights", "reduction"): (("loss_weights", 18), "divided by the sum of its weights"),
    ("loss_weights", "dpace_confidence"): (("loss_weights", 18), "the data's tokens"),
}


def test_modelopt_step_shows_its_documented_divergences(target_dir, tmp_path, capsys):
    """`convert` builds the drafter inside the target: the trace names its DFlashModule the drafter and the rest of
    the converted model the target, reads the step by value (fc's layers, the target's own logits as teacher, its
    D-PACE weights refitted with speculators' own function, the loss's divisor) and finds exactly its documented
    training divergences."""
    from dflash_audit.cli import main

    out = tmp_path / "trace"
    main(["trace", "--out", str(out), "--", str(MODELOPT_PYTHON), str(SCRIPTS / "modelopt_step.py"),
          "--target", str(target_dir)])
    capsys.readouterr()
    recording = read_recording(out)
    step = recording.steps[0]
    assert step["drafter"]["class"] == "modelopt.torch.speculative.plugins.modeling_dflash:DFlashModule"
    assert step["target"]["path"] == str(target_dir)
    report = audit_recording(recording)
    assert report.flow["fc_layers"] == [1, 3, 5, 7, 9] and report.flow["target_shift"] == 0
    assert report.flow["targets"] == "head(final_norm(raw output of layer 11)) = the target's own logits"
    assert report.flow["weights"].startswith("D-PACE (alpha 0.5, confidences on the data's tokens")
    assert not [row for row in report.tensors if row.what.startswith("unexplained")]
    found = {(f.component, f.key): f for f in report.findings}
    assert all(f.severity == "divergence" for f in report.findings), [f.message for f in report.findings]
    assert set(found) == set(MODELOPT_FOUND), [f.message for f in report.findings]
    for key, (entry, words) in MODELOPT_FOUND.items():
        assert words in found[key].message and found[key].pitfall == entry[1], (key, found[key].message)
    reached = {entry for entry, _ in MODELOPT_FOUND.values()}
    assert reached | set(MODELOPT_OUT_OF_REACH) == documented("modelopt")
    assert not reached & set(MODELOPT_OUT_OF_REACH)
