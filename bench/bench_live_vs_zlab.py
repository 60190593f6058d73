"""Our live DFlash loop vs z-lab's `dflash_generate`: identical acceptance lengths, throughput ratio.

Both loops run the same target and the same weights on the same prompts, alternating
(ours, z-lab) per prompt and repeat so that machine load hits both alike; the fastest
repeat of each counts.

    python bench/bench_live_vs_zlab.py [--drafters A.pt ...] [--max-new-tokens 256]
"""

from __future__ import annotations

import sys

import torch
from common import parse_args, setup, timed, write_report, zlab_generate, zlab_twin
from results import Row, record
from tabulate import tabulate

from impl.decoding import dflash_decode, mean_acceptance

REPEATS = 2


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], "live_vs_zlab.json")
    torch.manual_seed(0)
    target_dir, target, prompts, stop_ids, drafters = setup(args)
    rows, checkpoints = [], []
    for name, drafter in drafters.items():
        twin = zlab_twin(drafter)
        ours_s = zlab_s = 0.0
        identical, tokens, taus = True, 0, []
        for _, ids in prompts:
            best_ours = best_zlab = float("inf")
            for _ in range(REPEATS):
                ours, seconds = timed(lambda: dflash_decode(drafter, target, ids, args.max_new_tokens, stop_ids))
                best_ours = min(best_ours, seconds)
                ref, seconds = timed(lambda: zlab_generate(twin, target, ids, args.max_new_tokens, stop_ids))
                best_zlab = min(best_zlab, seconds)
            identical &= ours.acceptance_lengths == ref.acceptance_lengths and torch.equal(ours.output_ids,
                                                                                           ref.output_ids)
            ours_s, zlab_s = ours_s + best_ours, zlab_s + best_zlab
            tokens += len(ours.new_tokens)
            taus.append(ours.tau)
        checkpoint = {"checkpoint": name, "tau": mean_acceptance(taus), "identical_rounds": identical,
                      "new_tokens": tokens, "ours_tok_s": tokens / ours_s, "zlab_tok_s": tokens / zlab_s,
                      "throughput_ratio": zlab_s / ours_s}
        checkpoints.append(checkpoint)
        rows.append([name, f"{checkpoint['tau']:.3f}", identical, tokens, f"{checkpoint['ours_tok_s']:.1f}",
                     f"{checkpoint['zlab_tok_s']:.1f}", f"{checkpoint['throughput_ratio']:.2f}"])
    print(tabulate(rows, headers=["checkpoint", "τ", "same rounds", "new tokens", "ours tok/s", "z-lab tok/s",
                                  "ours / z-lab"], tablefmt="github"))
    write_report(args.out, {"bench": "live_vs_zlab", "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                            "repeats": REPEATS, "checkpoints": checkpoints})
    record("live_vs_zlab", " ".join(["python"] + sys.argv),
           [Row(f"live DFlash vs z-lab dflash_generate, {c['checkpoint']}: throughput ours / z-lab",
                c["throughput_ratio"], 1.0, ">=",
                detail=f"{c['ours_tok_s']:.1f} vs {c['zlab_tok_s']:.1f} tok/s, "
                       f"{'identical rounds' if c['identical_rounds'] else 'ROUNDS DIFFER'}") for c in checkpoints])
    if not all(c["identical_rounds"] for c in checkpoints):
        sys.exit("acceptance lengths differ from z-lab's")


if __name__ == "__main__":
    main()
