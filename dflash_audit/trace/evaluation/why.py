"""Why an evaluator's round is not z-lab's: each of its rounds held to z-lab's loop, input by input, by value.

On the evaluator's own sequence (what it generated, so the check holds at any temperature), each round's drafter
call is held to what `dflash_generate` feeds at that anchor:
- the context features: row by row and layer by layer, `hidden_states[id + 1]` of the target at the positions the
  rows stand for; a row that is another tensor is named by the one it equals (another layer, a layer after the final
  norm, the last layer before it, shifted positions);
- the block: the anchor (the last known token) and the mask id in every other slot, `B` long;
- the positions: the fed rows' positions, then `start..start + B - 1`;
- the acceptance rule: the drafts the target's choice accepts, in order, and its bonus token.
At the first round that parts from z-lab's (greedy), with all inputs z-lab's, the drafter's output is held to z-lab's
drafter run on the same inputs; one that equals it with the sliding window taken off is named (the window ignored).
Together they are the evaluator's localizer (`EvaluatorLocalizer`), under the rounds core's contract: the evaluator
is a source of rounds (dflash_audit/rounds/) as an engine is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from catalogue.findings import Finding
from dflash_audit.audit.context_faults import PITFALLS as CONTEXT_PITFALLS
from dflash_audit.audit.context_faults import ContextFault, context_faults, rebased, rebased_length
from dflash_audit.rounds.source import Localized
from dflash_audit.target_values import relative_rows
from dflash_audit.trace.evaluation.replay import TargetStates, drafter_logits, drafter_shape, faulted_output
from dflash_audit.trace.evaluation.rounds import SAME, PromptRun, Round
from impl.anchors import anchor_blocks
from impl.layers import hidden_state_index, names_final_layer
from impl.near_tie import near_tie


# What each cause is, for the finding's pitfall link (docs/pitfalls.md).
PITFALLS = {"context_features": 1, "block": 14, "positions": 12, "acceptance": 17, "drafter": 13, "drafts": 13,
            "stop_ids": 17, "tie": None, "unlocalized": None, **CONTEXT_PITFALLS}


@dataclass
class Cause:
    key: str
    message: str
    prompt: int
    round: int  # 1-based
    size: float | None = None
    severity: str = "divergence"
    prompts: list[int] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)  # a long-context fault's own figures (its cap, offset, theta)

    @classmethod
    def of_fault(cls, fault: ContextFault, prompt: int, number: int, size: float | None = None,
                 how: str = "") -> Cause:
        return cls(fault.key, f"the evaluator {fault.says}{how}", prompt, number, size, numbers=dict(fault.numbers))


class Reference:
    """What z-lab's loop is for this drafter: its layer ids, block size, mask id, its twin and the target."""

    def __init__(self, twin, target, stop_ids: list[int], declared_lengths: tuple[tuple[int, str], ...] = (),
                 tolerance: float = SAME):
        self.twin, self.target, self.stop_ids = twin, target, stop_ids
        self.tolerance = tolerance  # relative noise of the evaluation's dtype (the matcher's `tolerance`)
        self.layer_ids = [int(i) for i in twin.target_layer_ids]
        self.block_size = int(twin.block_size)
        self.mask_id = int(twin.mask_token_id)
        self.hidden = int(twin.config.hidden_size)
        self.windows = [layer.self_attn.sliding_window for layer in twin.layers]
        self.shape = drafter_shape(twin, declared_lengths)  # what the long-context faults change


