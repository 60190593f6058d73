"""`dflash-audit trace`'s costs, measured side by side in one process on the same trainer.

examples/own_trainer.py (z-lab's DFlashDraftModel, the seed's four bugs planted) on a 12-layer random Qwen3
(`distinct_random_qwen3`, hidden 256, vocabulary 2048), 256 tokens, 16 blocks of 8. A step's time is
(time of S steps - time of 0 steps) / S, so loading the models is not counted; traced, every step is recorded
(the recorder's hooks, the autograd walk, the copies) and the recording written. Goals (issue 37):
- a traced step / an untraced step <= 2;
- the audit of one recorded step (the target loaded and rerun, every tensor matched) / one untraced training step
  <= 3, in a process that has audited before (the first audit's imports are reported beside it);
- the recording's bytes (tensor file + manifest) / the bytes of the tensors it holds <= 1.5.
It also prints the audit's finding table (the README's).

    python bench/bench_trace.py [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from results import Row, record  # noqa: E402

TRAINER = ROOT / "examples" / "own_trainer.py"
SHAPE = ["--seq-len", "256", "--anchors", "16", "--block-size", "8"]
SEED_BUGS = ["--fc-drop-last", "--target-layer", "9", "--gamma", "7", "--target-noise", "0.5"]


def run(target: Path, steps: int, out: Path | None) -> float:
    """Wall time of the trainer for `steps` steps in this process (traced into `out` when given)."""
    import os

    from dflash_audit.trace.record.options import RecorderOptions
    from dflash_audit.trace.record.recorder import Recorder
    from dflash_audit.trace.record.recording import ENV_OUT

    sys.argv = [str(TRAINER), "--target", str(target), "--steps", str(steps), *SHAPE, *SEED_BUGS]
    recorder = None
    if out is not None:
        os.environ[ENV_OUT] = str(out)
        recorder = Recorder.from_options(RecorderOptions(out=Path(out).resolve(), steps=0)).install()
    started = time.perf_counter()
    try:
        runpy.run_path(str(TRAINER), run_name="__main__")
        if recorder is not None:
            recorder.finish()
    finally:
        if recorder is not None:
            recorder.remove()
            os.environ.pop(ENV_OUT, None)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    import torch

    from dflash_audit.trace.step_audit.audit import audit_recording
    from dflash_audit.trace.record.recording import MANIFEST, TENSORS, read_recording
    from dflash_audit.trace.report import terminal_summary
    from dflash_world.target_training import distinct_random_qwen3

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = tmp / "target"
        distinct_random_qwen3(12, 256, 2048).save_pretrained(target)
        run(target, 1, None)  # warm: first-call costs (imports, allocator) are neither side's
        untraced = (run(target, args.steps, None) - run(target, 0, None)) / args.steps
        traced = (run(target, args.steps, tmp / "many") - run(target, 0, tmp / "none")) / args.steps
        single = tmp / "one"
        run(target, 1, single)
        started = time.perf_counter()
        audit_recording(read_recording(tmp / "many"))  # cold: this process's first audit imports its modules
        cold = time.perf_counter() - started
        started = time.perf_counter()
        report = audit_recording(read_recording(single))  # the target loaded and run again, the step matched
        audit = time.perf_counter() - started
        manifest = json.loads((single / MANIFEST).read_text())
        stored = (single / TENSORS).stat().st_size + (single / MANIFEST).stat().st_size
        payload = manifest["tensor_payload_bytes"]
        print(terminal_summary(report))
    rows = [
        Row("traced / untraced training step", traced / untraced, 2.0, "<=",
            detail=f"{traced * 1000:.1f} ms vs {untraced * 1000:.1f} ms a step, {args.steps} steps"),
        Row("audit of one recorded step / one training step", audit / untraced, 3.0, "<=",
            detail=f"{audit:.3f} s vs {untraced:.3f} s, the process's first audit (imports) {cold:.1f} s; "
                   f"{len(report.divergences)} divergences found"),
        Row("recording bytes / bytes of the tensors it holds", stored / payload, 1.5, "<=",
            detail=f"{stored} vs {payload} bytes"),
    ]
    record("trace", f"python bench/bench_trace.py --steps {args.steps}", rows)


if __name__ == "__main__":
    main()
