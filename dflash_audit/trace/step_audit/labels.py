"""The hard labels' source: one-hot targets are the data's next tokens, or a candidate's argmax, at each row's place
(each block's anchor, where anchors.py placed it, else its position ids'); labels that are a candidate's argmax on
most rows, its argmax under Gaussian noise (label_noise.py). The source is held to the reference (the target's own
logits, targets.py's `target_findings`); the places of the argmax the labels were read at are where each row's target
sits (alignment.py).

The stage: `name_labels(step, blocks, loss, anchors) -> Labels`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from catalogue.findings import Finding
from dflash_audit.target_values import Named, spread_sample
from dflash_audit.trace.step_audit.anchors import Anchors
from dflash_audit.trace.step_audit.blocks import Blocks
from dflash_audit.trace.step_audit.loss_rows import LossRows
from dflash_audit.trace.step_audit.state import StepState
from dflash_audit.trace.step_audit.targets import target_findings

RIVALS = 6  # hard labels under noise: the candidates nearest by agreement, each fitted against the nearest


@dataclass
class Labels:
    """Hard labels: their source in words (None: soft targets, or not told), and each live row's flat place its
    label was read at, where it is a candidate's argmax (None: not such a source)."""
    source: str | None = None
    places: list | None = None


def name_labels(step: StepState, blocks: Blocks, loss: LossRows, anchors: Anchors) -> Labels:
    """Hard labels' source and places (`label_source`); soft targets: none."""
    found = Labels()
    if loss.hard:
        found.source = label_source(step, blocks, anchors, loss.live, found)
    return found


def label_source(step: StepState, blocks: Blocks, anchors: Anchors, live: list, found: Labels) -> str | None:
    """Hard labels (one-hot targets): the data's next tokens, or a candidate's argmax, at the row's place; labels
    that are a candidate's argmax on most rows, its argmax under noise (label_noise.py). The places of the best
    argmax option: `found.places`."""
    labels = [int(p.argmax()) for _, _, p, _ in live]
    tokens = step.cands.tokens.reshape(-1)
    seq = step.cands.seq_len
    batch = tokens.numel() // seq
    # Each block's (data row, anchor): where the anchors were found (anchors.py), else its position ids' anchor
    # in the drafter call's batch row.
    at = {key: divmod(flat, seq) for key, flat in anchors.places.items()}
    for call, block in blocks.calls.items() if not at else ():
        for key, a in block.get("positions", {}).items():
            at[(call, *key)] = (min(key[0], batch - 1), a)
    options: dict[str, list[int]] = {}
    places: dict[str, tuple] = {}  # an argmax option: its candidate and the flat position of each row
    flats: dict[int, list] = {}
    for shift in (0, 1, -1):
        data, flat = [], []
        for (slot, _, _, _) in live:
            placed = at.get(slot[:3]) if slot is not None else None
            if placed is None:
                return None
            row, a = placed[0] * seq, placed[1]
            pos = a + slot[3] - 1 + shift
            data.append(int(tokens[row + pos + 1]) if pos + 1 in range(seq) else -1)
            flat.append(row + pos if pos in range(seq) else None)
        options[f"the data's next tokens{f' (shifted by {shift:+d})' if shift else ''}"] = data
        flats[shift] = flat
    # Each candidate's argmax only where a label sits: screened on a spread sample of the rows, then the
    # candidates that could lead on every row (all of them when the sample is every row).
    candidates = step.cands.logit_candidates()
    sample = set(spread_sample(len(live)).tolist())
    tops: dict = {c: {} for c in candidates}

    def argmax_at(c, rows) -> None:
        missing = sorted({f for flat in flats.values() for r, f in enumerate(flat)
                          if f is not None and r in rows and f not in tops[c]})
        if missing:
            tops[c].update(zip(missing, step.cands.argmax(c, torch.tensor(missing)).tolist()))

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
    step.flow["labels"] = f"{best} ({share:.0%} of {len(labels)} rows)"
    if best in places and None not in places[best][1]:
        found.places = list(places[best][1])
    if share < 1.0:
        return noisy_labels(step, labels, scored, places)
    source = next((c for c in candidates if best == f"the argmax of {c.name}"), None)
    if source is not None and source != step.cands.reference_logits:
        named = Named(source, 0.0, True)
        target_findings(step, named, "the hard labels, the argmax of the targets")
    return best


def noisy_labels(step: StepState, labels: list[int], scored: list, places: dict) -> str | None:
    """Labels that no candidate's argmax gives on every row: the candidates they agree with most (at the best
    row offset), each fitted as its argmax under Gaussian noise on its logits (label_noise.py). The fit names the
    noise; the source is named only where one candidate explains the labels clearly better than every other
    (a likelihood ratio past the chi-square 95% point): where noise makes layers alike, it is said to be not
    checked. Labels nearest the data's tokens stay unexplained (said, never guessed)."""
    from dflash_audit.trace.step_audit.label_noise import CHI2_95, fit_noise

    share, best = scored[0]
    if best not in places or None in places[best][1]:
        step.add(Finding("unexplained", "warning", f"the hard labels are no candidate's argmax and not the "
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
        return step.cands.logits(places[key][0], torch.tensor(flat)).cpu()

    same_offset = [k for _, k in scored if k in places and places[k][1] == flat and k != best][:RIVALS]
    if len(fitted) < len(labels):
        step.note(f"the noise on the hard labels is fitted on {len(fitted)} of their {len(labels)} rows (spread "
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
    step.flow["labels"] = f"{likeliest} plus noise ({fit.rows - fit.flipped} of {fit.rows} rows its argmax)"
    if len(sources) > 1:
        what = "the argmax of one of " + "; ".join(c.name for c in sources)
        step.note(f"the targets' source is not checked: under the noise on the hard labels, {what} explain them "
                  f"alike (log-likelihoods within {CHI2_95 / 2:.2f} of each other; hard labels keep only which "
                  "logit won)")
    else:
        what = likeliest
        if sources[0] != step.cands.reference_logits:
            target_findings(step, Named(sources[0], 0.0, True),
                            "the hard labels, the argmax of the targets under noise")
    interval = f"95% interval {fit.low:.3g} to {fit.high:.3g}" if math.isfinite(fit.high) else \
        f"95% interval from {fit.low:.3g}, unbounded above"
    said = (f"std {fit.sigma:.3g} ({interval}; a maximum-likelihood fit to the labels)" if fit.identified else
            f"its std not identifiable from hard labels ({interval})")
    step.add(Finding("noise", "divergence", f"the targets carry noise: {fit.flipped} of {fit.rows} hard labels "
                     f"are not the argmax of {likeliest.removeprefix('the argmax of ')}; the labels are "
                     f"{what} under Gaussian noise on the logits, {said}; the reference computes targets from "
                     "clean target states (noise belongs on the drafter's inputs only)",
                     round(fit.sigma, 4) if fit.identified else None, 0.0, pitfall=15, key="targets",
                     raw={"tensor": "the hard labels", "interval": [fit.low, fit.high], "estimate": fit.sigma,
                          "rows": fit.rows, "flipped": fit.flipped,
                          "alike": {k: fits[k].log_likelihood for k in alike}}), edge="targets")
    return likeliest
