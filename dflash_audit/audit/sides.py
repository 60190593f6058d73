"""One side of a comparison: a drafter loaded from any format, with its raw on-disk values kept.

A side's spec may be incomplete (a foreign checkpoint that does not declare, say, which
target layers feed fc): `known` then holds what is known and `provenance` says, for every
field, where its value came from or why it is unknown. The audit never fills a gap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_audit.formats import LoadOptions
from dflash_audit.formats.loaded import LoadedCheckpoint
from dflash_audit.formats.shape_inference import Contradiction, fc_layer_count
from impl.families import spec_family
from foundation.param_names import verifier_owned_keys
from impl.recipe import Recipe
from impl.spec import SPEC_FIELDS, DraftSpec


@dataclass
class Side:
    path: str
    format: str  # ours | zlab | speculators | foreign
    spec: DraftSpec | None  # None when some field is unknown
    state_dict: dict[str, torch.Tensor]  # draft body (plus any tensor the spec does not explain)
    recipe: Recipe | None
    raw_layer_ids: list[int] | None  # target layer ids as stored, in the format's own convention
    layer_id_convention: str  # "zlab" (hs[id + 1]) or "speculators" (hs[id])
    verifier_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    known: dict[str, Any] = field(default_factory=dict)  # spec field -> value, known fields only
    provenance: dict[str, dict[str, str]] = field(default_factory=dict)  # field -> {"source", "detail"}
    recipe_unknown: list[str] = field(default_factory=list)
    contradictions: list[Contradiction] = field(default_factory=list)
    foreign: dict[str, Any] = field(default_factory=dict)
    gguf: dict[str, Any] = field(default_factory=dict)  # a GGUF side: its version, converter, tensor types

    def __post_init__(self) -> None:
        if self.spec is not None and not self.known:
            self.known = self.spec.to_dict()

    def require_spec(self, what: str) -> DraftSpec:
        """The complete spec, or a one-line error naming each unknown field and the flag that gives it."""
        if self.spec is None:
            from dflash_audit.formats import incomplete_spec

            details = {name: p.get("detail", "") for name, p in self.provenance.items()}
            raise incomplete_spec(self.path, self.known, details, what)
        return self.spec

    def value(self, name: str) -> Any:
        """A spec field's value; None also when unknown (check `is_known`)."""
        return self.known.get(name)

    def is_known(self, name: str) -> bool:
        return name in self.known

    def source(self, name: str) -> str:
        return self.provenance.get(name, {}).get("source", "declared")

    @property
    def fc_layer_count(self) -> int | None:
        """How many target layers fc reads: from the ids, else from fc.weight's shape."""
        ids = self.known.get("target_layer_ids")
        if ids is not None:
            return len(ids)
        fc = self.state_dict.get("fc.weight")
        counted = fc_layer_count({"fc.weight": tuple(fc.shape)}, self.known.get("hidden_size")) if fc is not None \
            else None
        return counted[0] if counted else None

    @property
    def fc_in_features(self) -> int | None:
        count, hidden = self.fc_layer_count, self.known.get("hidden_size")
        return count * hidden if count is not None and hidden else None

    def shape_spec(self) -> DraftSpec | None:
        """A spec with this side's shapes, for the tensors it implies; None when shapes are unknown.

        Fields no shape depends on (which layers, the mask token, ...) take stand-in values here
        and nowhere else: this spec only ever sizes tensors."""
        if self.spec is not None:
            return self.spec
        count = self.fc_layer_count
        names = set(SPEC_FIELDS)
        values = {k: v for k, v in self.known.items() if k in names}
        if count is None:
            return None
        values.update(target_layer_ids=tuple(range(count)), num_target_layers=count, mask_token_id=0,
                      target_vocab_size=values.get("target_vocab_size") or 1, block_size=values.get("block_size") or 1)
        if spec_family(values.get("conv_kernel_size")) == "dflash2":  # top-k and the block size shape nothing
            values["block_size"] = max(values["block_size"], values["conv_kernel_size"])
            values["selector_top_k"] = 1
        values["layer_types"] = tuple(values.get("layer_types") or ())
        try:
            return DraftSpec(**values)
        except (TypeError, ValueError):
            return None


def load_side(path: str | Path, target_dir: str | Path | None = None, options: LoadOptions | None = None) -> Side:
    """Detect the format and load; a path that is none of them is a one-line AuditError."""
    from dflash_audit.formats import load_any

    return side_of(load_any(path, target_dir, options), path)


def side_of(loaded: LoadedCheckpoint, path: str | Path) -> Side:
    """A loaded drafter as a side: verifier-owned tensors apart from its body."""
    raw = loaded.raw
    known = dict(loaded.known_spec) or (loaded.spec.to_dict() if loaded.spec is not None else {})
    # Belt and braces: a format loader that leaves verifier-owned tensors in the body.
    owned_keys = frozenset(verifier_owned_keys(known.get("draft_vocab_size") is not None))
    body = {k: v for k, v in loaded.state_dict.items() if k not in owned_keys}
    owned = {k: v for k, v in loaded.state_dict.items() if k in owned_keys} | dict(loaded.verifier_tensors)
    raw_ids = raw.layer_ids
    if raw_ids is None and "target_layer_ids" in known:
        raw_ids = known["target_layer_ids"]
    return Side(path=str(path), format=loaded.format, spec=loaded.spec, state_dict=body, recipe=loaded.recipe,
                raw_layer_ids=list(raw_ids) if raw_ids is not None else None,
                layer_id_convention=raw.layer_id_convention, verifier_tensors=owned,
                known=known,
                provenance={k: p.to_dict() for k, p in loaded.provenance.items()},
                recipe_unknown=list(loaded.recipe_unknown), contradictions=list(loaded.contradictions),
                foreign=dict(loaded.foreign), gguf=dict(loaded.gguf))
