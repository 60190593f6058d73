"""SpecForge 0.2.0's own DFlash training step, unmodified, on a tiny target.

Set up as its trainer sets up a DFlash run (specforge/algorithms/model_providers.py `_build_dflash_family_model`):
its `DFlashDraftModel`, the target's embedding and head loaded apart by its `TargetEmbeddingsAndHead`, its
`OnlineDFlashModel` with `TrainingConfig`'s defaults (loss_type dflash, no decay gamma, 512 anchors, objective
chunks of 128 blocks), driven through its `DFlashTrainStrategy.forward_loss`, then backward and an optimizer step.
Its trainer takes the target's states from SGLang's capture; here the target runs in this process and SpecForge's
own `extract_context_feature` picks fc's layers from them, as its `spec_generate` does. The one CPU setting is the
project's (held/specforge.py): `attention_backend="eager"` for the drafter and the mask builder. No line of the
trace's: the step is the first backward, closed by the optimizer's step.
"""

import argparse

import torch
from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
from specforge.config.schema import TrainingConfig
from specforge.modeling.draft.dflash import DFlashDraftModel, extract_context_feature
from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead
from specforge.runtime.contracts import TrainBatch
from specforge.training.strategies.base import DFlashTrainStrategy
from transformers import AutoModelForCausalLM, Qwen3Config


p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--seq-len", type=int, default=48)
args = p.parse_args()
torch.manual_seed(0)
target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
c = target.config
defaults = {name: field.default for name, field in TrainingConfig.model_fields.items()}
draft_config = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_hidden_layers=5, num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                           max_position_embeddings=c.max_position_embeddings)
draft_config.num_target_layers = c.num_hidden_layers
draft_config.block_size = 4
draft_config.dflash_config = {"mask_token_id": c.vocab_size - 1}
draft_config._attn_implementation = "eager"
drafter = DFlashDraftModel(draft_config)
parts = TargetEmbeddingsAndHead.from_pretrained(args.target, device="cpu", dtype=torch.float32)
model = OnlineDFlashModel(draft_model=drafter, target_lm_head=parts.lm_head, target_embed_tokens=parts.embed_tokens,
                          mask_token_id=c.vocab_size - 1, block_size=drafter.block_size, attention_backend="eager",
                          num_anchors=defaults["num_anchors"], loss_decay_gamma=defaults["loss_decay_gamma"],
                          objective_chunk_blocks=defaults["objective_chunk_blocks"], loss_type=defaults["loss_type"],
                          dpace_alpha=defaults["dpace_alpha"])
strategy = DFlashTrainStrategy(model)
optim = torch.optim.AdamW([q for q in strategy.trainable_module().parameters() if q.requires_grad], lr=1e-3)
for step in range(2):
    ids = torch.randint(1, c.vocab_size - 1, (1, args.seq_len))
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
    batch = TrainBatch(sample_ids=[str(step)], strategy="dflash", tensors={
        "input_ids": ids, "hidden_states": extract_context_feature(states, drafter.target_layer_ids),
        "loss_mask": torch.ones_like(ids, dtype=torch.float32)})
    out = strategy.forward_loss(batch)
    optim.zero_grad()
    out.loss.backward()
    optim.step()
