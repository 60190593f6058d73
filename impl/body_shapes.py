"""The draft body's tensors and their shapes, as a spec implies them, without building the drafter.

`DFlashDrafter(spec)` on the meta device gives the same table, but building it imports transformers' Qwen3
modelling (seconds), and a static audit or `convert` only needs names and shapes. The model (`impl/model.py`)
stays the one home of the architecture: tests/test_model_checkpoint.py holds this table equal to the meta-built
model's `state_dict()`, keys, order and shapes, for every family and option, so the two cannot drift apart.
A body read from any file is checked against this table (`check_body`) before a drafter is built from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from foundation.errors import CheckpointError
from foundation.param_names import strip_wrapper_prefixes
from impl.spec import DraftSpec

if TYPE_CHECKING:
    from impl.model import DFlashDrafter


def body_shapes(spec: DraftSpec) -> dict[str, tuple[int, ...]]:
    """Each body tensor's shape in the model's `state_dict()` order (a module's own tensors, then its children's)."""
    hidden, head_dim = spec.hidden_size, spec.head_dim
    q_width, kv_width = spec.num_attention_heads * head_dim, spec.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if spec.reduced_vocab:
        shapes["d2t"] = (spec.draft_vocab_size,)  # a buffer of the drafter itself: before its children
    projections = {"q_proj": (q_width, hidden), "k_proj": (kv_width, hidden), "v_proj": (kv_width, hidden),
                   "o_proj": (hidden, q_width)}
    for layer in range(spec.num_hidden_layers):
        at = f"layers.{layer}."
        for name, (out_features, in_features) in projections.items():
            shapes[f"{at}self_attn.{name}.weight"] = (out_features, in_features)
            if spec.attention_bias:
                shapes[f"{at}self_attn.{name}.bias"] = (out_features,)
        shapes[f"{at}self_attn.q_norm.weight"] = shapes[f"{at}self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{at}mlp.gate_proj.weight"] = shapes[f"{at}mlp.up_proj.weight"] = (spec.intermediate_size, hidden)
        shapes[f"{at}mlp.down_proj.weight"] = (hidden, spec.intermediate_size)
        shapes[f"{at}input_layernorm.weight"] = shapes[f"{at}post_attention_layernorm.weight"] = (hidden,)
        if spec.family == "dflash2":
            groups = hidden // spec.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"{at}{conv}.base_kernel"] = (2, spec.conv_kernel_size, hidden)
                shapes[f"{at}{conv}.kernel_projection.weight"] = (2 * spec.conv_kernel_size * groups, hidden)
    shapes["norm.weight"] = (hidden,)
    shapes["fc.weight"] = (hidden, spec.fc_in_features)
    shapes["hidden_norm.weight"] = (hidden,)
    if spec.reduced_vocab:
        shapes["lm_head.weight"] = (spec.draft_vocab_size, hidden)
    if spec.family == "dflash2":
        shapes["candidate_selector.predecessor_codebook"] = (spec.target_vocab_size, spec.selector_rank)
        shapes["candidate_selector.successor_codebook"] = (spec.target_vocab_size, spec.selector_rank)
        shapes["candidate_selector.hidden_projection.weight"] = (spec.selector_rank, hidden)
    shapes.update(head_shapes(spec))
    return shapes


def head_shapes(spec: DraftSpec) -> dict[str, tuple[int, ...]]:
    """DSpark's Markov and confidence heads, XPress's refiner (impl/dspark.py, impl/xpress.py), in module order."""
    hidden, vocab, head = spec.hidden_size, spec.target_vocab_size, spec.head_size
    shapes: dict[str, tuple[int, ...]] = {}
    if spec.has_markov_head:
        rank = spec.markov_rank
        shapes["markov_head.markov_w1.weight"] = (vocab, rank)
        shapes["markov_head.markov_w2.weight"] = (head, rank)
        extra = {"gated": ("gate_proj", rank, hidden + rank), "rnn": ("joint_proj", 3 * rank, 2 * rank + hidden)}
        if spec.markov_head_type in extra:
            name, out_features, in_features = extra[spec.markov_head_type]
            shapes[f"markov_head.{name}.weight"] = (out_features, in_features)
            shapes[f"markov_head.{name}.bias"] = (out_features,)
    if spec.has_confidence_head:
        shapes["confidence_head.proj.weight"] = (1, hidden + (spec.markov_rank if spec.confidence_head_with_markov
                                                              else 0))
        shapes["confidence_head.proj.bias"] = (1,)
    if spec.family == "xpress":
        rank, wide = spec.xpress_rank, spec.xpress_rank * spec.xpress_mlp_ratio
        shapes["refiner_head.mix_l"] = (rank, spec.block_size, spec.block_size)  # a parameter of its own: first
        shapes.update({"refiner_head.token_embed.weight": (vocab, rank), "refiner_head.down_h.weight": (rank, hidden),
                       "refiner_head.down_g.weight": (rank, hidden), "refiner_head.in_proj.weight": (rank, 3 * rank),
                       "refiner_head.mlp_gate.weight": (wide, rank), "refiner_head.mlp_up.weight": (wide, rank),
                       "refiner_head.mlp_down.weight": (rank, wide), "refiner_head.readout.weight": (head, rank)})
    return shapes


def check_body(spec: DraftSpec, state_dict: dict[str, torch.Tensor],
               source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The body without wrapper prefixes, in the spec's parameter order, checked against the shapes the
    spec implies; one-line error naming the first bad tensor."""
    expected = body_shapes(spec)
    state_dict = strip_wrapper_prefixes(state_dict)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    for key, shape in expected.items():
        if tuple(state_dict[key].shape) != shape:
            raise CheckpointError(f"{source}: tensor {key!r} has shape {tuple(state_dict[key].shape)}, "
                                  f"the spec implies {shape}")
    return {key: state_dict[key] for key in expected}


def weights_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype a body's weights are stored in (integer tensors such as a draft vocabulary's `d2t` say nothing)."""
    return next((t.dtype for t in state_dict.values() if t.is_floating_point()), torch.float32)


def build_drafter(spec: DraftSpec, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                  source: str = "checkpoint") -> DFlashDrafter:
    """A drafter with exactly these weights; one-line error naming the first bad tensor."""
    from impl.model import DFlashDrafter  # here, not above: transformers' Qwen3 modelling takes seconds

    state_dict = check_body(spec, state_dict, source)
    model = DFlashDrafter(spec)
    model.load_state_dict(state_dict)
    return model.to(dtype) if dtype is not None else model
