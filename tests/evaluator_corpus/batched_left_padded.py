"""DFlash evaluator over a batch of prompts: left padding, every row at its own position, z-lab's layers driven by hand.

Setup: the prompts go through in batches of `--batch-size` rows, each row decoding at its own pace (finished rows
leave the batch). Every round the target reads each row's whole sequence plus its proposed block in one left-padded
call (attention mask, position ids from the mask's cumulative sum, no cache); its `output_hidden_states` give the
context features. The drafter is z-lab's `DFlashDraftModel`, but the team drives its modules itself (`fc`,
`hidden_norm`, `rotary_emb`, each layer, `norm`) so that each layer gets its own 4-D boolean mask over
[left-padded context ; block]: the full-attention layers see every real key, the sliding layers see keys at or
before the query and within the window. Acceptance is kept in a [rows, rounds] tensor (-1 where a row had no round)
and τ is the mean over rows of each row's mean.
"""

from __future__ import annotations

import argparse
import json

import torch
from dflash.model import DFlashDraftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

FAULTS = ("window_ignored", "no_bonus", "pooled", "feature_after_norm", "positions_shifted")


def tokenize_all(tokenizer, path):
    names, ids = [], []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            text = row["prompt"]
            if tokenizer.chat_template:
                text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True)
                ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            else:
                ids.append(tokenizer(text)["input_ids"])
            names.append(row.get("id", f"row{i}"))
    return names, ids


def left_pad(seqs, pad_id):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s):] = torch.tensor(s)
        mask[r, width - len(s):] = 1
    return ids, mask


