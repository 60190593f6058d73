"""NVIDIA Model-Optimizer 0.47.0 (`nvidia-modelopt`) behind `impl/interface.py`, held to the references
(`pytest conformance --impl modelopt`) in a process of its own.

Why out of process: its DFlash drafter cannot run on the suite's transformers 5.19. `DFlashModule` builds its
rotary embedding on the first forward as `Qwen3RotaryEmbedding(config=..., device=...)`
(`modelopt/torch/speculative/plugins/modeling_dflash.py:388`); transformers 5.19's `Qwen3RotaryEmbedding.__init__`
takes `config` alone, so every drafter forward raises "TypeError: Qwen3RotaryEmbedding.__init__() got an
unexpected keyword argument 'device'". Its `[hf]` extra asks for transformers < 5.15. `make setup` therefore
gives it an environment of its own, `.venv/modelopt-env`: transformers 5.14.1 (whose rotary takes `device`) and
tokenizers 0.22.2 in its own site-packages, everything else (torch, nvidia-modelopt, this repository's packages)
shared with the suite's venv through a .pth file. Nothing of Model-Optimizer is patched.

This module is the plug: each operation is sent to `held.modelopt_worker` running under that environment's
interpreter (held/process_wire.py frames: data only), which calls Model-Optimizer's own code
(held/modelopt_ops.py). A target goes over once (config and weights); a drafter stays in the worker and is
named by a handle here.
"""

from __future__ import annotations

import atexit
import itertools
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from held import process_wire as wire
from impl.interface import Unsupported
from foundation.cache_dir import cache_root
from foundation.packages import PINNED, installed_version

VERSION = PINNED["modelopt"]
REPO = Path(__file__).resolve().parents[1]
# Its own environment, beside the suite's venv (`make setup`); DFLASH_AUDIT_MODELOPT_PYTHON names another.
ENV_PYTHON = Path(os.environ.get("DFLASH_AUDIT_MODELOPT_PYTHON", Path(sys.prefix) / "modelopt-env" / "bin" / "python"))
ENV_TRANSFORMERS = "5.14.1"


class HeldProcessError(RuntimeError):
    """An error Model-Optimizer raised in its process, re-raised here under its own name and message."""


class RemoteDrafter:
    """A drafter built and held by the worker; released there when this handle goes."""

    def __init__(self, worker: Worker, key: int):
        self.worker, self.key = worker, key
        weakref.finalize(self, worker.release, key)

    def to(self, dtype: torch.dtype) -> RemoteDrafter:
        self.worker.request({"op": "drafter_to", "key": self.key, "dtype": dtype})
        return self


class Worker:
    """One worker process for the session; requests are sent one at a time."""

    def __init__(self):
        if not ENV_PYTHON.exists():
            raise ImportError(f"held.modelopt runs Model-Optimizer under {ENV_PYTHON} (transformers "
                              f"{ENV_TRANSFORMERS}); it is missing: `make setup` makes it")
        # Importing Model-Optimizer makes torch inductor's cache folder (`torchinductor_<user>` in the temp dir,
        # left there): it is a cache, kept in the tool's own cache root unless the caller names another.
        inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(cache_root() / "modelopt-torchinductor")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TORCHINDUCTOR_CACHE_DIR": inductor}
        self.process = subprocess.Popen([str(ENV_PYTHON), "-m", "held.modelopt_worker"], cwd=REPO, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()
        self.keys = itertools.count(1)
        self.targets: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        self.released: list[int] = []
        atexit.register(self.close)

    def release(self, key: int) -> None:
        self.released.append(key)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)

    def _special(self, value: Any):
        if isinstance(value, RemoteDrafter):
            return wire.tagged("drafter", key=value.key)
        if isinstance(value, nn.Module):
            if value in self.targets:
                return wire.tagged("target", key=self.targets[value])
            key = self.targets[value] = next(self.keys)
            config = value.config.to_dict()
            return wire.tagged("target", key=key, config=config, state=value.state_dict(),
                               dtype=next(value.parameters()).dtype)
        return None

    def request(self, message: dict) -> Any:
        with self.lock:
            message["release"], self.released = self.released, []
            wire.write_frame(self.process.stdin, message)
            reply = wire.read_frame(self.process.stdout)
        if "unsupported" in reply:
            raise Unsupported(reply["unsupported"])
        if "error" in reply:
            raise HeldProcessError(f"{reply['error']}: {reply['message']}")
        return reply["ok"]

    def call(self, op: str, *args, **kwargs) -> Any:
        message = {"op": op, "args": wire.encode(args, self._special), "kwargs": wire.encode(kwargs, self._special)}
        if op == "build_drafter":
            message["key"] = key = next(self.keys)
            self.request(message)
            return RemoteDrafter(self, key)
        return wire.decode(self.request(message))


