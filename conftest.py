"""Settings shared by both suites (tests/ and conformance/)."""

import os
from pathlib import Path

import torch

# The suites run tiny models, where intra-op threads buy nothing and, on a shared 2-core
# machine, spin-waiting threads slow every process down by orders of magnitude: this process,
# and every process the suites start (xdist workers, CLI and torchrun runs, the vLLM engine,
# which otherwise takes a thread per core and ran 2-3x slower beside the other worker).
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"
# torch's compile cache (what a reference's flex attention or an import of vLLM makes) is a cache, not a temp file:
# kept in the tool's cache root, never left as `torchinductor_<user>` in the temp dir the session checks empty.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-audit"
                          / "torchinductor"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "dynamic: runs the dynamic path (target forward, live loops, offline replay, DDTree, compare "
                   "--target, eval); `make test` runs these a second time with DFLASH_AUDIT_DTYPE=bfloat16")
    config.addinivalue_line(
        "markers", "full_in_bfloat16: a dynamic case whose float32 run is `make test`'s and whose bfloat16 run is "
                   "`make test-full`'s: a faster bfloat16 case of `make test` holds what the dtype changes (named "
                   "where the mark is set)")
    config.addinivalue_line(
        "markers", "full: a heavy case run by `make test-full` (before a release), not by `make test`: each one's "
                   "property is also held, faster, by a case `make test` runs (named where the mark is set)")