def feature_cause(ref: Reference, states: TargetStates, rnd: Round, run: PromptRun, number: int) -> Cause | None:
    features = rnd.draft.features if rnd.draft is not None else None
    if features is None:
        return None
    rows = features.shape[0]
    positions = list(range(rnd.start - rows, rnd.start))
    if rows > rnd.start or not positions:
        return Cause("context_features", f"the drafter is fed {rows} context rows at an anchor at position "
                     f"{rnd.start}: more than the {rnd.start} positions before it", run.index, number)
    width = ref.hidden
    if features.shape[1] != width * len(ref.layer_ids):
        fed = features.shape[1] // width if features.shape[1] % width == 0 else None
        names = [states.name_rows(features[:, j * width:(j + 1) * width], positions)[0] or "a tensor of no target "
                 "layer" for j in range(fed or 0)]
        return Cause("context_features", f"the drafter is fed {fed if fed else features.shape[1]} "
                     f"{'layers' if fed else 'features'} ({'; '.join(names)}); z-lab's feeds the {len(ref.layer_ids)} "
                     f"layers {ref.layer_ids} (hidden_states[id + 1])", run.index, number)
    parts = []
    size = 0.0
    for j, layer in enumerate(ref.layer_ids):
        fed = features[:, j * width:(j + 1) * width].float()
        expected = states.feature(layer)[positions]
        gap = relative_rows(fed, expected)
        if gap <= SAME:
            continue
        size = max(size, gap)
        name, shift = states.name_rows(fed, positions)
        what = (f"{name}{f' at positions shifted by {shift:+d}' if shift else ''}" if name else
                f"no tensor of the target's forward (relative difference {gap:.3g} from z-lab's)")
        last = names_final_layer(layer, states.layers)
        parts.append(f"feature {j} (target layer {layer}) is {what}; z-lab feeds hidden_states[{hidden_state_index(layer)}] (the "
                     f"output of layer {layer}{', after the final norm' if last else ', before the final norm'})")
    if not parts:
        return None
    return Cause("context_features", "; ".join(parts), run.index, number, size)


def block_cause(ref: Reference, rnd: Round, run: PromptRun, number: int, max_length: int | None,
                near_end: bool) -> Cause | None:
    """`max_length`: the loop's end (greedy: known from the rounds), else None; `near_end`: this block and every
    later one are short of B, as z-lab's `min(B, max_length - start)` makes them at the end."""
    block = rnd.draft.block if rnd.draft is not None else None
    if block is None:
        return None
    sequence = run.sequence()
    anchor = sequence[rnd.start] if rnd.start < len(sequence) else None
    problems = []
    if block[0] != anchor:
        problems.append(f"the block starts with token {block[0]}, not the anchor (the last known token {anchor})")
    wrong = sorted({t for t in block[1:] if t != ref.mask_id})
    if wrong:
        problems.append(f"its masked slots hold token {wrong[0]}, not z-lab's mask id {ref.mask_id}")
    shortened = min(ref.block_size, max_length - rnd.start) if max_length is not None else None
    if len(block) != ref.block_size and not (near_end and (shortened is None or len(block) == shortened)):
        problems.append(f"it is {len(block)} tokens long; z-lab drafts blocks of {ref.block_size}")
    if not problems:
        return None
    return Cause("block", "; ".join(problems), run.index, number)


def _fed_positions(rnd: Round, run: PromptRun) -> tuple[list[int], list[int]] | None:
    """(given, expected) position ids of a round's drafter call: the fed rows' positions then the block's (or the
    block's alone, when only those were fed), against z-lab's; None: not recorded."""
    draft = rnd.draft
    if draft is None or draft.positions is None or draft.block is None:
        return None
    rows = draft.features.shape[0] if draft.features is not None else 0
    given = [p - run.offset for p in draft.positions]
    expected = list(range(rnd.start - rows, rnd.start + len(draft.block)))
    if len(given) == len(draft.block):  # positions of the block only
        expected = expected[rows:]
    return given, expected


def _block_shift(rnd: Round, run: PromptRun) -> int | None:
    """How far the round's block positions sit from z-lab's, its context rows where z-lab puts them (0: as z-lab's;
    None: not recorded, or not one shift of the block alone)."""
    fed = _fed_positions(rnd, run)
    if fed is None:
        return None
    given, expected = fed
    n = len(rnd.draft.block)
    shifts = {g - e for g, e in zip(given[-n:], expected[-n:])} if len(given) == len(expected) else set()
    return shifts.pop() if len(shifts) == 1 and given[:-n] == expected[:-n] else None


