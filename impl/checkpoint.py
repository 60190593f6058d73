"""Checkpoint I/O: our `ckpt.pt` and z-lab-format directories.

Every write is atomic (temp file or directory, then rename), so a crash never leaves a
half-written checkpoint. `ckpt.pt` is only ever read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from impl.atomic import atomic_directory, atomic_write_bytes  # noqa: F401  (re-exported: writers import them from here)
from impl.defaults import BLOCK_SIZE_DEFAULTS, QWEN3_DEFAULTS, ZLAB_EXTRAS
from impl.errors import CheckpointError
from impl.families import ZLAB_ARCHITECTURES, config_family
from impl.layers import build_target_layer_ids
from impl.model import DFlashDrafter
from impl.param_names import strip_wrapper_prefixes
from impl.spec import DFLASH2_FIELDS, DraftSpec, Recipe, SpecError

CKPT_FORMAT = "dflash-audit/ckpt-1"
# Tensors a speculators drafter holds that are copies of the verifier's (embeddings, head, final
# norm, vocabulary maps): never trained, never draft body (PITFALLS #13).
VERIFIER_OWNED_KEYS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                       "t2d", "d2t")


@dataclass
class Checkpoint:
    spec: DraftSpec
    state_dict: dict[str, torch.Tensor]
    recipe: Recipe | None = None
    step: int = 0
    # What resuming needs besides the weights: optimizer and scheduler state, RNG state, loss history.
    training_state: dict[str, Any] | None = None
    recipe_unknown: list[str] = field(default_factory=list)  # recipe fields the source never declared


# -- helpers -----------------------------------------------------------------------------
def index_shards(index: Path) -> list[Path]:
    """The shard files a `*.index.json` names; each must lie inside the index's own folder."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index}: invalid JSON ({exc.__class__.__name__})") from exc
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: no 'weight_map' object naming the shards") from exc
    folder = index.parent.resolve()
    files = []
    for name in names:
        if not isinstance(name, str):
            raise CheckpointError(f"{index}: weight_map names a non-string shard {name!r}")
        shard = (index.parent / name).resolve()
        if shard.parent != folder:
            raise CheckpointError(f"{index}: weight_map names {name!r}, outside the index's own folder; refused")
        if not shard.is_file():
            raise CheckpointError(f"{index}: shard {name!r} is missing")
        files.append(shard)
    return files


