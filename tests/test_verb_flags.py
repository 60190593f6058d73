"""One settings path: every verb's flags are one pydantic model declared once (dflash_audit/flags/), and everything
about a flag comes from that declaration: the typer option, its `--help`, the docs table, and the refusal, one line
naming the flag the user typed. The cases are read from the declarations, so a flag added later is held here too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic.fields import FieldInfo

from dflash_audit.cli import load_verb, main
from dflash_audit.flags import VerbFlags, flag_of
from dflash_audit.flags.tables import FLAG_MODELS, flag_tables, flags_model
from dflash_audit.flags.train import OWNERS
from impl.settings import choices, declared_range

REPO = Path(__file__).resolve().parents[1]
# Each verb's model, and the flags that must be given for it to run at all (any text: the model judges first).
MODELS: dict[str, type] = {verb: flags_model(verb) for verb in FLAG_MODELS}


def test_docs_flag_tables_are_the_generated_ones():
    assert flag_tables() in (REPO / "docs" / "usage.md").read_text(), "run: python -m dflash_audit.flags.tables"


@pytest.mark.parametrize("verb", sorted(FLAG_MODELS))
def test_every_option_of_a_verb_is_a_field_of_its_model(verb):
    """The command's options are the model's fields, one each, under the declared spellings."""
    command = load_verb(verb)
    options = {p.name: p.opts for p in command.params if p.param_type_name == "option" and p.name != "help"}
    model = flags_model(verb)
    extra = {name: info.json_schema_extra or {} for name, info in model.model_fields.items()}
    expected = {name: info for name, info in model.model_fields.items()
                if not (extra[name].get("arguments") or extra[name].get("argument"))}
    arguments = [p.name for p in command.params if p.param_type_name == "argument"]
    assert arguments == [name for name in model.model_fields if extra[name].get("argument")]
    assert set(options) == set(expected)
    for name, info in expected.items():
        assert flag_of(info, name) in options[name]


def bad_values(model: type, name: str, info: FieldInfo) -> list[object]:
    """Values the declaration refuses: outside its bounds, or no choice of it."""
    if choices(info):
        return ["no-such-choice"]
    found = declared_range(model, name)
    out = []
    for kind, bound in found.items():
        step = 1 if isinstance(bound, int) else 0.5
        out.append(bound - step if kind in ("ge", "gt") else bound + step)
        if kind == "gt":
            out.append(bound)
    return out


def refusal_cases() -> list[tuple[str, str, object]]:
    cases = []
    for verb, model in MODELS.items():
        for name, info in model.model_fields.items():
            if verb == "train" and name not in train_flags():
                continue
            cases += [(verb, name, value) for value in bad_values(model, name, info)]
    return cases


def train_flags() -> set[str]:
    return {p.name for p in load_verb("train").params}


def required_args(verb: str, name: str) -> list[str]:
    model = MODELS[verb]
    if verb == "train":  # a family's own setting given with its family
        family = ["--family", OWNERS[name]] if name in OWNERS else []
        return ["--target", "t", "--data", "d", "--out", "o.pt", *family]
    return [part for name, info in model.model_fields.items() if info.is_required()
            for part in (("x",) if (info.json_schema_extra or {}).get("argument") else (flag_of(info, name), "x"))]


def test_the_cases_cover_every_verb():
    """Every verb but doctor (its flags are a switch and two paths, nothing bounded) has a bounded or chosen flag."""
    assert set(MODELS) - {verb for verb, _, _ in refusal_cases()} == {"doctor"}


@pytest.mark.parametrize("verb, name, value", refusal_cases())
def test_a_refused_value_is_one_line_naming_the_flag_typed(verb, name, value, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = MODELS[verb]
    typed = model.name_of(name)
    info = model.model_fields[name]
    if isinstance(value, float) and (info.annotation is int or "int" in str(info.annotation)):
        pytest.skip("an integer flag takes no fraction")  # pragma: no cover - ranges of ints step by 1
    code = main([verb, *required_args(verb, name), typed, str(value)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith(f"dflash-audit: error: {typed}: "), err
    assert "must be" in err or "past any real model's" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing left behind


def numeric_flags() -> list[tuple[str, str]]:
    """(verb, field) of every flag typer reads as a number (an integer or a float, or a list of them)."""
    from typing import get_args

    from dflash_audit.flags import cli_kind

    found = []
    for verb, model in MODELS.items():
        for name, info in model.model_fields.items():
            extra = info.json_schema_extra or {}
            if extra.get("arguments") or extra.get("argument"):
                continue
            kind = cli_kind(info)
            if kind in (int, float) or set(get_args(kind)) & {int, float} or any(
                    set(get_args(arg)) & {int, float} for arg in get_args(kind)):
                found.append((verb, name))
    return found


@pytest.mark.parametrize("verb, name", numeric_flags())
def test_text_given_to_a_number_flag_is_one_line_naming_the_flag(verb, name, capsys, tmp_path, monkeypatch):
    """Every number flag of every verb (typer reads the text): `abc` is one line naming the flag typed, exit 2."""
    monkeypatch.chdir(tmp_path)
    model = MODELS[verb]
    typed = model.name_of(name)
    code = main([verb, *required_args(verb, name), typed, "abc"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith("dflash-audit: error: ") and typed in err, err
    assert list(tmp_path.iterdir()) == []


# -- no hand check of a declared flag outside its model -------------------------------------------------------------
PRODUCT = ("dflash_audit", "impl", "foundation", "serving_engines", "reference_adapters", "drafter_files")
WORDS = (" must be", ": must be", ": expected", " must be one of", ": unknown", " unknown")


def declared_flags() -> set[str]:
    flags = set()
    for verb, model in MODELS.items():
        flags |= {model.name_of(name) for name in model.model_fields}
    return {f for f in flags if f.startswith("--")}


def hand_checks(source: str, path: str, flags: set[str]) -> list[str]:
    """`path:line` of each message that words a declared flag's own refusal (`"--budget must be ..."`)."""
    found = set()
    refusals = tuple(f + word for f in flags for word in WORDS)  # one startswith over all of them, per string
    for node in ast.walk(ast.parse(source, path)):
        text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else (
            node.values[0].value if isinstance(node, ast.JoinedStr) and node.values
            and isinstance(node.values[0], ast.Constant) else None)
        if isinstance(text, str) and text.startswith(refusals):
            found.add(f"{path}:{node.lineno}")
    return sorted(found)


def test_no_declared_flag_is_checked_by_hand():
    flags = declared_flags()
    found = []
    for package in PRODUCT:
        for file in sorted((REPO / package).rglob("*.py")):
            rel = str(file.relative_to(REPO))
            found += hand_checks(file.read_text(encoding="utf-8"), rel, flags)
    assert found == [], "a flag's refusal worded by hand; declare it on the flag's Field (dflash_audit/flags/)"


def test_a_planted_hand_check_is_caught():
    planted = 'def f(budget):\n    if budget < 1:\n        raise AuditError(f"--budget must be at least 1, got {budget}")\n'
    assert hand_checks(planted, "x.py", declared_flags()) == ["x.py:3"]


def test_every_model_is_a_verb_flags_model():
    assert all(issubclass(flags_model(verb), VerbFlags) for verb in FLAG_MODELS)
