"""z-lab's own benchmark, `dflash.benchmark._run_transformers`, run on local rows and given models.

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

from reference_adapters.version_guard import check_reference
from reference_adapters.zlab_adapter import cpu_timer

check_reference("dflash")

import dflash.benchmark as zlab_benchmark  # noqa: E402  (after the version guard on purpose)


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
    summary = zlab_benchmark._print_decode_summary

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
          mock.patch.object(zlab_benchmark, "load_transformers_models", lambda *a: (target, zlab_drafter, wrapped)),
          mock.patch.object(zlab_benchmark, "_print_decode_summary", record),
          mock.patch.object(zlab_benchmark, "tqdm", lambda it, **k: it)):
        zlab_benchmark._run_transformers(args)
    return [[int(n) for n in lengths] for lengths in recorded]
