"""z-lab's two τ methods: its loop (`zlab-loop`) and its benchmark procedure (`zlab-benchmark`), and the reference
of the latter, z-lab's own benchmark, `dflash.benchmark._run_transformers`, run on local rows and given models.

`zlab_loop`: our walk over a prompt set (impl/tau_methods.py) with each turn decoded by z-lab's `dflash_generate`
on a z-lab twin of the drafter. `zlab_benchmark`: z-lab's benchmark procedure (its chat rendering with its
`--reasoning` switch, ids encoded without special tokens, its stop ids) with *our* loop decoding; held per
response to `run_zlab_benchmark` below.

`run_zlab_benchmark`:
The reference of the `zlab-benchmark` τ method. Everything in its run is z-lab's: the formatter of the
set (through its `load_and_process_dataset`), its seeded selection, its chat rendering and `--reasoning`
switch, its stop ids, its warm-up calls and its per-turn `dflash_generate` (block 1 and the drafter's
block). Only what a CPU machine and a local file need is supplied:
- `datasets.load_dataset` answers with the local rows instead of the Hub's;
- `load_transformers_models` hands over the already loaded target, z-lab drafter and tokenizer;
- the tokenizer's encoded ids stay on the target's device (z-lab moves warm-up ids to `cuda:0`);
- `_print_decode_summary` is recorded (its per-response acceptance lengths), then still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from unittest import mock

import torch

from foundation.benchmarks.sets import PromptSet
from foundation.chat_template import ChatTemplate
from foundation.errors import AuditError
from impl.decoding import dflash_decode
from impl.tau_methods import Setting, conversations
from reference_adapters.version_guard import check_reference
from reference_adapters.zlab_adapter import ZlabImplementation, cpu_timer

check_reference("dflash")

import dflash.benchmark as zlab_bench  # noqa: E402  (after the version guard on purpose)


class _IdsOnTargetDevice:
    """Ids that stay where the target is whatever device z-lab names (`cuda:0` in its warm-up)."""

    def __init__(self, ids, device):
        self.ids, self.device = ids, device

    def to(self, _device):
        return self.ids.to(self.device)


class _TokenizerOnTargetDevice:
    def __init__(self, tokenizer, device):
        self._tokenizer, self._device = tokenizer, device

    def encode(self, *args, **kwargs):
        ids = self._tokenizer.encode(*args, **kwargs)
        return _IdsOnTargetDevice(ids, self._device) if kwargs.get("return_tensors") == "pt" else ids

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def run_zlab_benchmark(rows: list[dict], dataset: str, target, zlab_drafter, tokenizer, max_new_tokens: int,
                       temperature: float = 0.0, reasoning: str | None = None,
                       max_samples: int | None = None) -> list[list[int]]:
    """Per-response acceptance lengths (the drafter's block) in z-lab's own order: every turn of every
    selected row. `rows` are the set's raw rows (as the Hub would give them)."""
    recorded: list = []
    summary = zlab_bench._print_decode_summary

    def record(responses, block_size):
        recorded.extend(r[block_size].acceptance_lengths for r in responses)
        with contextlib.redirect_stdout(io.StringIO()):
            summary(responses, block_size)

    args = argparse.Namespace(model="target", draft="draft", block_size=None, dataset=dataset,
                              max_samples=max_samples, reasoning=reasoning, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=1.0, top_k=0)
    device = target.device
    wrapped = _TokenizerOnTargetDevice(tokenizer, device)
    with (cpu_timer(),
          mock.patch("datasets.load_dataset", lambda *a, **k: rows),
          mock.patch.object(zlab_bench, "load_transformers_models", lambda *a: (target, zlab_drafter, wrapped)),
          mock.patch.object(zlab_bench, "_print_decode_summary", record),
          mock.patch.object(zlab_bench, "tqdm", lambda it, **k: it)):
        zlab_bench._run_transformers(args)
    return [[int(n) for n in lengths] for lengths in recorded]


def zlab_loop(drafter, target, tokenizer, prompt_set: PromptSet, template: ChatTemplate,
              setting: Setting) -> list[dict]:
    zlab = ZlabImplementation()
    twin = zlab.build_drafter(drafter.spec, drafter.state_dict(), target)
    stops = list(setting.stop_ids)

    def generate(ids):
        run = zlab.generate(twin, target, ids.to(target.device), setting.max_new_tokens, stops, setting.temperature,
                            setting.seed)
        return run.output_ids, run.acceptance_lengths

    return conversations(prompt_set, tokenizer, lambda m: template.ids(tokenizer, m), generate)


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
    if template.template(tokenizer) is None:
        raise AuditError("--tau-method zlab-benchmark renders every prompt through a chat template: the target "
                         "tokenizer has none (give one with --chat-template FILE)")
    reasoning = reasoning_of(template)
    template.install(tokenizer)
    stops = zlab_bench.stop_token_ids(target, tokenizer)

    def render(messages):
        with template.rendering():  # z-lab's code runs the template installed above
            text = zlab_bench.apply_chat_template(tokenizer, messages, reasoning)
        return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.long)

    def generate(ids):
        run = dflash_decode(drafter, target, ids, setting.max_new_tokens, stops, setting.temperature, setting.seed)
        return run.output_ids, run.acceptance_lengths

    return conversations(prompt_set, tokenizer, render, generate)