def position_cause(ref: Reference, rnd: Round, run: PromptRun, number: int) -> Cause | None:
    fed = _fed_positions(rnd, run)
    if fed is None:
        return None
    given, expected = fed
    draft = rnd.draft
    if given == expected:
        return None
    shift = {g - e for g, e in zip(given, expected)} if len(given) == len(expected) else set()
    if len(shift) == 1:
        k = shift.pop()
        return Cause("positions", f"the drafter's position ids are all shifted by {k:+d} (context and block alike): "
                     "rotary attention sees only their differences, so nothing the drafter computes changes",
                     run.index, number, severity="info")
    k = _block_shift(rnd, run)
    if k is not None:
        # A block pulled back by more the further the anchor is, so that it always ends at one length: rebased.
        recorded = [(r.start, len(r.draft.block), _block_shift(r, run)) for r in run.rounds
                    if r.draft is not None and r.draft.block is not None]
        recorded = [(s, b, shift) for s, b, shift in recorded if shift is not None]
        length = rebased_length(*zip(*recorded)) if recorded else None
        fault = rebased(ref.shape, rnd.start, len(draft.block), length, "read by value from its position ids "
                        "at every round") if length is not None else None
        if fault is not None:
            return Cause.of_fault(fault, run.index, number)
        what = f"z-lab's with the block shifted by {k:+d}: the block's anchor at {rnd.start + k}, not {rnd.start}"
    else:
        what = f"{given[:3]}...{given[-2:]}, not {expected[:3]}...{expected[-2:]}"
    return Cause("positions", f"the drafter's position ids are {what} (z-lab: the context rows' positions, then "
                 f"start..start + B - 1)", run.index, number)


def acceptance_cause(rnd: Round, run: PromptRun, number: int) -> Cause | None:
    if rnd.read_from != "next" or rnd.produced is None:
        return None
    accepted = rnd.accepted_by_rule
    expected = rnd.block[1: accepted + 1] + [rnd.target_argmax[accepted]]
    if rnd.kept == expected:
        return None
    if len(rnd.kept) != len(expected):
        what = f"keeps {len(rnd.kept)} tokens ({len(rnd.kept) - 1} drafts and a last token)"
    else:
        what = "keeps the drafts' count of the rule, but not its tokens"
    return Cause("acceptance", f"the round {what}; the target's greedy choice accepts {accepted} draft"
                 f"{'s' if accepted != 1 else ''} and adds its own next token ({len(expected)} tokens, z-lab's "
                 f"acceptance rule)", run.index, number)


def _zlab_features(ref: Reference, states: TargetStates, start: int):
    import torch

    return torch.cat([states.feature(layer)[:start] for layer in ref.layer_ids], dim=-1)


def output_cause(ref: Reference, states: TargetStates, rnd: Round, run: PromptRun, number: int) -> Cause | None:
    """The drafter's output held to z-lab's drafter on z-lab's inputs at this anchor; a long-context fault named
    (dflash_audit/audit/context_faults.py) where z-lab's drafter with that one change computes the evaluator's
    output."""
    draft = rnd.draft
    if draft is None or draft.output is None or draft.block is None:
        return None
    features = _zlab_features(ref, states, rnd.start)
    theirs = draft.output.float()
    ours = faulted_output(ref.twin, ref.target, features, draft.block, rnd.start)
    rows = min(theirs.shape[0], ours.shape[0])
    if rows == 0 or theirs.shape[-1] != ours.shape[-1]:
        return None
    gap = relative_rows(theirs[-rows:], ours[-rows:])
    if gap <= SAME:
        return None
    fed = draft.features.shape[0] if draft.features is not None else None
    for fault in context_faults(ref.shape, rnd.start, len(draft.block), fed if fed and fed < rnd.start else None):
        changed = faulted_output(ref.twin, ref.target, features, draft.block, rnd.start, fault)
        if relative_rows(theirs[-rows:], changed[-rows:]) <= SAME:
            return Cause.of_fault(fault, run.index, number, gap, " (the drafter's output at this round is z-lab's "
                                  "drafter's with that one change, by value)")
    return Cause("drafter", f"on z-lab's inputs the drafter computes another output than z-lab's drafter (relative "
                 f"difference {gap:.3g}); neither an input nor a long-context fault (the window, a context cap, "
                 "rebased positions, a default rope_theta) explains it", run.index, number, gap)