def check_body(spec: DraftSpec, state_dict: dict[str, torch.Tensor],
               source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The body without wrapper prefixes, in the spec's parameter order, checked against the shapes the
    spec implies (a model built on the meta device: no memory); one-line error naming the first bad tensor."""
    with torch.device("meta"):
        expected = DFlashDrafter(spec).state_dict()
    state_dict = strip_wrapper_prefixes(state_dict)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    for key, tensor in expected.items():
        if tuple(state_dict[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{source}: tensor {key!r} has shape {tuple(state_dict[key].shape)}, "
                                  f"the spec implies {tuple(tensor.shape)}")
    return {key: state_dict[key] for key in expected}


def build_drafter(spec: DraftSpec, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                  source: str = "checkpoint") -> DFlashDrafter:
    """A drafter with exactly these weights; one-line error naming the first bad tensor."""
    state_dict = check_body(spec, state_dict, source)
    model = DFlashDrafter(spec)
    model.load_state_dict(state_dict)
    return model.to(dtype) if dtype is not None else model


# -- ours: ckpt.pt -----------------------------------------------------------------------
def save_checkpoint(path: str | Path, model: DFlashDrafter, recipe: Recipe | None = None, step: int = 0,
                    training_state: dict[str, Any] | None = None, recipe_unknown: list[str] | None = None) -> None:
    save_state(path, model.spec, {k: v.detach().cpu() for k, v in model.state_dict().items()}, recipe, step,
               training_state, recipe_unknown)


def save_state(path: str | Path, spec: DraftSpec, state_dict: dict[str, torch.Tensor], recipe: Recipe | None = None,
               step: int = 0, training_state: dict[str, Any] | None = None,
               recipe_unknown: list[str] | None = None) -> None:
    """`ckpt.pt` from a state dict: tensors backed by a file's pages (mmap) are written straight from them,
    never gathered into memory (torch.save writes each tensor's storage as it stands)."""
    payload = {
        "format": CKPT_FORMAT,
        "model": dict(state_dict),
        "spec": spec.to_dict(),
        "recipe": recipe.to_dict() if recipe is not None else None,
        "step": int(step),
    }
    if training_state is not None:
        payload["training_state"] = training_state
    if recipe_unknown:  # a converted checkpoint whose source never said these: unknown, not defaults
        payload["recipe_unknown"] = sorted(recipe_unknown)
    atomic_write_bytes(Path(path), lambda tmp: torch.save(payload, tmp))


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        # mmap: the tensors stay pages of the file (read on use), so a 3 GB drafter costs no heap
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as exc:  # corrupt, truncated, or a pickle that is not plain data
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a readable ckpt.pt ({first_line[:200]})") from exc
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path}: expected a dict checkpoint, got {type(payload).__name__}")
    for key in ("model", "spec"):
        if key not in payload:
            raise CheckpointError(f"{path}: checkpoint has no {key!r} entry")
    try:
        spec = DraftSpec.from_dict(payload["spec"])
        recipe = Recipe.from_dict(payload["recipe"]) if payload.get("recipe") else None
    except (SpecError, TypeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    state = strip_wrapper_prefixes(payload["model"])
    unknown = payload.get("recipe_unknown") or []
    if not isinstance(unknown, list) or not all(isinstance(name, str) for name in unknown):
        raise CheckpointError(f"{path}: recipe_unknown must be a list of recipe field names")
    return Checkpoint(spec=spec, state_dict=state, recipe=recipe, step=int(payload.get("step", 0)),
                      # "optimizer": the entry's name in ckpt.pt files written before it was "training_state"
                      training_state=payload.get("training_state", payload.get("optimizer")),
                      recipe_unknown=list(unknown))


# -- z-lab directory ---------------------------------------------------------------------
def zlab_config(spec: DraftSpec) -> dict[str, Any]:
    """config.json of a z-lab drafter: Qwen3 fields plus `dflash_config`."""
    config = spec.qwen3_config().to_dict()
    config.update({
        "architectures": [ZLAB_ARCHITECTURES[spec.family]],
        "num_target_layers": spec.num_target_layers,
        "block_size": spec.block_size,
        "dflash_config": {
            "target_layer_ids": list(spec.target_layer_ids),
            "mask_token_id": spec.mask_token_id,
            "block_size": spec.block_size,
        },
    })
    for name, default in ZLAB_EXTRAS.items():
        if getattr(spec, name) != default:
            config["dflash_config"][name] = getattr(spec, name)
    if spec.family == "dflash2":
        config["dflash_config"].update({name: getattr(spec, name) for name in DFLASH2_FIELDS})
    if spec.sliding_window_non_causal:
        config["is_causal"] = False  # z-lab's switch: sliding layers then see their whole block
    return config


def save_zlab_dir(path: str | Path, spec: DraftSpec, state_dict: dict[str, torch.Tensor]) -> None:
    tensors = {k: v.detach().cpu().contiguous() for k, v in strip_wrapper_prefixes(state_dict).items()}

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(zlab_config(spec), indent=2, sort_keys=True))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    atomic_directory(Path(path), fill)


def as_int(name: str, value: Any) -> int:
    """A config's whole number, or a SpecError naming the field (never `int('sixty-four')`)."""
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, float) and value.is_integer()):
        raise SpecError(name, f"{value!r} is not a whole number")
    return int(value)


def as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(name, f"{value!r} is not a number")
    return float(value)


