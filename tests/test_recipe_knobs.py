"""Every recipe knob is declared once (impl/recipe.py); the CLI, the run settings, the format vocabulary, the range checks
and the docs table are derived from that declaration, and these tests hold each derivation to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from dflash_audit.cli import load_verb
from dflash_audit.formats.setting_names import ALIASES, BOOL_FIELDS, FLOAT_FIELDS, INT_FIELDS, convert
from impl.recipe import DEFAULTS, KNOBS, RECIPE_FIELDS, TRAIN_DEFAULTS, Recipe, flag_table, train_defaults, train_recipe
from impl.spec import SpecError
from impl.run_settings import RunSettings
from tests.helpers import knob_problem
from impl.train import knob_recipe

REPO = Path(__file__).resolve().parents[1]


def test_docs_flag_table_is_the_generated_one():
    assert flag_table() in (REPO / "docs" / "training.md").read_text(), "run: python -m impl.recipe"


def test_every_knob_declares_its_names_and_whose_default():
    for name, info in KNOBS.items():
        extra = info.json_schema_extra
        assert info.description and extra["default_of"] and extra["flags"], name
        assert {"speculators", "zlab", "names", "family"} <= set(extra), name
        assert name in extra["names"], name  # our own name is one a checkpoint may use
    assert RECIPE_FIELDS == tuple(KNOBS)


def test_train_has_one_option_per_knob_with_its_help_and_default():
    command = load_verb("train")
    options = {param.name: param for param in command.params}
    for name, info in KNOBS.items():
        option = options[name]
        assert option.default is None  # "not given": --recipe speculators fills it
        spelled = [flag for decl in info.json_schema_extra["flags"] for flag in decl.split("/")]
        assert set(spelled) <= set(option.opts) | set(option.secondary_opts), name
        assert info.description in option.help, name
        # the default train uses, said unless the description says it (`(default: the final one)`)
        assert TRAIN_DEFAULTS[name] is None and "(default: " in info.description or \
            f"(default: {TRAIN_DEFAULTS[name]})" in option.help, name


def test_run_settings_have_each_knob_at_its_familys_train_default():
    fields = RunSettings.model_fields
    for name, info in KNOBS.items():
        assert fields[name].default is None, name  # not given: the family's train default
        assert fields[name].annotation == info.annotation | None and fields[name].description == info.description
    assert knob_recipe(RunSettings(target="", out="")) == train_recipe() == Recipe(**TRAIN_DEFAULTS)
    for family in ("dspark", "xpress"):
        resolved = knob_recipe(RunSettings(target="", out="", family=family))
        assert resolved == train_recipe(family) == Recipe(**train_defaults(family))
        assert resolved != train_recipe(), family  # each resolves something differently from dflash
    assert train_recipe("dspark").sample_from_anchor and train_recipe("dspark").loss_fn == "kl_div"
    assert train_recipe("xpress").loss_fn == '{"ce": 0.1, "tv": 0.9}'
    assert knob_recipe(RunSettings(target="", out="", family="xpress", loss_fn="ce")).loss_fn == "ce"  # a flag wins
    assert train_recipe() != Recipe() and Recipe().to_dict() == {**DEFAULTS, "data_hash": "", "extra": {}}


def test_run_settings_take_each_trainable_drafter_setting_from_its_declaration():
    """Each drafter setting `train` takes is one run field, under its run name, of its declared kind and range, at
    `train`'s default: a default or a bound is never written again (pydantic checks the run's values)."""
    from impl import spec
    from impl.settings import base_type

    fields = RunSettings.model_fields
    for name in spec.TRAIN_SETTINGS:
        run, declared = fields[spec.RUN_FIELDS[name]], spec.SETTINGS[name]
        assert run.default == spec.TRAIN_DEFAULTS[name] and run.metadata == declared.metadata, name
        assert base_type(run) == base_type(declared) and run.description == declared.description, name
    taken = set(spec.RUN_FIELDS.values()) | set(KNOBS)
    assert {name for name in fields if name in spec.SETTINGS or name in KNOBS} <= taken
    with pytest.raises(ValueError, match="^block_size: must be a positive integer, got 0$"):
        RunSettings(target="", out="", block_size=0)


def test_the_format_vocabulary_reads_every_knob_by_its_declared_names_and_type():
    for name, info in KNOBS.items():
        for alias in info.json_schema_extra["names"]:
            assert ALIASES[alias] == name, alias
        kind = info.annotation
        assert (name in FLOAT_FIELDS) == (kind is float) and (name in BOOL_FIELDS) == (kind is bool), name
        assert (name in INT_FIELDS) == (kind in (int, int | None)), name
    assert convert("gamma", "7", "args.gamma") == 7.0


@pytest.mark.parametrize("name, value, message", [
    ("gamma", 0, "gamma: must be positive, got 0"),
    ("dpace_alpha", 1.5, "dpace_alpha: must be in (0, 1], got 1.5"),
    ("noise_std", -0.1, "noise_std: must be non-negative, got -0.1"),
    ("max_anchors", 0, "max_anchors: must be positive, got 0"),
    ("selector_loss_alpha", -1, "selector_loss_alpha: must be non-negative, got -1"),
    ("loss_fn", "mse", "loss_fn: 'mse' is not one of ['kl_div', 'ce', 'tv'] nor a JSON dict of them to weights"),
    ("loss_fn", '{"ce": 0.1, "mse": 0.9}', """loss_fn: '{"ce": 0.1, "mse": 0.9}': 'mse' not in ['kl_div', 'ce', 'tv']"""),
    ("per_position_loss_weight", "uniform", "per_position_loss_weight: must be fixed-exp-decay or dpace, got 'uniform'"),
])
def test_each_range_check_and_its_message_come_from_the_declaration(name, value, message):
    with pytest.raises(SpecError) as caught:
        Recipe(**{name: value})
    assert str(caught.value) == message
    assert knob_problem(name, value) == message.split(": ", 1)[1]
    assert knob_problem(name, DEFAULTS[name]) is None


def test_train_refuses_an_out_of_range_knob_in_one_line(tmp_path, capsys):
    from dflash_audit.cli import main

    assert main(["train", "--target", str(tmp_path), "--data", str(tmp_path / "d.jsonl"), "--out",
                 str(tmp_path / "o.pt"), "--gamma", "nan"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert typer  # the CLI module under test is typer's


def test_loss_fn_takes_speculators_weighted_combinations_in_one_spelling():
    from impl.recipe import XPRESS_LOSS

    assert Recipe(loss_fn='{"ce":0.1,"tv":0.9}').loss_fn == XPRESS_LOSS == '{"ce": 0.1, "tv": 0.9}'
    assert Recipe(loss_fn='{"ce": 1}').loss_fn == "ce"  # one term at weight 1 is the term (speculators: the same loss)
    assert convert("loss_fn", {"tv": 0.9, "ce": 0.1}, "args.loss_fn") == '{"tv": 0.9, "ce": 0.1}'
    assert convert("loss_fn", "TV", "args.loss_fn") == "tv"
    assert knob_problem("loss_fn", '{"ce": true}') == """'{"ce": true}': the weight of ce must be a finite number"""


@pytest.mark.parametrize("field, value, words", [
    ("gamma", True, "a finite number"), ("gamma", "inf", "a finite number"), ("gamma", 10 ** 400, "a finite number"),
    ("block_size", 7.5, "an integer"), ("block_size", True, "an integer"), ("block_size", "²", "an integer"),
    ("sample_from_anchor", 1, "true or false"), ("target_layer_ids", [], "a list of integer layer ids"),
    ("layer_types", ["x"], "a list of ['full_attention', 'sliding_attention']"),
    ("rope_scaling", "[" * 100_000, "a JSON object of transformers' rope parameters"),
])
def test_a_declared_value_is_read_by_its_pydantic_type_and_refused_in_one_short_line(field, value, words):
    """A config's value is read by the field's declared type (setting_names.READERS): no looser (1 is no boolean,
    a number past a float's range no gamma), the refusal one line of bounded length naming where it was read."""
    from dflash_audit.formats.setting_names import DeclarationError

    with pytest.raises(DeclarationError) as caught:
        convert(field, value, "args.json: x")
    message = str(caught.value)
    assert message.startswith("args.json: x: ") and message.endswith(f" is not {words}") and len(message) < 300
    assert convert("block_size", " 7 ", "w") == 7 and convert("sample_from_anchor", "TRUE", "w") is True
    assert convert("layer_types", ("full_attention",), "w") == ["full_attention"]
