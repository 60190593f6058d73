"""What a dataset claims to hold: its layer ids, in the convention of the writer that wrote them, as depths.

A depth is where a state sits in the target's stack, in vLLM's own numbering (`SupportsEagle3._maybe_add_hidden_state`,
vllm/model_executor/models/interfaces.py:1601-1611, called by Qwen2Model.forward at
vllm/model_executor/models/qwen2.py:424-435 — Qwen3 runs that forward): depth 0 is the embeddings (captured before
layer 0 with `layer_idx = start_layer`), depth i is `hidden_states + residual` after decoder layer i - 1, and depth N
(N decoder layers) is the last layer's output before the final norm (the norm runs after the loop). transformers'
`hidden_states[i]` is the same tensor for i < N; its `hidden_states[N]` is after the final norm, which no vLLM id is.

- vLLM and speculators files: ids are depths. speculators' data generation asks vLLM for the drafter's
  `target_layer_ids` (speculators' own convention, z-lab id + 1) and the last layer appended
  (speculators/train/config/schema.py:115-121, "excluding the final layer launch_vllm.py appends"); its loader feeds fc
  `hidden_states[:, :-1]` and keeps `hidden_states[:, -1]` as `verifier_last_hidden_states`, the targets' source
  (speculators/train/data.py:325-331).
- SpecForge records (written through SGLang's capture): ids are z-lab's, the decoder layer whose output is kept;
  SGLang captures "before layer k + 1" (sglang/srt/models/qwen3.py:803-805), so id k is depth k + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from foundation.errors import AuditError
from impl.layers import hidden_state_index, layer_at_index

CONVENTIONS = {
    "vllm": "vLLM's (id i: the output after decoder layer i - 1; 0 the embeddings; N the last layer before the final "
            "norm)",
    "speculators": "vLLM's, as speculators' data generation asks vLLM for them (the last layer appended)",
    "specforge": "z-lab's, as SGLang captures for SpecForge (id k: the output of decoder layer k)",
}


def depth_of(layout: str, layer_id: int) -> int:
    return hidden_state_index(layer_id) if layout == "specforge" else layer_id


def id_of(layout: str, depth: int) -> int:
    return layer_at_index(depth) if layout == "specforge" else depth


@dataclass
class Claim:
    layout: str  # the writer, whose convention `ids` are in
    depths: list[int] | None  # per stored slot, in stored order; None: the dataset's claim is unknown
    source: str  # where the claim came from, in words
    ids: list[int] | None = None  # as given, in the writer's convention
    fc_slots: int | None = None  # how many leading slots feed fc (the rest: the targets' source), when known


def claim_from_ids(layout: str, ids: list[int], layers: int) -> Claim:
    for layer_id in ids:
        depth = depth_of(layout, layer_id)
        if not 0 <= depth <= layers:
            top = id_of(layout, layers)
            raise AuditError(f"--layer-ids {layer_id}: outside the target's {layers} layers (in "
                             f"{CONVENTIONS[layout].split(' (')[0]} convention ids run {id_of(layout, 0)}..{top})")
    return Claim(layout, [depth_of(layout, i) for i in ids], f"--layer-ids, in {CONVENTIONS[layout]} convention", list(ids))


def claim_from_drafter(layout: str, zlab_ids: list[int], layers: int, drafter: str) -> Claim:
    """The slots a drafter's trainer reads: speculators' loader expects its fc layers then the last layer; SpecForge's
    DFlash records hold the fc layers only."""
    fc = [hidden_state_index(z) for z in zlab_ids]
    depths = fc if layout == "specforge" or fc[-1] == layers else [*fc, layers]
    what = ("its fc layers" if layout == "specforge" else
            "its fc layers, then the last layer before the final norm (speculators' loader, train/data.py:325-331)")
    return Claim(layout, depths, f"--drafter {drafter} (z-lab ids {list(zlab_ids)}): {what}",
                 [id_of(layout, d) for d in depths], len(fc))


def unknown_claim(layout: str) -> Claim:
    return Claim(layout, None, "nothing (no --layer-ids or --drafter)")
