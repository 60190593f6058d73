"""The check itself: a bounded sample of records, each stored layer named by value against the target recomputed on
the record's own token ids, held to what the dataset claims; each root cause one finding with the records it holds
for (`Issues`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from catalogue.findings import Finding, FindingsReport, sort_findings
from dflash_audit.data_check.claims import Claim, id_of
from dflash_audit.data_check.loss_mask import check_mask
from dflash_audit.data_check.naming import State, StateBank, describe_depth
from dflash_audit.data_check.records import Dataset, Record, split_flat
from foundation.errors import AuditError

PITFALL = 39  # catalogue/pitfalls.py: hidden-state data
SHOWN_RECORDS = 4  # record names a message spells out (report.json lists them all)


@dataclass
class Issue:
    severity: str
    message: str  # from the first record it was seen in
    ours: Any = None  # what the data holds
    ref: Any = None  # what is claimed or expected
    records: list[str] = field(default_factory=list)


class Issues:
    """Root causes by key, each with every sampled record it holds for."""

    def __init__(self) -> None:
        self.found: dict[str, Issue] = {}

    def add(self, key: str, record: str, severity: str, message: str, ours: Any = None, ref: Any = None) -> None:
        issue = self.found.setdefault(key, Issue(severity, message, ours, ref))
        if record not in issue.records:
            issue.records.append(record)

    def findings(self, sampled: int, total: int) -> list[Finding]:
        return [issue_finding(key, issue, sampled, total) for key, issue in self.found.items()]


def issue_finding(key: str, issue: Issue, sampled: int, total: int) -> Finding:
    """One root cause's finding: its message, and the records it holds for (all of them in `raw`)."""
    names = ", ".join(issue.records[:SHOWN_RECORDS]) + (", ..." if len(issue.records) > SHOWN_RECORDS else "")
    where = (f"in every one of the {sampled} records checked" if len(issue.records) == sampled else
             f"in {len(issue.records)} of the {sampled} records checked ({names})")
    of = f" (of {total} in the dataset)" if total > sampled else ""
    return Finding("hidden_state_data", issue.severity, f"{issue.message}: {where}{of}", issue.ours, issue.ref,
                   pitfall=PITFALL, key=key, raw={"records": issue.records})


@dataclass
class DataCheckReport(FindingsReport):
    findings: list[Finding]
    facts: dict[str, Any]
    records: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)


@dataclass
class Setting:
    """What the check holds the data to, beside the dataset and the target."""
    claim: Claim
    records: int
    target_dtype: str | None  # the dtype the target declares (None: it declares none)
    compute_dtype: str = "float32"  # the dtype the target is recomputed in (`--dtype`)
    tokenizer: Any = None
    turns: Any = None  # loss_mask.Turns, or why the turns cannot be told, or None (no template)


def named_state(state: State | None, layers: int) -> str:
    return describe_depth(state.depth, layers, state.normed) if state is not None else "no state of the target"


def alignment(record: Record, bank: StateBank, slot: int, precision: str) -> int:
    """Where a record shorter than its token ids sits: the offset at which its rows equal the target's (a prefix
    first, then a suffix as prefix caching leaves it), else 0."""
    rows = record.layers[slot].shape[0]
    for offset in dict.fromkeys((0, bank.tokens - rows)):
        if bank.name(record.layers[slot], precision, offset)[1] is not None:
            return offset
    return 0


