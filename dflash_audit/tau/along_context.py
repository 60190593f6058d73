"""τ along the context: where in a long prompt (or a long generation) acceptance falls, for every τ report.

The one place a source of rounds (our evaluator, the replay of z-lab's loop, a served engine, a team's evaluator
traced) turns its per-prompt rounds into τ by position and τ by prompt length. The API, stable for every caller:

    from dflash_audit.tau.along_context import PromptRounds, tau_along_context, context_marks, greedy_agreement

    along = tau_along_context(
        [PromptRounds(id="p0", prompt_len=1031, rounds=[3, 1, 4, ...], target_agreement=[True, False, ...])],
        marks=context_marks(spec, recipe, recipe_unknown),   # or None where the drafter is not known
        bin_tokens=256)                                        # speculators' default; settable
    along.to_dict()       # JSON (its `schema` is SCHEMA)
    along.table()         # terminal text: one row per bin, the drafter's window, trained length and rotary marked

Conventions (those of speculators' `scripts/evaluate/acceptance_report.py`, `bin_by_position`):
- a round is the tokens it added to the context: the accepted drafts plus the target's own (bonus) token, the
  acceptance length every τ of this tool counts (`DecodeResult.acceptance_lengths`);
- a round's position is its anchor's: the prompt length plus the tokens every earlier round of that prompt added
  (the target's first token, from the prompt's prefill, sits at position prompt_len and anchors round 0);
- a bin's τ is its rounds pooled (1 + accepted / rounds); the prompt-length bins also give the mean of per-prompt
  τ (z-lab's way) beside it;
- bins are `bin_tokens` wide from 0 ([0, 256), [256, 512), ...), only the bins that hold a round (or an agreement
  position) are listed.

The target's own greedy agreement, where a caller gives it (`greedy_agreement` computes it), is the share of a
bin's positions whose token the target's argmax predicted from the text before it (teacher-forced on the prompt's
own text). Beside τ it tells a drafter's collapse (τ falls, the target still agrees) from the target's own
extrapolation (both fall).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from tabulate import tabulate

from impl.acceptance import POSITION_BIN_TOKENS

SCHEMA = "dflash-audit/tau-along-context/1"
DEFAULT_BIN_TOKENS = POSITION_BIN_TOKENS  # speculators' DEFAULT_POSITION_BIN_SIZE
# The recipe fields that record the row length a drafter was trained on (ours: `extra.seq_len`, `train`'s schedule).
TRAINED_LENGTH_NAMES = ("seq_len", "max_seq_len", "max_seq_length", "total_seq_len", "max_length")
UNKNOWN = "unknown"
COUNTING = ("a round counts the tokens it adds (accepted drafts + the target's bonus token), at its anchor's position "
            "(prompt length + the tokens of the earlier rounds); a bin's τ pools its rounds (speculators' "
            "acceptance_report.py bin_by_position)")


class PromptRounds(BaseModel):
    """One prompt's rounds, as a source of rounds gives them."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, description="The prompt's id, for messages only.")
    prompt_len: int = Field(..., ge=0, description="Tokens of the prompt (the context before the first round).")
    rounds: list[int] = Field(..., description="Tokens each round added to the context, the bonus token included.")
    target_agreement: list[bool] | None = Field(
        None, description="Element i: the target's argmax after the prompt's tokens 0..i is its token i + 1 "
                          "(position i + 1); None where not measured.")


class ContextMarks(BaseModel):
    """What a reader of τ along the context needs beside it: the drafter's window, the length it was trained on
    and its rotary settings. `trained_length` None is unknown (never a guessed default)."""

    model_config = ConfigDict(extra="forbid")

    sliding_window: int | None = Field(None, gt=0, description="The window of the sliding layers (None: no sliding "
                                                                "layer).")
    layer_types: list[str] = Field(default_factory=list, description="Each draft layer's attention type.")
    trained_length: int | None = Field(None, gt=0, description="Row length the drafter was trained on; None: "
                                                                "unknown.")
    trained_length_source: str = Field("not recorded", description="Where trained_length was read.")
    rope_theta: float | None = Field(None, description="The drafter's rotary base.")
    rope_scaling: dict[str, Any] | None = Field(None, description="Its rope scaling (None: unscaled).")
    partial_rotary_factor: float | None = Field(None, description="Its partial rotary factor.")
    max_position_embeddings: int | None = Field(None, description="The longest context its rotary tables cover.")

    def lines(self) -> list[tuple[int, str]]:
        """(position, label) of each mark that sits at a position: where the window starts dropping context, the
        trained length, the rotary tables' end."""
        out = []
        if self.sliding_window is not None:
            out.append((self.sliding_window, f"sliding window {self.sliding_window}"))
        if self.trained_length is not None:
            out.append((self.trained_length, f"trained length {self.trained_length}"))
        if self.max_position_embeddings is not None:
            out.append((self.max_position_embeddings, f"max positions {self.max_position_embeddings}"))
        return out

    def describe(self) -> str:
        window = (f"sliding window {self.sliding_window} ({', '.join(self.layer_types)})"
                  if self.sliding_window is not None else "no sliding layer")
        trained = (f"trained length {self.trained_length} ({self.trained_length_source})"
                   if self.trained_length is not None else f"trained length {UNKNOWN} ({self.trained_length_source})")
        scaling = "unscaled" if not self.rope_scaling else f"{self.rope_scaling.get('rope_type')} {self.rope_scaling}"
        rotary = (f"rope_theta {self.rope_theta:g}, {scaling}, partial factor {self.partial_rotary_factor}, "
                  f"max positions {self.max_position_embeddings}") if self.rope_theta is not None else "rotary unknown"
        return f"{window}; {trained}; {rotary}"


