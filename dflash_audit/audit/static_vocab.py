"""Static audit, the draft vocabulary: how many tokens each drafter's head proposes and which target ids
(`d2t`, impl/vocab_mapping.py). One root cause, one `draft_vocab` finding: a side whose reduced vocabulary
has no usable map; else different draft vocabulary sizes; else the same size mapped to different ids.
The head and `d2t` tensors that differ because of it are listed as explained by it."""

from __future__ import annotations

import torch

from catalogue.findings import Finding
from dflash_audit.audit.sides import Side
from foundation.param_names import DRAFT_VOCAB_KEYS
from impl.vocab_mapping import differing_ids, mapping_problems

PITFALL = 32


def head_size(side: Side) -> int | None:
    """Rows of the side's head: its draft vocabulary, else the target vocabulary (None: unknown)."""
    return side.value("draft_vocab_size") or side.value("target_vocab_size")


def usable_d2t(side: Side) -> torch.Tensor | None:
    """The side's d2t when it has a reduced draft vocabulary and the map is well formed."""
    size, vocab, d2t = side.value("draft_vocab_size"), side.value("target_vocab_size"), side.state_dict.get("d2t")
    if size is None or vocab is None or d2t is None or mapping_problems(d2t, size, vocab):
        return None
    return d2t


def mapping_problem(side: Side) -> tuple[int, int, list[str]] | None:
    """(draft vocabulary, target vocabulary, why its map is unusable) for a side whose head is reduced (declared,
    or a stored `lm_head` with fewer rows than the vocabulary) without a usable `d2t`; None otherwise."""
    size, vocab = side.value("draft_vocab_size"), side.value("target_vocab_size")
    head = side.state_dict.get("lm_head.weight", side.verifier_tensors.get("lm_head.weight"))
    if size is None and vocab is not None and head is not None and head.dim() == 2 and head.shape[0] < vocab:
        size = head.shape[0]  # a reduced head whose config lost its draft_vocab_size (and so its mapping)
    if size is None or vocab is None:
        return None
    problems = mapping_problems(side.state_dict.get("d2t"), size, vocab)
    return (size, vocab, problems) if problems else None


def mapping_findings(side: Side, name: str) -> list[Finding]:
    """A reduced draft vocabulary without a usable map: engines would read draft ids as target ids."""
    problem = mapping_problem(side)
    if problem is None:
        return []
    size, vocab, problems = problem
    values = (problems if name == "ours" else None, problems if name == "ref" else None)
    if side.state_dict.get("d2t") is None:
        message = (f"{name} drafts over a reduced vocabulary of {size} of the target's {vocab} tokens but carries no "
                   "d2t mapping: an engine then treats draft id k as target token k, so it proposes the wrong tokens "
                   "for every id whose token is not at its own index.")
    else:
        message = (f"{name}'s draft-to-target map cannot map its {size}-token draft vocabulary into the target's "
                   f"{vocab} tokens: {'; '.join(problems)}.")
    return [Finding("draft_vocab", "divergence", message, *values, pitfall=PITFALL, key=f"mapping of {name}")]


def draft_vocab_findings(ours: Side, ref: Side) -> list[Finding]:
    found = mapping_findings(ours, "ours") + mapping_findings(ref, "ref")
    if found:
        return found
    if ours.value("draft_vocab_size") is None and ref.value("draft_vocab_size") is None:
        return []  # two full-vocabulary heads: any size difference is the vocabulary's (architecture, vocab_sizes)
    a, b = head_size(ours), head_size(ref)
    if a is None or b is None:
        return []
    d2t_a, d2t_b = usable_d2t(ours), usable_d2t(ref)
    if a != b:
        describe = {side: (f"a draft vocabulary of {size} mapped tokens" if size != s.value("target_vocab_size")
                           else f"the target's whole vocabulary of {size} tokens")
                    for side, s, size in (("ours", ours, a), ("ref", ref, b))}
        return [Finding("draft_vocab", "divergence",
                        f"ours proposes from {describe['ours']}, ref from {describe['ref']}: each can only draft the "
                        "tokens its head holds, so they draft differently wherever the target picks a token only one "
                        "of them holds.", a, b, pitfall=PITFALL, key="draft_vocab_size")]
    if d2t_a is None or d2t_b is None:
        return []
    only_ours, only_ref = differing_ids(d2t_a, d2t_b)
    if not only_ours and not only_ref:
        return []
    return [Finding("draft_vocab", "divergence",
                    f"Both draft over {a} tokens, but the mappings differ: {only_ours} target id(s) ours can propose "
                    f"are not in ref's draft vocabulary ({only_ref} the other way); the same draft id proposes "
                    "different target tokens.", {"only_ours": only_ours}, {"only_ref": only_ref}, pitfall=PITFALL,
                    key="mapping")]


def explained_by_draft_vocab(key: str, findings: list[Finding]) -> bool:
    """The head and d2t tensors differ because of a draft_vocab finding (never again under `weights`)."""
    return key in DRAFT_VOCAB_KEYS and any(f.component == "draft_vocab" for f in findings)
