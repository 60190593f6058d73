"""#23 DFlash2's candidate selector: the scores of candidates given their predecessor, and the
path it walks through a block (greedy, and sampled with its distribution over the candidates)."""

import pytest
from hypothesis import given

from conformance.checks import dflash2
from conformance.strategies import MODEL, selector_cases


@pytest.mark.quick
@pytest.mark.pitfall(23)
@pytest.mark.compare("selector_path", references=("zlab",))
@MODEL
@given(selector_cases())
def test_selector_path_p23(conform, pair, case):
    conform.describe(case)
    dflash2.selector_path(conform, *pair, case)


@pytest.mark.quick
@pytest.mark.pitfall(23)
@pytest.mark.compare("selector_scores", references=("speculators",))
@MODEL
@given(selector_cases(sampled=False))
def test_selector_scores_p23(conform, pair, case):
    conform.describe(case)
    dflash2.selector_scores(conform, *pair, case)
