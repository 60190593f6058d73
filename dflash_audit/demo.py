"""The embedded demo: a world with a planted-bug drafter, audited against a correctly trained reference.

Built once into a cache directory, each artefact written atomically and skipped when
present, so a rerun (or a resumed, interrupted build) never retrains what exists; a cache
built by another config or world format (`demo-key.txt`) is emptied first, and any other
non-empty folder is refused (the demo deletes only what it made). Step counts are fixed,
never time budgets, so the world is the same on every machine:
- `target/`       small Qwen3 trained on the standard library's source (world)
- `prompts.jsonl` held-out prompts
- `ref/`          drafter trained with the reference recipe, saved in z-lab format
- `ours.pt`       drafter trained with the three bugs of the README's opening story (a team's
                  Qwen3.6-27B drafter: fc fed 4 of its 5 target layers, targets from layer 61
                  instead of the final layer, loss decay gamma 7 instead of 4), scaled to this
                  world: fc fed all but the deepest selected layer, targets from that layer, gamma 7
Then `compare --ours ours.pt --ref ref/ --target target/ --prompts prompts.jsonl`.

The second act (`family="dflash2"`, `dflash-audit demo --family dflash2`) tells the same story
on a DFlash2 pair (convolutions and a candidate selector; a sliding layer then a full one):
the reference keeps speculators' dflash2 default, bidirectional sliding blocks; ours has the
three bugs plus its own, sliding blocks trained causal (a trainer that ignores
`sliding_window_non_causal`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dflash_audit.audit.report import AuditReport
from dflash_audit.outputs import check_outputs
from dflash_world import DEMO_TARGET, build_world, stdlib_corpus
from dflash_world.world_cache import WORLD_FORMAT
from foundation.atomic import atomic_write_bytes
from foundation.cache_dir import cache_root
from foundation.errors import AuditError
from drafter_files.checkpoint import load_checkpoint
from impl.families import DEMO_FAMILIES as FAMILIES
from impl.layers import build_target_layer_ids
from impl.settings import Declared
from drafter_files.zlab_format import save_zlab_dir
from serving_engines import ENGINES

if TYPE_CHECKING:
    from dflash_audit.flags.demo import DemoFlags


class DemoConfig(Declared):
    """The demo world's settings, each validated by pydantic; every one is part of the cache key (`demo_key`), so a
    world built for other settings is rebuilt, never reused. Step counts are fixed, never time budgets."""

    SUBJECT = "demo settings"
    INTEGER_WORDS = True

    target_preset: dict[str, Any] = Field(default_factory=lambda: dict(DEMO_TARGET),
                                          description="The target's size (dflash_world presets).")
    draft_layers: int = Field(2, gt=0, description="Drafter decoder layers.")
    target_layer_ids: list[int] | None = Field(None, description="The reference's target layers (None: z-lab's "
                                                                 "selection for the target's depth).")
    block_size: int = Field(8, gt=1, description="Drafter block size.")
    seq_len: int = Field(256, gt=0, description="Packed training row length.")
    batch_size: int = Field(4, gt=0, description="Packed rows per training step.")
    drafter_steps: int = Field(400, gt=0, description="Training steps per drafter: fixed, no time cap, so the same "
                                                      "world (and τ) on every machine.")
    max_anchors: int = Field(48, gt=0, description="Blocks per packed row: ~10x cheaper steps than speculators' "
                                                   "512, same recipe otherwise.")
    warmup: int = Field(20, ge=0, description="Linear warmup steps.")
    corpus_bytes: int = Field(1_500_000, gt=0, description="Standard-library source the target and drafters "
                                                           "train on.")
    n_prompts: int = Field(16, gt=0, description="Held-out prompts: 16 x 128 tokens, so the τ gap of the planted "
                                                 "bugs clears the bootstrap noise.")
    max_new_tokens: int = Field(128, gt=0, description="Tokens per prompt in the τ audit.")
    budget: int = Field(16, gt=0, description="DDTree node budget in the τ audit.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate of both drafters.")
    family: Literal[FAMILIES] = Field("dflash", description="dflash, or dflash2: the second act.")
    # DFlash2 act: a small selector for the small world, a sliding layer whose window is below seq_len.
    dflash2: dict[str, int] = Field(default_factory=lambda: dict(conv_kernel_size=2, conv_group_size=16,
                                                                 selector_rank=32, selector_top_k=8),
                                    description="The DFlash2 act's convolution and selector sizes.")
    sliding_window: int = Field(64, gt=0, description="The DFlash2 act's sliding window, below seq_len.")


def default_cache_dir(root: str | Path | None = None, family: str = "dflash") -> Path:
    return cache_root(root) / ("demo" if family == "dflash" else f"demo-{family}")


def default_out_dir(family: str = "dflash") -> Path:
    return Path("reports") / ("demo" if family == "dflash" else f"demo-{family}")


def family_settings(config: DemoConfig) -> tuple[dict, dict]:
    """(trainer settings both drafters share, the act's own planted bug) of the demo's family."""
    if config.family == "dflash":
        return {}, {}
    types = (["sliding_attention"] + ["full_attention"] * (config.draft_layers - 1))
    shared = dict(family="dflash2", layer_types=types, sliding_window=config.sliding_window,
                  sliding_window_non_causal=True, **config.dflash2)
    return shared, {"sliding_window_non_causal": False}  # sliding blocks trained causal


def reference_layer_ids(config: DemoConfig) -> list[int]:
    return config.target_layer_ids or build_target_layer_ids(config.target_preset["num_layers"], config.draft_layers)


def planted_bugs(reference_ids: list[int]) -> dict:
    """The story's three bugs (fc short of a layer, targets from a non-final layer, gamma 7), as trainer knobs."""
    return {
        "target_layer_ids": reference_ids[:-1],  # the deepest selected layer never reaches fc
        "verifier_source_layer": reference_ids[-1],  # targets from an intermediate layer, not the final one
        "gamma": 7.0,
    }


ARTEFACTS = ("target", "prompts.jsonl", "ref", "ours.pt", "offline")
KEY_FILE = "demo-key.txt"
SLOW_SECONDS = 600  # per drafter; about 2 minutes on the development machine


def demo_key(config: DemoConfig) -> str:
    """Hash of everything the cached artefacts depend on."""
    identity = config.model_dump()
    identity["world_format"] = WORLD_FORMAT
    identity["python"] = sys.version  # the corpus is this Python's standard library
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def built_for(cache: Path) -> str | None:
    """The key a demo cache was built for; AuditError if `cache` is anything else than a demo cache,
    an empty folder or nothing (the demo empties only what it recognizes as its own)."""
    if not cache.exists():
        return None
    if not cache.is_dir():
        raise AuditError(f"--world-dir {cache}: not a directory")
    key_file = cache / KEY_FILE
    key = key_file.read_text(errors="replace").strip() if key_file.is_file() else None
    if key is not None and re.fullmatch(r"[0-9a-f]{16}", key):
        return key
    if any(cache.iterdir()):
        raise AuditError(f"--world-dir {cache}: a non-empty folder that is not a demo world (no valid {KEY_FILE}); "
                         "give an empty or new folder")
    return None


def prepare_cache(cache: Path, config: DemoConfig, rebuild: bool = False) -> None:
    """Empty the cache of artefacts built by another config or code version (or all, on `rebuild`)."""
    key, key_file = demo_key(config), cache / KEY_FILE
    built_for_key = built_for(cache)
    if rebuild or (built_for_key != key and any((cache / name).exists() for name in ARTEFACTS)):
        for name in ARTEFACTS:
            _remove(cache / name)
    cache.mkdir(parents=True, exist_ok=True)
    if built_for_key != key:
        atomic_write_bytes(key_file, lambda tmp: Path(tmp).write_text(key + "\n"))


def build_demo(cache: Path, config: DemoConfig, rebuild: bool = False) -> dict[str, Path]:
    """Build (or reuse) the demo world under `cache`; returns its paths."""
    from impl.train import train_drafter

    cache = Path(cache)
    prepare_cache(cache, config, rebuild)
    trained = (cache / "ref" / "config.json").is_file() and (cache / "ours.pt").is_file()
    if not trained and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        print("note: training with this CPU's own kernels; `make demo` pins the AVX2 ones, with which every "
              "x86-64 machine trains the same world (the figures of docs/results.md)", file=sys.stderr)
    world = build_world(cache, config.target_preset, n_prompts=config.n_prompts, max_bytes=config.corpus_bytes)
    paths = {"target": world.target, "prompts": world.prompts, "ref": cache / "ref", "ours": cache / "ours.pt",
             "offline": cache / "offline"}
    if (paths["ref"] / "config.json").is_file() and paths["ours"].is_file():
        return paths
    texts = stdlib_corpus("train", max_bytes=config.corpus_bytes)
    common = dict(steps=config.drafter_steps, block_size=config.block_size,
                  draft_layers=config.draft_layers, seq_len=config.seq_len, batch_size=config.batch_size,
                  lr=config.lr, warmup=config.warmup, max_anchors=config.max_anchors, seed=0,
                  # Pinned: the demo's drafters train with KL + fixed decay (the trainer now defaults to D-PACE).
                  loss_fn="kl_div", per_position_loss_weight="fixed-exp-decay")
    shared, family_bug = family_settings(config)
    common.update(shared)
    reference_ids = reference_layer_ids(config)
    if not (paths["ref"] / "config.json").is_file():
        staging = cache / ".ref-train.pt"
        timed(lambda: train_drafter(world.target, texts, staging, target_layer_ids=reference_ids, **common), "reference drafter")
        trained = load_checkpoint(staging)
        save_zlab_dir(paths["ref"], trained.spec, trained.state_dict)  # z-lab format keeps no recipe
        staging.unlink()
    if not paths["ours"].is_file():
        bugs = {**common, **planted_bugs(reference_ids), **family_bug}
        timed(lambda: train_drafter(world.target, texts, paths["ours"], **bugs), "planted-bug drafter")
    return paths


def timed(step, what: str) -> None:
    """Run `step`; only warn when it is slow (a time cap would make the world depend on the machine)."""
    started = time.monotonic()
    step()
    seconds = time.monotonic() - started
    if seconds > SLOW_SECONDS:
        print(f"warning: training the demo's {what} took {seconds:.0f} s on this machine "
              "(same steps and result as anywhere, only slower)", file=sys.stderr)


def run_demo(flags: DemoFlags, config: DemoConfig | None = None, trace_trainer: bool = False) -> AuditReport:
    """`demo` as its validated flags ask (dflash_audit/commands/demo.py): the world of `config` (the demo's own
    for `--family` by default) built once, its drafters compared with `--device`/`--dtype` (a comma list of dtypes
    as `compare` takes); `trace_trainer` (the verb's default): first trace examples/own_trainer.py with the seed's
    four bugs."""
    from dflash_audit.audit.compare import run_compare
    from dflash_audit.flags.compare import CompareFlags
    from foundation.placement import resolve_placement

    config = config or DemoConfig(family=flags.family)
    family_settings(config)  # an unknown family fails before anything is built
    out = Path(flags.out or default_out_dir(config.family))
    cache = Path(flags.world_dir or flags.old_world_dir or default_cache_dir(flags.cache_dir, config.family))
    check_outputs({"--out": Path(out)}, {"--world-dir": cache})
    first = flags.dtype[0]
    resolve_placement(flags.device, "float32" if first == "auto" else first)  # bad flags fail before the build
    paths = build_demo(cache, config, flags.rebuild)
    if trace_trainer and config.family == "dflash":
        trace_own_trainer(paths["target"], out / "trace")
    # Will each drafter serve as trained on vLLM and SGLang? (`--serve`); the τ cache at <world>/offline.
    return run_compare(CompareFlags(ours=paths["ours"], ref=paths["ref"], target=paths["target"],
                                    prompts=paths["prompts"], out=out, max_new_tokens=config.max_new_tokens,
                                    budget=config.budget, cache_dir=cache, device=flags.device, dtype=flags.dtype,
                                    serve=list(ENGINES)))


# The seed team's four bugs planted in examples/own_trainer.py (a trainer of its own, no project code), scaled to the
# demo's 6-layer target: fc fed all but the deepest of its 3 layers, targets from layer n - 3, gamma 7, noise 0.5 on
# the target logits. `trace` finds each from one recorded step.
SEED_BUGS = ["--draft-layers", "3", "--fc-drop-last", "--target-layer", "3", "--gamma", "7", "--target-noise", "0.5"]
OWN_TRAINER = Path(__file__).resolve().parents[1] / "examples" / "own_trainer.py"


def trace_own_trainer(target: Path, out: Path) -> None:
    """Act zero: the team's own trainer, traced for one step (`dflash-audit trace -- python own_trainer.py ...`)."""
    from dflash_audit.flags.trace import TraceFlags
    from dflash_audit.trace.report import terminal_summary
    from dflash_audit.trace.verb import run_trace

    if not OWN_TRAINER.is_file():
        print(f"note: {OWN_TRAINER} is not installed here; the trace act is skipped")
        return
    command = [sys.executable, str(OWN_TRAINER), "--target", str(target), *SEED_BUGS]
    print("dflash-audit trace -- python examples/own_trainer.py --target <demo target> " + " ".join(SEED_BUGS))
    print(terminal_summary(run_trace(TraceFlags(command=command, out=out))))
    print(f"report: {out / 'index.html'}")


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