def spec_from_zlab_config(config: dict[str, Any], source: str = "config.json") -> DraftSpec:
    """Normalize a z-lab config.json the way `dflash.model.DFlashDraftModel` reads it."""
    dflash = config.get("dflash_config") or {}

    def value(name, default=None):
        return dflash.get(name, config.get(name, default))

    try:
        layers = as_int("num_hidden_layers", config["num_hidden_layers"])
        hidden, heads = as_int("hidden_size", config["hidden_size"]), as_int("num_attention_heads", config["num_attention_heads"])
        num_target_layers = config.get("num_target_layers")
        ids = value("target_layer_ids")
        if ids is None:
            if num_target_layers is None:
                raise SpecError("target_layer_ids", "absent, and no num_target_layers to derive z-lab's default")
            ids = build_target_layer_ids(as_int("num_target_layers", num_target_layers), layers)
        if num_target_layers is None:
            raise SpecError("num_target_layers", "missing from config.json")
        mask_token_id = value("mask_token_id")
        if mask_token_id is None:
            raise SpecError("mask_token_id", "missing from dflash_config")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise SpecError("rope_parameters", f"{rope!r} is not a mapping")
        use_sliding = bool(config.get("use_sliding_window", False))
        window = config.get("sliding_window") if use_sliding else None
        layer_types = config.get("layer_types") or ["full_attention"] * layers
        if "sliding_attention" in layer_types and window is None:
            # z-lab keeps such layers causal but unwindowed; an unreachable window says the same.
            window = as_int("max_position_embeddings", config.get("max_position_embeddings", QWEN3_DEFAULTS["max_position_embeddings"]))
        family = config_family(config)
        dflash2 = {name: as_int(name, value(name)) if value(name) is not None else None for name in DFLASH2_FIELDS}
        if family == "dflash2" and None in dflash2.values():
            raise SpecError(next(n for n, v in dflash2.items() if v is None), "missing from a DFlash2DraftModel config")
        return DraftSpec(
            **(dflash2 if family == "dflash2" else {}),
            sliding_window_non_causal=zlab_non_causal(config.get("is_causal"), layer_types),
            hidden_size=hidden,
            intermediate_size=as_int("intermediate_size", config["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=as_int("num_key_value_heads", config.get("num_key_value_heads") or heads),
            head_dim=as_int("head_dim", config.get("head_dim") or hidden // heads),
            num_hidden_layers=layers,
            vocab_size=as_int("vocab_size", config["vocab_size"]),
            target_layer_ids=tuple(ids),
            num_target_layers=as_int("num_target_layers", num_target_layers),
            mask_token_id=as_int("mask_token_id", mask_token_id),
            block_size=as_int("block_size", value("block_size", BLOCK_SIZE_DEFAULTS["zlab"])),
            layer_types=tuple(layer_types),
            sliding_window=window,
            rope_theta=as_float("rope_theta", rope.get("rope_theta", config.get("rope_theta",
                                                                                QWEN3_DEFAULTS["rope_theta"]))),
            rms_norm_eps=as_float("rms_norm_eps", config.get("rms_norm_eps", QWEN3_DEFAULTS["rms_norm_eps"])),
            max_position_embeddings=as_int("max_position_embeddings", config.get("max_position_embeddings", QWEN3_DEFAULTS["max_position_embeddings"])),
            attention_bias=bool(config.get("attention_bias", QWEN3_DEFAULTS["attention_bias"])),
            hidden_act=str(config.get("hidden_act", QWEN3_DEFAULTS["hidden_act"])),
            input_embedding_scale=as_float("input_embedding_scale", value("input_embedding_scale",
                                                                          ZLAB_EXTRAS["input_embedding_scale"])),
            output_multiplier=as_float("output_multiplier", value("output_multiplier", ZLAB_EXTRAS["output_multiplier"])),
            final_logit_softcapping=value("final_logit_softcapping", ZLAB_EXTRAS["final_logit_softcapping"]),
        )
    except KeyError as exc:
        raise CheckpointError(f"{source}: missing field {exc.args[0]!r}") from exc
    except SpecError as exc:
        raise CheckpointError(f"{source}: {exc}") from exc


def zlab_non_causal(is_causal: Any, layer_types: list[str]) -> bool:
    """z-lab's `is_causal` (absent: sliding layers causal) as `sliding_window_non_causal`."""
    if is_causal is None:
        return False
    if not isinstance(is_causal, bool):
        raise SpecError("is_causal", f"{is_causal!r} is not true or false")
    if is_causal and "full_attention" in layer_types:
        raise SpecError("is_causal", "true makes z-lab's full-attention layers causal too, which no DFlash "
                                     "drafter does; refused rather than audited as something else")
    return not is_causal


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards named by its index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [shard.name for shard in index_shards(index)]
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path}: no model.safetensors (or index) in the directory")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            with safe_open(str(path / name), framework="pt") as handle:
                for key in handle.keys():
                    tensors[key] = handle.get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{path / name}: unreadable safetensors file ({str(exc)[:200]})") from exc
    return tensors


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: invalid JSON ({exc})") from exc
