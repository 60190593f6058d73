"""The τ methods, each named (`--tau-method`) because each gives another figure for one checkpoint.

- `live`: our speculative decoding loop against the target (greedy, or rejection sampling at T > 0);
  multi-turn sets answer each turn after the model's own reply to the previous one.
- `zlab-loop`: the same walk through z-lab's own `dflash_generate` on a z-lab twin of the drafter.
- `teacher-forced`: fixed ground truth. The target reads prompt + the dataset's reference answer in
  one forward; each round the drafter proposes from the anchor and keeps the proposals that match
  the reference, then steps past the next reference token (Model-Optimizer's "fixed ground truth").
  It never decodes, so it needs no target agreement with the reference: it asks how well the drafter
  predicts the *dataset's* text, which the target itself may not write.
- `zlab-benchmark`: z-lab's `dflash.benchmark` procedure run with our loop: its chat rendering
  (`apply_chat_template` with its `--reasoning` switch), ids encoded without special tokens, its stop
  ids (`stop_token_ids`: the generation config's eos), every MT-Bench turn, τ the mean of the
  per-response means. Its reference is z-lab's own `_run_transformers` (reference_adapters/zlab_benchmark.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_audit.benchmarks.sets import PromptSet
from dflash_audit.chat_template import ChatTemplate
from impl.decoding import dflash_decode, mean_acceptance
from impl.errors import AuditError

TAU_METHODS = ("live", "zlab-loop", "teacher-forced", "zlab-benchmark")
GREEDY_ONLY = ("teacher-forced",)


@dataclass
class Setting:
    decode: str = "dflash"  # "dflash" or "ddtree"
    budget: int = 32
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0


def check_method(method: str, setting: Setting) -> None:
    if method not in TAU_METHODS:
        raise AuditError(f"--tau-method must be one of {list(TAU_METHODS)}, got {method!r}")
    if setting.temperature > 0 and method in GREEDY_ONLY:
        raise AuditError(f"--tau-method {method} is greedy by definition (it never samples); use live or zlab-loop "
                         "at --temperature > 0")
    if setting.decode == "ddtree" and method in ("zlab-loop", "zlab-benchmark"):
        raise AuditError(f"--tau-method {method} runs z-lab's dflash_generate, which has no tree (DDTree: live or "
                         "teacher-forced)")
    if setting.decode == "ddtree" and setting.temperature > 0:
        raise AuditError("--temperature > 0 needs --method dflash (DDTree is greedy)")


def unit(prompt_id: str, turn: int, rounds: list[int], prompt_tokens: int) -> dict:
    return {"id": prompt_id if turn == 0 else f"{prompt_id}/turn{turn + 1}", "prompt": prompt_id, "turn": turn,
            "prompt_tokens": prompt_tokens, "rounds": rounds, "tau": mean_acceptance(rounds)}


def reply_text(tokenizer, output_ids: torch.Tensor, prompt_len: int) -> str:
    """The assistant's reply as the next turn sees it (z-lab's benchmark decodes with skip_special_tokens)."""
    return tokenizer.decode(output_ids[0, prompt_len:].tolist(), skip_special_tokens=True)


def stop_ids_of(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _conversations(prompt_set: PromptSet, tokenizer, render, generate) -> list[dict]:
    """Each prompt's turns in order, each after the reply `generate(ids)` gave the previous one."""
    results = []
    for prompt in prompt_set.prompts:
        messages: list[dict] = []
        for turn, text in enumerate(prompt.turns):
            messages.append({"role": "user", "content": text})
            ids = render(messages)
            output_ids, rounds = generate(ids)
            results.append(unit(prompt.id, turn, rounds, ids.shape[1]))
            messages.append({"role": "assistant", "content": reply_text(tokenizer, output_ids, ids.shape[1])})
    return results


def live(drafter, target, tokenizer, prompt_set: PromptSet, template: ChatTemplate, setting: Setting) -> list[dict]:
    from impl.ddtree import ddtree_decode

    stops = stop_ids_of(tokenizer)

    def generate(ids):
        if setting.decode == "ddtree":
            run = ddtree_decode(drafter, target, ids, setting.max_new_tokens, stops, setting.budget)
        else:
            run = dflash_decode(drafter, target, ids, setting.max_new_tokens, stops, setting.temperature, setting.seed)
        return run.output_ids, run.acceptance_lengths

    return _conversations(prompt_set, tokenizer, lambda m: template.ids(tokenizer, m), generate)


