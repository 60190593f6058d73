"""Build the test suites' world before pytest starts: the target first, then its four trained drafters
two at a time (one per core, the longest first), so that no test worker sits waiting on another's training.

`make test` runs `python -m dflash_world.prebuild`; the fixtures then find every artefact built (each one is
still built under its own lock on first use, so running pytest alone works too, only slower).
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

from .world_cache import WorldPaths, cached_test_world
from .drafter import (DFLASH2_DRAFTER_FILE, DRAFTER_FILES, FULL_DRAFTER_FILE, cached_dflash2_drafter,
                      cached_full_drafter, cached_test_drafter)

# Each training process runs single-threaded, exactly as the test fixtures do (the root conftest.py): the
# drafters are the same files whichever process trains them.
THREADS_PER_PROCESS = 1


def _single_threaded() -> None:
    torch.set_num_threads(THREADS_PER_PROCESS)


def build_drafter(world: WorldPaths, name: str) -> str:
    _single_threaded()
    if name == "full":
        return str(cached_full_drafter(world))
    return str(cached_dflash2_drafter(world) if name == "dflash2" else cached_test_drafter(world, name))


def main() -> None:
    _single_threaded()
    world = cached_test_world()
    files = {"dflash2": DFLASH2_DRAFTER_FILE, **DRAFTER_FILES, "full": FULL_DRAFTER_FILE}
    # The longest training first: it runs beside the two others in turn. A drafter already cached is only named:
    # no process is started for it (each would import torch for nothing).
    names = [name for name, file in files.items() if not (world.root / file).is_file()]
    for name in (name for name in files if name not in names):
        print(f"test world: {name} drafter at {world.root / files[name]}", flush=True)
    if not names:
        return
    workers = max(1, min(len(names), len(os.sched_getaffinity(0))))
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"),
                             initializer=_single_threaded) as pool:
        for name, path in zip(names, pool.map(build_drafter, [world] * len(names), names), strict=True):
            print(f"test world: {name} drafter at {path}", flush=True)


if __name__ == "__main__":
    main()
