"""`dflash-audit compare`: audit a drafter against a reference; exit status like diff(1)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import typer
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
from dflash_audit.commands import VERBS
from dflash_audit.commands.serve_check import parse_engines
from dflash_audit.formats import LoadOptions
from dflash_audit.outputs import check_cache_dir, check_not_foreign, check_outputs, check_writable
from dflash_audit.ranks import Ranks
from foundation.cache_dir import cache_root
from foundation.chat_template import CHAT_TEMPLATE_HELP, ChatTemplate
from foundation.errors import AuditError
from foundation.inputs import TOKENIZER_FILES, check_generation_flags, check_target_dir
from foundation.placement import (
    CPU_FLOAT32,
    DEVICE_HELP,
    DEVICE_MAP_HELP,
    DTYPE_HELP,
    Placement,
    parse_dtype_list,
    resolve_placement,
)
from foundation.target import load_tokenizer
from foundation.target_vocab import TargetVocabulary


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


def run_compare(ours: Path, ref: Path, target: Path | None = None, prompts: Path | None = None,
                static_only: bool = False, out: Path | None = None, json_path: Path | None = None,
                expect_identical: bool = False, max_new_tokens: int = 64, budget: int = 32,
                cache_dir: Path | None = None, console: Console | None = None, truncate: bool = False,
                ours_options: LoadOptions | None = None, ref_options: LoadOptions | None = None,
                placement: Placement = CPU_FLOAT32, dtypes: list[str] | None = None,
                serve: list[str] | None = None, live: bool = False,
                vllm_python: Path | None = None, chat=None, force: bool = False) -> AuditReport:
    """Load, audit, write `out/index.html` + `out/report.json` (+ `json_path`), print the summary.

    `dtypes` (`--dtype a,b`): the τ audit once per dtype, the first one the report's main run."""
    console = console or Console(stderr=True)
    check_generation_flags(max_new_tokens, budget)
    out = out or default_out_dir(ours, ref)
    check_compare_outputs(out, json_path, {"--ours": ours, "--ref": ref, "--target": target, "--prompts": prompts},
                          force)
    ours_side = load_side(ours, target, ours_options or LoadOptions(flag_prefix="--ours"))
    ref_side = load_side(ref, target, ref_options or LoadOptions(flag_prefix="--ref"))
    if target is not None and not static_only:
        for side in (ours_side, ref_side):  # the τ audit runs both drafters: every field must be known
            side.require_spec("the τ audit (add --static-only for the static audit alone)")
    with progress_bar(console) as bar:
        total = len(set(ours_side.state_dict) | set(ref_side.state_dict))
        task = bar.add_task("static audit: tensors", total=total)
        static = static_audit(ours_side, ref_side, expect_identical, advance=lambda: bar.advance(task),
                              target=target_vocabulary(target) if target is not None else None)
    report = AuditReport(ours_side, ref_side, static)
    if live and (not serve or "vllm" not in serve or target is None):
        raise AuditError("--live runs both drafters in vLLM on the target: give --serve vllm and --target")
    if serve:
        report.serving = serving_sections(ours, ref, serve, target, ours_options, ref_options)
    if live:
        from dflash_audit.audit.live_check import live_check
        from dflash_audit.audit.serving_live import attach_live

        served = live_check({"ours": ours, "ref": ref}, target, prompts, max_new_tokens, vllm_python)
        for side in ("ours", "ref"):
            attach_live(report.serving[side], served[side])
    ranks = Ranks.single()
    if target is not None and not static_only:
        from dflash_audit.audit.dynamic import attach_proposable_share
        from dflash_audit.commands.compare_tau import dynamic_audits  # only here: it imports the decoding loops

        ranks = Ranks()  # under torchrun: prompts sharded, one cache, every rank on its own GPU
        report.dynamic = dynamic_audits(ours_side, ref_side, target, prompts, max_new_tokens, budget, cache_dir,
                                        console, truncate, placement, dtypes or [None], report.notes, ranks, chat)
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
    console.print(f"report: {out / 'index.html'}")
    return report


def serving_sections(ours: Path, ref: Path, engines: list[str], target: Path | None,
                     ours_options: LoadOptions | None, ref_options: LoadOptions | None) -> dict:
    """`--serve`: will each drafter serve as trained on each engine (the serve-check section, both sides)."""
    from dflash_audit.audit.serving import section_dict, serving_section

    return {side: section_dict(serving_section(path, engines, target, options))
            for side, path, options in (("ours", ours, ours_options or LoadOptions(flag_prefix="--ours")),
                                        ("ref", ref, ref_options or LoadOptions(flag_prefix="--ref")))}


