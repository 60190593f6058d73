"""Module-scoped fixtures of the format and conversion tests: a tiny drafter and a saved tiny target."""

from __future__ import annotations

import pytest
import torch

from impl.model import DFlashDrafter
from tests.helpers import tiny_spec, tiny_target


@pytest.fixture(scope="module")
def spec():
    return tiny_spec()  # 2 sliding + 1 full layer, ids (1, 3, 4) of a 6-layer target


@pytest.fixture(scope="module")
def drafter(spec):
    torch.manual_seed(0)
    return DFlashDrafter(spec)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(path)
    return path.resolve()
