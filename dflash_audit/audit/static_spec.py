"""Static audit, the settings: two drafters' specs compared field by field (architecture, layer ids,
layer types and windows, the DFlash family), and each side checked against its own tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from catalogue.pitfalls import (
    ARCHITECTURE_ENTRIES,
    ARCHITECTURE_WARNINGS,
    FAMILY_ENTRY,
    FAMILY_SPEC_ENTRIES,
    SLOT_LAYOUT_ENTRY,
)
from catalogue.findings import Finding
from dflash_audit.audit.sides import Side
from impl.body_shapes import body_shapes
from impl.families import spec_family
from impl.slot_layout import describe as describe_layout
from impl.slot_layout import speculative_tokens
from impl.spec import ROTARY_FIELDS, SPEC_FIELDS, DraftSpec


@dataclass
class SpecRow:
    name: str
    ours_raw: Any
    ref_raw: Any
    ours: Any
    ref: Any
    ours_source: dict[str, str] = field(default_factory=dict)  # provenance: {"source", "detail"}
    ref_source: dict[str, str] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        return self.ours == self.ref



def spec_findings(ours: Side, ref: Side) -> list[Finding]:
    found = layer_id_findings(ours, ref)

    def both(name):
        return ours.is_known(name) and ref.is_known(name)

    o_block, r_block = ours.value("block_size"), ref.value("block_size")
    if both("block_size") and o_block != r_block:
        found.append(default_aware(ours, ref, "block_size", Finding(
            "block_size", "divergence",
            f"Blocks of {o_block} tokens in ours vs {r_block} in ref: a round drafts at most "
            f"{proposals(ours, o_block)} vs {proposals(ref, r_block)} tokens, and a drafter run with a block size "
            "it was not "
            "trained for mispredicts the extra slots.", o_block, r_block, pitfall=16)))
    o_mask, r_mask = ours.value("mask_token_id"), ref.value("mask_token_id")
    if both("mask_token_id") and o_mask != r_mask:
        found.append(default_aware(ours, ref, "mask_token_id", Finding(
            "mask_token", "divergence",
            f"The empty block slots are filled with token {o_mask} in ours but {r_mask} in ref: "
            "a drafter fed a mask token it never saw in training drafts garbage.", o_mask, r_mask, pitfall=14)))
    found += layer_type_findings(ours, ref) + window_direction_findings(ours, ref) + family_findings(ours, ref)
    found += slot_layout_findings(ours, ref)
    for name, pitfall in ARCHITECTURE_ENTRIES.items():
        a, b = ours.value(name), ref.value(name)
        if both(name) and a != b:
            severity = "warning" if name in ARCHITECTURE_WARNINGS else "divergence"
            found.append(default_aware(ours, ref, name, Finding(
                "architecture", severity, f"{name} is {a!r} in ours but {b!r} in ref: "
                + architecture_consequence(name), a, b, pitfall=pitfall, key=name)))
    return found


def proposals(side: Side, block_size: int) -> int:
    """Tokens a block of `block_size` proposes under the side's slot layout (anchor-as-bonus when unknown)."""
    layout = side.value("sample_from_anchor") if side.is_known("sample_from_anchor") else False
    return speculative_tokens(block_size, bool(layout))


# Which finding component a spec field belongs to (for unknowns and contradictions).
FIELD_COMPONENT = {"target_layer_ids": "target_layers", "block_size": "block_size", "mask_token_id": "mask_token",
                   "layer_types": "layer_types", "sliding_window": "layer_types", "sample_from_anchor": "slot_layout",
                   "draft_vocab_size": "draft_vocab",
                   **dict.fromkeys(ROTARY_FIELDS, "rotary")}


def default_aware(ours: Side, ref: Side, name: str, finding: Finding) -> Finding:
    """A difference where one side only took a default is a warning: that side never said its value."""
    defaulted = [side for side, s in (("ours", ours), ("ref", ref)) if s.source(name) == "default"]
    if not defaulted or finding.severity != "divergence":
        return finding
    side = defaulted[0]
    flag = f"--{side}-spec {name}=..."
    finding.severity = "warning"
    finding.message += (f" ({side} does not declare {name}: its value is a default; if it was trained with another, "
                        f"give it with {flag})")
    return finding