def drafts_cause(ref: Reference, rnd: Round, run: PromptRun, number: int) -> Cause | None:
    draft = rnd.draft
    if draft is None or draft.output is None or not draft.drafts:
        return None
    logits = drafter_logits(ref.twin, ref.target, draft.output[-len(draft.drafts):])
    ours = logits.argmax(-1).tolist()
    if ours == draft.drafts:
        return None
    top = logits.topk(2, dim=-1).values
    slot = next(j for j, (a, b) in enumerate(zip(ours, draft.drafts)) if a != b)  # the first draft that parts
    margin = float(top[slot, 0] - top[slot, 1])
    # The one near-tie rule (impl/near_tie.py): the head read the evaluator's own output rows (the same inputs,
    # nothing rounded apart below float32), by the evaluator's kernels, not ours.
    if near_tie(margin, next(ref.twin.parameters()).dtype, moved=0.0, ulps=0.0):
        return Cause("tie", f"the drafts part at an argmax near-tie (top-2 logit margin {margin:.3g} at draft "
                     f"{slot + 1}): float32 kernels summing in another order pick either", run.index, number, margin,
                     "info")
    return Cause("drafts", f"the drafter's output is z-lab's, its drafts are not the head's argmax on it "
                 f"({draft.drafts} vs {ours})", run.index, number)


