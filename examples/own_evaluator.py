"""A team's own DFlash evaluator: z-lab's `DFlashDraftModel` weights decoded by the team's own loop.

It uses no dflash-audit code but the optional `trace.tau(tau)`: only torch, transformers and z-lab's `dflash.model`.
Its loop keeps no cache: each round it runs the target on the whole sequence, feeds the drafter every context row
(`hidden_states[id + 1]` of z-lab's layers) and the block `[last token, mask x (B - 1)]` at positions
`0..start + B - 1`, verifies the drafts greedily (rejection sampling at `--temperature T`) and adds the target's next
token. `--batch N` runs the target on N prompts at once, left-padded (the drafter one row at a time); `--loop zlab`
decodes with z-lab's own cached `dflash_generate` instead. Each `--fault` plants one evaluator bug:
window_ignored (the drafter's sliding window taken off), no_bonus (τ without the bonus token), pooled (τ over all
rounds together), feature_after_norm (every feature after the target's final norm), positions_shifted (the
block's positions one later than its context's).
"""

from __future__ import annotations

import argparse
import json

import torch
from dflash.model import DFlashDraftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

try:
    from dflash_audit import trace
except ImportError:  # the script runs without the tool installed
    trace = None

FAULTS = ("window_ignored", "no_bonus", "pooled", "feature_after_norm", "positions_shifted")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="z-lab drafter folder")
    p.add_argument("--target", required=True, help="Hugging Face target folder")
    p.add_argument("--prompts", required=True, help="JSON lines, each with a 'prompt'")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--limit", type=int, default=4, help="prompts to run")
    p.add_argument("--batch", type=int, default=1, help="prompts whose target calls run together, left-padded")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else drafts and verification sampled "
                                                                    "(rejection sampling)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loop", choices=("own", "zlab"), default="own",
                   help="own: this script's uncached loop; zlab: z-lab's dflash_generate (cached), prompt by prompt")
    p.add_argument("--tau-per-prompt", action="store_true", help="hand over one τ per prompt")
    p.add_argument("--fault", choices=FAULTS, default=None)
    return p.parse_args(argv)


def features(hidden_states, layer_ids, norm=None):
    picked = [hidden_states[i + 1] for i in layer_ids]
    if norm is not None:
        picked = [norm(h) for h in picked]
    return torch.cat(picked, dim=-1)


def stop_ids(target, tokenizer) -> list[int]:
    eos = target.generation_config.eos_token_id or tokenizer.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


