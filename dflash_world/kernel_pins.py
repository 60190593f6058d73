"""The kernels every artefact of the test world is trained with, and the one way it is trained: in a process of its
own, started with them.

torch's own CPU kernels, MKL and oneDNN each pick the widest instructions the CPU has (AVX-512 here, AVX2 there),
and those round float sums differently: the same seeds train other weights on another CPU. Pinned to their AVX2
paths (MKL in its strict reproducible mode) and to one thread, every x86-64 machine with AVX2 trains the same bits.
The libraries read these settings as they load, so a process started without them (pytest alone, a lazy fixture, a
notebook) cannot take them on later: the world is built in a child process started with them, whoever asks for it.
The Makefile's DEMO_ENV names the same three (tests/test_world_pins.py holds them equal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

KERNEL_PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}
THREAD_PINS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# The child process's module (`python -m dflash_world.pinned_build JOB`).
BUILDER = "dflash_world.pinned_build"


def pinned_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (this process's environment) with the kernel and thread pins, and this checkout first on the path (the
    child imports the code that asked, not whatever copy the venv's editable install points at)."""
    env = {**(os.environ if base is None else base), **KERNEL_PINS, **THREAD_PINS}
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([repo, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def run_pinned(job: dict) -> None:
    """Build one artefact (`job`: what `pinned_build` reads) in a child process under the pins; its output is the
    caller's. A failed build raises, naming the job; what it half wrote its atomic writes never leave."""
    done = subprocess.run([sys.executable, "-m", BUILDER, json.dumps(job)], env=pinned_env(), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"test world: the pinned build of {job.get('what')} {job.get('name', '')} exited "
                           f"{done.returncode} (its output is above)")
