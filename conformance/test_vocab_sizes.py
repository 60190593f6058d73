"""#36 vocabulary sizes: against a target whose embedding has rows past the tokenizer (a padded vocabulary),
the draft logits span all of the target's rows, as speculators' own training forward does; the padding rows'
logits agree. The size table itself (draft head, target vocab_size, tokenizer length, embedding rows; padding =
info) is the audit's `vocab_sizes` finding (tests/test_mask_vocab_audit.py)."""

import pytest

from conformance.checks import vocab

pytestmark = pytest.mark.quick


@pytest.mark.pitfall(36)
@pytest.mark.compare("training_outputs", references=("speculators",))
def test_draft_logits_span_the_padded_vocabulary_p36(conform, pair):
    vocab.padded_vocabulary(conform, *pair)
