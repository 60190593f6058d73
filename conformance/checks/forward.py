"""The draft forward in the inference layout with identical weights (all three implementations).

One check, reported under the one catalogue entry whose property a case adds to the plain forward
(#10: full attention, the context from position 0): #12 a later position, #11 sliding layers, #25
bidirectional sliding blocks, #22 DFlash2's convolutions, #35 a scaled or partial rotary. A case first
runs without its property; when the two implementations already differ there, the root cause belongs
to that simpler check, which reports it, and this one is n/a: one root cause, one failing entry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from conformance.comparator import Comparator, tensor_difference
from conformance.tolerances import for_drafter
from conformance.world import reference_state_dict, target_for
from impl.anchors import anchor_blocks
from impl.interface import Unsupported
from impl.spec import DFLASH2_FIELDS, DraftSpec


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
    block = anchor_blocks(torch.randint(0, spec.target_vocab_size, (1,), generator=gen), spec.block_size, spec.mask_token_id)
    noise = torch.nn.functional.embedding(block, target.get_input_embeddings().weight.detach())
    features = torch.randn(1, case.context_len, len(spec.target_layer_ids) * spec.hidden_size, generator=gen)
    positions = case.position_offset + torch.arange(case.context_len + spec.block_size)[None]
    return target, noise, features, positions


def without_property(case: ForwardCase, pitfall: int | None) -> tuple[ForwardCase, int] | None:
    """The case without what entry `pitfall` adds, and the entry that checks that simpler case."""
    spec = case.spec
    if pitfall == 22:
        simpler = replace(case, spec=spec.replace(**dict.fromkeys(DFLASH2_FIELDS)))
    elif pitfall == 25:
        simpler = replace(case, spec=spec.replace(sliding_window_non_causal=False))
    elif pitfall == 11:
        simpler = replace(case, spec=spec.replace(layer_types=("full_attention",) * spec.num_hidden_layers,
                                             sliding_window=None, sliding_window_non_causal=False))
    elif pitfall == 35:
        simpler = replace(case, spec=spec.replace(rope_scaling=None, partial_rotary_factor=1.0))
    elif pitfall == 12:
        simpler = replace(case, position_offset=0)
    else:
        return None
    return simpler, entry_of(simpler)


def entry_of(case: ForwardCase) -> int:
    """The catalogue entry of the most specific property a forward case has."""
    spec = case.spec
    if spec.family == "dflash2":
        return 22
    if "sliding_attention" in spec.layer_types:
        return 25 if spec.sliding_window_non_causal else 11
    if spec.rope_scaling is not None or spec.partial_rotary_factor != 1.0:
        return 35
    return 12 if case.position_offset else 10


def run_forward(impl, case: ForwardCase) -> torch.Tensor:
    target, noise, features, positions = inputs(case)
    drafter = impl.build_drafter(case.spec, reference_state_dict(case.spec, case.seed), target).to(case.dtype)
    with torch.no_grad():
        return impl.draft_forward(drafter, noise.to(case.dtype), features.to(case.dtype), positions)


def outcome(impl, case: ForwardCase) -> tuple[torch.Tensor | None, Exception | None]:
    try:
        return run_forward(impl, case), None
    except Exception as error:  # noqa: BLE001 -- raising where the other computes is itself a difference
        return None, error


def differs(results, case: ForwardCase) -> bool:
    """Whether two outcomes of `case` differ (a case one side cannot express: no)."""
    (out_a, error_a), (out_b, error_b) = results
    if isinstance(error_a, Unsupported) or isinstance(error_b, Unsupported):
        return False
    return bool(error_a or error_b) or tensor_difference(out_a, out_b, for_drafter(case.spec, case.dtype)) is not None


def draft_forward(cmp: Comparator, a, b, case: ForwardCase) -> None:
    results = outcome(a, case), outcome(b, case)
    if differs(results, case):
        # Only now the simpler cases run (a passing suite pays nothing for them): down the chain to the
        # simplest one that still differs, whose own check reports the root cause.
        owner, simpler = cmp.pitfall, without_property(case, cmp.pitfall)
        while simpler is not None and differs((outcome(a, simpler[0]), outcome(b, simpler[0])), simpler[0]):
            owner = simpler[1]
            simpler = without_property(*simpler)
        if owner != cmp.pitfall:
            cmp.not_applicable((a.name, b.name), f"the draft forward already differs without this entry's property: "
                                                 f"the root cause is reported under #{owner}")
            return
    (out_a, error_a), (out_b, error_b) = results
    cmp.compare((a.name, b.name), (lambda: _raise(error_a)) if error_a else out_a,
                (lambda: _raise(error_b)) if error_b else out_b, for_drafter(case.spec, case.dtype),
                what=f"draft hidden states, {case.context_len} context tokens from position {case.position_offset}, "
                     f"layers {list(case.spec.layer_types)}, window {case.spec.sliding_window}")


def _raise(error: Exception):
    raise error
