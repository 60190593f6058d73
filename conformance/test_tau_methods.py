"""#17 τ by each named method (`--tau-method`), held per prompt to that method's reference implementation on the
world's trained pair and the benchmark fixtures (tests/fixtures/benchmarks), rendered through the world's
thinking-aware chat template:

- `live` (our loop) against `zlab-loop` (z-lab's `dflash_generate` on a z-lab twin), greedy and sampled under
  the same seeds, every turn of MT-Bench included;
- `teacher-forced` (fixed ground truth) against a walk written here from z-lab's own pieces: its
  `DFlashDraftModel` over the whole ground-truth context each round (no cache), its `extract_context_feature`,
  `_raw_input_embeddings` and `compute_logits`;
- `zlab-benchmark` (its procedure run with our loop) against z-lab's own `dflash.benchmark._run_transformers`
  on the same local rows (reference_adapters/zlab_benchmark.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conformance.tolerances import EXACT

pytestmark = [pytest.mark.slow, pytest.mark.dynamic, pytest.mark.pitfall(17)]
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "benchmarks"
TEMPLATE = Path(__file__).resolve().parents[1] / "dflash_world" / "chat_template_thinking.jinja"
MAX_NEW_TOKENS = 24
SETS = {"humaneval": "humaneval.jsonl", "mt-bench": "mt_bench.jsonl"}


@pytest.fixture(scope="module")
def world_pair():
    """(drafter, target, tokenizer, stop ids) of the world, placed as the suite places it."""
    from transformers import AutoTokenizer

    from dflash_world import cached_test_world
    from dflash_world.drafter import cached_test_drafter
    from dflash_world.suite_placement import audit_placement, world_in_suite_dtype
    from impl.body_shapes import build_drafter
    from drafter_files.checkpoint import load_checkpoint
    from foundation.placement import built_in
    from foundation.target import load_target_model
    from foundation.target_vocab import stop_token_ids

    world = world_in_suite_dtype(cached_test_world())
    placement = audit_placement()
    target = load_target_model(world.target, placement)
    ckpt = load_checkpoint(cached_test_drafter(world))
    drafter = built_in(placement.device, placement.dtype, lambda: build_drafter(ckpt.spec, ckpt.state_dict)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(world.target))
    return drafter, target, tokenizer, tuple(stop_token_ids(world.target, tokenizer).ids)


def chat(kwargs: str | None = None):
    from foundation.chat_template import ChatTemplate

    return ChatTemplate.parse(str(TEMPLATE), kwargs)


def prompt_set(name: str, count: int | None = None):
    from foundation.benchmarks.sets import read_prompt_set

    return read_prompt_set(name, FIXTURES / SETS[name], count)


def run_method(method: str, drafter, target, tokenizer, prompt_set, template, setting) -> list[dict]:
    """One τ method's per-response results: ours (impl/tau_methods.py) or z-lab's (reference_adapters)."""
    from impl.tau_methods import RUNNERS
    from reference_adapters.zlab_benchmark import zlab_benchmark, zlab_loop

    runners = {**RUNNERS, "zlab-loop": zlab_loop, "zlab-benchmark": zlab_benchmark}
    with torch.inference_mode():
        return runners[method](drafter, target, tokenizer, prompt_set, template, setting)


def rounds_by_id(results: list[dict]) -> dict[str, list[int]]:
    return {r["id"]: r["rounds"] for r in results}


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 3)])
def test_live_equals_zlab_loop_per_prompt_p17(conform, world_pair, temperature, seed):
    from impl.tau_methods import Setting

    drafter, target, tokenizer, stops = world_pair
    setting = Setting("dflash", 32, MAX_NEW_TOKENS, temperature, seed, stops)
    for name in SETS:
        conform.describe({"set": name, "temperature": temperature, "seed": seed})
        ours = run_method("live", drafter, target, tokenizer, prompt_set(name), chat(), setting)
        ref = run_method("zlab-loop", drafter, target, tokenizer, prompt_set(name), chat(), setting)
        assert [r["id"] for r in ours] == [r["id"] for r in ref]
        for a, b in zip(ours, ref):
            conform.compare(("ours", "zlab"), a["rounds"], b["rounds"], EXACT,
                            what=f"{name} {a['id']} T={temperature}: per-round acceptance lengths (live vs zlab-loop)")
        assert len(ours) == (4 if name == "mt-bench" else 3)  # both MT-Bench turns measured


def zlab_teacher_forced(twin, target, prompt_ids: torch.Tensor, answer: list[int]) -> list[int]:
    """Fixed-ground-truth rounds from z-lab's own model pieces: each round, its drafter reads the target's
    features of the whole ground truth before the anchor (no cache) and drafts `[anchor, mask ...]`; the
    proposals are kept up to the first that differs from the ground truth, then one ground-truth token."""
    import dflash.model as zlab

    device = target.device
    tokens = torch.cat([prompt_ids[0].to(device), torch.tensor(answer, device=device)])
    features = zlab.extract_context_feature(target(tokens[None], output_hidden_states=True).hidden_states,
                                            twin.target_layer_ids)
    head, scale = zlab._output_head(target), float(zlab._draft_value(twin.config, "input_embedding_scale", 1.0))
    start, last, rounds = prompt_ids.shape[1], len(tokens) - 1, []
    while start < last:
        size = min(twin.block_size, len(tokens) - start)
        block = tokens[start:start + size].clone()
        block[1:] = twin.mask_token_id
        hidden = twin(target_hidden=features[:, :start], noise_embedding=zlab._raw_input_embeddings(target, block[None],
                                                                                                      scale),
                      position_ids=torch.arange(start + size, device=device)[None])[:, 1 - size:]
        proposals = twin.compute_logits(hidden, head).argmax(-1)[0].tolist()
        accepted = 0
        while accepted < size - 1 and proposals[accepted] == int(tokens[start + 1 + accepted]):
            accepted += 1
        rounds.append(min(accepted + 1, last - start))
        start += rounds[-1]
    return rounds


def test_teacher_forced_equals_zlab_models_fixed_ground_truth_walk_p17(conform, world_pair):
    from impl.tau_methods import Setting
    from reference_adapters.zlab_adapter import ZlabImplementation

    drafter, target, tokenizer, _ = world_pair
    twin = ZlabImplementation().build_drafter(drafter.spec, drafter.state_dict(), target)
    for name, file in (("humaneval", "humaneval.jsonl"), ("mbpp", "mbpp.jsonl")):
        from foundation.benchmarks.sets import read_prompt_set

        prompts = read_prompt_set(name, FIXTURES / file)
        ours = rounds_by_id(run_method("teacher-forced", drafter, target, tokenizer, prompts, chat(),
                                       Setting(max_new_tokens=MAX_NEW_TOKENS)))
        assert set(ours) == {p.id for p in prompts.prompts}
        for prompt in prompts.prompts:
            ids = chat().ids(tokenizer, [{"role": "user", "content": prompt.prompt}])
            answer = tokenizer(prompt.reference, add_special_tokens=False)["input_ids"][:MAX_NEW_TOKENS]
            with torch.inference_mode():
                ref = zlab_teacher_forced(twin, target, ids, answer)
            conform.compare(("ours", "zlab"), ours[prompt.id], ref, EXACT,
                            what=f"{name} {prompt.id}: teacher-forced rounds on the reference answer")
            assert sum(ref) == len(answer) - 1  # the walk covers the whole answer after its first token


@pytest.mark.parametrize("thinking", [None, "off"])
def test_zlab_benchmark_method_equals_zlabs_own_benchmark_run_p17(conform, world_pair, thinking):
    from impl.tau_methods import Setting
    from reference_adapters.zlab_adapter import ZlabImplementation
    from reference_adapters.zlab_benchmark import run_zlab_benchmark

    drafter, target, tokenizer, _ = world_pair
    template = chat(None if thinking is None else json.dumps({"enable_thinking": thinking == "on"}))
    twin = ZlabImplementation().build_drafter(drafter.spec, drafter.state_dict(), target)
    for name, dataset in (("humaneval", "humaneval"), ("mt-bench", "mt-bench")):
        rows = [json.loads(line) for line in (FIXTURES / SETS[name]).read_text().split("\n") if line.strip()]
        # z-lab's run orders the rows by its seeded selection (`_select_dataset`) even when it keeps all of them.
        ours = run_method("zlab-benchmark", drafter, target, tokenizer, prompt_set(name, len(rows)), template,
                          Setting(max_new_tokens=MAX_NEW_TOKENS))
        template.install(tokenizer)
        with torch.inference_mode():
            ref = run_zlab_benchmark(rows, dataset, target, twin, tokenizer, MAX_NEW_TOKENS, reasoning=thinking)
        conform.compare(("ours", "zlab"), [r["rounds"] for r in ours], ref, EXACT,
                        what=f"{name}, reasoning {thinking}: per-response rounds (zlab-benchmark vs z-lab's "
                             "_run_transformers)")
        assert len(ref) == (4 if name == "mt-bench" else 3)
