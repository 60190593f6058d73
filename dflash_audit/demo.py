"""The embedded demo: a world with a planted-bug drafter, audited against a correctly trained reference.

Built once into a cache directory, each artefact written atomically and skipped when
present, so a rerun (or a resumed, interrupted build) never retrains what exists; a cache
built by another config or world format (`demo-key.txt`) is emptied first:
- `target/`       small Qwen3 trained on the standard library's source (dflash_audit.world)
- `prompts.jsonl` held-out prompts
- `ref/`          drafter trained with the reference recipe, saved in z-lab format
- `ours.pt`       drafter trained with the seed's three bugs: fc fed all but the deepest
                  selected layer, targets from an intermediate layer, gamma 7
Then `compare --ours ours.pt --ref ref/ --target target/ --prompts prompts.jsonl`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_audit.audit.report import AuditReport
from dflash_audit.world import DEMO_TARGET, build_world, stdlib_corpus
from dflash_audit.world.cache import WORLD_FORMAT
from impl.checkpoint import atomic_write_bytes, load_checkpoint, save_zlab_dir
from impl.layers import build_target_layer_ids


@dataclass
class DemoConfig:
    target_preset: dict = field(default_factory=lambda: dict(DEMO_TARGET))
    draft_layers: int = 2
    fc_layers: list[int] | None = None  # the reference's target layers; default z-lab's selection
    block_size: int = 8
    seq_len: int = 256
    batch_size: int = 4
    drafter_steps: int = 400
    drafter_seconds: float = 240.0  # safety cap per drafter on a slow machine; the schedule shrinks to fit
    max_anchors: int = 48  # blocks per packed row: ~10x cheaper steps than speculators' 512, same recipe otherwise
    warmup: int = 20
    corpus_bytes: int = 1_500_000
    n_prompts: int = 16  # 16 x 128 tokens: the τ gap of the planted bugs clears the bootstrap noise
    max_new_tokens: int = 128
    budget: int = 16
    lr: float = 3e-3


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash-audit" / "demo"


def reference_layer_ids(config: DemoConfig) -> list[int]:
    return config.fc_layers or build_target_layer_ids(config.target_preset["num_layers"], config.draft_layers)


def planted_bugs(reference_ids: list[int]) -> dict:
    """The seed's three bugs, as trainer knobs."""
    return {
        "fc_layers": reference_ids[:-1],  # the deepest selected layer never reaches fc
        "target_source_layer": reference_ids[-1],  # targets from an intermediate layer, not the final one
        "gamma": 7.0,
    }


ARTEFACTS = ("target", "prompts.jsonl", "ref", "ours.pt", "offline")
KEY_FILE = "demo-key.txt"


def demo_key(config: DemoConfig) -> str:
    """Hash of everything the cached artefacts depend on (the time cap aside)."""
    identity = {k: v for k, v in asdict(config).items() if k != "drafter_seconds"}
    identity["world_format"] = WORLD_FORMAT
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def prepare_cache(cache: Path, config: DemoConfig, rebuild: bool = False) -> None:
    """Empty the cache of artefacts built by another config or code version (or all, on `rebuild`)."""
    key, key_file = demo_key(config), cache / KEY_FILE
    built_for = key_file.read_text().strip() if key_file.is_file() else None
    if rebuild or (built_for != key and any((cache / name).exists() for name in ARTEFACTS)):
        for name in ARTEFACTS:
            _remove(cache / name)
    cache.mkdir(parents=True, exist_ok=True)
    if built_for != key:
        atomic_write_bytes(key_file, lambda tmp: Path(tmp).write_text(key + "\n"))


def build_demo(cache: Path, config: DemoConfig, rebuild: bool = False) -> dict[str, Path]:
    """Build (or reuse) the demo world under `cache`; returns its paths."""
    from impl.train import train_drafter

    cache = Path(cache)
    prepare_cache(cache, config, rebuild)
    world = build_world(cache, config.target_preset, n_prompts=config.n_prompts, max_bytes=config.corpus_bytes)
    paths = {"target": world.target, "prompts": world.prompts, "ref": cache / "ref", "ours": cache / "ours.pt",
             "offline": cache / "offline"}
    if (paths["ref"] / "config.json").is_file() and paths["ours"].is_file():
        return paths
    texts = stdlib_corpus("train", max_bytes=config.corpus_bytes)
    common = dict(steps=config.drafter_steps, max_seconds=config.drafter_seconds, block_size=config.block_size,
                  draft_layers=config.draft_layers, seq_len=config.seq_len, batch_size=config.batch_size,
                  lr=config.lr, warmup=config.warmup, max_anchors=config.max_anchors, seed=0,
                  # Pinned: the demo's drafters train with KL + fixed decay (the trainer now defaults to D-PACE).
                  loss="kl_div", loss_weighting="fixed-exp-decay")
    reference_ids = reference_layer_ids(config)
    if not (paths["ref"] / "config.json").is_file():
        staging = cache / ".ref-train.pt"
        train_drafter(world.target, texts, staging, fc_layers=reference_ids, **common)
        trained = load_checkpoint(staging)
        save_zlab_dir(paths["ref"], trained.spec, trained.state_dict)  # z-lab format keeps no recipe
        staging.unlink()
    if not paths["ours"].is_file():
        train_drafter(world.target, texts, paths["ours"], **common, **planted_bugs(reference_ids))
    return paths


def run_demo(cache: Path | None = None, rebuild: bool = False, out: Path = Path("reports/demo"),
             config: DemoConfig | None = None) -> AuditReport:
    from dflash_audit.commands.compare import run_compare

    config = config or DemoConfig()
    paths = build_demo(cache or default_cache_dir(), config, rebuild)
    return run_compare(paths["ours"], paths["ref"], target=paths["target"], prompts=paths["prompts"], out=out,
                       max_new_tokens=config.max_new_tokens, budget=config.budget, cache_dir=paths["offline"])


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
