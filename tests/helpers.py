"""Small shared builders for the harness's own tests (tiny configs, CPU, seconds)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from impl.spec import DraftSpec


def tiny_spec(**overrides) -> DraftSpec:
    fields = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=3, vocab_size=128, target_layer_ids=(1, 3, 4), num_target_layers=6,
                  mask_token_id=127, block_size=8,
                  layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=6)
    fields.update(overrides)
    return DraftSpec(**fields)


def tiny_target(num_layers: int = 6, hidden: int = 64, vocab: int = 128, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).eval()


def zlab_model_for(spec: DraftSpec):
    """z-lab's own DFlashDraftModel (real `dflash` package) for this spec, random weights."""
    from dflash.model import DFlashDraftModel

    from impl.checkpoint import zlab_config

    config = Qwen3Config(**zlab_config(spec))
    config._attn_implementation = "sdpa"
    return DFlashDraftModel(config).eval()
