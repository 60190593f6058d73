"""A source of rounds: what a speculative decoder did on each prompt, round by round, in the audit's words.

A serving engine (vLLM, llama.cpp) or a team's own evaluator (recorded by `trace --eval`) is one `RoundSource`:
per prompt (`PromptRounds`) the rounds (the block it drafted, how many of it the target accepted) and, where the
source knows it, what its drafter was fed at a round (`DrafterFeed`), which lets the assessment localize a parting by
value. `assess.py` holds any source to the audit's replay of z-lab's loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from catalogue.findings import Finding


@dataclass
class DrafterFeed:
    """What a drafter was fed at one round, and what the source saw it compute there (each by value).

    As trained (z-lab's loop) the block is `[last known token, mask x (B - 1)]` at positions `start..start + B - 1`,
    the context every position before `start`, each context row the concatenated hidden states of the declared target
    layers (`hidden_states[id + 1]`)."""

    block_tokens: list[int]
    block_positions: list[int]
    context_positions: list[int]  # the context rows the drafter attended to
    features: torch.Tensor  # [len(context_positions), layers x hidden]: what it read as each row's target features
    # The rows the drafter's fc projected at this round (an engine's KV cache keeps the earlier ones); default all.
    step_positions: list[int] | None = None
    # Module outputs the source captured, by the drafter's module name: "fc", "layers.<i>", "norm"; the context keys
    # of every layer at once, "context" (fc's output), "context_k_in" (before k_norm), "context_k" (after).
    modules: dict[str, torch.Tensor] = field(default_factory=dict)
    drafts: list[int] = field(default_factory=list)  # the proposals it drafted from them

    @property
    def start(self) -> int:
        return self.block_positions[0]

    def __post_init__(self) -> None:
        if self.step_positions is None:
            self.step_positions = list(self.context_positions)


@dataclass
class PromptRounds:
    """One prompt as a source ran it. `rounds`: tokens each round added, the bonus included (z-lab's
    `acceptance_lengths`; the prefill's first token is no round)."""

    id: str
    prompt_ids: list[int]
    rounds: list[int]
    blocks: list[list[int]] | None = None  # the proposals each round's verification judged; None: not known
    output: list[int] | None = None  # the tokens generated after the prompt (the prefill's first one included)
    feed: Callable[[int], DrafterFeed | None] | None = None  # round r (1-based) -> what the drafter was fed at r
    facts: dict[str, Any] = field(default_factory=dict)  # the source's own per-prompt figures, shown in its row

    @property
    def tau(self) -> float:
        return sum(self.rounds) / len(self.rounds) if self.rounds else 0.0

    @classmethod
    def from_accepted(cls, id: str, prompt_ids: list[int], accepted: list[int], output: list[int] | None = None,
                      blocks: list[list[int]] | None = None, **more) -> PromptRounds:
        """From how many proposals the target accepted per round (an evaluator's record, llama.cpp's trace line):
        each round adds those and the target's own token. With the output known the rounds are counted the audit's
        way: they stop where the output does (its budget, a stop token), and what it holds beyond them (a last
        verification that drafted nothing) is one more round."""
        if output is None:
            return cls(id, list(prompt_ids), [count + 1 for count in accepted], blocks, None, **more)
        left = len(output) - 1  # the prefill gave the first token
        rounds = []
        for count in accepted:
            if left <= 0:
                break
            rounds.append(min(count + 1, left))
            left -= rounds[-1]
        if left > 0:
            rounds.append(left)
        return cls(id, list(prompt_ids), rounds, None if blocks is None else blocks[:len(rounds)], list(output),
                   **more)


@dataclass
class Localized:
    """What a localizer found at a prompt's first parting round: findings (`Finding.localization`, each naming the
    prompt and round) and what the prompt's row says of it (`explained_by`, and any evidence: `ties`...)."""

    findings: list[Finding] = field(default_factory=list)
    row: dict[str, Any] = field(default_factory=dict)


class Localizer(Protocol):
    def __call__(self, index: int, prompt: PromptRounds, audited, round_no: int) -> Localized:
        """Why prompt number `index` parts from the replay `audited` (an `impl.decoding.DecodeResult`) at round
        `round_no` (1-based)."""


@dataclass
class RoundSource:
    """Every prompt as one source ran it, the same prompts the audit replays (same order, same stop ids).

    `name`: what ran them, for the report ("vLLM 0.32.0", "llama.cpp b11434", "eval.py"). `speculative_tokens`: the
    proposals it drafts per round (K = block size - 1). `localize`: how it explains a parting round (None: it cannot;
    `by_value.FedLocalizer` for a source whose prompts carry what the drafter was fed)."""

    name: str
    speculative_tokens: int
    prompts: list[PromptRounds]
    localize: Localizer | None = None
