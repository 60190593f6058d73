"""The offline audit along the context: its cost per generated token from 512- to 4032-token prompts, and its memory.

On the test world's long target and long drafter (dflash_world/long_context.py: the test target trained on rows of
its 4096 positions; the mixed sliding/full drafter trained against it) and its long prompts (512, 1024, 2048 and
4032 tokens, cut from held-out files), one prompt at a time, every length measured in turn within each repeat (the
fastest repeat counts), so that machine load hits all alike:
  replay      the offline DFlash replay's time per generated token (the context projected once per prompt, then
              one drafter pass per round): the longest prompt's against the shortest's, goal flat (<= 1.5x)
  recompute   context positions the drafter's fc projects per (prompt + generated) position, counted by a hook
              (whatever the machine's speed): 1 means the context is never recomputed per round
  memory      the bytes the audit holds per context position (the cache's layers, ids and margins; the replay's
              K/V banks), the longest prompt's against the shortest's: linear in the context (<= 1.1x)
  target      the cache build's decode time per generated token past the prefill ((t(N) - t(1)) / (N - 1)),
              the target's own cost (attention over a longer context), shown beside the replay: no goal
Also measured (no goal: a figure the docs report): the τ of the drafter past its window with z-lab's inference
layout (slot j sees keys with q - k < W) against speculators' training layout (every slot sees the W context tokens
before the anchor), conformance/references_differ.toml's disagreement, on the same prompts.

    python bench/bench_long_context.py [--max-new-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from results import Row, record  # noqa: E402

GOALS = {"replay": 1.5, "recompute": 1.0, "memory": 1.1}


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


class ProjectedPositions:
    """Context positions the drafter's fc projects, counted by a forward hook."""

    def __init__(self, drafter):
        self.count = 0
        self.handle = drafter.fc.register_forward_hook(self.hook)

    def hook(self, _module, inputs, _output):
        self.count += inputs[0].shape[:-1].numel()


def entry_bytes(entry) -> int:
    return sum(t.numel() * t.element_size() for t in [entry.token_ids, entry.margin, *entry.layers.values()])


def bank_bytes(drafter, target, entry) -> int:
    from impl.offline.replay import BlockReplay

    replay = BlockReplay(drafter, target, [entry])
    return sum(t.numel() * t.element_size() for t in replay.keys + replay.values)