def shape_contradictions(side: Side, name: str) -> list[Finding]:
    """A declared spec its own tensors disagree with (config says 3 target layers, fc.weight reads 2)."""
    expected = expected_shapes(side.spec) if side.spec is not None else {}
    # A malformed d2t is the draft_vocab finding's (dflash_audit/audit/static_vocab.py), not a contradiction.
    wrong = [(key, tuple(t.shape), expected[key]) for key, t in side.state_dict.items()
             if key in expected and key != "d2t" and tuple(t.shape) != expected[key]]
    if not wrong:
        return []
    key, actual, implied = wrong[0]
    fc = key == "fc.weight" and len(actual) == 2 and side.spec.hidden_size and actual[1] % side.spec.hidden_size == 0
    if fc:
        detail = (f"its config names {len(side.spec.target_layer_ids)} target layers "
                  f"{list(side.spec.target_layer_ids)}, but fc.weight in_features {actual[1]} = "
                  f"{actual[1] // side.spec.hidden_size} layers of hidden {side.spec.hidden_size}")
    else:
        detail = f"its config implies {key} of shape {list(implied)}, the tensor is {list(actual)}"
    more = f" ({len(wrong)} tensors in all)" if len(wrong) > 1 else ""
    return [Finding("fc_dims" if fc else "architecture", "divergence", f"{name} contradicts itself: {detail}{more}.",
                    detail if name == "ours" else None, detail if name == "ref" else None,
                    pitfall=4 if fc else None, key=f"contradiction in {name}")]


def self_findings(side: Side, name: str) -> list[Finding]:
    """What one side says about itself: fields nobody can know without a declaration, contradictions."""
    found = []
    for field_name, prov in side.provenance.items():
        if prov.get("source") != "unknown" or field_name.startswith("recipe."):
            continue
        component = FIELD_COMPONENT.get(field_name, "architecture")
        found.append(Finding(component, "warning", f"{field_name} of {name} is unknown: {prov.get('detail', '')}.",
                             None if name == "ref" else "unknown", None if name == "ours" else "unknown",
                             key=f"unknown in {name}: {field_name}"))
    found += trained_layout_findings(side, name)
    for said in side.contradictions:
        field_name, text = said.spec_field, said.text
        component = "fc_dims" if field_name == "target_layer_ids" else FIELD_COMPONENT.get(field_name, "architecture")
        found.append(Finding(component, "divergence", f"{name} contradicts itself: {text}.",
                             text if name == "ours" else None, text if name == "ref" else None,
                             key=f"contradiction in {name}: {field_name}"))
    return found


def architecture_consequence(name: str) -> str:
    if name == "num_target_layers":
        return "the two drafters were built for targets of different depth."
    if name == "num_hidden_layers":
        return "the drafters have a different number of decoder layers (their layer tensors differ accordingly)."
    if name == "max_position_embeddings":
        return "only contexts longer than the smaller limit behave differently."
    return "the two drafters compute different functions."


def layer_id_findings(ours: Side, ref: Side) -> list[Finding]:
    raw = {"ours": {"ids": ours.raw_layer_ids, "convention": ours.layer_id_convention},
           "ref": {"ids": ref.raw_layer_ids, "convention": ref.layer_id_convention}}
    ids_o, ids_r = ours.value("target_layer_ids"), ref.value("target_layer_ids")
    count_o, count_r = ours.fc_layer_count, ref.fc_layer_count
    if count_o is not None and count_r is not None and count_o != count_r:
        detail = []
        if ids_o is not None and ids_r is not None:
            left_out = [i for i in ids_r if i not in ids_o]
            extra = [i for i in ids_o if i not in ids_r]
            if left_out:
                deepest = " (the deepest)" if max(ids_r) in left_out else ""
                detail.append(f"ours leaves out target layer{'s' if len(left_out) > 1 else ''} "
                              f"{', '.join(map(str, left_out))}{deepest}")
            if extra:
                detail.append(f"ours adds {', '.join(map(str, extra))}")
        else:
            unknown = [side for side, ids in (("ours", ids_o), ("ref", ids_r)) if ids is None]
            detail.append(f"which layers {' and '.join(unknown)} read{'s' if len(unknown) == 1 else ''} is unknown")
        return [Finding(
            "fc_dims", "divergence",
            f"fc reads {count_o} target layers in ours but {count_r} in ref ({'; '.join(detail)}): "
            f"fc.weight in_features {ours.fc_in_features} vs {ref.fc_in_features}. Every selected layer must feed fc.",
            {"target_layer_ids": ids_o, "fc_in_features": ours.fc_in_features},
            {"target_layer_ids": ids_r, "fc_in_features": ref.fc_in_features}, pitfall=4, raw=raw)]
    if ids_o is not None and ids_r is not None and list(ids_o) != list(ids_r):
        ids_o, ids_r = list(ids_o), list(ids_r)
        shifted = all(a - b == ids_o[0] - ids_r[0] for a, b in zip(ids_o, ids_r)) and abs(ids_o[0] - ids_r[0]) == 1
        why = (" Every id is shifted by one: one side reads hs[id] where z-lab reads hs[id + 1]." if shifted
               else " The drafter reads different target layers than the reference was built with.")
        return [Finding("target_layers", "divergence",
                        f"Target layers {ids_o} in ours vs {ids_r} in ref (z-lab convention).{why}",
                        ids_o, ids_r, pitfall=2 if shifted else 1, raw=raw)]
    return []


