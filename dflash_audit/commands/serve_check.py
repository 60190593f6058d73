"""`dflash-audit serve-check --drafter PATH [--engine vllm,sglang] [--target DIR] [--spec KEY=VALUE ...]
[--json FILE] [--out DIR] [--live [--prompts F] [--max-new-tokens N] [--vllm-python PATH]]`: will the drafter serve
as trained? `--live` also runs it in a real vLLM engine (serving_engines/live/, dflash_audit/audit/live_check.py).
Exit 0 none, 1 divergences, 2 trouble."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import typer
from tabulate import tabulate

from dflash_audit.audit.serving import divergence_count, section_dict, serving_section
from dflash_audit.commands import VERBS
from dflash_audit.formats import LoadOptions
from dflash_audit.outputs import check_not_foreign, check_outputs, check_writable
from foundation.atomic import atomic_write_bytes
from foundation.errors import AuditError

SCHEMA = "dflash-audit-serving/1"


def parse_engines(text: str) -> list[str]:
    from serving_engines import ENGINES

    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if not engines or unknown:
        raise AuditError(f"--engine: expected a comma-separated list of {', '.join(ENGINES)}, got {text!r}")
    return list(dict.fromkeys(engines))


def terminal_section(section: dict[str, Any], width: int = 70) -> str:
    lines = []
    for engine, report in section.items():
        state = "loads" if report["loads"] else "REFUSES"
        lines.append(f"{engine} {report['version']}: {state}")
        rows = [[f["severity"], f["field"], textwrap.fill(f["message"], width), f["source"]]
                for f in report["findings"]]
        lines.append(tabulate(rows, headers=["severity", "field", "message", "engine source"],
                              tablefmt="simple_grid") if rows else "  serves as trained")
        if report["command"]:
            lines.append(f"  serve with: {report['command']}")
        lines += [f"  note: {note}" for note in report["notes"]]
        if report.get("live"):
            lines.append(live_table(report["live"]))
    return "\n".join(lines)


def live_table(live: dict[str, Any]) -> str:
    """The served rounds per prompt, as `serve-check --live` prints them (and the README shows them)."""
    if not live.get("ran"):
        return f"  live: not run: {live.get('refused')}"
    rows = [[p["id"], f"{p['served_tau']:.3f}", f"{p['audited_tau']:.3f}",
             f"{p['rounds_equal']}/{p['rounds']}" + (f" ({p['rounds_apart']} apart)" if p.get("rounds_apart") else ""),
             p["first_diff_round"] or "-", ", ".join(p.get("explained_by", [])) or "-",
             "yes" if p["greedy_identical"] else "NO"] for p in live["prompts"]]
    head = f"  live: vLLM {live['version']} ({live['python']}), greedy output identical: " \
           f"{'yes' if live['greedy_identical'] else 'NO'}"
    return head + "\n" + tabulate(rows, headers=["prompt", "served τ", "audited τ", "rounds equal", "first diff",
                                                 "explained by", "greedy same"], tablefmt="simple")


def render_html(drafter: str, data: dict[str, Any]) -> str:
    from dflash_audit.audit.report_html import environment

    body = environment().get_template("serving.html.j2").render(serving={drafter: data})
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta http-equiv=\"Content-Security-"
            "Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\"><title>dflash-audit serve-check"
            "</title></head><body><main>" + body + "</main></body></html>\n")


def write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def run_serve_check(drafter: Path, engines: list[str], target: Path | None = None, spec: list[str] | None = None,
                    json_path: Path | None = None, out: Path | None = None, live: bool = False,
                    prompts: Path | None = None, max_new_tokens: int = 64, vllm_python: Path | None = None,
                    force: bool = False) -> int:
    check_outputs({"--json": json_path, "--out": out}, {"--drafter": drafter, "--target": target})
    if json_path is not None:
        check_writable("--json", json_path)
        check_not_foreign("--json", json_path, force)
    if out is not None:
        check_writable("--out", out, "dir")
        check_not_foreign("--out", out, force, ("serving.json", "index.html"))
    if target is not None and not (target / "config.json").is_file():
        raise AuditError(f"{target}: not a Hugging Face model directory (no config.json) to use as the target")
    if live and (target is None or "vllm" not in engines):
        raise AuditError("--live runs the drafter in vLLM on the target: give --target and keep vllm in --engine")
    if live and max_new_tokens < 1:
        raise AuditError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    section = section_dict(serving_section(drafter, engines, target, LoadOptions(spec=list(spec or []),
                                                                                 flag_prefix="")))
    if live:
        from dflash_audit.audit.serving_live import attach_live
        from dflash_audit.audit.live_check import live_check

        attach_live(section, live_check({"drafter": drafter}, target, prompts, max_new_tokens, vllm_python)["drafter"])
    count = divergence_count(section)
    data = {"schema": SCHEMA, "drafter": str(drafter), "target": str(target) if target else None,
            "serving": section, "exit_status": 1 if count else 0}
    text = json.dumps(data, indent=2, default=str) + "\n"
    if json_path is not None:
        write_text(json_path, text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "serving.json", text)
        write_text(out / "index.html", render_html(str(drafter), section))
    typer.echo(terminal_section(section))
    typer.echo(f"{count} serving divergence{'s' if count != 1 else ''}")
    return data["exit_status"]


def register(app: typer.Typer) -> None:
    @app.command("serve-check", help=VERBS["serve-check"])
    def serve_check(
        drafter: Path = typer.Option(..., "--drafter", help="drafter directory (z-lab or speculators format)"),
        engine: str = typer.Option("vllm,sglang", "--engine", help="engines to hold it against: vllm,sglang"),
        target: Path | None = typer.Option(None, "--target", help="target HF dir: its layers, vocabulary, eos/pad"),
        spec: list[str] = typer.Option([], "--spec", help="KEY=VALUE trained spec field (repeatable)"),
        json_path: Path | None = typer.Option(None, "--json", help="write the JSON here"),
        out: Path | None = typer.Option(None, "--out", help="report dir: serving.json + index.html"),
        live: bool = typer.Option(False, "--live", help="also run it in a real vLLM engine, round by round"),
        prompts: Path | None = typer.Option(None, "--prompts", help="--live: prompts JSONL (default: built-in)"),
        max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="--live: tokens per prompt"),
        vllm_python: Path | None = typer.Option(None, "--vllm-python",
                                                help="--live: a Python with vLLM (default .venv-vllm/bin/python)"),
        force: bool = typer.Option(False, "--force", help="replace report files the tool did not write"),
    ) -> int:
        return run_serve_check(drafter, parse_engines(engine), target, spec, json_path, out, live, prompts,
                               max_new_tokens, vllm_python, force)


__all__ = ["divergence_count", "register", "run_serve_check"]