class Evaluation:
    def __init__(self, args):
        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.target)
        self.target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        self.drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
        if args.fault == "window_ignored":
            for layer in self.drafter.layers:
                layer.self_attn.sliding_window = None
        self.stops = stop_ids(self.target, self.tokenizer)
        self.norm = self.target.model.norm if args.fault == "feature_after_norm" else None

    def target_rows(self, sequences: list[list[int]]):
        """The target on each sequence (left-padded together): per row, its logits and feature rows."""
        width = max(len(s) for s in sequences)
        ids = torch.tensor([[self.tokenizer.pad_token_id or 0] * (width - len(s)) + s for s in sequences])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = self.target(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        feats = features(out.hidden_states, self.drafter.target_layer_ids, self.norm)
        return [(out.logits[r, width - len(s):], feats[r, width - len(s):]) for r, s in enumerate(sequences)]

    def draft(self, sequence: list[int], context: torch.Tensor, size: int):
        """The drafts, and their sampling distributions (None when greedy)."""
        start = len(sequence) - 1
        block = torch.tensor([[sequence[-1]] + [self.drafter.mask_token_id] * (size - 1)])
        positions = torch.arange(start + size)[None]
        if self.args.fault == "positions_shifted":
            positions[:, start:] += 1  # the block one position later than its context
        noise = self.target.get_input_embeddings()(block)
        hidden = self.drafter(position_ids=positions, noise_embedding=noise, target_hidden=context[None, :start])
        logits = self.target.lm_head(hidden[:, 1:])[0]
        if self.args.temperature == 0:
            return logits.argmax(-1).tolist(), None
        probs = torch.softmax(logits.float() / self.args.temperature, dim=-1)
        return torch.multinomial(probs, 1)[:, 0].tolist(), probs

    def verify(self, drafts: list[int], probs, logits: torch.Tensor) -> list[int]:
        """The accepted drafts and the target's next token: greedy, or rejection sampling at T > 0."""
        if probs is None:
            choice = logits.argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == choice[accepted]:
                accepted += 1
            return drafts[:accepted] + [choice[accepted]]
        target = torch.softmax(logits.float() / self.args.temperature, dim=-1)
        for k, token in enumerate(drafts):
            if torch.rand(()) * probs[k, token] >= target[k, token]:
                residual = (target[k] - probs[k]).clamp_min(0)
                residual = residual / residual.sum() if residual.sum() > 0 else target[k]
                return drafts[:k] + [int(torch.multinomial(residual, 1))]
        return drafts + [int(torch.multinomial(target[len(drafts)], 1))]

    @torch.inference_mode()
    def run(self, prompts: list[list[int]]) -> list[list[int]]:
        """Rounds (tokens each added, the bonus counted) per prompt, `batch` prompts advancing together."""
        all_rounds = []
        for first in range(0, len(prompts), self.args.batch):
            group = prompts[first:first + self.args.batch]
            sequences = [list(p) for p in group]
            ends = [len(p) + self.args.max_new_tokens for p in group]
            rounds: list[list[int]] = [[] for _ in group]
            for row, (logits, _) in enumerate(self.target_rows(sequences)):
                if self.args.temperature == 0:
                    sequences[row].append(int(logits[-1].argmax()))
                else:
                    probs = torch.softmax(logits[-1].float() / self.args.temperature, dim=-1)
                    sequences[row].append(int(torch.multinomial(probs, 1)))
            live = [row for row in range(len(group)) if sequences[row][-1] not in self.stops]
            while live:
                rows = self.target_rows([sequences[r] for r in live])
                drafted = {}
                for row, (_, context) in zip(live, rows):
                    start = len(sequences[row]) - 1
                    size = min(self.drafter.block_size, ends[row] - start)
                    drafted[row] = self.draft(sequences[row], context, size)
                verified = self.target_rows([sequences[r] + drafted[r][0] for r in live])
                for row, (logits, _) in zip(live, verified):
                    start = len(sequences[row]) - 1
                    new = self.verify(drafted[row][0], drafted[row][1], logits[start:])
                    new = new[: ends[row] - start - 1]
                    for i, token in enumerate(new):
                        if token in self.stops:
                            new = new[: i + 1]
                            break
                    sequences[row] += new
                    rounds[row].append(len(new))
                live = [r for r in live if len(sequences[r]) < ends[r] and sequences[r][-1] not in self.stops]
            all_rounds.extend(rounds)
        return all_rounds


def _run_zlab(self, prompts: list[list[int]]) -> list[list[int]]:
    """z-lab's own loop (its KV caches), called as a team calls it."""
    import time

    import dflash.model as zlab

    zlab._cuda_time = time.perf_counter  # its timer synchronizes CUDA; a plain clock on a CPU
    rounds = []
    for prompt in prompts:
        stats = zlab.dflash_generate(self.drafter, self.target, torch.tensor([prompt]), self.args.max_new_tokens,
                                     self.stops, temperature=self.args.temperature, return_stats=True)
        rounds.append([int(n) for n in stats.acceptance_lengths])
    return rounds


Evaluation.run_zlab = torch.inference_mode()(_run_zlab)


def tau_of(rounds: list[list[int]], fault: str | None):
    if fault == "pooled":
        flat = [n for r in rounds for n in r]
        return sum(flat) / len(flat)
    bonus = 1 if fault == "no_bonus" else 0
    means = [sum(n - bonus for n in r) / len(r) for r in rounds if r]
    return sum(means) / len(means)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    evaluation = Evaluation(args)
    with open(args.prompts) as handle:
        texts = [json.loads(line)["prompt"] for line in handle if line.strip()][: args.limit]
    prompts = [evaluation.tokenizer(text)["input_ids"] for text in texts]
    rounds = evaluation.run(prompts) if args.loop == "own" else evaluation.run_zlab(prompts)
    tau = tau_of(rounds, args.fault)
    if args.tau_per_prompt:
        tau = [tau_of([r], args.fault) for r in rounds]
    print(f"tau {tau} over {len(rounds)} prompts")
    if trace is not None:
        trace.tau(tau)


if __name__ == "__main__":
    main()
