"""Static audit against the target (`compare --target`): each drafter's vocabulary and mask token held to the
target's vocabulary (`foundation.target_vocab`), without loading a model.

- `vocab_sizes` (#36): the target's padded vocabulary (embedding rows beyond the tokenizer) is info; a drafter
  whose vocabulary differs from the target's padded one is a divergence. A reduced draft head (`draft_vocab_size`
  with its mapping) is `draft_vocab`'s, not this finding's: here the vocabulary the drafter maps into counts.
- `mask_token_validity` (#34): the mask id must lie inside the target's vocabulary and embedding and differ from
  its eos, pad and bos ids (the same rule the serving verdict applies, #28); the finding always says whether the
  embedding row looks trained. One finding per distinct value: two drafters with the same bad id share one.
"""

from __future__ import annotations

from typing import Any

from catalogue.findings import Finding
from dflash_audit.audit.sides import Side
from dflash_audit.audit.static_vocab import head_size
from foundation.target_vocab import TargetVocabulary, mask_token_problems, row_norms

MASK_CONSEQUENCES = {
    "outside": "the block's mask slots index past the target's embedding: an engine refuses the drafter or reads "
               "out of range",
    "special": "a real token of the target is fed as the mask: a decode loop that stops on it or drops it loses "
               "real tokens, and the drafter cannot tell that token from an empty slot",
}


def target_findings(ours: Side, ref: Side, target: TargetVocabulary) -> list[Finding]:
    return vocab_size_findings(ours, ref, target) + mask_token_validity_findings(ours, ref, target)


def size_table(ours: Side, ref: Side, target: TargetVocabulary) -> dict[str, Any]:
    """The four sizes side by side (the report's vocabulary table): the target's, and each drafter's head."""
    return {**target.to_dict(), "drafters": {"ours": sizes(ours), "ref": sizes(ref)}}


def sides_by_value(ours: Side, ref: Side, name: str) -> dict[Any, list[str]]:
    """{value: ["ours", "ref"] or one of them}, known values only."""
    found: dict[Any, list[str]] = {}
    for label, side in (("ours", ours), ("ref", ref)):
        if side.is_known(name) and side.value(name) is not None:
            found.setdefault(side.value(name), []).append(label)
    return found


def who(labels: list[str]) -> str:
    return "both drafters" if len(labels) == 2 else labels[0]


def sizes(side: Side) -> dict[str, Any]:
    return {"draft_head_rows": head_size(side), "target_vocab_size": side.value("target_vocab_size")}


def vocab_size_findings(ours: Side, ref: Side, target: TargetVocabulary) -> list[Finding]:
    rows, config, tokens, padded = target.embedding_rows, target.config_vocab_size, target.tokenizer_length, \
        target.padded_size
    table = target.to_dict()
    found = []
    if target.padding is not None and target.padding > 0:
        found.append(Finding(
            "vocab_sizes", "info",
            f"The target's vocabulary is padded: {padded} rows (embedding rows {_known(rows)}, config vocab_size "
            f"{_known(config)}) for {tokens} tokenizer tokens; ids {tokens}..{padded - 1} are never produced by the "
            f"tokenizer. Padding is no divergence by itself: a draft head must span the padded {padded} rows.",
            None, None, pitfall=36, key="target padding", raw=table))
    if rows is not None and config is not None and rows != config:
        found.append(Finding(
            "vocab_sizes", "warning",
            f"The target contradicts itself: config vocab_size {config} but {rows} embedding rows; its logits span "
            f"{rows} rows, which is what a drafter is held to here.", None, None, pitfall=36,
            key="target config vs embedding", raw=table))
    if tokens is not None and padded is not None and tokens > padded:
        found.append(Finding(
            "vocab_sizes", "warning",
            f"The target's tokenizer has {tokens} tokens but only {padded} embedding rows: ids {padded}..{tokens - 1} "
            "have no row, so the target cannot read them.", None, None, pitfall=36,
            key="target tokenizer beyond embedding", raw=table))
    if padded is None:
        return found
    for vocab, labels in sides_by_value(ours, ref, "target_vocab_size").items():
        if vocab == padded:
            continue
        side = ours if labels[0] == "ours" else ref
        reduced = head_size(side) != vocab
        head = (f"a reduced draft head of {head_size(side)} rows mapped into a vocabulary of {vocab}" if reduced
                else f"a draft head of {vocab} rows")
        tokenizer_sized = " (the tokenizer's length, not the target's padded vocabulary)" if vocab == tokens else ""
        found.append(Finding(
            "vocab_sizes", "divergence",
            f"{_upper_first(who(labels))} {'have' if len(labels) == 2 else 'has'} {head}{tokenizer_sized}, but the "
            f"target's logits span {padded} rows: draft and target distributions are indexed over different "
            "vocabularies, so an engine refuses the head or compares ids that do not line up.",
            sizes(ours) if "ours" in labels else None, sizes(ref) if "ref" in labels else None, pitfall=36,
            key=f"draft vocabulary {vocab}", raw={"target": table, "ours": sizes(ours), "ref": sizes(ref)}))
    return found


def mask_token_validity_findings(ours: Side, ref: Side, target: TargetVocabulary) -> list[Finding]:
    masks = sides_by_value(ours, ref, "mask_token_id")
    limits = {"vocabulary": target.config_vocab_size, "embedding": target.embedding_rows}
    norms = row_norms(target.embedding, list(masks)) if target.embedding is not None and masks else {}
    found = []
    for mask, labels in masks.items():
        problems = mask_token_problems(mask, limits, target.special_ids)
        facts = [row.describe() for row in [norms.get(mask)] if row is not None]
        if target.embedding is None:
            facts.append("the target has no safetensors embedding, so whether its row looks trained is unknown")
        tokens, inside = target.tokenizer_length, mask < (target.padded_size or 0)
        if inside and tokens is not None and mask >= tokens:
            facts.append(f"it is a padding row past the tokenizer's {tokens} tokens, so the target never generates "
                         "it")
        elif inside and tokens is not None:
            facts.append("it is a tokenizer token the target can generate, so a decode loop must keep it")
        if not any(target.special_ids.values()):
            facts.append("the target declares no eos, pad or bos id, so a clash with them is unknown")
        values = {"mask_token_id": mask, "problems": [kind for kind, _ in problems],
                  "row_norm": norms[mask].norm if mask in norms else None,
                  "median_row_norm": norms[mask].median if mask in norms else None,
                  "looks_trained": norms[mask].looks_trained if mask in norms else None}
        subject = f"Mask token {mask} ({who(labels)})"
        if problems:
            kinds = {kind for kind, _ in problems}
            consequences = "; ".join(MASK_CONSEQUENCES[k] for k in ("outside", "special") if k in kinds)
            message = f"{subject} is {' and '.join(phrase for _, phrase in problems)}. {_upper_first(consequences)}."
            severity = "divergence"
        elif all(limit is None for limit in limits.values()):
            message, severity = f"{subject}: whether it lies inside the target's vocabulary is unknown (the " \
                                "target declares no vocab_size and has no safetensors embedding).", "warning"
        else:
            message, severity = (f"{subject} lies inside the target's vocabulary and embedding and is none of its "
                                 "eos/pad/bos ids."), "info"
        if facts:
            text = "; ".join(facts)
            message += f" {_upper_first(text)}."
        found.append(Finding("mask_token_validity", severity, message,
                             values if "ours" in labels else None, values if "ref" in labels else None,
                             pitfall=34, key=f"mask token {mask}", raw={"target": target.to_dict()}))
    return found


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def _known(value: Any) -> str:
    return "unknown" if value is None else str(value)
