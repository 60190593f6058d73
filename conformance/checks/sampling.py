"""Speculative sampling at T > 0 held to the target's own distribution (catalogue #17).

At temperature T, DFlash's rejection sampling must leave the output distributed exactly as the target's own
samples at T. The check draws `SAMPLES` continuations of `LENGTH` tokens after one of the world's prompts, one
per seed 0..SAMPLES-1 (derandomized: the same draws every run), and tests them against the target's exact
probabilities (conformance/sampling_stats.py). The first token comes from the target's prefill; the others
from one speculative round, so the test sees the drafted, verified and resampled tokens.

Reference loops known to leave the target's distribution at T > 0: {what: where}. z-lab/dflash #74 reported
`dflash_generate` drafting greedily while the target samples (fixed by PR #77): dflash 0.1.0 samples its drafts
(`dflash/model.py` dflash_generate, `_sampling_probs` then `_sample_probs` on the draft logits) and passes. The
pre-#77 behaviour is reproduced by making 0.1.0's draft draw an argmax (every other line its own), and the same
test flags it: a catalogued reference divergence, recorded as such.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

KNOWN_SAMPLING_DIVERGENCES = {
    "zlab-greedy-drafts": "z-lab/dflash #74 (fixed by PR #77 before 0.1.0): drafts are the argmax of the draft "
                          "logits while the target samples; 0.1.0's dflash/model.py dflash_generate samples them",
}
TEMPERATURE = 0.7
LENGTH = 3
SAMPLES = 600
ALPHA = 0.01
POWER = 0.9
PROMPT = 3  # the world's held-out prompt whose continuations concentrate enough mass for named bins
PROMPT_TOKENS = 16


@contextmanager
def zlab_drafting_greedily():
    """z-lab 0.1.0's loop with its draft draw (the only 3-D `_sample_probs` call: [1, B-1, V]) replaced by the
    argmax, as before PR #77; first-token, bonus and residual draws stay its own."""
    import dflash.model as zlab

    own = zlab._sample_probs

    def draw(probs):
        return probs.argmax(-1) if probs.dim() == 3 else own(probs)

    with mock.patch.object(zlab, "_sample_probs", draw):
        yield
