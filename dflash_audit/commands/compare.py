"""`dflash-audit compare`: audit a drafter against a reference; exit status like diff(1)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer

from dflash_audit.audit.compare import run_compare
from dflash_audit.commands import VERBS
from dflash_audit.commands.serve_check import parse_engines
from dflash_audit.formats import LoadOptions
from dflash_audit.outputs import check_cache_dir
from foundation.cache_dir import cache_root
from foundation.chat_template import CHAT_TEMPLATE_HELP, ChatTemplate
from foundation.placement import (
    CPU_FLOAT32,
    DEVICE_HELP,
    DEVICE_MAP_HELP,
    DTYPE_HELP,
    parse_dtype_list,
    resolve_placement,
)


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
        live: bool = typer.Option(False, "--live", help="with --serve vllm or llamacpp: run both drafters in a real engine"),
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
        hidden_states: str = typer.Option("transformers", "--hidden-states",
                                          help="what makes the offline cache of the target's states: transformers, "
                                               "or vllm (its extract_hidden_states; --vllm-python names the Python)"),
        tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", min=1,
                                                 help="--hidden-states vllm: vLLM's tensor parallelism (GPUs)"),
    ) -> int:
        check_cache_dir(cache_dir, {"--ours": ours, "--ref": ref, "--target": target, "--prompts": prompts})
        dtypes = parse_dtype_list(dtype)
        chat = ChatTemplate.parse(chat_template, chat_template_kwargs)
        placement = resolve_placement(device, dtypes[0], device_map, target) if target is not None else CPU_FLOAT32
        engine = contextlib.nullcontext()  # the transformers pass; a static compare imports no torch
        if (hidden_states, tensor_parallel_size) != ("transformers", 1):
            from dflash_audit.offline_tau import hidden_states_from
            from dflash_audit.vllm_states import cache_builder

            engine = hidden_states_from(cache_builder(hidden_states, target, vllm_python, tensor_parallel_size))
        with engine:
            report = run_compare(ours, ref, target, prompts, static_only, out, json_path, expect_identical,
                                 max_new_tokens, budget, truncate=truncate,
                                 cache_dir=cache_root(cache_dir) / "offline" if cache_dir is not None else None,
                                 ours_options=LoadOptions(ours_entry, key_map, list(ours_spec), "--ours"),
                                 ref_options=LoadOptions(ref_entry, ref_key_map, list(ref_spec), "--ref"),
                                 placement=placement, dtypes=[None, *dtypes[1:]],
                                 serve=parse_engines(serve) if serve is not None else None, live=live,
                                 vllm_python=vllm_python, chat=chat, force=force)
        return report.exit_status