def counterfactual_cause(ref: Reference, states: TargetStates, rnd: Round, run: PromptRun,
                         number: int) -> Cause | None:
    """At a parting round whose drafter inputs the recording does not show (a drafter driven module by module, its
    positions and masks inside it): z-lab's drafter is run on z-lab's inputs with one change at a time (each
    long-context fault of dflash_audit/audit/context_faults.py: its sliding window off, its context capped, its
    block rebased, a default rope_theta; the block's positions shifted by one; one layer's feature replaced by
    another tensor of the target), and the change whose drafts are the evaluator's, with their top-2 logit margins
    where the recording holds them, is named (one root cause, by value)."""
    import torch

    theirs = rnd.block[1:]
    if not theirs or rnd.start >= len(run.sequence()):
        return None
    n, start = len(theirs), rnd.start
    block = anchor_blocks(torch.tensor([run.sequence()[start]]), n + 1, ref.mask_id)[0].tolist()
    width = ref.hidden
    base = _zlab_features(ref, states, start)
    margins = rnd.draft.margins if rnd.draft is not None and rnd.draft.drafts == theirs else None
    margins = margins if margins and len(margins) == n else None

    def match(features=base, fault: ContextFault | None = None) -> str | None:
        """"margins": the evaluator's drafts and their top-2 margins within the evaluation's dtype noise (or no
        margins recorded); "drafts": its drafts alone; None: other drafts."""
        hidden = faulted_output(ref.twin, ref.target, features, block, start, fault)
        logits = drafter_logits(ref.twin, ref.target, hidden[1:])
        if logits.argmax(-1).tolist() != theirs:
            return None
        if margins is None:
            return "margins"  # nothing more recorded to hold them to
        top = logits.topk(2, dim=-1).values
        tolerance = ref.tolerance * float(top[:, 0].abs().max())
        same = all(abs(float(a - b) - m) <= tolerance for (a, b), m in zip(top.tolist(), margins))
        return "margins" if same else "drafts"

    if match() is not None:
        return None
    how = " (the drafter's inputs are not recorded: named by a counterfactual replay)"

    def variants():
        """(the cause, its replay) in the order tried."""
        fed = rnd.draft.features.shape[0] if rnd.draft is not None and rnd.draft.features is not None else None
        for fault in context_faults(ref.shape, start, n + 1, fed if fed and fed < start else None):
            yield (lambda fault=fault, how=how: Cause.of_fault(fault, run.index, number, how=how)), \
                (lambda fault=fault: match(fault=fault))
        for shift in (1, -1):
            yield (lambda shift=shift, how=how: Cause(
                "positions", f"the drafts are z-lab's drafter's with the block's positions shifted by {shift:+d} (the "
                f"anchor at {start + shift}, not {start}; the context rows where z-lab puts them){how}", run.index,
                number)), (lambda shift=shift: match(fault=ContextFault("positions", "", block_shift=shift)))
        for j, layer in enumerate(ref.layer_ids):
            for name, tensor in states.named_states():
                if relative_rows(tensor[:start], states.feature(layer)[:start]) <= SAME:
                    continue
                fed_features = base.clone()
                fed_features[:, j * width:(j + 1) * width] = tensor[:start]
                yield (lambda name=name, j=j, layer=layer, how=how: Cause(
                    "context_features", f"the drafts are z-lab's drafter's fed {name} as feature {j} (target layer "
                    f"{layer}); z-lab feeds hidden_states[{hidden_state_index(layer)}]{how}", run.index, number)), \
                    (lambda fed_features=fed_features: match(features=fed_features))

    # With the margins recorded, only the change that gives them too is named (the drafts alone may be given by
    # several changes, a cap of 64 and one of 100 alike): an unknown stays unknown.
    for cause, replay in variants():
        if replay() == "margins":
            return cause()
    return None
    how = " (the drafter's inputs are not recorded: named by a counterfactual replay)"
    fed = rnd.draft.features.shape[0] if rnd.draft is not None and rnd.draft.features is not None else None
    for fault in context_faults(ref.shape, start, n + 1, fed if fed and fed < start else None):
        if same(fault=fault):
            return Cause.of_fault(fault, run.index, number, how=how)
    for shift in (1, -1):
        if same(fault=ContextFault("positions", "", block_shift=shift)):
            return Cause("positions", f"the drafts are z-lab's drafter's with the block's positions shifted by "
                         f"{shift:+d} (the anchor at {start + shift}, not {start}; the context rows where z-lab puts "
                         f"them){how}", run.index, number)
    for j, layer in enumerate(ref.layer_ids):
        for name, tensor in states.named_states():
            if relative_rows(tensor[:start], states.feature(layer)[:start]) <= SAME:
                continue
            fed = base.clone()
            fed[:, j * width:(j + 1) * width] = tensor[:start]
            if same(features=fed):
                return Cause("context_features", f"the drafts are z-lab's drafter's fed {name} as feature {j} (target "
                             f"layer {layer}); z-lab feeds hidden_states[{hidden_state_index(layer)}]{how}",
                             run.index, number)
    return None


# The rounds core's words for what a cause is (`Finding.localized["kind"]`): an input the drafter is fed, a rule of
# the loop around it, a near-tie, no cause found; any other cause is the drafter's own computation ("module").
KINDS = {"context_features": "input", "block": "input", "positions": "input", "acceptance": "convention",
         "stop_ids": "convention", "tie": "tie", "unlocalized": "unlocalized"}


def cause_finding(cause: Cause) -> Finding:
    """One prompt's cause, at its first round, as the rounds core's localizers give theirs (`Localized.findings`)."""
    return Finding("evaluation", cause.severity, cause.message, cause.size, None, PITFALLS.get(cause.key), cause.key,
                   raw=dict(cause.numbers), localized={"kind": KINDS.get(cause.key, "module"), "prompt": cause.prompt,
                                                       "round": cause.round})


