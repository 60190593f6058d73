"""The CLI's verbs: each is `dflash_audit/commands/<verb>.py` exposing `register(app)`, imported only when that verb
runs (`dflash_audit.cli`), so `dflash-audit --help` and `--version` import none of them.

`VERBS` is each verb's one-line help, in the order `--help` lists them: the listing reads it without importing the
verb, and the verb's own `--help` reads it too (`app.command(name, help=VERBS[name])`), so it is written once.
"""

VERBS = {
    "compare": "Audit --ours against --ref: findings, spec and tensor diff, per-prompt τ. Exit 1 on divergence.",
    "eval": "Per-prompt τ and per-round acceptance lengths of one drafter.",
    "train": "Train a DFlash drafter online against a Hugging Face target.",
    "convert": "Convert a drafter between ours, z-lab and speculators formats (layer ids translated).",
    "demo": "Build (once) the demo world and compare its buggy drafter with the reference; report in reports/demo/.",
    "serve-check": "Will it serve as trained? Hold the drafter against vLLM and SGLang through their own code.",
    "trace": "Run your own training script for a step (-- COMMAND) and audit what flowed through it, by value.",
    "doctor": "What this installation can run: packages, engines (llama.cpp, vLLM, SGLang), what each verb lacks.",
    "data-check": "Name every stored layer of an offline hidden-state dataset (vLLM, speculators, SpecForge) by value.",
}


def module_of(verb: str) -> str:
    return f"dflash_audit.commands.{verb.replace('-', '_')}"
