import pytest

from impl.recipe import Recipe
from impl.spec import DraftSpec, SpecError
from tests.helpers import tiny_spec


def test_valid_spec_normalizes_lists_and_round_trips():
    spec = tiny_spec(target_layer_ids=[1, 3, 4])
    assert spec.target_layer_ids == (1, 3, 4)
    assert spec.fc_in_features == 3 * 64
    assert DraftSpec.from_dict(spec.to_dict()) == spec


def test_layer_types_default_to_full_attention():
    spec = tiny_spec(layer_types=(), sliding_window=None)
    assert spec.layer_types == ("full_attention",) * 3
    assert spec.window_of(0) is None


@pytest.mark.parametrize("overrides, field", [
    (dict(mask_token_id=128), "mask_token_id"),
    (dict(mask_token_id=-1), "mask_token_id"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(target_layer_ids=()), "target_layer_ids"),
    (dict(target_layer_ids=(1, 1)), "target_layer_ids"),
    (dict(target_layer_ids=(6,)), "target_layer_ids"),
    (dict(layer_types=("full_attention",)), "layer_types"),
    (dict(layer_types=("full_attention", "banana", "full_attention")), "layer_types"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(block_size=0), "block_size"),
    (dict(head_dim=15), "head_dim"),
    (dict(hidden_size=-4), "hidden_size"),
])
def test_inconsistent_spec_names_the_field(overrides, field):
    with pytest.raises(SpecError) as info:
        tiny_spec(**overrides)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:")
    assert "\n" not in str(info.value)


def test_from_dict_rejects_unknown_and_missing_fields():
    data = tiny_spec().to_dict()
    with pytest.raises(SpecError, match="unknown fields"):
        DraftSpec.from_dict({**data, "wat": 1})
    del data["target_vocab_size"]
    with pytest.raises(SpecError, match="missing fields.*target_vocab_size"):
        DraftSpec.from_dict(data)


def test_recipe_defaults_are_speculators_model_level_defaults_and_validated():
    from reference_adapters.speculators_recipe import model_level

    assert Recipe() == model_level().recipe  # read from the installed speculators, not restated
    with pytest.raises(SpecError, match="^loss_fn"):
        Recipe(loss_fn="mse")
    with pytest.raises(SpecError, match="^per_position_loss_weight"):
        Recipe(per_position_loss_weight="linear")
    for alpha in (0.0, 1.5):
        with pytest.raises(SpecError, match="^dpace_alpha"):
            Recipe(dpace_alpha=alpha)
    with pytest.raises(SpecError, match="^gamma"):
        Recipe(gamma=0)


def test_recipe_of_a_checkpoint_written_before_dpace_loads_as_it_was_trained():
    # Such a checkpoint says `loss_kind` and nothing about weighting: it trained with fixed decay.
    old = {"gamma": 7.0, "loss_kind": "ce", "verifier_source_layer": None, "noise_std": 0.0, "max_anchors": 48,
           "sample_from_anchor": False, "data_hash": "h", "extra": {}}
    recipe = Recipe.from_dict(old)
    assert (recipe.loss_fn, recipe.per_position_loss_weight, recipe.gamma) == ("ce", "fixed-exp-decay", 7.0)
    assert Recipe.from_dict(recipe.to_dict()) == recipe


def test_dpace_needs_ce_is_a_rule_of_the_recipe_type():
    declared = Recipe(loss_fn="kl_div", per_position_loss_weight="dpace")  # a declared recipe is audited, not refused
    with pytest.raises(SpecError, match="per_position_loss_weight: dpace needs loss_fn ce"):
        declared.check_trainable()
    Recipe(loss_fn="ce", per_position_loss_weight="dpace").check_trainable()
    with pytest.raises(SpecError, match="verifier_source_layer: 7 outside the target's decoder layers 0..3"):
        Recipe(verifier_source_layer=7).check_trainable(num_target_layers=4)


