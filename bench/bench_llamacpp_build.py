"""What the portable llama.cpp build costs in speed: `build-avx2` (GGML_NATIVE=OFF, SSE4.2/AVX/AVX2/BMI2/FMA/F16C
named, no AVX-512: the build `make setup` makes and the tests serve with, the same kernels on every x86-64 machine)
against `build-native` (-march=native: this CPU's widest instructions), side by side in one run, the two builds
interleaved in every repeat so that the machine's load falls on both alike.

Measured per build, one llama-server thread each (as the live check runs it), greedy, the median over repeats of
tokens per second of the server's own CPU time (`cpu_tok_s`: on a shared machine the wall time measures the
neighbours), beside the server's wall-clock timings of generation and prompt processing:
- `world target`: the test world's target alone;
- `world target + drafter`: the live check's served run (the all-full test drafter, f32);
- `117M target`: a random Qwen3 of 12 layers, hidden 1024 (the world's tokenizer), f32, alone, where the matrix
  kernels, not the server, take the time.

    python bench/bench_llamacpp_build.py [--repeats 3] [--max-new-tokens 64]

Needs both builds (`python -m serving_engines.live.llamacpp_env native` makes the second, ~15 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import os
import tempfile
from pathlib import Path

import torch
from bench_served_tau import llamacpp_drafter  # bench/ is on sys.path: run as a script
from results import Row, record
from tabulate import tabulate

from dflash_audit.rounds.replay import load_prompts_for
from dflash_audit.cli import main as cli
from dflash_world import cached_test_world
from dflash_world.target_training import random_qwen3
from foundation.target import load_target
from serving_engines.live.llamacpp_convert import run_converter, target_gguf
from serving_engines.live.llamacpp_env import find_llamacpp
from serving_engines.live.llamacpp_server import LlamaServer

BUILDS = ("avx2", "native")


def big_target(folder: Path, world_target: Path) -> Path:
    """A 117M-parameter random Qwen3 with the world's tokenizer, as an f32 GGUF."""
    _, tokenizer = load_target(world_target)
    model = random_qwen3(12, 1024, len(tokenizer), seed=0, head_dim=64, heads=16, kv_heads=8, max_positions=4096)
    model.config.eos_token_id = 0
    model.save_pretrained(folder / "hf")
    for file in world_target.iterdir():  # the tokenizer's files, not the world's weights or config
        if file.name.startswith("tokenizer") or file.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copyfile(file, folder / "hf" / file.name)
    out = folder / "big-f32.gguf"
    run_converter(folder / "hf", out, "f32")
    return out


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time (/proc/PID/stat), which a busy neighbour on the other core does not
    inflate as it inflates the wall time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_features(engine, target: Path, log: Path) -> str:
    """The instruction sets the build's ggml CPU backend was compiled for, as the server logs them at -lv 4
    (`system_info: ... CPU : SSE3 = 1 | ... AVX512 = 1 | ...`)."""
    with LlamaServer(engine, target, log, log_vocabulary=True):
        pass
    line = next((ln for ln in log.read_text(errors="replace").splitlines() if "system_info" in ln), "")
    cpu = line.split("CPU :", 1)[1] if "CPU :" in line else ""
    return " ".join(k.strip() for k, v in (kv.split("=", 1) for kv in cpu.split("|") if "=" in kv) if v.strip() == "1")


