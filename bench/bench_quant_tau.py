"""The τ each quantization costs on llama.cpp: the test world's all-full drafter (layers 1 and 2: llama.cpp cannot
capture the target's last layer) served by a real llama-server b11434 as f32, f16, q8_0 and q4_k_m (llama.cpp's own
converter and llama-quantize), per prompt: served τ beside the audited τ of the drafter as trained, rounds equal to
the audit's replay or explained by a named finding (the dequantized replay). The f32 live check's wall time and
peak memory are set against `dflash-audit eval` on the same prompts (goal: within 2x).

    python bench/bench_quant_tau.py [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from bench_served_tau import eval_cost, explained, llamacpp_drafter  # bench/ is on sys.path: run as a script
from results import Row, record
from tabulate import tabulate

from dflash_audit.audit.live_llamacpp import live_llamacpp
from dflash_world import cached_test_world
from foundation.atomic import atomic_write_bytes

QUANTS = ("f32", "f16", "q8_0", "q4_k_m")


def peak_rss_mb(sections: dict) -> tuple[float, float]:
    """(this process's peak, the largest llama-server's own peak): both were held at once while a server ran. (The
    children's ru_maxrss would be eval's, run first.)"""
    servers = [s.get("engine_peak_rss_mb") or 0 for s in sections.values()]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, max(servers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("reports") / "bench" / "quant_tau.json")
    args = parser.parse_args()
    world = cached_test_world()
    with tempfile.TemporaryDirectory(prefix="quant-tau-") as tmp:
        root = Path(tmp)
        llamacpp_drafter(world, root / "zlab")
        eval_wall, eval_rss = eval_cost(root / "zlab", world.target, world.prompts, args.max_new_tokens)
        sections, walls = {}, {}
        for quant in QUANTS:
            started = time.monotonic()
            sections[quant] = live_llamacpp(root / "zlab", world.target, world.prompts, args.max_new_tokens,
                                            quant=None if quant == "f32" else quant, workdir=root / quant)
            walls[quant] = time.monotonic() - started
    audit_rss, server_rss = peak_rss_mb(sections)
    live_rss = audit_rss + server_rss
    table, rows, summary = [], [], {}
    for quant, section in sections.items():
        total, equal, covered = explained(section)
        types = sorted(set(section["quantized_tensors"].values())) or ["F32"]
        summary[quant] = {"rounds": total, "equal": equal, "explained": covered, "types": types,
                          "findings": sorted({f.key for f in section["findings"]}),
                          "greedy_identical": section["greedy_identical"],
                          "served_tau": [p["served_tau"] for p in section["prompts"]],
                          "audited_tau": [p["audited_tau"] for p in section["prompts"]]}
        for p in section["prompts"]:
            table.append([quant, "+".join(types), p["id"], f"{p['served_tau']:.3f}", f"{p['audited_tau']:.3f}",
                          f"{p['audited_tau'] - p['served_tau']:+.3f}", f"{p['rounds_equal']}/{p['rounds']}",
                          ", ".join(p.get("explained_by", [])) or "-"])
        served_mean, audited_mean = (sum(values) / len(values) for values in
                                     (summary[quant]["served_tau"], summary[quant]["audited_tau"]))
        rows.append(Row(f"llama.cpp b11434 serving the all-full test drafter at {quant} ({'+'.join(types)}): rounds "
                        f"equal to the audit's or explained by a named finding", covered / total, 1.0, ">=", unit="",
                        detail=f"{equal}/{total} equal; served τ {served_mean:.3f} vs audited {audited_mean:.3f}; "
                               f"greedy identical: {section['greedy_identical']}"))
    print(tabulate(table, headers=["quant", "types", "prompt", "served τ", "audited τ", "τ cost", "rounds equal",
                                   "explained by"], tablefmt="github"))
    rows.append(Row("llama.cpp live check (f32: conversion, greedy reference, served run, replay) / dflash-audit "
                    "eval, wall time", walls["f32"] / eval_wall, 2.0, "<=",
                    detail=f"{walls['f32']:.1f} s vs {eval_wall:.1f} s"))
    rows.append(Row("llama.cpp live check (this process + llama-server) / dflash-audit eval, peak memory",
                    live_rss / eval_rss, 2.0, "<=",
                    detail=f"{audit_rss:.0f} MB + {server_rss} MB vs {eval_rss:.0f} MB"))
    payload = {"bench": "quant_tau", "max_new_tokens": args.max_new_tokens, "summary": summary, "walls_s": walls,
               "eval_wall_s": eval_wall, "eval_peak_rss_mb": eval_rss, "live_peak_rss_mb": live_rss,
               "command": sections["f32"]["command"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=2)))
    record("quant_tau", "python bench/bench_quant_tau.py", rows)


if __name__ == "__main__":
    main()
