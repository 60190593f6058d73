import json

import pytest
import torch
from dflash.model import DFlashDraftModel

from dflash_audit.formats import load_any
from foundation.errors import CheckpointError
from impl.body_shapes import build_drafter
from drafter_files.checkpoint import load_checkpoint, save_checkpoint
from impl.model import DFlashDrafter
from impl.recipe import Recipe
from drafter_files.zlab_format import save_zlab_dir
from tests.helpers import tiny_spec, zlab_model_for


def test_zlab_saved_directory_loads_into_ours(tmp_path):
    """A directory z-lab's own `save_pretrained` wrote: same spec, same tensors in ours (its forward's
    parity with z-lab's, caches included, is conformance's: #10-#12 and #17)."""
    spec = tiny_spec()
    torch.manual_seed(0)
    zlab = zlab_model_for(spec)
    zlab.save_pretrained(tmp_path / "z")
    loaded = load_any(tmp_path / "z")
    assert loaded.spec == spec
    ours = build_drafter(loaded.spec, loaded.state_dict).eval()
    for key, value in zlab.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


def test_our_zlab_directory_loads_in_zlab_package(tmp_path):
    spec = tiny_spec()
    ours = DFlashDrafter(spec)
    save_zlab_dir(tmp_path / "z", spec, ours.state_dict())
    zlab = DFlashDraftModel.from_pretrained(tmp_path / "z")
    assert zlab.target_layer_ids == list(spec.target_layer_ids)
    assert zlab.block_size == spec.block_size and zlab.mask_token_id == spec.mask_token_id
    for key, value in ours.state_dict().items():
        assert torch.equal(zlab.state_dict()[key], value), key


def test_ckpt_round_trip_with_wrapper_prefixes(tmp_path):
    spec = tiny_spec()
    model = DFlashDrafter(spec)
    recipe = Recipe(gamma=7.0, verifier_source_layer=3)
    save_checkpoint(tmp_path / "ckpt.pt", model, recipe, step=12, training_state={"lr": torch.tensor(0.1)})
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt.spec == spec and ckpt.recipe == recipe and ckpt.step == 12
    assert torch.equal(ckpt.training_state["lr"], torch.tensor(0.1))
    wrapped = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}
    rebuilt = build_drafter(spec, wrapped)
    for key, value in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[key], value)
    assert not list(tmp_path.glob(".ckpt.pt.*")), "temp file left behind"


def test_a_ckpt_written_with_the_old_optimizer_entry_still_resumes(tmp_path):
    """Before it was `training_state`, ckpt.pt held optimizer, scheduler, RNG and history under `optimizer`."""
    spec = tiny_spec()
    model = DFlashDrafter(spec)
    save_checkpoint(tmp_path / "ckpt.pt", model, training_state={"history": [1.0, 0.5]})
    payload = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    payload["optimizer"] = payload.pop("training_state")
    torch.save(payload, tmp_path / "old.pt")
    assert load_checkpoint(tmp_path / "old.pt").training_state == {"history": [1.0, 0.5]}


def test_corrupt_and_malicious_checkpoints_give_one_line_errors(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(bad)
    assert "\n" not in str(info.value) and "bad.pt" in str(info.value)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "spec": Evil()}, evil)
    with pytest.raises(CheckpointError, match="not a readable ckpt.pt"):
        load_checkpoint(evil)


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    spec = tiny_spec()
    state = DFlashDrafter(spec).state_dict()
    del state["layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers.1.mlp.up_proj.weight'"):
        build_drafter(spec, state)
    state = DFlashDrafter(spec).state_dict()
    state["fc.weight"] = torch.zeros(64, 4 * 64)
    with pytest.raises(CheckpointError, match=r"tensor 'fc.weight' has shape \(64, 256\)"):
        build_drafter(spec, state)


def test_zlab_config_errors_name_the_field(tmp_path):
    spec = tiny_spec()
    save_zlab_dir(tmp_path / "z", spec, DFlashDrafter(spec).state_dict())
    config = json.loads((tmp_path / "z" / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 500
    (tmp_path / "z" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="mask_token_id: 500 is not a token id"):
        load_any(tmp_path / "z")
    (tmp_path / "z" / "model.safetensors").write_bytes(b"\0" * 10)
    config["dflash_config"]["mask_token_id"] = 5
    (tmp_path / "z" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        load_any(tmp_path / "z")


@pytest.mark.parametrize("overrides", [
    {},
    {"attention_bias": True},
    {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8, "intermediate_size": 96},
    {"target_layer_ids": (2,), "num_hidden_layers": 1, "layer_types": ("full_attention",)},
    {"draft_vocab_size": 50},
    {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4,
     "sliding_window_non_causal": True},
    {"conv_kernel_size": 2, "conv_group_size": 32, "selector_rank": 4, "selector_top_k": 2, "attention_bias": True},
    *({"markov_rank": 8, "markov_head_type": kind, "enable_confidence_head": True, "confidence_head_with_markov": with_markov}
      for kind, with_markov in (("vanilla", True), ("gated", False), ("rnn", True))),
    {"markov_rank": 0, "markov_head_type": "vanilla", "enable_confidence_head": True,
     "confidence_head_with_markov": False},
    {"xpress_rank": 8, "xpress_mlp_ratio": 3, "num_jacobi_passes": 2},
])
def test_body_shapes_are_the_built_drafters(overrides):
    """`impl.body_shapes` (what a static audit reads, without transformers' modelling) is the model's own table:
    the meta-built drafter's state_dict, key for key, in order, shape for shape."""
    from impl.body_shapes import body_shapes

    spec = tiny_spec(**overrides)
    with torch.device("meta"):
        built = {key: tuple(tensor.shape) for key, tensor in DFlashDrafter(spec).state_dict().items()}
    assert list(body_shapes(spec).items()) == list(built.items())