def measure(engine, target: Path, drafter: Path | None, prompts: list[list[int]], tokens: int, log: Path) -> dict:
    """Tokens per second of one server over the prompts: per second of its own CPU time (the figure compared), and
    generation and prompt processing as the server's wall-clock timings give them."""
    with LlamaServer(engine, target, log, drafter, 7 if drafter else None) as server:
        server.complete(prompts[0], 4)  # warm: the first request pays for the weights' first touch
        before, made, gen, prompt = cpu_seconds(server.process.pid), 0, [], []
        for ids in prompts:
            result = server.complete(ids, tokens)
            made += len(result["tokens"])
            gen.append(result["timings"].get("predicted_per_second", 0.0))
            prompt.append(result["timings"].get("prompt_per_second", 0.0))
        cpu = cpu_seconds(server.process.pid) - before
    return {"cpu_tok_s": made / cpu, "gen_tok_s": statistics.mean(gen), "prompt_tok_s": statistics.mean(prompt)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("reports") / "bench" / "llamacpp_build.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engines = {build: find_llamacpp(variant=build) for build in BUILDS}
    world = cached_test_world()
    _, tokenizer = load_target(world.target)
    prompts = [p["ids"] for p in load_prompts_for(Path(world.target), Path(world.prompts), tokenizer)]
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="llamacpp-build-") as tmp:
        root = Path(tmp)
        llamacpp_drafter(world, root / "zlab")
        assert cli(["convert", "--from", str(root / "zlab"), "--to", str(root / "gguf"), "--for", "llamacpp",
                    "--target", str(world.target)]) == 0
        world_gguf, _ = target_gguf(Path(world.target))
        features = {build: cpu_features(engines[build], world_gguf, root / f"{build}-features.log") for build in BUILDS}
        setups = {"world target": (world_gguf, None), "world target + drafter": (world_gguf, root / "gguf" /
                                                                                  "drafter-f32.gguf"),
                  "117M target": (big_target(root, Path(world.target)), None)}
        for repeat in range(args.repeats):
            for name, (target, drafter) in setups.items():
                for build in BUILDS if repeat % 2 == 0 else reversed(BUILDS):
                    runs.setdefault((name, build), []).append(
                        measure(engines[build], target, drafter, prompts, args.max_new_tokens,
                                root / f"{build}-{repeat}.log"))
    table, figures = [], {}
    for name in ("world target", "world target + drafter", "117M target"):
        for key in ("cpu_tok_s", "gen_tok_s", "prompt_tok_s"):
            if name == "world target + drafter" and key != "cpu_tok_s":
                continue  # with a drafter the server's per-phase timings count the verifier only
            values = {b: sorted(r[key] for r in runs[(name, b)]) for b in BUILDS}
            medians = {b: statistics.median(v) for b, v in values.items()}
            ratio = medians["avx2"] / medians["native"]
            figures[f"{name}: {key}"] = {**medians, "portable_over_native": round(ratio, 3),
                                         "runs": {b: [round(x, 1) for x in v] for b, v in values.items()}}
            table.append([name, key, *(f"{medians[b]:.1f} ({values[b][0]:.0f}–{values[b][-1]:.0f})" for b in BUILDS),
                          f"{ratio:.3f}"])
    print(tabulate(table, headers=["served", "tokens/s", "build-avx2 median (range)", "build-native median (range)",
                                   "avx2 / native"], tablefmt="github"))
    versions = {b: e.version for b, e in engines.items()}
    for build in BUILDS:
        print(f"{build}: {features[build]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
                                    "versions": versions, "figures": figures}, indent=2) + "\n")
    rows = []
    for name in ("117M target", "world target + drafter"):
        cpu, gen = figures[f"{name}: cpu_tok_s"], figures.get(f"{name}: gen_tok_s")
        wall = f"; wall-clock generation {gen['portable_over_native']:.3f}" if gen else ""
        rows.append(Row(f"llama.cpp b11434 build-avx2 (portable) / build-native (this CPU's), tokens per CPU-second "
                        f"of llama-server (1 thread), {name}, f32", cpu["portable_over_native"], 0.8, ">=", unit="",
                        detail=f"{cpu['avx2']:.1f} vs {cpu['native']:.1f} tokens/s (medians of {args.repeats}; "
                               f"runs {cpu['runs']['avx2']} vs {cpu['runs']['native']}){wall}"))
    record("llamacpp_build", f"python bench/bench_llamacpp_build.py --repeats {args.repeats}", rows,
           {"versions": versions})

if __name__ == "__main__":
    main()