class EvaluatorLocalizer:
    """The evaluator's localizer, under the rounds core's contract (`rounds.source.Localizer`: prompt `index`, at its
    first round that parts from z-lab's loop, -> `Localized`), so the evaluator is a source of rounds like an engine:
    every round's inputs up to the parting round held to z-lab's loop (the context features, the block, the
    positions and, greedy, the acceptance rule), and at the parting round, with no input cause, the drafter's output,
    a counterfactual replay, its drafts. An engine's `FedLocalizer` (rounds/by_value.py) needs every context row the
    drafter attends to and its modules' outputs, which an evaluator's recording does not hold (docs/trace-eval.md).

    Its findings are the evaluator's own (`evaluation`), one per cause at the cause's first round; `row`'s
    `explained_by` their keys. A prompt whose rounds never part (or any prompt at T > 0, where no round is the first
    to part) has its inputs held at every round all the same: `localized(index, None)`."""

    def __init__(self, ref: Reference, states_of, runs: list[PromptRun], temperature: float):
        self.ref, self.states_of, self.runs, self.temperature = ref, states_of, runs, temperature
        self.found: dict[tuple[int, int | None], Localized] = {}  # the core's call and the report's read it once

    def __call__(self, index: int, prompt, audited, round_no: int) -> Localized:
        return self.localized(index, round_no)

    def localized(self, index: int, parting: int | None) -> Localized:
        if (index, parting) not in self.found:
            causes = self.causes(self.runs[index], parting)
            self.found[index, parting] = Localized([cause_finding(c) for c in causes],
                                                   {"explained_by": [c.key for c in causes]})
        return self.found[index, parting]

    def causes(self, run: PromptRun, parting: int | None) -> list[Cause]:
        """A cause is kept at its first round."""
        ref, temperature = self.ref, self.temperature
        states = self.states_of(run.sequence())
        found: dict[str, Cause] = {}
        last = len(run.rounds) if parting is None else min(parting, len(run.rounds))
        max_length = len(run.prompt) + 1 + sum(run.lengths)  # the evaluator's length (the loop's end, short of a stop)
        for i, rnd in enumerate(run.rounds[:last]):
            number = i + 1
            near_end = all(len(r.block) < ref.block_size for r in run.rounds[i:])  # z-lab's blocks shorten at the end
            checks = [feature_cause(ref, states, rnd, run, number),
                      block_cause(ref, rnd, run, number, max_length if temperature == 0 else None, near_end),
                      position_cause(ref, rnd, run, number)]
            if temperature == 0:
                checks.append(acceptance_cause(rnd, run, number))
            for cause in checks:
                if cause is not None and cause.key not in found:
                    found[cause.key] = cause
        if parting is not None and not any(c.severity == "divergence" for c in found.values()):
            if parting > len(run.rounds) or parting > 0 and run.rounds[parting - 1].produced is not None and \
                    _past_stop(run, parting, ref.stop_ids):
                found["stop_ids"] = Cause("stop_ids", f"the evaluator goes on after the target's stop id "
                                          f"({ref.stop_ids}); z-lab's loop stops there", run.index, parting)
            else:
                rnd = run.rounds[parting - 1]
                cause = output_cause(ref, states, rnd, run, parting)
                if cause is None or cause.key == "drafter":
                    cause = counterfactual_cause(ref, states, rnd, run, parting) or cause
                cause = cause or drafts_cause(ref, rnd, run, parting)
                found[(cause.key if cause else "unlocalized")] = cause or Cause(
                    "unlocalized", "the round parts with every input, the drafter's output and its drafts z-lab's",
                    run.index, parting)
        return list(found.values())


def _past_stop(run: PromptRun, parting: int, stop_ids: list[int]) -> bool:
    before = run.sequence(parting - 1)[len(run.prompt):]
    return any(t in stop_ids for t in before)
