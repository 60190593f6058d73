"""What the held codebases' DFlash drafters (SpecForge, Model-Optimizer) do not have: the sample-from-anchor
layout and a reduced draft vocabulary. A spec asking for either is Unsupported there, in the same words."""

from __future__ import annotations

from impl.interface import Unsupported
from impl.spec import DraftSpec


def refuse_missing_layouts(spec: DraftSpec, plug: str, codebase: str) -> None:
    if spec.sample_from_anchor:
        raise Unsupported(f"{plug}: {codebase}'s DFlash has no sample-from-anchor layout (slot 0 is the anchor)")
    if spec.draft_vocab_size is not None:
        raise Unsupported(f"{plug}: {codebase}'s DFlash drafter has no reduced draft vocabulary (its head is the "
                          "target's lm_head)")
