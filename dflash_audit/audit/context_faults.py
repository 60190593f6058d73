"""The long-context faults: what a source of rounds (a team's evaluator) may do to the drafter along the context, each
as one change to z-lab's drafter run at one round, so that the round where the source first parts names it by value.

A fault is a `ContextFault`: a change to what the drafter reads at a round anchored at `start` (its context rows,
the block's positions) or to the drafter itself (its sliding windows, its rotary base). The evaluator trace
(dflash_audit/trace/evaluation/why.py) runs z-lab's drafter on z-lab's inputs with each change, one at a time, at the
first parting round, and names the one whose output (or, where only the drafts were recorded, whose drafts and
their logit margins) is the source's:
- the sliding window ignored: the sliding layers run as full ones (the seed evaluator's "short context" assumption,
  z-lab #126, speculators #523);
- the drafter's context capped at N tokens: it reads only the last N context rows (a runtime's drafter context limit,
  Luce-Org/lucebox #740). N is searched among the rows the source fed where it fed fewer than the context, the
  declared lengths and the powers of two below the anchor: a cap of another N is not found, and the round is then
  left as the drafter's;
- the block's positions rebased past a length L: pulled back so that the block ends at L, while the context keeps
  its absolute positions (buun-llama-cpp #32). z-lab's loop never rebases (the reference is absolute); L is read by
  value where the source's position ids were recorded (`rebased_length`), else searched like N;
- a nested `rope_theta` read as a default (transformers' and SGLang's 10000, vLLM's 1e6) instead of the config's
  `rope_parameters.rope_theta` (how each engine reads the field statically is pitfall #30, `serve-check`). Where the
  declared theta is that default, the misreading changes nothing and nothing can name it.
Nothing is guessed: a round no change reproduces keeps its other causes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from impl.defaults import QWEN3_DEFAULTS

# The defaults a reader falls back to for a rope_theta it does not find (pitfall #30).
THETA_DEFAULTS = {float(QWEN3_DEFAULTS["rope_theta"]): "transformers' and SGLang's default",
                  1_000_000.0: "vLLM's default"}
# Context lengths tried for a cap or a rebase where nothing recorded gives them: powers of two, the usual limits.
LENGTH_CANDIDATES = tuple(2 ** k for k in range(4, 18))


@dataclass(frozen=True)
class DrafterShape:
    """What the faults need to know of the drafter as declared (z-lab's folder): each layer's window, its block,
    its rotary base (None: not plain rotary, no theta change is tried), and the lengths its files or recipe
    declare (the trained length, the rotary tables' end), for the searches."""

    windows: tuple[int | None, ...]
    block_size: int
    rope_theta: float | None
    declared_lengths: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class ContextFault:
    """One long-context fault at one round: what changes, and the finding's words and numbers."""

    key: str
    says: str  # what the source does, as the finding words it (after "the evaluator ")
    numbers: dict = field(default_factory=dict)
    keep_rows: int | None = None  # the context cut to its last N rows (their positions kept)
    block_shift: int = 0  # added to every block position
    windows_off: bool = False  # every sliding layer run as a full one
    rope_theta: float | None = None  # the drafter's rotary base replaced


PITFALLS = {"window": 11, "context_cap": 11, "positions_rebased": 12, "rope_theta": 30}


def window_ignored(shape: DrafterShape, start: int) -> ContextFault | None:
    """The sliding layers run as full ones: only visible once the anchor is past the narrowest window."""
    windowed = [i for i, w in enumerate(shape.windows) if w is not None]
    if not windowed or start <= min(shape.windows[i] for i in windowed) - 1:
        return None
    window = shape.windows[windowed[0]]
    return ContextFault("window", f"runs the drafter's sliding layer{'s' if len(windowed) > 1 else ''} {windowed} "
                        f"over all {start} context positions: the window of {window} is not applied (z-lab applies "
                        f"it; the anchor is at position {start}, past it)",
                        {"window": window, "layers": windowed, "anchor": start}, windows_off=True)


def context_caps(shape: DrafterShape, start: int, fed_rows: int | None) -> list[ContextFault]:
    """The drafter's context cut to its last N rows, for each N that changes something at an anchor at `start` (N
    below it, and below every layer's window if all slide)."""
    tried = ([fed_rows] if fed_rows is not None else []) + [n for n, _ in shape.declared_lengths] + \
        list(LENGTH_CANDIDATES)
    widest = None if any(w is None for w in shape.windows) else max(shape.windows)
    caps = []
    for n in dict.fromkeys(tried):
        if 0 < n < start and (widest is None or n < widest):
            caps.append(ContextFault("context_cap", f"caps the drafter's context at {n} tokens: at an anchor at "
                                     f"position {start} it reads the last {n} of its {start} context positions "
                                     "(z-lab's reads them all)", {"cap": n, "anchor": start}, keep_rows=n))
    return caps


def rebased(shape: DrafterShape, start: int, block: int, length: int, how: str) -> ContextFault | None:
    """The block's positions pulled back so the block ends at `length` (its context kept absolute)."""
    offset = length - (start + block)
    if offset >= 0:
        return None
    declared = [what for n, what in shape.declared_lengths if n == length]
    return ContextFault("positions_rebased", f"rebases the block's rotary positions past {length} tokens"
                        f"{f' ({declared[0]})' if declared else ''}, {how}: at an anchor at position {start} the "
                        f"block sits at {start + offset}..{start + offset + block - 1} (offset {offset:+d}) while its "
                        f"context keeps absolute positions; z-lab's loop keeps the block at {start}..{start + block - 1}",
                        {"rebased_to": length, "offset": offset, "anchor": start}, block_shift=offset)


def rebases(shape: DrafterShape, start: int, block: int) -> list[ContextFault]:
    """Every length whose rebase moves the block at `start`: the declared ones first, then the powers of two."""
    found = []
    for length in dict.fromkeys([n for n, _ in shape.declared_lengths] + list(LENGTH_CANDIDATES)):
        fault = rebased(shape, start, block, length, "a length the drafter's files declare" if length in
                        dict(shape.declared_lengths) else "a power of two searched")
        if fault is not None:
            found.append(fault)
    return found


def rebased_length(starts: Sequence[int], blocks: Sequence[int], shifts: Sequence[int]) -> int | None:
    """The length L a source rebases to, read from its recorded block shifts (one per round, `starts` the anchors,
    `blocks` the block lengths): every round's shift is min(0, L - (start + block)), some below 0; None: not a
    rebase (no shift, a constant shift, or shifts no one L explains)."""
    lengths = {s + b + k for s, b, k in zip(starts, blocks, shifts) if k < 0}
    if len(lengths) != 1:
        return None
    length = lengths.pop()
    if all(k == min(0, length - (s + b)) for s, b, k in zip(starts, blocks, shifts)):
        return length
    return None


def theta_defaults(shape: DrafterShape) -> list[ContextFault]:
    """The rotary base read as a default instead of the declared (nested) one."""
    if shape.rope_theta is None:
        return []
    return [ContextFault("rope_theta", f"runs the drafter's rotary embedding at rope_theta {theta:g} ({whose}) "
                         f"instead of the config's {shape.rope_theta:g} (nested in rope_parameters): a nested "
                         "rope_theta read as the default", {"rope_theta_used": theta,
                                                             "rope_theta_declared": shape.rope_theta},
                         rope_theta=theta)
            for theta, whose in THETA_DEFAULTS.items() if theta != shape.rope_theta]


def context_faults(shape: DrafterShape, start: int, block: int, fed_rows: int | None = None) -> list[ContextFault]:
    """Every long-context fault that changes what the drafter computes at an anchor at `start` (block `block`
    long), in the order they are tried: the window, the rotary base, the caps, the rebases."""
    window = window_ignored(shape, start)
    return ([window] if window else []) + theta_defaults(shape) + context_caps(shape, start, fed_rows) + \
        rebases(shape, start, block)
