"""#34 mask-token validity: a target that itself generates the mask id. Every decoding loop must keep that
token (greedy speculative decoding = the target's own greedy output, `transformers`' generate). A reference
loop that drops it is a reference divergence listed with its file:line in `checks.vocab.KNOWN_MASK_DROPS`; none of
the installed ones does (z-lab's `dflash_generate` keeps it; speculators has no decoding loop: n/a). The static
side (the id inside the target's vocabulary and embedding, not its eos/pad/bos) is the audit's
`mask_token_validity` finding (tests/test_mask_vocab_audit.py)."""

import pytest

from conformance.checks import vocab

pytestmark = pytest.mark.quick


def test_the_case_has_the_target_generate_the_mask_id():
    case = vocab.mask_kept_case()
    assert case.occurrences >= 2 and case.expected[1:].count(case.spec.mask_token_id) == case.occurrences


@pytest.mark.pitfall(34)
@pytest.mark.compare("generate", references=("zlab", "speculators"))
def test_generated_mask_id_is_kept_p34(conform, pair):
    vocab.mask_token_kept(conform, *pair, vocab.mask_kept_case())
