"""The by-value core that streams (dflash_audit/target_values.py) names every tensor as the dense matcher it replaced
did: every candidate materialized, every row against every position over the whole vocabulary (written out here as
the oracle). Names are decided on a sample of rows (made small here, so that sampling is exercised) and confirmed on
every row; the states spilled to disk read back bit for bit."""

from __future__ import annotations

import pytest
import torch

import dflash_audit.target_values as core
from dflash_audit.target_values import TargetCandidates, centered_log_probs, name_hidden, name_logits
from dflash_world.target_training import distinct_random_qwen3


@pytest.fixture(scope="module")
def target():
    return distinct_random_qwen3(6, 64, 512).eval()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))


def dense_bank(target, tokens) -> tuple[dict, dict]:
    """The oracle: every candidate of the old matcher, materialized (hidden states and centred log-probabilities)."""
    with torch.inference_mode():
        captured = {}
        handle = target.model.norm.register_forward_pre_hook(lambda m, a: captured.update(pre=a[0]))
        out = [target(row[None], output_hidden_states=True) for row in tokens]
        pres = []
        for row in tokens:
            target(row[None])
            pres.append(captured["pre"][0])
        handle.remove()
        n = len(out[0].hidden_states) - 1
        hidden = {i: torch.cat([o.hidden_states[i][0] for o in out]).float() for i in range(n + 1)}
        hidden["pre"] = torch.cat(pres).float()
        head, norm = target.lm_head, target.model.norm
        logits = {}
        for layer in range(n):
            raw = hidden[layer + 1] if layer < n - 1 else hidden["pre"]
            logits[(layer, True)] = centered_log_probs(head(norm(raw)))
            logits[(layer, False)] = centered_log_probs(head(raw))
        logits[("twice", True)] = centered_log_probs(head(norm(hidden[n])))
    return hidden, logits


def oracle(rows: torch.Tensor, bank: dict) -> tuple[object, torch.Tensor]:
    """The old rule: each candidate's nearest position per row, the lowest mean squared error, a tie keeps the
    earlier."""
    best = None
    for key, table in bank.items():
        pos = torch.cdist(rows, table).argmin(1)
        err = float((rows - table[pos]).pow(2).mean())
        if best is None or err < best[0] * (1 - 1e-4):
            best = (err, key, pos)
    return best[1], best[2]


def key_of(candidate) -> object:
    if candidate.kind == "hidden":
        return candidate.index if candidate.index is not None else "pre"
    return ("twice", True) if "twice" in candidate.name else (candidate.layer, candidate.normed)


@pytest.fixture
def small_sample(monkeypatch):
    monkeypatch.setattr(core, "SAMPLE_ROWS", 7)
    monkeypatch.setattr(core, "CHUNK_ROWS", 5)


@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_logit_names_match_the_dense_oracle(target, tokens, small_sample, noise):
    _, logits = dense_bank(target, tokens)
    cands = TargetCandidates(target, tokens)
    gen = torch.Generator().manual_seed(1)
    for key in [(0, True), (2, False), (4, True), (5, True), (5, False), ("twice", True)]:
        positions = torch.randperm(48, generator=gen)[:19]
        rows = logits[key][positions] + noise * torch.randn(19, 512, generator=gen)
        named = name_logits(rows, cands, core.SAME)
        want, want_positions = oracle(centered_log_probs(rows), logits)
        assert key_of(named.candidate) == want, (named.candidate.name, want)
        assert torch.equal(named.positions, want_positions)
        assert (named.sampled, named.rows) == (7, 19) and named.sampling == "named on 7 of 19 rows, confirmed on all 19"
        picked = logits[want][want_positions]
        residual = centered_log_probs(rows) - picked
        assert named.residual_std == pytest.approx(float(residual.std()), rel=1e-3, abs=1e-6)
        assert named.distance == pytest.approx(core.relative(centered_log_probs(rows), picked), rel=1e-3, abs=1e-6)
        assert named.equal == (noise == 0.0)
        assert named.noisy == (noise > 0)


def test_probabilities_name_as_their_logits(target, tokens, small_sample):
    _, logits = dense_bank(target, tokens)
    cands = TargetCandidates(target, tokens)
    named = name_logits(logits[(3, True)][:11].softmax(-1), cands, core.SAME)
    assert key_of(named.candidate) == (3, True) and named.equal
    assert named.positions.tolist() == list(range(11))


@pytest.mark.parametrize("key", [0, 2, 6, "pre"])
def test_hidden_names_match_the_dense_oracle(target, tokens, small_sample, key):
    hidden, _ = dense_bank(target, tokens)
    cands = TargetCandidates(target, tokens)
    positions = torch.arange(3, 40, 2)
    rows = hidden[key][positions] + 0.01 * torch.randn(len(positions), 64, generator=torch.Generator().manual_seed(2))
    named = name_hidden(rows, cands, core.SAME)
    want, want_positions = oracle(rows, hidden)
    assert key_of(named.candidate) == want and torch.equal(named.positions, want_positions)


def test_spilled_states_read_back_bit_for_bit(target, tokens, monkeypatch):
    held = TargetCandidates(target, tokens)
    monkeypatch.setattr(core, "SPILL_BYTES", 0)
    spilled = TargetCandidates(target, tokens)
    assert spilled.run.store._folder is not None and held.run.store._folder is None
    for candidate in held.hidden_candidates():
        assert torch.equal(held.hidden(candidate), spilled.hidden(candidate))
    folder = spilled.run.store._folder.name
    spilled.close()
    import os

    assert not os.path.exists(folder)
