"""Tiny real models and packed sequences the checks run on (CPU, milliseconds).

Targets are real `transformers` Qwen3 models with random weights (cached per shape);
draft-body weights come from z-lab's own `DFlashDraftModel`, so every implementation
is built from the reference's state dict.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_world.target_training import random_qwen3
from foundation.param_names import codebook_name
from impl.spec import DraftSpec
from drafter_files.zlab_format import zlab_config

VOCAB = 96
TARGET_HEADS, TARGET_KV_HEADS, TARGET_HEAD_DIM = 4, 2, 8


@lru_cache(maxsize=8)
def tiny_target(num_layers: int, hidden: int, seed: int = 0) -> Qwen3ForCausalLM:
    model = random_qwen3(num_layers, hidden, VOCAB, seed, head_dim=TARGET_HEAD_DIM, heads=TARGET_HEADS,
                         kv_heads=TARGET_KV_HEADS)
    # Random init leaves the norms at 1; perturb them so "normalised once" vs twice differs visibly.
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


def target_for(spec: DraftSpec) -> Qwen3ForCausalLM:
    return tiny_target(spec.num_target_layers, spec.hidden_size)


def reference_state_dict(spec: DraftSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Draft-body weights made by z-lab's own model class for `spec` (norm weights perturbed too).

    Names are the on-disk ones (a DFlash2 selector's codebooks without `.weight`, as z-lab's
    `from_pretrained` maps them)."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    if spec.family in ("dspark", "xpress"):
        return family_state_dict(spec, seed)
    torch.manual_seed(seed)
    model_class = DFlash2DraftModel if spec.family == "dflash2" else DFlashDraftModel
    model = model_class(Qwen3Config(**zlab_config(spec)))
    # Keys and shapes are z-lab's; values are redrawn so norms are not all ones and the
    # convolutions are clearly not the identity (tap 0 near 1, later taps and deltas well away from 0).
    return {codebook_name(name): redrawn(name, t) for name, t in model.state_dict().items()}


def family_state_dict(spec: DraftSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """A DSpark or XPress body: the DFlash backbone z-lab's class makes, the heads speculators' own class makes
    (z-lab has neither family), redrawn at a scale where the heads change proposals."""
    import dataclasses

    from impl.spec import FAMILY_FIELDS
    from reference_adapters.speculators_adapter import MODEL_CLASSES, speculators_config

    backbone = reference_state_dict(dataclasses.replace(spec, **dict.fromkeys(FAMILY_FIELDS[spec.family])), seed)
    torch.manual_seed(seed + 1)
    model = MODEL_CLASSES[spec.family](speculators_config(spec))
    heads = {name: redrawn(name, t) for name, t in model.state_dict().items() if name.startswith(
        ("markov_head.", "confidence_head.", "refiner_head."))}
    return {**backbone, **heads}


def redrawn(name: str, t: torch.Tensor) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1 + 0.1 * torch.randn_like(t)
    if name.endswith("base_kernel"):
        identity = torch.zeros_like(t)
        identity[:, 0] = 1.0
        return identity + 0.3 * torch.randn_like(t)
    if name.endswith("kernel_projection.weight"):
        return 0.2 * torch.randn_like(t)
    if name.startswith(("refiner_head.down_h", "refiner_head.down_g")):
        return 0.05 * torch.randn_like(t)  # the block's hidden summary: small beside the previous tokens' part
    if "candidate_selector" in name or name.startswith(("markov_head.", "refiner_head.")):
        return 0.5 * torch.randn_like(t)  # a transition term (a Markov or refiner bias) that can overturn the order
    return 0.05 * torch.randn_like(t)


def packed_sequence(lengths: list[int], padding: int, seed: int = 0):
    """`(input_ids, loss_mask, document_ids)` [1, T] for documents of `lengths` plus `padding` pad slots."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths) + padding
    input_ids = torch.randint(0, VOCAB - 1, (1, total), generator=gen)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((padding,), -1)])
    loss_mask = (document_ids != -1).long()[None]
    return input_ids, loss_mask, document_ids[None].long()
