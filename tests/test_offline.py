"""Offline τ (`impl.offline`): the cache, the batched replay masks, and equality with the live loops."""

from __future__ import annotations

import pytest
import torch

from dflash_world.suite_placement import audit_dtype, placed_drafter
from foundation.errors import AuditError
from impl.ddtree import ddtree_decode
from impl.decoding import dflash_decode
from impl.masks import inference_mask
from impl.model import DFlashDrafter
from impl.offline import (
    HiddenStateCache,
    block_key_mask,
    cache_key,
    find_mismatch,
    load_or_build_cache,
    offline_rounds,
)
from impl.offline.walks import Parting, explain_parting, unexplained_partings
from foundation.placement import target_device
from impl.offline.cache import target_dtype
from tests.helpers import ULPS, tiny_spec

MAX_NEW_TOKENS = 96


def replay_mask(anchors: torch.Tensor, context_len: int, block_len: int, window: int | None,
                causal: bool) -> torch.Tensor:
    """[A*S, T + A*S]: `block_key_mask` laid out over shared keys [context | all blocks], the mask one
    `DFlashDrafter.forward` over all blocks would need (the replay gives each block only its own keys)."""
    positions = torch.arange(context_len).expand(anchors.numel(), -1)
    sizes = torch.full_like(anchors, block_len)
    mask = block_key_mask(anchors, positions, sizes, block_len, window, causal)
    return torch.cat([mask[..., block_len:].reshape(-1, context_len), torch.block_diag(*mask[..., :block_len])],
                     dim=1)


