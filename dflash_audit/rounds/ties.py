"""A parting round that is the replay's own argmax near-tie broken the other way, for a source that does not say
what its drafter was fed (llama.cpp).

The one near-tie rule (`impl/near_tie.py`) judges it: two float32 implementations of one drafter (an engine's
kernels, torch's) sum in other orders, their logits part by about 1e-4 on the test world, so two candidates closer
than `TIE_MARGIN` may come out in either order. Below float32 the rule needs what the source's inputs move the
scores, which such a source does not show: no parting is called a tie there. A parting is only called a tie where
the replay's top two are that close at the first proposal the source and the replay judge apart, and only kept when
the replay taking the runner-up there then gives the source's rounds.
"""

from __future__ import annotations

import torch

from impl.near_tie import KERNEL_MARGIN, near_tie

TIE_MARGIN = KERNEL_MARGIN


class TieFlips:
    """The drafter's top-two logit margin recorded at every slot of every round (one `compute_logits` per round,
    for a DFlash drafter without a selector), and chosen slots' top two swapped, as the source's argmax had them."""

    def __init__(self, model, flips: dict[int, set[int]]):
        self.flips, self.round, self.margins, self.tops = flips, 0, [], []
        plain = model.compute_logits

        def compute_logits(hidden, head):
            logits = plain(hidden, head)
            top = logits.float().topk(2, dim=-1)
            self.margins.append((top.values[:, 0] - top.values[:, 1]).tolist())
            self.tops.append(top.indices.tolist())
            for slot in self.flips.get(self.round, ()):
                first, second = top.indices[slot].tolist()
                logits = logits.clone()
                kept = logits[slot, first].item()
                logits[slot, first] = logits[slot, second]
                logits[slot, second] = kept
            self.round += 1
            return logits

        model.compute_logits = compute_logits  # this replay's drafter only: built for it


def flip_near_ties(spec, state: dict[str, torch.Tensor], target, prompt_ids: list[int], max_new_tokens: int,
                   stop_ids: list[int], rounds: list[int], whole_blocks: bool = False,
                   max_flips: int = 8) -> tuple[list[dict], int | None] | None:
    """Whether a source's `rounds` are the replay's (the drafter `spec` with weights `state`) with argmax near-ties
    broken the other way: at each differing round, the first slot where the source's and the replay's proposals
    part must be a near-tie (top two within TIE_MARGIN), and the replay taking the runner-up there must give the
    source's round. (ties taken, the first round still differing after them or None), or None when the first is no
    tie. `whole_blocks`: replayed drafting whole blocks, as an engine does near its budget's end."""
    from dflash_audit.rounds.match import first_difference
    from dflash_audit.rounds.replay import built
    from impl.decoding import dflash_decode

    flips: dict[int, set[int]] = {}
    taken: list[dict] = []
    for _ in range(max_flips + 1):
        model = built(spec, state, target)
        if model.candidate_selector is not None or model.reads_whole_block:
            return None  # its proposals are not each slot's own argmax
        record = TieFlips(model, flips)
        replayed = dflash_decode(model, target, torch.tensor([prompt_ids]), max_new_tokens, stop_ids,
                                 whole_blocks=whole_blocks).acceptance_lengths
        first = first_difference(rounds, replayed)
        if first is None:
            return taken, None
        index = first - 1
        slot = min(rounds[index:index + 1] + replayed[index:index + 1]) - 1  # the first proposal judged apart
        margins = record.margins[index] if index < len(record.margins) else []
        if slot >= len(margins) or not near_tie(margins[slot], next(model.parameters()).dtype) \
                or slot in flips.get(index, set()) \
                or len(taken) == max_flips:
            return (taken, first) if taken else None
        flips.setdefault(index, set()).add(slot)
        replay_top, runner_up = record.tops[index][slot]
        taken.append({"round": first, "slot": slot + 1, "margin": round(margins[slot], 6), "replay_token": replay_top,
                      "engine_token": runner_up})
    return None
