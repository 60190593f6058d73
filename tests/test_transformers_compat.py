"""The target's KV cache as every transformers release in pyproject's range takes it (foundation/transformers_compat.py): passed
under the keyword the installed forward declares, found under either name, cropped by the count to drop. These run
on `make setup`'s transformers and, under `make test-latest`, on the newest."""

from __future__ import annotations

import warnings

import pytest
import torch

from dflash_world.target_training import random_qwen3
from foundation.transformers_compat import cache_argument, crop_to, passed_cache
from impl.decoding import make_target_cache


@pytest.fixture(scope="module")
def target():
    return random_qwen3(num_layers=2, hidden=32, vocab=64)


def test_the_cache_goes_in_under_the_keyword_the_forward_declares(target):
    cache = make_target_cache(target)
    ids = torch.arange(5)[None]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated keyword: transformers warns before it removes
        with torch.inference_mode():
            out = target(ids, **cache_argument(target, cache), use_cache=True)
            # a keyword the forward did not take would leave our cache empty and the next call without the past
            assert cache.get_seq_length() == 5
            step = target(ids[:, -1:] + 1, **cache_argument(target, cache), use_cache=True)
    assert passed_cache({}, out) is cache and passed_cache({}, step) is cache
    with torch.inference_mode():
        whole = target(torch.cat([ids, ids[:, -1:] + 1], dim=1)).logits[:, -1]
    torch.testing.assert_close(step.logits[:, -1], whole)  # the step saw the cached five positions


def test_a_cache_is_found_under_either_name():
    given, carried = object(), object()
    for name in ("cache", "past_key_values"):
        assert passed_cache({name: given}) is given
        assert passed_cache({name: None}, type("Out", (), {name: carried})()) is carried
    assert passed_cache({}) is None


def test_crop_to_keeps_the_first_positions_and_never_grows(target):
    cache = make_target_cache(target)
    with torch.inference_mode():
        target(torch.arange(6)[None], **cache_argument(target, cache), use_cache=True)
    crop_to(cache, 4)
    assert cache.get_seq_length() == 4
    crop_to(cache, 9)  # more than it holds: nothing to drop
    assert cache.get_seq_length() == 4


def test_specforges_length_to_keep_is_cropped_as_the_count_to_drop(target):
    """SpecForge's `spec_generate` crops with the length to keep (a positive `crop`, refused since 5.24): the plug's
    recording cache records it and cuts the same positions on every release."""
    from held.specforge import recorded_caches, sf_draft

    with recorded_caches() as made:
        cache = sf_draft.DynamicCache(config=target.config)
        with torch.inference_mode():
            target(torch.arange(7)[None], **cache_argument(target, cache), use_cache=True)
        cache.crop(3)
        cache.crop(5)  # longer than it now holds: kept whole
    assert made == [cache] and cache.crops == [3, 5] and cache.get_seq_length() == 3


def test_a_model_loads_on_transformers_own_code_whatever_the_environment_says(target, tmp_path, monkeypatch):
    """From 5.25 a plain `from_pretrained` kernelizes the model with hub kernels (and fails without the `kernels`
    package); ours asks for transformers' own torch code, so it loads the same weights and runs the same function."""
    from transformers import Qwen3ForCausalLM

    from foundation.transformers_compat import from_pretrained

    monkeypatch.setenv("USE_HUB_KERNELS", "YES")  # transformers' default: the keyword alone must turn them off
    target.save_pretrained(tmp_path)
    loaded = from_pretrained(Qwen3ForCausalLM, tmp_path).eval()
    assert not getattr(loaded, "use_kernels", False)
    ids = torch.arange(6)[None]
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids).logits, target(ids).logits, rtol=0, atol=0)


def test_the_tool_loads_every_model_through_the_one_helper():
    """A model class's `from_pretrained` called anywhere in the tool or its benchmarks but
    foundation/transformers_compat.py would load with transformers' default, hub kernels from 5.25: configs and
    tokenizers are the only other receivers. (examples/ and the tests' own scripts are a user's code: theirs.)"""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    packages = ("dflash_audit", "impl", "foundation", "catalogue", "reference_adapters", "held", "serving_engines",
                "dflash_world", "drafter_files", "conformance", "bench")
    found = []
    for path in sorted(p for package in packages for p in (repo / package).rglob("*.py")):
        if path.name == "transformers_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained"):
                receiver = ast.unparse(node.func.value)
                if "config" not in receiver.lower() and "tokenizer" not in receiver.lower():
                    found.append(f"{path.relative_to(repo)}:{node.lineno}: {receiver}.from_pretrained")
    assert not found, "\n".join(found)
