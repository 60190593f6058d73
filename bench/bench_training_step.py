"""One training step, ours (`impl.train_step.training_step`) vs speculators' `DFlashDraftModel.forward`.

Same drafter weights (the test world's drafter), same target, same packed batch (one row of
T tokens, two documents), same anchors (both draw them from torch's RNG after one seed) and
the same loss (KL to the target, fixed exponential decay, gamma 4: speculators' model-level
defaults; its eager loss: the fused one needs Triton). A step is the target's pass for the hidden states, the drafter's forward, the
loss and the backward; alternating runs, the fastest of REPEATS counting. Goals: identical
loss (float32 rounding); tokens/s ratio ours / speculators >= 1.0.

    python bench/bench_training_step.py [--length 1024] [--anchors 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from results import RESULTS, Row, record  # noqa: E402

REPEATS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from dflash_audit.formats import load_any
    from dflash_world import cached_test_world
    from impl.body_shapes import build_drafter
    from impl.extract import HiddenStateExtractor
    from impl.layers import speculators_to_zlab
    from impl.recipe import Recipe
    from foundation.target import load_target
    from impl.train_step import training_step
    from reference_adapters.speculators_adapter import SpeculatorsImplementation, resolve_loss_config

    world = cached_test_world()
    target, _ = load_target(world.target)
    loaded = load_any(world.root / "test-drafter.pt", world.target)
    ours = build_drafter(loaded.spec, loaded.state_dict).float().train()
    theirs = SpeculatorsImplementation().build_drafter(loaded.spec, loaded.state_dict, target).float().train()
    recipe = Recipe().replace(loss_fn="kl_div", per_position_loss_weight="fixed-exp-decay", gamma=4.0,
                                 max_anchors=args.anchors)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, target.config.vocab_size, (1, args.length), generator=gen)
    loss_mask = torch.ones(1, args.length, dtype=torch.long)
    document_ids = (torch.arange(args.length) // (args.length // 2))[None]
    extractor = HiddenStateExtractor(target, speculators_to_zlab(theirs.target_layer_ids))

    def step_ours():
        torch.manual_seed(0)
        ours.zero_grad(set_to_none=True)
        loss = training_step(ours, target, input_ids, loss_mask, document_ids, recipe).loss
        loss.backward()
        return float(loss.detach())

    def step_theirs():
        torch.manual_seed(0)
        theirs.zero_grad(set_to_none=True)
        with torch.no_grad():
            states = extractor(input_ids)
        _, loss, _ = theirs(states.context, input_ids, loss_mask, states.final_raw, document_ids,
                         max_anchors=args.anchors, loss_config=resolve_loss_config("kl_div", "eager"))
        loss.backward()
        return float(loss.detach())

    times = {"ours": [], "speculators": []}
    losses = {}
    for _ in range(REPEATS):  # alternating, so machine load hits both alike
        for name, step in (("ours", step_ours), ("speculators", step_theirs)):
            started = time.perf_counter()
            losses[name] = step()
            times[name].append(time.perf_counter() - started)
    best = {name: min(t) for name, t in times.items()}
    same = abs(losses["ours"] - losses["speculators"]) <= 1e-5 * max(1.0, abs(losses["speculators"]))
    rate = {name: args.length / seconds for name, seconds in best.items()}
    rows = [Row(f"training step T={args.length}, {args.anchors} anchors: ours / speculators tokens/s",
                rate["ours"] / rate["speculators"], 1.0, ">=",
                detail=f"{rate['ours']:.0f} vs {rate['speculators']:.0f} tokens/s ({best['ours']:.2f} s vs "
                       f"{best['speculators']:.2f} s); loss {losses['ours']:.6f} vs {losses['speculators']:.6f} "
                       f"({'identical' if same else 'DIFFERENT'})")]
    record("training_step", f"python bench/bench_training_step.py --length {args.length} --anchors {args.anchors}",
           rows, {"seconds": times, "losses": losses, "identical_loss": same}, results=args.results)
    if not same:
        raise SystemExit("the losses differ")


if __name__ == "__main__":
    main()