def replay_against_live(models, target, cache, prompts, stop_ids,
                        max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[list[Parting], list[list[float]]]:
    """Every prompt replayed from `cache` and decoded live: DFlash with each model, DDTree with the first.
    Returns where each walk pair parts (set against the features the live drafter read), and each model's
    per-prompt offline DFlash τ."""
    partings, taus = [], [[] for _ in models]
    for entry, (_, ids) in zip(cache.prompts, prompts):
        for model, model_taus in zip(models, taus):
            live = dflash_decode(model, target, ids, max_new_tokens, stop_ids, keep_features=True)
            offline = offline_rounds(model, target, cache, entry, "dflash")
            partings.append(explain_parting(model, target, cache, entry, "dflash", offline, live.acceptance_lengths,
                                            live.extra["features"], live.output_ids))
            model_taus.append(sum(offline) / len(offline))
        tree = ddtree_decode(models[0], target, ids, max_new_tokens, stop_ids, budget=24, keep_features=True)
        offline_tree = offline_rounds(models[0], target, cache, entry, "ddtree", budget=24)
        partings.append(explain_parting(models[0], target, cache, entry, "ddtree", offline_tree,
                                        tree.acceptance_lengths, tree.extra["features"], tree.output_ids, budget=24))
    return [p for p in partings if p is not None], taus


def unexplained(partings: list[Parting], dtype: torch.dtype) -> list[str]:
    """The partings the rounding of the target's states does not account for: the product's one rule
    (`impl.offline.walks.unexplained_partings`), which the benches judge by too."""
    return unexplained_partings(partings, dtype)


def test_replay_mask_is_the_inference_mask_of_each_block():
    anchors, context_len, block_len = torch.tensor([3, 4, 9]), 12, 4
    for window, causal in ((None, False), (5, True), (2, True)):
        mask = replay_mask(anchors, context_len, block_len, window, causal)
        for j, a in enumerate(anchors.tolist()):
            rows = mask[j * block_len:(j + 1) * block_len]
            expected = inference_mask(a, block_len, sliding_window=window, causal=causal)
            assert torch.equal(rows[:, :a], expected[:, :a])
            assert not rows[:, a:context_len].any()  # nothing at or after the anchor
            blocks = rows[:, context_len:].view(block_len, len(anchors), block_len)
            assert torch.equal(blocks[:, j], expected[:, a:])
            assert not torch.cat([blocks[:, :j], blocks[:, j + 1:]], dim=1).any()  # never another block


@pytest.fixture(scope="module")
def world_cache_dir(tmp_path_factory):
    """The offline cache's folder for the world's prompts at MAX_NEW_TOKENS in the suite's dtype: the target's
    states are the same whichever drafter replays them (DFlash, DFlash2), built by the first test, read after."""
    return tmp_path_factory.mktemp("world-cache")


@pytest.mark.dynamic
def test_offline_tau_equals_live_tau_per_prompt(trained_pair, test_world, world_cache_dir):  # noqa: F811
    drafter, target, prompts, stop_ids = trained_pair
    cache = load_or_build_cache(world_cache_dir, test_world.target, target, prompts, MAX_NEW_TOKENS, stop_ids)
    # A second drafter reading other target layers replays from the same cache; its rotary is partial, scaled
    # and interleaved, which the replay's rotary (the drafter's own pieces) must follow too. Its random weights are
    # seeded: unseeded, they came from whatever the worker ran before, so its drafts (and with them the shapes of
    # the live target forwards, which bfloat16 rounds differently) changed from run to run.
    torch.manual_seed(0)
    other = placed_drafter(DFlashDrafter(tiny_spec(hidden_size=drafter.spec.hidden_size, intermediate_size=64,
                                                   target_vocab_size=drafter.spec.target_vocab_size, num_target_layers=4,
                                                   target_layer_ids=(0, 3), mask_token_id=drafter.mask_token_id,
                                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                   partial_rotary_factor=0.5,
                                                   rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                   rope_style="gptj")))
    for entry, (prompt_id, _) in zip(cache.prompts, prompts):
        assert entry.id == prompt_id
    partings, taus = replay_against_live([drafter, other], target, cache, prompts, stop_ids)
    taus = taus[0]  # the trained drafter's; the random one accepts next to nothing
    assert unexplained(partings, audit_dtype()) == []  # float32: no parting at all
    assert max(taus) > 1.5  # the trained drafter's walks are not trivial


@pytest.fixture(scope="module")
def bf16_pairs(trained_pair, dflash2_pair, test_world):
    """The world's target loaded in bfloat16 (as `--dtype bfloat16` loads it) and both drafters in bfloat16."""
    from impl.body_shapes import build_drafter
    from foundation.placement import Placement, built_in
    from foundation.target import load_target_model

    target = load_target_model(test_world.target, Placement(torch.device("cpu"), torch.bfloat16, "test"))
    # Built as `compare`/`eval` build them; the fixtures' float32 drafters stay as they are.
    drafters = [built_in(torch.device("cpu"), torch.bfloat16,
                         lambda d=pair[0]: build_drafter(d.spec, d.state_dict())).eval()
                for pair in (trained_pair, dflash2_pair)]
    assert all(d.rotary_emb.inv_freq.dtype == torch.float32 for d in drafters)  # computed in float32, kept so
    return drafters, target, trained_pair[2], trained_pair[3]


# `make test`'s bfloat16 pass holds it: test_offline_tau_equals_live_tau_per_prompt (DFlash and DDTree) and
# test_dflash2_offline_tau_equals_live_tau_per_prompt run there on the bfloat16 target, and
# tests/test_offline_cache.py::test_the_cache_keeps_the_target_dtype_and_its_size_is_the_states that they are never upcast.
@pytest.mark.full
def test_bf16_offline_tau_equals_live_tau_per_prompt(bf16_pairs, test_world, tmp_path):
    """In bfloat16, every round of the replay is the live loop's, DFlash, DFlash2 and DDTree, up to drafter
    near-ties the rounding of the target's states decides (`unexplained`). Which prompt parts, if any, is the
    kernels' accident: on a test world once trained with an AVX-512 CPU's own kernels, one prompt's DDTree walk parted
    in round 4 (live 3, replay 2, the same output): the cache's states of that prompt, left-padded in a batch of
    eight, were rounded apart from the live loop's from position 22 on (about an ulp), and the 24-node tree's last
    place went to another path (gap 0.003 of log-probability, moved 0.05).
    (With SDPA attention three of these prompts walk differently: see `Placement.attn_implementation`.)"""
    (drafter, drafter2), target, prompts, stop_ids = bf16_pairs
    cache = load_or_build_cache(tmp_path, test_world.target, target, prompts, MAX_NEW_TOKENS, stop_ids)
    assert {t.dtype for entry in cache.prompts for t in entry.layers.values()} == {torch.bfloat16}  # never upcast
    partings, taus = replay_against_live([drafter, drafter2], target, cache, prompts, stop_ids)
    taus = taus[0] + taus[1]
    assert unexplained(partings, torch.bfloat16) == []
    assert max(taus) > 1.5
    assert {p.dtype for p in [*target.parameters(), *drafter.parameters()]} == {torch.bfloat16}


@pytest.mark.dynamic
def test_dflash2_offline_tau_equals_live_tau_per_prompt(dflash2_pair, test_world, world_cache_dir):
    """The selector's greedy path from the cache, round by round as the live loop walks it."""
    drafter, target, prompts, stop_ids = dflash2_pair
    assert drafter.spec.family == "dflash2"
    cache = load_or_build_cache(world_cache_dir, test_world.target, target, prompts, MAX_NEW_TOKENS, stop_ids)
    mismatches, taus = [], []
    for entry, (_, ids) in zip(cache.prompts, prompts):
        live = dflash_decode(drafter, target, ids, MAX_NEW_TOKENS, stop_ids)
        offline = offline_rounds(drafter, target, cache, entry, "dflash")
        mismatch = find_mismatch(entry, offline, live.acceptance_lengths, live.output_ids)
        mismatches += [mismatch.describe()] if mismatch else []
        taus.append(sum(offline) / len(offline))
    assert mismatches == []
    assert max(taus) > 1.5


@pytest.mark.dynamic
def test_ddtree_on_a_dflash2_drafter_is_refused_with_the_reason(dflash2_pair, test_world, tmp_path):
    drafter, target, prompts, stop_ids = dflash2_pair
    cache = load_or_build_cache(tmp_path, test_world.target, target, prompts[:1], 8, stop_ids)
    for run in (lambda: ddtree_decode(drafter, target, prompts[0][1], 8, stop_ids, budget=8),
                lambda: offline_rounds(drafter, target, cache, cache.prompts[0], "ddtree", budget=8)):
        with pytest.raises(AuditError, match="DDTree is defined on DFlash drafters only"):
            run()


@pytest.mark.dynamic
def test_cache_is_reused_and_keyed_by_settings(trained_pair, test_world, tmp_path, monkeypatch):  # noqa: F811
    _, target, prompts, stop_ids = trained_pair
    prompts = prompts[:2]
    first = load_or_build_cache(tmp_path, test_world.target, target, prompts, 16, stop_ids)
    files = list(tmp_path.glob("*.safetensors"))
    assert [f.stem for f in files] == [first.key]

    def no_target_forward(*args, **kwargs):
        raise AssertionError("the target ran although the cache exists")

    monkeypatch.setattr(target, "forward", no_target_forward)
    monkeypatch.setattr(target.get_decoder(), "forward", no_target_forward)
    again = load_or_build_cache(tmp_path, test_world.target, target, prompts, 16, stop_ids)
    for a, b in zip(first.prompts, again.prompts):
        assert a.id == b.id and a.prompt_len == b.prompt_len
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.margin, b.margin)
        assert a.layers.keys() == b.layers.keys() and all(torch.equal(a.layers[i], b.layers[i]) for i in a.layers)
    ids = [p[0].tolist() for _, p in prompts]
    numerics = (target_dtype(target), target_device(target).type)  # the target's: part of the key
    assert cache_key(test_world.target, ids, 16, stop_ids, *numerics) == first.key
    assert cache_key(test_world.target, ids, 17, stop_ids, *numerics) != first.key
    assert cache_key(test_world.target, ids[:1], 16, stop_ids, *numerics) != first.key


