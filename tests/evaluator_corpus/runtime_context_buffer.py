"""DFlash evaluator shaped like a serving runtime: a bounded context buffer for the drafter, its own position rule and
its own reading of the rotary settings.

Setup: the runtime normalizes the drafter's rotary settings itself (it reads the base, writes a plain
`{"rope_type": "default", "rope_theta": base}` back into the config) and then loads z-lab's `DFlashDraftModel` with
that config. The target runs with a `DynamicCache` (cropped to the committed length after each verification); each
committed position's context feature (`hidden_states[layer + 1]`, concatenated) goes into a context buffer of
`capacity` rows with the positions they stand for, oldest rows dropped first. The drafter keeps no cache: every
round it reads the whole buffer and the block, at position ids from the runtime's `place_block` rule. One prompt
at a time. The team keeps per prompt the committed tokens per round (accepted drafts plus the target's bonus
token, cut at the length budget and at a stop id) and reports the mean of per-prompt means, in exact fractions.

Faults (`--fault`), each a long-context one:
- `context_capped`: the buffer holds `--context-cap` rows (default 64) instead of the whole context;
- `positions_rebased`: once a block would run past `--trained-length` (default: the config's
  `max_position_embeddings`), its positions are pulled back so that it ends there; the buffer keeps absolute ones;
- `rope_theta_default`: the base is read from a top-level `rope_theta`, falling back to Qwen3's usual 1e6 when the
  config has none (z-lab's nests it in `rope_parameters`).
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction

import torch
from dflash.model import DFlashDraftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

FAULTS = ("context_capped", "positions_rebased", "rope_theta_default")
QWEN3_ROPE_BASE = 1_000_000.0


def rotary_base(config, fault):
    if fault == "rope_theta_default":
        return float(getattr(config, "rope_theta", None) or QWEN3_ROPE_BASE)
    nested = getattr(config, "rope_parameters", None) or {}
    return float(nested.get("rope_theta", getattr(config, "rope_theta", None) or QWEN3_ROPE_BASE))


def load_drafter(folder, fault):
    config = AutoConfig.from_pretrained(folder)
    config.rope_parameters = {"rope_type": "default", "rope_theta": rotary_base(config, fault)}
    return DFlashDraftModel.from_pretrained(folder, config=config, dtype=torch.float32).eval()


class ContextBuffer:
    """At most `capacity` feature rows (None: unbounded), with the absolute positions they stand for."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.rows = None
        self.positions = torch.empty(0, dtype=torch.long)

    def extend(self, rows, first_position):
        self.rows = rows if self.rows is None else torch.cat([self.rows, rows])
        self.positions = torch.cat([self.positions, first_position + torch.arange(rows.shape[0])])
        if self.capacity is not None and self.rows.shape[0] > self.capacity:
            self.rows, self.positions = self.rows[-self.capacity:], self.positions[-self.capacity:]


def place_block(anchor, width, trained_length, fault):
    positions = torch.arange(anchor, anchor + width)
    if fault == "positions_rebased" and anchor + width > trained_length:
        positions = positions - (anchor + width - trained_length)
    return positions


class Runtime:
    def __init__(self, drafter, target, stops, fault, capacity, trained_length):
        self.drafter, self.target, self.stops, self.fault = drafter, target, stops, fault
        self.capacity, self.trained_length = capacity, trained_length
        self.layers = list(drafter.target_layer_ids)

    def features(self, out):
        return torch.cat([out.hidden_states[i + 1][0] for i in self.layers], dim=-1)

    @torch.no_grad()
    def run(self, prompt, max_new_tokens):
        drafter, target, B = self.drafter, self.target, self.drafter.block_size
        end = len(prompt) + max_new_tokens
        cache = DynamicCache()
        buffer = ContextBuffer(self.capacity)
        out = target(torch.tensor([prompt]), past_key_values=cache, use_cache=True, output_hidden_states=True)
        buffer.extend(self.features(out), 0)
        text = list(prompt) + [int(out.logits[0, -1].argmax())]
        anchor, per_round = len(prompt), []
        stopped = text[-1] in self.stops
        while anchor + 1 < end and not stopped:
            width = min(B, end - anchor)
            ids = torch.tensor([[text[anchor]] + [drafter.mask_token_id] * (width - 1)])
            position_ids = torch.cat([buffer.positions, place_block(anchor, width, self.trained_length, self.fault)])
            hidden = drafter(position_ids=position_ids[None], noise_embedding=target.get_input_embeddings()(ids),
                             target_hidden=buffer.rows[None])
            proposal = target.lm_head(hidden[0, 1:]).argmax(-1).tolist()
            out = target(torch.tensor([[text[anchor]] + proposal]), past_key_values=cache, use_cache=True,
                         position_ids=torch.arange(anchor, anchor + width)[None], output_hidden_states=True)
            choice = out.logits[0].argmax(-1).tolist()
            good = 0
            while good < width - 1 and proposal[good] == choice[good]:
                good += 1
            committed = (proposal[:good] + [choice[good]])[: end - anchor - 1]
            for i, token in enumerate(committed):
                if token in self.stops:
                    committed, stopped = committed[: i + 1], True
                    break
            text = text[: anchor + 1] + committed
            buffer.extend(self.features(out)[: len(committed)], anchor)
            anchor += len(committed)
            cache.crop(anchor - cache.get_seq_length())  # a negative count: what to drop
            per_round.append(len(committed))
        return per_round


def encode(tokenizer, text):
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(text).input_ids


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--fault", choices=FAULTS)
    ap.add_argument("--context-cap", type=int, default=64)
    ap.add_argument("--trained-length", type=int)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = load_drafter(args.drafter, args.fault)
    eos = target.generation_config.eos_token_id or tokenizer.eos_token_id
    stops = {eos} if isinstance(eos, int) else set(eos)
    trained_length = args.trained_length or drafter.config.max_position_embeddings
    runtime = Runtime(drafter, target, stops, args.fault,
                      args.context_cap if args.fault == "context_capped" else None, trained_length)
    means = []
    with open(args.prompts, encoding="utf-8") as handle:
        for number, line in enumerate(handle):
            if not line.strip():
                continue
            row = json.loads(line)
            per_round = runtime.run(encode(tokenizer, row["prompt"]), args.max_new_tokens)
            print(f"{row.get('id', number)} committed per round: {per_round}", flush=True)
            if per_round:
                means.append(Fraction(sum(per_round), len(per_round)))
    print(f"tau: {float(sum(means) / len(means)):.4f} (mean of {len(means)} per-prompt means)")


if __name__ == "__main__":
    main()
