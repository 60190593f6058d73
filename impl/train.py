"""Our online DFlash trainer: the target runs in-process (no grad) and feeds the drafter.

AdamW, linear warmup then cosine decay (or, `--recipe speculators`, speculators' run: Muon on the 2-D weight
matrices and AdamW on the rest, linear warmup over 1% of the steps then linear decay to 0), gradient clipping,
gradient accumulation, fp32 or
bf16 (autocast: fp32 master weights and optimizer state, bf16 matmuls), periodic
evaluation on held-out rows, atomic `ckpt.pt` checkpoints that resume the same run.

Under `torchrun` the same call runs DDP (gloo on CPU, nccl on GPU): each micro-batch of
`batch_size` rows is split across ranks, and only rank 0 writes checkpoints or progress.
Every random draw that shapes a step (which rows, which anchors, which noise) comes from
a generator seeded by (seed, step, global row), so a resumed run and a sharded run see
exactly what the uninterrupted single-process run saw.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from foundation.target import load_target_model, load_tokenizer
from foundation.ckpt_file import read_ckpt, write_ckpt
from foundation.errors import CheckpointError
from impl.data import PackedData, load_packed, pack_records
from impl.extract import output_head
from impl.layers import build_target_layer_ids, final_layer
from impl.model import DFlashDrafter
from impl.recipe import RECIPE_FIELDS, Recipe, train_defaults
from impl.run_settings import RunSettings, SettingRefused, TrainError
from impl.spec import FAMILY_FIELDS, DraftSpec, SpecError
from impl.train_step import training_step
from impl.vocab_mapping import MappingError, check_mapping, count_token_frequencies, mapping_from_frequencies
from impl.rotary_config import rotary_settings

MASK_TOKEN = "<|mask|>"
MIN_LR_RATIO = 0.1  # cosine decays to this fraction of the peak learning rate


# -- setup ---------------------------------------------------------------------------------
def resolve_mask_token(tokenizer, override: int | None) -> int:
    if override is not None:
        return override
    token_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise TrainError(f"the tokenizer has no {MASK_TOKEN} token; pass --mask-token-id")
    return int(token_id)


def draft_spec(config, tokenizer, cfg: RunSettings, draft_vocab_size: int | None = None,
               sample_from_anchor: bool | None = None) -> DraftSpec:
    """The drafter's spec: sizes from the target's config (hidden sizes must match), the rest from cfg (the slot
    layout: the run's recipe's)."""
    num_layers = config.num_hidden_layers
    ids = cfg.target_layer_ids if cfg.target_layer_ids is not None else build_target_layer_ids(num_layers, cfg.draft_layers)
    if len(set(ids)) != len(ids) and cfg.target_layer_ids is None:
        raise TrainError(f"z-lab's default target layers for {num_layers} target layers and {cfg.draft_layers} "
                         f"draft layers repeat ({ids}); pass --target-layer-ids")
    # speculators' trainer copies the verifier's rope_parameters (theta, scaling) into the draft config and drops
    # partial_rotary_factor (train/cli.py create_transformer_layer_config): every head dim is rotated.
    rotary = rotary_settings(config.to_dict())
    own = {name: getattr(cfg, name) for name in FAMILY_FIELDS[cfg.family]}
    non_causal = cfg.sliding_window_non_causal
    if sample_from_anchor is None:
        sample_from_anchor = knob_recipe(cfg).sample_from_anchor
    return DraftSpec(
        **own,
        sliding_window_non_causal=cfg.family == "dflash2" if non_causal is None else non_causal,
        sample_from_anchor=sample_from_anchor,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        num_hidden_layers=cfg.draft_layers,
        target_vocab_size=config.vocab_size,
        target_layer_ids=tuple(ids),
        num_target_layers=num_layers,
        mask_token_id=resolve_mask_token(tokenizer, cfg.mask_token_id),
        block_size=cfg.block_size,
        layer_types=tuple(cfg.layer_types or ()),
        sliding_window=cfg.sliding_window,
        rope_theta=rotary["rope_theta"],
        rope_scaling=rotary["rope_scaling"],
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        draft_vocab_size=draft_vocab_size,
    )


def vocab_mapping(cfg: RunSettings, data: PackedData, target_vocab_size: int) -> torch.Tensor | None:
    """The run's d2t: read from `cfg.d2t`, else built from the training data's token frequencies; None
    without a reduced draft vocabulary."""
    if cfg.d2t is not None:
        d2t = read_d2t(Path(cfg.d2t))
        size = cfg.draft_vocab_size if cfg.draft_vocab_size is not None else d2t.numel()
        try:
            check_mapping(d2t, size, target_vocab_size, f"--d2t {cfg.d2t}")
        except MappingError as exc:
            raise TrainError(str(exc)) from None
        return d2t
    if cfg.draft_vocab_size is None or cfg.draft_vocab_size == target_vocab_size:
        return None
    if cfg.draft_vocab_size > target_vocab_size:  # its lower bound is its declaration's; this one the target's
        raise TrainError(f"--draft-vocab-size {cfg.draft_vocab_size}: larger than the target's vocabulary of "
                         f"{target_vocab_size} tokens")
    freq = count_token_frequencies(zip(data.input_ids, data.loss_mask))
    return mapping_from_frequencies(freq, cfg.draft_vocab_size, target_vocab_size)


def read_d2t(path: Path) -> torch.Tensor:
    """A d2t .npy file (integer offsets, one per draft id), read without pickles."""
    import numpy as np

    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise TrainError(f"--d2t {path}: not a readable .npy array ({' '.join(str(exc).split())[:160]})") from None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TrainError(f"--d2t {path}: expected a 1-D integer array of offsets, got {array.dtype} of shape "
                         f"{list(array.shape)}")
    return torch.from_numpy(array.astype(np.int64))


def knob_recipe(cfg: RunSettings, num_target_layers: int | None = None) -> Recipe:
    """The recipe of `cfg`'s knobs, checked by the recipe type's own rules (its declared bounds and
    `check_trainable`): the one place a knob is validated, in speculators' names."""
    defaults = train_defaults(cfg.family)
    given = {name: getattr(cfg, name) for name in RECIPE_FIELDS}
    try:
        recipe = Recipe(**{name: defaults[name] if value is None else value for name, value in given.items()})
        recipe.check_trainable(num_target_layers)
    except SpecError as exc:
        raise SettingRefused.of(exc) from None
    return recipe


