"""`dflash-audit trace` reads the shapes of trainers written apart from the tool (issue 53, part 3), on
tests/trace_scripts/own_blocks_trainer.py: a drafter of the team's own class with no config, its decoder blocks an
nn.ModuleList under its own name; right-padded rows whose features past each row's end are zeros its masks hide;
a loss divided by the batch's sum of weights; each (row, anchor) pair its own batch element, its context cut at the
anchor by a key-padding mask. Each variant is recorded once (one step) and audited with no --ref: each sound shape
exits 0 with no false claim, each planted bug is found with its numbers.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dflash_audit.trace.step_audit.audit import audit_recording
from dflash_audit.trace.record.recording import read_recording
from dflash_audit.trace.record.launch import record_script
from dflash_world.target_training import distinct_random_qwen3

TRAINER = Path(__file__).resolve().parent / "trace_scripts" / "own_blocks_trainer.py"
VARIANTS = {
    # fc fed 2 of its 3 layers (blocks under `decoder`), targets one position late, every row weighed alike over
    # rows of 2, 3 and 4 blocks: three bugs, with the (row, anchor) pairs laid out one a batch element, hard labels.
    "bugs": ["--list-name", "decoder", "--fc-layers", "1,5", "--layout", "pairs", "--labels", "hard",
             "--target-shift", "1", "--reduce", "weight-sum", "--uneven"],
    "padded, divided by the sum of weights, SGD": ["--pad", "--reduce", "weight-sum", "--optimizer", "sgd"],
    "pairs cut by a key-padding mask": ["--layout", "pairs", "--labels", "hard", "--pad", "--reduce", "weight-sum"],
    "padded, noise on the inputs and the targets": ["--pad", "--input-noise", "0.05", "--target-noise", "0.5"],
    "pairs with their position ids": ["--layout", "pairs", "--labels", "hard", "--position-ids"],
    # The anchor slot's target rows zeros (weight 0: never read by the loss), noise 0.5 on the rows it reads.
    "unread anchor targets, noise on the targets": ["--zero-anchor-targets", "--target-noise", "0.5"],
    "functional_call on trained clones of the weights": ["--functional"],
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    target = tmp_path_factory.mktemp("shapes-target")
    distinct_random_qwen3(12, 64, 512).save_pretrained(target)
    found = {}
    for name, argv in VARIANTS.items():
        out = tmp_path_factory.mktemp("rec")
        record_script(TRAINER, ["--target", str(target), *argv], out)
        found[name] = audit_recording(read_recording(out))
    return found


def said(report) -> list[str]:
    return [f"{f.severity} {f.component}:{f.key}: {f.message}" for f in report.findings] + report.notes


def test_the_planted_bugs_are_found_with_their_numbers(reports):
    report = reports["bugs"]
    found = {(f.component, f.key): f for f in report.divergences}
    assert set(found) == {("fc_dims", "fc_layers"), ("target_alignment", "shift"), ("loss_weights", "reduction")}, \
        said(report)
    fc = found[("fc_dims", "fc_layers")]  # the depth read from `decoder`, z-lab's ids for 12 and 3
    assert (fc.ours, fc.ref) == ([1, 5], [1, 5, 9]) and "fc is fed 2 of 3" in fc.message, fc.message
    assert report.facts["drafter"]["depth_from"] == ("the drafter's modules: decoder, an nn.ModuleList of 3 Block, "
                                                     "each with an attention")
    assert "read from the drafter's modules: decoder" in report.facts["reference"]["layer_source"]
    # The anchors: where the key-padding mask cuts each pair's context; the hard labels' places give the shift.
    assert report.flow["anchors_from"].startswith("the drafter's mask (each block's context cut at its anchor)")
    assert found[("target_alignment", "shift")].ours == 1
    reduction = found[("loss_weights", "reduction")]  # rows of 2, 3, 4 blocks (6, 9, 12 trained rows) weighed alike
    assert "in a sequence of 6 trained rows" in reduction.message and "in one of 12" in reduction.message
    assert "every trained row weighs alike" in reduction.message, reduction.message
    assert not [row for row in report.tensors if row.what.startswith("unexplained")]


def test_padding_rows_the_masks_hide_are_no_evidence(reports):
    """Zeros past each row's end, hidden by the drafter's attention mask and the target's: no noise, no other layer."""
    report = reports["padded, divided by the sum of weights, SGD"]
    assert report.divergences == [] and report.exit_status == 0, said(report)
    assert not [f for f in report.findings if f.component == "noise"], said(report)
    assert report.flow["fc_layers"] == [1, 5, 9] == report.flow["reference_layers"]
    (fed,) = [row for row in report.tensors if row.what.startswith("the context features")]
    assert "8 rows of padding under the target's attention mask left out (all zero)" in fed.what, fed.what


