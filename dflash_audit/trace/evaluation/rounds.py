"""The rounds of a recorded evaluation, rebuilt per prompt (per batch row) from its calls, by value.

A target call after no drafter call opens a prompt (its prefill; the greedy first token is its last logit's argmax,
else the first verified block's anchor); a target call after a drafter call verifies that call's block: its last
`n + 1` tokens are the block, anchor first, at positions `start..start + n` (a cached loop feeds only the block, an
uncached one the whole sequence before it). What the evaluator kept of a round is read from the next verification:
its anchor's position gives the round's length (the bonus token included), its tokens the ones kept. The last round
of a prompt has no next call: it is what the target's verification accepts (greedy), cut at the first of the
target's stop ids and at the end a shortened block shows (z-lab's `min(B, max_length - start)`).

The drafter's inputs at each round are named by value: the block's tokens are the rows of the target's embedding
matrix the block input equals; the context features are the other input as wide as the target's layers; the
positions its integer input. Which module is the drafter is decided the same way: the one fed the target's features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_audit.target_values import SAME, relative  # noqa: F401 (the one core's: eval_* read them here)


@dataclass
class DraftCall:
    """The drafter's inputs and output at one round (one batch row)."""
    event: int
    features: torch.Tensor | None  # [c, F]
    block: list[int] | None  # the block's tokens, read by value from its embedding rows
    block_scale: float | None
    positions: list[int] | None
    output: torch.Tensor | None  # [rows, H]
    drafts: list[int] = field(default_factory=list)  # the head's argmax on the drafter's output
    margins: list[float] = field(default_factory=list)


@dataclass
class Round:
    start: int  # the anchor's position
    block: list[int]  # the verified block: anchor, then the drafts
    target_argmax: list[int]  # the target's greedy choice after each block token
    target_margin: list[float]
    draft: DraftCall | None
    produced: int | None = None  # tokens the round added (accepted drafts + the bonus)
    kept: list[int] = field(default_factory=list)
    read_from: str = "next"  # "next": the next verification shows it; "rule": the last round, by the target's choice
    context: list[int] = field(default_factory=list)  # the whole verify call's tokens before the block, if fed

    @property
    def accepted_by_rule(self) -> int:
        """Greedy acceptance: the drafts equal to the target's choice, in order."""
        n = 0
        for draft, choice in zip(self.block[1:], self.target_argmax):
            if draft != choice:
                break
            n += 1
        return n


@dataclass
class PromptRun:
    index: int
    prompt: list[int]
    first: int | None
    rounds: list[Round] = field(default_factory=list)
    row: int = 0
    batch: int = 1
    padded: bool = False
    offset: int = 0  # the position the target ran the prompt's first token at (left padding without position ids)
    pending: Round | None = None  # the last round, until the next verification shows what it kept

    @property
    def lengths(self) -> list[int]:
        return [r.produced for r in self.rounds if r.produced is not None]

    def sequence(self, rounds: int | None = None) -> list[int]:
        """The prompt and what the evaluator generated, through `rounds` rounds (all: None)."""
        tokens = list(self.prompt) + ([self.first] if self.first is not None else [])
        for r in self.rounds[: len(self.rounds) if rounds is None else rounds]:
            tokens += r.kept
        return tokens


@dataclass
class Rebuilt:
    prompts: list[PromptRun]
    drafter_module: int | None
    notes: list[str] = field(default_factory=list)


