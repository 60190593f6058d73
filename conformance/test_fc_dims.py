"""#4 fc / hidden_norm dimensions: every selected target layer feeds fc."""

import pytest
from hypothesis import given

from conformance.checks import layers
from conformance.strategies import MODEL, draft_specs, dtypes

pytestmark = pytest.mark.quick


@pytest.mark.pitfall(4)
@pytest.mark.compare("project_context", cross=True)
@MODEL
@given(draft_specs(max_layers=2), dtypes)
def test_fc_and_hidden_norm_p4(conform, pair, spec, dtype):
    conform.describe((spec, dtype))
    layers.fc_dims(conform, *pair, (spec, dtype))
