"""#17 at T > 0: our live loop's speculative sampling is distributed as the target's own samples; z-lab 0.1.0's
`dflash_generate` too; z-lab's pre-#77 greedy drafting (z-lab/dflash #74) is flagged by the same test
(conformance/checks/sampling.py says how, and the power)."""

from __future__ import annotations

import pytest

from conformance.checks import sampling
from conformance.sampling_stats import detectable_effect, exact_continuations, goodness_of_fit

pytestmark = [pytest.mark.slow, pytest.mark.pitfall(17)]


@pytest.fixture(scope="module")
def case():
    """(drafter, target, prompt ids [1, 16], the target's exact continuation probabilities) on the world."""
    from dflash_world import cached_test_world
    from tests.helpers import load_trained_pair

    drafter, target, prompts, _ = load_trained_pair(cached_test_world())
    ids = prompts[sampling.PROMPT][1][:, -sampling.PROMPT_TOKENS:]
    exact = exact_continuations(target, ids, sampling.LENGTH, sampling.TEMPERATURE)
    return drafter, target, ids, exact


def samples_of(generate) -> list[tuple[int, ...]]:
    return [tuple(generate(seed)) for seed in range(sampling.SAMPLES)]


def test_the_test_has_power(case):
    """Enough samples and mass in named bins: at level ALPHA the test detects an effect w >= 0.25 with
    probability POWER (Cohen's 'medium' is 0.3)."""
    *_, exact = case
    fit = goodness_of_fit([()] * sampling.SAMPLES, exact)  # only its bins and df matter here
    assert fit.binned_mass > 0.4 and fit.df >= 5, fit.describe()
    assert detectable_effect(sampling.SAMPLES, fit.df, sampling.ALPHA, sampling.POWER) < 0.25


def test_live_sampling_follows_the_targets_distribution_p17(conform, case):
    from impl.decoding import dflash_decode

    drafter, target, ids, exact = case
    fit = goodness_of_fit(samples_of(lambda seed: dflash_decode(drafter, target, ids, sampling.LENGTH, None,
                                                                sampling.TEMPERATURE, seed).new_tokens), exact)
    conform.compare(("ours", "transformers"), fit.p_value > sampling.ALPHA, True,
                    what=f"T={sampling.TEMPERATURE}: our sampled continuations against the target's own "
                         f"distribution: {fit.describe()}")


def zlab_samples(case) -> list[tuple[int, ...]]:
    from reference_adapters.zlab_adapter import ZlabImplementation

    drafter, target, ids, _ = case
    zlab = ZlabImplementation()
    twin = zlab.build_drafter(drafter.spec, drafter.state_dict(), target)
    return samples_of(lambda seed: zlab.generate(twin, target, ids, sampling.LENGTH, None, sampling.TEMPERATURE,
                                                 seed).output_ids[0, ids.shape[1]:].tolist())


def test_zlab_010_sampling_follows_the_targets_distribution_p17(conform, case):
    fit = goodness_of_fit(zlab_samples(case), case[3])
    conform.compare(("zlab", "transformers"), fit.p_value > sampling.ALPHA, True,
                    what=f"T={sampling.TEMPERATURE}: z-lab 0.1.0 dflash_generate against the target's own "
                         f"distribution: {fit.describe()}")
    assert fit.p_value > sampling.ALPHA, fit.describe()


def test_zlab_greedy_drafting_is_the_catalogued_divergence_p17(conform, case):
    with sampling.zlab_drafting_greedily():
        fit = goodness_of_fit(zlab_samples(case), case[3])
    entry = conform.compare(("zlab", "transformers"), fit.p_value > sampling.ALPHA, True,
                            what=f"T={sampling.TEMPERATURE}: {sampling.KNOWN_SAMPLING_DIVERGENCES['zlab-greedy-drafts']}"
                                 f"; {fit.describe()}")
    assert entry is not None and fit.p_value < 1e-6, fit.describe()  # flagged, and far beyond doubt
