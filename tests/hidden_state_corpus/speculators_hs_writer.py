"""Hidden-state dataset writer in speculators' / vLLM extract_hidden_states layout: one `hs_{i}.safetensors` a record.

Each record holds `token_ids` [seq] (int64) and `hidden_states` [seq, n_layers, hidden] in the target's dtype, the
layers in vLLM's convention (`Qwen2Model.forward` / `_maybe_add_hidden_state` in vLLM: id 0 is the embeddings, id i
the output of decoder layer i-1, hidden state plus residual; id N, the last, is the final layer *before* the final
norm). The default ids are z-lab's rule for the target (`build_target_layer_ids(N, 5)`, read as HF
`hidden_states[i + 1]`, i.e. vLLM id i + 1) followed by N, the layer speculators' `train/data.py` splits off as
`verifier_last_hidden_states` (`hidden_states[:, -1]`; the others are flattened into the drafter's input).
Here the target is run with transformers: the raw decoder-layer outputs are taken with forward hooks, so id N is
the last layer's raw output.

`python tests/hidden_state_corpus/speculators_hs_writer.py --target DIR --out DIR [--records N] [--layer-ids 2,4,...]
[--prompts FILE.jsonl] [--fault NAME]`: token ids come from the prompts' `"prompt"` texts (the target's tokenizer)
or, without `--prompts`, from seeded random rows of 24-64 tokens. `--out` must not exist yet; it is written as
`hs_0.safetensors`, `hs_1.safetensors`, ... Faults: zero_states (every hidden state zero, as hybrid targets have
written them), layer_off_by_one (each auxiliary layer taken one layer deeper: id i holds id i+1), last_layer_stripped
(id N left out), short_record (record 1 is missing its first 16 positions, as after a prefix-cache hit, while its
token_ids stay whole), after_norm (id N stored after the final norm).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

FAULTS = ("zero_states", "layer_off_by_one", "last_layer_stripped", "short_record", "after_norm")
PREFIX_HIT = 16


def zlab_layers(n_target, n_draft=5):
    start, end = 1, n_target - 3
    return [round(start + i * (end - start) / (n_draft - 1)) for i in range(n_draft)]


def token_rows(args, target_dir, vocab):
    if args.prompts:
        tok = AutoTokenizer.from_pretrained(target_dir)
        with open(args.prompts, encoding="utf-8") as f:
            texts = [json.loads(line)["prompt"] for line in f if line.strip()]
        return [tok(t)["input_ids"] for t in texts[: args.records]]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(24, 65, (args.records,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--records", type=int, default=4)
    ap.add_argument("--layer-ids", help="vLLM-convention ids, comma-separated, the last one N (default: z-lab's + N)")
    ap.add_argument("--prompts")
    ap.add_argument("--fault", choices=FAULTS)
    args = ap.parse_args(argv)
    if os.path.exists(args.out):
        ap.error(f"{args.out} exists; give a new folder")
    if args.fault == "short_record" and args.records < 2:
        ap.error("short_record needs at least 2 records")

    model = AutoModelForCausalLM.from_pretrained(args.target).eval()
    n = model.config.num_hidden_layers
    ids = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else [i + 1 for i in zlab_layers(n)] + [n]
    aux, last = ids[:-1], ids[-1]
    if args.fault == "layer_off_by_one":
        aux = [i + 1 for i in aux]
    wanted = aux + ([] if args.fault == "last_layer_stripped" else [last])

    captured = {}
    model.model.embed_tokens.register_forward_hook(lambda _m, _a, out: captured.__setitem__(0, out))
    for k, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda _m, _a, out, k=k: captured.__setitem__(k + 1, out[0] if isinstance(out, tuple) else out))

    os.makedirs(args.out)
    with torch.no_grad():
        for r, row in enumerate(token_rows(args, args.target, model.config.vocab_size)):
            captured.clear()
            model(torch.tensor([row]))
            states = []
            for i in wanted:
                h = captured[i][0]
                if args.fault == "after_norm" and i == last:
                    h = model.model.norm(h)
                states.append(h)
            hidden = torch.stack(states, dim=1).contiguous()  # [seq, n_layers, hidden]
            if args.fault == "zero_states":
                hidden = torch.zeros_like(hidden)
            if args.fault == "short_record" and r == 1:
                hidden = hidden[PREFIX_HIT:].contiguous()
            record = {"token_ids": torch.tensor(row, dtype=torch.long), "hidden_states": hidden}
            path = os.path.join(args.out, f"hs_{r}.safetensors")
            save_file(record, path + ".tmp")
            os.replace(path + ".tmp", path)
            print(f"hs_{r}.safetensors: {len(row)} tokens, hidden_states {list(hidden.shape)}, layers {wanted}")


if __name__ == "__main__":
    main()
