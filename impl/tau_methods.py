"""Our τ methods (`--tau-method`; dflash_audit/tau/grid.py names all four), each another figure for one checkpoint.

- `live`: our speculative decoding loop against the target (greedy, or rejection sampling at T > 0);
  multi-turn sets answer each turn after the model's own reply to the previous one.
- `zlab-loop` (reference_adapters/zlab_benchmark.py): the same walk through z-lab's own `dflash_generate`.
- `teacher-forced`: fixed ground truth. The target reads prompt + the dataset's reference answer in
  one forward; each round the drafter proposes from the anchor and keeps the proposals that match
  the reference, then steps past the next reference token (Model-Optimizer's "fixed ground truth").
  It never decodes, so it needs no target agreement with the reference: it asks how well the drafter
  predicts the *dataset's* text, which the target itself may not write.
- `zlab-benchmark` (reference_adapters/zlab_benchmark.py): z-lab's `dflash.benchmark` procedure run with our loop: its chat rendering
  (`apply_chat_template` with its `--reasoning` switch), ids encoded without special tokens, its stop
  ids (z-lab's `stop_token_ids` on the loaded model), every MT-Bench turn, τ the mean of the
  per-response means. Its reference is z-lab's own `_run_transformers` (reference_adapters/zlab_benchmark.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foundation.benchmarks.sets import PromptSet
from foundation.chat_template import ChatTemplate
from foundation.errors import AuditError
from impl.acceptance import mean_acceptance



@dataclass
class Setting:
    decode: str = "dflash"  # "dflash" or "ddtree"
    budget: int = 32
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    # The target's stop ids (foundation.target_vocab.stop_token_ids, z-lab's rule); empty: every turn runs to
    # max_new_tokens. `live` and `zlab-loop` stop at these; `zlab-benchmark` at z-lab's own reading of the model.
    stop_ids: tuple[int, ...] = ()


def unit(prompt_id: str, turn: int, rounds: list[int], prompt_tokens: int) -> dict:
    return {"id": prompt_id if turn == 0 else f"{prompt_id}/turn{turn + 1}", "prompt": prompt_id, "turn": turn,
            "prompt_tokens": prompt_tokens, "rounds": rounds, "tau": mean_acceptance(rounds)}


def reply_text(tokenizer, output_ids: torch.Tensor, prompt_len: int) -> str:
    """The assistant's reply as the next turn sees it (z-lab's benchmark decodes with skip_special_tokens)."""
    return tokenizer.decode(output_ids[0, prompt_len:].tolist(), skip_special_tokens=True)


def conversations(prompt_set: PromptSet, tokenizer, render, generate) -> list[dict]:
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
    from impl.ddtree import ddtree_decode  # the decoding loops: imported by the run, not by the verb's checks
    from impl.decoding import dflash_decode

    stops = list(setting.stop_ids)

    def generate(ids):
        if setting.decode == "ddtree":
            run = ddtree_decode(drafter, target, ids, setting.max_new_tokens, stops, setting.budget)
        else:
            run = dflash_decode(drafter, target, ids, setting.max_new_tokens, stops, setting.temperature, setting.seed)
        return run.output_ids, run.acceptance_lengths

    return conversations(prompt_set, tokenizer, lambda m: template.ids(tokenizer, m), generate)


def teacher_forced(drafter, target, tokenizer, prompt_set: PromptSet, template: ChatTemplate,
                   setting: Setting) -> list[dict]:
    """Fixed ground truth: prompts without a reference answer (or multi-turn ones) are left out, and said."""
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


@torch.inference_mode()
def ground_truth_entry(target, prompt_ids: torch.Tensor, answer_ids: list[int], layer_ids: list[int],
                       prompt_id: str = "0"):
    """prompt + answer as an offline cache entry (impl/offline: the replay walks a cached greedy continuation; here
    the cached sequence is the dataset's reference answer instead): the target's states of every position, from one
    forward."""
    from foundation.placement import target_device
    from impl.layers import hidden_state_index
    from impl.offline.cache import CachedPrompt

    device = target_device(target)
    tokens = torch.cat([prompt_ids[0].to(device), torch.tensor(answer_ids, dtype=torch.long, device=device)])
    out = target(tokens[None], output_hidden_states=True, logits_to_keep=1)
    layers = {i: out.hidden_states[hidden_state_index(i)][0] for i in layer_ids}
    return CachedPrompt(prompt_id, tokens, prompt_ids.shape[1], layers, torch.zeros(len(tokens)))


def teacher_forced_rounds(drafter, target, prompt_ids: torch.Tensor, answer_ids: list[int], decode: str = "dflash",
                          budget: int = 32) -> list[int]:
    """Per-round accepted lengths (bonus included) walking the reference answer `answer_ids`: the offline replay's
    walk (the drafter's blocks at each anchor, the prefix match, the bonus step, the block shrinking near the end)
    over prompt + answer."""
    import functools

    from impl.extract import output_head
    from impl.offline.walks import play_ddtree, play_dflash, replay_walks

    entry = ground_truth_entry(target, prompt_ids, answer_ids, drafter.target_layer_ids)
    head = output_head(target)
    play = (functools.partial(play_ddtree, drafter, head, budget=budget) if decode == "ddtree"
            else functools.partial(play_dflash, drafter, head))
    return replay_walks(drafter, target, [entry], len(answer_ids), play)[0]


RUNNERS = {"live": live, "teacher-forced": teacher_forced}  # ours; z-lab's two: reference_adapters/zlab_benchmark.py


def mean_tau(results: list[dict]) -> float:
    """The mean of per-response τ over responses that ran a round (z-lab's 'Average Acceptance length')."""
    return mean_acceptance([r["tau"] for r in results if r["rounds"]])
