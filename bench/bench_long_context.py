"""The offline audit along the context: its cost per generated token from 512- to 4032-token prompts, and its memory.

On the test world's long target (dflash_world/long_context.py: the test target trained on rows of its 4096
positions), its two long drafters (the mixed sliding/full one and its all-sliding twin, window 48) and its long prompts
(512, 1024, 2048 and 4032 tokens, cut from held-out files), one prompt at a time, every length measured in turn within
each repeat (the fastest repeat counts), so that machine load hits all alike:
  replay      the all-sliding drafter's offline replay time per drafter pass (up to 8 blocks a pass) past the
              context's one projection: the longest prompt's against the shortest's, goal flat (<= 1.5x); the mixed
              drafter's full layer attends to the whole context in any loop, so its replay time per generated token
              is held to the live loop's drafter time per generated token (forward + logits, the same rounds), that
              ratio at the longest prompt against at the shortest (<= 1.5x); the projection's time per position too
  recompute   context positions the drafter's fc projects per (prompt + generated) position, counted by a hook
              (whatever the machine's speed): 1 means the context is never recomputed per round
  memory      the bytes the audit holds per context position (the cache's layers, ids and margins; the replay's
              K/V banks), the longest prompt's against the shortest's: linear in the context (<= 1.1x)
  target      the cache build's decode time per generated token past the prefill ((t(N) - t(1)) / (N - 1)),
              the target's own cost (attention over a longer context), shown beside the replay: no goal
Also measured (no goal: a figure the docs report): the τ of the mixed drafter and its all-sliding twin past their
window with z-lab's inference layout (slot j sees keys with q - k < W) against speculators' training layout (every slot sees the W context tokens
before the anchor), conformance/references_differ.toml's disagreement, on the same prompts.

    python bench/bench_long_context.py [--max-new-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from bench_dynamic_scale import Timer  # noqa: E402
from results import Row, record  # noqa: E402

GOALS = {"replay": 1.5, "recompute": 1.0, "memory": 1.1}
WINDOW_NOTE = "only the window before each block, so nothing a pass does grows with the context"


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


class Passes:
    """Drafter passes of the replay (`BlockReplay.hidden` calls: up to a few blocks each), counted while installed."""

    def __init__(self):
        from impl.offline.replay import BlockReplay

        self.count, self.cls, self.original = 0, BlockReplay, BlockReplay.hidden

        def counted(replay, *args, **kwargs):
            self.count += 1
            return self.original(replay, *args, **kwargs)

        BlockReplay.hidden = counted

    def remove(self) -> None:
        self.cls.hidden = self.original


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
    from impl.offline.replay import BlockReplay
    from impl.offline.walks import offline_rounds_batch

    world = cached_test_world()
    target, tokenizer = load_target(cached_long_target(world))
    models = {}
    for kind, sliding_only in (("mixed", False), ("all-sliding", True)):
        ckpt = load_checkpoint(cached_long_drafter(world, sliding_only=sliding_only))
        models[kind] = build_drafter(ckpt.spec, ckpt.state_dict).eval()
    prompts = tokenize_prompts(tokenizer, load_prompts(cached_long_prompts(world)))
    layer_ids, new = list(models["mixed"].target_layer_ids), args.max_new_tokens
    lengths = {pid: ids.shape[1] for pid, ids in prompts}
    best = {(kind, pid): {} for kind in models for pid in lengths}
    caches, rounds = {}, {}

    def keep(b: dict, name: str, value: float) -> None:
        b[name] = min(b.get(name, float("inf")), value)

    with torch.inference_mode():
        for repeat in range(args.repeats):
            for pid, ids in prompts:  # every length in turn within a repeat
                cache, build_s = timed(lambda: build_cache(pid, target, [(pid, ids)], layer_ids, new, []))
                _, prefill_s = timed(lambda: build_cache(pid, target, [(pid, ids)], layer_ids, 1, []))
                caches[pid] = cache
                for kind, drafter in models.items():
                    b = best[kind, pid]
                    keep(b, "build", build_s)
                    keep(b, "prefill", prefill_s)
                    _, project_s = timed(lambda: BlockReplay(drafter, target, cache.prompts))
                    counter, passes = ProjectedPositions(drafter), Passes()
                    replayed, replay_s = timed(lambda: offline_rounds_batch(drafter, target, cache, cache.prompts)[0])
                    counter.handle.remove()
                    passes.remove()
                    live_drafter = copy.copy(drafter)  # the live loop's drafter time (forward + logits), timed
                    timer = Timer(live_drafter, ("forward", "compute_logits"))
                    live = dflash_decode(live_drafter, target, ids, new, []).acceptance_lengths
                    if live != replayed:
                        sys.exit(f"{kind} {pid}: the replay's rounds differ from the live loop's")
                    rounds[kind, pid] = replayed
                    keep(b, "replay", replay_s)
                    keep(b, "project", project_s)
                    keep(b, "live_drafter", timer.seconds)
                    b["projected"], b["passes"] = counter.count, passes.count
                    print(f"repeat {repeat}: {kind} {pid} ({lengths[pid]} tokens): cache {build_s:.2f} s (prefill "
                          f"{prefill_s:.2f} s), replay {replay_s:.3f} s ({passes.count} passes), live drafter "
                          f"{timer.seconds:.3f} s, {len(replayed)} rounds", flush=True)
        figures = {}
        for (kind, pid), b in best.items():
            entry = caches[pid].prompts[0]
            generated, positions = len(entry.token_ids) - entry.prompt_len, len(entry.token_ids)
            figures[kind, pid] = {
                "prompt_tokens": lengths[pid], "generated": generated, "rounds": len(rounds[kind, pid]),
                "tau": sum(rounds[kind, pid]) / len(rounds[kind, pid]), "passes": b["passes"],
                "replay_s_per_token": b["replay"] / generated,
                "live_drafter_s_per_token": b["live_drafter"] / generated,
                "project_s_per_position": b["project"] / positions,
                "pass_s": max(0.0, b["replay"] - b["project"]) / b["passes"],
                "target_decode_s_per_token": (b["build"] - b["prefill"]) / max(1, new - 1),
                "projected_per_position": b["projected"] / positions,
                "bytes_per_position": (entry_bytes(entry) + bank_bytes(models[kind], target, entry)) / positions}
        # τ past the window, z-lab's inference layout (the drafter as built) against speculators' training layout.
        layouts = {(kind, layout): model if layout == "zlab" else speculators_layout(model)
                   for kind, model in models.items() for layout in ("zlab", "speculators")}
        decoded = {key: {pid: dflash_decode(model, target, ids, new, []).acceptance_lengths for pid, ids in prompts}
                   for key, model in layouts.items()}
        along = {f"{kind} {layout}": tau_along_context([PromptRounds(id=pid, prompt_len=lengths[pid], rounds=r)
                                                        for pid, r in decoded[kind, layout].items()])
                 for kind, layout in layouts}
        parted = {kind: sum(decoded[kind, "zlab"][pid] != decoded[kind, "speculators"][pid] for pid in lengths)
                  for kind in models}
    short, long_ = min(lengths, key=lengths.get), max(lengths, key=lengths.get)
    fig = {kind: (figures[kind, long_], figures[kind, short]) for kind in models}
    taus = {name: sum(b.tokens for b in a.by_position) / sum(b.rounds for b in a.by_position)
            for name, a in along.items()}
    (sl, ss), (ml, ms) = fig["all-sliding"], fig["mixed"]
    over_live = {kind: (l_["replay_s_per_token"] / l_["live_drafter_s_per_token"],
                        s["replay_s_per_token"] / s["live_drafter_s_per_token"]) for kind, (l_, s) in fig.items()}
    span = f"{sl['prompt_tokens']}- / {ss['prompt_tokens']}-token prompt"
    rows = [
        Row(f"long context: all-sliding drafter, offline replay time per drafter pass past the context's projection, "
            f"{span}", sl["pass_s"] / ss["pass_s"], GOALS["replay"], "<=",
            detail=f"{1e3 * sl['pass_s']:.2f} vs {1e3 * ss['pass_s']:.2f} ms a pass (up to 8 blocks each; "
                   f"{sl['passes']} and {ss['passes']} passes for {new} new tokens): its layers see {WINDOW_NOTE}"),
        Row(f"long context: mixed drafter, offline replay per generated token / the live loop's drafter time per "
            f"generated token, {span}", over_live["mixed"][0] / over_live["mixed"][1], GOALS["replay"], "<=",
            detail=f"{over_live['mixed'][0]:.2f}x vs {over_live['mixed'][1]:.2f}x; replay {1e3 * ml['replay_s_per_token']:.2f} "
                   f"vs {1e3 * ms['replay_s_per_token']:.2f} ms a token, a pass {1e3 * ml['pass_s']:.2f} vs "
                   f"{1e3 * ms['pass_s']:.2f} ms: its full layer attends to the whole context in both loops"),
        Row(f"long context: the context's one projection per position, {span}",
            ml["project_s_per_position"] / ms["project_s_per_position"], GOALS["replay"], "<=",
            detail=f"{1e6 * ml['project_s_per_position']:.1f} vs {1e6 * ms['project_s_per_position']:.1f} µs a "
                   "position (fc, norm and every layer's K/V, once per prompt; mixed drafter)"),
        Row(f"long context: context positions the drafter projects per position, {ml['prompt_tokens']}-token prompt",
            max(ml["projected_per_position"], sl["projected_per_position"]), GOALS["recompute"], "<=", unit="",
            detail=f"{ml['projected_per_position']:.3f} mixed, {sl['projected_per_position']:.3f} all-sliding "
                   f"({ms['projected_per_position']:.3f} at {ms['prompt_tokens']}): never recomputed per round"),
        Row(f"long context: audit bytes per context position, {span}",
            ml["bytes_per_position"] / ms["bytes_per_position"], GOALS["memory"], "<=",
            detail=f"{ml['bytes_per_position']:.0f} vs {ms['bytes_per_position']:.0f} B (cache layers, ids, margins "
                   "and the replay's K/V banks; mixed drafter): linear in the context"),
    ]
    window_rows = {name: [[b.start, b.tau, b.rounds] for b in a.by_position] for name, a in along.items()}
    extra = {"figures": {f"{kind} {pid}": f for (kind, pid), f in figures.items()},
             "target_decode_ratio": ml["target_decode_s_per_token"] / ms["target_decode_s_per_token"],
             "window_layout": {"tau": taus, "by_position": window_rows, "prompts_whose_rounds_differ": parted,
                               "window": models["mixed"].spec.sliding_window}}
    print(f"target decode per token past the prefill: {1e3 * ml['target_decode_s_per_token']:.2f} vs "
          f"{1e3 * ms['target_decode_s_per_token']:.2f} ms ({extra['target_decode_ratio']:.2f}x, the target's own "
          "cost, no goal)")
    for kind in models:
        print(f"{kind} drafter, window {models[kind].spec.sliding_window}, every round past it: τ "
              f"{taus[f'{kind} zlab']:.3f} with z-lab's inference layout, {taus[f'{kind} speculators']:.3f} with "
              f"speculators' training layout ({parted[kind]} of {len(prompts)} prompts' rounds differ)")
    for key, f in figures.items():
        print(f"{key}: {f}")
    record("long_context", " ".join(["python"] + sys.argv), rows, extra)


if __name__ == "__main__":
    main()
