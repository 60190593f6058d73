"""llama.cpp as a source of rounds: llama-server's own trace line per verification step (`accepted X/ Y draft
tokens`, `serving_engines/live/llamacpp_server.py`) read as the accepted count of each round; the blocks it drafted
and what it fed its drafter are not known (llama.cpp has no Python to hook).

So a parting round is localized by counterfactual replays in the audit, each changing one thing to what the engine
has: the GGUF's dequantized weights, the block the engine drafted, the target layers the GGUF declares, its mask
token, its layers' causality, the whole block drafted near the budget's end. The first variant whose rounds equal
the engine's through the first round where the engine and the audit part names the finding; else the near-tie rule
(`ties.flip_near_ties`, on the GGUF's own weights, whole blocks drafted as the engine drafts); a difference neither
reproduces stays `unlocalized`, with its first differing round.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from catalogue.findings import Finding
from dflash_audit.rounds.replay import built, zlab_replay
from dflash_audit.rounds.source import Localized, PromptRounds, RoundSource
from dflash_audit.rounds.ties import TIE_MARGIN, flip_near_ties

# The counterfactual replays, in the order they are tried, and the rule (`serving_engines.llamacpp_engine.source`)
# that each one names.
VARIANTS = (
    ("quantization", None, "the GGUF's own (dequantized) weights"),
    ("block_length", "block_size", "the block the engine drafted (1 + --spec-draft-n-max, clamped to the GGUF's "
                                   "dflash.block_size - 1)"),
    ("target_layer_ids", "target_layer_ids", "the target layers the GGUF declares (dflash.target_layers - 1)"),
    ("mask_token_id", "mask_token_id", "the GGUF's mask token (tokenizer.ggml.mask_token_id)"),
    ("layer_causal", "layer_causal", "every draft layer non-causal, as the engine runs a GGUF without "
                                     "dflash.attention.causal = true"),
    ("final_block", "final_block", "the whole block drafted in every round, its proposals cut to what is left, as "
                                   "the engine drafts near the budget's end (z-lab shrinks the block there)"),
)
# A variant that is the engine's own convention, not a defect of how it serves the drafter.
CONVENTIONS = ("final_block",)


@dataclass
class Served:
    """The GGUF the engine serves, as trained (the source's spec and weights) and as written (the GGUF's)."""

    gguf: Path
    spec: Any  # trained
    state: dict[str, torch.Tensor]  # trained
    gguf_spec: Any  # the GGUF's, read back
    gguf_state: dict[str, torch.Tensor]
    quantized: dict[str, str]
    notes: list[str]
    causal: bool = False  # the GGUF's dflash.attention.causal (absent: false, as llama.cpp reads it)
    marks: Any = None  # the drafter's window, trained length, rotary (`tau.along_context.ContextMarks`), as trained


def variant_of(name: str, served: Served, block: int):
    """(spec, state) of the counterfactual `name`: the trained drafter with one thing as the engine has it."""
    spec, state = served.spec, served.state
    if name == "quantization":
        return spec, {k: served.gguf_state.get(k, v) for k, v in state.items()}
    if name == "block_length":
        return spec.replace(block_size=block), state
    if name == "target_layer_ids":
        return spec.replace(target_layer_ids=served.gguf_spec.target_layer_ids), state
    if name == "layer_causal":
        return spec.replace(sliding_window_non_causal=True), state
    if name == "final_block":  # the decode differs (the replay's whole_blocks), not the drafter
        return spec, state
    return spec.replace(mask_token_id=served.gguf_spec.mask_token_id), state


def differs(name: str, served: Served, block: int) -> bool:
    """Whether the engine's side differs from training in what `name` changes (else replaying it proves nothing)."""
    if name == "quantization":
        return any(not torch.equal(served.gguf_state[k], v.to(served.gguf_state[k].dtype))
                   for k, v in served.state.items() if k in served.gguf_state)
    if name == "block_length":
        return block != served.spec.block_size
    if name == "layer_causal":
        return not served.causal and any(served.spec.block_is_causal(i) for i in range(served.spec.num_hidden_layers))
    if name == "final_block":
        return True  # the engine never shrinks its block: only a prompt's last rounds can show it
    field = {"target_layer_ids": "target_layer_ids", "mask_token_id": "mask_token_id"}[name]
    return getattr(served.gguf_spec, field) != getattr(served.spec, field)


def replay(spec, state, target, prompts, max_new_tokens: int, stop_ids: list[int], whole_blocks: bool = False):
    """z-lab's loop with the drafter `spec` of weights `state` (one counterfactual) on every prompt."""
    return zlab_replay(built(spec, state, target), target, prompts, max_new_tokens, stop_ids, whole_blocks)