def check_record(record: Record, target, setting: Setting, issues: Issues) -> dict[str, Any]:
    layers, hidden_size = target.config.num_hidden_layers, target.config.hidden_size
    if len(record.layers) == 1 and record.layers[0].shape[-1] != hidden_size:
        split_flat(record, hidden_size, record.name)
    for tensor in record.layers:
        if tensor.shape[-1] != hidden_size:
            raise AuditError(f"{record.name}: hidden states {tensor.shape[-1]} wide, the target's hidden size is "
                             f"{hidden_size} (not this target's states)")
    ids = record.token_ids
    vocab = target.config.vocab_size
    if ids.numel() == 0:
        raise AuditError(f"{record.name}: no token ids")
    if int(ids.max()) >= vocab:
        raise AuditError(f"{record.name}: token id {int(ids.max())} is outside the target's vocabulary of {vocab} "
                         "(not a record of this target)")
    longest = getattr(target.config, "max_position_embeddings", None)
    if isinstance(longest, int) and ids.numel() > longest:  # past it the target's states are not the writer's
        raise AuditError(f"{record.name}: {ids.numel()} tokens, past the target's max_position_embeddings {longest} "
                         "(no writer of this target's states stores a sequence it cannot hold)")
    name, tokens, rows = record.name, int(ids.numel()), int(record.layers[0].shape[0])
    row = {"record": name, "tokens": tokens, "rows": rows, "dtype": record.dtype, "slots": []}
    if setting.target_dtype is not None and record.dtype != setting.target_dtype:
        issues.add("dtype", name, "warning", f"hidden states stored in {record.dtype}, the target runs in "
                   f"{setting.target_dtype}", record.dtype, setting.target_dtype)
    if "input_ids" in record.extra and not torch.equal(record.extra["input_ids"], ids):
        issues.add("token_ids_mismatch", name, "divergence", "the record's token ids are not its row's input_ids in "
                   "the preprocessed dataset, so speculators' loader drops the sample (train/data.py:314-322)")
    bank = StateBank(target, ids.tolist())
    # "Equal" within the rounding of the coarser of the stored and the recomputed precision (dflash_audit/target_values.py).
    precision = record.dtype if setting.compute_dtype in ("float32", "float64") else setting.compute_dtype
    offset = 0
    if rows != tokens:
        issues.add("short_record" if rows < tokens else "long_record", name, "divergence",
                   f"hidden_states holds {rows} rows for {tokens} token ids", rows, tokens)
        if rows < tokens:
            live = next((j for j, t in enumerate(record.layers) if t.abs().sum() > 0), None)
            offset = alignment(record, bank, live, precision) if live is not None else 0
            row["offset"] = offset
    states: list[State | None | str] = []
    for j, tensor in enumerate(record.layers):
        if not bool(torch.isfinite(tensor).all()):
            issues.add("non_finite", name, "divergence", f"slot {j} holds NaN or infinite values")
            states.append("non-finite")
            row["slots"].append("non-finite values")
            continue
        zero_rows = int((tensor == 0).all(dim=-1).sum())
        if zero_rows == tensor.shape[0]:
            states.append("zeros")
            row["slots"].append("all zeros")
            continue
        named, state = bank.name(tensor[: tokens - offset], precision, offset)
        if zero_rows:
            issues.add("zero_states", name, "divergence", f"slot {j} holds {zero_rows} all-zero rows among "
                       f"{tensor.shape[0]}", "zeros")
        states.append(state)
        row["slots"].append(named.describe())
    zero_slots = [j for j, state in enumerate(states) if state == "zeros"]
    if zero_slots:
        issues.add("zero_states", name, "divergence", f"slot{'s' if len(zero_slots) > 1 else ''} {zero_slots} of "
                   f"{len(states)} hold all zeros, no state of the target (what hybrid targets' capture has left: "
                   "vLLM #46301, speculators #279)", "zeros")
    compare_claim(name, states, bank.layers, setting.claim, issues)
    if record.loss_mask is not None:
        row["loss_mask"] = mask_findings(name, record, setting, issues)
    return row


