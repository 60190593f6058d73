"""The dynamic audit (`compare --target`) at a real target's scale: memory, cache build, cache size
and replay, each against its floor, and live τ against offline τ, in one run.

Generates into a temp folder (removed afterwards) a Qwen3 target at a published shape with
random bf16 weights (written tensor by tensor, never materialised in float32) and two DFlash
drafters at the matching shape (the z-lab Qwen3-8B-DFlash-b16 recipe). Then:
  memory      `dflash-audit compare --target` through the real CLI in its own process, target in
              bf16; peak RssAnon sampled from /proc (CPU; mmap'd weights stay file-backed) less the
              idle CLI's (python, torch and transformers imported: what a 1 MB tiny model cannot
              outweigh), or `torch.cuda.max_memory_allocated` (CUDA, in-process) / (target + drafters
              + cache bytes); not a row for the tiny shape, whose 1 MB of models the allocator outweighs
  cache build the cache's greedy continuation with the drafters' layers captured on the way /
              transformers `generate` (greedy, KV cache, the same left-padded batch, the same tokens)
  cache size  its files / the needed layers' states in the target's dtype (+ token ids and margins)
  replay      the offline DFlash replay of one drafter / the drafter forward passes and LM-head
              reads the live loop spends on the same rounds
  τ           per prompt and drafter, the live loop's rounds == the offline rounds in `compare`'s
              report (== this process's replay, for the timed drafter); below float32 a parting that
              `explain_parting` judges a drafter near-tie within the dtype's rounding is not counted (the
              tests' rule, `impl.offline.walks.unexplained_partings`)
  speculative (tiny shape) the cache's continuation by speculative decoding with the test world's
              trained DFlash2 drafter / transformers `generate`, one prompt at a time both, goal below 1x;
              and the target forward passes each makes (a count, whatever the machine's speed)
Prompts are the test world's first `--prompts` prompts, cut to `--prompt-chars` characters (a CPU
spends its time on the prefill otherwise). Absolute times are only meaningful from a GPU; on a CPU
the ratios are what is recorded.

    python bench/bench_dynamic_scale.py --shape tiny|qwen3-1.7b|qwen3-8b [--device auto] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from measure import measure  # noqa: E402
from results import RESULTS, Row, record  # noqa: E402
from scale_targets import TARGETS, drafter_spec, write_drafter, write_target  # noqa: E402

GOALS = {"memory": 1.25, "build": 1.2, "size": 1.1, "replay": 1.5}
# The speculative build's row: long enough continuations that the drafter's rounds, not the prefills,
# decide (a CPU runs an 8-token verify pass at about 2.5x a 1-token step on the tiny target).
SPECULATIVE_NEW_TOKENS = 256
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
# What any run of the CLI holds before it reads a model: the baseline of the memory row.
IDLE = "import torch, transformers; from transformers import AutoModelForCausalLM; import dflash_audit.cli"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_audit", *args]


def compare_flags() -> set[str]:
    """The placement flags this checkout's `compare` has (they arrive with the device work)."""
    help_text = subprocess.run(cli("compare", "--help"), capture_output=True, text=True, env={**ENV, "COLUMNS": "200"},
                               check=False).stdout
    return {flag for flag in ("--dtype", "--device") if flag in help_text}


def files_bytes(folder: Path, pattern: str = "*.safetensors") -> int:
    return sum(p.stat().st_size for p in folder.rglob(pattern) if p.is_file())


def write_prompts(path: Path, count: int, chars: int) -> Path:
    from dflash_audit.prompts import load_prompts
    from dflash_world import cached_test_world

    records = [{"id": p["id"], "prompt": p["prompt"][:chars]} for p in load_prompts(cached_test_world().prompts)[:count]]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


class Timer:
    """Seconds spent inside the wrapped methods of a module (monkeypatched on the instance)."""

    def __init__(self, module, names: tuple[str, ...]):
        self.seconds = 0.0
        for name in names:
            original = getattr(module, name)
            setattr(module, name, self._timed(original))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            sync()
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                self.seconds += time.perf_counter() - started
        return wrapper


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    started = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - started


