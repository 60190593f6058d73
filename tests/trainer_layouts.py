"""Builders for the layouts training frameworks save in, each written in that framework's own layout.

- torch.distributed.checkpoint: written by torch's own `dcp.save` (single process, as FSDP2 / torchtitan
  write it, with `model` and `optimizer` entries);
- DeepSpeed: DeepSpeed is not installed here (its engine needs an accelerator to save), so its files
  are written with `torch.save` in exactly the key layout `engine.save_checkpoint` uses and
  `zero_to_fp32` reads: `module`, `buffer_names`, `param_shapes` (one ordered dict per param group),
  `frozen_param_shapes`, `shared_params`, `frozen_param_fragments`, `ds_config`, `ds_version`, client
  state at the top level; `*_optim_states.pt` with `optimizer_state_dict` holding `zero_stage`,
  `partition_count` and `single_partition_of_fp32_groups` (ZeRO-1/2) or `fp32_flat_groups` (ZeRO-3:
  each parameter padded to a multiple of the ranks and split evenly, rank r's pieces end to end);
- Megatron: `latest_checkpointed_iteration.txt` + `iter_0000100/mp_rank_00/model_optim_rng.pt`;
- NeMo: a `.nemo` tar with `model_weights.ckpt` and `model_config.yaml`;
- accelerate `save_state`: `model.safetensors`, `optimizer.bin`, `scheduler.bin`, `random_states_0.pkl`.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import io
import json
import math
import pickle
import sys
import tarfile
import types
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from drafter_files.zlab_format import save_zlab_dir
from impl.model import DFlashDrafter
from tests.helpers import tiny_spec

# z-lab convention ids, under the names each framework's configs would use.
LAYERS, TARGET_LAYERS, MASK, BLOCK, VOCAB = [1, 3, 4], 6, 127, 8, 128
HYDRA_CONFIG = {"model": {"target_layer_ids": LAYERS, "num_target_layers": TARGET_LAYERS, "mask_token_id": MASK},
                "training": {"block_size": BLOCK, "lr": 3e-4, "max_steps": 1000},
                "target": {"name_or_path": "Qwen/Qwen3-8B", "vocab_size": VOCAB},
                "loss": {"gamma": 4.0}}
HYDRA_OVERRIDES = ["loss.gamma=4.0", "training.block_size=8", "+experiment=dflash"]
DS_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
             "zero_optimization": {"stage": 3}}
CLIENT_ARGS = {"fc_layers": LAYERS, "target_num_layers": TARGET_LAYERS, "mask_id": MASK, "block_size": BLOCK,
               "vocab_size": VOCAB}
# The drafter every layout holds, and its z-lab folder as the reference (the two test files' module fixtures).
SPEC = tiny_spec(layer_types=("full_attention",) * 3, sliding_window=None)


def seeded_drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(SPEC)


@pytest.fixture(scope="module")
def drafter():
    return seeded_drafter()


@pytest.fixture(scope="session")
def fsdp2_dcp(tmp_path_factory) -> Path:
    """What an FSDP2 job of two ranks writes for the layouts' drafter, written once a session for every test that
    reads it (two spawned ranks cost seconds each); a test copies it before it changes anything."""
    from tests.helpers import once_per_session

    return Path(once_per_session(tmp_path_factory, "fsdp2-dcp", lambda: str(
        fsdp2_sharded_dcp(tmp_path_factory.mktemp("fsdp2-dcp"), seeded_drafter()))))


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory, drafter):
    path = tmp_path_factory.mktemp("ref") / "zlab"
    save_zlab_dir(path, SPEC, drafter.state_dict())
    return path


def state(drafter, prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + k: v.detach().clone() for k, v in drafter.state_dict().items()}


def adamw_state(drafter) -> dict:
    """An AdamW state after one step (moments and step count per parameter), taken on a copy."""
    import copy

    clone = copy.deepcopy(drafter)
    optimizer = torch.optim.AdamW(clone.parameters(), lr=1e-3)
    for parameter in clone.parameters():
        parameter.grad = torch.full_like(parameter, 1e-3)
    optimizer.step()
    return optimizer.state_dict()


def hydra_run(root: Path) -> Path:
    """outputs/<date>/<time>/ with the .hydra folder Hydra writes."""
    run = root / "outputs" / "2026-12-01" / "03-00-00"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(HYDRA_CONFIG))
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(HYDRA_OVERRIDES))
    (run / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"run": {"dir": "outputs/x"}}}))
    return run


# -- torch.distributed.checkpoint -------------------------------------------------------------------
def dcp_save(folder: Path, state_dict: dict) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save(state_dict, checkpoint_id=str(folder))


def dcp_folder_in_hydra_run(root: Path, drafter) -> Path:
    run = hydra_run(root)
    folder = run / "checkpoints" / "step-10"
    folder.parent.mkdir()
    dcp_save(folder, {"model": state(drafter), "optimizer": adamw_state(drafter),
                      "train_state": {"step": 10, "ntokens_seen": 40960}})
    return folder


def fsdp2_rank(rank: int, world: int, port: int, weights: dict, folder: str) -> None:
    """One rank of an FSDP2 job: shard the drafter, save model and optimizer with `dcp.save`."""
    import os
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from impl.model import DFlashDrafter
    from tests.helpers import tiny_spec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = DFlashDrafter(tiny_spec(layer_types=("full_attention",) * 3, sliding_window=None))
        model.load_state_dict(weights)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state, "args": dict(CLIENT_ARGS)},
                     checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


def fsdp2_sharded_dcp(root: Path, drafter, world: int = 2) -> Path:
    """What an FSDP2 job writes: each rank its shard of every parameter (`__0_0.distcp`, `__1_0.distcp`)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    folder = root / "fsdp2"
    mp.spawn(fsdp2_rank, args=(world, port, state(drafter), str(folder)), nprocs=world)
    return folder


