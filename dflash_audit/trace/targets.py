"""The targets: each trained row's target named by value (the recorded target tensor equal to it, or the gradient's
own distribution; hard labels: the data's next tokens or a candidate's argmax), then held to the reference: the
target's own final logits, clean."""

from __future__ import annotations

import torch

from catalogue.findings import Finding
from dflash_audit.trace.matcher import Named, centered_log_probs, name_rows
from dflash_audit.trace.step_state import LOOSE_GRADIENT, StepState, as_rows


class TargetAudit(StepState):
    def target_positions(self, live: list, distributions: list[str], hard: bool) -> list | None:
        """Each trained row's target named by value: the recorded target row equal to it (then that tensor is
        named: which candidate, at which position, plus what residual), or the gradient's own distribution."""
        if hard:
            return None
        tables = []
        if distributions:  # named together: one candidate for every target row (noise averages out over them)
            rows = [centered_log_probs(as_rows(self.tensors[n])) for n in distributions]
            named = name_rows(torch.cat(rows), self.cands.log_probs(), min(self.tol(n) for n in distributions))
            for n in distributions:
                self.account(n, f"the targets: {named.describe()}", named.distance)
            self.target_findings(named, ", ".join(distributions) if len(distributions) < 3 else
                                 f"{distributions[0]} and {len(distributions) - 1} more")
            if (named.equal or named.noisy) and named.positions is not None:
                for n, part in zip(distributions, torch.split(named.positions, [r.shape[0] for r in rows])):
                    tables.append((n, centered_log_probs(as_rows(self.tensors[n])).softmax(-1), part))
        positions: list[int | None] = [None] * len(live)
        if tables and live:
            wanted = torch.stack([p for _, _, p, _ in live])
            for n, probs, pos in tables:  # each row's recorded twin: the same distribution (L1 within 1e-3)
                distance, index = torch.cdist(wanted, probs, p=1).min(1)
                for r, (d, i) in enumerate(zip(distance.tolist(), index.tolist())):
                    if positions[r] is None and d <= 1e-3:
                        positions[r] = int(pos[i])
        if tables and all(x is not None for x in positions):
            return positions
        # No recorded tensor holds them (made in code the recorder cannot see): the gradient's own rows, named.
        stacked = torch.stack([p.clamp_min(1e-30).log() for _, _, p, _ in live])
        named = name_rows(centered_log_probs(stacked), self.cands.log_probs(), LOOSE_GRADIENT)
        self.target_findings(named, "the targets read from the loss's gradient")
        return named.positions.tolist() if named.positions is not None and (named.equal or named.noisy) else None

    def targets(self, name: str) -> Named | None:
        rows = centered_log_probs(as_rows(self.tensors[name]))
        named = name_rows(rows, self.cands.log_probs(), self.tol(name))
        self.account(name, f"the targets: {named.describe()}", named.distance)
        self.target_findings(named, name)
        return named if named.equal or named.noisy else None

    def target_findings(self, named: Named, what: str) -> None:
        ref = self.cands.reference_logits
        self.flow.setdefault("targets", named.candidate.name if named.candidate else None)
        if named.candidate is not None and named.candidate != ref and (named.equal or named.noisy):
            c = named.candidate
            why = "its final norm never applied" if not c.normed else \
                "the final norm applied twice" if "twice" in c.name else \
                f"layer {c.layer} instead of the final layer {self.cands.layers - 1}"
            self.add(Finding("targets", "divergence", f"the target logits equal {c.name}; the reference distils "
                             f"hidden_states[-1], the final layer {self.cands.layers - 1} after its norm (the target's "
                             f"own logits): {why}", c.name, ref.name, pitfall=3, key="target_source"),
                     edge="targets")
        elif not (named.equal or named.noisy):
            self.add(Finding("unexplained", "warning", f"the targets are no candidate of the target ({what}): "
                             f"{named.describe()}", None, None, key="targets"), edge="targets")
            return
        if named.noisy:
            self.add(Finding("noise", "divergence", f"the targets carry noise ({what}): they equal "
                             f"{named.candidate.name} plus a residual no candidate explains, std "
                             f"{named.residual_std:.3g} ({named.relative_noise:.2g} of the clean logits' std); the "
                             "reference computes targets from clean target states (noise belongs on the drafter's "
                             "inputs only)", round(named.residual_std, 4), 0.0, pitfall=15, key="targets",
                             raw={"relative": named.relative_noise, "tensor": what}), edge="targets")


    def label_source(self, live: list, positions) -> str | None:
        """Hard labels (one-hot targets): the data's next tokens, or a candidate's argmax, at the row's place."""
        labels = [int(p.argmax()) for _, _, p, _ in live]
        tokens = self.cands.tokens.reshape(-1)
        anchors = {}
        for call, block in self.blocks.items():
            for key, a in block.get("positions", {}).items():
                anchors[(call, *key)] = a
        seq = self.cands.seq_len
        batch = tokens.numel() // seq
        options: dict[str, list[int]] = {}
        tops = {c: logits.argmax(-1) for c, logits in self.cands.logits.items()}
        for shift in (0, 1, -1):
            data, argmax = [], {c: [] for c in self.cands.logits}
            for (slot, _, _, _) in live:
                a = anchors.get(slot[:3]) if slot is not None else None
                if a is None:
                    return None
                pos = a + slot[3] - 1 + shift
                row = min(slot[1], batch - 1) * seq  # the drafter call's batch row: the data's row
                data.append(int(tokens[row + pos + 1]) if pos + 1 in range(seq) else -1)
                for c, top in tops.items():
                    argmax[c].append(int(top[row + pos]) if pos in range(seq) else -1)
            options[f"the data's next tokens{f' (shifted by {shift:+d})' if shift else ''}"] = data
            for c, values in argmax.items():
                options[f"the argmax of {c.name}{f' (shifted by {shift:+d})' if shift else ''}"] = values
        scored = sorted(((sum(a == b for a, b in zip(labels, v)) / len(labels), k) for k, v in options.items()),
                        key=lambda x: -x[0])
        share, best = scored[0]
        self.flow["labels"] = f"{best} ({share:.0%} of {len(labels)} rows)"
        if share < 1.0:  # said plainly, never turned into a guessed source or a guessed noise
            self.add(Finding("unexplained", "warning", f"the hard labels are no candidate's argmax and not the "
                             f"data's tokens: the nearest, {best}, agrees on {share:.0%} of {len(labels)} rows (a "
                             "source or noise the labels cannot tell apart)", None, None, key="labels"),
                     edge="targets")
        if share == 1.0:
            source = next((c for c in self.cands.logits if best == f"the argmax of {c.name}"), None)
            if source is not None and source != self.cands.reference_logits:
                named = Named(source, 0.0, True)
                self.target_findings(named, "the hard labels, the argmax of the targets")
        return best if share == 1.0 else None
