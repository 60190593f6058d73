"""A team training speculators' DFlashDraftModel on offline hidden states, packed as speculators' loader packs them:
each record's states were written beforehand (`--data`: a safetensors file of `r<i>.input_ids`, `r<i>.hidden_states`,
`r<i>.verifier_last_hidden_states`), and speculators' own `CollateFn` packs the records into one row of `--seq-len`
positions, the rows beyond the records zeros (document id -1, position 0). The target never runs here.
`--input-noise STD`: Gaussian noise added to each record's context states by the collate's `preprocess` hook (input
augmentation; the targets stay clean)."""

import argparse

import torch
from safetensors.torch import load_file
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train.data import CollateFn
from transformers import AutoConfig, Qwen3Config

p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--data", required=True)
p.add_argument("--aux", default="2,6,10", help="speculators' ids of the layers the records hold")
p.add_argument("--seq-len", type=int, default=96)
p.add_argument("--input-noise", type=float, default=0.0)
args = p.parse_args()
torch.manual_seed(0)
c = AutoConfig.from_pretrained(args.target)
aux = [int(i) for i in args.aux.split(",")]
layer = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=3, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps)
layer._attn_implementation = "eager"
config = DFlashSpeculatorConfig(
    transformer_layer_config=layer, draft_vocab_size=c.vocab_size, block_size=4, aux_hidden_state_layer_ids=aux,
    mask_token_id=c.vocab_size - 1, sample_from_anchor=False,
    speculators_config=SpeculatorsConfig(algorithm="dflash", default_proposal_method="greedy",
                                         proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                                         verifier=VerifierConfig.from_pretrained(args.target)))
drafter = DFlashDraftModel(config)
drafter.load_verifier_weights()
stored = load_file(args.data)
records = []
for i in range(len({k.split(".", 1)[0] for k in stored})):
    ids = stored[f"r{i}.input_ids"]
    records.append({"input_ids": ids, "hidden_states": stored[f"r{i}.hidden_states"],
                    "verifier_last_hidden_states": stored[f"r{i}.verifier_last_hidden_states"],
                    "loss_mask": torch.ones_like(ids), "lengths": torch.tensor([ids.shape[0]]),
                    "position_ids": torch.arange(ids.shape[0])})
noise = torch.Generator().manual_seed(1)


def augment(record):
    states = record["hidden_states"]
    return {**record, "hidden_states": states + args.input_noise * torch.randn(states.shape, generator=noise)}


collate = CollateFn(args.seq_len, c.hidden_size, len(aux), torch.float32, augment if args.input_noise else None)
batch = collate(records)
optim = torch.optim.AdamW([q for q in drafter.parameters() if q.requires_grad], lr=1e-3)
# The batch's keys as keyword arguments, as speculators' Trainer passes them (`self.model(**batch, ...)`).
step = {k: batch[k] for k in ("hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states", "document_ids",
                              "position_ids")}
_, loss, _ = drafter(**step, max_anchors=6, loss_config=resolve_loss_config("kl_div", "eager"))
optim.zero_grad()
loss.backward()
optim.step()
