"""`dflash-audit eval` over benchmark prompt sets: τ per set × τ method × decoding × temperature × chat setting.

Used when eval is given `--table`, `--tau-method`, `--tau-by`, a `NAME:PATH` prompt set, `--max-samples`,
or more than one set, method, temperature or budget. Prints the table, writes `--json` and (with `--table`)
`--html`.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from dflash_audit.tau.prompt_sets import prompt_set_from_flag
from foundation.benchmarks.sets import PromptSet
from foundation.chat_template import ChatTemplate, thinking_settings
from dflash_audit.outputs import check_not_foreign, check_outputs, check_writable
from dflash_audit.tau.declared import declared_settings, template_findings
from dflash_audit.tau.grid import Decoding, run_grid
from dflash_audit.tau.methods import TAU_METHODS
from dflash_audit.tau.published import resolve_published
from dflash_audit.tau.table_out import payload, terminal_table, write_html, write_json
from foundation.errors import AuditError
from foundation.inputs import check_generation_flags
from foundation.placement import CPU_FLOAT32, Placement

TAU_BY = ("thinking",)


def decodings_of(methods: list[str], budgets: list[int]) -> list[Decoding]:
    out = []
    for method in dict.fromkeys(methods):
        if method not in ("dflash", "ddtree"):
            raise AuditError(f"--method must be one of ['dflash', 'ddtree'], got {method!r}")
        out += [Decoding("ddtree", b) for b in dict.fromkeys(budgets)] if method == "ddtree" else [Decoding("dflash")]
    return out


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise AuditError(f"--seeds: expected comma-separated integers, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds):
        raise AuditError(f"--seeds: expected one or more non-negative integers, got {text!r}")
    return list(dict.fromkeys(seeds))


def check_table_options(tau_methods, temperatures, budgets, max_new_tokens, tau_by, html_path, json_path, inputs,
                        force: bool = False):
    for method in tau_methods:
        if method not in TAU_METHODS:
            raise AuditError(f"--tau-method must be one of {list(TAU_METHODS)}, got {method!r}")
    for temperature in temperatures:
        check_generation_flags(max_new_tokens, None, temperature)
    for budget in budgets:
        check_generation_flags(None, budget)
    if tau_by is not None and tau_by not in TAU_BY:
        raise AuditError(f"--tau-by must be one of {list(TAU_BY)}, got {tau_by!r}")
    outputs = {"--json": json_path, "--html": html_path}
    check_outputs(outputs, inputs)
    for flag, path in outputs.items():
        if path is not None:
            check_writable(flag, path)
            check_not_foreign(flag, path, force)  # a user's file is never replaced silently


def run_table(drafter_path: Path, target_dir: Path, prompts: list, tau_methods: list[str] | None = None,
              methods: list[str] | None = None, budgets: list[int] | None = None,
              temperatures: list[float] | None = None, seeds: str = "0", max_new_tokens: int = 256,
              chat: ChatTemplate | None = None, tau_by: str | None = None, max_samples: int | None = None,
              json_path: Path | None = None, html_path: Path | None = None, published: str | None = None,
              trained_kwargs: str | None = None, load_options=None, placement: Placement = CPU_FLOAT32,
              console: Console | None = None, force: bool = False) -> dict:
    from dflash_audit.audit.drafter_fit import place_drafter, read_drafter
    from dflash_audit.formats import LoadOptions, load_any
    from foundation.target import load_target_model, load_tokenizer

    console = console or Console(stderr=True)
    tau_methods, methods = tau_methods or ["live"], methods or ["dflash"]
    budgets, temperatures = budgets or [32], temperatures or [0.0]
    chat = chat or ChatTemplate.parse("auto")
    inputs = {"--drafter": drafter_path, "--target": target_dir}
    check_table_options(tau_methods, temperatures, budgets, max_new_tokens, tau_by, html_path, json_path, inputs,
                        force)
    seed_list = parse_seeds(seeds)
    decodings = decodings_of(methods, budgets)
    # Bad input before any model; the command line hands them over already read.
    prompt_sets = [v if isinstance(v, PromptSet) else prompt_set_from_flag(v, max_samples) for v in prompts]
    published_target = resolve_published(published, target_dir)
    tokenizer, config = load_tokenizer(target_dir)
    chat.check_kwargs(tokenizer)
    if "zlab-benchmark" in tau_methods and chat.template(tokenizer) is None:  # said before any model loads
        raise AuditError("--tau-method zlab-benchmark renders every prompt through a chat template: the target "
                         "tokenizer has none (give one with --chat-template FILE)")
    chats = {"default": chat} if tau_by is None else {f"thinking {k}": v
                                                      for k, v in thinking_settings(chat, tokenizer).items()}
    options = load_options or LoadOptions(flag_prefix="")
    spec, state_dict = read_drafter(drafter_path, target_dir, config, options)
    declared, where = declared_settings(load_any(drafter_path, target_dir, options).raw.config, trained_kwargs)
    findings = template_findings(declared, where, {label: c.kwargs for label, c in chats.items()})
    target = load_target_model(target_dir, placement)
    drafter = place_drafter(spec, state_dict, drafter_path, target)
    cells, skipped = run_grid(drafter, target, tokenizer, prompt_sets, tau_methods, decodings, temperatures, chats,
                              max_new_tokens, seed_list, published_target,
                              advance=lambda: console.print(".", end=""))
    console.print()
    data = payload(cells, [s.describe() for s in prompt_sets],
                   {"drafter": str(drafter_path), "target": str(target_dir), "max_new_tokens": max_new_tokens,
                    "published_target": published_target, "placement": placement.describe(),
                    "trained_chat_template": {"kwargs": declared, "declared_in": where} if declared else None,
                    "findings": findings}, skipped)
    for s in data["sets"]:
        print(f"{s['name']}: {s['count']} of {s['rows']} rows ({s['selection']}); rendering: {s['rendering']}")
    print(terminal_table(cells))
    for finding in findings:
        print(f"divergence  chat_template  {finding['message']}")
    for note in skipped:
        print(f"not run: {note}")
    if json_path is not None:
        write_json(json_path, data)
    if html_path is not None:
        write_html(html_path, data)
    return data
