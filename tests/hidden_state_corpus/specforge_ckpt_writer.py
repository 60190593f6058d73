"""Hidden-state dataset writer in SpecForge's offline DFlash layout: one `data_{i}.ckpt` a record, via `torch.save`.

Each record is a dict of `input_ids` [seq] (int64), `loss_mask` [seq] (int64) and `hidden_states`
[seq, len(target_layer_ids) * hidden] in float16, the features z-lab's `extract_context_feature` reads: HF
`output_hidden_states[layer_id + 1]` for each of the drafter's `dflash_config.target_layer_ids`, concatenated
(SpecForge's `scripts/prepare_dflash_hidden_states_hf.py`). The layer ids come from `--draft-config` (a drafter
`config.json` with `dflash_config.target_layer_ids`) or default to z-lab's rule for the target with 5 layers.

`python tests/hidden_state_corpus/specforge_ckpt_writer.py --target DIR --out DIR [--records N]
[--draft-config FILE] [--fault NAME]`: seeded random rows of 32-64 tokens, the first third of each masked out of the
loss (its "prompt"), the rest in it. `--out` must not exist yet. Faults: zero_states (every hidden state zero),
layer_off_by_one (the +1 offset forgotten: `hidden_states[layer_id]`, one layer shallower), last_layer_stripped (the
deepest of the target layers left out of the concatenation), short_record (record 1's hidden states miss their first
16 positions, its input_ids and loss_mask stay whole), after_norm (the deepest feature taken after the target's
final norm; for a deepest layer that is the target's last, transformers hands it over normed already).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM

FAULTS = ("zero_states", "layer_off_by_one", "last_layer_stripped", "short_record", "after_norm")
PREFIX_HIT = 16


def default_layer_ids(n_target, n_draft=5):
    start, end = 1, n_target - 3
    return [round(start + i * (end - start) / (n_draft - 1)) for i in range(n_draft)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--records", type=int, default=4)
    ap.add_argument("--draft-config")
    ap.add_argument("--fault", choices=FAULTS)
    args = ap.parse_args(argv)
    if os.path.exists(args.out):
        ap.error(f"{args.out} exists; give a new folder")
    if args.fault == "short_record" and args.records < 2:
        ap.error("short_record needs at least 2 records")

    model = AutoModelForCausalLM.from_pretrained(args.target).eval()
    n_layers = model.config.num_hidden_layers
    if args.draft_config:
        with open(args.draft_config) as f:
            layer_ids = json.load(f)["dflash_config"]["target_layer_ids"]
    else:
        layer_ids = default_layer_ids(n_layers)
    offset = 0 if args.fault == "layer_off_by_one" else 1
    picked = layer_ids[:-1] if args.fault == "last_layer_stripped" else layer_ids

    os.makedirs(args.out)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for r in range(args.records):
            seq = int(torch.randint(32, 65, (1,), generator=gen))
            input_ids = torch.randint(0, model.config.vocab_size, (seq,), generator=gen)
            loss_mask = torch.zeros(seq, dtype=torch.long)
            loss_mask[seq // 3:] = 1
            out = model(input_ids=input_ids[None], output_hidden_states=True, use_cache=False)
            selected = [out.hidden_states[i + offset][0] for i in picked]
            if args.fault == "after_norm" and picked[-1] != n_layers - 1:
                selected[-1] = model.model.norm(selected[-1])
            hidden_states = torch.cat(selected, dim=-1).to(torch.float16)
            if args.fault == "zero_states":
                hidden_states = torch.zeros_like(hidden_states)
            if args.fault == "short_record" and r == 1:
                hidden_states = hidden_states[PREFIX_HIT:].clone()
            path = os.path.join(args.out, f"data_{r}.ckpt")
            torch.save({"input_ids": input_ids, "loss_mask": loss_mask, "hidden_states": hidden_states}, path + ".tmp")
            os.replace(path + ".tmp", path)
            print(f"data_{r}.ckpt: {seq} tokens, hidden_states {list(hidden_states.shape)}, layers {picked} "
                  f"(hidden_states index +{offset})")


if __name__ == "__main__":
    main()
