"""#35 rotary: a drafter's rotary embedding applied to a tensor, held to the references' own and to
transformers' partial-rotary implementation.

The references rotate the whole head (z-lab's and speculators' `apply_rotary_pos_emb` over transformers'
`Qwen3RotaryEmbedding`): their adapters raise `Unsupported` for a partial factor, so those cases are n/a
there, as is the interleaved (GPT-J) style, which neither has. Partial rotary is held to transformers' own
partial-rotary model, Qwen3-Next (`Qwen3NextRotaryEmbedding`: frequencies of the rotated dims only; its
`apply_rotary_pos_emb`: the first dims rotated, the rest passed); the interleaved style to transformers' GPT-J
rotary on the same frequencies.
"""

from __future__ import annotations

import torch

from conformance.comparator import Comparator
from conformance.strategies import RotaryCase
from conformance.tolerances import for_dtype
from conformance.world import reference_state_dict
from impl.interface import Unsupported


def inputs(case: RotaryCase) -> tuple[torch.Tensor, torch.Tensor]:
    spec, gen = case.spec, torch.Generator().manual_seed(case.seed)
    x = torch.randn(1, spec.num_key_value_heads, case.length, spec.head_dim, generator=gen)
    return x, case.position_offset + torch.arange(case.length)[None]


def run(impl, case: RotaryCase) -> torch.Tensor:
    if not hasattr(impl, "apply_rotary"):  # an optional operation: n/a, not a failure
        raise Unsupported(f"{impl.name}: no rotary operation of its own to run alone")
    drafter = impl.build_drafter(case.spec, reference_state_dict(case.spec, case.seed))
    return impl.apply_rotary(drafter, *inputs(case))


def transformers_rotary(case: RotaryCase) -> torch.Tensor:
    """transformers' partial-rotary path (Qwen3-Next) with the spec's rope parameters."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    spec = case.spec
    # Qwen3NextConfig's own default factor is 0.25: the spec's is always stated.
    config = Qwen3NextConfig(hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                             num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
                             max_position_embeddings=spec.max_position_embeddings,
                             rope_parameters={**spec.rope_parameters(),
                                              "partial_rotary_factor": spec.partial_rotary_factor})
    x, positions = inputs(case)
    cos, sin = Qwen3NextRotaryEmbedding(config)(x, positions)
    if spec.rope_style == "gptj":
        return gptj_rotary(x, cos, sin)
    return apply_rotary_pos_emb(x, x, cos, sin)[1]


def gptj_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' GPT-J rotary (`apply_rotary_pos_emb`: pairs (2i, 2i + 1), one frequency each, on the first
    `rotary_dim` dims as `GPTJAttention` splits them) with the frequencies of `cos`/`sin` (neox layout, two halves)."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb

    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    heads_last = x.transpose(1, 2)  # GPT-J's layout: [b, n, heads, d]
    rotated = apply_rotary_pos_emb(heads_last[..., :rotary_dim], sin[..., :half], cos[..., :half])
    return torch.cat([rotated, heads_last[..., rotary_dim:]], dim=-1).transpose(1, 2)


def describe(case: RotaryCase) -> str:
    spec = case.spec
    return (f"{case.length} positions from {case.position_offset}, theta {spec.rope_theta:g}, scaling "
            f"{spec.rope_scaling}, partial_rotary_factor {spec.partial_rotary_factor}, head_dim {spec.head_dim}")


def rotary(cmp: Comparator, a, b, case: RotaryCase) -> None:
    """Two implementations' rotary on the same spec, positions and tensor."""
    cmp.compare((a.name, b.name), lambda: run(a, case), lambda: run(b, case), for_dtype(torch.float32),
                what=describe(case))


def against_transformers(cmp: Comparator, impl, case: RotaryCase) -> None:
    cmp.compare((impl.name, "transformers"), lambda: run(impl, case), lambda: transformers_rotary(case),
                for_dtype(torch.float32), what=describe(case))
