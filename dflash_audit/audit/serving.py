"""Will it serve as trained? A drafter directory loaded by its format's loader (its trained spec, and the
provenance that says which values the file really declares), held against each engine (`serving_engines`);
`serve-check`'s run: the section, `--live`'s rounds joined, written as JSON and HTML and printed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_audit.audit.report import divergence_count
from dflash_audit.audit.report_html import serving_page_html
from dflash_audit.audit.report_terminal import terminal_section
from dflash_audit.formats import LoadedCheckpoint, LoadOptions, detect_format, load_any
from dflash_audit.outputs import check_not_foreign, check_outputs, check_writable
from catalogue.findings import Finding
from serving_engines import ENGINES, TargetFacts
from serving_engines.verdict import EngineReport, engine_report, trained_values
from foundation.atomic import atomic_write_text
from foundation.errors import AuditError

__all__ = ["EngineReport", "Finding", "divergence_count", "run_serve_check", "section_dict", "serving_section",
           "terminal_section"]
SCHEMA = "dflash-audit-serving/1"

if TYPE_CHECKING:
    from dflash_audit.flags.serve_check import ServeCheckFlags


def trained_of(loaded: LoadedCheckpoint) -> tuple[dict[str, Any], dict[str, str]]:
    defaulted = {name: p.detail for name, p in loaded.provenance.items() if p.source == "default"}
    values, unknown = trained_values(loaded.spec, loaded.raw.draft_vocab_size, defaulted)
    fc = loaded.state_dict.get("fc.weight")
    if "target_layer_ids" in unknown and fc is not None and fc.ndim == 2 and fc.shape[1] % loaded.spec.hidden_size == 0:
        # ids undeclared, their count is not: fc reads one hidden state per target layer
        values["target_layer_count"] = fc.shape[1] // loaded.spec.hidden_size
    return values, unknown


def not_a_directory(engine: str, path: Path, fmt: str) -> EngineReport:
    wants = "a GGUF file" if engine == "llamacpp" else "a drafter directory"
    message = (f"{engine} serves {wants}; {path} is a {fmt} checkpoint it cannot read: write one "
               f"with `dflash-audit convert --from {path} --to DIR --for {engine}`")
    return EngineReport(engine, "", False, message, {}, {},
                        [Finding.serving("loads", "divergence", None, False, "", message, pitfall=31)], None)


def servable(engine: str, fmt: str) -> bool:
    """vLLM and SGLang serve a drafter directory; llama.cpp a GGUF, or the z-lab directory its converter reads."""
    return fmt in (("gguf", "zlab", "speculators") if engine == "llamacpp" else ("zlab", "speculators"))


def serving_section(drafter: str | Path, engines: list[str], target: str | Path | None = None,
                    options: LoadOptions | None = None, **engine_options) -> dict[str, EngineReport]:
    """{engine: EngineReport} for one drafter. `engine_options`: llama-server's command (n_max, kv_type)."""
    drafter = Path(drafter)
    fmt = detect_format(drafter)
    served = [engine for engine in engines if servable(engine, fmt)]
    converted = [engine for engine in engines if engine not in served and engine in ENGINES]
    section = {engine: not_a_directory(engine, drafter, fmt) for engine in engines
               if engine not in served and engine not in converted}
    if not served and not converted:
        return section
    options = options or LoadOptions(flag_prefix="")
    loaded = load_any(drafter, target_dir=target, options=options)
    if loaded.spec is None:
        raise AuditError(f"{drafter}: the drafter's spec is incomplete; give the missing fields with --spec")
    facts = TargetFacts.read(target)
    trained = trained_of(loaded)
    for engine in served:
        section[engine] = engine_report(engine, str(drafter), loaded.spec, facts, trained,
                                        reference=fmt if fmt in ("zlab", "speculators") else None,
                                        **(engine_options if engine == "llamacpp" else {}))
    for engine in converted:
        section[engine] = converted_report(engine, drafter, fmt, loaded, facts, trained, target, options)
    return {engine: section[engine] for engine in engines}