def make_recipe(cfg: RunSettings, num_target_layers: int, digest: str) -> Recipe:
    recipe = knob_recipe(cfg, num_target_layers)
    # None is the reference recipe (the final layer); any other layer is recorded as given.
    source = None if recipe.verifier_source_layer == final_layer(num_target_layers) else recipe.verifier_source_layer
    schedule = {k: getattr(cfg, k) for k in ("steps", "lr", "warmup", "weight_decay", "grad_clip", "batch_size",
                                             "grad_accum", "seq_len", "dtype", "seed")}
    if cfg.optimizer != "adamw" or cfg.lr_schedule != "cosine":  # an AdamW-cosine run's record is as it always was
        schedule.update({k: getattr(cfg, k) for k in ("optimizer", "lr_schedule", "muon_lr", "muon_momentum",
                                                      "muon_weight_decay", "muon_adjust_lr_fn")},
                        adam_betas=list(cfg.adam_betas))
    return recipe.replace(verifier_source_layer=source, data_hash=digest, extra={**schedule, **cfg.extra})


def load_data(cfg: RunSettings, tokenizer, vocab_size: int) -> tuple[PackedData, PackedData | None]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    if cfg.records is not None:
        data = pack_records(cfg.records, tokenizer, vocab_size, cfg.seq_len, pad)
    elif cfg.data is not None:
        data = load_packed(cfg.data, tokenizer, vocab_size, cfg.seq_len, pad)
    else:
        raise TrainError("no training data given")
    if cfg.eval_data is not None:
        return data, load_packed(cfg.eval_data, tokenizer, vocab_size, cfg.seq_len, pad)
    if cfg.eval_sequences > 0 and len(data) > cfg.eval_sequences:
        split = len(data) - cfg.eval_sequences
        return data.rows(slice(0, split)), data.rows(slice(split, None))
    return data, None