_WORKER: Worker | None = None


def worker() -> Worker:
    global _WORKER
    if _WORKER is None or _WORKER.process.poll() is not None:
        _WORKER = Worker()
    return _WORKER


class ModelOptRecipe:
    """Its shipped recipe (modelopt_recipes/general/speculative_decoding/dflash.yaml through `DFlashConfig`), in
    speculators' names, read in its process."""

    def __init__(self, fields: dict[str, Any]):
        self.__dict__.update(fields)


class _RemoteLoss(torch.autograd.Function):
    """A loss computed in the worker, its gradient w.r.t. the logits the worker's own autograd gave."""

    @staticmethod
    def forward(ctx, logits, loss, grad):
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad_output * grad, None, None


def _remote_loss(op: str):
    def operation(self, logits, *args, **kwargs):
        result = worker().call(op, logits, *args, **kwargs)
        return _RemoteLoss.apply(logits, result["loss"], result["grad"].to(logits.dtype))

    operation.__name__ = op
    return operation


def _remote(op: str):
    def operation(self, *args, **kwargs):
        return worker().call(op, *args, **kwargs)

    operation.__name__ = op
    return operation


# Model-Optimizer trains DSpark (`_compute_dspark_loss`); this plug holds its DSpark heads and Markov loop, not its loss.
NOT_WRAPPED_DSPARK_LOSS = ("modelopt: Model-Optimizer 0.47.0's DSpark loss (modelopt/torch/speculative/plugins/"
                           "hf_dspark.py:170, _compute_dspark_loss) is not wrapped by this plug, which holds its "
                           "DSpark heads and Markov loop")


class ModelOptImplementation:
    name = "modelopt"
    interface_version = 10  # impl/interface_versions.py
    # No function of its own for these: context features are gathered inline in `HFDFlashModel.forward`
    # (hf_dflash.py:983); no decoding loop (its AR validation, `HFARValidation`, runs on CUDA against a precomputed
    # greedy ground truth); no slot layout, DFlash2 or reduced draft vocabulary; no XPress (its projector types
    # are dflash, domino and dspark: dflash/conversion.py:51).
    unsupported: frozenset[str] = frozenset({"context_features", "generate", "speculative_tokens", "proposal_logits",
                                             "vocab_mapping", "proposed_ids", "refiner_bias", "jacobi_tokens"})

    def __init__(self):
        if installed_version("nvidia-modelopt") != VERSION:
            raise ImportError(f"held.modelopt wraps nvidia-modelopt {VERSION}; installed: "
                              f"{installed_version('nvidia-modelopt') or 'none'} (make setup pins it)")
        self._recipe = None

    @property
    def recipe(self) -> ModelOptRecipe:
        if self._recipe is None:
            self._recipe = ModelOptRecipe(worker().request({"op": "recipe"}))
        return self._recipe

    def family_loss(self, drafter, target, input_ids, loss_mask, document_ids, recipe, seed, anchors=None):
        raise Unsupported(NOT_WRAPPED_DSPARK_LOSS)  # it has one: not held here (n/a saying so, never "has none")

    default_target_layer_ids = _remote("default_target_layer_ids")
    select_anchors = _remote("select_anchors")
    training_mask = _remote("training_mask")
    inference_mask = _remote("inference_mask")
    build_drafter = _remote("build_drafter")
    project_context = _remote("project_context")
    apply_rotary = _remote("apply_rotary")
    draft_forward = _remote("draft_forward")
    training_outputs = _remote("training_outputs")
    loss_weights = _remote("loss_weights")
    loss = _remote_loss("loss")
    dpace_weights = _remote("dpace_weights")
    dpace_loss = _remote_loss("dpace_loss")
    block_metrics = _remote("block_metrics")
    # DSpark (`HFDSparkModel`, hf_dspark.py): its Markov and confidence heads, its AR-validation Markov loop.
    markov_bias = _remote("markov_bias")
    confidence_logits = _remote("confidence_logits")
    markov_path = _remote("markov_path")

    def context_features(self, hidden_states, layer_ids):
        raise Unsupported("Model-Optimizer gathers context features inline in HFDFlashModel.forward")

    def generate(self, *args, **kwargs):
        raise Unsupported("Model-Optimizer 0.47.0 has no DFlash decoding loop to run here")
