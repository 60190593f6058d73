"""What SpecForge's inference loop costs in τ: `spec_generate` vs z-lab's `dflash_generate`, same weights.

The test world's trained drafter (one sliding layer, window 48, and one full layer: the drafter of
conformance/test_live_decoding.py) decodes the same prompts greedily through each loop, as trained
and with every layer made full attention (which is what SpecForge's loop runs either way: it calls
the drafter with no mask). Both loops must emit the same tokens (greedy decoding is lossless); the
τ gap is the cost of the unmasked sliding layer (docs/held.md, "SpecForge 0.2.0 against the references").

    python bench/bench_specforge_tau.py [--prompts N] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from results import Row, record  # bench/ is on sys.path: run as a script
from tabulate import tabulate

from dflash_audit.prompts import load_prompts, tokenize_prompts
from dflash_world import cached_test_world
from dflash_world.drafter import cached_test_drafter
from foundation.atomic import atomic_write_bytes
from foundation.target import load_target
from foundation.target_vocab import stop_token_ids
from held.specforge import SpecForgeImplementation
from drafter_files.checkpoint import load_checkpoint
from impl.decoding import mean_acceptance
from reference_adapters.zlab_adapter import ZlabImplementation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("reports") / "bench" / "specforge_tau.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = cached_test_world()
    ckpt = load_checkpoint(cached_test_drafter(world))
    target, tokenizer = load_target(world.target)
    prompts = tokenize_prompts(tokenizer, load_prompts(world.prompts))[:args.prompts]
    stop = stop_token_ids(world.target, tokenizer).ids
    variants = {"as trained": ckpt.spec,
                "every layer full": ckpt.spec.replace(layer_types=("full_attention",) * len(
                    ckpt.spec.layer_types), sliding_window=None)}
    rows, results = [], []
    for label, spec in variants.items():
        runs = {}
        for impl in (SpecForgeImplementation(), ZlabImplementation()):
            drafter = impl.build_drafter(spec, ckpt.state_dict, target)
            with torch.no_grad():
                runs[impl.name] = [impl.generate(drafter, target, ids, args.max_new_tokens, stop) for _, ids in prompts]
        tau = {name: mean_acceptance([sum(r.acceptance_lengths) / len(r.acceptance_lengths) for r in rs])
               for name, rs in runs.items()}
        same_ids = sum(torch.equal(a.output_ids, b.output_ids) for a, b in zip(runs["specforge"], runs["zlab"]))
        same_rounds = sum(a.acceptance_lengths == b.acceptance_lengths for a, b in zip(runs["specforge"], runs["zlab"]))
        results.append({"layers": label, "layer_types": list(spec.layer_types), "tau": tau,
                        "same_output_ids": same_ids, "same_rounds": same_rounds, "prompts": len(prompts)})
        rows.append([label, f"{tau['specforge']:.3f}", f"{tau['zlab']:.3f}", f"{same_ids}/{len(prompts)}",
                     f"{same_rounds}/{len(prompts)}"])
    print(tabulate(rows, headers=["drafter layers", "τ SpecForge", "τ z-lab", "same tokens", "same rounds"],
                   tablefmt="github"))
    payload = {"bench": "specforge_tau", "max_new_tokens": args.max_new_tokens, "results": results}
    atomic_write_bytes(args.out, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=2)))
    # The goal is losslessness (greedy: both loops emit the target's own tokens); the τ is what it costs.
    record("specforge_tau", "python bench/bench_specforge_tau.py", [
        Row(f"SpecForge spec_generate vs z-lab dflash_generate, drafter layers {r['layers']}: prompts with "
            f"identical tokens", r["same_output_ids"] / r["prompts"], 1.0, ">=", unit="",
            detail=f"τ {r['tau']['specforge']:.3f} vs {r['tau']['zlab']:.3f}; {r['same_rounds']}/{r['prompts']} "
                   "identical rounds (SpecForge's per-round lengths are its own bookkeeping)"
                   + ("; the τ gap is what its unmasked sliding layer costs" if r["layers"] == "as trained" else ""))
        for r in results])


if __name__ == "__main__":
    main()
