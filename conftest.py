"""Settings shared by both suites (tests/ and conformance/)."""

import torch

# The suites run tiny models, where intra-op threads buy nothing and, on a shared 2-core
# machine, spin-waiting threads slow every process down by orders of magnitude.
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "dynamic: runs the dynamic path (target forward, live loops, offline replay, DDTree, compare "
                   "--target, eval); `make test` runs these a second time with DFLASH_AUDIT_DTYPE=bfloat16")
