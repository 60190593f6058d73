"""The slot layout's effect on τ, measured: two drafters identical but for `sample_from_anchor`.

Both are trained by our trainer on the same data with the same seed, steps and recipe (speculators' KL
loss, fixed decay): one with the anchor as the bonus token (slot k >= 1 proposes the token at anchor + k,
B - 1 proposals per block), one sampling from the anchor (every slot proposes the next token, B per block,
DSpark's layout). Each is decoded live (greedy, lossless: the output must equal the other's) on the same
prompts, and replayed offline from one cache (τ live = offline for both). The first row is the τ ratio,
sample-from-anchor over anchor-as-bonus, held to DSpark's premise (one more proposal per block pays: >= 1);
it reports whether that holds for this pair, it is not assumed.

    python bench/bench_slot_layout.py [--steps 400] [--max-new-tokens 128]
"""

from __future__ import annotations

import sys
import tempfile

import torch
from common import BENCH_DRAFTERS, parse_args, setup, timed, trained_drafter, write_report
from results import Row, record
from tabulate import tabulate

from impl.decoding import dflash_decode, mean_acceptance
from impl.offline import load_or_build_cache, offline_rounds_batch

LAYOUTS = {"anchor-as-bonus": False, "sample-from-anchor": True}


def layout_drafters(steps: int):
    def build(world):
        base = {**BENCH_DRAFTERS["sound"], "steps": steps}
        return [trained_drafter(world, f"slot-{name}-{steps}", {**base, "sample_from_anchor": layout})
                for name, layout in LAYOUTS.items()]
    return build


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], "slot_layout.json", extra=lambda p: p.add_argument(
        "--steps", type=int, default=400, help="training steps of each drafter (the same for both)"))
    if args.max_new_tokens == 256 and "--max-new-tokens" not in sys.argv:
        args.max_new_tokens = 128  # keep the run to a few CPU minutes
    torch.manual_seed(0)
    (target_dir, target, prompts, stop_ids, drafters), train_s = timed(
        lambda: setup(args, layout_drafters(args.steps)))
    with tempfile.TemporaryDirectory() as cache_dir:
        cache = load_or_build_cache(cache_dir, target_dir, target, prompts, args.max_new_tokens, stop_ids)
    results, outputs = {}, {}
    for name, drafter in drafters.items():
        live, live_s = timed(lambda: [dflash_decode(drafter, target, ids, args.max_new_tokens, stop_ids)
                                      for _, ids in prompts])
        offline = offline_rounds_batch(drafter, target, cache, cache.prompts)
        outputs[name] = [run.output_ids for run in live]
        results[name] = {"sample_from_anchor": drafter.spec.sample_from_anchor,
                         "speculative_tokens": drafter.spec.speculative_tokens,
                         "tau_live": mean_acceptance([run.tau for run in live]),
                         "tau_offline": mean_acceptance([mean_acceptance(r) for r in offline]),
                         "rounds_identical": [r for r in offline] == [run.acceptance_lengths for run in live],
                         "longest_round": max(max(run.acceptance_lengths) for run in live), "live_s": live_s}
    names = list(drafters)
    same_output = all(torch.equal(a, b) for a, b in zip(*(outputs[n] for n in names)))
    print(tabulate([[n, r["sample_from_anchor"], r["speculative_tokens"], f"{r['tau_live']:.3f}",
                     f"{r['tau_offline']:.3f}", r["longest_round"]] for n, r in results.items()],
                   headers=["drafter", "sample_from_anchor", "proposals/block", "τ live", "τ offline", "longest"],
                   tablefmt="github"))
    write_report(args.out, {"bench": "slot_layout", "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                            "steps": args.steps, "drafters": results, "same_output": same_output,
                            "setup_and_training_s": train_s})
    by_layout = {r["sample_from_anchor"]: r for r in results.values()}
    if set(by_layout) != {False, True}:
        sys.exit("needs one drafter of each slot layout")
    bonus, anchor = by_layout[False], by_layout[True]
    rows = [Row(f"slot layout, {args.steps} steps, same data and seed: τ sample-from-anchor / τ anchor-as-bonus",
                anchor["tau_live"] / bonus["tau_live"], 1.0, ">=",
                detail=f"τ {anchor['tau_live']:.3f} ({anchor['speculative_tokens']} proposals/block) vs "
                       f"{bonus['tau_live']:.3f} ({bonus['speculative_tokens']}); "
                       f"{'same output' if same_output else 'OUTPUT DIFFERS'}")]
    rows += [Row(f"slot layout, {name}: |τ live − τ offline|", abs(r["tau_live"] - r["tau_offline"]), 0.0, "<=",
                 unit="", detail="rounds identical" if r["rounds_identical"] else "ROUNDS DIFFER")
             for name, r in results.items()]
    record("slot_layout", " ".join(["python"] + sys.argv), rows)
    if not same_output or not all(r["rounds_identical"] for r in results.values()):
        sys.exit("the two layouts' outputs differ (both are lossless), or offline rounds differ from live ones")


if __name__ == "__main__":
    main()
