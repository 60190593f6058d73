"""The audit of a trace recording: each recorded tensor named by value (dflash_audit/target_values.py), then held to the reference, one
finding per root cause, with its numbers and its catalogue entry.

One step's audit is `audit_step`: a pipeline of stages, each a function of its own module that reads the step and
the results of the stages before it, writes to the step's ledger (`StepState`, state.py: the tensors accounted for,
the findings, the notes, the data flow) and returns its own typed result, in this order:
- blocks.py `read_blocks -> Blocks`: the block token ids of every drafter call, the mask id, the block length,
  positions;
- context.py `name_context -> Context`: fc's context features named as target layers, held to the reference's layer
  ids;
- draft_rows.py `read_draft_rows -> DraftRows`: every draft row with the block slot it drafts;
- loss_rows.py `read_loss_rows -> LossRows`: the loss's rows read from its gradient (each found among the draft
  rows); without the gradient, `loss_unread`;
- targets.py `name_targets -> Targets`: each trained row's target named (which candidate, which position, what
  residual);
- anchors.py `place_anchors -> Anchors`: where each block's anchor sits in the data;
- labels.py `name_labels -> Labels`: hard labels' source (the data's tokens, a candidate's argmax, under noise);
- alignment.py `hold_alignment -> Alignment`: the slot-to-target shift, the late anchors, the training mask;
- weights.py `read_weights -> Weights`: the weights per slot, fitted;
- recipe.py `hold_recipe -> LossRecipe`: the reduction, the loss kind, against speculators' reference recipe;
then blocks.py `unread_masks` (a drafter mask the training-mask check never reached) and whatever is left
unexplained. The reference (layer ids, block size, mask id) is reference.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from catalogue.findings import Finding, FindingsReport, sort_findings
from dflash_audit.trace.step_audit.alignment import hold_alignment
from dflash_audit.trace.step_audit.anchors import place_anchors
from dflash_audit.trace.step_audit.blocks import read_blocks, unread_masks
from dflash_audit.trace.step_audit.context import name_context
from dflash_audit.trace.step_audit.draft_rows import read_draft_rows
from dflash_audit.target_values import TargetCandidates
from dflash_audit.trace.step_audit.labels import name_labels
from dflash_audit.trace.step_audit.loss_rows import loss_unread, read_loss_rows
from dflash_audit.trace.step_audit.recipe import hold_recipe
from dflash_audit.trace.record.recording import ID_ROLES, Recording, compile_notes
from dflash_audit.trace.step_audit.reference import Reference, read_ref, reference_for
from dflash_audit.trace.step_audit.replay_inputs import replay_inputs
from dflash_audit.trace.step_audit.state import StepState, TensorRow
from dflash_audit.trace.step_audit.targets import name_targets
from dflash_audit.trace.step_audit.weights import read_weights
from foundation.errors import AuditError
from foundation.token_ids import outside_vocabulary

__all__ = ["Reference", "StepState", "TensorRow", "TraceReport", "audit_recording", "audit_step", "read_ref",
           "reference_for"]


@dataclass
class TraceReport(FindingsReport):
    findings: list[Finding]
    tensors: list[TensorRow]
    facts: dict[str, Any]
    flow: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def audit_step(meta: dict, tensors: dict[str, torch.Tensor], cands: TargetCandidates, reference: Reference,
               pad_id: int | None, index: int, run: dict | None = None) -> StepState:
    """One recorded step against the target's candidates, stage by stage: each reads what the stages before it
    found and writes to the step's ledger, which is returned (its rows, findings, notes and flow)."""
    step = StepState(meta, tensors, cands, reference, pad_id, index, run)
    target_inputs(step)
    blocks = read_blocks(step)
    context = name_context(step, blocks)
    draft = read_draft_rows(step, blocks)
    loss = read_loss_rows(step, draft)
    targets = name_targets(step, loss)
    if loss.trained:  # the rest is read from the loss's rows
        anchors = place_anchors(step, blocks, context, loss, targets)
        labels = name_labels(step, blocks, loss, anchors)
        positions = labels.places if loss.hard else targets.positions  # where each row's target sits
        hold_alignment(step, blocks, loss, positions, anchors)
        weights = read_weights(step, loss, anchors)
        hold_recipe(step, blocks, context, loss, anchors, weights, labels)
    else:
        loss_unread(step)
    unread_masks(step, blocks)
    unexplained(step)
    return step


def target_inputs(step: StepState) -> None:
    """The target's own inputs: not compared, rerun (the candidates are recomputed from them)."""
    for name in step.of_role("tokens"):
        step.account(name, "the target's input ids (the candidates are recomputed from them)")
    for name in step.of_role("target_attention_mask"):
        step.account(name, "the target's attention mask (the target is rerun with it)")
    for name in step.of_role("target_position_ids"):
        step.account(name, "the target's position ids (the target is rerun with them)")


def unexplained(step: StepState) -> None:
    """Every recorded tensor no stage named: said, with a warning each."""
    for name in step.entries:
        if name not in step.rows:
            e = step.entries[name]
            step.account(name, "unexplained: no candidate and no role in the loss")
            step.add(Finding("unexplained", "warning", f"{name} ({e['role']}, shape {e['shape']}) is no tensor "
                             "the audit can name: no candidate of the target equals it", None, None, key=name))


