"""`compare`'s audit: both drafters loaded, the static audit, `--serve`'s and `--live`'s sections, the τ audit with
a target; the report written (`index.html`, `report.json`) and its summary printed."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from dflash_audit.audit.report import AuditReport
from dflash_audit.audit.report_html import write_report_html
from dflash_audit.audit.report_json import write_report_json
from dflash_audit.audit.report_terminal import terminal_summary
from dflash_audit.audit.sides import load_side
from dflash_audit.audit.static import static_audit
from dflash_audit.formats import LoadOptions
from dflash_audit.outputs import check_not_foreign, check_outputs, check_writable
from dflash_audit.ranks import Ranks
from foundation.inputs import TOKENIZER_FILES, check_target_dir
from foundation.target import load_tokenizer
from foundation.target_vocab import TargetVocabulary
from dflash_audit.outputs import check_cache_dir
from foundation.cache_dir import cache_root
from foundation.chat_template import ChatTemplate
from foundation.placement import CPU_FLOAT32, resolve_placement

if TYPE_CHECKING:
    from dflash_audit.flags.compare import CompareFlags


def target_vocabulary(target: Path) -> TargetVocabulary:
    """The target's sizes and special ids for the static audit (its tokenizer, config and headers; no weights).
    The static audit needs no tokenizer: without one, its length and ids stay unknown."""
    check_target_dir(target, tokenizer=False)
    has_tokenizer = any((target / name).is_file() for name in TOKENIZER_FILES)
    return TargetVocabulary.read(target, load_tokenizer(target)[0] if has_tokenizer else None)


def progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def default_out_dir(ours: Path, ref: Path) -> Path:
    def name(path: Path) -> str:
        real = Path(os.path.realpath(path))  # realpath: a symbolic link loop is refused where it is read
        # At most 100 characters a side: the folder name stays within the file system's 255.
        return (re.sub(r"[^A-Za-z0-9_.-]+", "_", real.stem or real.name) or "drafter")[:100]

    return Path("reports") / f"{name(ours)}-vs-{name(ref)}"


REPORT_FILES = ("index.html", "report.json")


def check_compare_outputs(out: Path, json_path: Path | None, inputs: dict[str, Path | None],
                          force: bool = False) -> None:
    """The report directory and --json are no input (nor contain one), replace nothing the tool did not
    write (unless --force) and are writable; all before any work."""
    check_outputs({"--out": out, "--json": json_path}, inputs)
    check_writable("--out", out, "dir")
    check_not_foreign("--out", out, force, REPORT_FILES)
    if json_path is not None:
        check_writable("--json", json_path)
        check_not_foreign("--json", json_path, force)


def run_compare(flags: CompareFlags, console: Console | None = None) -> AuditReport:
    """Load, audit, write `out/index.html` + `out/report.json` (+ `--json`), print the summary; `flags` are
    `compare`'s, validated (dflash_audit/flags/compare.py). `--dtype a,b`: the τ audit once per dtype, the first
    one the report's main run; `--hidden-states vllm`: the offline cache made by vLLM."""
    engine = contextlib.nullcontext()  # the transformers pass; a static compare imports no torch
    if flags.hidden_states == "vllm":
        from dflash_audit.offline_tau import hidden_states_from
        from dflash_audit.vllm_states import cache_builder

        engine = hidden_states_from(cache_builder(flags.target, flags.vllm_python, flags.tensor_parallel_size))
    with engine:
        return audit_and_report(flags, console)


