"""The static audit and convert at a real drafter's scale: wall time against a trivial floor, peak anonymous memory.

Generates a drafter pair at a published shape into a temp folder (removed afterwards): `ref`
(random bf16 weights under the real config), `same` (a byte copy) and `fc4` (the same drafter
with fc over 4 of its 5 target layers). The floor reads both files through safetensors'
lazy `safe_open` and `torch.equal`s every tensor: the least any audit of the pair must do.
Every command runs in its own process, files warm in the page cache, floor and ours
alternating, the faster of REPEATS runs counting; memory is the peak RssAnon sampled from
/proc (file-backed pages of the mmap do not count). Goals: compare wall <= 1.2x the floor;
peak RssAnon of compare and convert <= 2 x the largest tensor + 512 MB.

    python bench/bench_static_scale.py [--shape qwen3.6-27b|qwen3-8b|tiny] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from measure import measure  # noqa: E402
from results import RESULTS, Row, record  # noqa: E402
from scale_drafters import SHAPES, body_shapes, write_pair  # noqa: E402

REPEATS = 2
WALL_GOAL = 1.2  # the CLI's start and the audit beyond the read itself: at most a fifth of the floor
FLOOR = """
import sys
import torch
from safetensors import safe_open
with safe_open(sys.argv[1], "pt") as a, safe_open(sys.argv[2], "pt") as b:
    print(sum(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys()))
