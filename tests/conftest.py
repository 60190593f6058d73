import pytest

from world import cached_test_world


@pytest.fixture(scope="session")
def test_world():
    """Tokenizer + trained TEST_TARGET + held-out prompts, built once and cached."""
    return cached_test_world()