class PositionBin(BaseModel):
    start: int
    end: int
    rounds: int = Field(..., description="Rounds anchored in the bin.")
    prompts: int = Field(..., description="Prompts with a round in the bin.")
    tokens: int = Field(..., description="Tokens those rounds added.")
    tau: float | None = Field(..., description="Pooled τ of the bin's rounds (None: no round).")
    agreement: float | None = Field(..., description="Target's greedy agreement over the bin's positions.")
    agreement_positions: int = Field(0, description="Positions the agreement is over.")
    past: list[str] = Field(default_factory=list, description="Marks the bin starts at or past.")


class LengthBin(BaseModel):
    start: int
    end: int
    prompts: int
    rounds: int
    tau: float | None = Field(..., description="Pooled τ of the rounds of the bin's prompts.")
    tau_prompt_mean: float | None = Field(..., description="Mean of the bin's per-prompt τ.")
    past: list[str] = Field(default_factory=list)


class AlongContext(BaseModel):
    """τ by position and by prompt length, with the drafter's marks."""

    schema_: str = Field(SCHEMA, alias="schema")
    bin_tokens: int
    length_bin_tokens: int
    counting: str = COUNTING
    by_position: list[PositionBin]
    by_prompt_length: list[LengthBin]
    marks: ContextMarks | None = None
    model_config = ConfigDict(populate_by_name=True)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True)

    def marks_text(self) -> str:
        return self.marks.describe() if self.marks is not None else "drafter marks unknown"

    def table(self) -> str:
        """Terminal text: τ (and the target's agreement) per position bin, then per prompt-length bin."""
        def pct(value):
            return "" if value is None else f"{value:.0%}"

        rows = [[f"{b.start}-{b.end}", b.rounds, b.prompts, "" if b.tau is None else f"{b.tau:.2f}",
                 pct(b.agreement), ", ".join(b.past)] for b in self.by_position]
        text = (f"τ along the context ({self.bin_tokens}-token bins; {self.marks_text()})\n"
                + tabulate(rows, headers=["position", "rounds", "prompts", "τ", "target agrees", "past"],
                           tablefmt="github"))
        if self.by_prompt_length:
            rows = [[f"{b.start}-{b.end}", b.prompts, b.rounds, "" if b.tau is None else f"{b.tau:.2f}",
                     "" if b.tau_prompt_mean is None else f"{b.tau_prompt_mean:.2f}", ", ".join(b.past)]
                    for b in self.by_prompt_length]
            text += ("\n" + tabulate(rows, headers=["prompt length", "prompts", "rounds", "τ pooled",
                                                    "τ mean of prompts", "past"], tablefmt="github"))
        return text


def _bin(position: int, width: int) -> int:
    return position // width * width


def _past(start: int, marks: ContextMarks | None) -> list[str]:
    return [label for at, label in (marks.lines() if marks else []) if start >= at]