def audit_and_report(flags: CompareFlags, console: Console | None = None) -> AuditReport:
    console = console or Console(stderr=True)
    ours, ref, target, prompts, serve = flags.ours, flags.ref, flags.target, flags.prompts, flags.serve
    inputs = {"--ours": ours, "--ref": ref, "--target": target, "--prompts": prompts}
    check_cache_dir(flags.cache_dir, inputs)
    out = flags.out or default_out_dir(ours, ref)
    json_path = flags.json_path
    check_compare_outputs(out, json_path, inputs, flags.force)
    chat = ChatTemplate.parse(flags.chat_template, flags.chat_template_kwargs)
    dtypes = flags.dtype  # the first one the placement's
    placement = resolve_placement(flags.device, dtypes[0], flags.device_map, target) if target is not None \
        else CPU_FLOAT32
    ours_options, ref_options = flags.load_options("ours"), flags.load_options("ref")
    ours_side = load_side(ours, target, ours_options)
    ref_side = load_side(ref, target, ref_options)
    if target is not None and not flags.static_only:
        for side in (ours_side, ref_side):  # the τ audit runs both drafters: every field must be known
            side.require_spec("the τ audit (add --static-only for the static audit alone)")
    with progress_bar(console) as bar:
        total = len(set(ours_side.state_dict) | set(ref_side.state_dict))
        task = bar.add_task("static audit: tensors", total=total)
        static = static_audit(ours_side, ref_side, flags.expect_identical, advance=lambda: bar.advance(task),
                              target=target_vocabulary(target) if target is not None else None)
    report = AuditReport(ours_side, ref_side, static)
    live, max_new_tokens = flags.live, flags.max_new_tokens
    if serve:
        reports = serving_sections(ours, ref, serve, target, ours_options, ref_options)
        if live and "llamacpp" in serve:
            from dflash_audit.audit.live_llamacpp import attach_llamacpp_live, live_llamacpp

            for side, path in (("ours", ours), ("ref", ref)):
                attach_llamacpp_live(reports[side], live_llamacpp(Path(path), target, prompts, max_new_tokens,
                                                                  bin_tokens=flags.tau_bin_tokens))
        if live and "vllm" in serve:
            from dflash_audit.audit.live_check import attach_live, live_check

            served = live_check({"ours": ours, "ref": ref}, target, prompts, max_new_tokens, flags.vllm_python,
                                bin_tokens=flags.tau_bin_tokens)
            for side in ("ours", "ref"):
                attach_live(reports[side], served[side])
        from dflash_audit.audit.serving import section_dict

        report.serving = {side: section_dict(section) for side, section in reports.items()}  # written once
    ranks = Ranks.single()
    if target is not None and not flags.static_only:
        # only here: it imports the decoding loops
        from dflash_audit.audit.dynamic import attach_proposable_share, dynamic_audits

        ranks = Ranks()  # under torchrun: prompts sharded, one cache, every rank on its own GPU
        cache_dir = cache_root(flags.cache_dir) / "offline" if flags.cache_dir is not None else None
        report.dynamic = dynamic_audits(ours_side, ref_side, target, prompts, max_new_tokens, flags.budget, cache_dir,
                                        console, flags.truncate, placement, [None, *dtypes[1:]], report.notes, ranks,
                                        chat, flags.tau_bin_tokens)
        ranks.close()
        attach_proposable_share(static.findings, report.dynamic.proposable_share)
    elif target is None:
        report.notes.append("No --target given: static audit only (τ not measured; the mask token and vocabulary sizes "
                            "not held to a target).")
    else:
        report.notes.append("--static-only: τ not measured.")
    if ranks.rank != 0:  # every rank has the whole report; rank 0 writes and prints it
        return report
    write_report_json(report, out / "report.json")
    write_report_html(report, out / "index.html")
    if json_path is not None:
        write_report_json(report, json_path)
    print(terminal_summary(report))
    # A path is printed whole (never wrapped at the terminal's width) and as written (no rich markup read in it).
    console.print(f"report: {out / 'index.html'}", soft_wrap=True, markup=False, highlight=False)
    return report


def serving_sections(ours: Path, ref: Path, engines: list[str], target: Path | None,
                     ours_options: LoadOptions | None, ref_options: LoadOptions | None) -> dict:
    """`--serve`: will each drafter serve as trained on each engine (the serve-check section, both sides, as records)."""
    from dflash_audit.audit.serving import serving_section

    return {side: serving_section(path, engines, target, options)
            for side, path, options in (("ours", ours, ours_options or LoadOptions(flag_prefix="--ours")),
                                        ("ref", ref, ref_options or LoadOptions(flag_prefix="--ref")))}
