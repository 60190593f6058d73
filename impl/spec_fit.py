"""Whether a drafter's spec fits a target: the hidden size it reads, the decoder depth it was built for and the
vocabulary it drafts over. The one check `eval`, `compare` and `convert --format speculators` apply
(dflash_audit/audit/drafter_fit.py adds a reduced draft vocabulary's map)."""

from __future__ import annotations

from impl.spec import DraftSpec


def spec_misfit(spec: DraftSpec, hidden_size: int | None, depth: int | None,
                vocab_size: int | None = None) -> str | None:
    """Why a drafter of `spec` cannot run against a target of this hidden size, decoder depth and vocabulary
    (None: not checked), or None."""
    if spec.hidden_size != hidden_size:
        return f"hidden size {spec.hidden_size} but the target's is {hidden_size}"
    if spec.num_target_layers != depth:
        return f"built for a target of {spec.num_target_layers} layers, this one has {depth}"
    if vocab_size is not None and spec.target_vocab_size != vocab_size:
        return f"vocabulary of {spec.target_vocab_size} but the target's is {vocab_size}"
    return None