class EmbeddingLookup:
    """Token ids of embedding rows by value (the target's input embedding matrix, any constant scale)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach().float().cpu()
        self.unit = torch.nn.functional.normalize(self.weight, dim=-1)

    def ids(self, rows: torch.Tensor) -> tuple[list[int] | None, float | None]:
        rows = rows.float().cpu()
        index = (torch.nn.functional.normalize(rows, dim=-1) @ self.unit.T).argmax(-1)
        chosen = self.weight[index]
        scale = float((rows * chosen).sum() / (chosen * chosen).sum().clamp_min(1e-12))
        if relative(rows, scale * chosen) > SAME:
            return None, None
        return index.tolist(), scale


def _int(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and t.dtype != torch.bool


def rebuild(recording, target, stop_ids: list[int], feature_check) -> Rebuilt:
    """Every prompt's rounds. `feature_check(tensor [c, F], prompt tokens) -> bool`: whether a drafter candidate's
    input holds the target's features (decides which module is the drafter)."""
    events = recording.events
    tensor = recording.tensor
    lookup = EmbeddingLookup(target.get_input_embeddings().weight)
    notes: list[str] = []
    drafter_module = _drafter_module(recording, feature_check)
    if drafter_module is None:
        return Rebuilt([], None, ["no module fed the target's features ran: no evaluation to rebuild"])
    streams: list[PromptRun] = []  # every prompt seen, in the order its prefill ran
    drafted: list[DraftCall] = []  # the drafter's rows since the last target call, in order (batched or one by one)
    hidden_call: dict | None = None  # the last target call: the features' rows are its positions (uncached loops)
    for index, event in enumerate(events):
        kind = event["kind"]
        if kind == "drafter" and event["module"] != drafter_module:
            continue
        if kind == "drafter":
            rows = _draft_rows(recording, event, index, lookup, hidden_call)
            drafted.extend(rows[r] for r in sorted(rows))
            last_drafter = [rows[r] for r in sorted(rows)]
            continue
        if kind == "head":
            if drafted:
                argmax, margin = tensor(event["argmax"]), tensor(event["margin"])
                for row, draft in enumerate(last_drafter):
                    if row < argmax.shape[0]:
                        draft.drafts = argmax[row].reshape(-1).tolist()
                        draft.margins = margin[row].reshape(-1).tolist()
            continue
        ids, positions = tensor(event["ids"]), tensor(event["positions"])
        mask = tensor(event["attention_mask"]) if "attention_mask" in event else None
        argmax, margin = tensor(event["argmax"]), tensor(event["margin"])
        verifying = len(drafted) == ids.shape[0]
        if drafted and not verifying:
            notes.append(f"call {index}: the target verifies {ids.shape[0]} rows after {len(drafted)} drafted "
                         "ones; its rows are not read as rounds")
        for row in range(ids.shape[0]):
            valid = mask[row].bool() if mask is not None and mask.shape == ids.shape else \
                torch.ones(ids.shape[1], dtype=torch.bool)
            row_ids = ids[row][valid].tolist()
            row_positions = positions[min(row, positions.shape[0] - 1)][valid].tolist()
            offset = int(event["logits_from"])
            keep = valid[offset:]
            row_argmax = argmax[row][keep].tolist() if argmax.dim() == 2 else []
            row_margin = margin[row][keep].tolist() if margin.dim() == 2 else []
            run = _stream_of(streams, row_ids, row_positions, row if verifying else None)
            if not verifying or run is None:
                if drafted and not verifying:
                    continue
                if run is not None and _feature_forward(run, row_ids):
                    if not run.rounds and len(row_ids) > len(run.prompt):
                        run.first = row_ids[len(run.prompt)]  # the first token as kept (sampled at T > 0)
                    continue  # an uncached loop's forward for the features of what the prompt holds
                logits_cover = len(row_argmax) == len(row_ids)
                first = row_argmax[-1] if row_argmax and logits_cover else None
                streams.append(PromptRun(len(streams), row_ids, first, row=row, batch=ids.shape[0],
                                         padded=mask is not None and not bool(mask.bool().all()),
                                         offset=row_positions[0] if row_positions else 0))
                continue
            draft = drafted[row]
            expected = (run.pending.start + run.pending.accepted_by_rule + 1 if run.pending is not None
                        else len(run.sequence()) - 1)
            n = len(draft.block) - 1 if draft.block else _verified_drafts(row_ids, row_positions, run.offset,
                                                                         draft.drafts, expected)
            if n is None:
                notes.append(f"call {index}: a verification whose drafted block is not known; left out")
                continue
            block = row_ids[-(n + 1):]
            # The anchor's position: after the tokens fed before the block (an uncached loop feeds them all), else
            # where the target ran it (a cached loop), less the row's padding.
            context = row_ids[:-(n + 1)]
            start = len(context) if context else row_positions[-(n + 1)] - run.offset
            round_ = Round(start, block, row_argmax[-(n + 1):], row_margin[-(n + 1):], draft, context=context)
            if run.pending is not None:
                _settle(run.pending, round_)
            elif not run.rounds and run.first is not None:
                round_.start = len(run.sequence()) - 1
            if not run.rounds:  # the first token as kept: fed before the block (uncached), else the block's anchor
                kept_first = context[len(run.prompt)] if len(context) > len(run.prompt) else block[0]
                if run.first != kept_first:
                    run.first = kept_first  # sampled from the prefill's logits, not its argmax
                    round_.start = len(run.sequence()) - 1
            run.pending = round_
            run.rounds.append(round_)
        drafted = []
        hidden_call = event if event.get("hidden_states") else hidden_call
    for run in streams:
        _close(run, run.pending, stop_ids)
    _cut_at_budget(streams)
    return Rebuilt([r for r in streams if r.rounds], drafter_module, notes)


