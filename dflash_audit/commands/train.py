"""`dflash-audit train`: our online DFlash trainer (also under `torchrun --nproc_per_node=N`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dflash_audit.commands import VERBS
from dflash_audit.commands.train_options import with_knob_options
from dflash_audit.formats.setting_names import DeclarationError, convert
from dflash_audit.outputs import check_not_foreign, check_outputs, check_writable
from foundation.errors import AuditError
from foundation.inputs import check_finite_flags, check_target_dir, regular_file
from impl.families import TITLES, TRAINED_FAMILIES
from impl.recipe import KNOBS
from impl.spec import FAMILY_FIELDS


def _layer_ids(value: str | None, flag: str) -> list[int] | None:
    """`--target-layer-ids 1,16,31`: read as the spec's target_layer_ids, the same way every other source is."""
    if value is None:
        return None
    try:
        return convert("target_layer_ids", value, flag)
    except DeclarationError as exc:
        raise AuditError(str(exc)) from None


def check_out(out: Path, resume: bool, force: bool = False) -> None:
    """--out is a checkpoint file: never a directory, never someone else's file; an existing one is
    only this run's own to --resume, or replaced with --force."""
    from dflash_audit.formats import ours

    if out.is_dir():
        raise AuditError(f"--out {out}: a directory; --out is the checkpoint file to write (e.g. {out / 'ckpt.pt'})")
    if out.exists() and out.is_file() and out.suffix != ".pt":
        raise AuditError(f"--out {out}: an existing file that is not a *.pt checkpoint; refusing to overwrite it")
    if resume and out.exists() and not out.is_file():
        raise AuditError(f"--out {out}: not a checkpoint file to --resume from")
    if not out.is_file() or force:
        return
    if not ours.detect(out):
        raise AuditError(f"--out {out}: an existing file that is not a checkpoint dflash-audit wrote; refusing "
                         "to overwrite it (choose another path, or pass --force to replace it)")
    if not resume:
        raise AuditError(f"--out {out}: a checkpoint already exists there; pass --resume to continue that run, "
                         "or --force to replace it")


def check_train_paths(target: Path, data: Path, eval_data: Path | None, out: Path, json_out: Path | None,
                      resume: bool, force: bool = False) -> None:
    """Every path, before the tokenizer, the data or the target are read."""
    check_target_dir(target)
    regular_file(data, "file", "--data")
    if eval_data is not None:
        regular_file(eval_data, "file", "--eval-data")
    check_outputs({"--out": out, "--json": json_out}, {"--target": target, "--data": data, "--eval-data": eval_data})
    check_out(out, resume, force)
    check_writable("--out", out)
    if json_out is not None:
        check_writable("--json", json_out)
        check_not_foreign("--json", json_out, force)