@pytest.mark.dynamic
def test_cache_holds_the_layers_asked_for_as_output_hidden_states_reads_them(trained_pair, test_world, tmp_path):  # noqa: F811
    _, target, prompts, stop_ids = trained_pair
    layers = target.config.num_hidden_layers
    cache = load_or_build_cache(tmp_path, test_world.target, target, prompts[:1], 8, stop_ids, layer_ids=[layers - 1, 0])
    entry = cache.prompts[0]
    with torch.no_grad():
        out = target(entry.token_ids[None], output_hidden_states=True)
    assert sorted(entry.layers) == [0, layers - 1] == cache.layer_ids  # the union asked for, nothing more
    # Captured while generating, one position per forward: equal to one full forward up to fp32 rounding
    # (a few ulps of the layer's scale; tests/test_offline_cache.py bounds it tightly).
    assert torch.allclose(entry.features([0, layers - 1])[0],
                          torch.cat([out.hidden_states[1][0], out.hidden_states[layers][0]], -1), atol=1e-4)
    top2 = out.logits[0].float().topk(2, -1).values  # the margin of the logits as they are, in float32
    assert torch.allclose(entry.margin, top2[:, 0] - top2[:, 1], atol=1e-4)
    with pytest.raises(KeyError, match="not \\[1\\]"):
        entry.features([1])
    HiddenStateCache.load(tmp_path / f"{cache.key}.safetensors")