def test_the_activations_accepted_without_transformers_are_transformers_own():
    """`COMMON_ACTIVATIONS` spares a static audit the import of transformers.activations: each must be in ACT2FN,
    and a name outside it is still looked up there."""
    from transformers.activations import ACT2FN

    from impl.spec import COMMON_ACTIVATIONS, is_known_activation

    assert COMMON_ACTIVATIONS <= set(ACT2FN)
    assert is_known_activation("gelu_fast") and not is_known_activation("wibble") and not is_known_activation(["silu"])


def test_the_qwen3_defaults_are_what_transformers_qwen3config_fills_in():
    """One rope theta (and window) default, the one both references apply to a config that states none: z-lab builds
    its drafter from a Qwen3Config, speculators its layer config."""
    from transformers import Qwen3Config

    from impl.defaults import QWEN3_DEFAULTS

    config = Qwen3Config()
    assert QWEN3_DEFAULTS["rope_theta"] == config.rope_parameters["rope_theta"] == Qwen3Config.default_theta
    for name in ("rms_norm_eps", "max_position_embeddings", "hidden_act", "attention_bias"):
        assert QWEN3_DEFAULTS[name] == getattr(config, name), name
    assert DraftSpec.model_fields["rope_theta"].default == QWEN3_DEFAULTS["rope_theta"]


def test_a_ckpt_written_before_the_target_vocab_size_rename_still_loads(tmp_path):
    """ckpt.pt files name the target's vocabulary `vocab_size` from before the rename: read as target_vocab_size."""
    import torch

    from drafter_files.checkpoint import load_checkpoint
    from foundation.ckpt_file import write_ckpt

    spec = tiny_spec()
    old = {("vocab_size" if name == "target_vocab_size" else name): value for name, value in spec.to_dict().items()}
    write_ckpt(tmp_path / "old.pt", old, {"fc.weight": torch.zeros(1)})
    ckpt = load_checkpoint(tmp_path / "old.pt")
    assert ckpt.spec == spec and "target_vocab_size" in ckpt.spec_written and "vocab_size" not in ckpt.spec_written


def test_docs_settings_table_is_the_generated_one():
    from pathlib import Path

    from impl.spec import settings_table

    page = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    assert settings_table() in page, "run: python -m impl.spec"


def test_each_setting_is_checked_by_its_declaration():
    """A setting's own range, from its Field alone: a planted bound is checked, with the declared words."""
    from impl.spec import SETTINGS
    from tests.helpers import setting_problem

    assert setting_problem("block_size", 0) == "must be a positive integer, got 0"
    assert setting_problem("block_size", 1 << 25) == f"{1 << 25} is past any real model's (at most {1 << 24:,})"
    assert setting_problem("partial_rotary_factor", 1.5) == "must be in (0, 1], got 1.5"
    assert setting_problem("markov_head_type", "lstm") == "must be one of vanilla, gated, rnn, got 'lstm'"
    assert setting_problem("xpress_rank", 0) == "must be an integer >= 1, got 0"
    assert setting_problem("conv_kernel_size", None) is None and setting_problem("hidden_size", None) is not None
    with pytest.raises(SpecError, match="^rms_norm_eps: must be positive, got -1.0$"):
        tiny_spec(rms_norm_eps=-1.0)
    assert all(info.description for info in SETTINGS.values())


@pytest.mark.parametrize("value", ["x", [1.5], None, True, 1 << 40, -1, 0.5, {"a": 1}])
def test_every_refused_value_is_one_line_naming_its_setting(value):
    """pydantic judges every value; what it refuses reaches the user as one SpecError line naming the setting, in the
    tool's words (never pydantic's own "Input should be ..."), for every setting of the spec and of the recipe."""
    from impl.recipe import KNOBS
    from tests.helpers import knob_problem, setting_problem

    base = tiny_spec().to_dict()
    for name, own, build in [*((n, setting_problem(n, value), lambda n: DraftSpec(**{**base, n: value})) for n in base),
                             *((n, knob_problem(n, value), lambda n: Recipe(**{n: value})) for n in KNOBS)]:
        try:
            build(name)
        except SpecError as exc:
            assert "\n" not in str(exc) and "Input should" not in str(exc), (name, str(exc))
            assert exc.field == name or own is None and exc.field in base, (name, str(exc))  # else a rule between
        else:
            assert own is None, (name, own)
