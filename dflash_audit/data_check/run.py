"""What `dflash-audit data-check DIR --target T` runs: its flags validated as one pydantic model
(`DataCheckSettings`, each refusal one line naming its flag), every path checked before a record or the target is
read, the check, and its reports written beside each other (temp file, then rename)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from foundation.errors import AuditError
from impl.settings import Declared

DEFAULT_OUT = Path("reports/data-check")
REPORT_FILES = ("report.json", "index.html")


class DataCheckSettings(Declared):
    """data-check's flags; pydantic holds each to its declaration."""

    SUBJECT = "data-check settings"

    dataset: Path = Field(description="the dataset: a folder of vLLM / speculators *.safetensors records (or "
                                      "speculators' output folder holding hidden_states/), or of SpecForge "
                                      "*.ckpt / *.ckpt.gz records; or one record file")
    target: Path = Field(description="the target's Hugging Face folder: its states are recomputed on each record's "
                                     "token ids")
    layer_ids: str | None = Field(None, description="the layer ids the dataset claims, in its writer's convention "
                                                    "(vLLM's for vLLM and speculators files: 0 the embeddings, i the "
                                                    "output after decoder layer i-1, N the last layer before the final "
                                                    "norm; z-lab's for SpecForge), comma-separated")
    drafter: Path | None = Field(None, description="the drafter that trains on the dataset (any format compare "
                                                   "reads): the layers its trainer reads are the claim")
    records: int = Field(16, gt=0, le=1_000_000, description="records checked by value, spread evenly over the "
                                                             "dataset (one in memory at a time)")
    device: str = Field("auto", description="where the target runs (auto, cpu, cuda, cuda:N)")
    dtype: str = Field("float32", description="the target's dtype for the recomputation (auto: its config's); "
                                              "float32 names states stored in any precision")
    chat_template: str = Field("auto", description="the template whose assistant turns loss_mask is held to: auto "
                                                   "(the target tokenizer's), none, or a Jinja FILE")
    chat_template_kwargs: str | None = Field(None, description="JSON kwargs for the chat template")
    out: Path | None = Field(None, description="report folder: report.json and index.html (default "
                                               "reports/data-check)")
    json_path: Path | None = Field(None, description="also write report.json here")
    force: bool = Field(False, description="replace report files the tool did not write")

    @field_validator("layer_ids")
    @classmethod
    def ids_text(cls, text: str | None) -> str | None:
        if text is not None:
            from dflash_audit.data_check.claims import parse_layer_ids

            parse_layer_ids(text)
        return text

    @model_validator(mode="after")
    def one_claim(self):
        if self.layer_ids is not None and self.drafter is not None:
            raise ValueError("--layer-ids and --drafter both say what the dataset holds; give one")
        return self

    @classmethod
    def refused(cls, field_name: str, message: str) -> Exception:
        flag = {"json_path": "--json", "dataset": "DIR"}.get(field_name, "--" + field_name.replace("_", "-"))
        return AuditError(message if field_name == cls.SUBJECT else f"{flag} {message}")

    @classmethod
    def refusal(cls, exc, data):
        from impl.settings import first_error

        first = first_error(exc, data)
        if not first["loc"]:  # the rule between flags, worded whole
            return AuditError(str(first["ctx"]["error"]))
        return super().refusal(exc, data)


def option(name: str):
    """The typer option of a setting: its declared default and description."""
    import typer

    info = DataCheckSettings.model_fields[name]
    return typer.Option(info.default, help=info.description)


def load_claim(settings: DataCheckSettings, layout: str, layers: int):
    from dflash_audit.data_check.claims import claim_from_drafter, claim_from_ids, parse_layer_ids, unknown_claim

    if settings.layer_ids is not None:
        return claim_from_ids(layout, parse_layer_ids(settings.layer_ids), layers)
    if settings.drafter is not None:
        from dflash_audit.formats import LoadOptions, load_any

        loaded = load_any(settings.drafter, settings.target, LoadOptions(flag_prefix="--drafter"))
        ids = loaded.known_spec.get("target_layer_ids")
        if not ids:
            raise AuditError(f"--drafter {settings.drafter}: its target layer ids are unknown; give --layer-ids")
        return claim_from_drafter(layout, list(ids), layers, str(settings.drafter))
    return unknown_claim(layout)


def check_paths(settings: DataCheckSettings) -> Path:
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


def run_data_check(settings: DataCheckSettings):
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
