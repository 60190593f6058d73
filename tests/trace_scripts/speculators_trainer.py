"""speculators 0.9.0's own `Trainer` running one DFlash training step, unmodified, on offline data it reads.

The data is written in the layout its `ArrowDataset` reads (`speculators/train/data.py`): a `datasets` folder of
input_ids / loss_mask / seq_len rows and, beside it, `hidden_states/hs_<i>.safetensors` holding the target's states at
speculators' aux layers plus the final layer's raw output, with the token ids (what its vLLM capture writes; here the
target runs in this process to make them, once per row). Its loaders come from `create_train_val_loaders` (the file
backend, no workers), the drafter and its step's keyword arguments as `speculators train` resolves them
(`TrainConfig` defaults through `DFlashDraftModel.get_trainer_kwargs`, as speculators/train/cli.py calls it), and
`Trainer.train_epoch` runs the step: forward under autocast, zero_grad, backward, clip, optimizer and scheduler step.

Two settings for a CPU run, both of its state, none of its code: its `Trainer` places the model and every batch on
device `local_rank` (`self.model.to(self.local_rank)`, `v.to(self.local_rank)`), which without torchrun is the
integer 0, a CUDA device, so `speculators.train.distributed._local_rank` (what its `maybe_setup_distributed` sets)
is "cpu"; and its step timer calls `torch.accelerator.synchronize()` on every logged step (global_step % log_freq
== 0), which raises with no accelerator, so the step runs as global step 1 of a run logging every 2 steps.
No line of the trace's: the step is the first backward, closed by the optimizer's step.
"""

import argparse
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train import distributed
from speculators.train.config.schema import TrainConfig
from speculators.train.dataloader import create_train_val_loaders
from speculators.train.trainer import Trainer, TrainerConfig
from transformers import AutoModelForCausalLM, Qwen3Config


p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--seq-len", type=int, default=48)
p.add_argument("--work", required=True, help="an empty folder for the offline data and checkpoints")
args = p.parse_args()
torch.manual_seed(0)
target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
c = target.config
aux = [2, 4, 6, 8, 10]  # speculators' ids: hidden_states indices (z-lab 1, 3, 5, 7, 9)
work = Path(args.work)
(work / "hidden_states").mkdir(parents=True)
raw = {}
target.model.norm.register_forward_pre_hook(lambda m, a: raw.update(last=a[0]))
ids = torch.randint(1, c.vocab_size - 1, (args.seq_len,))
rows = 2  # the train split and the validation split its loaders require (the same row: one target forward each)
for i in range(rows):
    with torch.no_grad():
        hs = target(input_ids=ids[None], output_hidden_states=True).hidden_states
    states = torch.stack([hs[k][0] for k in aux] + [raw["last"][0]], dim=1)  # [seq, aux + 1, hidden]
    save_file({"hidden_states": states.contiguous(), "token_ids": ids.clone()},
              work / "hidden_states" / f"hs_{i}.safetensors")
data = Dataset.from_dict({"input_ids": [ids.tolist()] * rows, "loss_mask": [[1] * args.seq_len] * rows,
                          "seq_len": [args.seq_len] * rows})
data.set_format("torch")
data.save_to_disk(str(work / "data"))
(work / "data" / "hidden_states").symlink_to(work / "hidden_states")

layer = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=5, num_attention_heads=c.num_attention_heads,
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
# `speculators train --speculator-type dflash --loss-implementation eager`: its fused losses need Triton (a GPU); the
# eager ones are its own CPU path ("use --loss-implementation eager", its error says).
resolved = {**TrainConfig(speculator_type="dflash").flatten(), "loss_implementation": "eager"}
train_kwargs, val_kwargs = DFlashDraftModel.get_trainer_kwargs(**resolved)
train_loader, val_loader = create_train_val_loaders(
    data_path=str(work / "data"), total_seq_len=args.seq_len, hidden_states_dtype=torch.float32,
    vllm_endpoint="http://localhost:8000/v1", on_missing="raise", verifier_name_or_path=args.target,
    request_timeout=None, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
    hidden_size=c.hidden_size, num_target_layers=len(aux), num_workers=0, prefetch_factor=None, preprocess=None,
    train_data_ratio=0.5, seed=0)
distributed._local_rank = "cpu"
trainer = Trainer(drafter, TrainerConfig(lr=1e-3, num_epochs=1, save_path=str(work / "checkpoints"),
                                         train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs,
                                         hidden_states_dtype=torch.float32, log_freq=2,
                                         max_steps=2), train_loader, val_loader)
trainer.global_step = 1
trainer.train_epoch(0)
