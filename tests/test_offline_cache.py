"""The offline cache's build (`impl.offline.capture`): states captured while the continuation is
generated, several prompts per forward, only the layers asked for, in the target's dtype, and
extended rather than rebuilt when a drafter reads other layers."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import greedy_decode
from impl.extract import HiddenStateExtractor, output_head
from impl.offline import cache_bytes_estimate, load_or_build_cache
from impl.offline.cache import kept_layers, layer_path
from impl.offline.capture import capture

from tests.helpers import ULPS

MAX_NEW = 24


def load_in(target_dir, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()


def within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: int = ULPS) -> bool:
    scale = float(torch.maximum(a.abs().max(), b.abs().max()))
    return float((a - b).abs().max()) <= ulps * torch.finfo(a.dtype).eps * scale


def margins_agree(target, a: torch.Tensor, b: torch.Tensor, final_a: torch.Tensor, final_b: torch.Tensor) -> bool:
    """Two builds' top-2 margins [T], each of the logits of its own final (normed) states [T, H].

    float32: within 1e-5, a few ulps of these logits' scale. Below float32 the logits are rounded to the target's
    dtype (1/32 at a logit of 4 in bfloat16) and forwards of other shapes round the states apart (within ULPS ulps,
    above: a GEMM over another number of rows may sum in another order; on an AVX-512 CPU first in layer 0's MLP
    down-projection, oneDNN's bfloat16 kernel); a margin then moves by at most twice the most a logit moves: the
    head applied to the states' difference (in float32) plus one ulp of the logits (a head run over other rows)."""
    if final_a.dtype == torch.float32:
        return torch.allclose(a, b, rtol=0, atol=1e-5)
    weight = output_head(target).weight.detach().to("cpu", torch.float32)
    moved = ((final_a.float() - final_b.float()) @ weight.T).abs().amax(-1)
    rounding = torch.finfo(final_a.dtype).eps * (final_b.float() @ weight.T).abs().amax(-1)  # >= an ulp of any logit
    return bool(((a - b).abs() <= 2 * (moved + rounding)).all())


class ForwardLog:
    """The number of tokens of every forward of the target's decoder body."""

    def __init__(self, target, monkeypatch):
        self.lengths: list[int] = []
        body = target.get_decoder()
        original = body.forward

        def logged(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.lengths.append(ids.shape[1])
            return original(*args, **kwargs)

        monkeypatch.setattr(body, "forward", logged)


@pytest.fixture(scope="module")
def world(trained_pair):
    drafter, target, prompts, stop_ids = trained_pair
    # Prompts of different lengths: a batch of them is padded.
    chosen = [p for _, p in prompts[:4]]
    assert len({p.shape[1] for p in chosen}) > 1
    return target, chosen, stop_ids


@pytest.mark.dynamic
def test_capture_is_the_greedy_continuation_with_one_forward_per_position(world, monkeypatch):
    """Tokens bit-identical to plain greedy decoding; states equal to the former second full
    forward over prompt + continuation within ULPS ulps (not bitwise: a position computed as
    one query against a KV cache, or as one row of the prefill, runs matmuls and attention of
    other shapes, so fp32 sums round differently); and no position is fed twice."""
    target, prompts, stop_ids = world
    layers = target.config.num_hidden_layers
    ids = list(range(layers))
    for prompt in prompts[:2]:
        log = ForwardLog(target, monkeypatch)
        captured = capture(target, [prompt[0]], ids, MAX_NEW, stop_ids)[0]
        monkeypatch.undo()
        tokens = greedy_decode(target, prompt, MAX_NEW, stop_ids)[0]
        assert torch.equal(captured.token_ids, tokens)
        assert log.lengths == [prompt.shape[1]] + [1] * (len(tokens) - prompt.shape[1])  # each position once
        full = HiddenStateExtractor(target, ids)(tokens[None], with_logits=True)
        for i in ids:
            old = full.context[0].view(len(tokens), layers, -1)[:, i]
            assert captured.layers[i].shape == old.shape and within_ulps(captured.layers[i], old), i
        top2 = full.logits[0].float().topk(2, -1).values  # the margin of the logits as they are, in float32
        final = full.context[0].view(len(tokens), layers, -1)[:, layers - 1]  # after the final norm
        assert margins_agree(target, captured.margin, top2[:, 0] - top2[:, 1], captured.layers[layers - 1], final)


@pytest.mark.dynamic
def test_a_padded_batch_gives_each_prompt_what_it_gets_alone(world, monkeypatch):
    """fp32: tokens bit-identical; states within ULPS ulps (the padded batch runs its GEMMs over
    more rows and its attention over masked pad keys, which changes fp32 summation order)."""
    target, prompts, stop_ids = world
    ids = [0, 2, 3]
    log = ForwardLog(target, monkeypatch)
    together = capture(target, [p[0] for p in prompts], ids, MAX_NEW, stop_ids, batch=len(prompts))
    monkeypatch.undo()
    assert len(log.lengths) <= MAX_NEW + 1  # all prompts in one forward per step
    for prompt, batched in zip(prompts, together):
        alone = capture(target, [prompt[0]], ids, MAX_NEW, stop_ids)[0]
        assert torch.equal(batched.token_ids, alone.token_ids) and batched.prompt_len == alone.prompt_len
        for i in ids:
            assert torch.isfinite(batched.layers[i]).all() and within_ulps(batched.layers[i], alone.layers[i]), i
        last = target.config.num_hidden_layers - 1  # kept: the final (normed) state the margin is read from
        assert margins_agree(target, batched.margin, alone.margin, batched.layers[last], alone.layers[last])


@pytest.mark.dynamic
def test_a_drafter_reading_other_layers_extends_the_cache(world, test_world, tmp_path, monkeypatch):
    """Only the missing layer is captured (the cached continuation fed back, no token chosen
    again), the kept layers' files are not rewritten, and the result is bit-identical to a
    cache built with the union at once."""
    target, prompts, stop_ids = world
    named = [(f"p{i}", p) for i, p in enumerate(prompts)]
    first = load_or_build_cache(tmp_path / "a", test_world.target, target, named, MAX_NEW, stop_ids, layer_ids=[1])
    path = tmp_path / "a" / f"{first.key}.safetensors"
    assert kept_layers(path) == [1]
    stamp = layer_path(path, 1).stat().st_mtime_ns
    continuation_stamp = path.stat().st_mtime_ns
    log = ForwardLog(target, monkeypatch)
    extended = load_or_build_cache(tmp_path / "a", test_world.target, target, named, MAX_NEW, stop_ids,
                                   layer_ids=[3, 1])
    monkeypatch.undo()
    assert kept_layers(path) == [1, 3] and extended.layer_ids == [1, 3]
    assert layer_path(path, 1).stat().st_mtime_ns == stamp and path.stat().st_mtime_ns == continuation_stamp
    longest = max(len(p.token_ids) - p.prompt_len for p in first.prompts)
    assert len(log.lengths) == longest + 1  # one replay of the continuations, batched
    fresh = load_or_build_cache(tmp_path / "b", test_world.target, target, named, MAX_NEW, stop_ids,
                                layer_ids=[1, 3])
    for a, b in zip(extended.prompts, fresh.prompts):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.margin, b.margin)
        assert all(torch.equal(a.layers[i], b.layers[i]) for i in (1, 3))
    # Asking for a subset reads it; nothing runs.
    log = ForwardLog(target, monkeypatch)
    only = load_or_build_cache(tmp_path / "a", test_world.target, target, named, MAX_NEW, stop_ids, layer_ids=[3])
    assert log.lengths == [] and only.layer_ids == [3]


def test_the_cache_keeps_the_target_dtype_and_its_size_is_the_states(world, test_world, tmp_path):
    _, prompts, stop_ids = world
    target = load_in(test_world.target, torch.bfloat16)
    named = [(f"p{i}", p) for i, p in enumerate(prompts)]
    cache = load_or_build_cache(tmp_path, test_world.target, target, named, MAX_NEW, stop_ids, layer_ids=[0, 2])
    assert all(t.dtype == torch.bfloat16 for p in cache.prompts for t in p.layers.values())
    path = tmp_path / f"{cache.key}.safetensors"
    on_disk = path.stat().st_size + sum(layer_path(path, i).stat().st_size for i in (0, 2))
    tokens = sum(len(p.token_ids) for p in cache.prompts)
    needed = cache_bytes_estimate(tokens, [0, 2], target.config.hidden_size, torch.bfloat16)
    assert needed == tokens * (2 * target.config.hidden_size * 2 + 12)
    assert needed <= on_disk <= 1.1 * needed
    # Another dtype is another continuation: another key.
    fp32 = load_or_build_cache(tmp_path, test_world.target, load_in(test_world.target, torch.float32), named[:1], MAX_NEW,
                               stop_ids, layer_ids=[0])
    assert fp32.key != cache.key


def test_cache_bytes_estimate_counts_each_layer_once():
    assert cache_bytes_estimate(10, [1, 1, 2], 4, torch.float32) == 10 * (2 * 4 * 4 + 12)
    # Qwen3-8B (H 4096), 5 layers, bf16: 41 KB a token, not 590 KB (all 36 layers in fp32).
    assert cache_bytes_estimate(1, range(5), 4096, torch.bfloat16) == 5 * 4096 * 2 + 12


@pytest.mark.dynamic
def test_speculative_generation_is_plain_greedy_in_fewer_target_passes(trained_pair, test_world, tmp_path):
    """Greedy verification is lossless: the continuation is bit-identical to plain greedy decoding,
    in fewer target passes with a trained drafter; the states (verified blocks instead of single
    tokens) stay within ULPS ulps of the plain build's."""
    drafter, target, prompts, stop_ids = trained_pair
    from impl.offline.speculative import capture_speculative

    ids = [0, 1, 3]
    total_new = total_passes = 0
    for _, prompt in prompts[:3]:
        fast, passes = capture_speculative(target, drafter, prompt[0], ids, 48, stop_ids)
        tokens = greedy_decode(target, prompt, 48, stop_ids)[0]
        assert torch.equal(fast.token_ids, tokens)
        plain = capture(target, [prompt[0]], ids, 48, stop_ids)[0]
        assert all(within_ulps(fast.layers[i], plain.layers[i]) for i in ids)
        last = target.config.num_hidden_layers - 1  # kept: the final (normed) state the margin is read from
        assert margins_agree(target, fast.margin, plain.margin, fast.layers[last], plain.layers[last])
        total_new, total_passes = total_new + len(tokens) - prompt.shape[1], total_passes + passes
    assert total_passes < total_new / 1.5  # one pass per token (+1) without the drafter
    named = [(f"p{i}", p) for i, (_, p) in enumerate(prompts[:2])]
    cache = load_or_build_cache(tmp_path, test_world.target, target, named, 48, stop_ids, layer_ids=ids,
                                drafter=drafter)
    assert [len(p.token_ids) for p in cache.prompts] == [p.shape[1] + 48 for _, p in named]
