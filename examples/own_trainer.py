"""A team's own DFlash trainer: z-lab's `DFlashDraftModel` trained against a Hugging Face target.

It uses no dflash-audit code: only torch, transformers and z-lab's `dflash.model`. The one line
`trace.step(loss)` lets `dflash-audit trace -- python examples/own_trainer.py ...` record a step; run
without the tool it does nothing (and without dflash-audit installed the script still runs).

Sound by default (what speculators' DFlash trainer computes with its model-level defaults): fc reads
every layer of `build_target_layer_ids`, the targets are the target's own logits (its final layer
after the final norm) one position back from each slot, KL toward them, weights exp(-(k-1)/4) with
none on the anchor slot, reduced as sum(w * mask * loss) / (sum(mask) + 1e-5). Each flag below
plants one bug; the seed team's four are --fc-drop-last, --target-layer, --gamma 7 and --target-noise.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel, build_target_layer_ids
from transformers import AutoConfig, AutoModelForCausalLM

try:
    from dflash_audit import trace
except ImportError:  # the script runs without the tool installed
    trace = None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="the Hugging Face target's folder")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=48)
    p.add_argument("--anchors", type=int, default=6, help="blocks per sequence")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="the target's device")
    p.add_argument("--drafter-device", default=None, help="the drafter's device (default: the target's)")
    p.add_argument("--input-noise", type=float, default=0.0,
                   help="augmentation: Gaussian noise of this std on the drafter's context features")
    # Planted bugs.
    p.add_argument("--fc-drop-last", action="store_true",
                   help="bug: fc reads all selected layers but the deepest (the seed's 4 of 5)")
    p.add_argument("--target-layer", type=int, default=None,
                   help="bug: targets from this decoder layer's output (through the final norm and head)")
    p.add_argument("--raw-targets", action="store_true", help="bug: targets from the last layer before the final norm")
    p.add_argument("--target-shift", type=int, default=0, help="bug: targets taken this many positions later")
    p.add_argument("--gamma", type=float, default=4.0, help="loss decay; the reference's is 4")
    p.add_argument("--target-noise", type=float, default=0.0, help="bug: Gaussian noise of this std on the target logits")
    p.add_argument("--noise-to-targets", type=float, default=0.0,
                   help="bug: the augmentation noise (this std) added to the hidden state the targets come from, "
                        "not to the drafter's inputs")
    p.add_argument("--ce-from-data", action="store_true", help="bug: CE toward the data's next tokens, not distillation")
    p.add_argument("--mask-is-pad", action="store_true", help="bug: the mask token is the pad id")
    p.add_argument("--block-short", action="store_true", help="bug: each block one slot short of the drafter's size")
    p.add_argument("--ddp", action="store_true", help="torchrun: gloo process group, the drafter in DDP")
    p.add_argument("--fsdp2", action="store_true", help="torchrun: gloo process group, the drafter's layers and the "
                   "drafter sharded by fully_shard (FSDP2 DTensors, as speculators shards it)")
    p.add_argument("--accelerate", action="store_true", help="accelerate launch: the drafter prepared by Accelerator")
    return p.parse_args(argv)


def draft_config(target_config, args, layer_ids, mask_id):
    config = AutoConfig.for_model("qwen3", **{k: getattr(target_config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "max_position_embeddings")})
    config.num_hidden_layers = args.draft_layers
    config.num_target_layers = target_config.num_hidden_layers
    config.rope_parameters = getattr(target_config, "rope_parameters", None) or {"rope_type": "default",
                                                                                   "rope_theta": 10000.0}
    config.dflash_config = {"target_layer_ids": layer_ids, "block_size": args.block_size, "mask_token_id": mask_id}
    config._attn_implementation = "sdpa"
    return config


def training_mask(anchors, block, seq_len, device):
    """Block j's queries see the context before its anchor and the whole of their own block."""
    q = len(anchors) * block
    visible = torch.zeros(q, seq_len + q, dtype=torch.bool, device=device)
    for j, a in enumerate(anchors):
        visible[j * block:(j + 1) * block, :a] = True
        visible[j * block:(j + 1) * block, seq_len + j * block:seq_len + (j + 1) * block] = True
    return visible[None, None]


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rank, accelerator = 0, None
    if args.ddp or args.fsdp2:
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
    if args.accelerate:
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=args.device == "cpu")
        rank = accelerator.process_index
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(args.device).eval()
    target.requires_grad_(False)
    config = target.config
    n_layers, vocab = config.num_hidden_layers, config.vocab_size
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    mask_id = pad_id if args.mask_is_pad else vocab - 1
    layer_ids = build_target_layer_ids(n_layers, args.draft_layers)
    fc_ids = layer_ids[:-1] if args.fc_drop_last else layer_ids
    drafter_device = torch.device(args.drafter_device or args.device)
    drafter = DFlashDraftModel(draft_config(config, args, fc_ids, mask_id)).to(drafter_device)
    if args.fsdp2:  # sharded before the optimizer is made: it holds the sharded parameters
        from torch.distributed.fsdp import fully_shard

        for layer in drafter.layers:
            fully_shard(layer)
        fully_shard(drafter)
    optim = torch.optim.AdamW(drafter.parameters(), lr=args.lr)
    model = drafter
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(drafter)
    if accelerator is not None:
        model, optim = accelerator.prepare(drafter, optim)
    slots = args.block_size - 1 if args.block_short else args.block_size
    raw_last = {}
    target.model.layers[-1].register_forward_hook(lambda m, i, o: raw_last.update(out=o[0] if isinstance(o, tuple) else o))
    data = torch.Generator().manual_seed(args.seed + 1 + rank)
    for step in range(args.steps):
        ids = torch.randint(1, vocab - 1, (args.batch, args.seq_len), generator=data).to(args.device)
        with torch.no_grad():
            out = target(input_ids=ids, output_hidden_states=True)
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1] for i in fc_ids], dim=-1)
            if args.input_noise:
                feats = feats + args.input_noise * torch.randn_like(feats)
            if args.target_layer is not None:
                source = target.model.norm(hs[args.target_layer + 1])
            elif args.raw_targets:
                source = raw_last["out"]
            else:
                source = hs[-1]
            if args.noise_to_targets:
                source = source + args.noise_to_targets * torch.randn_like(source)
            t_logits = target.lm_head(source)
            if args.target_noise:
                t_logits = t_logits + args.target_noise * torch.randn_like(t_logits)
        anchors = sorted(torch.randperm(args.seq_len - args.block_size - 1, generator=data)[:args.anchors].add(1).tolist())
        block_ids = torch.full((args.batch, len(anchors) * slots), mask_id, dtype=torch.long, device=args.device)
        for j, a in enumerate(anchors):
            block_ids[:, j * slots] = ids[:, a]
        block_pos = torch.tensor([a + k for a in anchors for k in range(slots)], device=drafter_device)
        position_ids = torch.cat([torch.arange(args.seq_len, device=drafter_device), block_pos])[None].expand(
            args.batch, -1)
        noise_embedding = target.model.embed_tokens(block_ids).to(drafter_device)
        hidden = model(position_ids=position_ids, noise_embedding=noise_embedding, target_hidden=feats.to(drafter_device),
                       attention_mask=training_mask(anchors, slots, args.seq_len, drafter_device))
        logits = target.lm_head(hidden.to(args.device)).view(args.batch, len(anchors), slots, vocab)
        # Slot k >= 1 of the block at anchor a predicts token a + k: the target's logits at position a + k - 1.
        where = torch.tensor([[a + k - 1 + args.target_shift for k in range(1, slots)] for a in anchors],
                             device=args.device)
        draft = logits[:, :, 1:]
        if args.ce_from_data:
            labels = ids[:, where + 1]
            per_slot = F.cross_entropy(draft.reshape(-1, vocab), labels.reshape(-1), reduction="none").view(
                labels.shape)
        else:
            targets = t_logits[:, where]
            per_slot = F.kl_div(F.log_softmax(draft, -1), F.log_softmax(targets, -1), reduction="none",
                                log_target=True).sum(-1)
        weights = torch.tensor([math.exp(-(k - 1) / args.gamma) for k in range(1, slots)], device=args.device)
        mask = torch.ones_like(per_slot)
        loss = ((weights * mask * per_slot).flatten(1).sum(-1) / (mask.flatten(1).sum(-1) + 1e-5)).mean()
        if trace is not None:
            trace.step(loss)
        optim.zero_grad()
        if accelerator is not None:
            accelerator.backward(loss)
        else:
            loss.backward()
        optim.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