def tie_flips(served: Served, target, prompt: dict, max_new_tokens: int, stop_ids, rounds: list[int],
              max_flips: int = 8) -> tuple[list[dict], int | None] | None:
    """The near-tie rule on the GGUF's own weights, whole blocks drafted as the engine drafts them."""
    spec, state = variant_of("quantization", served, served.spec.block_size)
    return flip_near_ties(spec, state, target, prompt["ids"], max_new_tokens, stop_ids, rounds, whole_blocks=True,
                          max_flips=max_flips)


class CounterfactualLocalizer:
    """The first counterfactual replay that reproduces the engine through the parting round, else near-ties proved by
    the replay, else `unlocalized`. Each variant is replayed once, on every prompt, when a prompt first needs it."""

    def __init__(self, served: Served, block: int, target, prompts: list[dict], max_new_tokens: int,
                 stop_ids: list[int]):
        self.served, self.block, self.target, self.prompts = served, block, target, prompts
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids
        self.runs: dict[str, list] = {}

    def __call__(self, index: int, prompt: PromptRounds, audited, first: int) -> Localized:
        from serving_engines.llamacpp_engine import source

        served, rounds, block = self.served, prompt.rounds, self.block
        for name, rule, words in VARIANTS:
            if not differs(name, served, block):
                continue
            if name not in self.runs:
                self.runs[name] = replay(*variant_of(name, served, block), self.target, self.prompts,
                                         self.max_new_tokens, self.stop_ids, whole_blocks=name == "final_block")
            replayed = self.runs[name][index].acceptance_lengths
            # It reproduces the engine through the first round the audit and the engine part at (a quantized
            # kernel's rounding may part them again later: those rounds are downstream, counted in the row).
            if replayed[:first] == rounds[:first]:
                types = ", ".join(sorted(set(served.quantized.values())))
                found = Finding.localization(
                    "convention" if name in CONVENTIONS else "input", name,
                    f"the audit's replay with {words} gives the engine's rounds", None,
                    source(rule) if rule else f"the GGUF's tensor types ({types})", prompt.id, first)
                return Localized([found], {"explained_by": [name], "variant_rounds_equal": replayed == rounds})
        ties = tie_flips(served, self.target, self.prompts[index], self.max_new_tokens, self.stop_ids, rounds)
        if ties is not None and not ties[0]:
            # No flip needed: the GGUF's own weights drafting whole blocks as the engine does give its rounds,
            # where neither alone did (a quantized drafter's last block): both named, at the round they part.
            name, rule, words = next(v for v in VARIANTS if v[0] == "final_block")
            found = Finding.localization(
                "convention", name, f"the audit's replay with the GGUF's own (dequantized) weights and {words} "
                f"gives the engine's rounds (neither alone does)", None, source(rule), prompt.id, first)
            return Localized([found], {"explained_by": ["quantization"] * differs("quantization", served, block)
                                       + [name]})
        if ties is not None:
            taken, still = ties
            found = [Finding.localization(
                "tie", "argmax_tie", f"the drafter's top two logits at the slot where the engine and the audit "
                f"part are within {TIE_MARGIN:g} of each other (an argmax near-tie that float32 kernels summing in "
                f"another order break the other way); the audit's replay taking the runner-up there gives the "
                f"engine's rounds", taken[0]["margin"], source("argmax_tie"), prompt.id, first)]
            if still is not None:  # a later round no tie explains is still a difference
                found.append(Finding.localization(
                    "unlocalized", "rounds", "after the argmax near-ties, no counterfactual replay reproduces the "
                    "engine's rounds", None, source("rounds"), prompt.id, still,
                    at="still parting after the near-ties at"))
            return Localized(found, {"ties": taken, "explained_by": ["argmax_tie"]})
        return Localized([Finding.localization(
            "unlocalized", "rounds", "no counterfactual replay (" + ", ".join(words for _, _, words in VARIANTS)
            + ") reproduces the engine's rounds", None, source("rounds"), prompt.id, first)], {})


def llamacpp_source(version: str, results: list[dict], prompts: list[dict], localizer: CounterfactualLocalizer,
                    block: int) -> RoundSource:
    """llama-server's replies (`LlamaServer.complete`: tokens, accepted per verification step, timings) on
    `prompts` as a source of rounds; `block`: the block it drafts (1 + its --spec-draft-n-max, clamped)."""
    rounds = [PromptRounds.from_accepted(prompt["id"], prompt["ids"], result["accepted"], result["tokens"],
                                         facts={"draft_n": result["timings"].get("draft_n"),
                                                "draft_n_accepted": result["timings"].get("draft_n_accepted")})
              for prompt, result in zip(prompts, results, strict=True)]
    return RoundSource(f"llama.cpp {version}", block - 1, rounds, localizer)