def train(
    target: Path = typer.Option(..., help="Hugging Face target directory (model + tokenizer)."),
    data: Path = typer.Option(..., help="JSON lines: {'text'}, {'input_ids'[, 'loss_mask']} or {'messages'}."),
    out: Path = typer.Option(..., help="Checkpoint to write (ckpt.pt)."),
    steps: int = typer.Option(1000, help="Optimizer steps."),
    lr: float = typer.Option(6e-4, help="Peak learning rate."),
    warmup: int = typer.Option(50, help="Linear warmup steps before the cosine decay."),
    batch_size: int = typer.Option(4, help="Packed rows per micro-batch, across all ranks."),
    grad_accum: int = typer.Option(1, help="Micro-batches per optimizer step."),
    seq_len: int = typer.Option(1024, help="Packed row length."),
    recipe: str = typer.Option(None, help="'speculators': the whole recipe speculators' TrainConfig resolves for "
                                          "--speculator-type dflash (loss_fn, per_position_loss_weight, dpace_alpha, "
                                          "gamma, max_anchors, block_size, draft layers), read from the installed "
                                          "package; flags given explicitly still win."),
    block_size: int = typer.Option(None, help="Draft block size B (default: 16)."),
    draft_layers: int = typer.Option(None, help="Drafter decoder layers (default: 1)."),
    target_layer_ids: str = typer.Option(None, "--target-layer-ids", "--fc-layers",
                                         help="Target layers feeding fc, e.g. '1,2' (default: z-lab's rule)."),
    layer_types: str = typer.Option(None, help="Per draft layer: full_attention or sliding_attention, comma-separated."),
    sliding_window: int = typer.Option(None, help="Window of the sliding_attention layers."),
    mask_token_id: int = typer.Option(None, help="Default: the tokenizer's <|mask|> token."),
    draft_vocab_size: int = typer.Option(None, help="Reduced draft vocabulary: the head proposes only the N most "
                                                     "frequent loss-masked tokens of --data (speculators' rule), "
                                                     "mapped to target ids by d2t (default: the whole vocabulary)."),
    d2t: Path = typer.Option(None, "--d2t", help="The draft-to-target map to use instead: a .npy of offsets "
                                                 "(target id = draft id + d2t[draft id]), as speculators writes."),
    dtype: str = typer.Option("fp32", help="fp32, or bf16 (autocast, fp32 master weights)."),
    eval_data: Path = typer.Option(None, help="Held-out JSON lines (default: the last --eval-sequences rows)."),
    eval_sequences: int = typer.Option(2, help="Rows held out when no --eval-data is given."),
    eval_every: int = typer.Option(0, help="Evaluate every N steps (0: at the end only)."),
    save_every: int = typer.Option(0, help="Checkpoint every N steps (0: at the end only)."),
    resume: bool = typer.Option(False, help="Continue the run saved at --out."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file at --out / --json instead of "
                                                      "refusing it."),
    seed: int = typer.Option(0),
    max_seconds: float = typer.Option(None, help="Shrink the schedule to fit this wall-clock budget."),
    json_out: Path = typer.Option(None, "--json", help="Write the run's stats as JSON."),
    family: str = typer.Option("dflash", help="dflash; dflash2 (convolutions + candidate selector); dspark (Markov and "
                                              "confidence heads); xpress (causal refiner). Each trains with its loss "
                                              "and its defaults as speculators' trainer resolves the family."),
    conv_kernel_size: int = typer.Option(None, help="DFlash2: causal taps per convolution (default: 2)."),
    conv_group_size: int = typer.Option(None, help="DFlash2: channels sharing one dynamic kernel (default: 16)."),
    selector_rank: int = typer.Option(None, help="DFlash2: rank of the selector's bilinear term (default: 256)."),
    selector_top_k: int = typer.Option(None, help="DFlash2: unary candidates the selector reranks (default: 16)."),
    sliding_window_non_causal: bool = typer.Option(
        None, "--sliding-window-non-causal/--sliding-window-causal",
        help="Sliding layers see their whole block (default: dflash2 yes, dflash no)."),
    markov_rank: int = typer.Option(None, help="DSpark: rank of the Markov logit bias, 0 for none (default: 256)."),
    markov_head_type: str = typer.Option(None, help="DSpark: vanilla, gated or rnn Markov head (default: vanilla)."),
    enable_confidence_head: bool = typer.Option(None, "--confidence-head/--no-confidence-head",
                                                help="DSpark: the per-slot confidence head (default: on)."),
    confidence_head_with_markov: bool = typer.Option(
        None, "--confidence-head-with-markov/--confidence-head-without-markov",
        help="DSpark: the confidence head also reads the Markov embedding (default: on)."),
    xpress_rank: int = typer.Option(None, help="XPress: rank of the causal refiner (default: 256)."),
    xpress_mlp_ratio: int = typer.Option(None, help="XPress: refiner MLP width over its rank (default: 2)."),
    num_jacobi_passes: int = typer.Option(None, help="XPress: Jacobi passes at inference, stored with the drafter "
                                                     "(default: 6)."),
    **knobs,  # one option per recipe knob, generated from impl/recipe.py (train_options.with_knob_options)
) -> None:
    from transformers.utils import logging as hf_logging

    from impl.data import DataError
    from impl.train import RunConfig, TrainError
    from impl.train import train as run_training

    check_train_paths(target, data, eval_data, out, json_out, resume, force)
    if d2t is not None:
        regular_file(d2t, "file", "--d2t")
    if draft_vocab_size is not None and draft_vocab_size <= 0:
        raise AuditError(f"--draft-vocab-size must be a positive number of tokens, got {draft_vocab_size}")
    check_finite_flags(lr=lr, max_seconds=max_seconds,
                       **{name: value for name, value in knobs.items() if KNOBS[name].annotation is float})
    heads = dict(markov_rank=markov_rank, markov_head_type=markov_head_type,
                 enable_confidence_head=enable_confidence_head,
                 confidence_head_with_markov=confidence_head_with_markov, xpress_rank=xpress_rank,
                 xpress_mlp_ratio=xpress_mlp_ratio, num_jacobi_passes=num_jacobi_passes)
    check_family_flags(family, dict(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                                    selector_rank=selector_rank, selector_top_k=selector_top_k, **heads, **knobs))
    if dtype not in ("fp32", "bf16"):
        raise AuditError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    # The recipe knobs are checked once, by the recipe type, when the run starts (impl.train.check_run).
    settings = recipe_settings(recipe, family, dict(
        conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size, selector_rank=selector_rank,
        selector_top_k=selector_top_k, sliding_window_non_causal=sliding_window_non_causal, block_size=block_size,
        draft_layers=draft_layers, **heads, **knobs))
    cfg = RunConfig(
        target=str(target), out=str(out), data=str(data), eval_data=str(eval_data) if eval_data else None,
        eval_sequences=eval_sequences, steps=steps, lr=lr, warmup=warmup, batch_size=batch_size,
        grad_accum=grad_accum, seq_len=seq_len, target_layer_ids=_layer_ids(target_layer_ids, "--target-layer-ids"),
        layer_types=_layer_types(layer_types),
        sliding_window=sliding_window, mask_token_id=mask_token_id, draft_vocab_size=draft_vocab_size,
        d2t=str(d2t) if d2t is not None else None, dtype=dtype, eval_every=eval_every,
        save_every=save_every, resume=resume, seed=seed, max_seconds=max_seconds, family=family, **settings)
    hf_logging.disable_progress_bar()  # one progress bar: the trainer's
    try:
        stats = run_training(cfg)
    except (DataError, TrainError) as exc:
        raise AuditError(str(exc)) from exc
    if stats["rank"] == 0:  # under torchrun only rank 0 reports
        report_run(stats, json_out)


