"""speculators 0.9.0's own `Trainer` training a DFlash drafter on an offline hidden-state dataset in its own layout
(a `datasets` folder of input_ids / loss_mask / seq_len rows, `hidden_states/hs_<i>.safetensors` inside it: what its
data generation writes through vLLM), then saving it with its own `save_pretrained` (speculators' format).

Its code runs unmodified: the drafter is its `DFlashDraftModel`, the loaders its `create_train_val_loaders` (the file
backend, no workers), the step's keyword arguments its `DFlashDraftModel.get_trainer_kwargs` of `TrainConfig`'s
defaults for `--speculator-type dflash` (as speculators/train/cli.py calls it, `--loss-implementation eager`: its fused
losses need Triton), its optimizers and schedule those the resolved `TrainConfig` gives cli.py's `TrainerConfig`
(Muon on the 2-D weights + AdamW, `--lr` for both as an unset `muon_lr` resolves, linear), and `Trainer.train_epoch`
runs every step (autocast, zero_grad, backward, clip at 1.0, its optimizers and schedulers). Two settings make it run on a CPU, both its state, none of its code:

- `Trainer` puts the model and every batch on `local_rank` (speculators/train/trainer.py:348
  `self.model.to(self.local_rank)` and :533 `v.to(self.local_rank, ...)`), which without torchrun is the integer 0,
  CUDA device 0: `speculators.train.distributed._local_rank` (what its `maybe_setup_distributed` sets) is "cpu";
- its step timer calls `torch.accelerator.synchronize()` on every logged step (`global_step % log_freq == 0`), which
  raises without an accelerator: the run starts at global step 1 and logs every `steps + 1` steps (never).

    python examples/speculators_offline_train.py --target DIR --data DIR --save DIR [--steps N] [--aux-layer-ids 1,2,3]
"""

import argparse
from pathlib import Path

import torch
from datasets import load_from_disk
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train import distributed
from speculators.train.config.schema import TrainConfig
from speculators.train.dataloader import create_train_val_loaders
from speculators.train.trainer import Trainer, TrainerConfig
from transformers import AutoConfig, Qwen3Config

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--target", required=True)
p.add_argument("--data", required=True, help="speculators' data folder (hidden_states/ inside)")
p.add_argument("--save", required=True, help="the trained drafter's folder (speculators format)")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--aux-layer-ids", default="1,2,3", help="speculators' ids (z-lab id + 1) fc reads")
p.add_argument("--draft-layers", type=int, default=1)
p.add_argument("--block-size", type=int, default=4)
p.add_argument("--seq-len", type=int, default=512, help="the packed length its loader makes")
p.add_argument("--lr", type=float, default=1e-3)
args = p.parse_args()
torch.manual_seed(0)
c = AutoConfig.from_pretrained(args.target)
aux = [int(i) for i in args.aux_layer_ids.split(",")]
layer = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=args.draft_layers, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                    max_position_embeddings=c.max_position_embeddings, rope_theta=getattr(c, "rope_theta", 1e6))
layer._attn_implementation = "eager"
config = DFlashSpeculatorConfig(
    transformer_layer_config=layer, draft_vocab_size=c.vocab_size, block_size=args.block_size,
    aux_hidden_state_layer_ids=aux, mask_token_id=1, sample_from_anchor=False,
    # No sliding layer, so training is the same either way (its full-attention layers are bidirectional); false, its
    # default, makes vLLM 0.33.0 serve every layer causal (`dflash_config.causal = not sliding_window_non_causal`,
    # vllm/transformers_utils/configs/speculators/algos.py:123-125): serve-check's one divergence (#27) on it.
    sliding_window_non_causal=True,
    speculators_config=SpeculatorsConfig(algorithm="dflash", default_proposal_method="greedy",
                                         proposal_methods=[GreedyTokenProposalConfig(
                                             speculative_tokens=args.block_size - 1)],
                                         verifier=VerifierConfig.from_pretrained(args.target)))
drafter = DFlashDraftModel(config)
drafter.load_verifier_weights()
rows = len(load_from_disk(args.data))
if rows < 2:
    raise SystemExit(f"{args.data}: {rows} row(s); its loaders need a train and a validation split (2 rows at least)")
resolved = {**TrainConfig(speculator_type="dflash", optimizer={"lr": args.lr}).flatten(), "loss_implementation": "eager"}
train_kwargs, val_kwargs = DFlashDraftModel.get_trainer_kwargs(**resolved)
train_loader, val_loader = create_train_val_loaders(
    data_path=args.data, total_seq_len=args.seq_len, hidden_states_dtype=torch.float32,
    vllm_endpoint="http://localhost:8000/v1", on_missing="raise", verifier_name_or_path=args.target,
    request_timeout=None, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
    hidden_size=c.hidden_size, num_target_layers=len(aux), num_workers=0, prefetch_factor=None, preprocess=None,
    train_data_ratio=(rows - 0.5) / rows, seed=0)  # the last row its validation split, the rest trained on
distributed._local_rank = "cpu"
# The run's optimizers and schedule as speculators/train/cli.py passes them to its TrainerConfig, from the resolved
# TrainConfig (Muon + AdamW, linear): TrainerConfig's own defaults are another run (AdamW alone, muon_lr 0.02).
run = {name: resolved[name] for name in ("lr", "optimizer", "weight_decay", "muon_lr", "muon_momentum",
                                         "muon_weight_decay", "muon_ns_steps", "muon_adjust_lr_fn", "scheduler_type",
                                         "scheduler_warmup_steps", "scheduler_warmup_ratio", "scheduler_total_steps",
                                         "scheduler_num_cosine_cycles")}
trainer = Trainer(drafter, TrainerConfig(**run, num_epochs=max(1, args.steps), save_path=str(Path(args.save)
                                                                                             / "checkpoints"),
                                         train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs,
                                         hidden_states_dtype=torch.float32, log_freq=args.steps + 1,
                                         max_steps=args.steps + 1), train_loader, val_loader)
trainer.global_step = 1
epoch = 0
while trainer.global_step < args.steps + 1:  # its epochs, each its own train_epoch, until the steps are done
    trainer.train_epoch(epoch)
    epoch += 1
drafter.save_pretrained(args.save)
print(f"trained {args.steps} steps; saved {args.save}")
