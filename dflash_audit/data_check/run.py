"""What `dflash-audit data-check DIR --target T` runs: its flags validated as one pydantic model
(`DataCheckFlags`, dflash_audit/flags/data_check.py; each refusal one line naming its flag), every path checked before a record or the target is
read, the check, and its reports written beside each other (temp file, then rename)."""

from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING

from foundation.errors import AuditError

if TYPE_CHECKING:
    from dflash_audit.flags.data_check import DataCheckFlags

DEFAULT_OUT = Path("reports/data-check")
REPORT_FILES = ("report.json", "index.html")


def load_claim(settings: DataCheckFlags, layout: str, layers: int):
    from dflash_audit.data_check.claims import claim_from_drafter, claim_from_ids, unknown_claim

    if settings.layer_ids is not None:
        return claim_from_ids(layout, list(settings.layer_ids), layers)
    if settings.drafter is not None:
        from dflash_audit.formats import LoadOptions, load_any

        loaded = load_any(settings.drafter, settings.target, LoadOptions(flag_prefix="--drafter"))
        ids = loaded.known_spec.get("target_layer_ids")
        if not ids:
            raise AuditError(f"--drafter {settings.drafter}: its target layer ids are unknown; give --layer-ids")
        return claim_from_drafter(layout, list(ids), layers, str(settings.drafter))
    return unknown_claim(layout)


def check_paths(settings: DataCheckFlags) -> Path:
    from dflash_audit.outputs import check_not_foreign, check_outputs, check_writable
    from foundation.inputs import check_target_dir

    check_target_dir(Path(settings.target))
    out = Path(settings.out) if settings.out is not None else DEFAULT_OUT
    check_outputs({"--out": out, "--json": settings.json_path},
                  {"DIR": settings.dataset, "--target": settings.target, "--drafter": settings.drafter})
    check_writable("--out", out, "dir")
    check_not_foreign("--out", out, settings.force, REPORT_FILES)
    if settings.json_path is not None:
        check_writable("--json", Path(settings.json_path))
        check_not_foreign("--json", Path(settings.json_path), settings.force)
    return out


def run_data_check(settings: DataCheckFlags):
    """The check, its reports written; the DataCheckReport."""
    from dflash_audit.data_check.check import Setting, check_dataset
    from dflash_audit.data_check.loss_mask import Turns
    from dflash_audit.data_check.records import detect_layout
    from dflash_audit.data_check.report import write_report_html, write_report_json
    from foundation.chat_template import ChatTemplate
    from foundation.placement import declared_dtype, resolve_placement
    from foundation.target import load_target_model, load_tokenizer

    out = check_paths(settings)
    chat = ChatTemplate.parse(settings.chat_template, settings.chat_template_kwargs)
    dataset = detect_layout(Path(settings.dataset))
    tokenizer, config = load_tokenizer(settings.target)
    chat.check_kwargs(tokenizer)
    claim = load_claim(settings, dataset.layout, config.num_hidden_layers)
    template = chat.template(tokenizer)
    turns = Turns.of(tokenizer, template, chat.kwargs) if template is not None else None
    placement = resolve_placement(settings.device, settings.dtype, None, settings.target)
    target = load_target_model(settings.target, placement)
    setting = Setting(claim, settings.records, declared_dtype(settings.target), placement.describe()["dtype"],
                      tokenizer, turns)
    report = check_dataset(dataset, target, setting)
    report.facts["placement"] = placement.describe()
    out.mkdir(parents=True, exist_ok=True)
    write_report_json(report, out / "report.json")
    write_report_html(report, out / "index.html")
    if settings.json_path is not None:
        write_report_json(report, Path(settings.json_path))
    return report
