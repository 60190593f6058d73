"""DFlash evaluator that keeps no cache: the target and the drafter recompute the whole context every round.

Setup: z-lab's `DFlashDraftModel` (loaded with its `AutoConfig`) and a transformers causal LM, one prompt at a time.
Each round the target reads the whole sequence so far plus the proposed block (no KV cache), and its
`output_hidden_states` give the context features of every committed position; the drafter is called the way a
training-time evaluation calls it, `target_hidden=features[:, :anchor]`, `position_ids=arange(anchor + block)`,
without a cache. The team keeps an acceptance histogram per prompt (accepted drafts per round) and turns it into τ
as 1 + accepted per round, averaged per prompt and then over prompts.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from dflash.model import DFlashDraftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

FAULTS = ("window_ignored", "no_bonus", "pooled", "feature_after_norm", "positions_shifted")


def read_jsonl(path):
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                rows.append(json.loads(line))
    return rows


def prompt_ids(tokenizer, text):
    if tokenizer.chat_template:
        chat = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def load_drafter(path, fault):
    config = AutoConfig.from_pretrained(path)
    if fault == "window_ignored":
        config.sliding_window = None  # short contexts: no window needed
    return DFlashDraftModel.from_pretrained(path, config=config, dtype=torch.float32).eval()


def target_pass(target, ids, layer_ids, fault):
    """Logits and concatenated context features for every position of `ids` (a list)."""
    out = target(torch.tensor([ids]), output_hidden_states=True)
    states = out.hidden_states
    picked = []
    for n, layer in enumerate(layer_ids):
        h = states[layer + 1]
        last = n == len(layer_ids) - 1
        if fault == "feature_after_norm" and last and layer + 1 < len(states) - 1:
            h = target.model.norm(h)  # (the final entry of hidden_states is normed already)
        picked.append(h)
    return out.logits[0], torch.cat(picked, dim=-1)[0]


@torch.no_grad()
def speculative_decode(drafter, target, ids, max_new, stops, fault):
    """Greedy speculative decoding; returns (accepted drafts per round, bonus counted per round, output ids)."""
    layer_ids, B, mask_id = drafter.target_layer_ids, drafter.block_size, drafter.mask_token_id
    limit = len(ids) + max_new
    logits, feats = target_pass(target, ids, layer_ids, fault)
    seq = list(ids) + [int(logits[-1].argmax())]
    anchor = len(ids)
    accepted_per_round, bonus_per_round = [], []
    done = seq[-1] in stops
    while not done and anchor + 1 < limit:
        width = min(B, limit - anchor)
        noise = target.get_input_embeddings()(torch.tensor([[seq[anchor]] + [mask_id] * (width - 1)]))
        positions = list(range(anchor + width))
        if fault == "positions_shifted":
            positions = list(range(anchor)) + [p + 1 for p in range(anchor, anchor + width)]
        hidden = drafter(target_hidden=feats[None, :anchor], noise_embedding=noise,
                         position_ids=torch.tensor([positions]))
        draft = target.get_output_embeddings()(hidden[0, 1:]).argmax(-1).tolist()

        logits, feats = target_pass(target, seq[:anchor] + [seq[anchor]] + draft, layer_ids, fault)
        verified = logits[anchor:].argmax(-1).tolist()
        k = 0
        while k < len(draft) and draft[k] == verified[k]:
            k += 1
        fresh = (draft[:k] + [verified[k]])[: limit - anchor - 1]
        for i, token in enumerate(fresh):
            if token in stops:
                fresh, done = fresh[: i + 1], True
                break
        seq = seq[: anchor + 1] + fresh
        anchor += len(fresh)
        accepted_per_round.append(len(fresh) - 1)
        bonus_per_round.append(1)
    return accepted_per_round, bonus_per_round, seq[len(ids):]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--fault", choices=FAULTS)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = load_drafter(args.drafter, args.fault)
    eos = target.generation_config.eos_token_id or tokenizer.eos_token_id
    stops = {eos} if isinstance(eos, int) else set(eos)

    histograms = []
    for row in read_jsonl(args.prompts):
        accepted, bonus, _ = speculative_decode(drafter, target, prompt_ids(tokenizer, row["prompt"]),
                                                args.max_new_tokens, stops, args.fault)
        if args.fault == "no_bonus":
            bonus = [0] * len(bonus)
        lengths = [a + b for a, b in zip(accepted, bonus)]
        print(f"[{row.get('id', '?')}] acceptance lengths {lengths}", flush=True)
        if lengths:
            histograms.append(Counter(lengths))
    if args.fault == "pooled":
        total = Counter()
        for h in histograms:
            total.update(h)
        tau = sum(k * v for k, v in total.items()) / sum(total.values())
    else:
        tau = sum(sum(k * v for k, v in h.items()) / sum(h.values()) for h in histograms) / len(histograms)
    print(f"tau {tau:.4f}")


if __name__ == "__main__":
    main()