def layer_type_findings(ours: Side, ref: Side) -> list[Finding]:
    o_layers, r_layers = ours.value("num_hidden_layers"), ref.value("num_hidden_layers")
    if o_layers != r_layers or not (ours.is_known("layer_types") and ref.is_known("layer_types")):
        return []  # a different layer count is the architecture finding's root cause
    o_types, r_types = list(ours.value("layer_types")), list(ref.value("layer_types"))
    found = []
    if o_types != r_types:
        differing = [i for i, (a, b) in enumerate(zip(o_types, r_types)) if a != b]
        found.append(default_aware(ours, ref, "layer_types", Finding(
            "layer_types", "divergence",
            f"Draft layer{'s' if len(differing) > 1 else ''} {differing} use a different attention type "
            "(sliding vs full): sliding layers are causal within the block and windowed over the context.",
            o_types, r_types, pitfall=11)))
    o_window, r_window = ours.value("sliding_window"), ref.value("sliding_window")
    if "sliding_attention" in o_types and o_window != r_window and o_types == r_types:
        found.append(default_aware(ours, ref, "sliding_window", Finding(
            "layer_types", "divergence",
            f"Sliding window {o_window} in ours vs {r_window} in ref: contexts longer than the "
            "smaller window are attended differently.", o_window, r_window, pitfall=11, key="sliding_window")))
    return found


def family_of(side: Side) -> str | None:
    """`dflash`, `dflash2`, `dspark` or `xpress` from the side's spec fields; None when its family fields are
    unknown."""
    if side.spec is not None:
        return side.spec.family
    if side.is_known("conv_kernel_size"):
        return spec_family(side.value("conv_kernel_size"),
                           side.value("markov_rank") if side.is_known("markov_rank") else None,
                           side.value("xpress_rank") if side.is_known("xpress_rank") else None)
    return None


def describe_family(side: Side, other: str | None = None) -> str:
    """The side's family and what it has; a DFlash side says what the `other` family's drafter has and it lacks."""
    family, value = family_of(side), side.value
    if family == "dflash2":
        return (f"DFlash2 ({value('conv_kernel_size')}-tap convolutions in groups of {value('conv_group_size')} "
                f"around attention and MLP, a rank-{value('selector_rank')} selector reranking the top "
                f"{value('selector_top_k')})")
    if family == "dspark":
        markov = (f"a rank-{value('markov_rank')} {value('markov_head_type')} Markov head" if value("markov_rank")
                  else "no Markov head")
        confidence = ("a confidence head" + (" reading the Markov embedding" if value("confidence_head_with_markov")
                                             else "") if value("enable_confidence_head") else "no confidence head")
        return f"DSpark ({markov}, {confidence})"
    if family == "xpress":
        return (f"XPress (a rank-{value('xpress_rank')} causal refiner, MLP x{value('xpress_mlp_ratio')}, resolved "
                f"by {value('num_jacobi_passes')} Jacobi passes)")
    lacks = {"dspark": "no Markov or confidence head", "xpress": "no refiner head"}
    return f"DFlash ({lacks.get(other, 'no convolutions, no selector')})"


FAMILY_TENSORS = {"dflash2": "convolution and selector", "dspark": "Markov and confidence head",
                  "xpress": "refiner head"}


def family_findings(ours: Side, ref: Side) -> list[Finding]:
    """Two families are one architecture finding naming both; between two drafters of one family each
    differing setting of its own is a finding of its component, with both sides' provenance."""
    families = family_of(ours), family_of(ref)
    if None in families:
        return []
    if families[0] != families[1]:
        own = " and ".join(FAMILY_TENSORS[f] for f in dict.fromkeys(families) if f in FAMILY_TENSORS)
        return [Finding("architecture", "divergence",
                        f"ours is {describe_family(ours, families[1])}, ref is {describe_family(ref, families[0])}: "
                        "drafters of different "
                        f"families compute different functions and propose tokens differently; their {own} "
                        "tensors exist on one side only.", families[0], families[1],
                        pitfall=FAMILY_ENTRY.get(families[1] if families[0] == "dflash" else families[0], 19),
                        key="family")]
    found = []
    for name, (component, pitfall, consequence) in FAMILY_SPEC_ENTRIES.get(families[0], {}).items():
        a, b = ours.value(name), ref.value(name)
        if ours.is_known(name) and ref.is_known(name) and a != b:
            found.append(default_aware(ours, ref, name, Finding(
                component, "divergence", f"{name} is {a} in ours but {b} in ref: {consequence}.", a, b,
                pitfall=pitfall, key=name)))
    return found