def fsdp2_copy(root: Path, drafter, built: Path) -> Path:
    """The session's FSDP2 folder (`fsdp2_dcp`, of the same seeded drafter), copied into `root`."""
    import shutil

    return Path(shutil.copytree(built, root / built.name))


def torchtitan_style_dcp(root: Path, drafter) -> Path:
    """torchtitan saves the model's state dict flattened into the top level, beside its other states."""
    folder = root / "step-20"
    optimizer = {f"state.{k}": v for k, v in adamw_state(drafter)["state"].get(0, {}).items()}
    dcp_save(folder, {**state(drafter), "optimizer": {**optimizer, "param_groups.lr": 1e-3},
                      "lr_scheduler": {"base_lrs": [1e-3], "last_epoch": 20, "_step_count": 21},
                      "train_state": {"step": 20, "ntokens_seen": 81920}, "dataloader": {"world_size": 1},
                      "job_config": dict(CLIENT_ARGS)})
    return folder


def dcp_folder_with_args(root: Path, drafter) -> Path:
    folder = root / "dcp"
    dcp_save(folder, {"model": state(drafter), "ema": state(drafter), "optim": adamw_state(drafter),
                      "args": dict(CLIENT_ARGS)})
    return folder


# -- DeepSpeed ---------------------------------------------------------------------------------------
class ZeroStageEnum(int, enum.Enum):
    """DeepSpeed pickles `zero_stage` as its own enum; saved under DeepSpeed's module name."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


ZeroStageEnum.__module__ = "deepspeed.runtime.zero.config"


@contextlib.contextmanager
def deepspeed_names():
    """Lets pickle record ZeroStageEnum under DeepSpeed's module path (DeepSpeed is not installed here)."""
    names = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero", "deepspeed.runtime.zero.config"]
    assert not any(name in sys.modules for name in names)
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[names[-1]].ZeroStageEnum = ZeroStageEnum
    try:
        yield
    finally:
        for name in names:
            del sys.modules[name]


def param_groups(drafter) -> list[OrderedDict]:
    """Two groups as a weight-decay split makes them: matrices, then vectors (norms)."""
    params = OrderedDict((n, p) for n, p in drafter.named_parameters())
    return [OrderedDict((n, p) for n, p in params.items() if p.dim() > 1),
            OrderedDict((n, p) for n, p in params.items() if p.dim() <= 1)]


def ds_model_states(drafter, module: dict, extra: dict) -> dict:
    buffers = [n for n, _ in drafter.named_buffers()]
    return {"module": module, "buffer_names": buffers, "optimizer": None,
            "param_shapes": [OrderedDict((n, p.shape) for n, p in g.items()) for g in param_groups(drafter)],
            "frozen_param_shapes": OrderedDict(), "shared_params": {}, "frozen_param_fragments": {},
            "lr_scheduler": None, "data_sampler": None, "random_ltd": None, "sparse_tensor_module_names": set(),
            "skipped_steps": 0, "global_steps": 10, "global_samples": 40, "dp_world_size": extra.pop("world", 1),
            "mp_world_size": 1, "ds_config": DS_CONFIG, "ds_version": "0.16.4", **extra}