"""


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_audit", *args]


def run(command: list[str]):
    result = measure(command, {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if result.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()[-400:]}")
    return result


def warm(*files: Path) -> None:
    """Read the files once, so every timed run finds them in the page cache alike."""
    for path in files:
        with open(path, "rb") as handle:
            while handle.read(1 << 24):
                pass


def findings(report: Path) -> list[tuple[str, str]]:
    return [(f["component"], f["severity"]) for f in json.loads(report.read_text())["findings"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.6-27b")
    parser.add_argument("--tmp", type=Path, default=None, help="where the pair is generated (default: the temp dir)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=REPEATS, help="runs of each side, the fastest counting")
    args = parser.parse_args()
    spec = SHAPES[args.shape]
    shapes = body_shapes(spec)
    largest_mb = max(2 * _numel(s) for s in shapes.values()) / 2**20  # bf16
    memory_goal = 2 * largest_mb + 512
    root = Path(tempfile.mkdtemp(prefix="dflash-scale-", dir=args.tmp))
    try:
        pair = write_pair(root / "pair", args.shape)
        ref, same, fc4 = pair["ref"], pair["same"], pair["fc4"]
        size_gb = (ref / "model.safetensors").stat().st_size / 1e9
        warm(ref / "model.safetensors", same / "model.safetensors", fc4 / "model.safetensors")
        floor_cmd = [sys.executable, "-c", FLOOR, str(ref / "model.safetensors"), str(same / "model.safetensors")]
        reports = root / "reports"
        floor, ours_same, ours_fc4 = [], [], []
        for i in range(args.repeats):  # alternating, so machine load hits both alike
            floor.append(run(floor_cmd))
            ours_same.append(run(cli("compare", "--ours", str(same), "--ref", str(ref), "--static-only",
                                     "--out", str(reports / f"same{i}"))))
            ours_fc4.append(run(cli("compare", "--ours", str(fc4), "--ref", str(ref), "--static-only",
                                    "--out", str(reports / f"fc4{i}"))))
        found_same = findings(reports / "same0" / "report.json")
        found_fc4 = findings(reports / "fc40" / "report.json")
        ours_pt, back, spec_dir, config_only = root / "ours.pt", root / "back", root / "spec", root / "target"
        to_ours = run(cli("convert", "--from", str(ref), "--to", str(ours_pt), "--format", "ours"))
        pt_vs_zlab = run(cli("compare", "--ours", str(ours_pt), "--ref", str(ref), "--static-only",
                             "--out", str(reports / "pt")))
        found_pt = findings(reports / "pt" / "report.json")
        to_zlab = run(cli("convert", "--from", str(ours_pt), "--to", str(back), "--format", "zlab"))
        config_only.mkdir()
        (config_only / "config.json").write_text(json.dumps({
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": spec.hidden_size,
            "num_hidden_layers": spec.num_target_layers, "vocab_size": spec.target_vocab_size}))
        to_spec = measure(cli("convert", "--from", str(ref), "--to", str(spec_dir), "--format", "speculators",
                              "--target", str(config_only)), {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        floor_s = min(m.wall_s for m in floor)
        same_s, fc4_s = min(m.wall_s for m in ours_same), min(m.wall_s for m in ours_fc4)
        anon = {"compare, identical pair": max(m.peak_anon_mb for m in ours_same),
                "compare, fc over 4 of 5": max(m.peak_anon_mb for m in ours_fc4),
                "convert z-lab -> ours.pt": to_ours.peak_anon_mb, "compare ours.pt vs z-lab": pt_vs_zlab.peak_anon_mb,
                "convert ours.pt -> z-lab": to_zlab.peak_anon_mb,
                "convert -> speculators, target without weights": to_spec.peak_anon_mb}
        same_ok = found_same == [] and all(m.returncode == 0 for m in ours_same)
        fc4_ok = found_fc4 == [("fc_dims", "divergence")] and all(m.returncode == 1 for m in ours_fc4)
        rows = [
            Row(f"{args.shape} static compare, identical pair: ours / floor wall", same_s / floor_s, WALL_GOAL, "<=",
                detail=f"{same_s:.2f} s vs {floor_s:.2f} s, {2 * size_gb:.2f} GB read; findings {found_same} "
                       f"({'as expected' if same_ok else 'WRONG: expected none'})"),
            Row(f"{args.shape} static compare, fc over 4 of 5: ours / floor wall", fc4_s / floor_s, WALL_GOAL, "<=",
                detail=f"{fc4_s:.2f} s vs {floor_s:.2f} s; findings {found_fc4} "
                       f"({'as expected' if fc4_ok else 'WRONG: expected exactly fc_dims'})"),
        ]
        for what, mb in anon.items():
            rows.append(Row(f"{args.shape} {what}: peak RssAnon", mb, memory_goal, "<=", unit=" MB",
                            detail=f"goal 2 x largest tensor {largest_mb:.0f} MB + 512 MB"))
        spec_msg = to_spec.stderr.strip().splitlines()[-1] if to_spec.stderr.strip() else ""
        extra = {"walls_s": {"floor": floor_s, "compare identical": same_s, "compare fc4": fc4_s,
                             "convert to ours": to_ours.wall_s, "compare ours.pt vs zlab": pt_vs_zlab.wall_s,
                             "convert to zlab": to_zlab.wall_s, "convert to speculators (refused)": to_spec.wall_s},
                 "peak_anon_mb": anon, "drafter_gb": size_gb, "largest_tensor_mb": largest_mb,
                 "findings_ok": same_ok and fc4_ok and found_pt == [],
                 "speculators_refusal": {"exit": to_spec.returncode, "message": spec_msg}}
        print(f"convert z-lab -> ours.pt {to_ours.wall_s:.2f} s; compare ours.pt vs z-lab {pt_vs_zlab.wall_s:.2f} s "
              f"(findings {found_pt}); convert ours.pt -> z-lab {to_zlab.wall_s:.2f} s; convert -> speculators with "
              f"a config-only target: exit {to_spec.returncode} after {to_spec.wall_s:.2f} s: {spec_msg}")
        record(f"static_scale[{args.shape}]", f"python bench/bench_static_scale.py --shape {args.shape}", rows, extra,
               results=args.results)
        if not (extra["findings_ok"] and to_spec.returncode == 2):
            raise SystemExit("findings or the speculators refusal are not what they must be")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


if __name__ == "__main__":
    main()