def slot_layout_findings(ours: Side, ref: Side) -> list[Finding]:
    """The slot layout (`sample_from_anchor`): one finding for the whole difference. Its consequences (which
    slot proposes which position, how many tokens a block proposes, which targets and loss weights training
    used) are this root cause, never findings of their own; the block size is compared apart."""
    name = "sample_from_anchor"
    if not (ours.is_known(name) and ours.is_known("block_size") and ref.is_known(name) and ref.is_known("block_size")):
        return []
    a, b = ours.value(name), ref.value(name)
    if a == b:
        return []
    count_o, count_r = speculative_tokens(ours.value("block_size"), a), speculative_tokens(ref.value("block_size"), b)
    return [default_aware(ours, ref, name, Finding(
        "slot_layout", "divergence",
        f"Slot layout differs: ours {describe_layout(a)}; ref {describe_layout(b)}. A block proposes "
        f"{count_o} tokens in ours vs {count_r} in ref, every slot proposes a different position, and each was "
        "trained toward different target positions.", a, b, pitfall=SLOT_LAYOUT_ENTRY, key=name))]


def trained_layout_findings(side: Side, name: str) -> list[Finding]:
    """A drafter whose own recipe says training applied the other slot layout than it is served with."""
    field_name = "sample_from_anchor"
    recipe = side.recipe
    if recipe is None or field_name in side.recipe_unknown or not side.is_known(field_name):
        return []
    layout, trained = side.value(field_name), recipe.sample_from_anchor
    if layout == trained:
        return []
    return [Finding("slot_layout", "divergence",
                    f"{name} is served with the slot layout {describe_layout(layout)}, but its recipe says training "
                    f"applied {describe_layout(trained)}: its slots propose positions they were not trained for.",
                    {"spec": layout, "recipe": trained} if name == "ours" else None,
                    {"spec": layout, "recipe": trained} if name == "ref" else None,
                    pitfall=SLOT_LAYOUT_ENTRY, key=f"trained layout ({name})")]


def window_direction_findings(ours: Side, ref: Side) -> list[Finding]:
    """Bidirectional vs causal sliding blocks: a difference only where both have sliding layers."""
    name = "sliding_window_non_causal"
    if not all(side.is_known(name) and side.is_known("layer_types") and "sliding_attention" in side.value("layer_types")
               for side in (ours, ref)):
        return []
    a, b = ours.value(name), ref.value(name)
    if a == b:
        return []
    describe = {True: "see their whole block", False: "see only earlier block slots"}
    return [default_aware(ours, ref, name, Finding(
        "window_direction", "divergence",
        f"Sliding layers {describe[a]} in ours but {describe[b]} in ref (sliding_window_non_causal {a} vs {b}): "
        "every drafted slot after the first attends to a different part of its block.", a, b, pitfall=25,
        key=name))]


def spec_rows(ours: Side, ref: Side) -> list[SpecRow]:
    rows = [SpecRow("format", ours.format, ref.format, ours.format, ref.format),
            SpecRow("layer-id convention", ours.layer_id_convention, ref.layer_id_convention, "zlab", "zlab")]
    for name in SPEC_FIELDS:
        a, b = (side.value(name) if side.is_known(name) else "unknown" for side in (ours, ref))
        a, b = (list(v) if isinstance(v, tuple) else v for v in (a, b))
        raw_a, raw_b = a, b
        if name == "target_layer_ids":  # as stored, in the format's own convention
            raw_a, raw_b = (side.raw_layer_ids if side.raw_layer_ids is not None else "unknown" for side in (ours, ref))
        rows.append(SpecRow(name, raw_a, raw_b, a, b, ours.provenance.get(name, {}), ref.provenance.get(name, {})))
    fc = [side.fc_in_features if side.fc_in_features is not None else "unknown" for side in (ours, ref)]
    rows.append(SpecRow("fc_in_features", fc[0], fc[1], fc[0], fc[1],
                        {"source": "inferred", "detail": "target layers x hidden size"},
                        {"source": "inferred", "detail": "target layers x hidden size"}))
    return rows


@lru_cache(maxsize=8)  # asked per side by the contradiction check and the tensor table: built once
def expected_shapes(spec: DraftSpec | None) -> dict[str, tuple[int, ...]]:
    """Draft-body tensor shapes a spec implies (`impl.body_shapes`: no model built); {} if unknown.
    Callers only read the result."""
    return {} if spec is None else body_shapes(spec)
