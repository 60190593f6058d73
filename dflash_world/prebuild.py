"""Build the test suites' world before pytest starts: the target first, then its trained drafters (and the long target)
two at a time (one per core, the longest first), so that no test worker sits waiting on another's training.

`make test` runs `python -m dflash_world.prebuild`; the fixtures then find every artefact built (each one is
still built under its own lock on first use, so running pytest alone works too, only slower). Each artefact is
trained in a child process of its own under the kernel pins (kernel_pins.py), so these threads only wait on them.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from .drafter import DRAFTERS, cached_drafter
from .long_context import cached_long_prompts
from .world_cache import cached_test_world

# The longest training first: it runs beside the others in turn. The long drafter first trains the long target
# (long_context.py) under its lock; its sliding twin, last, finds it built.
ORDER = ("long", "dflash2", "kl_div", "ce", "full", "long-sliding")


def main() -> None:
    world = cached_test_world()
    cached_long_prompts(world)
    # A drafter already cached is only named: no process is started for it.
    names = [name for name in ORDER if not (world.root / DRAFTERS[name][0]).is_file()]
    for name in (name for name in ORDER if name not in names):
        print(f"test world: {name} drafter at {world.root / DRAFTERS[name][0]}", flush=True)
    if not names:
        return
    workers = max(1, min(len(names), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for name, path in zip(names, pool.map(lambda name: cached_drafter(world, name), names), strict=True):
            print(f"test world: {name} drafter at {path}", flush=True)


if __name__ == "__main__":
    main()