class BatchedDFlashEval:
    def __init__(self, drafter, target, stop_ids, pad_id, fault):
        self.d, self.t, self.fault = drafter, target, fault
        self.stop_ids, self.pad_id = set(stop_ids), pad_id
        self.layer_ids = list(drafter.target_layer_ids)
        self.B = drafter.block_size
        self.last_target_layer = target.config.num_hidden_layers - 1

    # -- target -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def run_target(self, seqs):
        """Per row: logits [len, V] and context features [len, F] of its own (unpadded) sequence."""
        ids, mask = left_pad(seqs, self.pad_id)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.t(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        feats = [out.hidden_states[i + 1] for i in self.layer_ids]
        if self.fault == "feature_after_norm" and self.layer_ids[-1] != self.last_target_layer:
            feats[-1] = self.t.model.norm(feats[-1])  # the last layer's entry is normed by transformers already
        feats = torch.cat(feats, dim=-1)
        return [(out.logits[r, ids.shape[1] - len(s):], feats[r, ids.shape[1] - len(s):]) for r, s in enumerate(seqs)]

    # -- drafter ------------------------------------------------------------------------------------------------
    def layer_masks(self, ctx_lens, anchors, widths):
        """One [rows, 1, B, L + B] boolean mask per layer type; context left-padded to L."""
        L, B, rows = max(ctx_lens), self.B, len(anchors)
        key_pos = torch.full((rows, L + B), -1, dtype=torch.long)
        real = torch.zeros((rows, L + B), dtype=torch.bool)
        for r in range(rows):
            key_pos[r, L - ctx_lens[r]:L] = torch.arange(ctx_lens[r])
            key_pos[r, L:] = anchors[r] + torch.arange(B)
            real[r, L - ctx_lens[r]:L] = True
            real[r, L:L + widths[r]] = True
        q_pos = key_pos[:, L:]
        full = real[:, None, :].expand(rows, B, L + B)
        causal = full & (key_pos[:, None, :] <= q_pos[:, :, None])
        if self.fault == "window_ignored":
            sliding = causal
        else:
            sliding = causal & (q_pos[:, :, None] - key_pos[:, None, :] < self.d.config.sliding_window)
        return {"full_attention": full[:, None], "sliding_attention": sliding[:, None]}, key_pos

    @torch.no_grad()
    def draft(self, contexts, anchor_tokens, anchors, widths):
        d, B = self.d, self.B
        ctx_lens = [c.shape[0] for c in contexts]
        L = max(ctx_lens)
        ctx = torch.zeros((len(contexts), L, contexts[0].shape[-1]))
        for r, c in enumerate(contexts):
            ctx[r, L - c.shape[0]:] = c
        block = torch.full((len(contexts), B), d.mask_token_id, dtype=torch.long)
        block[:, 0] = torch.tensor(anchor_tokens)
        masks, key_pos = self.layer_masks(ctx_lens, anchors, widths)
        position_ids = key_pos.clamp(min=0)
        if self.fault == "positions_shifted":
            position_ids[:, L:] += 1
        hidden = self.t.get_input_embeddings()(block)
        target_hidden = d.hidden_norm(d.fc(ctx))
        cos_sin = d.rotary_emb(hidden, position_ids)
        layer_types = d.config.layer_types or ["full_attention"] * len(d.layers)
        for layer, kind in zip(d.layers, layer_types):
            hidden = layer(hidden_states=hidden, target_hidden=target_hidden, attention_mask=masks[kind],
                           position_ids=position_ids, position_embeddings=cos_sin)
        hidden = d.norm(hidden)
        return d.compute_logits(hidden[:, 1:], self.t.get_output_embeddings()).argmax(-1)

    # -- loop ---------------------------------------------------------------------------------------------------
    def evaluate(self, prompts, max_new):
        rows = len(prompts)
        limit = [len(p) + max_new for p in prompts]
        first = self.run_target(prompts)
        seqs = [list(p) + [int(lg[-1].argmax())] for p, (lg, _) in zip(prompts, first)]
        contexts = [f for _, f in first]
        anchors = [len(p) for p in prompts]
        active = [r for r in range(rows) if seqs[r][-1] not in self.stop_ids]
        history = [[] for _ in range(rows)]
        while True:
            active = [r for r in active if anchors[r] + 1 < limit[r]]
            if not active:
                break
            widths = [min(self.B, limit[r] - anchors[r]) for r in active]
            guesses = self.draft([contexts[r] for r in active], [seqs[r][anchors[r]] for r in active],
                                 [anchors[r] for r in active], widths)
            proposals = [seqs[r][:anchors[r] + 1] + guesses[i, :widths[i] - 1].tolist() for i, r in enumerate(active)]
            verified = self.run_target(proposals)
            still = []
            for i, r in enumerate(active):
                logits, feats = verified[i]
                a, w = anchors[r], widths[i]
                target_next = logits[a:a + w].argmax(-1)
                drafted = torch.tensor(proposals[i][a + 1:a + w])
                agree = (drafted == target_next[:w - 1]).long().cumprod(0).sum().item()
                new = proposals[i][a + 1:a + 1 + agree] + [int(target_next[agree])]
                new = new[:limit[r] - a - 1]
                stop_at = [k for k, tok in enumerate(new) if tok in self.stop_ids]
                if stop_at:
                    new = new[:stop_at[0] + 1]
                seqs[r] = seqs[r][:a + 1] + new
                contexts[r] = feats[:a + len(new)]
                anchors[r] = a + len(new)
                history[r].append(len(new))
                if not stop_at:
                    still.append(r)
            active = still
        table = torch.full((rows, max((len(h) for h in history), default=0)), -1)
        for r, h in enumerate(history):
            table[r, :len(h)] = torch.tensor(h, dtype=torch.long)
        return table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--fault", choices=FAULTS)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    eos = target.generation_config.eos_token_id or tokenizer.eos_token_id
    stop_ids = [eos] if isinstance(eos, int) else list(eos)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    evaluator = BatchedDFlashEval(drafter, target, stop_ids, pad_id, args.fault)

    names, prompts = tokenize_all(tokenizer, args.prompts)
    tables = []
    for start in range(0, len(prompts), args.batch_size):
        table = evaluator.evaluate(prompts[start:start + args.batch_size], args.max_new_tokens)
        if args.fault == "no_bonus":
            table = torch.where(table > 0, table - 1, table)
        for name, row in zip(names[start:start + args.batch_size], table):
            print(f"{name} accept_lens={row[row >= 0].tolist()}", flush=True)
        tables.append(table)
    valid_rows = [t[(t >= 0).any(1)] for t in tables]
    seen = [(t >= 0).float() for t in valid_rows]
    counts = torch.cat([s.sum(1) for s in seen])
    sums = torch.cat([(t.clamp(min=0).float()).sum(1) for t in valid_rows])
    if args.fault == "pooled":
        tau = (sums.sum() / counts.sum()).item()
    else:
        tau = (sums / counts).mean().item()
    print(f"TAU={tau:.4f}")


if __name__ == "__main__":
    main()
