"""What the cache root's kept answers save: each asked the first time (nothing kept) and again (kept), side by side in
one run, in a cache root of the run's own (a temporary `XDG_CACHE_HOME`, the pinned llama.cpp tree linked into it):

- the vLLM environment's probe (`serving_engines/live/vllm_env.py` `find_vllm`: importing vLLM to ask its version);
- the engine-reads scan of every engine and reference file (`serving_engines/config_reads.py` `read_column`);
- a drafter's GGUF by llama.cpp's converter (`serving_engines/live/llamacpp_convert.py` `drafter_gguf`: the test
  world's all-full drafter as a z-lab folder, f32), the kept copy byte for byte the converted one.

    python bench/bench_kept_answers.py
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from results import Row, record  # bench/ is on sys.path: run as a script

GOAL = 0.1  # the kept answer at most a tenth of asking


def timed(call) -> tuple[float, object]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bench-kept-") as scratch:
        from dflash_audit.conversion import convert
        from dflash_world import cached_test_world
        from dflash_world.drafter import cached_full_drafter
        from serving_engines.live.llamacpp_env import engine_dir, source_tree

        world = cached_test_world()  # the world and the tree from the usual cache root, before it moves
        folder = Path(scratch) / "zlab"
        convert(cached_full_drafter(world), folder, "zlab")
        real_tree = source_tree()
        os.environ["XDG_CACHE_HOME"] = str(Path(scratch) / "cache")
        engine_dir().mkdir(parents=True)
        (engine_dir() / "llama.cpp").symlink_to(real_tree)  # the pinned tree, scanned and run from the new root
        from serving_engines import config_reads
        from serving_engines.live.llamacpp_convert import drafter_gguf
        from serving_engines.live.vllm_env import find_vllm

        rows = []
        first, found = timed(find_vllm)
        kept, again = timed(find_vllm)
        assert again == found, (found, again)
        rows.append(Row("vLLM probe: kept answer / asking (find_vllm)", kept / first, GOAL, "<=",
                        detail=f"{kept:.3f} s vs {first:.1f} s; vllm {found.version}"))

        def scan_all():
            return [config_reads.read_column(column) for column in config_reads.columns()]

        first, scanned = timed(scan_all)
        kept, rescanned = timed(scan_all)
        assert [c.reads for c in scanned] == [c.reads for c in rescanned]
        rows.append(Row("engine-reads scan of every engine and reference file: kept / scanning", kept / first, GOAL,
                        "<=", detail=f"{kept:.2f} s vs {first:.2f} s; {sum(len(c.reads) for c in scanned)} reads"))

        first, _ = timed(lambda: drafter_gguf(folder, world.target, Path(scratch) / "first.gguf", "f32", None))
        kept, _ = timed(lambda: drafter_gguf(folder, world.target, Path(scratch) / "kept.gguf", "f32", None))
        same = (Path(scratch) / "first.gguf").read_bytes() == (Path(scratch) / "kept.gguf").read_bytes()
        assert same
        rows.append(Row("drafter GGUF by llama.cpp's converter: kept copy / converting", kept / first, GOAL, "<=",
                        detail=f"{kept:.3f} s vs {first:.2f} s; the test world's all-full drafter, f32, "
                               "byte-identical"))
    entry = record("kept_answers", "python bench/bench_kept_answers.py", rows)
    return 0 if all(row["passed"] for row in entry["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
