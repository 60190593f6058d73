"""The training mask at scale: ours (`impl.masks.training_mask`) vs speculators' mask construction.

speculators builds the anchor-block mask as a flex-attention `mask_mod`
(`create_anchor_block_mask_mod`) and, off flex attention, materializes it with
`create_mask` (inside its `create_float_mask`, before the 0 / -inf conversion): a boolean
[A*B, T + A*B] mask like ours. Both run on the same packed documents and the same 512
anchors (B = 16) at T = 1k, 4k and 16k; each construction runs in its own process, its
peak RssAnon above the process's own level before it (sampled from /proc) is its memory.
Goals: identical masks; speculators / ours time and memory ratios >= 1.0.

    python bench/bench_training_mask.py [--lengths 1024 4096 16384]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from results import RESULTS, Row, record  # noqa: E402

from foundation.jsonl import split_json_lines  # noqa: E402

ANCHORS, BLOCK = 512, 16
REPEATS = 2


def inputs(length: int):
    """Documents of ~length/4 tokens, the last 5% padding (-1); ours' anchor sampler under a fixed seed."""
    import torch

    from impl.anchors import select_anchors

    document_ids = torch.arange(length) // max(1, length // 4)
    document_ids[int(length * 0.95):] = -1
    anchors, valid = select_anchors((document_ids != -1)[None], ANCHORS, BLOCK, torch.Generator().manual_seed(0))
    return document_ids, anchors.reshape(-1)[valid.reshape(-1)]


def one(impl: str, length: int) -> dict:
    import torch

    torch.set_num_threads(1)
    document_ids, anchors = inputs(length)
    if impl == "ours":
        from impl.masks import training_mask

        def build():
            return training_mask(document_ids, anchors, BLOCK)
    else:
        from speculators.models.attention import _create_mask  # what create_float_mask materializes with

        from reference_adapters.speculators_adapter import create_anchor_block_mask_mod

        def build():
            mask_mod, q_len, kv_len = create_anchor_block_mask_mod(
                document_ids=document_ids, total_seq_len=length, anchor_positions=anchors, block_size=BLOCK)
            return _create_mask(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=None)[0, 0]
    build()  # warm: first-call overheads (vmap tracing, allocator) are not the construction
    base, peak, done = anon_kb(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon_kb())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    mask = build()
    seconds = time.perf_counter() - started
    peak[0] = max(peak[0], anon_kb())
    done.set()
    sampler.join()
    digest = hashlib.sha256(mask.contiguous().numpy().tobytes()).hexdigest()
    return {"seconds": seconds, "peak_mb": (peak[0] - base) / 1024, "shape": list(mask.shape), "sha256": digest,
            "true": int(mask.sum())}


def anon_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))


def run_one(impl: str, length: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", impl, str(length)], capture_output=True, text=True,
                         env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    if out.returncode:
        raise SystemExit(f"{impl} at T={length} failed: {out.stderr.strip()[-400:]}")
    return json.loads(split_json_lines(out.stdout.strip())[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--one", nargs=2, metavar=("IMPL", "T"), help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]))))
        return
    rows, figures = [], {}
    for length in args.lengths:
        runs = {"ours": [], "speculators": []}
        for _ in range(REPEATS):  # alternating, so machine load hits both alike
            for impl in runs:
                runs[impl].append(run_one(impl, length))
        ours = min(runs["ours"], key=lambda r: r["seconds"])
        theirs = min(runs["speculators"], key=lambda r: r["seconds"])
        same = ours["sha256"] == theirs["sha256"] and ours["shape"] == theirs["shape"]
        mem_o = min(r["peak_mb"] for r in runs["ours"])
        mem_s = min(r["peak_mb"] for r in runs["speculators"])
        figures[length] = {"ours": runs["ours"], "speculators": runs["speculators"], "identical": same}
        mask = f"mask {ours['shape'][0]}x{ours['shape'][1]}, {'identical' if same else 'NOT IDENTICAL'}"
        rows.append(Row(f"training mask T={length}: speculators / ours time", theirs["seconds"] / ours["seconds"],
                        1.0, ">=", detail=f"{theirs['seconds']:.3f} s vs {ours['seconds']:.3f} s; {mask}"))
        rows.append(Row(f"training mask T={length}: speculators / ours peak memory", mem_s / max(mem_o, 1e-3), 1.0,
                        ">=", detail=f"{mem_s:.0f} MB vs {mem_o:.0f} MB above each process's level"))
    record("training_mask", "python bench/bench_training_mask.py", rows, {"runs": figures}, results=args.results)
    if not all(f["identical"] for f in figures.values()):
        raise SystemExit("the masks differ")


if __name__ == "__main__":
    main()
