"""Why the τ methods give different figures, measured on the test world: the τ table of the world's drafter over
the benchmark fixtures (tests/fixtures/benchmarks), every τ method, thinking off and on, T = 0 and T = 0.8 over
three seeds; then each method's τ as a ratio of live greedy τ. The figures of docs/tau-methods.md.

    python -m bench.tau_methods [--max-new-tokens 64] [--html reports/bench/tau-table.html]

Not part of `make bench` (no speed figure): a fixed-step measurement, the same on any machine.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "benchmarks"
SETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "alpaca")
FILES = {"mt-bench": "mt_bench.jsonl"}


def main() -> None:
    from dflash_audit.audit.eval import run_table
    from dflash_audit.flags.eval import EvalFlags
    from dflash_world import cached_test_world
    from dflash_world.drafter import cached_test_drafter

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--html", type=Path, default=None)
    args = parser.parse_args()
    world = cached_test_world()
    prompts = [f"{name}:{FIXTURES / FILES.get(name, name + '.jsonl')}" for name in SETS]
    template = str(REPO / "dflash_world" / "chat_template_thinking.jinja")
    data = run_table(EvalFlags(drafter=cached_test_drafter(world), target=world.target, prompts=prompts,
                               tau_method=["live", "zlab-loop", "teacher-forced", "zlab-benchmark"],
                               temperature=[0.0, 0.8], seeds="0,1,2", max_new_tokens=args.max_new_tokens,
                               chat_template=template, tau_by="thinking", html_path=args.html,
                               device="cpu", dtype="float32"))  # as the figures were measured
    print("\nτ of each method over live greedy τ, per set (thinking off):")
    for name in SETS:
        cells = {(c["method"], c["temperature"]): c["tau"] for c in data["cells"]
                 if c["set"] == name and c["chat"] == "thinking off"}
        live = cells[("live", 0.0)]
        ratios = ", ".join(f"{method} T={t:g} {tau / live:.2f}" for (method, t), tau in sorted(cells.items()))
        print(f"  {name}: live τ {live:.3f}; {ratios}")
    for chat in ("thinking off", "thinking on"):
        forced = [c["tau"] for c in data["cells"] if c["method"] == "teacher-forced" and c["chat"] == chat]
        live = [c["tau"] for c in data["cells"] if c["method"] == "live" and c["temperature"] == 0 and c["chat"] == chat
                and c["set"] in {x["set"] for x in data["cells"] if x["method"] == "teacher-forced"}]
        print(f"mean over sets with references, {chat}: teacher-forced / live = "
              f"{statistics.mean(forced) / statistics.mean(live):.2f}")
    on = {c["set"]: c["tau"] for c in data["cells"] if c["method"] == "live" and c["temperature"] == 0
          and c["chat"] == "thinking on"}
    off = {c["set"]: c["tau"] for c in data["cells"] if c["method"] == "live" and c["temperature"] == 0
           and c["chat"] == "thinking off"}
    print("live greedy τ, thinking on / off: " + ", ".join(f"{s} {on[s]:.2f}/{off[s]:.2f}" for s in SETS))


if __name__ == "__main__":
    main()