def register(app: typer.Typer) -> None:
    @app.command("compare", help=VERBS["compare"])
    def compare(
        ours: Path = typer.Option(..., "--ours", help="our drafter: ckpt.pt, z-lab dir or speculators dir"),
        ref: Path = typer.Option(..., "--ref", help="the reference drafter, any format"),
        target: Path | None = typer.Option(None, "--target", help="target HF dir: enables the τ audit"),
        prompts: Path | None = typer.Option(None, "--prompts", help="prompts JSONL (default: built-in)"),
        static_only: bool = typer.Option(False, "--static-only", help="skip the τ audit"),
        out: Path | None = typer.Option(None, "--out", help="report dir (default reports/<ours>-vs-<ref>/)"),
        json_path: Path | None = typer.Option(None, "--json", help="also write report.json here"),
        expect_identical: bool = typer.Option(False, "--expect-identical",
                                              help="any weight difference is a divergence"),
        max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
        budget: int = typer.Option(32, "--budget", help="DDTree node budget"),
        ours_entry: str | None = typer.Option(None, "--ours-entry",
                                              help="entry of a training dict holding our state dict"),
        ref_entry: str | None = typer.Option(None, "--ref-entry", help="same, for --ref"),
        key_map: Path | None = typer.Option(None, "--key-map", "--ours-key-map",
                                            help="our parameter names: 'PATTERN => REPLACEMENT' per line"),
        ref_key_map: Path | None = typer.Option(None, "--ref-key-map", help="same, for --ref"),
        ours_spec: list[str] = typer.Option([], "--ours-spec", help="KEY=VALUE spec/recipe field (repeatable)"),
        ref_spec: list[str] = typer.Option([], "--ref-spec", help="same, for --ref"),
        truncate: bool = typer.Option(False, "--truncate",
                                      help="keep a too-long prompt's last tokens (default: refuse it)"),
        serve: str | None = typer.Option(None, "--serve", help="also check how vllm,sglang would serve each drafter"),
        live: bool = typer.Option(False, "--live", help="with --serve vllm: run both drafters in a real vLLM engine"),
        vllm_python: Path | None = typer.Option(None, "--vllm-python",
                                                help="--live: a Python with vLLM (default .venv-vllm/bin/python)"),
        cache_dir: Path | None = typer.Option(None, "--cache-dir",
                                              help="cache root; hidden states go to <root>/offline "
                                                   "(default $XDG_CACHE_HOME/dflash-audit)"),
        device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
        dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP + "; a comma list (bfloat16,float32) "
                                  "measures τ in each"),
        device_map: str | None = typer.Option(None, "--device-map", help=DEVICE_MAP_HELP),
        chat_template: str = typer.Option("auto", "--chat-template", help=CHAT_TEMPLATE_HELP),
        chat_template_kwargs: str | None = typer.Option(None, "--chat-template-kwargs",
                                                        help='JSON for apply_chat_template, e.g. {"enable_thinking": false}'),
        force: bool = typer.Option(False, "--force", help="replace report files at --out / --json that the tool "
                                                          "did not write"),
    ) -> int:
        check_cache_dir(cache_dir, {"--ours": ours, "--ref": ref, "--target": target, "--prompts": prompts})
        dtypes = parse_dtype_list(dtype)
        chat = ChatTemplate.parse(chat_template, chat_template_kwargs)
        placement = resolve_placement(device, dtypes[0], device_map, target) if target is not None else CPU_FLOAT32
        report = run_compare(ours, ref, target, prompts, static_only, out, json_path, expect_identical,
                             max_new_tokens, budget, truncate=truncate,
                             cache_dir=cache_root(cache_dir) / "offline" if cache_dir is not None else None,
                             ours_options=LoadOptions(ours_entry, key_map, list(ours_spec), "--ours"),
                             ref_options=LoadOptions(ref_entry, ref_key_map, list(ref_spec), "--ref"),
                             placement=placement, dtypes=[None, *dtypes[1:]],
                             serve=parse_engines(serve) if serve is not None else None, live=live,
                             vllm_python=vllm_python, chat=chat, force=force)
        return report.exit_status
