"""A team's own multi-step DFlash trainer on speculators' DFlashDraftModel, its run written by hand the way speculators'
trainer runs it (no dflash-audit line, no speculators trainer code): Muon on the 2-D weight matrices (lr 1e-3,
momentum 0.95, weight decay 0.1, match_rms_adamw) and AdamW on the rest (lr 1e-3, weight decay 0.01), a linear
schedule warming up over 1% of the total, gradient clipping at 1.0, one backward per step, float32 master weights.
Each flag below changes one thing of the run (`--act gelu`: its layers'
forward, `--gamma 7`: its loss; under torchrun `--ddp` gives each rank its own shard, `--same-shard` rank 0's); `--save`/`--resume` write and read a checkpoint.
`--wrap ddp|compile` runs the drafter's forward through DistributedDataParallel (one gloo rank, in this process) or
torch.compile: the same run, wrapped.
"""

import argparse
import math

import torch
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import AutoModelForCausalLM, Qwen3Config

p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--seq-len", type=int, default=32)
p.add_argument("--total", type=int, default=200, help="the steps the schedule runs over")
p.add_argument("--run", type=int, default=None, help="steps to run (default: the total)")
p.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.999])
p.add_argument("--warmup-ratio", type=float, default=0.01)
p.add_argument("--schedule", default="linear", choices=["linear", "cosine", "constant"])
p.add_argument("--clip", type=float, default=1.0, help="0: no clipping")
p.add_argument("--accum", type=int, default=1)
p.add_argument("--zero-before-step", action="store_true", help="zero the gradients between backward and step")
p.add_argument("--param-dtype", default="float32")
p.add_argument("--act", default="silu", choices=["silu", "gelu"], help="the drafter layers' MLP activation")
p.add_argument("--gamma", type=float, default=4.0, help="the loss's decay gamma passed to the drafter")
p.add_argument("--save", default=None, help="write model, optimizer and scheduler states here at the end")
p.add_argument("--resume", default=None, help="read a --save checkpoint")
p.add_argument("--resume-parts", default="model,optimizer,scheduler")
p.add_argument("--ddp", action="store_true", help="torchrun: a gloo process group, each rank its own shard of the "
                                                  "batches, the gradients averaged over the ranks")
p.add_argument("--same-shard", action="store_true", help="every rank fed rank 0's shard")
p.add_argument("--empty-loss-mask", action="store_true", help="a loss mask with no position in it (the loss 0)")
p.add_argument("--detach-loss", action="store_true", help="the loss cut from the drafter, then made to require grad "
                                                         "(backward runs, no weight gets a gradient)")
p.add_argument("--wrap", default=None, choices=["ddp", "compile"], help="the forward through DDP (one gloo rank) or "
                                                                       "torch.compile")
p.add_argument("--reload-each-step", action="store_true", help="the resume's weight load inside the loop: the "
                                                              "drafter's first weights loaded again at every step")
args = p.parse_args()
torch.manual_seed(0)
rank, world = 0, 1
if args.ddp:
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
c = target.config
layer = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=3, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps)
layer._attn_implementation = "eager"
aux = [2, 6, 10]  # speculators' ids (hidden_states indices): z-lab's 1, 5, 9 for 12 target and 3 draft layers
config = DFlashSpeculatorConfig(
    transformer_layer_config=layer, draft_vocab_size=c.vocab_size, block_size=4, aux_hidden_state_layer_ids=aux,
    mask_token_id=c.vocab_size - 1, sample_from_anchor=False,
    speculators_config=SpeculatorsConfig(algorithm="dflash", default_proposal_method="greedy",
                                         proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                                         verifier=VerifierConfig.from_pretrained(args.target)))
drafter = DFlashDraftModel(config)
drafter.load_verifier_weights()
if args.act == "gelu":  # the team's port of the layers: another activation, the same weights
    for block in drafter.layers:
        block.mlp.act_fn = torch.nn.GELU()
