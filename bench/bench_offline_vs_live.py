"""Offline τ (cached hidden states, replayed walks) vs z-lab's live `dflash_generate`.

Scenario: several checkpoints evaluated against one (target, prompts) pair. The cache is
built once (its cost reported separately); per checkpoint we time z-lab's live loop and
the offline replay over the same prompts and check that the per-prompt τ are identical.
The offline replay walks all prompts at once (`offline_rounds_batch`, as `eval` and `compare`
call it, 16 prompts at a time); the prompt-by-prompt path (`offline_rounds`) is timed too. Runs alternate and repeat so that
machine load hits both alike; the fastest repeat of each counts.

    python bench/bench_offline_vs_live.py [--drafters A.pt B ...] [--max-new-tokens 256]
"""

from __future__ import annotations

import sys
import tempfile

import torch
from common import parse_args, setup, timed, write_report, zlab_generate, zlab_twin
from results import Row, record
from tabulate import tabulate

from impl.decoding import mean_acceptance
from impl.offline import HiddenStateCache, find_mismatch, load_or_build_cache, offline_rounds, offline_rounds_batch

REPEATS = 3


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], "offline_vs_live.json")
    torch.manual_seed(0)
    target_dir, target, prompts, stop_ids, drafters = setup(args)
    with tempfile.TemporaryDirectory() as cache_dir:
        cache, build_s = timed(lambda: load_or_build_cache(cache_dir, target_dir, target, prompts,
                                                           args.max_new_tokens, stop_ids))
        _, load_s = timed(lambda: HiddenStateCache.load(f"{cache_dir}/{cache.key}.safetensors"))

    rows, checkpoints = [], []
    for name, drafter in drafters.items():
        twin = zlab_twin(drafter)
        live_s = offline_s = per_prompt_s = float("inf")
        for _ in range(REPEATS):
            live_runs, seconds = timed(lambda: [zlab_generate(twin, target, ids, args.max_new_tokens, stop_ids)
                                                for _, ids in prompts])
            live_s = min(live_s, seconds)
            offline_runs, seconds = timed(lambda: offline_rounds_batch(drafter, target, cache, cache.prompts))
            offline_s = min(offline_s, seconds)
            one_by_one, seconds = timed(lambda: [offline_rounds(drafter, target, cache, entry)
                                                 for entry in cache.prompts])
            per_prompt_s = min(per_prompt_s, seconds)
        if one_by_one != offline_runs:
            raise AssertionError(f"{name}: prompt-by-prompt replay differs from the batched one")
        mismatches = [m.describe() for entry, off, live in zip(cache.prompts, offline_runs, live_runs)
                      if (m := find_mismatch(entry, off, live.acceptance_lengths, live.output_ids))]
        live_tau = mean_acceptance([mean_acceptance(r.acceptance_lengths) for r in live_runs])
        offline_tau = mean_acceptance([mean_acceptance(r) for r in offline_runs])
        identical = all(off == live.acceptance_lengths for off, live in zip(offline_runs, live_runs))
        checkpoints.append({"checkpoint": name, "zlab_live_s": live_s, "offline_s": offline_s,
                            "speedup": live_s / offline_s, "offline_per_prompt_s": per_prompt_s,
                            "speedup_per_prompt": live_s / per_prompt_s, "zlab_tau": live_tau,
                            "offline_tau": offline_tau, "identical_rounds": identical, "mismatches": mismatches})
        rows.append([name, f"{live_tau:.3f}", f"{offline_tau:.3f}", identical, f"{live_s:.2f}", f"{offline_s:.3f}",
                     f"{live_s / offline_s:.1f}x", f"{per_prompt_s:.3f}", f"{live_s / per_prompt_s:.1f}x"])
    print(tabulate(rows, headers=["checkpoint", "τ z-lab live", "τ offline", "same rounds", "z-lab live s",
                                  "offline s", "speedup", "offline s (prompt by prompt)", "speedup"],
                   tablefmt="github"))
    total_live = sum(c["zlab_live_s"] for c in checkpoints)
    total_offline = sum(c["offline_s"] for c in checkpoints)
    print(f"one-time cache: build {build_s:.2f}s, load {load_s:.3f}s; {len(prompts)} prompts x "
          f"{args.max_new_tokens} new tokens; per-checkpoint speedup {total_live / total_offline:.1f}x, "
          f"including the cache build over {len(checkpoints)} checkpoints "
          f"{total_live / (total_offline + build_s):.1f}x")
    for c in checkpoints:
        for line in c["mismatches"]:
            print(f"mismatch ({c['checkpoint']}): {line}")
    write_report(args.out, {"bench": "offline_vs_live", "prompts": len(prompts),
                            "max_new_tokens": args.max_new_tokens, "cache_build_s": build_s, "cache_load_s": load_s,
                            "repeats": REPEATS, "checkpoints": checkpoints,
                            "speedup_per_checkpoint": total_live / total_offline})
    record(f"offline_vs_live[{args.max_new_tokens}]", " ".join(["python"] + sys.argv),
           [Row(f"offline τ vs z-lab live, {c['checkpoint']}, {len(prompts)} prompts x {args.max_new_tokens} tokens: "
                "speedup", c["speedup"], 30.0, ">=",
                detail=f"{c['zlab_live_s']:.2f} s vs {c['offline_s']:.3f} s; floor 10x "
                       f"{'met' if c['speedup'] >= 10 else 'NOT met'}; τ {c['offline_tau']:.3f} vs {c['zlab_tau']:.3f}, "
                       f"{'identical rounds' if c['identical_rounds'] else 'ROUNDS DIFFER'}")
            for c in checkpoints], {"cache_build_s": build_s})


if __name__ == "__main__":
    main()