def zlab_loop(drafter, target, tokenizer, prompt_set: PromptSet, template: ChatTemplate,
              setting: Setting) -> list[dict]:
    from reference_adapters.zlab_adapter import ZlabImplementation

    zlab = ZlabImplementation()
    twin = zlab.build_drafter(drafter.spec, drafter.state_dict(), target)
    stops = stop_ids_of(tokenizer)

    def generate(ids):
        run = zlab.generate(twin, target, ids.to(target.device), setting.max_new_tokens, stops, setting.temperature,
                            setting.seed)
        return run.output_ids, run.acceptance_lengths

    return _conversations(prompt_set, tokenizer, lambda m: template.ids(tokenizer, m), generate)


def reasoning_of(template: ChatTemplate) -> str | None:
    """The chat-template kwargs as z-lab's `--reasoning` value (it has no other way to take them)."""
    extra = {k: v for k, v in template.kwargs.items() if k != "enable_thinking"}
    if extra:
        raise AuditError(f"--tau-method zlab-benchmark: z-lab's benchmark passes only its --reasoning switch "
                         f"(enable_thinking) to the chat template, not {sorted(extra)}")
    if "enable_thinking" not in template.kwargs:
        return None
    return "on" if template.kwargs["enable_thinking"] else "off"


def zlab_benchmark(drafter, target, tokenizer, prompt_set: PromptSet, template: ChatTemplate,
                   setting: Setting) -> list[dict]:
    from dflash.benchmark import apply_chat_template, stop_token_ids

    if template.template(tokenizer) is None:
        raise AuditError("--tau-method zlab-benchmark renders every prompt through a chat template: the target "
                         "tokenizer has none (give one with --chat-template FILE)")
    reasoning = reasoning_of(template)
    template.install(tokenizer)
    stops = stop_token_ids(target, tokenizer)

    def render(messages):
        text = apply_chat_template(tokenizer, messages, reasoning)
        return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.long)

    def generate(ids):
        run = dflash_decode(drafter, target, ids, setting.max_new_tokens, stops, setting.temperature, setting.seed)
        return run.output_ids, run.acceptance_lengths

    return _conversations(prompt_set, tokenizer, render, generate)


def teacher_forced(drafter, target, tokenizer, prompt_set: PromptSet, template: ChatTemplate,
                   setting: Setting) -> list[dict]:
    """Fixed ground truth: prompts without a reference answer (or multi-turn ones) are left out, and said."""
    from dflash_audit.tau.teacher_forced import teacher_forced_rounds

    results = []
    for prompt in prompt_set.prompts:
        if prompt.reference is None or len(prompt.turns) != 1:
            continue
        ids = template.ids(tokenizer, [{"role": "user", "content": prompt.prompt}])
        answer = tokenizer(prompt.reference, add_special_tokens=False)["input_ids"][: setting.max_new_tokens]
        if not answer:
            continue
        rounds = teacher_forced_rounds(drafter, target, ids, answer, setting.decode, setting.budget)
        results.append(unit(prompt.id, 0, rounds, ids.shape[1]))
    if not results:
        raise AuditError(f"--tau-method teacher-forced: {prompt_set.name} ({prompt_set.path}) has no single-turn "
                         "prompt with a reference answer")
    return results


RUNNERS = {"live": live, "zlab-loop": zlab_loop, "teacher-forced": teacher_forced, "zlab-benchmark": zlab_benchmark}


def run_method(method: str, drafter, target, tokenizer, prompt_set: PromptSet, template: ChatTemplate,
               setting: Setting) -> list[dict]:
    """Per-response results `{"id", "prompt", "turn", "prompt_tokens", "rounds", "tau"}` of `method`."""
    check_method(method, setting)
    with torch.inference_mode():
        return RUNNERS[method](drafter, target, tokenizer, prompt_set, template, setting)


def mean_tau(results: list[dict]) -> float:
    """The mean of per-response τ over responses that ran a round (z-lab's 'Average Acceptance length')."""
    return mean_acceptance([r["tau"] for r in results if r["rounds"]])