def _cut_at_budget(streams: list[PromptRun]) -> None:
    """A last round that drafted a whole block cannot show that the loop's end cut it (z-lab's `min(accepted + 1,
    max_length - start - 1)`); a prompt whose last block was shortened shows where the end is (max_length - the
    prompt: the new-token budget every prompt shares), and cuts the others' last rounds there."""
    full = max((len(r.block) for run in streams for r in run.rounds), default=0)
    budgets = {run.rounds[-1].start + len(run.rounds[-1].block) - len(run.prompt) for run in streams
               if run.rounds and len(run.rounds[-1].block) < full}
    if len(budgets) != 1:
        return
    budget = budgets.pop()
    for run in streams:
        last = run.rounds[-1] if run.rounds else None
        if last is None or last.read_from != "rule":
            continue
        room = len(run.prompt) + budget - last.start - 1
        if 0 < room < last.produced:
            last.produced, last.kept = room, last.kept[:room]


def _verified_drafts(row_ids: list[int], row_positions: list[int], offset: int, drafts: list[int],
                     expected_start: int) -> int | None:
    """How many of the drafts the verification ran (a shortened block runs a prefix of them): a prefix the call ends
    with; where several do (repetitive text), the one whose anchor sits where the greedy rule puts it, else the
    longest. None: drafts not known."""
    if not drafts:
        return None
    fits = [k for k in range(min(len(drafts), len(row_ids) - 1), 0, -1) if row_ids[-k:] == drafts[:k]]
    for k in fits:
        anchor = len(row_ids) - k - 1 if row_positions[0] - offset == 0 else row_positions[-k - 1] - offset
        if anchor == expected_start:
            return k
    return fits[0] if fits else len(drafts)


def _stream_of(streams: list[PromptRun], row_ids: list[int], row_positions: list[int],
               row: int | None) -> PromptRun | None:
    """The prompt a target row continues: the one whose sequence it starts with (an uncached loop feeds it whole),
    else (a cached loop feeds only the block) the prompt of that batch row whose anchor it is."""
    best, best_length = None, -1
    for run in streams:
        known = run.sequence() if run.rounds else run.prompt  # a first token not yet seen kept may be sampled
        if row_positions and row_positions[0] - run.offset == 0 and row_ids[: len(known)] == known and \
                len(known) > best_length:
            best, best_length = run, len(known)
    if best is not None or row is None:
        return best
    for run in reversed(streams):
        if run.row == row and row_positions and row_positions[0] - run.offset > 0:
            return run
    return None


def _feature_forward(run: PromptRun, row_ids: list[int]) -> bool:
    """A target call on what the prompt already holds, the last round's tokens included (an uncached loop's forward
    for the features): no new prompt."""
    reach = len(run.sequence()) + (len(run.pending.block) if run.pending is not None else 0 if run.rounds else 1)
    return len(row_ids) <= reach


def _settle(previous: Round, current: Round) -> None:
    """The previous round's length and tokens, from the verification after it: its anchor sits right after what
    the previous round kept (the tokens fed before it, when an uncached loop feeds them; else its accepted drafts as
    verified, and the new anchor, the bonus)."""
    produced = current.start - previous.start
    if current.context:
        kept = current.context[previous.start + 1: current.start] + [current.block[0]]
    else:
        kept = previous.block[1: produced] + [current.block[0]]
    previous.produced, previous.kept = produced, kept