def recorded_device(placement: list[str]) -> torch.device:
    """The device the target ran on when it ran on one GPU that this machine has too (the audit's replay there, as
    the trainer's); else the CPU."""
    if len(placement) == 1 and placement[0].startswith("cuda") and torch.cuda.is_available():
        device = torch.device(placement[0])
        if device.index is None or device.index < torch.cuda.device_count():
            return device
    return torch.device("cpu")


def audit_recording(recording: Recording, target_dir: Path | None = None, ref: Path | None = None,
                    placement=None) -> TraceReport:
    """Every recorded step audited; a finding seen at several steps is reported once (its first step's numbers)."""
    from foundation.placement import CPU_FLOAT32, Placement
    from foundation.target import load_target_model

    steps = recording.steps
    target_meta = steps[0]["target"]
    target_path = Path(target_dir) if target_dir is not None else Path(target_meta["path"])
    if not (target_path / "config.json").is_file():
        raise AuditError(f"--target {target_path}: no Hugging Face model folder there (the recorded target was "
                         f"{target_meta['path']!r}; name its folder with --target)")
    ref_data = read_ref(ref)
    if placement is None:  # the target rerun in the dtype it ran in, so "equal" means one kernel's rounding
        dtype = getattr(torch, str(target_meta.get("dtype", "float32")), torch.float32)
        device = recorded_device(target_meta.get("placement") or [])
        placement = CPU_FLOAT32 if dtype == torch.float32 and device.type == "cpu" else \
            Placement(device, dtype, "the recording")
    target = load_target_model(target_path, placement)
    pad_id = target.config.pad_token_id
    findings: list[Finding] = []
    rows: list[TensorRow] = []
    seen: set[tuple[str, str]] = set()
    flow: dict[str, Any] = {}
    notes: list[str] = []
    vocab = target.config.vocab_size
    unaudited: list[int] = []  # steps with no token ids the target can be rerun on
    reread: dict[int, list[int]] = {}  # steps that ran no target forward -> the steps whose forwards they are read on
    for index, meta in enumerate(steps):
        tensors = recording.step_tensors(index)
        for name, entry in meta["entries"].items():  # token ids index the target's embedding: in its vocabulary
            if entry["role"] in ID_ROLES and bool(outside_vocabulary(tensors[name], vocab).any()):
                raise AuditError(f"--from {recording.folder}: step {index}'s {name!r} holds token ids "
                                 f"{int(tensors[name].min())}..{int(tensors[name].max())}, outside the target's "
                                 f"vocabulary of {vocab} (not a recording of this target; record it again)")
        if not any(e["role"] == "tokens" for e in meta["entries"].values()):
            if index == 0:
                raise AuditError(f"--from {recording.folder}: step {index} recorded no token ids")
            unaudited.append(meta.get("step", index + 1))  # nothing to rerun the target on: the run still is
            continue
        if meta.get("target_forwards_of_steps"):  # an offline trainer: the states it reads are earlier forwards'
            reread[meta.get("step", index + 1)] = meta["target_forwards_of_steps"]
        inputs = replay_inputs(meta, tensors, pad_id)  # every target call of the step, as it ran (its masks)
        cands = TargetCandidates(target, inputs.tokens, inputs.attention_mask, inputs.position_ids)
        reference = reference_for(meta["drafter"]["facts"], cands.layers, ref_data,
                                  meta["drafter"].get("depth_from"))
        try:
            audit = audit_step(meta, tensors, cands, reference, pad_id, index,
                               (recording.manifest.get("context") or {}).get("run"))
        finally:
            cands.close()  # the replay's states (a temporary folder at scale) go before the next step's
        for f in audit.findings:
            if (f.component, f.key) not in seen:
                seen.add((f.component, f.key))
                findings.append(f)
        rows.extend(audit.rows.values())
        notes.extend(n for n in audit.notes if n not in notes)
        if index == 0:
            flow = {**audit.flow, "divergent": sorted(audit.flow["divergent"]), "target_layers": cands.layers,
                    "reference_layers": reference.layer_ids, "reference_source": reference.layer_source}
            facts = {"target": target_meta, "drafter": meta["drafter"], "reference": reference.__dict__,
                     "loss": meta["loss"], "steps": len(steps), "context": recording.manifest.get("context", {}),
                     "recording": str(recording.folder)}
    notes.extend(step_notes(unaudited, reread))
    from dflash_audit.trace.run.audit import audit_run

    run = audit_run(recording.manifest, recording.folder, findings)  # the run across steps (trace --steps N)
    findings.extend(run.findings)
    notes.extend(run.notes)
    notes.extend(compile_notes(recording.manifest))
    facts["run"] = run.facts
    return TraceReport(sort_findings(findings), rows, facts, flow, notes)


def step_notes(unaudited: list[int], reread: dict[int, list[int]]) -> list[str]:
    """What the report says of steps that ran no target forward of their own."""
    def steps(numbers) -> str:
        numbers = sorted(set(numbers))
        return f"step{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))}"

    notes = []
    if reread:
        notes.append(f"{steps(reread)} ran no target forward of {'their' if len(reread) > 1 else 'its'} own (the "
                     "trainer reads states it stored from the target's earlier forwards): named against the target "
                     f"rerun on the token ids it ran on in {steps(n for ns in reread.values() for n in ns)}")
    if unaudited:
        notes.append(f"{steps(unaudited)} recorded no token ids to rerun the target on: "
                     f"{'their' if len(unaudited) > 1 else 'its'} context features, targets and loss are not "
                     "audited (the run across steps is)")
    return notes