def speculators_layout(drafter):
    """The drafter with speculators' training layout on its sliding layers at inference: every slot of a block sees
    the W context tokens before its anchor (z-lab's: keys with q - k < W)."""
    spec = drafter.spec

    class Layout(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = drafter

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

        def forward(self, noise, context, positions, masks=None, cache=None):
            from impl.masks import inference_mask

            cached = len(cache) if cache is not None else 0
            keys, block = cached + context.shape[1], noise.shape[1]
            masks = []
            for i in range(spec.num_hidden_layers):
                window, causal = spec.window_of(i), spec.block_is_causal(i)
                mask = inference_mask(keys, block, sliding_window=None, causal=causal, device=noise.device)
                if window is not None:  # the context: the W tokens before the anchor, for every slot
                    mask[:, :keys] &= (torch.arange(keys, device=noise.device) >= keys - window)[None]
                masks.append(mask)
            return self.inner(noise, context, positions, masks=masks, cache=cache)

    return Layout()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from dflash_audit.prompts import load_prompts, tokenize_prompts
    from dflash_audit.tau.along_context import PromptRounds, tau_along_context
    from dflash_world import cached_test_world
    from dflash_world.drafter import cached_long_drafter
    from dflash_world.long_context import cached_long_prompts, cached_long_target
    from drafter_files.checkpoint import load_checkpoint
    from foundation.target import load_target
    from impl.body_shapes import build_drafter
    from impl.decoding import dflash_decode
    from impl.offline.cache import build_cache
    from impl.offline.walks import offline_rounds_batch

    world = cached_test_world()
    target_dir, drafter_path = cached_long_target(world), cached_long_drafter(world)
    target, tokenizer = load_target(target_dir)
    ckpt = load_checkpoint(drafter_path)
    drafter = build_drafter(ckpt.spec, ckpt.state_dict).eval()
    prompts = tokenize_prompts(tokenizer, load_prompts(cached_long_prompts(world)))
    layer_ids, new = list(drafter.target_layer_ids), args.max_new_tokens
    lengths = {pid: ids.shape[1] for pid, ids in prompts}
    best = {pid: {"replay": float("inf"), "build": float("inf"), "prefill": float("inf")} for pid, _ in prompts}
    caches, rounds = {}, {}
    with torch.inference_mode():
        for repeat in range(args.repeats):
            for pid, ids in prompts:  # every length in turn within a repeat
                cache, build_s = timed(lambda: build_cache(pid, target, [(pid, ids)], layer_ids, new, []))
                _, prefill_s = timed(lambda: build_cache(pid, target, [(pid, ids)], layer_ids, 1, []))
                counter = ProjectedPositions(drafter)
                replayed, replay_s = timed(lambda: offline_rounds_batch(drafter, target, cache, cache.prompts)[0])
                counter.handle.remove()
                caches[pid], rounds[pid] = cache, replayed
                b = best[pid]
                b["replay"], b["build"], b["prefill"] = (min(b["replay"], replay_s), min(b["build"], build_s),
                                                         min(b["prefill"], prefill_s))
                b["projected"] = counter.count
                print(f"repeat {repeat}: {pid} ({lengths[pid]} tokens): cache {build_s:.2f} s (prefill "
                      f"{prefill_s:.2f} s), replay {replay_s:.3f} s, {len(replayed)} rounds", flush=True)
        figures = {}
        for pid, _ in prompts:
            entry, b = caches[pid].prompts[0], best[pid]
            generated = len(entry.token_ids) - entry.prompt_len
            positions = len(entry.token_ids)
            figures[pid] = {
                "prompt_tokens": lengths[pid], "generated": generated, "rounds": len(rounds[pid]),
                "tau": sum(rounds[pid]) / len(rounds[pid]),
                "replay_s_per_token": b["replay"] / generated,
                "target_decode_s_per_token": (b["build"] - b["prefill"]) / max(1, new - 1),
                "projected_per_position": b["projected"] / positions,
                "bytes_per_position": (entry_bytes(entry) + bank_bytes(drafter, target, entry)) / positions}
        # τ past the window, z-lab's inference layout (the drafter as built) against speculators' training layout.
        layouts = {"zlab": drafter, "speculators": speculators_layout(drafter)}
        along = {name: tau_along_context([PromptRounds(id=pid, prompt_len=ids.shape[1], rounds=dflash_decode(
            model, target, ids, new, []).acceptance_lengths) for pid, ids in prompts]) for name, model in
            layouts.items()}
    short, long_ = min(figures, key=lambda p: lengths[p]), max(figures, key=lambda p: lengths[p])
    s, l_ = figures[short], figures[long_]
    taus = {name: [sum(b.tau * b.rounds for b in a.by_position) / sum(b.rounds for b in a.by_position)]
            for name, a in along.items()}
    rows = [
        Row(f"long context: offline replay time per generated token, {l_['prompt_tokens']}- / "
            f"{s['prompt_tokens']}-token prompt", l_["replay_s_per_token"] / s["replay_s_per_token"],
            GOALS["replay"], "<=", detail=f"{1e3 * l_['replay_s_per_token']:.2f} vs "
            f"{1e3 * s['replay_s_per_token']:.2f} ms/token, {new} new tokens, the context projected once per prompt"),
        Row(f"long context: context positions the drafter projects per position, {l_['prompt_tokens']}-token prompt",
            l_["projected_per_position"], GOALS["recompute"], "<=", unit="",
            detail=f"{l_['projected_per_position']:.3f} ({s['projected_per_position']:.3f} at "
                   f"{s['prompt_tokens']}): never recomputed per round"),
        Row(f"long context: audit bytes per context position, {l_['prompt_tokens']}- / {s['prompt_tokens']}-token "
            "prompt", l_["bytes_per_position"] / s["bytes_per_position"], GOALS["memory"], "<=",
            detail=f"{l_['bytes_per_position']:.0f} vs {s['bytes_per_position']:.0f} B (cache layers, ids, margins "
                   "and the replay's K/V banks): linear in the context"),
    ]
    window_rows = {name: [[b.start, b.tau, b.rounds] for b in a.by_position] for name, a in along.items()}
    extra = {"figures": figures, "target_decode_ratio": l_["target_decode_s_per_token"] /
             s["target_decode_s_per_token"], "window_layout": {
                 "tau": {name: t[0] for name, t in taus.items()}, "by_position": window_rows,
                 "window": drafter.spec.sliding_window}}
    print(f"target decode per token past the prefill: {1e3 * l_['target_decode_s_per_token']:.2f} vs "
          f"{1e3 * s['target_decode_s_per_token']:.2f} ms ({extra['target_decode_ratio']:.2f}x, the target's own "
          "cost, no goal)")
    print(f"τ with z-lab's inference window layout {taus['zlab'][0]:.3f}, with speculators' training layout "
          f"{taus['speculators'][0]:.3f} (window {drafter.spec.sliding_window}, every round past it)")
    for pid, f in figures.items():
        print(f"{pid}: {f}")
    record("long_context", " ".join(["python"] + sys.argv), rows, extra)


if __name__ == "__main__":
    main()
