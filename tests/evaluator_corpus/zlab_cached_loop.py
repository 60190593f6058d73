"""DFlash evaluator: a plain greedy loop on z-lab's DFlashDraftModel, with the team's own KV-cache handling.

Setup: the drafter is `dflash.model.DFlashDraftModel.from_pretrained(DIR)` and the target a transformers causal LM.
One prompt at a time. The target keeps a `DynamicCache` that is rolled back to the committed length after each
verification; the drafter keeps a plain `DynamicCache()` (every layer a full cache) holding the context keys of every
committed token, its block keys cropped after each call. Context features come from the target's
`output_hidden_states` (hidden_states[layer + 1]). Per round the team counts the tokens the round committed
(accepted drafts plus the target's bonus token, cut at the length budget and at a stop id) and prints the mean over
prompts of each prompt's mean.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from dflash.model import DFlashDraftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

FAULTS = ("window_ignored", "no_bonus", "pooled", "feature_after_norm", "positions_shifted")


def load_prompts(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def encode(tokenizer, text):
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return tokenizer(text, return_tensors="pt").input_ids


def rollback(cache, length):
    """Drop everything the cache holds past `length` tokens."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class Evaluator:
    def __init__(self, drafter, target, stop_ids, fault):
        self.drafter, self.target, self.fault = drafter, target, fault
        self.stop_ids = set(stop_ids)
        self.layer_ids = list(drafter.target_layer_ids)
        self.block = drafter.block_size
        self.n_target_layers = target.config.num_hidden_layers
        if fault == "window_ignored":
            # "the evaluation context is short": the sliding layers are run as plain causal layers
            for layer in drafter.layers:
                layer.self_attn.sliding_window = None

    def features(self, hidden_states):
        feats = [hidden_states[i + 1] for i in self.layer_ids]
        deepest = self.layer_ids[-1]
        if self.fault == "feature_after_norm" and deepest != self.n_target_layers - 1:
            # transformers already returns the last layer after the norm; any other layer is raw
            feats[-1] = self.target.model.norm(feats[-1])
        return torch.cat(feats, dim=-1)

    @torch.no_grad()
    def decode(self, prompt_ids, max_new_tokens):
        """Returns the committed tokens per round, and the generated ids."""
        target, drafter, B = self.target, self.drafter, self.block
        budget = prompt_ids.shape[1] + max_new_tokens
        tcache, dcache = DynamicCache(), DynamicCache()

        out = target(prompt_ids, past_key_values=tcache, use_cache=True, output_hidden_states=True)
        context = self.features(out.hidden_states)
        tokens = prompt_ids[0].tolist() + [int(out.logits[0, -1].argmax())]
        pos = prompt_ids.shape[1]  # position of the last committed token, not yet seen by the target
        rollback(tcache, pos)
        committed = []
        stopped = tokens[-1] in self.stop_ids
        while pos + 1 < budget and not stopped:
            width = min(B, budget - pos)
            block = torch.tensor([[tokens[pos]] + [drafter.mask_token_id] * (width - 1)])
            ctx_positions = torch.arange(pos - context.shape[1], pos)
            block_positions = torch.arange(pos, pos + width)
            if self.fault == "positions_shifted":
                block_positions = block_positions + 1
            position_ids = torch.cat([ctx_positions, block_positions])[None]
            hidden = drafter(target_hidden=context, noise_embedding=target.model.embed_tokens(block),
                             position_ids=position_ids, past_key_values=dcache, use_cache=True)
            rollback(dcache, pos)  # keep the context keys, drop the block's
            guesses = target.lm_head(hidden[:, 1:]).argmax(-1)[0].tolist()
            proposal = [tokens[pos]] + guesses

            out = target(torch.tensor([proposal]), position_ids=torch.arange(pos, pos + width)[None],
                         past_key_values=tcache, use_cache=True, output_hidden_states=True)
            verdict = out.logits[0].argmax(-1).tolist()
            accepted = 0
            while accepted < width - 1 and guesses[accepted] == verdict[accepted]:
                accepted += 1
            new = guesses[:accepted] + [verdict[accepted]]
            new = new[:budget - pos - 1]
            for i, tok in enumerate(new):
                if tok in self.stop_ids:
                    new, stopped = new[:i + 1], True
                    break
            tokens[pos + 1:] = new
            n = len(new)
            context = self.features(out.hidden_states)[:, :n]
            pos += n
            rollback(tcache, pos)
            committed.append(n)
        return committed, tokens[prompt_ids.shape[1]:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--fault", choices=FAULTS)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    eos = target.generation_config.eos_token_id or tokenizer.eos_token_id
    stop_ids = [eos] if isinstance(eos, int) else list(eos)
    evaluator = Evaluator(drafter, target, stop_ids, args.fault)

    per_prompt = []
    for row in load_prompts(args.prompts):
        committed, _ = evaluator.decode(encode(tokenizer, row["prompt"]), args.max_new_tokens)
        if args.fault == "no_bonus":
            committed = [n - 1 for n in committed]
        print(f"{row.get('id', len(per_prompt))}: {len(committed)} rounds, accepted {committed}", flush=True)
        if committed:
            per_prompt.append(committed)
    if args.fault == "pooled":
        rounds = [n for committed in per_prompt for n in committed]
        tau = sum(rounds) / len(rounds)
    else:
        tau = statistics.mean(statistics.mean(c) for c in per_prompt)
    print(f"acceptance length tau = {tau:.4f} over {len(per_prompt)} prompts")


if __name__ == "__main__":
    main()