def tau_along_context(prompts: Iterable[PromptRounds], marks: ContextMarks | None = None,
                      bin_tokens: int = DEFAULT_BIN_TOKENS, length_bin_tokens: int | None = None) -> AlongContext:
    """τ by position bin and by prompt-length bin of `prompts` (see the module's conventions); `bin_tokens` wide
    position bins, `length_bin_tokens` (default: the same) wide prompt-length bins. A round of no token or a
    negative length is an error (no correct decoder makes one), never dropped."""
    if bin_tokens <= 0 or (length_bin_tokens is not None and length_bin_tokens <= 0):
        raise ValueError(f"bins must be at least one token wide, got {bin_tokens}, {length_bin_tokens}")
    length_width = length_bin_tokens or bin_tokens
    positions: dict[int, dict[str, Any]] = {}
    lengths: dict[int, dict[str, Any]] = {}

    def position_bin(start: int) -> dict[str, Any]:
        return positions.setdefault(start, {"rounds": 0, "tokens": 0, "prompts": set(), "agreed": 0, "seen": 0})

    for index, prompt in enumerate(prompts):
        if any(length < 1 for length in prompt.rounds):
            raise ValueError(f"prompt {prompt.id or index}: a round that adds no token ({prompt.rounds})")
        position = prompt.prompt_len
        for length in prompt.rounds:
            b = position_bin(_bin(position, bin_tokens))
            b["rounds"] += 1
            b["tokens"] += length
            b["prompts"].add(index)
            position += length
        for offset, agreed in enumerate(prompt.target_agreement or []):
            b = position_bin(_bin(offset + 1, bin_tokens))
            b["seen"] += 1
            b["agreed"] += bool(agreed)
        group = lengths.setdefault(_bin(prompt.prompt_len, length_width), {"prompts": 0, "rounds": 0, "tokens": 0,
                                                                          "taus": []})
        group["prompts"] += 1
        group["rounds"] += len(prompt.rounds)
        group["tokens"] += sum(prompt.rounds)
        if prompt.rounds:
            group["taus"].append(sum(prompt.rounds) / len(prompt.rounds))
    by_position = [PositionBin(start=start, end=start + bin_tokens, rounds=b["rounds"], prompts=len(b["prompts"]),
                               tokens=b["tokens"], tau=b["tokens"] / b["rounds"] if b["rounds"] else None,
                               agreement=b["agreed"] / b["seen"] if b["seen"] else None,
                               agreement_positions=b["seen"], past=_past(start, marks))
                   for start, b in sorted(positions.items())]
    by_length = [LengthBin(start=start, end=start + length_width, prompts=g["prompts"], rounds=g["rounds"],
                           tau=g["tokens"] / g["rounds"] if g["rounds"] else None,
                           tau_prompt_mean=sum(g["taus"]) / len(g["taus"]) if g["taus"] else None,
                           past=_past(start, marks))
                 for start, g in sorted(lengths.items())]
    return AlongContext(bin_tokens=bin_tokens, length_bin_tokens=length_width, by_position=by_position,
                        by_prompt_length=by_length, marks=marks)


def trained_length(recipe, recipe_unknown: Sequence[str] = ()) -> tuple[int | None, str]:
    """(row length, where it was read) from a drafter's recipe (`impl.recipe.Recipe`: ours records it in
    `extra.seq_len`), or (None, why unknown)."""
    if recipe is None:
        return None, "the checkpoint carries no recipe"
    extra = getattr(recipe, "extra", None) or {}
    for name in TRAINED_LENGTH_NAMES:
        value = extra.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and name not in recipe_unknown:
            return value, f"recipe {name}"
    return None, "not recorded in the recipe"


def context_marks(spec, recipe=None, recipe_unknown: Sequence[str] = ()) -> ContextMarks:
    """The marks of a drafter from its spec (`impl.spec.DraftSpec`) and recipe."""
    length, source = trained_length(recipe, recipe_unknown)
    sliding = "sliding_attention" in spec.layer_types
    return ContextMarks(sliding_window=spec.sliding_window if sliding else None, layer_types=list(spec.layer_types),
                        trained_length=length, trained_length_source=source, rope_theta=spec.rope_theta,
                        rope_scaling=spec.rope_scaling, partial_rotary_factor=spec.partial_rotary_factor,
                        max_position_embeddings=spec.max_position_embeddings)


def greedy_agreement(target, input_ids) -> list[bool]:
    """The target's own greedy agreement along a prompt's text (`input_ids` [1, T]): element i is whether its
    argmax after tokens 0..i is token i + 1. One forward of the prompt, logits kept one position at a time in
    chunks so that memory stays linear in T."""
    import torch

    from foundation.placement import target_device
    from impl.extract import output_head

    with torch.inference_mode():
        ids = input_ids.to(target_device(target))
        hidden = target.model(input_ids=ids).last_hidden_state[0, :-1]  # after the final norm
        head = output_head(target)
        device = head.weight.device  # a sharded target's head may sit on another device
        predicted = torch.cat([head(chunk.to(device)).argmax(-1).to(ids.device) for chunk in hidden.split(512)])
        return (predicted == ids[0, 1:]).tolist()


def side_by_side(series: dict[str, AlongContext]) -> str:
    """Several sources' τ by position in one table (compare's ours and ref; a live check's audited and served):
    one column of τ per source, the target's agreement from the first source that measured it, and the marks
    each bin is past (the first source's)."""
    if not series:
        return ""
    first = next(iter(series.values()))
    starts = sorted({b.start for along in series.values() for b in along.by_position})
    found = {name: {b.start: b for b in along.by_position} for name, along in series.items()}
    rows = []
    for start in starts:
        row = [f"{start}-{start + first.bin_tokens}"]
        row += [f"{b.tau:.2f} ({b.rounds})" if (b := found[name].get(start)) and b.tau is not None else ""
                for name in series]
        agreement = next((b.agreement for name in series if (b := found[name].get(start)) and b.agreement is not None),
                         None)
        past = next((b.past for name in series if (b := found[name].get(start))), [])
        rows.append(row + ["" if agreement is None else f"{agreement:.0%}", ", ".join(past)])
    marks = "; ".join(f"{name}: {along.marks_text()}" for name, along in series.items())
    return (f"τ along the context ({first.bin_tokens}-token bins by round position, τ (rounds); {marks})\n"
            + tabulate(rows, headers=["position", *(f"τ {name}" for name in series), "target agrees", "past"],
                       tablefmt="github"))
