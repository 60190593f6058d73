"""The targets: each trained row's target named by value (the recorded target tensor equal to it, or the gradient's
own distribution; hard labels: the data's next tokens or a candidate's argmax), then held to the reference: the
target's own final logits, clean."""

from __future__ import annotations

import math

import torch

from catalogue.findings import Finding
from dflash_audit.target_values import CHUNK_ROWS, Named, centered_log_probs, name_logits, spread_sample
from dflash_audit.trace.step_audit.state import LOOSE_GRADIENT, StepState

RIVALS = 6  # hard labels under noise: the candidates nearest by agreement, each fitted against the nearest


class TargetAudit(StepState):
    def target_positions(self, live: list, distributions: list[str], hard: bool) -> list | None:
        """Each trained row's target named by value: the recorded target row equal to it (then that tensor is
        named: which candidate, at which position, plus what residual), or the gradient's own distribution."""
        if hard:
            return None
        tables = []
        if distributions:  # named together: one candidate for every target row (noise averages out over them)
            parts = [self.evidence_rows(n) for n in distributions]  # less the rows the masks exclude
            sizes = [part.shape[0] for part in parts]
            rows = torch.cat(parts)
            del parts
            named = name_logits(rows, self.cands, min(self.tol(n) for n in distributions))
            del rows
            for n in distributions:
                self.account(n, f"the targets: {named.describe()}{self.left_out(n)}", named.distance)
            self.sampled(named, "the targets")
            self.target_findings(named, ", ".join(distributions) if len(distributions) < 3 else
                                 f"{distributions[0]} and {len(distributions) - 1} more")
            if (named.equal or named.noisy) and named.positions is not None:
                for n, part in zip(distributions, torch.split(named.positions, sizes)):
                    tables.append((n, part))
        positions: list[int | None] = [None] * len(live)
        if tables and live:
            wanted = torch.stack([p for _, _, p, _ in live])
            for n, pos in tables:  # each row's recorded twin: the same distribution (L1 within 1e-3)
                for r, i in twins(wanted, self.evidence_rows(n).float()):
                    if positions[r] is None:
                        positions[r] = int(pos[i])
        if tables and all(x is not None for x in positions):
            return positions
        # No recorded tensor holds them (made in code the recorder cannot see): the gradient's own rows, named.
        stacked = torch.stack([p.clamp_min(1e-30).log() for _, _, p, _ in live])
        named = name_logits(stacked, self.cands, LOOSE_GRADIENT)
        del stacked
        self.sampled(named, "the targets read from the loss's gradient")
        self.target_findings(named, "the targets read from the loss's gradient")
        return named.positions.tolist() if named.positions is not None and (named.equal or named.noisy) else None

    def sampled(self, named: Named, what: str) -> None:
        if named.sampling:
            self.note(f"{what}: {named.sampling}")

    def targets(self, name: str) -> Named | None:
        rows = self.evidence_rows(name)
        named = name_logits(rows, self.cands, self.tol(name))
        self.sampled(named, name)
        self.account(name, f"the targets: {named.describe()}{self.left_out(name)}", named.distance)
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
        """Hard labels (one-hot targets): the data's next tokens, or a candidate's argmax, at the row's place; labels
        that are a candidate's argmax on most rows, its argmax under noise (label_noise.py)."""
        labels = [int(p.argmax()) for _, _, p, _ in live]
        tokens = self.cands.tokens.reshape(-1)
        seq = self.cands.seq_len
        batch = tokens.numel() // seq
        # Each block's (data row, anchor): where the anchors were found (alignment.py), else its position ids' anchor
        # in the drafter call's batch row.
        anchors = {key: divmod(flat, seq) for key, flat in self.anchor_at.items()}
        for call, block in self.blocks.items() if not anchors else ():
            for key, a in block.get("positions", {}).items():
                anchors[(call, *key)] = (min(key[0], batch - 1), a)
        options: dict[str, list[int]] = {}
        places: dict[str, tuple] = {}  # an argmax option: its candidate and the flat position of each row
        flats: dict[int, list] = {}
        for shift in (0, 1, -1):
            data, flat = [], []
            for (slot, _, _, _) in live:
                found = anchors.get(slot[:3]) if slot is not None else None
                if found is None:
                    return None
                row, a = found[0] * seq, found[1]
                pos = a + slot[3] - 1 + shift
                data.append(int(tokens[row + pos + 1]) if pos + 1 in range(seq) else -1)
                flat.append(row + pos if pos in range(seq) else None)
            options[f"the data's next tokens{f' (shifted by {shift:+d})' if shift else ''}"] = data
            flats[shift] = flat
        # Each candidate's argmax only where a label sits: screened on a spread sample of the rows, then the
        # candidates that could lead on every row (all of them when the sample is every row).
        candidates = self.cands.logit_candidates()
        sample = set(spread_sample(len(live)).tolist())
        tops: dict = {c: {} for c in candidates}

        def argmax_at(c, rows) -> None:
            missing = sorted({f for flat in flats.values() for r, f in enumerate(flat)
                              if f is not None and r in rows and f not in tops[c]})
            if missing:
                tops[c].update(zip(missing, self.cands.argmax(c, torch.tensor(missing)).tolist()))

        def agreement(c, shift, rows) -> float:
            flat = flats[shift]
            return sum(labels[r] == tops[c][flat[r]] for r in rows if flat[r] is not None) / max(len(rows), 1)

        shortlist = candidates
        if len(sample) < len(live):
            for c in candidates:
                argmax_at(c, sample)
            lead = {c: max(agreement(c, shift, sample) for shift in flats) for c in candidates}
            ranked = sorted(candidates, key=lambda c: -lead[c])
            shortlist = [c for c in candidates if c in ranked[:2 * (RIVALS + 1)] or lead[c] >= lead[ranked[0]] - 0.1]
        every = set(range(len(live)))
        for c in shortlist:
            argmax_at(c, every)
        for shift, flat in flats.items():
            for c in shortlist:
                name = f"the argmax of {c.name}{f' (shifted by {shift:+d})' if shift else ''}"
                options[name] = [tops[c][f] if f is not None else -1 for f in flat]
                places[name] = (c, flat)
        scored = sorted(((sum(a == b for a, b in zip(labels, v)) / len(labels), k) for k, v in options.items()),
                        key=lambda x: -x[0])
        share, best = scored[0]
        self.flow["labels"] = f"{best} ({share:.0%} of {len(labels)} rows)"
        if best in places and None not in places[best][1]:
            self.label_places = list(places[best][1])
        if share < 1.0:
            return self.noisy_labels(labels, scored, places)
        source = next((c for c in candidates if best == f"the argmax of {c.name}"), None)
        if source is not None and source != self.cands.reference_logits:
            named = Named(source, 0.0, True)
            self.target_findings(named, "the hard labels, the argmax of the targets")
        return best

    def noisy_labels(self, labels: list[int], scored: list, places: dict) -> str | None:
        """Labels that no candidate's argmax gives on every row: the candidates they agree with most (at the best
        row offset), each fitted as its argmax under Gaussian noise on its logits (label_noise.py). The fit names the
        noise; the source is named only where one candidate explains the labels clearly better than every other
        (a likelihood ratio past the chi-square 95% point): where noise makes layers alike, it is said to be not
        checked. Labels nearest the data's tokens stay unexplained (said, never guessed)."""
        from dflash_audit.trace.step_audit.label_noise import CHI2_95, fit_noise

        share, best = scored[0]
        if best not in places or None in places[best][1]:
            self.add(Finding("unexplained", "warning", f"the hard labels are no candidate's argmax and not the "
                             f"data's tokens: the nearest, {best}, agrees on {share:.0%} of {len(labels)} rows",
                             None, None, key="labels"), edge="targets")
            return None
        wanted = torch.tensor(labels)
        flat = places[best][1]

        # The fit reads each candidate's logits on a spread sample of the rows (all of them up to SAMPLE_ROWS).
        fitted = spread_sample(len(labels))
        wanted = wanted[fitted]
        flat = [flat[i] for i in fitted.tolist()]

        def rows_of(key):
            return self.cands.logits(places[key][0], torch.tensor(flat)).cpu()

        same_offset = [k for _, k in scored if k in places and places[k][1] == flat and k != best][:RIVALS]
        if len(fitted) < len(labels):
            self.note(f"the noise on the hard labels is fitted on {len(fitted)} of their {len(labels)} rows (spread "
                      "over the batch and the positions)")
        fits = {best: fit_noise(rows_of(best), wanted)}
        for key in same_offset:
            fits[key] = fit_noise(rows_of(key), wanted, around=fits[best].sigma)
        likeliest = max(fits, key=lambda k: fits[k].log_likelihood)
        if likeliest != best:
            fits[likeliest] = fit_noise(rows_of(likeliest), wanted)
        fit = fits[likeliest]
        alike = [k for k in fits if fits[k].log_likelihood >= fit.log_likelihood - CHI2_95 / 2]
        sources = list(dict.fromkeys(places[k][0] for k in alike))
        self.flow["labels"] = f"{likeliest} plus noise ({fit.rows - fit.flipped} of {fit.rows} rows its argmax)"
        if len(sources) > 1:
            what = "the argmax of one of " + "; ".join(c.name for c in sources)
            self.note(f"the targets' source is not checked: under the noise on the hard labels, {what} explain them "
                      f"alike (log-likelihoods within {CHI2_95 / 2:.2f} of each other; hard labels keep only which "
                      "logit won)")
        else:
            what = likeliest
            if sources[0] != self.cands.reference_logits:
                self.target_findings(Named(sources[0], 0.0, True),
                                     "the hard labels, the argmax of the targets under noise")
        interval = f"95% interval {fit.low:.3g} to {fit.high:.3g}" if math.isfinite(fit.high) else \
            f"95% interval from {fit.low:.3g}, unbounded above"
        said = (f"std {fit.sigma:.3g} ({interval}; a maximum-likelihood fit to the labels)" if fit.identified else
                f"its std not identifiable from hard labels ({interval})")
        self.add(Finding("noise", "divergence", f"the targets carry noise: {fit.flipped} of {fit.rows} hard labels "
                         f"are not the argmax of {likeliest.removeprefix('the argmax of ')}; the labels are "
                         f"{what} under Gaussian noise on the logits, {said}; the reference computes targets from "
                         "clean target states (noise belongs on the drafter's inputs only)",
                         round(fit.sigma, 4) if fit.identified else None, 0.0, pitfall=15, key="targets",
                         raw={"tensor": "the hard labels", "interval": [fit.low, fit.high], "estimate": fit.sigma,
                              "rows": fit.rows, "flipped": fit.flipped,
                              "alike": {k: fits[k].log_likelihood for k in alike}}), edge="targets")
        return likeliest


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
