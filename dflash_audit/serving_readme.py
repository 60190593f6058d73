"""The "Will it serve as trained?" tables of docs/serving.md, generated: which engine rule gives each field (called,
executed from source or restated) and what each engine runs differently from training on drafters written by
the references' own writers (z-lab's `save_pretrained`, speculators' converter and its DSpark and XPress classes'
`save_pretrained`) and by our `convert`.

`python -m dflash_audit.serving_readme` prints both tables; tests/test_serving.py keeps docs/serving.md equal to them.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from impl.spec import DraftSpec

ENGINES = ("vllm", "sglang")
# Two sliding layers around a full one (window 6), ids (1, 3, 4) of a 6-layer target, block 8.
SPEC = DraftSpec(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=3, target_vocab_size=128, target_layer_ids=(1, 3, 4), num_target_layers=6,
                 mask_token_id=127, block_size=8,
                 layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=6)


def dflash2(spec: DraftSpec) -> DraftSpec:
    return dataclasses.replace(spec, conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=5,
                               sliding_window_non_causal=True)


# speculators' other two DFlash-family drafters, written by their own model classes (models/dspark, models/xpress).
FAMILY_WRITERS = {"dspark": dict(markov_rank=16, markov_head_type="vanilla", enable_confidence_head=True,
                                 confidence_head_with_markov=True),
                  "dspark (rnn head)": dict(markov_rank=16, markov_head_type="rnn", enable_confidence_head=True,
                                            confidence_head_with_markov=True),
                  "xpress": dict(xpress_rank=16, xpress_mlp_ratio=2, num_jacobi_passes=3)}


def speculators_save_pretrained(spec: DraftSpec, path: Path, verifier: Path) -> Path:
    """speculators' own writer: its DFlash-family model class's `save_pretrained` (its own random weights)."""
    from reference_adapters import speculators_adapter as adapter

    model = adapter.MODEL_CLASSES[spec.family](adapter.speculators_config(spec, verifier))
    adapter.save_speculators_model(model, path)
    return path


def zlab_save_pretrained(spec: DraftSpec, path: Path) -> Path:
    """z-lab's own writer: its DFlash / DFlash2 model class's `save_pretrained` (random weights)."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from transformers import Qwen3Config

    from drafter_files.zlab_format import zlab_config

    model = (DFlash2DraftModel if spec.family == "dflash2" else DFlashDraftModel)(Qwen3Config(**zlab_config(spec)))
    model.save_pretrained(path)
    return path


def reference_written(root: Path, target_dir: Path, spec: DraftSpec = SPEC) -> dict[str, Path]:
    """{writer label: drafter directory}: both families by z-lab, DFlash by speculators' converter (it converts
    no DFlash2), both families by our convert (its speculators output is speculators' own save_pretrained)."""
    from loguru import logger
    from speculators.convert.dflash import DFlashConverter

    from dflash_audit.conversion import convert

    logger.disable("speculators")
    dirs = {}
    for family, family_spec in (("dflash", spec), ("dflash2", dflash2(spec))):
        zlab = dirs[f"z-lab save_pretrained, {family}"] = zlab_save_pretrained(family_spec, root / f"zlab-{family}")
        if family == "dflash":
            DFlashConverter().convert(zlab, root / "speculators-dflash", base_model=str(target_dir))
            dirs["speculators converter, dflash"] = root / "speculators-dflash"
        for fmt in ("zlab", "speculators"):
            convert(zlab, root / f"ours-{fmt}-{family}", fmt, target=target_dir)
            dirs[f"our convert --format {fmt}, {family}"] = root / f"ours-{fmt}-{family}"
    for label, heads in FAMILY_WRITERS.items():
        dirs[f"speculators save_pretrained, {label}"] = speculators_save_pretrained(
            dataclasses.replace(spec, **heads), root / f"speculators-{label.split()[0]}-{len(dirs)}", target_dir)
    return dirs


def divergence_table(dirs: dict[str, Path], target_dir: Path) -> str:
    from dflash_audit.audit.serving import section_dict, serving_section

    lines = ["| drafter written by | " + " | ".join(ENGINES) + " |", "|---|" + "---|" * len(ENGINES)]
    for label, path in dirs.items():
        section = section_dict(serving_section(path, list(ENGINES), target_dir))
        cells = []
        for engine in ENGINES:
            found = [f for f in section[engine]["findings"] if f["severity"] == "divergence"]
            cells.append("; ".join(f"**{f['field']}**: {f['message']}".replace(str(path), "DRAFTER")
                                   + (f" (`{f['source']}`)" if f["source"] else "") for f in found)
                         or "serves as trained")
        lines.append(f"| {label} | " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def tables(root: Path) -> str:
    from dflash_world.target_training import random_qwen3
    from serving_engines.rules import markdown

    target = root / "target"
    random_qwen3(SPEC.num_target_layers, SPEC.hidden_size, SPEC.target_vocab_size).save_pretrained(target)
    return markdown() + "\n" + divergence_table(reference_written(root, target), target)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(tables(Path(tmp)), end="")
