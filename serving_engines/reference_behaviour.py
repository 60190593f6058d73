"""What the reference does with a drafter-config key that it never reads, and what a different value does to the
drafts: the knowledge the AST table (`config_reads.py`) cannot read off the code.

- `FIXED`: a key an engine reads whose meaning z-lab's DFlashDraftModel (dflash 0.1.0) hard-codes: the value it
  behaves as, in words, at the line of dflash/model.py that fixes it (looked up by its needle, never written here).
- `effect(key, served, reference, config)`: what running the engine's value where the reference runs its own does
  to the drafts, as one of `EFFECTS`: greedy drafts change (a divergence), only sampled drafts change (the argmax is
  kept: a scale > 0 of the logits, a soft cap), the engine refuses the weights, nothing, or not known to the tool.
- `reference_tensor_names(config)`: the tensors z-lab's own class builds for a folder's config (on the meta device),
  so a tensor of the folder that it never loads, or one it needs that the folder lacks, is named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serving_engines.source_exec import cite

REFERENCE_MODULE = "dflash.model"
REFERENCE = "z-lab's DFlashDraftModel (dflash 0.1.0)"
# What each effect is as a serving finding's severity.
EFFECTS = {"greedy": "divergence", "loads": "divergence", "sampled": "warning", "unknown": "warning", "none": "info"}


@dataclass(frozen=True)
class Fixed:
    value: Any  # what the reference behaves as (the engine's neutral value for the same key)
    what: str
    needle: str  # on the line of dflash/model.py that fixes it

    @property
    def source(self) -> str:
        return cite(REFERENCE_MODULE, self.needle)


NEOX = Fixed(True, "rotates neox style only (rotate_half)", "k_embed = (k * cos) + (rotate_half(k) * sin)")
NO_SINK = Fixed(False, "has no attention sink: its attention is plain softmax attention",
                'attn_output, attn_weights = ALL_ATTENTION_FUNCTIONS["sdpa"](')
FIXED = {
    "is_neox_style": NEOX, "rope_is_neox_style": NEOX,
    "logit_scale": Fixed(1.0, "scales its draft logits by output_multiplier only",
                         'logits = logits * float(_draft_value(self.config, "output_multiplier", 1.0))'),
    "use_aux_hidden_state": Fixed(True, "always projects the target's hidden states through fc",
                                  "self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size"),
    "target_hidden_size": Fixed(None, "sizes fc by the drafter's own hidden_size (len(target_layer_ids) x hidden_size)",
                                "self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size"),
    "has_own_lm_head": Fixed(False, "drafts through the target's output head, never one of the drafter's",
                             'head = getattr(target, "lm_head", None)'),
    "attention_value_scale": Fixed(None, "scales no attention values", 'attn_output, attn_weights = '
                                                                       'ALL_ATTENTION_FUNCTIONS["sdpa"]('),
    "attention_sink_bias": NO_SINK, "add_swa_attention_sink_bias": NO_SINK,
    "use_gemma_norm": Fixed(False, "normalizes with Qwen3RMSNorm (x w), not Gemma's (x (1 + w))",
                            "self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)"),
}
# Keys the reference reads that change nothing an engine drafts (training-only settings).
NO_DRAFT_EFFECT = {"attention_dropout": "attention dropout (training only)"}


@dataclass(frozen=True)
class Effect:
    kind: str  # greedy | sampled | loads | none | unknown
    words: str

    @property
    def severity(self) -> str:
        return EFFECTS[self.kind]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def logit_multiplier(served: Any, reference: Any) -> Effect:
    """The engine multiplies the draft logits z by `served` where the reference multiplies them by `reference`: a
    positive ratio of the two keeps the argmax."""
    a, b = _number(served if served is not None else 1.0), _number(reference if reference is not None else 1.0)
    if a is None or b is None or b == 0:
        return Effect("unknown", f"a logit multiplier of {served!r} where the reference applies {reference!r}")
    if a / b > 0:
        return Effect("sampled", f"the engine's draft logits are z x {a:g} where the reference's are z x {b:g}; a "
                                 f"positive factor keeps the argmax, so greedy drafts are unchanged; sampled drafts "
                                 f"change (the engine samples softmax(z x {a:g} / T) where the reference samples "
                                 f"softmax(z x {b:g} / T): its temperature T acts as T x {b / a:.4g})")
    return Effect("greedy", f"the engine's draft logits are z x {a:g} where the reference's are z x {b:g}: the "
                            "factor between them is <= 0 and turns the order of the logits around (or flattens it), "
                            "so greedy drafts change")


def soft_cap(served: Any, reference: Any) -> Effect:
    def describe(cap: Any) -> str:
        return f"a tanh soft cap of {cap}" if (_number(cap) or 0) > 0 else "no soft cap"

    return Effect("sampled", f"the engine applies {describe(served)} where the reference applies {describe(reference)} "
                             "to the draft logits: tanh keeps their order, so greedy drafts are unchanged; sampled "
                             "drafts change")


def _changes(served: Any, reference: Any, what: str) -> Effect:
    return Effect("greedy", f"{what}: the draft logits change, so greedy drafts change")


def effect(key: str, served: Any, reference: Any, config: dict[str, Any]) -> Effect:
    """What the engine running `served` for `key` where the reference runs `reference` does to the drafts."""
    if key in ("logit_scale", "output_multiplier"):
        return logit_multiplier(served, reference)
    if key == "final_logit_softcapping":
        return soft_cap(served, reference)
    if key == "input_embedding_scale":
        return _changes(served, reference, f"the noise embeddings are scaled by {served!r} where the reference "
                                           f"scales them by {reference!r}")
    if key in ("is_neox_style", "rope_is_neox_style"):
        return _changes(served, reference, "interleaved (GPT-J style) rotary where the reference rotates neox style"
                        if not served else "neox rotary where the reference rotates interleaved")
    if key == "attention_value_scale":
        return Effect("none", "a value scale of 1 changes nothing") if _number(served) == 1.0 else \
            _changes(served, reference, f"every draft layer's attention values are scaled by {served!r}")
    if key in ("attention_sink_bias", "add_swa_attention_sink_bias"):
        return _changes(served, reference, "every draft layer's attention gets a learned sink logit (its tensor from "
                                           "the folder, or its initial value when the folder has none)")
    if key == "use_aux_hidden_state":
        return _changes(served, reference, "the target's hidden states reach the draft layers without fc")
    if key == "use_gemma_norm":
        return _changes(served, reference, "Gemma's RMSNorm (x (1 + w)) in every draft norm")
    if key == "has_own_lm_head":
        return _changes(served, reference, "the drafter's own lm_head (from the folder; uninitialized when the folder "
                                           "has none) instead of the target's")
    if key == "target_hidden_size":
        hidden = config.get("hidden_size")
        if served in (None, hidden):
            return Effect("none", f"target_hidden_size {served!r} sizes fc as the reference does")
        return Effect("loads", f"fc is sized for target_hidden_size {served!r} x the target layers where the folder's "
                               f"fc.weight reads hidden_size {hidden!r} x the target layers: the engine refuses the "
                               "weights (a shape mismatch)")
    return Effect("unknown", "what this value does to the drafts is not modelled by this tool")


def reference_tensor_names(config: dict[str, Any]) -> set[str]:
    """The parameter names z-lab's own class builds for a z-lab config (DFlash2's codebooks under both spellings its
    `from_pretrained` maps), built on the meta device: no memory, no weights."""
    import torch
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from transformers import Qwen3Config

    from foundation.param_names import codebook_name
    from impl.families import config_family

    family = config_family(config)
    model_class = DFlash2DraftModel if family == "dflash2" else DFlashDraftModel
    with torch.device("meta"):
        model = model_class(Qwen3Config(**{k: v for k, v in config.items() if k != "architectures"}))
    names = set(model.state_dict())
    names |= {codebook_name(name) for name in names}  # a codebook under either of its spellings
    return names
