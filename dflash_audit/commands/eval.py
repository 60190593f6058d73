"""`dflash-audit eval`: per-prompt τ and per-round acceptance lengths of one drafter, or the τ table over benchmark
prompt sets (`--table`, ...); what it runs is `dflash_audit/audit/eval.py`."""

from __future__ import annotations

from pathlib import Path

import typer

from dflash_audit.commands import VERBS
from foundation.chat_template import CHAT_TEMPLATE_HELP, ChatTemplate
from foundation.placement import DEVICE_HELP, DEVICE_MAP_HELP, DTYPE_HELP


def register(app: typer.Typer) -> None:
    @app.command("eval", help=VERBS["eval"])
    def eval_command(
        drafter: Path = typer.Option(..., "--drafter", help="ours ckpt.pt, z-lab dir or speculators dir"),
        target: Path = typer.Option(..., "--target", help="Hugging Face target model directory"),
        prompts: list[str] = typer.Option(..., "--prompts",
                                          help='JSON lines {"id", "prompt"} or {"turns": [...]}, or NAME:PATH, a '
                                               "benchmark's own file (gsm8k, math500, aime, humaneval, mbpp, "
                                               "mt-bench, alpaca, livecodebench; JSON lines or parquet); repeatable"),
        method: list[str] = typer.Option(["dflash"], "--method", help="dflash | ddtree (repeatable with --table)"),
        budget: list[int] = typer.Option([32], "--budget", help="DDTree node budget (repeatable with --table)"),
        mode: str = typer.Option("live", "--mode", help="live | offline (replay from cached hidden states)"),
        max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
        temperature: list[float] = typer.Option([0.0], "--temperature",
                                                help="> 0: rejection sampling (dflash, live); repeatable with --table"),
        seed: int = typer.Option(0, "--seed", help="sampling seed when --temperature > 0"),
        seeds: str | None = typer.Option(None, "--seeds", help="comma-separated sampling seeds for the table at T > 0 "
                                                               "(τ per seed and the range across them)"),
        json_path: Path | None = typer.Option(None, "--json", help="write the results as JSON here"),
        cache: Path | None = typer.Option(None, "--cache-dir",
                                          help="cache root; offline hidden states go to <root>/offline "
                                               "(default $XDG_CACHE_HOME/dflash-audit)"),
        chat_template: str = typer.Option("auto", "--chat-template", help=CHAT_TEMPLATE_HELP),
        chat_template_kwargs: str | None = typer.Option(None, "--chat-template-kwargs",
                                                        help='JSON for apply_chat_template, e.g. {"enable_thinking": false}'),
        tau_method: list[str] = typer.Option([], "--tau-method",
                                             help="live | zlab-loop | teacher-forced | zlab-benchmark (repeatable)"),
        tau_by: str | None = typer.Option(None, "--tau-by", help="thinking: τ with thinking on and off"),
        table: bool = typer.Option(False, "--table", help="τ per set x method x temperature (terminal, --json, --html)"),
        html_path: Path | None = typer.Option(None, "--html", help="write the τ table as HTML here"),
        max_samples: int | None = typer.Option(None, "--max-samples",
                                               help="prompts per set, chosen by z-lab's seeded selection"),
        published: str | None = typer.Option(None, "--published",
                                             help="set the published figures of this target beside the cells "
                                                  "(default: when the target directory is named like one)"),
        trained_kwargs: str | None = typer.Option(None, "--trained-chat-template-kwargs",
                                                  help="the chat-template kwargs the drafter was trained with (JSON), "
                                                       "when its config does not declare them"),
        entry: str | None = typer.Option(None, "--entry", help="entry of a training dict holding the state dict"),
        key_map: Path | None = typer.Option(None, "--key-map", help="parameter names: 'PATTERN => REPLACEMENT'"),
        spec: list[str] = typer.Option([], "--spec", help="KEY=VALUE spec/recipe field (repeatable)"),
        truncate: bool = typer.Option(False, "--truncate",
                                      help="keep a too-long prompt's last tokens (default: refuse it)"),
        device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
        dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
        device_map: str | None = typer.Option(None, "--device-map", help=DEVICE_MAP_HELP),
        force: bool = typer.Option(False, "--force", help="replace a --json file the tool did not write"),
    ) -> None:
        from dflash_audit.audit.eval import evaluate
        from dflash_audit.formats import LoadOptions

        evaluate(drafter, target, prompts, method, budget, mode, max_new_tokens, temperature, seed, seeds, json_path,
                 cache, ChatTemplate.parse(chat_template, chat_template_kwargs), tau_method, tau_by, table, html_path,
                 max_samples, published, trained_kwargs, LoadOptions(entry, key_map, list(spec), flag_prefix=""),
                 device, dtype, device_map, truncate, force)
