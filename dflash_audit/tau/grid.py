"""τ over prompt sets × τ methods × temperatures × decodings (DFlash, DDTree per node budget) × chat settings.

The four τ methods by name (`--tau-method`): ours (impl/tau_methods.py: `live`, `teacher-forced`) and z-lab's
(reference_adapters/zlab_benchmark.py: `zlab-loop`, `zlab-benchmark`); what each can run.

One cell = one (set, method, decoding, temperature, chat setting); at T > 0 it runs once per seed and
reports each seed's τ, their mean and the range across seeds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from dflash_audit.tau.published import figures_for
from foundation.benchmarks.sets import PromptSet
from foundation.chat_template import ChatTemplate
from impl.tau_methods import Setting, mean_tau




def unrunnable(method: str, setting: Setting) -> str | None:
    """Why `method` (one of `TAU_METHODS`, as `eval --tau-method` declares) cannot run at `setting` (a z-lab loop
    has no tree, teacher forcing never samples), or None. Not a check of a flag: the grid leaves such a cell out and
    says why (`cells_plan`)."""
    if setting.temperature > 0 and method == "teacher-forced":
        return (f"--tau-method {method} is greedy by definition (it never samples); use live or zlab-loop at "
                "--temperature > 0")
    if setting.decode == "ddtree" and method in ("zlab-loop", "zlab-benchmark"):
        return f"--tau-method {method} runs z-lab's dflash_generate, which has no tree (DDTree: live or teacher-forced)"
    if setting.decode == "ddtree" and setting.temperature > 0:
        return "--temperature > 0 needs --method dflash (DDTree is greedy)"
    return None


def run_method(method: str, drafter, target, tokenizer, prompt_set: PromptSet, template: ChatTemplate,
               setting: Setting) -> list[dict]:
    """Per-response results `{"id", "prompt", "turn", "prompt_tokens", "rounds", "tau"}` of `method`, at a setting it
    can run (`cells_plan` plans only those)."""
    # The runners (and z-lab's package) are imported when a method runs, not when eval checks its flags.
    from impl.tau_methods import RUNNERS
    from reference_adapters.zlab_benchmark import zlab_benchmark, zlab_loop

    runners = {**RUNNERS, "zlab-loop": zlab_loop, "zlab-benchmark": zlab_benchmark}
    with torch.inference_mode():
        return runners[method](drafter, target, tokenizer, prompt_set, template, setting)


@dataclass(frozen=True)
class Decoding:
    name: str  # "dflash" or "ddtree"
    budget: int | None = None

    @property
    def label(self) -> str:
        return self.name if self.budget is None else f"{self.name}@{self.budget}"


def cells_plan(prompt_sets, methods, decodings, temperatures, chats: dict[str, ChatTemplate]):
    """Every cell of the grid that can run; a combination no method can run (teacher-forced at T > 0, a z-lab
    loop with a tree) is left out, and said."""
    plan, skipped = [], []
    for prompt_set in prompt_sets:
        for method in methods:
            if method == "teacher-forced" and not any(p.reference is not None and len(p.turns) == 1
                                                      for p in prompt_set.prompts):
                skipped.append(f"{prompt_set.name} × teacher-forced: no single-turn prompt with a reference answer")
                continue
            for decoding in decodings:
                for temperature in temperatures:
                    for label, chat in chats.items():
                        setting = Setting(decoding.name, decoding.budget or 32, 0, temperature)
                        reason = unrunnable(method, setting)
                        if reason is not None:
                            skipped.append(f"{prompt_set.name} × {method} × {decoding.label} × T={temperature}: "
                                           f"{reason}")
                            continue
                        plan.append((prompt_set, method, decoding, temperature, label, chat))
    return plan, list(dict.fromkeys(skipped))


def run_cell(drafter, target, tokenizer, prompt_set: PromptSet, method: str, decoding: Decoding, temperature: float,
             chat_label: str, chat: ChatTemplate, max_new_tokens: int, seeds: list[int],
             published_target: str | None, stop_ids: list[int]) -> dict:
    runs = []
    for seed in (seeds if temperature > 0 else seeds[:1]):
        setting = Setting(decoding.name, decoding.budget or 32, max_new_tokens, temperature, seed, tuple(stop_ids))
        results = run_method(method, drafter, target, tokenizer, prompt_set, chat, setting)
        runs.append({"seed": seed if temperature > 0 else None, "tau": mean_tau(results), "prompts": results})
    taus = [r["tau"] for r in runs]
    return {"set": prompt_set.name, "method": method, "decoding": decoding.name, "budget": decoding.budget,
            "temperature": temperature, "chat": chat_label, "chat_template": chat.describe(tokenizer),
            "tau": statistics.mean(taus), "seeds": [r["seed"] for r in runs] if temperature > 0 else None,
            "per_seed": taus if temperature > 0 else None,
            "seed_range": [min(taus), max(taus)] if temperature > 0 else None,
            "count": len(runs[0]["prompts"]), "runs": runs,
            "published": figures_for(published_target, prompt_set.name, decoding.name, temperature, method)}


def run_grid(drafter, target, tokenizer, prompt_sets, methods, decodings, temperatures, chats, max_new_tokens: int,
             seeds: list[int], published_target: str | None, stop_ids: list[int],
             advance=lambda: None) -> tuple[list[dict], list[str]]:
    plan, skipped = cells_plan(prompt_sets, methods, decodings, temperatures, chats)
    cells = []
    for prompt_set, method, decoding, temperature, label, chat in plan:
        cells.append(run_cell(drafter, target, tokenizer, prompt_set, method, decoding, temperature, label, chat,
                              max_new_tokens, seeds, published_target, stop_ids))
        advance()
    return cells, skipped
