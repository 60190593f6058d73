"""A team training speculators' own DFlashDraftModel: the target's states by hand, the loss from its forward."""

import argparse

import torch
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_audit import trace

p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--seq-len", type=int, default=48)
args = p.parse_args()
torch.manual_seed(0)
target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
c = target.config
layer = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=5, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps)
layer._attn_implementation = "eager"
aux = [2, 4, 6, 8, 10]  # speculators' ids: hidden_states indices (z-lab 1, 3, 5, 7, 9)
config = DFlashSpeculatorConfig(
    transformer_layer_config=layer, draft_vocab_size=c.vocab_size, block_size=4, aux_hidden_state_layer_ids=aux,
    mask_token_id=c.vocab_size - 1, sample_from_anchor=False,
    speculators_config=SpeculatorsConfig(algorithm="dflash", default_proposal_method="greedy",
                                         proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                                         verifier=VerifierConfig.from_pretrained(args.target)))
drafter = DFlashDraftModel(config)
drafter.load_verifier_weights()
optim = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
raw = {}
target.model.norm.register_forward_pre_hook(lambda m, a: raw.update(last=a[0]))
for step in range(2):
    ids = torch.randint(1, c.vocab_size - 1, (1, args.seq_len))
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    _, loss, _ = drafter(torch.cat([hs[i] for i in aux], -1), ids, torch.ones_like(ids), raw["last"],
                         torch.zeros_like(ids), max_anchors=6, loss_config=resolve_loss_config("kl_div", "eager"))
    trace.step(loss)
    optim.zero_grad()
    loss.backward()
    optim.step()
