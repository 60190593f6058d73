"""`dflash-audit serve-check --drafter PATH [--engine vllm,sglang] [--target DIR] [--spec KEY=VALUE ...]
[--json FILE] [--out DIR] [--live [--prompts F] [--max-new-tokens N] [--vllm-python PATH]]`: will the drafter serve
as trained? `--live` also runs it in a real vLLM engine (serving_engines/live/, dflash_audit/audit/live_check.py).
Exit 0 none, 1 divergences, 2 trouble."""

from __future__ import annotations

from pathlib import Path

import typer

from dflash_audit.audit.serving import run_serve_check
from dflash_audit.commands import VERBS
from foundation.errors import AuditError


def parse_engines(text: str) -> list[str]:
    from serving_engines import ALL_ENGINES

    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ALL_ENGINES]
    if not engines or unknown:
        raise AuditError(f"--engine: expected a comma-separated list of {', '.join(ALL_ENGINES)}, got {text!r}")
    return list(dict.fromkeys(engines))


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
        n_max: int | None = typer.Option(None, "--spec-draft-n-max",
                                         help="llamacpp: the llama-server --spec-draft-n-max you run (default: "
                                              "block - 1, and its absence flagged)"),
        kv_type: str | None = typer.Option(None, "--draft-kv-type", help="llamacpp: the draft KV cache type you run"),
        quant: str | None = typer.Option(None, "--quant", help="llamacpp --live: serve the drafter quantized "
                                                               "(f32, f16, bf16, q8_0, q4_k_m)"),
        llamacpp_bin: Path | None = typer.Option(None, "--llamacpp-bin",
                                                 help="llamacpp --live: a folder with your own llama-server build"),
    ) -> int:
        if n_max is not None and n_max < 1:
            raise AuditError(f"--spec-draft-n-max must be at least 1, got {n_max}")
        if quant is not None and not live:
            raise AuditError("--quant applies to --live (the quantized drafter is served and held to its training)")
        options = {k: v for k, v in (("n_max", n_max), ("kv_type", kv_type), ("quant", quant),
                                     ("bin_dir", llamacpp_bin)) if v is not None}
        return run_serve_check(drafter, parse_engines(engine), target, spec, json_path, out, live, prompts,
                               max_new_tokens, vllm_python, force, **options)

