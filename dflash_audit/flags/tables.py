"""The flag tables of docs/usage.md, one per verb, generated from each verb's flags model
(`python -m dflash_audit.flags.tables`; tests/test_verb_flags.py keeps the page equal to it)."""

from __future__ import annotations

import importlib

from dflash_audit.flags import VerbFlags, flag_help

# Each verb's flags model, by verb, for the tables of docs/usage.md.
FLAG_MODELS = {
    "compare": "dflash_audit.flags.compare:CompareFlags",
    "eval": "dflash_audit.flags.eval:EvalFlags",
    "convert": "dflash_audit.flags.convert:ConvertFlags",
    "demo": "dflash_audit.flags.demo:DemoFlags",
    "serve-check": "dflash_audit.flags.serve_check:ServeCheckFlags",
    "trace": "dflash_audit.flags.trace:TraceFlags",
    "data-check": "dflash_audit.flags.data_check:DataCheckFlags",
    "doctor": "dflash_audit.flags.doctor:DoctorFlags",
    "train": "dflash_audit.flags.train:TrainFlags",
}


def flags_model(verb: str) -> type[VerbFlags]:
    module, name = FLAG_MODELS[verb].split(":")
    return getattr(importlib.import_module(module), name)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def flag_table(verb: str) -> str:
    """The verb's flags as a Markdown table: flag, default, meaning (with its choices and range)."""
    model = flags_model(verb)
    lines = [f"### `{verb}`", "", "| flag | default | meaning |", "|---|---|---|"]
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra or {}
        if extra.get("hidden"):
            continue
        if extra.get("arguments"):
            lines.append(f"| `-- COMMAND...` | | {cell(flag_help(model, name))} |")
            continue
        if extra.get("argument"):
            lines.append(f"| `{extra['flags'][0]}` (argument) | required | {cell(flag_help(model, name))} |")
            continue
        spellings = ", ".join(f"`{s}`" for s in extra.get("flags") or [f"--{name.replace('_', '-')}"])
        default = "required" if info.is_required() else info.get_default(call_default_factory=True)
        # 0 is a default to show (`--eval-every 0`), None, False and an empty list none
        default = "" if default is None or default is False or default == [] else \
            f"`{default}`" if default != "required" else default
        lines.append(f"| {spellings} | {cell(str(default))} | {cell(flag_help(model, name))} |")
    return "\n".join(lines)


def flag_tables() -> str:
    return "\n\n".join(flag_table(verb) for verb in FLAG_MODELS)


if __name__ == "__main__":
    print(flag_tables())
