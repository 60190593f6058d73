"""DSpark and XPress drafters written by speculators' own `save_pretrained`, for the family tests.

Each is the world's trained DFlash drafter as its backbone (random drafters accept nothing, τ = 1) under
speculators' `DSparkDraftModel` / `XPressDraftModel`, its heads drawn from a seed at a scale where they do
change proposals, written by the class's own `save_pretrained` beside the world's target as its verifier.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from drafter_files.checkpoint import load_checkpoint

DSPARK = dict(markov_rank=16, markov_head_type="vanilla", enable_confidence_head=True,
              confidence_head_with_markov=True)
XPRESS = dict(xpress_rank=16, xpress_mlp_ratio=2, num_jacobi_passes=3)
NO_FAMILY = dict.fromkeys([*DSPARK, *XPRESS])


def family_spec(base, family: str, **overrides):
    """`base` as a drafter of `family`, all layers full attention (speculators' training masks and the inference
    loops then see the same keys; the sliding-window rules are #11's and #25's, held elsewhere)."""
    own = DSPARK if family == "dspark" else XPRESS if family == "xpress" else {}
    full = dict(layer_types=("full_attention",) * base.num_hidden_layers, sliding_window=None)
    return dataclasses.replace(base, **{**NO_FAMILY, **full, **own, **overrides})


def write_speculators_drafter(path: Path, spec, body: dict[str, torch.Tensor], verifier: Path, seed: int = 0) -> Path:
    """`spec`'s drafter under speculators' own class: `body`'s tensors, heads from `seed`, its own save_pretrained."""
    from reference_adapters import speculators_adapter as adapter

    torch.manual_seed(seed)
    model = adapter.MODEL_CLASSES[spec.family](adapter.speculators_config(spec, verifier))
    state = model.state_dict()
    with torch.no_grad():
        for key, tensor in state.items():
            if key in body:
                tensor.copy_(body[key])
            elif key.startswith(("markov_head.", "confidence_head.", "refiner_head.")):
                tensor.copy_(torch.randn_like(tensor) * (0.5 if "w1" in key or "embed" in key else 0.1))
    model.load_verifier_weights()
    adapter.save_speculators_model(model, path)
    return path


def world_backbone(world):
    from dflash_world.drafter import cached_test_drafter

    ckpt = load_checkpoint(cached_test_drafter(world))
    return ckpt.spec, ckpt.state_dict


def without_final_layer(spec, body: dict[str, torch.Tensor]):
    """The spec and body reading every target layer but the verifier's final one (speculators' trainer never feeds
    it to fc, so only such a drafter converts to and from its format exactly)."""
    keep = [k for k, i in enumerate(spec.target_layer_ids) if i != spec.num_target_layers - 1]
    h = spec.hidden_size
    columns = torch.cat([torch.arange(k * h, (k + 1) * h) for k in keep])
    return (dataclasses.replace(spec, target_layer_ids=tuple(spec.target_layer_ids[k] for k in keep)),
            {**body, "fc.weight": body["fc.weight"][:, columns].contiguous()})