def test_a_reduction_by_the_sum_of_weights_is_a_scale_said_with_what_it_does(reports):
    """Every sequence holds 9 trained rows: dividing by the batch's sum of weights, not each sequence's count, is one
    factor for the step (the sum of the weights of 27 rows against 3 sequences of 9), said as info with what it does
    under the optimizer recorded."""
    for name, optimizer, effect in (("padded, divided by the sum of weights, SGD", "SGD", "the learning rate times"),
                                    ("pairs cut by a key-padding mask", "AdamW", "changes nothing but the weight of eps")):
        report = reports[name]
        assert report.exit_status == 0, said(report)
        (scale,) = [f for f in report.findings if (f.component, f.key) == ("loss_weights", "reduction_scale")]
        weights = sum(math.exp(-(k - 1) / 4) for k in (1, 2, 3))
        assert scale.severity == "info" and scale.ours == pytest.approx(27 / (9 * weights), rel=1e-4), scale.message
        assert f"under {optimizer} (recorded)" in scale.message and effect in scale.message, scale.message


def test_pairs_cut_by_a_key_padding_mask_have_their_anchors_found(reports):
    report = reports["pairs cut by a key-padding mask"]
    assert report.divergences == [], said(report)
    assert report.flow["anchors_from"].startswith("the drafter's mask (each block's context cut at its anchor)")
    assert report.flow["target_shift"] == 0 and report.flow["labels"].startswith("the argmax of head(final_norm(raw "
                                                                                 "output of layer 11))")
    assert not any("could not be told" in note for note in report.notes), report.notes
    (mask,) = [row for row in report.tensors if row.name.endswith("key_padding_mask")]
    assert "the context rows it hides are left out" in mask.what


def test_pairs_with_position_ids_are_read_in_their_data_rows(reports):
    """Each pair's position ids place its anchor; its data row is the one its context features were named in (not its
    index in the drafter's batch): hard labels are read at the right places, no noise is invented."""
    report = reports["pairs with their position ids"]
    assert report.findings == [] and report.exit_status == 0, said(report)
    assert report.flow["anchors_from"] == "the drafter's position ids (the data's token at each)"
    assert report.flow["labels"] == ("the argmax of head(final_norm(raw output of layer 11)) = the target's own logits "
                                     "(100% of 27 rows)") and report.flow["target_shift"] == 0


def test_noise_on_the_rows_the_masks_keep_is_still_found(reports):
    report = reports["padded, noise on the inputs and the targets"]
    found = {(f.component, f.key): f for f in report.findings}
    assert set(found) == {("noise", "inputs"), ("noise", "targets")}, said(report)
    assert found[("noise", "inputs")].severity == "info" and found[("noise", "inputs")].ours == pytest.approx(
        0.05, rel=0.05)
    assert found[("noise", "targets")].severity == "divergence" and found[("noise", "targets")].ours == \
        pytest.approx(0.5, rel=0.05)


def test_target_rows_the_loss_does_not_read_are_no_evidence(reports):
    """The anchor slot's target rows are zeros, and its weight is 0: the loss reads none of them, so they are left out
    of the targets' naming and the noise's fit (else the zeros would be a residual of their own), and said."""
    report = reports["unread anchor targets, noise on the targets"]
    found = {(f.component, f.key): f for f in report.findings}
    assert set(found) == {("noise", "targets")}, said(report)
    assert found[("noise", "targets")].ours == pytest.approx(0.5, rel=0.05), found[("noise", "targets")].message
    (targets,) = [row for row in report.tensors if row.what.startswith("the targets")]
    assert "9 rows the loss does not read (their weight 0 in its gradient) left out" in targets.what, targets.what
    assert "the target's own logits" in targets.what, targets.what


def test_weights_bound_by_functional_call_are_the_drafters(reports):
    """The optimizer trains clones of the drafter's weights, bound in its parameters' places by functional_call for
    each call: they are the drafter's weights, read as its parameters (nothing else said), each one in the optimizer."""
    report = reports["functional_call on trained clones of the weights"]
    assert report.findings == [] and report.exit_status == 0, said(report)
    assert report.facts["drafter"]["class"] == "__main__:Drafter", report.facts["drafter"]
    assert report.flow["fc_layers"] == [1, 5, 9] == report.flow["reference_layers"]
    structure = report.facts["context"]["run"]["structure"]
    (optimizer,) = structure["optimizers"]
    names = [p["name"] for group in optimizer["groups"] for p in group["params"]]
    assert "fc.weight" in names and "(outside the drafter)" not in names, names
    assert structure["not_in_any_optimizer"] == [] and structure["drafter_trainable"] == len(names)
