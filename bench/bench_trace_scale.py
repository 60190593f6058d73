"""`dflash-audit trace` at a real target's shape: a traced step, and the audit of its recording, against the same
step untraced, side by side in one run.

The trainer is tests/trace_scripts/scale_trainer.py (a team's batched z-lab trainer, right-padded rows, no dflash-audit
code) on random-weight bfloat16 Qwen3 targets written locally (bench/scale_targets.py). For each case:
- untraced: the trainer alone (its peak anonymous memory, its wall time);
- traced: `dflash-audit trace --steps 1 -- <the trainer>` (the recorded step, then its audit, in one command);
- audit: `dflash-audit trace --from <the recording>` (the audit alone: its peak and wall).
Goals:
- the traced command's peak / the untraced step's peak <= 1.5;
- the audit's wall / the untraced step's wall <= 3 (both load their models);
- the sound trainer's report has no divergence;
- the audit's own memory (its peak less the target's weights) does not grow with the target's depth: the 28-layer
  0.6B shape against the same widths at 14 layers, the same rows (<= 1.1).

    python bench/bench_trace_scale.py [--cases 0.6b-2x256,0.6b-2x1024,0.6b-2x2048,1.7b-2x1024] [--depth]
        [--device cuda --cases 0.6b-8x4096] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from measure import measure  # noqa: E402
from results import Row, record  # noqa: E402
from scale_targets import TARGETS, write_target  # noqa: E402

TRAINER = ROOT / "tests" / "trace_scripts" / "scale_trainer.py"  # a user's trainer: no project code
CASES = {"0.6b-2x256": ("qwen3-0.6b", 2, 256), "0.6b-2x1024": ("qwen3-0.6b", 2, 1024),
         "0.6b-2x2048": ("qwen3-0.6b", 2, 2048), "1.7b-2x1024": ("qwen3-1.7b", 2, 1024),
         "0.6b-8x4096": ("qwen3-0.6b", 8, 4096)}  # the last: `make gpu-check`, on CUDA
DEPTH = ("qwen3-0.6b-14-layers", "qwen3-0.6b", 2, 512)  # the same rows on 14 and on 28 layers
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-audit" / "bench-targets"


def target(shape: str) -> Path:
    """The shape's random target, written once into the cache (never committed)."""
    folder = CACHE / shape
    if not (folder / "model.safetensors.index.json").is_file():
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
        write_target(folder, shape, None)
    return folder


def weights_mb(shape: str, dtype: str = "bfloat16") -> float:
    s = TARGETS[shape]
    per_layer = (s.hidden_size * s.head_dim * (s.num_attention_heads * 2 + s.num_key_value_heads * 2)
                 + 3 * s.hidden_size * s.intermediate_size)
    embeddings = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    return (2 if dtype == "bfloat16" else 4) * (per_layer * s.num_hidden_layers + embeddings) / 2**20


OPTIONS = {"device": "cpu", "dtype": "bfloat16"}


def trainer_args(folder: Path, rows: int, tokens: int) -> list[str]:
    return [str(TRAINER), "--target", str(folder), "--rows", str(rows), "--tokens", str(tokens),
            "--anchors", str(max(4, tokens // 64)), "--device", OPTIONS["device"], "--dtype", OPTIONS["dtype"]]


def run_case(name: str, shape: str, rows: int, tokens: int, work: Path) -> tuple[list[Row], dict]:
    folder = target(shape)
    env = {"PYTHONPATH": str(ROOT)}
    untraced = measure([sys.executable, *trainer_args(folder, rows, tokens)], env=env, interval_s=0.05)
    assert untraced.returncode == 0, untraced.stderr[-2000:]
    step_s = float(re.search(r"step_s ([\d.]+)", untraced.stdout).group(1))
    out = work / f"trace-{name}"
    traced = measure([sys.executable, "-m", "dflash_audit", "trace", "--steps", "1", "--out", str(out), "--json",
                      str(work / f"{name}.json"), "--", sys.executable, *trainer_args(folder, rows, tokens)],
                     env=env, interval_s=0.05)
    report = json.loads((work / f"{name}.json").read_text()) if (work / f"{name}.json").is_file() else {}
    audit = measure([sys.executable, "-m", "dflash_audit", "trace", "--from", str(out)], env=env, interval_s=0.05)
    divergences = [f for f in report.get("findings", []) if f.get("severity") == "divergence"]
    detail = (f"untraced {untraced.peak_anon_mb:.0f} MB in {untraced.wall_s:.0f} s (the step itself {step_s:.0f} s); "
              f"traced {traced.peak_anon_mb:.0f} MB in {traced.wall_s:.0f} s (exit {traced.returncode}); audit alone "
              f"{audit.peak_anon_mb:.0f} MB in {audit.wall_s:.0f} s (exit {audit.returncode})")
    print(f"{name}: {detail}", flush=True)
    if traced.returncode not in (0, 1):
        print(traced.stderr[-3000:], flush=True)
    rows_out = [
        Row(f"trace {name}: traced command's peak / untraced step's peak", traced.peak_anon_mb / untraced.peak_anon_mb,
            1.5, "<=", detail=detail),
        Row(f"trace {name}: the audit's wall / the untraced step's wall", audit.wall_s / untraced.wall_s, 3.0, "<=",
            detail=detail),
        Row(f"trace {name}: divergences on the sound trainer", float(len(divergences)), 0.0, "<=",
            unit="", detail="; ".join(f.get("message", "")[:160] for f in divergences) or "none"),
    ]
    return rows_out, {"audit_peak_mb": audit.peak_anon_mb, "audit_wall_s": audit.wall_s,
                      "untraced_peak_mb": untraced.peak_anon_mb, "traced_peak_mb": traced.peak_anon_mb,
                      "notes": report.get("notes", [])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="0.6b-2x256,0.6b-2x1024,0.6b-2x2048,1.7b-2x1024")
    parser.add_argument("--depth", action="store_true", help="also the 14- against the 28-layer audit")
    parser.add_argument("--device", default="cpu", help="the trainer's device (the audit replays the target there)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    OPTIONS.update(device=args.device, dtype=args.dtype)
    rows: list[Row] = []
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-trace-scale-") as tmp:
        work = Path(tmp)
        for name in [c for c in args.cases.split(",") if c]:
            shape, batch, tokens = CASES[name]
            case_rows, figures[name] = run_case(name, shape, batch, tokens, work)
            rows += case_rows
        if args.depth:
            shallow, deep, batch, tokens = DEPTH
            _, low = run_case(f"0.6b-14-layers-2x{tokens}", shallow, batch, tokens, work)
            high = run_case(f"0.6b-2x{tokens}", deep, batch, tokens, work)[1]
            figures["0.6b-14-layers"], figures["0.6b-28-layers"] = low, high
            own_low = low["audit_peak_mb"] - weights_mb(shallow, OPTIONS["dtype"])
            own_high = high["audit_peak_mb"] - weights_mb(deep, OPTIONS["dtype"])
            rows.append(Row("trace audit's own memory (peak less the target's weights): 28 layers / 14 layers",
                            own_high / own_low, 1.1, "<=",
                            detail=f"{own_high:.0f} MB at 28 layers, {own_low:.0f} MB at 14 (2 x {tokens} tokens)"))
    # The depth comparison alone is its own entry ("trace_scale[depth]"), beside the cases' one.
    name = "trace_scale" if args.cases else "trace_scale[depth]"
    record(name, "python bench/bench_trace_scale.py " + " ".join(sys.argv[1:]), rows, {"figures": figures})


if __name__ == "__main__":
    main()