def run_cli_compare(args, target: Path, ours: Path, ref: Path, prompts: Path, cache: Path, out: Path, device: str):
    """`compare --target` as a user runs it: (peak bytes, wall s, report.json, how memory was measured)."""
    flags = compare_flags()
    command = ["compare", "--ours", str(ours), "--ref", str(ref), "--target", str(target), "--prompts", str(prompts),
               "--max-new-tokens", str(args.max_new_tokens), "--cache-dir", str(cache), "--out", str(out)]
    command += ["--dtype", "bfloat16"] if "--dtype" in flags else []
    command += ["--device", device] if "--device" in flags else []
    if device.startswith("cuda"):
        from dflash_audit.cli import main as cli_main

        torch.cuda.reset_peak_memory_stats()
        (status, wall) = timed(lambda: cli_main(command))
        if status not in (0, 1):
            raise SystemExit(f"compare failed ({status})")
        return torch.cuda.max_memory_allocated(), wall, json.loads((out / "report.json").read_text()), \
            "torch.cuda.max_memory_allocated", flags
    result = measure(cli(*command), ENV)
    if result.returncode not in (0, 1):
        raise SystemExit(f"compare failed ({result.returncode}): {result.stderr.strip()[-600:]}")
    return result.peak_anon_mb * 2**20, result.wall_s, json.loads((out / "report.json").read_text()), \
        "peak RssAnon", flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(TARGETS), default="tiny")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-chars", type=int, default=160)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of build and floor (default 3 tiny, 1)")
    parser.add_argument("--tmp", type=Path, default=None, help="where the models are generated (default: temp dir)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    repeats = args.repeats or (3 if args.shape == "tiny" else 1)
    if args.tmp is not None:  # a folder the user names may not exist yet: made (only the temp dir inside is removed)
        try:
            args.tmp.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--tmp {args.tmp}: cannot create it ({exc.strerror})")
        if not args.tmp.is_dir():
            parser.error(f"--tmp {args.tmp}: not a folder")
    root = Path(tempfile.mkdtemp(prefix="dflash-dyn-scale-", dir=args.tmp))
    try:
        from dflash_world import cached_test_world

        started = time.perf_counter()
        target_dir = write_target(root / "target", args.shape, Path(cached_test_world().target))
        spec = drafter_spec(args.shape)
        ours_dir, ref_dir = write_drafter(root / "ours", spec, 1), write_drafter(root / "ref", spec, 2)
        prompts_path = write_prompts(root / "prompts.jsonl", args.prompts, args.prompt_chars)
        generated_s = time.perf_counter() - started
        print(f"generated {args.shape}: target {files_bytes(target_dir) / 1e9:.2f} GB, drafters "
              f"2 x {files_bytes(ours_dir) / 1e9:.2f} GB in {generated_s:.0f} s", flush=True)

        peak, cli_wall, report, memory_kind, flags = run_cli_compare(
            args, target_dir, ours_dir, ref_dir, prompts_path, root / "cli-cache", root / "report", device)
        cli_cache = root / "cli-cache" / "offline"
        print(f"compare --target ({' '.join(sorted(flags)) or 'no placement flags'}): {memory_kind} "
              f"{peak / 2**20:.0f} MB, {cli_wall:.1f} s", flush=True)
        rows, extra = measure_in_process(args, device, repeats, target_dir, ours_dir, ref_dir, prompts_path,
                                         root / "cache", report)
        target_bytes = files_bytes(target_dir)
        drafter_bytes = files_bytes(ours_dir) + files_bytes(ref_dir)
        cache_bytes = files_bytes(cli_cache)
        floor = target_bytes + drafter_bytes + cache_bytes
        missing = [flag for flag in ("--dtype", "--device") if flag not in flags]
        idle = 0 if device.startswith("cuda") else measure([sys.executable, "-c", IDLE], ENV).peak_anon_mb * 2**20
        memory_row = Row(
            f"{args.shape} compare --target: {memory_kind}{' above the idle CLI' if idle else ''} / "
            "(target + drafters + cache)", (peak - idle) / floor, GOALS["memory"], "<=",
            detail=f"{peak / 2**20:.0f} MB" + (f" - {idle / 2**20:.0f} MB idle (python, torch, transformers "
                                                 f"imported) = {(peak - idle) / 2**20:.0f} MB" if idle else "")
                   + f" vs {target_bytes / 2**20:.0f} + {drafter_bytes / 2**20:.0f} + {cache_bytes / 2**20:.1f} MB"
                   + f" (all in bf16; {peak / floor:.3g}x counting the idle CLI too); {args.prompts} prompts x "
                   f"{args.max_new_tokens} new tokens"
                   + (f"; this compare lacks {' '.join(missing)} (target in float32)" if missing else ""))
        if args.shape != "tiny":  # a 1 MB model: the row would measure the allocator, not the audit
            rows.insert(0, memory_row)
        else:  # random drafters accept nothing: speculative generation is measured with a trained one
            speculative, extra["speculative"] = speculative_rows(args, repeats)
            rows += speculative
        extra["idle_cli_bytes"], extra["memory_row"] = idle, memory_row.line()
        extra.update({"device": device, "memory": {"kind": memory_kind, "peak_bytes": peak, "target_bytes": target_bytes,
                                                    "drafter_bytes": drafter_bytes, "cache_bytes": cache_bytes},
                      "compare_wall_s": cli_wall, "generate_models_s": generated_s,
                      "compare_flags": sorted(flags)})
        record(f"dynamic_scale[{args.shape}]", f"python bench/bench_dynamic_scale.py --shape {args.shape}", rows,
               extra, results=args.results)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def load_models(target_dir: Path, ours_dir: Path, ref_dir: Path, device: str):
    from transformers import AutoModelForCausalLM

    from dflash_audit.formats import load_any
    from foundation.transformers_compat import from_pretrained
    from impl.body_shapes import build_drafter

    target = from_pretrained(AutoModelForCausalLM, target_dir, dtype=torch.bfloat16, device_map=device)
    target = target.eval().requires_grad_(False)
    drafters = {}
    for name, folder in (("ours", ours_dir), ("ref", ref_dir)):
        loaded = load_any(folder, target_dir)
        drafters[name] = build_drafter(loaded.spec, loaded.state_dict).to(device=device, dtype=torch.bfloat16).eval()
    return target, drafters


@torch.inference_mode()
def live_partings(drafter, target, cache, prompts: list[torch.Tensor], offline: list[list[int]], max_new_tokens: int,
                  stop_ids: list[int], device: str) -> tuple[list[list[int]], list, bool]:
    """Each prompt decoded live by `drafter` and held to its offline rounds (compare's report) as the tests hold them:
    where they part, `explain_parting` sets the parting against the features the live drafter read, for the one
    near-tie rule (`impl.offline.walks.unexplained_partings`) to judge: below float32 a drafter near-tie within the
    dtype's rounding of the target's states is explained, anything else counts. Returns (the live rounds per prompt,
    the partings, whether every live continuation is the cache's)."""
    from impl.decoding import dflash_decode
    from impl.offline.walks import explain_parting

    rounds, partings, same = [], [], True
    for entry, prompt, replayed in zip(cache.prompts, prompts, offline, strict=True):
        result = dflash_decode(drafter, target, prompt.to(device), max_new_tokens, stop_ids, keep_features=True)
        rounds.append(result.acceptance_lengths)
        same &= torch.equal(result.output_ids.reshape(-1).cpu(), entry.token_ids)
        parting = explain_parting(drafter, target, cache, entry, "dflash", replayed, result.acceptance_lengths,
                                  result.extra["features"], result.output_ids)
        if parting is not None:
            partings.append(parting)
    return rounds, partings, same


@torch.inference_mode()
def measure_in_process(args, device: str, repeats: int, target_dir: Path, ours_dir: Path, ref_dir: Path,
                       prompts_path: Path, cache_dir: Path, report: dict) -> tuple[list[Row], dict]:
    from dflash_audit.prompts import load_prompts, tokenize_prompts
    from impl.offline import cache_bytes_estimate, offline_rounds_batch
    from impl.offline.cache import build_cache
    from impl.offline.walks import unexplained_partings
    from foundation.placement import dtype_name, model_dtype
    from foundation.target import load_tokenizer
    from foundation.target_vocab import stop_token_ids

    target, drafters = load_models(target_dir, ours_dir, ref_dir, device)
    tokenizer, _ = load_tokenizer(target_dir)
    prompts = tokenize_prompts(tokenizer, load_prompts(prompts_path))
    stop_ids = stop_token_ids(target_dir, tokenizer).ids
    layer_ids = sorted({i for d in drafters.values() for i in d.target_layer_ids})
    ids = [p.reshape(-1) for _, p in prompts]
    width = max(len(p) for p in ids)
    batch = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for b, p in enumerate(ids):
        batch[b, width - len(p):], mask[b, width - len(p):] = p, 1

    def floor_generate():
        return target.generate(input_ids=batch.to(device), attention_mask=mask.to(device), do_sample=False,
                               max_new_tokens=args.max_new_tokens, min_new_tokens=0, eos_token_id=stop_ids,
                               pad_token_id=0, use_cache=True)

    def ours_build():
        cache = build_cache("bench", target, prompts, layer_ids, args.max_new_tokens, stop_ids, batch=len(prompts))
        cache.save(cache_dir / "bench.safetensors")
        return cache

    floor_s, build_s = [], []
    for _ in range(repeats):  # alternating, so machine load hits both alike
        generated, seconds = timed(floor_generate)
        floor_s.append(seconds)
        cache, seconds = timed(ours_build)
        build_s.append(seconds)
        print(f"generate {floor_s[-1]:.2f} s, cache build {build_s[-1]:.2f} s", flush=True)
    same_tokens = all(
        torch.equal(entry.token_ids, generated[b, width - len(p):][:len(entry.token_ids)].cpu())
        for b, (entry, p) in enumerate(zip(cache.prompts, ids)))
    on_disk = files_bytes(cache_dir)
    total_tokens = sum(len(e.token_ids) for e in cache.prompts)
    needed = cache_bytes_estimate(total_tokens, layer_ids, target.config.hidden_size, torch.bfloat16)

    # The replay is timed for one drafter against its own live forwards; both drafters' offline
    # rounds are also read from the CLI's report (the real compare path).
    timed_name = "ref"
    offline = {side: [p[f"{side}_rounds"] for p in report["tau"]["methods"]["dflash"]["prompts"]]
               for side in ("ours", "ref")}
    replayed, replay_s = timed(lambda: offline_rounds_batch(drafters[timed_name], target, cache, cache.prompts))
    live, drafter_s, live_tokens_same, partings = {}, 0.0, True, []
    # At a real shape a CPU spends ~1.5 s a live round: the live loop runs for the timed drafter there.
    live_names = list(drafters) if args.shape == "tiny" or device.startswith("cuda") else [timed_name]
    for name in live_names:
        drafter = drafters[name]
        timer = Timer(drafter, ("forward", "compute_logits"))
        live[name], found, same = live_partings(drafter, target, cache, [p for _, p in prompts], offline[name],
                                                args.max_new_tokens, stop_ids, device)
        partings += found
        live_tokens_same &= same
        if name == timed_name:
            drafter_s = timer.seconds
        print(f"live {name}: τ {[round(sum(r) / len(r), 3) for r in live[name]]}", flush=True)
    tau = {name: [sum(r) / len(r) for r in rounds] for name, rounds in offline.items()}
    unexplained = unexplained_partings(partings, model_dtype(target))
    differing = len(unexplained)
    differing += sum(replayed[i] != offline[timed_name][i] for i in range(len(prompts)))  # one process: exact
    shape = args.shape
    rows = [
        Row(f"{shape} cache build / transformers generate of the same tokens", min(build_s) / min(floor_s),
            GOALS["build"], "<=", detail=f"{len(prompts)} prompts per forward, {args.max_new_tokens} new tokens, "
            f"{len(layer_ids)} layers kept; tokens {'identical' if same_tokens else 'DIFFER'}"),
        Row(f"{shape} cache size / needed layers' states (bf16)", on_disk / needed, GOALS["size"], "<=",
            detail=f"{on_disk / 2**20:.2f} MB vs {needed / 2**20:.2f} MB: {total_tokens} positions x "
                   f"{len(layer_ids)} layers x {target.config.hidden_size}"),
        Row(f"{shape} offline replay / drafter-only forwards", replay_s / drafter_s, GOALS["replay"], "<=",
            detail=f"{timed_name}, DFlash; the floor is its forward + LM-head time in the live loop"),
        Row(f"{shape} prompts x drafters ({', '.join(live_names)}) whose live and offline (compare's report) "
            "rounds part beyond a near-tie", differing, 0, "<=", unit="",
            detail=f"{len(partings)} parting(s), {len(partings) - len(unexplained)} of them drafter near-ties within "
                   f"the {dtype_name(model_dtype(target))} rounding (explain_parting, the tests' rule); "
                   f"τ ours {[round(t, 3) for t in tau['ours']]}, ref {[round(t, 3) for t in tau['ref']]} "
                   f"(random weights: drafts rarely match); live continuations "
                   f"{'equal' if live_tokens_same else 'differ from'} the cached ones"),
    ]
    extra = {"walls_s": {"generate": floor_s, "cache_build": build_s, "replay": replay_s,
                         "drafter_forwards_live": drafter_s},
             "cache": {"on_disk": on_disk, "needed": needed, "layer_ids": layer_ids, "positions": total_tokens},
             "tau": {"offline": tau, "live": {n: [sum(r) / len(r) for r in rs] for n, rs in live.items()}},
             "tokens_same_as_generate": same_tokens, "live_tokens_same_as_cache": live_tokens_same,
             "partings": [p.describe() for p in partings], "unexplained_partings": unexplained}
    return rows, extra


class ForwardCount:
    """The target's forward passes (calls of its decoder body), whoever makes them: a machine-free count."""

    def __init__(self, target):
        self.calls = 0
        self.handle = target.get_decoder().register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1

    def close(self) -> int:
        self.handle.remove()
        return self.calls


@torch.inference_mode()
def speculative_rows(args, repeats: int) -> tuple[list[Row], dict]:
    """The test world's target and its DFlash2 drafter, the world's most accepting (τ about 4 per
    round): the cache's continuation by speculative decoding against transformers `generate`, one prompt
    at a time both, every world prompt, SPECULATIVE_NEW_TOKENS new tokens. Random drafters accept nothing
    (τ 1), so the bench's own pair cannot show the gain."""
    from dflash_audit.prompts import load_prompts, tokenize_prompts
    from dflash_world import cached_test_world
    from dflash_world.drafter import cached_dflash2_drafter
    from impl.body_shapes import build_drafter
    from drafter_files.checkpoint import load_checkpoint
    from impl.offline.speculative import capture_speculative
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids

    world = cached_test_world()
    target, tokenizer = load_target(world.target)  # as trained: float32
    drafter_path = cached_dflash2_drafter(world)
    checkpoint = load_checkpoint(drafter_path)
    drafter = build_drafter(checkpoint.spec, checkpoint.state_dict).float().eval()
    prompts = tokenize_prompts(tokenizer, load_prompts(world.prompts))
    stop_ids = stop_token_ids(world.target, tokenizer).ids
    layer_ids = list(drafter.target_layer_ids)
    new = SPECULATIVE_NEW_TOKENS

    def floor():
        return [target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=new, eos_token_id=stop_ids, pad_token_id=0, use_cache=True)[0]
                for _, ids in prompts]

    def ours():
        return [capture_speculative(target, drafter, ids[0], layer_ids, new, stop_ids) for _, ids in prompts]

    floor_s, ours_s = [], []
    for _ in range(repeats):  # alternating, so machine load hits both alike
        count = ForwardCount(target)
        generated, seconds = timed(floor)
        floor_passes = count.close()
        floor_s.append(seconds)
        count = ForwardCount(target)
        captured, seconds = timed(ours)
        ours_passes = count.close()
        ours_s.append(seconds)
        print(f"generate {floor_s[-1]:.2f} s ({floor_passes} target passes), speculative build {ours_s[-1]:.2f} s "
              f"({ours_passes} target passes)", flush=True)
    same = all(torch.equal(c.token_ids, g) for (c, _), g in zip(captured, generated))
    assert ours_passes == sum(n for _, n in captured)  # the loop's own count agrees with the hook's
    new_tokens = sum(len(c.token_ids) - c.prompt_len for c, _ in captured)
    name = f"test world, trained drafter ({Path(drafter_path).stem}), {len(prompts)} prompts x {new} new tokens"
    rows = [
        Row(f"{name}: speculative cache build / transformers generate", min(ours_s) / min(floor_s), 1.0, "<=",
            detail=f"one prompt at a time both; tokens {'identical' if same else 'DIFFER'}; "
                   f"{ours_passes} target passes vs {floor_passes}"),
        Row(f"{name}: target forward passes, speculative / generate", ours_passes / floor_passes, 1.0, "<=",
            detail=f"{ours_passes} vs {floor_passes} (a count, whatever the machine's speed) for {new_tokens} new "
                   f"tokens: {new_tokens / ours_passes:.2f} vs {new_tokens / floor_passes:.2f} tokens per pass"),
    ]
    return rows, {"generate_s": floor_s, "speculative_s": ours_s, "passes": ours_passes,
                  "generate_passes": floor_passes, "new_tokens": new_tokens, "tokens_identical": same,
                  "drafter": Path(drafter_path).stem}


if __name__ == "__main__":
    main()