def converted_report(engine: str, drafter: Path, fmt: str, loaded: LoadedCheckpoint, facts: TargetFacts,
                     trained: tuple[dict[str, Any], dict[str, str]], target: str | Path | None,
                     options: LoadOptions) -> EngineReport:
    """A checkpoint no engine reads (`ckpt.pt`, a foreign trainer's file): not a defect but a step. The verdict is
    that of its conversion, written to a temporary directory as the live check does and judged like any drafter;
    the step names the command. A drafter no format can carry is the conversion's refusal, a `loads` divergence."""
    import tempfile

    from dflash_audit.conversion import FAMILY_FORMATS, convert

    step = (f"not an engine format: {drafter} is a {fmt} checkpoint {engine} cannot read; convert with "
            f"`dflash-audit convert --from {drafter} --to DIR --for {engine}"
            f"{f' --target {target}' if target is not None else ''}`; judged here as converted")
    with tempfile.TemporaryDirectory(prefix="dflash-serve-") as scratch:
        written = Path(scratch) / f"for-{engine}"
        try:
            convert(drafter, written, FAMILY_FORMATS.get((loaded.spec.family, engine), "zlab"), target=target,
                    options=options)
        except AuditError as exc:
            report = not_a_directory(engine, drafter, fmt)
            report.findings[0].message += f" (and its conversion refuses: {exc})"
            return report
        report = engine_report(engine, str(written), loaded.spec, facts, trained)
    if report.command:
        report.command = report.command.replace(str(written), "DIR")
    report.step = step
    return report


def section_dict(section: dict[str, EngineReport]) -> dict[str, Any]:
    return {engine: report.to_dict() for engine, report in section.items()}


def write_text(path: Path, text: str) -> None:
    atomic_write_text(path, text)


def run_serve_check(flags: ServeCheckFlags) -> int:
    """`serve-check` as its validated flags ask (dflash_audit/commands/serve_check.py); its exit status."""
    drafter, engines, target, json_path, out = flags.drafter, flags.engine, flags.target, flags.json_path, flags.out
    check_outputs({"--json": json_path, "--out": out}, {"--drafter": drafter, "--target": target})
    if json_path is not None:
        check_writable("--json", json_path)
        check_not_foreign("--json", json_path, flags.force)
    if out is not None:
        check_writable("--out", out, "dir")
        check_not_foreign("--out", out, flags.force, ("serving.json", "index.html"))
    if target is not None and not (target / "config.json").is_file():
        raise AuditError(f"{target}: not a Hugging Face model directory (no config.json) to use as the target")
    engine_options = {k: v for k, v in (("n_max", flags.n_max), ("kv_type", flags.kv_type)) if v is not None}
    reports = serving_section(drafter, engines, target, LoadOptions(spec=list(flags.spec), flag_prefix=""),
                              **engine_options)
    if flags.live and "vllm" in engines:
        from dflash_audit.audit.live_check import attach_live, live_check

        attach_live(reports, live_check({"drafter": drafter}, target, flags.prompts, flags.max_new_tokens,
                                        flags.vllm_python, bin_tokens=flags.tau_bin_tokens,
                                        temperature=flags.temperature, samples=flags.sample_count())["drafter"])
    if flags.live and "llamacpp" in engines:
        from dflash_audit.audit.live_llamacpp import attach_llamacpp_live, live_llamacpp

        attach_llamacpp_live(reports, live_llamacpp(drafter, target, flags.prompts, flags.max_new_tokens, flags.quant,
                                                    flags.llamacpp_bin, **engine_options,
                                                    bin_tokens=flags.tau_bin_tokens))
    section = section_dict(reports)  # the records, live ones included, written once
    count = divergence_count(section)
    data = {"schema": SCHEMA, "drafter": str(drafter), "target": str(target) if target else None,
            "serving": section, "exit_status": 1 if count else 0}
    text = json.dumps(data, indent=2, default=str) + "\n"
    if json_path is not None:
        write_text(json_path, text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "serving.json", text)
        write_text(out / "index.html", serving_page_html(str(drafter), section))
    print(terminal_section(section))
    print(f"{count} serving divergence{'s' if count != 1 else ''}")
    return data["exit_status"]
