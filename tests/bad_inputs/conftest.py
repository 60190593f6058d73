"""The hostile-input suites, one file per class of issue #32 (outputs kept, verdicts, bombs, internal names,
messages that name the right thing, valid layouts) and the fuzz: one input world per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_bad_inputs import build_world


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.mktemp("hostile"))


def pytest_sessionfinish(session):
    from tests.bad_inputs import test_fuzz

    test_fuzz.save_findings()