def _close(run: PromptRun, last: Round | None, stop_ids: list[int]) -> None:
    """The prompt's last round: what the target's greedy verification accepts, cut at a stop id and at a shortened
    block's end (z-lab's max_length)."""
    if last is None or last.produced is not None:
        return
    accepted = last.accepted_by_rule
    tokens = last.block[1: accepted + 1] + ([last.target_argmax[accepted]] if accepted < len(last.target_argmax)
                                            else [])
    for i, token in enumerate(tokens):
        if token in stop_ids:
            tokens = tokens[: i + 1]
            break
    if len(last.block) < max(len(r.block) for r in run.rounds):  # shortened: the loop's end is its last position
        tokens = tokens[: len(last.block) - 1]
    last.produced, last.kept, last.read_from = len(tokens), tokens, "rule"


def _draft_rows(recording, event: dict, index: int, lookup: EmbeddingLookup, hidden_call: dict | None) -> dict:
    """The drafter call's inputs per batch row."""
    tensor = recording.tensor
    inputs = {name: tensor(key) for name, key in event["inputs"].items()}
    # A module fed one row set without a batch dimension ([rows, F]: a team's own fc call) is a batch of one.
    floats = {n: (t[None] if t.dim() == 2 else t) for n, t in inputs.items() if t.is_floating_point()}
    ints = {n: t for n, t in inputs.items() if _int(t)}
    width = lookup.weight.shape[1]
    block_name, rows = None, {}
    for name, t in floats.items():
        if t.shape[-1] == width and t.dim() == 3:
            ids, scale = lookup.ids(t[0])
            if ids is not None:
                block_name = name
                break
    feature_name = next((n for n, t in floats.items() if n != block_name and t.shape[-1] % width == 0
                         and t.dim() == 3), None)
    position_name = "position_ids" if "position_ids" in ints else next(iter(ints), None)
    batch = next(iter(floats.values())).shape[0]
    mask = None
    if hidden_call is not None and "attention_mask" in hidden_call and feature_name is not None:
        mask = tensor(hidden_call["attention_mask"])
        if mask.shape[1] != floats[feature_name].shape[1]:
            mask = None
    for row in range(batch):
        features = floats[feature_name][min(row, floats[feature_name].shape[0] - 1)] if feature_name else None
        if features is not None and mask is not None:
            features = features[mask[row].bool()]
        elif features is not None:  # left padding by zero rows (a batch padded by hand)
            real = features.abs().amax(-1) > 0
            first = int(real.float().argmax()) if bool(real.any()) else features.shape[0]
            features = features[first:]
        block, scale = lookup.ids(floats[block_name][row]) if block_name else (None, None)
        positions = None
        if position_name is not None:
            p = ints[position_name]
            positions = p[min(row, p.shape[0] - 1)].reshape(-1).tolist()
        out = tensor(event["output"]) if "output" in event else None
        out = (out[None] if out is not None and out.dim() == 2 else out)
        out = out[row] if out is not None and block_name else None  # the drafter's output on a block it was fed
        call = DraftCall(index, features, block, scale, positions, out)
        if "argmax" in event:
            call.drafts = tensor(event["argmax"])[row].reshape(-1).tolist()
            call.margins = tensor(event["margin"])[row].reshape(-1).tolist()
        rows[row] = call
    return rows


def _drafter_module(recording, feature_check) -> int | None:
    """The module fed the target's features: among the recorded candidates, the first whose wide input is the
    target's hidden states by value (on the prompt the target ran just before)."""
    events = recording.events
    tried: set[int] = set()
    last_ids = None
    for event in events:
        if event["kind"] == "target":
            ids = recording.tensor(event["ids"])[0]
            if "attention_mask" in event:
                ids = ids[recording.tensor(event["attention_mask"])[0].bool()]
            last_ids = ids.tolist()
            continue
        if event["kind"] != "drafter" or event["module"] in tried or last_ids is None:
            continue
        tried.add(event["module"])
        for key in event["inputs"].values():
            t = recording.tensor(key)
            if not t.is_floating_point() or t.dim() not in (2, 3):
                continue
            rows = t[0] if t.dim() == 3 else t
            rows = rows[rows.abs().amax(-1) > 0]  # left padding by zero rows
            if rows.shape[0] and feature_check(rows, last_ids):
                return event["module"]
    return None