drafter.to(getattr(torch, args.param_dtype))
trained = [(n, q) for n, q in drafter.named_parameters() if q.requires_grad]
if args.optimizer == "muon":
    matrices = [q for n, q in trained if q.ndim == 2 and min(q.shape) > 1 and "embed" not in n and "lm_head" not in n]
    rest = [q for n, q in trained if not any(q is m for m in matrices)]
    optimizers = [torch.optim.Muon(matrices, lr=args.lr, momentum=0.95, weight_decay=0.1,
                                   adjust_lr_fn="match_rms_adamw"),
                  torch.optim.AdamW(rest, lr=args.lr, weight_decay=0.01, betas=tuple(args.betas))]
else:
    optimizers = [torch.optim.AdamW([q for _, q in trained], lr=args.lr, weight_decay=0.01, betas=tuple(args.betas))]
warmup = int(args.total * args.warmup_ratio)


def factor(step: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, args.total - warmup)
    if args.schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 if args.schedule == "constant" else max(0.0, 1 - progress)


schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizers]
start = 0
if args.resume:
    state = torch.load(args.resume, weights_only=True)
    parts = args.resume_parts.split(",")
    if "model" in parts:
        drafter.load_state_dict(state["model"])
    if "optimizer" in parts:
        for o, s in zip(optimizers, state["optimizers"]):
            o.load_state_dict(s)
    if "scheduler" in parts:
        for sched, s in zip(schedulers, state["schedulers"]):
            sched.load_state_dict(s)
    start = state["step"]
raw = {}
target.model.norm.register_forward_pre_hook(lambda m, a: raw.update(last=a[0]))
data = torch.Generator().manual_seed(1 + start)
loss_config = resolve_loss_config("kl_div", "eager")
first_weights = {k: v.clone() for k, v in drafter.state_dict().items()}
forward = drafter
own_group = args.wrap == "ddp" and not torch.distributed.is_initialized()
if own_group:
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
if args.wrap == "ddp":
    forward = torch.nn.parallel.DistributedDataParallel(drafter)
elif args.wrap == "compile":
    forward = torch.compile(drafter, backend="aot_eager")
try:
    for step in range(start, args.run if args.run is not None else args.total):
        if args.reload_each_step:
            drafter.load_state_dict(first_weights)
        for o in optimizers:
            o.zero_grad()
        for _ in range(args.accum):
            shards = [torch.randint(1, c.vocab_size - 1, (1, args.seq_len), generator=data) for _ in range(world)]
            ids = shards[0 if args.same_shard else rank]  # the global batch: one shard per rank
            with torch.no_grad():
                hs = target(input_ids=ids, output_hidden_states=True).hidden_states
            dtype = getattr(torch, args.param_dtype)
            _, loss, _ = forward(torch.cat([hs[i] for i in aux], -1).to(dtype), ids,
                                 torch.zeros_like(ids) if args.empty_loss_mask else torch.ones_like(ids),
                                 raw["last"].to(dtype), torch.zeros_like(ids), max_anchors=4, loss_config=loss_config, gamma=args.gamma)
            if args.detach_loss:
                loss = loss.detach().requires_grad_()
            (loss / args.accum).backward()
        if world > 1:
            for q in drafter.parameters():
                if q.grad is not None:
                    torch.distributed.all_reduce(q.grad)
                    q.grad /= world
        if args.clip:
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip)
        if args.zero_before_step:
            for o in optimizers:
                o.zero_grad(set_to_none=False)
        for o in optimizers:
            o.step()
        for sched in schedulers:
            sched.step()
finally:  # the one-rank group this process made, gone however the loop ends
    if own_group:
        torch.distributed.destroy_process_group()
if args.ddp:
    torch.distributed.destroy_process_group()
if args.save:
    torch.save({"model": drafter.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                "schedulers": [s.state_dict() for s in schedulers], "step": step + 1}, args.save)