def zero2_folder(root: Path, drafter) -> Path:
    ckpt = root / "ds-zero2"
    tag = ckpt / "global_step10"
    tag.mkdir(parents=True)
    (ckpt / "latest").write_text("global_step10")
    (ckpt / "zero_to_fp32.py").write_text("# DeepSpeed's consolidation script\n")
    torch.save(ds_model_states(drafter, state(drafter), {"args": dict(CLIENT_ARGS)}),
               tag / "mp_rank_00_model_states.pt")
    flat = [torch.cat([p.detach().reshape(-1) for p in g.values()]) for g in param_groups(drafter)]
    with deepspeed_names():
        torch.save({"optimizer_state_dict": {"zero_stage": ZeroStageEnum.gradients, "partition_count": [1, 1],
                                             "loss_scaler": None, "single_partition_of_fp32_groups": flat,
                                             "optimizer_state_dict": adamw_state(drafter)},
                    "ds_config": DS_CONFIG, "ds_version": "0.16.4"},
                   tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return ckpt


def zero3_partitions(drafter, world: int) -> list[list[torch.Tensor]]:
    """Per rank, per group: that rank's even slice of each (zero-padded) parameter, end to end."""
    ranks: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for group in param_groups(drafter):
        pieces: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for p in group.values():
            flat = p.detach().reshape(-1).float()
            per_rank = math.ceil(flat.numel() / world)
            padded = torch.cat([flat, flat.new_zeros(per_rank * world - flat.numel())])
            for r in range(world):
                pieces[r].append(padded[r * per_rank:(r + 1) * per_rank])
        for r in range(world):
            ranks[r].append(torch.cat(pieces[r]))
    return ranks


def zero3_folder(root: Path, drafter, world: int = 2) -> Path:
    ckpt = root / "ds-zero3"
    tag = ckpt / "global_step10"
    tag.mkdir(parents=True)
    (ckpt / "latest").write_text("global_step10\n")
    (ckpt / "zero_to_fp32.py").write_text("# DeepSpeed's consolidation script\n")
    params = {n for n, _ in drafter.named_parameters()}
    placeholders = {k: (torch.empty(0, dtype=v.dtype) if k in params else v.clone())
                    for k, v in drafter.state_dict().items()}
    for rank, flat_groups in enumerate(zero3_partitions(drafter, world)):
        torch.save(ds_model_states(drafter, dict(placeholders), {"world": world, "args": dict(CLIENT_ARGS)}),
                   tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        with deepspeed_names():
            torch.save({"optimizer_state_dict": {"zero_stage": ZeroStageEnum.weights, "partition_count": world,
                                                 "loss_scaler": None, "fp32_flat_groups": flat_groups,
                                                 "optimizer_state_dict": {"state": {}, "param_groups": []}},
                        "ds_config": DS_CONFIG, "ds_version": "0.16.4"},
                       tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return ckpt


# -- Megatron, NeMo, accelerate ---------------------------------------------------------------------
def megatron_folder(root: Path, drafter) -> Path:
    ckpt = root / "megatron"
    rank = ckpt / "iter_0000100" / "mp_rank_00"
    rank.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("100")
    args = argparse.Namespace(**CLIENT_ARGS, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              micro_batch_size=4, lr=3e-4, seq_length=512, iteration=100)
    torch.save({"model": state(drafter), "optimizer": {"optimizer": adamw_state(drafter), "fp32_from_fp16_params": []},
                "opt_param_scheduler": {"max_lr": 3e-4, "min_lr": 0.0, "num_steps": 400},
                "rng_state": [{"random_rng_state": (3, (1, 2), None), "torch_rng_state": torch.get_rng_state()}],
                "args": args, "checkpoint_version": 3.0, "iteration": 100}, rank / "model_optim_rng.pt")
    return ckpt


def megatron_torch_dist_folder(root: Path, drafter) -> Path:
    """Megatron's torch_dist format: a DCP iteration folder with `common.pt` and `metadata.json`."""
    ckpt = root / "megatron-dist"
    iteration = ckpt / "iter_0000200"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("200")
    dcp_save(iteration, {"model": state(drafter), "optimizer": adamw_state(drafter)})
    args = argparse.Namespace(**CLIENT_ARGS, tensor_model_parallel_size=1, ckpt_format="torch_dist")
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 200, "rng_state": [torch.get_rng_state()]},
               iteration / "common.pt")
    write_json(iteration / "metadata.json", {"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    return ckpt


def add_member(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def nemo_archive(root: Path, drafter, weights_name: str = "model_weights.ckpt") -> Path:
    buffer = io.BytesIO()
    torch.save(state(drafter), buffer)
    config = {"target": "nemo.collections.llm.DFlashDrafter", "target_layer_ids": LAYERS,
              "num_target_layers": TARGET_LAYERS, "mask_token_id": MASK, "block_size": BLOCK, "vocab_size": VOCAB,
              "optim": {"name": "adamw", "lr": 3e-4}}
    path = root / "drafter.nemo"
    with tarfile.open(path, "w:") as archive:
        add_member(archive, f"./{weights_name}", buffer.getvalue())
        add_member(archive, "./model_config.yaml", yaml.safe_dump(config).encode())
    return path


class Canary:
    """Pickled into random_states_0.pkl: unpickling the file would create `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def accelerate_folder_in_hydra_run(root: Path, drafter) -> Path:
    run = hydra_run(root)
    folder = run / "checkpoints" / "checkpoint_3"
    folder.mkdir(parents=True)
    save_file(state(drafter), str(folder / "model.safetensors"), metadata={"format": "pt"})
    torch.save(adamw_state(drafter), folder / "optimizer.bin")
    torch.save({"base_lrs": [1e-3], "last_epoch": 3, "_step_count": 4}, folder / "scheduler.bin")
    with open(folder / "random_states_0.pkl", "wb") as handle:
        pickle.dump({"step": 3, "canary": Canary(str(root / "canary"))}, handle)
    return folder


def lightning_run_with_hparams_yaml(root: Path, drafter) -> Path:
    version = root / "lightning_logs" / "version_0"
    (version / "checkpoints").mkdir(parents=True)
    (version / "hparams.yaml").write_text(yaml.safe_dump({"model": {"target_layers": LAYERS,
                                                                     "num_target_layers": TARGET_LAYERS},
                                                           "data": {"mask_token_id": MASK, "block_size": BLOCK,
                                                                    "vocab_size": VOCAB}}))
    path = version / "checkpoints" / "epoch=3-step=10.ckpt"
    torch.save({"state_dict": state(drafter, "model."), "optimizer_states": [adamw_state(drafter)],
                "epoch": 3, "global_step": 10, "pytorch-lightning_version": "2.4.0"}, path)
    return path


# name -> (builder, extra CLI flags, provenance detail of target_layer_ids)
TRAINER_GALLERY = {
    "torch.distributed.checkpoint folder in a Hydra run": (
        dcp_folder_in_hydra_run, [], "../../.hydra/config.yaml: model.target_layer_ids"),
    "FSDP2 sharded over 2 ranks (torch.distributed.checkpoint)": (fsdp2_copy, [], "fsdp2: args.fc_layers"),
    "torchtitan-style DCP (model at the top level)": (torchtitan_style_dcp, [], "step-20: job_config.fc_layers"),
    "torch.distributed.checkpoint, --ours-entry ema": (dcp_folder_with_args, ["--ours-entry", "ema"],
                                                       "dcp: args.fc_layers"),
    "DeepSpeed ZeRO-2 folder (latest)": (zero2_folder, [], "ds-zero2: args.fc_layers"),
    "DeepSpeed ZeRO-3 folder, 2 ranks (latest)": (zero3_folder, [], "ds-zero3: args.fc_layers"),
    "Megatron iter_*/mp_rank_00 (latest_checkpointed_iteration.txt)": (megatron_folder, [],
                                                                        "megatron: args.fc_layers"),
    "Megatron torch_dist (DCP + common.pt)": (megatron_torch_dist_folder, [], "common.pt: args.fc_layers"),
    "NeMo .nemo archive": (nemo_archive, [], "drafter.nemo: model_config.yaml: target_layer_ids"),
    "accelerate save_state folder in a Hydra run": (accelerate_folder_in_hydra_run, [],
                                                    "../../.hydra/config.yaml: model.target_layer_ids"),
    "Lightning checkpoints/ + hparams.yaml": (lightning_run_with_hparams_yaml, [],
                                              "../hparams.yaml: model.target_layers"),
}


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data))
