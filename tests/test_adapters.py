"""The reference adapters as a harness: the registry, the protocol, version guards, the packages really called.

Their parity with ours, operation by operation, lives in `conformance/`."""

from __future__ import annotations

import importlib
import inspect
from unittest import mock

import pytest
import torch

import reference_adapters.speculators_adapter as spec_adapter
import reference_adapters.zlab_adapter as zlab_adapter
from foundation.errors import AuditError
from impl.interface import DFlashImplementation, Unsupported, supports
from impl.model import DFlashDrafter
from reference_adapters import IMPLEMENTATIONS, version_guard
from tests.helpers import tiny_spec, tiny_target


def get_implementation(name: str, **kwargs):
    """A fresh implementation object (`ours`, `speculators` or `zlab`)."""
    if name not in IMPLEMENTATIONS:
        raise AuditError(f"unknown implementation {name!r}; expected one of {sorted(IMPLEMENTATIONS)}")
    module_name, class_name = IMPLEMENTATIONS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)(**kwargs)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls on 2 shared cores run far faster single-threaded.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def impls():
    return {name: get_implementation(name) for name in IMPLEMENTATIONS}


@pytest.fixture(scope="module")
def spec():
    # Sliding + full layers; a window wider than the test contexts, where the two
    # references' sliding rules (training vs inference) coincide.
    return tiny_spec(sliding_window=32)


@pytest.fixture(scope="module")
def weights(spec):
    torch.manual_seed(0)
    model = DFlashDrafter(spec)
    with torch.no_grad():  # non-trivial norms, so a mixed-up norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    return model.state_dict()


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_registry_gives_each_implementation_behind_the_protocol(impls):
    assert sorted(impls) == ["ours", "speculators", "zlab"]
    for name, impl in impls.items():
        assert isinstance(impl, DFlashImplementation) and impl.name == name
    assert not supports(impls["speculators"], "generate") and not supports(impls["speculators"], "inference_mask")
    assert not supports(impls["zlab"], "loss") and supports(impls["zlab"], "generate")
    with pytest.raises(AuditError, match="unknown implementation"):
        get_implementation("eagle")


def test_speculators_cannot_make_full_attention_blocks_causal(impls):
    with pytest.raises(Unsupported, match="bidirectional"):
        impls["speculators"].training_mask(torch.zeros(10, dtype=torch.long), torch.tensor([2]), 4, None, True)


def test_zlab_generate_runs_on_cpu_and_is_lossless(impls, spec, weights, target):
    drafter = impls["zlab"].build_drafter(spec, weights)
    torch.manual_seed(4)
    prompt = torch.randint(0, spec.target_vocab_size - 1, (1, 7))
    result = impls["zlab"].generate(drafter, target, prompt, max_new_tokens=20, stop_token_ids=None)
    generated = result.output_ids.shape[1] - prompt.shape[1]
    # The prefill emits the first token; every round then adds accepted drafts + the bonus token.
    assert sum(result.acceptance_lengths) + result.extra["prefill_tokens"] == generated == 20
    assert all(1 <= n <= spec.block_size for n in result.acceptance_lengths)
    greedy = target.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(result.output_ids, greedy)  # speculative decoding never changes greedy output


def test_zlab_declares_training_unsupported(impls):
    for operation in zlab_adapter.TRAINING_OPERATIONS:
        assert not supports(impls["zlab"], operation)
        with pytest.raises(Unsupported, match="no training code"):
            getattr(impls["zlab"], operation)()


def test_adapters_call_the_packages(impls, spec, weights):
    """No adapter carries a copy of reference logic: every rule is the package's, called live."""
    spec_impl, zlab_impl = impls["speculators"], impls["zlab"]
    loss_mask = torch.ones(1, 20)
    calls = [
        (zlab_adapter.zlab, "build_target_layer_ids", lambda: zlab_impl.default_target_layer_ids(12, 3)),
        (zlab_adapter.zlab, "extract_context_feature",
         lambda: zlab_impl.context_features((torch.ones(1, 1, 2),) * 3, [0])),
        (zlab_adapter.zlab, "_attention_mask", lambda: zlab_impl.inference_mask(3, 4, 2, True)),
        (zlab_adapter.zlab, "dflash_generate", lambda: zlab_impl.generate(None, None, None, 1, None)),
        (spec_adapter.spec_utils, "resolve_target_layer_ids", lambda: spec_impl.default_target_layer_ids(12, 3)),
        (spec_adapter, "select_anchors", lambda: spec_impl.select_anchors(loss_mask, 4, 4, 0)),
        (spec_adapter, "create_anchor_block_mask_mod",
         lambda: spec_impl.training_mask(torch.zeros(20, dtype=torch.long), torch.tensor([3]), 4, None, False)),
        (spec_adapter, "dflash_loss_decay", lambda: spec_impl.loss_weights(4, 4.0, False)),
        (spec_adapter, "compute_metrics", lambda: spec_impl.loss(None, None, None, 4, 4.0, "kl_div", False)),
    ]
    for module, name, call in calls:
        with mock.patch.object(module, name, side_effect=LookupError(name)) as package_function:
            with pytest.raises(LookupError, match=name):
                call()
        assert package_function.called, name
    for module in (spec_adapter, zlab_adapter):
        source = inspect.getsource(module)
        for reference_rule in ("randperm", "torch.exp", "cumprod", "start + i *", "repeat_interleave"):
            assert reference_rule not in source, f"{module.__name__} re-implements {reference_rule!r}"


@pytest.mark.parametrize("package, found, hint", [
    ("dflash", None, "pip install dflash==0.1.0"),
    ("speculators", "0.8.1", "pip install --no-deps speculators==0.9.0"),
])
def test_version_guard_says_how_to_install_the_pinned_release(package, found, hint):
    with mock.patch.object(version_guard, "installed_version", return_value=found):
        with pytest.raises(AuditError) as error:
            version_guard.check_reference(package)
    message = str(error.value)
    assert hint in message and "\n" not in message
    assert ("not installed" if found is None else found) in message
    if package == "speculators":
        assert "make setup" in message
    assert {name: version_guard.check_reference(name) for name in ("dflash", "speculators")} == \
        {"dflash": "0.1.0", "speculators": "0.9.0"}


def test_saved_directories_load_through_the_packages(tmp_path, impls, spec, weights, target):
    from transformers import Qwen3ForCausalLM

    from drafter_files.zlab_format import save_zlab_dir

    target.save_pretrained(tmp_path / "target")
    local_target = Qwen3ForCausalLM.from_pretrained(tmp_path / "target").eval()
    # A target loaded from a directory: speculators' own `load_verifier_weights` fills its tensors.
    built = impls["speculators"].build_drafter(spec, weights, local_target)
    assert built.config.speculators_config.verifier.name_or_path == str(tmp_path / "target")
    assert torch.equal(built.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(built.verifier_norm.weight, target.model.norm.weight)
    spec_adapter.save_speculators_model(built, tmp_path / "spec")
    loaded = spec_adapter.load_speculators_model(tmp_path / "spec")
    assert loaded.config.transformer_layer_config._attn_implementation == "eager"
    assert torch.equal(loaded.lm_head.weight, target.lm_head.weight)  # reloaded from the recorded verifier
    save_zlab_dir(tmp_path / "zlab", spec, weights)
    zlab_model = zlab_adapter.load_zlab_model(tmp_path / "zlab")
    assert zlab_model.target_layer_ids == list(spec.target_layer_ids) and zlab_model.block_size == spec.block_size
    for key, value in weights.items():
        assert torch.equal(loaded.state_dict()[key], value) and torch.equal(zlab_model.state_dict()[key], value)
