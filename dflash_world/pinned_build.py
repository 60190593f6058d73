"""`python -m dflash_world.pinned_build JOB`: the child process `kernel_pins.run_pinned` starts, with the kernel pins
in its environment from the start, to build one artefact of a world (JOB, JSON: `{"what": "world", "root", "preset",
"builder_args"}`, `{"what": "drafter", "root", "name"}` or `{"what": "long-target", "root"}`). The caller holds the artefact's build lock; this process
only builds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from .drafter import train_named_drafter
from .long_context import train_long_target
from .kernel_pins import KERNEL_PINS
from .world_cache import WorldPaths, build_world


def check_pins() -> None:
    """Refuse to build unpinned (a direct call without the environment); say so where the CPU has no AVX2 (its
    kernels are torch's default ones: a world of other bits, which the digest test names)."""
    missing = [f"{k}={v}" for k, v in KERNEL_PINS.items() if os.environ.get(k) != v]
    if missing:
        sys.exit(f"{__spec__.name if __spec__ else 'pinned_build'}: started without {' '.join(missing)}; "
                 "run it through dflash_world.kernel_pins.run_pinned")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        print(f"note: this CPU runs torch's {capability} kernels, not AVX2: the world trained here differs from the "
              "one every AVX2 machine trains", file=sys.stderr)


def main(argv: list[str]) -> None:
    job = json.loads(argv[0])
    check_pins()
    torch.set_num_threads(1)
    root = Path(job["root"])
    if job["what"] == "world":
        build_world(root, job["preset"], progress=False, **job["builder_args"])
    elif job["what"] == "long-target":
        train_long_target(WorldPaths.under(root))
    elif job["what"] == "drafter":
        train_named_drafter(WorldPaths.under(root), job["name"])
    else:
        sys.exit(f"unknown job {job['what']!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