def check_family_flags(family: str, given: dict) -> None:
    """--family names one of the families; a family's own flag (its drafter's shape, its loss knobs) needs it."""
    if family not in TRAINED_FAMILIES:
        raise AuditError(f"--family must be one of {', '.join(TRAINED_FAMILIES)}, got {family!r}")
    for name, value in given.items():
        owner = flag_family(name)
        if value is not None and owner not in (None, family):
            raise AuditError(f"--{name.replace('_', '-')} is a {TITLES[owner]} setting; add --family {owner}")


def flag_family(name: str) -> str | None:
    """The family a train setting belongs to: a drafter field of one family, or a recipe knob declared for one."""
    if name in KNOBS:
        return KNOBS[name].json_schema_extra["family"]
    return next((family for family, names in FAMILY_FIELDS.items() if name in names), None)


def recipe_settings(recipe: str | None, family: str, given: dict) -> dict:
    """The TrainConfig knobs: `--recipe speculators`'s whole resolution, then every flag given explicitly."""
    if recipe not in (None, "speculators"):
        raise AuditError(f"--recipe must be speculators, got {recipe!r}")
    settings = {}
    if recipe == "speculators":
        from reference_adapters.speculators_recipe import train_settings

        settings = train_settings(family)
    settings.update({name: value for name, value in given.items() if value is not None})
    return settings


def _layer_types(value: str | None) -> list[str] | None:
    return [t.strip() for t in value.split(",")] if value else None


def report_run(stats: dict, json_out: Path | None) -> None:
    """The run's stats as JSON (atomically) and its one summary line."""
    if json_out is not None:
        from foundation.atomic import atomic_write_bytes

        text = json.dumps({"schema": "dflash-audit/train/1", **stats}, indent=2)
        atomic_write_bytes(json_out, lambda tmp: Path(tmp).write_text(text))
    final = stats["eval"] or stats["final"]
    typer.echo(f"trained {stats['steps']} steps in {stats['seconds']} s -> {stats['out']}  "
               f"loss {final['loss']:.4f}  EAL {final['eal']:.2f}")


def register(app: typer.Typer) -> None:
    app.command("train", help=VERBS["train"])(with_knob_options(train))
