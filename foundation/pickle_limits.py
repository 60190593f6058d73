"""Limits on what an unpickled checkpoint may be, and torch's refusal put in words.

A pickle can reference one object many times (the memo), so a file of a few kilobytes can be a
"reference bomb": a list of two references to a list of two references ... unpickles at once, but
every reader that walks it (finding the state dict, turning training args into plain data) visits
2**depth nodes. The object graph is measured once, each distinct object once, before anything walks
it; a graph that would expand past the limits, or that contains itself, is refused.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from foundation.graph_walk import check_bounded

MAX_EXPANDED_NODES = 2_000_000  # far beyond any training checkpoint's dicts, lists and args
MAX_DEPTH = 200
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# torch's advice around a weights-only refusal: paragraphs that are not the reason.
BOILERPLATE = ("Weights only load failed", "weights_only", "trusted source", "trust the source",
               "Check the documentation", "Please file an issue", "torch.serialization.add_safe_globals",
               "safe_globals", "https://")


REFUSALS = {
    "expanded": f"its objects reference each other so often that reading them would visit more than "
                f"{MAX_EXPANDED_NODES:,} entries (a pickle reference bomb)",
    "loop": "a list or dict in it contains itself (a reference loop); no checkpoint needs one",
    "depth": f"its data nests deeper than {MAX_DEPTH} levels",
}


# Failures that carry no message, in words.
SILENT_FAILURES = {MemoryError: "out of memory while reading it", EOFError: "it ends before its data does (truncated)"}


class PickleBomb(ValueError):
    """An unpickled object graph past the limits; the message says which."""


def check_graph(root: Any) -> None:
    """PickleBomb if walking `root` (dicts, lists, tuples, sets; tensors are leaves) would visit more than
    MAX_EXPANDED_NODES nodes, nest deeper than MAX_DEPTH, or loop."""
    # An object's back-reference (OmegaConf's `_parent`) is no loop: readers stop there.
    check_bounded(root, _children, MAX_DEPTH, MAX_EXPANDED_NODES, lambda kind: PickleBomb(REFUSALS[kind]),
                  back_reference=_is_object)


def _is_object(node: Any) -> bool:
    return not isinstance(node, (dict, list, tuple, set, frozenset))


def _children(node: Any) -> list | None:
    if isinstance(node, dict):
        return list(node.keys()) + list(node.values())
    if isinstance(node, (list, tuple, set, frozenset)):
        return list(node)
    state = getattr(node, "__dict__", None) if not isinstance(node, (torch.Tensor, type)) else None
    if isinstance(state, dict) and state:
        return list(state.values())
    return None


def load_failure_reason(exc: BaseException) -> str:
    """torch.load's refusal without its advice and terminal colours: the reason alone (for a failure that gives
    none, what its kind says)."""
    text = ANSI.sub("", str(exc))
    if not text.strip():
        return SILENT_FAILURES.get(type(exc), "no details given")
    for paragraph in re.split(r"\n\s*\n", text):
        line = " ".join(paragraph.split())
        if line and not any(needle in line for needle in BOILERPLATE):
            return line.removeprefix("WeightsUnpickler error:").strip()[:200]
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()[:200]
    return "not plain data (a class or function torch does not load safely)" if "Weights only" in text \
        else (" ".join(text.split())[:200] or "no details given")
