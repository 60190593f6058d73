"""The long-context faults, named by value: which one a source of rounds (an evaluator, an engine) carries.

A source whose rounds part from the audit's replay of z-lab's loop only past some position may run the drafter
otherwise along the context. Each fault below is replayed as a variant of the audit's own replay (the same cache,
the same drafter weights); a variant whose rounds equal the source's on every prompt names the fault, as one finding:
- the sliding window ignored: the sliding layers run as full ones (the seed evaluator's "short context" assumption,
  z-lab #126, speculators #523);
- the drafter's context capped at N tokens: every layer sees at most N positions back (a runtime's drafter context
  limit, Luce-Org/lucebox #740); N is searched where the rounds first part;
- the block's positions rebased past the trained length: its rotary positions pulled back so that the block ends at
  the trained length, while the context keeps its absolute positions (buun-llama-cpp #32) — or, from a reference
  that rebases, a source that does not;
- rope_theta read as a default (transformers' and SGLang's 10000, vLLM's 1e6) instead of the config's nested
  `rope_parameters.rope_theta` (how each engine reads the field statically is pitfall #30, `serve-check`).
Nothing is guessed: a source no variant reproduces gets no finding here (the rounds core names where it parts).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from catalogue.findings import Finding
from dflash_audit.tau.along_context import ContextMarks
from impl.body_shapes import build_drafter
from impl.defaults import QWEN3_DEFAULTS
from impl.offline.cache import CachedPrompt, HiddenStateCache
from impl.offline.walks import offline_rounds_batch

# The defaults a reader falls back to for a rope_theta it does not find (pitfall #30).
THETA_DEFAULTS = {QWEN3_DEFAULTS["rope_theta"]: "transformers' and SGLang's default", 1_000_000.0: "vLLM's default"}
# Context caps tried when the first parting position gives no tighter bound: powers of two, the usual limits.
CAP_CANDIDATES = tuple(2 ** k for k in range(4, 18))


@dataclass
class Variant:
    """One long-context fault, replayable: a drafter built otherwise and/or the block's positions moved."""

    component: str
    key: str
    pitfall: int
    says: str  # what the source does, as the finding words it
    drafter: torch.nn.Module
    block_positions: Callable[[torch.Tensor], torch.Tensor] | None = None


def respecced(drafter, **changes) -> torch.nn.Module:
    """The drafter's weights under a changed spec, where it already sits."""
    weight = next(drafter.parameters())
    model = build_drafter(drafter.spec.replace(**changes), drafter.state_dict())
    return model.to(weight.device, weight.dtype).eval()


def rebased_block(block_size: int, trained_length: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Slot positions of each block pulled back so the block ends at the trained length, past it."""
    def positions(anchors: torch.Tensor) -> torch.Tensor:
        slots = anchors[:, None] + torch.arange(block_size, device=anchors.device)[None]
        return slots - (anchors + block_size - trained_length).clamp(min=0)[:, None]
    return positions


def variants(drafter, marks: ContextMarks, parting_positions: Sequence[int]) -> list[Variant]:
    """The faults that can apply to this drafter, each built once; a cap's N within what the first partings allow
    (a cap of N changes nothing before a block reaches N context positions)."""
    spec = drafter.spec
    found = []
    if marks.sliding_window is not None:
        found.append(Variant("layer_types", "sliding window ignored", 11,
                             f"runs the sliding layers as full attention: the window of {marks.sliding_window} is "
                             "ignored past it", respecced(drafter, layer_types=tuple(["full_attention"] *
                                                                                       spec.num_hidden_layers),
                                                          sliding_window=None)))
    if parting_positions:
        reach = max(parting_positions) + drafter.block_size
        for cap in [n for n in CAP_CANDIDATES if n < reach]:
            if marks.sliding_window is not None and cap >= marks.sliding_window and \
                    all(t == "sliding_attention" for t in spec.layer_types):
                continue  # an all-sliding drafter never sees past its window: a wider cap changes nothing
            found.append(Variant("layer_types", f"context capped at {cap}", 11,
                                 f"caps the drafter's context at {cap} tokens: every layer sees at most {cap} "
                                 "positions back", capped(drafter, cap)))
    if marks.trained_length is not None:
        found.append(Variant("positions", "block positions rebased past the trained length", 12,
                             f"rebases the block's rotary positions past the trained length {marks.trained_length} "
                             "(the block ends at it) while the context keeps absolute positions", drafter,
                             rebased_block(drafter.block_size, marks.trained_length)))
    for theta, whose in THETA_DEFAULTS.items():
        if marks.rope_theta is not None and theta != marks.rope_theta:
            found.append(Variant("rotary", "rope_theta read as a default", 30,
                                 f"reads rope_theta as {theta:g} ({whose}) instead of the config's "
                                 f"{marks.rope_theta:g} (nested in rope_parameters)", respecced(drafter,
                                                                                               rope_theta=theta)))
    return found


def capped(drafter, cap: int) -> torch.nn.Module:
    """The drafter (its very weights) with every layer seeing at most `cap` positions back: a full layer windowed at
    the cap, a sliding one at the narrower of its window and the cap."""
    model = copy.copy(drafter)
    spec = drafter.spec

    def layer_masks(make):
        cache, masks = {}, []
        for i in range(spec.num_hidden_layers):
            window = spec.window_of(i)
            key = (cap if window is None else min(window, cap), spec.block_is_causal(i))
            masks.append(cache[key] if key in cache else cache.setdefault(key, make(*key)))
        return masks

    model.layer_masks = layer_masks
    return model


def first_partings(source: dict[str, list[int]], reference: dict[str, list[int]],
                   entries: Sequence[CachedPrompt]) -> list[tuple[str, int, int]]:
    """(prompt, round, anchor position) of the first round that parts on each prompt whose rounds part."""
    out = []
    for entry in entries:
        a, b = source[entry.id], reference[entry.id]
        position = entry.prompt_len
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                out.append((entry.id, i, position))
                break
            position += x
        else:
            if len(a) != len(b):
                out.append((entry.id, min(len(a), len(b)), position))
    return out


@torch.inference_mode()
def context_fault_finding(drafter, target, cache: HiddenStateCache, source: dict[str, list[int]], who: str,
                          marks: ContextMarks) -> Finding | None:
    """The one long-context fault whose replay gives `who`'s rounds (`source`: prompt id -> rounds) on every prompt
    of `cache`, as a finding; None when the source walks as the audit's replay, or no variant reproduces it."""
    entries = cache.prompts
    reference = dict(zip([e.id for e in entries], offline_rounds_batch(drafter, target, cache, entries)))
    partings = first_partings(source, reference, entries)
    if not partings:
        return None
    tried = []
    for variant in variants(drafter, marks, [position for _, _, position in partings]):
        rounds = offline_rounds_batch(variant.drafter, target, cache, entries, block_positions=variant.block_positions)
        tried.append(variant.key)
        if all(rounds[i] == source[e.id] for i, e in enumerate(entries)):
            prompt, round_no, position = min(partings, key=lambda p: p[2])
            past = [label for at, label in marks.lines() if position >= at]
            return Finding(
                variant.component, "divergence",
                f"{who} {variant.says}: its rounds are the audit's replay with that fault on all {len(entries)} "
                f"prompts; they first part at round {round_no} of {prompt}, anchored at position {position}"
                + (f" (past the {', '.join(past)})" if past else "") + ".",
                None, variant.key, pitfall=variant.pitfall, key=variant.key,
                raw={"prompt": prompt, "round": round_no, "position": position, "tried": tried},
                localized={"kind": "input", "prompt": prompt, "round": round_no})
    return None
