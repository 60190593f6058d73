"""The draft forward in the inference layout with identical weights (all three implementations)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.compare import Comparator
from conformance.tolerances import for_drafter
from conformance.world import reference_state_dict, target_for
from impl.spec import DraftSpec


@dataclass(frozen=True)
class ForwardCase:
    spec: DraftSpec
    context_len: int
    position_offset: int  # positions of the first context token (a later round of decoding)
    dtype: torch.dtype
    seed: int


def inputs(case: ForwardCase):
    spec, gen = case.spec, torch.Generator().manual_seed(case.seed)
    target = target_for(spec)
    # Block = [known token, mask x (B-1)], embedded with the target's own embeddings as every loop does.
    block = torch.full((1, spec.block_size), spec.mask_token_id)
    block[0, 0] = int(torch.randint(0, spec.vocab_size, (1,), generator=gen))
    noise = torch.nn.functional.embedding(block, target.get_input_embeddings().weight.detach())
    features = torch.randn(1, case.context_len, len(spec.target_layer_ids) * spec.hidden_size, generator=gen)
    positions = case.position_offset + torch.arange(case.context_len + spec.block_size)[None]
    return target, noise, features, positions


def draft_forward(cmp: Comparator, a, b, case: ForwardCase) -> None:
    target, noise, features, positions = inputs(case)
    state = reference_state_dict(case.spec, case.seed)

    def forward(impl):
        drafter = impl.build_drafter(case.spec, state, target).to(case.dtype)
        with torch.no_grad():
            return impl.draft_forward(drafter, noise.to(case.dtype), features.to(case.dtype), positions)

    cmp.compare((a.name, b.name), lambda: forward(a), lambda: forward(b), for_drafter(case.spec, case.dtype),
                what=f"draft hidden states, {case.context_len} context tokens from position {case.position_offset}, "
                     f"layers {list(case.spec.layer_types)}, window {case.spec.sliding_window}")