def test_mismatch_names_the_position_and_margin():
    entry = type("Entry", (), {})()
    entry.id, entry.prompt_len, entry.margin = "p", 10, torch.arange(40, dtype=torch.float32) / 100
    mismatch = find_mismatch(entry, [3, 2, 4], [3, 1, 5])
    assert (mismatch.round, mismatch.position) == (1, 10 + 3 + 0)
    assert abs(mismatch.margin - 0.13) < 1e-6 and "margin" in mismatch.describe()
    assert find_mismatch(entry, [3, 2], [3, 2]) is None


@pytest.mark.dynamic
def test_offline_rounds_reject_unknown_methods(trained_pair, test_world, tmp_path):  # noqa: F811
    drafter, target, prompts, stop_ids = trained_pair
    cache = load_or_build_cache(tmp_path, test_world.target, target, prompts[:1], 8, stop_ids)
    with pytest.raises(ValueError, match="unknown method"):
        offline_rounds(drafter, target, cache, cache.prompts[0], "beam")
    with pytest.raises(ValueError, match="budget"):
        offline_rounds(drafter, target, cache, cache.prompts[0], "ddtree")


def test_fused_rms_norm_is_bit_identical_to_the_qwen3_module():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from impl.model import rms_norm as _rms

    norm = Qwen3RMSNorm(32, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_rms(norm, x), norm(x))
    assert torch.equal(_rms(norm.bfloat16(), x.bfloat16()), norm(x.bfloat16()))  # other dtypes: the module itself


def test_a_parting_the_rounding_does_not_explain_is_named(bf16_pairs, test_world, tmp_path):
    """A cache whose states are not the target's (here: zeroed after the prompt) parts from the live walk, and
    `explain_parting` does not take it for a near-tie: the features are far more than rounding apart, while the
    replay fed the live loop's own features still walks as the live loop."""
    (drafter, _), target, prompts, stop_ids = bf16_pairs
    cache = load_or_build_cache(tmp_path, test_world.target, target, prompts[:1], 32, stop_ids)
    entry = cache.prompts[0]
    entry.layers = {i: torch.cat([s[:entry.prompt_len], torch.zeros_like(s[entry.prompt_len:])])
                    for i, s in entry.layers.items()}
    live = dflash_decode(drafter, target, prompts[0][1], 32, stop_ids, keep_features=True)
    offline = offline_rounds(drafter, target, cache, entry, "dflash")
    parting = explain_parting(drafter, target, cache, entry, "dflash", offline, live.acceptance_lengths,
                              live.extra["features"], live.output_ids)
    assert parting is not None and parting.replayed and parting.feature_ulps > ULPS
    assert unexplained([parting], torch.bfloat16) == [parting.describe()]
