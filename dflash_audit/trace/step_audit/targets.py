"""The targets: each trained row's target named by value (the recorded target tensor equal to it, or the gradient's
own distribution; hard labels: the data's next tokens or a candidate's argmax), then held to the reference: the
target's own final logits, clean. The hard labels' source is labels.py's.

The stage: `name_targets(step, loss) -> Targets`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from catalogue.findings import Finding
from dflash_audit.target_values import CHUNK_ROWS, Named, centered_log_probs, name_logits
from dflash_audit.trace.step_audit.loss_rows import LossRows
from dflash_audit.trace.step_audit.state import LOOSE_GRADIENT, StepState


@dataclass
class Targets:
    """Each live loss row's flat place in the target's rerun its target was named at (None: not told, or hard
    labels, whose places are labels.py's)."""
    positions: list | None


def name_targets(step: StepState, loss: LossRows) -> Targets:
    """The targets named: with the loss's rows, each trained row's (`target_positions`); without them (no gradient
    recorded), each recorded target tensor alone. The hard labels are named for what they are."""
    if not loss.trained:
        for n in loss.distributions:
            name_tensor(step, n)
        for n in loss.labels:
            step.account(n, "hard labels (the loss's gradient was not recorded)")
        return Targets(None)
    positions = target_positions(step, loss.live, loss.distributions, loss.hard)
    for n in loss.labels:
        step.account(n, "hard labels (the targets are read from the loss's gradient)")
    return Targets(positions)


def target_positions(step: StepState, live: list, distributions: list[str], hard: bool) -> list | None:
    """Each trained row's target named by value: the recorded target row equal to it (then that tensor is
    named: which candidate, at which position, plus what residual), or the gradient's own distribution."""
    if hard:
        return None
    tables = []
    if distributions:  # named together: one candidate for every target row (noise averages out over them)
        parts = [step.evidence_rows(n) for n in distributions]  # less the rows the masks exclude
        sizes = [part.shape[0] for part in parts]
        rows = torch.cat(parts)
        del parts
        named = name_logits(rows, step.cands, min(step.tol(n) for n in distributions))
        del rows
        for n in distributions:
            step.account(n, f"the targets: {named.describe()}{step.left_out(n)}", named.distance)
        sampled(step, named, "the targets")
        target_findings(step, named, ", ".join(distributions) if len(distributions) < 3 else
                        f"{distributions[0]} and {len(distributions) - 1} more")
        if (named.equal or named.noisy) and named.positions is not None:
            for n, part in zip(distributions, torch.split(named.positions, sizes)):
                tables.append((n, part))
    positions: list[int | None] = [None] * len(live)
    if tables and live:
        wanted = torch.stack([p for _, _, p, _ in live])
        for n, pos in tables:  # each row's recorded twin: the same distribution (L1 within 1e-3)
            for r, i in twins(wanted, step.evidence_rows(n).float()):
                if positions[r] is None:
                    positions[r] = int(pos[i])
    if tables and all(x is not None for x in positions):
        return positions
    # No recorded tensor holds them (made in code the recorder cannot see): the gradient's own rows, named.
    stacked = torch.stack([p.clamp_min(1e-30).log() for _, _, p, _ in live])
    named = name_logits(stacked, step.cands, LOOSE_GRADIENT)
    del stacked
    sampled(step, named, "the targets read from the loss's gradient")
    target_findings(step, named, "the targets read from the loss's gradient")
    return named.positions.tolist() if named.positions is not None and (named.equal or named.noisy) else None


def sampled(step: StepState, named: Named, what: str) -> None:
    if named.sampling:
        step.note(f"{what}: {named.sampling}")


def name_tensor(step: StepState, name: str) -> Named | None:
    """One recorded target tensor named alone (no loss rows to name it with)."""
    rows = step.evidence_rows(name)
    named = name_logits(rows, step.cands, step.tol(name))
    sampled(step, named, name)
    step.account(name, f"the targets: {named.describe()}{step.left_out(name)}", named.distance)
    target_findings(step, named, name)
    return named if named.equal or named.noisy else None


def target_findings(step: StepState, named: Named, what: str) -> None:
    ref = step.cands.reference_logits
    step.flow.setdefault("targets", named.candidate.name if named.candidate else None)
    if named.candidate is not None and named.candidate != ref and (named.equal or named.noisy):
        c = named.candidate
        why = "its final norm never applied" if not c.normed else \
            "the final norm applied twice" if "twice" in c.name else \
            f"layer {c.layer} instead of the final layer {step.cands.layers - 1}"
        step.add(Finding("targets", "divergence", f"the target logits equal {c.name}; the reference distils "
                         f"hidden_states[-1], the final layer {step.cands.layers - 1} after its norm (the target's "
                         f"own logits): {why}", c.name, ref.name, pitfall=3, key="target_source"),
                 edge="targets")
    elif not (named.equal or named.noisy):
        step.add(Finding("unexplained", "warning", f"the targets are no candidate of the target ({what}): "
                         f"{named.describe()}", None, None, key="targets"), edge="targets")
        return
    if named.noisy:
        step.add(Finding("noise", "divergence", f"the targets carry noise ({what}): they equal "
                         f"{named.candidate.name} plus a residual no candidate explains, std "
                         f"{named.residual_std:.3g} ({named.relative_noise:.2g} of the clean logits' std); the "
                         "reference computes targets from clean target states (noise belongs on the drafter's "
                         "inputs only)", round(named.residual_std, 4), 0.0, pitfall=15, key="targets",
                         raw={"relative": named.relative_noise, "tensor": what}), edge="targets")


def twins(wanted: torch.Tensor, recorded: torch.Tensor) -> list[tuple[int, int]]:
    """(row of `wanted`, row of `recorded`) for each wanted distribution whose recorded twin is the same distribution
    (L1 within 1e-3): the nearest recorded row by L2 (a matrix product), then its L1, in chunks of rows."""
    found = []
    for start in range(0, wanted.shape[0], CHUNK_ROWS):
        part = wanted[start:start + CHUNK_ROWS]
        near = torch.cat([torch.cdist(part, centered_log_probs(recorded[s:s + CHUNK_ROWS]).softmax(-1))
                          for s in range(0, recorded.shape[0], CHUNK_ROWS)], dim=1).argmin(1)
        for r, i in enumerate(near.tolist()):
            twin = centered_log_probs(recorded[i:i + 1]).softmax(-1)[0]
            if float((part[r] - twin).abs().sum()) <= 1e-3:
                found.append((start + r, i))
    return found