def compare_claim(name: str, states: list, layers: int, claim: Claim, issues: Issues) -> None:
    """The stored slots against the claimed depths: one root cause each (a uniform shift, the last layer stripped,
    the final norm applied, another layer)."""
    named = [s for s in states if isinstance(s, State) or s is None]
    if any(s is None for s in states):
        slots = [j for j, s in enumerate(states) if s is None]
        issues.add("unexplained", name, "divergence", f"slot{'s' if len(slots) > 1 else ''} {slots} "
                   "equal no state of the target recomputed on the record's tokens (nearest named in the records "
                   "table)")
    if claim.depths is None or not named:
        return
    claimed = claim.depths
    if len(states) < len(claimed) and all(not isinstance(s, State) or s == State(d, False)
                                          for s, d in zip(states, claimed)):
        missing = claimed[len(states):]
        issues.add("last_layer_stripped", name, "divergence",
                   f"the record holds {len(states)} layers, the first {len(states)} claimed; "
                   f"{'the last layer' if missing == [layers] else 'layers'} {missing} "
                   f"({', '.join(describe_depth(d, layers) for d in missing)}) missing (speculators #705)",
                   len(states), len(claimed))
        return
    if len(states) != len(claimed):
        issues.add("layer_count", name, "divergence", f"the record holds {len(states)} layers where {claim.source} "
                   f"claims {len(claimed)}", len(states), len(claimed))
    pairs = [(j, s, d) for j, (s, d) in enumerate(zip(states, claimed)) if isinstance(s, State)]
    wrong = [(j, s, d) for j, s, d in pairs if s != State(d, False)]
    if not wrong:
        return
    normed = [(j, s, d) for j, s, d in wrong if s == State(d, True)]
    if normed:
        slots = [j for j, _, _ in normed]
        issues.add("after_final_norm", name, "divergence", f"slot{'s' if len(slots) > 1 else ''} {slots} "
                   f"hold{'' if len(slots) > 1 else 's'} "
                   f"{', '.join(describe_depth(d, layers, True) for _, _, d in normed)}; {claim.source} claims the "
                   "state before it (a trainer that applies the final norm itself applies it twice)",
                   "after the final norm", "before")
    shifted = [(j, s, d) for j, s, d in wrong if (j, s, d) not in normed]
    shifts = {s.depth - d for _, s, d in shifted if not s.normed}
    if shifted and len(shifts) == 1 and all(not s.normed for _, s, _ in shifted):
        (shift,) = shifts
        slots = [j for j, _, _ in shifted]
        key = "layer_off_by_one" if abs(shift) == 1 else "layer_shift"
        issues.add(key, name, "divergence",
                   f"slot{'s' if len(slots) > 1 else ''} {slots} hold the layer {abs(shift)} "
                   f"{'above' if shift > 0 else 'below'} the one claimed: ids {[id_of(claim.layout, d) for _, _, d in shifted]} "
                   f"claimed, ids {[id_of(claim.layout, s.depth) for _, s, _ in shifted]} stored (by {claim.source})",
                   [s.depth for _, s, _ in shifted], [d for _, _, d in shifted])
        return
    for j, s, d in shifted:
        issues.add(f"layer:slot{j}", name, "divergence", f"slot {j} holds {named_state(s, layers)}; {claim.source} "
                   f"claims {describe_depth(d, layers)}", named_state(s, layers), describe_depth(d, layers))


def mask_findings(name: str, record: Record, setting: Setting, issues: Issues) -> dict[str, Any]:
    result = check_mask(record.loss_mask, record.token_ids, setting.tokenizer, setting.turns)
    if not result.length_ok:
        issues.add("loss_mask_length", name, "divergence", f"loss_mask holds {record.loss_mask.numel()} entries for "
                   f"{result.tokens} token ids", int(record.loss_mask.numel()), result.tokens)
    elif result.supervised == 0:
        issues.add("loss_mask_empty", name, "divergence", "loss_mask supervises no token (the record trains nothing)")
    if result.outside:
        issues.add("loss_mask_outside_turns", name, "divergence",
                   f"loss_mask supervises {len(result.outside)} tokens outside the chat template's assistant turns "
                   f"(first at position {result.outside[0]})", len(result.outside), 0)
    elif result.turns == 0 and result.supervised:
        issues.add("loss_mask_no_turns", name, "warning", "the record holds no assistant turn of the chat template, "
                   "yet its loss_mask supervises tokens (rendered with another template?)")
    return {"coverage": round(result.coverage, 4), "supervised": result.supervised, "tokens": result.tokens,
            "assistant_turns": result.turns, "turns_supervised": result.turns_supervised,
            "turns_unchecked": result.unchecked}


def check_dataset(dataset: Dataset, target, setting: Setting) -> DataCheckReport:
    """The sampled records checked one at a time (one record in memory), findings merged by root cause."""
    issues = Issues()
    sample = dataset.sample(setting.records)
    rows = [check_record(dataset.read(index), target, setting, issues) for index in sample]
    claim = setting.claim
    notes = []
    if claim.depths is None:
        notes.append("the dataset's layer ids are unknown (give --layer-ids or --drafter): each stored layer is named "
                     "by value below, and held to no claim")
    masks = [r["loss_mask"] for r in rows if "loss_mask" in r]
    if not masks:
        notes.append("the dataset carries no loss_mask: coverage and assistant turns not checked")
    else:
        unchecked = {m["turns_unchecked"] for m in masks if m["turns_unchecked"]}
        notes += [f"loss_mask against the assistant turns not checked in some records: {why}" for why in sorted(unchecked)]
    facts = {"dataset": str(dataset.folder), "layout": dataset.layout, "records_total": len(dataset),
             "records_checked": len(sample), "claim": {"source": claim.source, "ids": claim.ids,
                                                       "depths": claim.depths},
             "target_dtype": setting.target_dtype,
             "loss_mask_coverage": round(sum(m["coverage"] for m in masks) / len(masks), 4) if masks else None}
    return DataCheckReport(sort_findings(issues.findings(len(sample), len(dataset))), facts, rows, notes)
