"""One test world everywhere: its weights are trained under the kernel pins (dflash_world/kernel_pins.py) in a
process started with them, whatever the asking process's own kernels, so the cached world is the same bits on every
x86-64 machine with AVX2: the digest recorded here, from the world `make test` built on an AMD EPYC with AVX-512
(torch's AVX512 kernels but for the pins), is every such machine's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from dflash_world import cached_test_world
from dflash_world.kernel_pins import BUILDER, KERNEL_PINS, pinned_env
from dflash_world.world_digest import world_digest

REPO = Path(__file__).resolve().parents[1]
RECORDED = Path(__file__).parent / "fixtures" / "world_digest.json"


def test_the_cached_world_is_the_recorded_digest():
    """Target and the four prebuilt drafters, tensor by tensor. A different digest is a world trained under other
    kernels (or a builder that changed: record the new one, with the reason, where WORLD_FORMAT is bumped)."""
    recorded = json.loads(RECORDED.read_text())
    found = world_digest(cached_test_world())
    assert found == recorded["digest"], {k: (found[k], recorded["digest"].get(k)) for k in found
                                         if found[k] != recorded["digest"].get(k)}


def test_the_makefiles_demo_pins_are_the_worlds():
    """`make demo` trains its world under DEMO_ENV; the test world under KERNEL_PINS: one set of pins."""
    line = next(ln for ln in (REPO / "Makefile").read_text().splitlines() if ln.startswith("DEMO_ENV"))
    assert dict(re.findall(r"(\w+)=(\S+)", line.split(":=", 1)[1])) == KERNEL_PINS


def test_the_builder_runs_on_the_pinned_kernels_and_refuses_to_build_without_them(tmp_path):
    """The child `run_pinned` starts takes torch's AVX2 kernels whatever this process runs on (pytest here, on
    this CPU's own); started without the pins it refuses, one line, before it builds anything."""
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())"
    done = subprocess.run([sys.executable, "-c", probe], env=pinned_env(), capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["AVX2", "1"], done.stdout
    unpinned = {k: v for k, v in pinned_env().items() if k not in KERNEL_PINS}
    job = json.dumps({"what": "world", "root": str(tmp_path / "w"), "preset": {}, "builder_args": {}})
    done = subprocess.run([sys.executable, "-m", BUILDER, job], env=unpinned, capture_output=True, text=True)
    assert done.returncode != 0 and "started without ATEN_CPU_CAPABILITY=avx2" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "w").exists()