# -- determinism ---------------------------------------------------------------------------
def row_generator(seed: int, *stream: int, device="cpu") -> torch.Generator:
    """A generator for one (step, row): independent of ranks, batch order or resumption."""
    mixed = seed
    for value in stream:
        mixed = (mixed * 1_000_003 + value + 1) % (2**63 - 1)
    return torch.Generator(device=device).manual_seed(mixed)


class RowSampler:
    """Global sample k -> a packed row: a fresh permutation of the rows every epoch."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows, self.seed, self._perms = num_rows, seed, {}

    def __call__(self, sample: int) -> int:
        epoch, offset = divmod(sample, self.num_rows)
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.num_rows, generator=row_generator(self.seed, -1, epoch))}
        return int(self._perms[epoch][offset])


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup to the peak, then cosine decay to MIN_LR_RATIO of it at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def linear_factor(step: int, warmup: int, total: int) -> float:
    """Warmup from 0 (step / warmup), then linear decay to 0 at `total`: the schedule speculators' trainer runs
    (transformers' get_linear_schedule_with_warmup; conformance holds the two equal)."""
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def warmup_steps(cfg: RunSettings, total: int) -> int:
    """--warmup, or none given: speculators' rule, 1% of the total (total // 100)."""
    return cfg.warmup if cfg.warmup is not None else total // 100


def muon_split(drafter: torch.nn.Module, vocab_size: int) -> tuple[list, list]:
    """(Muon's parameters, AdamW's): Muon takes the trainable 2-D weight matrices of linear layers, except a
    vocabulary-wide one (a head: as wide as the vocabulary, which no drafter layer is) and vectors ([1, N]); AdamW the
    rest (norms, biases, embeddings, heads), as speculators' split_named_params_for_muon does by name
    (tests/test_trace_run.py holds the two equal on our drafter)."""
    matrices, rest = [], []
    for module in drafter.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            matrix = isinstance(module, torch.nn.Linear) and name == "weight" and p.dim() == 2 and \
                min(p.shape) > 1 and vocab_size not in p.shape
            (matrices if matrix else rest).append(p)
    return matrices, rest


class Stepped:
    """The run's optimizers (or their schedulers) stepped together; one is saved as itself (the checkpoints of
    the AdamW runs keep their format), several as a list."""

    def __init__(self, parts: list):
        self.parts = parts

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.parts[0].state_dict() if len(self.parts) == 1 else {"parts": [p.state_dict() for p in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        states = state["parts"] if len(self.parts) > 1 and "parts" in state else [state]
        if len(states) != len(self.parts):
            raise TrainError(f"cannot resume: the checkpoint holds {len(states)} optimizer states, this run has "
                             f"{len(self.parts)}")
        for part, part_state in zip(self.parts, states):
            part.load_state_dict(part_state)


def make_optimizers(cfg: RunSettings, drafter: torch.nn.Module, vocab_size: int, schedule: dict) -> tuple:
    """(optimizers, schedulers): AdamW on everything, or Muon + AdamW; each with the run's schedule."""
    if cfg.optimizer == "muon":
        matrices, rest = muon_split(drafter, vocab_size)
        parts = [torch.optim.Muon(matrices, lr=cfg.muon_lr or cfg.lr, momentum=cfg.muon_momentum,
                                  weight_decay=cfg.muon_weight_decay, adjust_lr_fn=cfg.muon_adjust_lr_fn)] \
            if matrices else []
        if rest:
            parts.append(torch.optim.AdamW(rest, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.adam_betas))
    else:
        parts = [torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                   betas=cfg.adam_betas)]
    factor = linear_factor if cfg.lr_schedule == "linear" else lr_factor
    schedulers = [torch.optim.lr_scheduler.LambdaLR(
        o, lambda step: factor(step, warmup_steps(cfg, schedule["total"]), schedule["total"])) for o in parts]
    return Stepped(parts), Stepped(schedulers)


# -- distributed ---------------------------------------------------------------------------
def init_distributed() -> tuple[int, int, bool]:
    """(rank, world size, whether we started the process group) from torchrun's environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        return dist.get_rank(), world, True
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    return 0, 1, False


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def mean_over_ranks(values: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(values)
        values = values / world
    return values


# -- evaluation ----------------------------------------------------------------------------
@torch.no_grad()
def evaluate(drafter: DFlashDrafter, target, data: PackedData, recipe: Recipe, batch_size: int, seed: int,
             autocast) -> dict:
    """Loss, per-position accuracy and EAL over held-out rows (fixed anchors across evals)."""
    device = next(drafter.parameters()).device
    block, first = drafter.block_size, drafter.spec.first_proposing_slot
    loss_sum = run_sum = blocks = 0.0
    hits = torch.zeros(drafter.spec.speculative_tokens, device=device)  # one per proposing slot
    counts = torch.zeros(drafter.spec.speculative_tokens, device=device)
    for start in range(0, len(data), batch_size):
        rows = data.rows(slice(start, start + batch_size))
        generators = [row_generator(seed, -2, start + i, device=device) for i in range(len(rows))]
        with autocast():
            out = training_step(drafter, target, rows.input_ids.to(device), rows.loss_mask.to(device),
                                rows.document_ids.to(device), recipe, position_ids=rows.position_ids.to(device),
                                generators=generators)
        loss_sum += out.loss.item() * len(rows)
        hits += out.metrics["position_acc"] * out.metrics["position_count"]
        counts += out.metrics["position_count"]
        trained_blocks = out.outputs.loss_mask.reshape(-1, block)[:, first:].bool().any(1).sum().item()
        run_sum += out.metrics["eal"].item() * trained_blocks
        blocks += trained_blocks
    return {"loss": loss_sum / len(data), "position_acc": (hits / counts.clamp(min=1)).tolist(),
            "eal": run_sum / max(blocks, 1)}


# -- the run -------------------------------------------------------------------------------
def _training_state(optimizer, scheduler, history, evals) -> dict:
    return {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(), "history": list(history), "evals": list(evals)}


def train(cfg: RunSettings) -> dict:
    """Run (or resume) training; returns stats. Every rank calls it; rank 0 writes."""
    rank, world, owns_group = init_distributed()
    try:
        return _train(cfg, rank, world)
    finally:
        if owns_group:
            dist.destroy_process_group()


def check_run(cfg: RunSettings, world: int) -> None:
    """Every setting that needs no file: before the tokenizer, the data or the (possibly large) target is read."""
    # Each setting's own kind and range is its declaration's, checked when the run settings were made.
    if cfg.batch_size % world:
        raise TrainError(f"batch size {cfg.batch_size} does not split across {world} ranks")
    knob_recipe(cfg)


@dataclass
class Run:
    """What a run trains with, once set up."""
    spec: DraftSpec
    recipe: Recipe
    train_data: PackedData
    eval_data: PackedData | None
    target: torch.nn.Module
    drafter: DFlashDrafter
    optimizer: Stepped  # AdamW, or Muon + AdamW
    scheduler: Stepped  # one LambdaLR per optimizer
    schedule: dict  # {"total": steps}; a time budget may shrink it
    device: torch.device


def set_up(cfg: RunSettings, device: torch.device) -> Run:
    """Data and knobs first (one-line errors before the target is loaded), then target, drafter, optimizer."""
    tokenizer, target_config = load_tokenizer(cfg.target)
    longest = getattr(target_config, "max_position_embeddings", None)
    if isinstance(longest, int) and cfg.seq_len > longest:  # a huge row would only fail in the allocator
        raise SettingRefused("seq_len", f"{cfg.seq_len} is longer than the target's context window "
                             f"(max_position_embeddings {longest} in {cfg.target}/config.json)")
    train_data, eval_data = load_data(cfg, tokenizer, target_config.vocab_size)
    d2t = vocab_mapping(cfg, train_data, target_config.vocab_size)
    try:
        spec = draft_spec(target_config, tokenizer, cfg, None if d2t is None else d2t.numel())
    except SpecError as exc:
        raise SettingRefused.of(exc) from None
    recipe = make_recipe(cfg, spec.num_target_layers, train_data.data_hash)
    target = load_target_model(cfg.target).to(device)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(spec).to(device)
    if d2t is not None:  # its head: the target head's rows of the mapped ids, frozen (speculators)
        drafter.set_vocab_mapping(d2t.to(device), output_head(target))
    schedule = {"total": cfg.steps}
    optimizer, scheduler = make_optimizers(cfg, drafter, target_config.vocab_size, schedule)
    return Run(spec, recipe, train_data, eval_data, target, drafter, optimizer, scheduler, schedule, device)


def autocast_for(cfg: RunSettings, device: torch.device):
    """A context factory: bf16 autocast (fp32 master weights) or nothing."""
    def autocast():
        if cfg.dtype == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()
    return autocast


def optimizer_step(cfg: RunSettings, run: Run, model, sampler: RowSampler, step: int, rank: int, world: int,
                   autocast) -> dict:
    """One optimizer step over `grad_accum` micro-batches; the step's loss, EAL and per-position accuracy,
    averaged over ranks."""
    run.drafter.train()
    per_rank, device = cfg.batch_size // world, run.device
    logged = torch.zeros(2 + run.spec.speculative_tokens, device=device)  # loss, EAL, accuracy per proposing slot
    for micro in range(cfg.grad_accum):
        base = (step * cfg.grad_accum + micro) * cfg.batch_size + rank * per_rank
        samples = list(range(base, base + per_rank))
        rows = run.train_data.rows([sampler(s) for s in samples])
        generators = [row_generator(cfg.seed, step, s, device=device) for s in samples]
        sync = model.no_sync() if world > 1 and micro < cfg.grad_accum - 1 else contextlib.nullcontext()
        with sync, autocast():
            out = training_step(run.drafter, run.target, rows.input_ids.to(device), rows.loss_mask.to(device),
                                rows.document_ids.to(device), run.recipe,
                                position_ids=rows.position_ids.to(device), generators=generators, forward=model)
            (out.loss / cfg.grad_accum).backward()
        logged += torch.cat([out.loss.detach().float()[None], out.metrics["eal"].float()[None],
                             out.metrics["position_acc"].float()]) / cfg.grad_accum
    torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), cfg.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    logged = mean_over_ranks(logged, world)
    return {"loss": logged[0].item(), "eal": logged[1].item(), "position_acc": logged[2:].tolist()}


def progress_bar(cfg: RunSettings, rank: int) -> Progress:
    return Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                    TextColumn("acc {task.fields[acc]}"), TextColumn("EAL {task.fields[eal]}"), TimeElapsedColumn(),
                    disable=not (cfg.progress and rank == 0))


def _train(cfg: RunSettings, rank: int, world: int) -> dict:
    check_run(cfg, world)
    started = time.monotonic()
    run = set_up(cfg, device_for_rank())
    step, history, evals = 0, [], []
    out_path = Path(cfg.out)
    if cfg.resume and out_path.exists():
        step, history, evals = _resume(out_path, run.drafter, run.optimizer, run.scheduler, run.spec, run.recipe)
    model = run.drafter
    if world > 1:
        device_ids = [run.device.index] if run.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(run.drafter, device_ids=device_ids)
    autocast = autocast_for(cfg, run.device)
    sampler = RowSampler(len(run.train_data), cfg.seed)
    first_step, loop_started = step, time.monotonic()
    bar = progress_bar(cfg, rank)
    last = {}
    with bar:
        task = bar.add_task("train", total=run.schedule["total"], completed=step, loss="-", acc="-", eal="-")
        while step < run.schedule["total"] and step != cfg.stop_at:
            last = optimizer_step(cfg, run, model, sampler, step, rank, world, autocast)
            step += 1
            history.append(last["loss"])
            if cfg.max_seconds and step - first_step == 3:
                run.schedule["total"] = _fit_budget(cfg, step, first_step, loop_started, started, world)
                run.recipe.extra["steps"] = run.schedule["total"]
                bar.update(task, total=run.schedule["total"])
            bar.update(task, completed=step, loss=f"{last['loss']:.3f}", eal=f"{last['eal']:.2f}",
                       acc=" ".join(f"{a:.2f}" for a in last["position_acc"][:4]))
            done = step >= run.schedule["total"] or step == cfg.stop_at
            if rank == 0 and run.eval_data is not None and (done or (cfg.eval_every and step % cfg.eval_every == 0)):
                evals.append(_evaluate_now(cfg, run, step, autocast, bar))
            if rank == 0 and (done or (cfg.save_every and step % cfg.save_every == 0)):
                write_ckpt(out_path, run.spec.to_dict(), {k: v.detach().cpu() for k, v in run.drafter.state_dict().items()},
                           run.recipe.to_dict(), step,
                           training_state=_training_state(run.optimizer, run.scheduler, history, evals))
    if world > 1:
        dist.barrier()
    return {"out": str(out_path), "steps": step, "seconds": round(time.monotonic() - started, 1),
            "losses": history, "final": last, "eval": evals[-1] if evals else None, "evals": evals,
            "spec": run.spec.to_dict(), "recipe": run.recipe.to_dict(), "rows": len(run.train_data),
            "world_size": world, "rank": rank}


def _evaluate_now(cfg: RunSettings, run: Run, step: int, autocast, bar: Progress) -> dict:
    """Held-out loss, EAL and accuracy at `step` (rank 0), printed under the progress bar."""
    result = {"step": step, **evaluate(run.drafter, run.target, run.eval_data, run.recipe, cfg.batch_size, cfg.seed,
                                       autocast)}
    if cfg.progress:
        bar.console.print(f"eval @ {step}: loss {result['loss']:.3f}  EAL {result['eal']:.2f}  "
                          f"acc {' '.join(f'{a:.2f}' for a in result['position_acc'][:4])}")
    return result


def _fit_budget(cfg: RunSettings, step: int, first_step: int, loop_started: float, started: float, world: int) -> int:
    """Total steps that fit the time budget, from the first steps' pace (rank 0 decides)."""
    per_step = (time.monotonic() - loop_started) / (step - first_step)
    remaining = cfg.max_seconds - (time.monotonic() - started)
    total = torch.tensor([max(step, min(cfg.steps, step + int(remaining / per_step)))])
    if world > 1:
        dist.broadcast(total, src=0)
    return int(total)


def _resume(path: Path, drafter, optimizer, scheduler, spec: DraftSpec, recipe: Recipe):
    ckpt = read_ckpt(path)
    try:
        written, trained = DraftSpec.from_dict(ckpt.spec), Recipe.from_dict(ckpt.recipe) if ckpt.recipe else None
    except SpecError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if written != spec:
        raise TrainError(f"{path}: cannot resume, its drafter spec differs from this run's")
    if trained is None or trained.data_hash != recipe.data_hash:
        raise TrainError(f"{path}: cannot resume, it was trained on different data (data hash differs)")
    if ckpt.training_state is None:
        raise TrainError(f"{path}: cannot resume, the checkpoint has no optimizer state")
    drafter.load_state_dict(ckpt.model)
    state = ckpt.training_state
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return ckpt.step, list(state.get("history", [])), list(state.get("evals", []))


def train_drafter(target_dir: str | Path, texts_or_data, out_path: str | Path, **config) -> dict:
    """Train a drafter without a subprocess: `texts_or_data` is a list of texts, a list of
    records (`{"text"}`, `{"input_ids"}`, `{"messages"}`) or a JSON-lines path. `config`
    takes any `RunSettings` field, e.g. `max_seconds=120`."""
    if isinstance(texts_or_data, (str, Path)):
        cfg = RunSettings(target=str(target_dir), out=str(out_path), data=str(texts_or_data), **config)
    else:
        records = [{"text": item} if isinstance(item, str) else item for item in texts_or_data]
        cfg = RunSettings(target=str(target_dir), out=str(out_path), records=records, **config)
    return train(cfg)
