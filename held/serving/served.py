"""What an engine will run a drafter with (`Served`), and what it needs to know of the target (`TargetFacts`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from impl.target_vocab import TargetVocabulary

ENGINES = ("vllm", "sglang")

# The served fields, in report order. Layer ids are in the z-lab convention (hs[id + 1]).
FIELDS = ("target_layer_ids", "target_layer_ids_declared", "layer_types", "layer_windows", "layer_causal",
          "mask_token_id", "block_size", "num_speculative_tokens", "rope_theta", "rope_type",
          "partial_rotary_factor", "is_neox_style", "rms_norm_eps", "hidden_act", "vocab_size", "draft_vocab_size",
          "draft_to_target",
          "input_embedding_scale", "output_multiplier", "final_logit_softcapping", "conv_kernel_size",
          "conv_group_size", "selector_rank", "selector_top_k", "tensors_ignored", "tensors_refused",
          "sample_from_anchor")


@dataclass
class TargetFacts:
    """The target (verifier) as the engine sees it at run time: layers, vocabulary, embedding rows, eos/pad."""

    path: str | None = None
    num_layers: int | None = None
    vocab_size: int | None = None
    embedding_rows: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def read(cls, target: str | Path | None) -> TargetFacts:
        """From the target's config.json, generation_config.json and safetensors headers (`impl.target_vocab`, the
        one reader of a target's vocabulary); the engine loads the tokenizer itself."""
        if target is None:
            return cls()
        path = Path(target)
        config = json.loads((path / "config.json").read_text())
        vocab = TargetVocabulary.read(path)
        return cls(path=str(path), num_layers=config.get("text_config", config).get("num_hidden_layers"),
                   vocab_size=vocab.config_vocab_size, embedding_rows=vocab.embedding_rows,
                   eos_token_ids=vocab.special_ids["eos"], pad_token_ids=vocab.special_ids["pad"])


@dataclass
class Served:
    engine: str
    version: str
    loads: bool
    error: str | None = None
    refused_for: str | None = None  # the served field whose value the engine refuses (its finding says why)
    values: dict[str, Any] = field(default_factory=dict)  # field -> value the engine runs with (None: unknown)
    sources: dict[str, str] = field(default_factory=dict)  # field -> engine file:line
    notes: list[str] = field(default_factory=list)
    command: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_engine(engine: str) -> str:
    """The installed engine's version; an AuditError with the fix unless it is the release the rules were read
    from (impl/packages.py): every cited line and restated rule belongs to that release."""
    from impl.errors import AuditError
    from impl.packages import BY_NAME, installed_version

    if engine not in BY_NAME:
        raise AuditError(f"unknown engine {engine!r}; expected one of {list(ENGINES)}")
    found, wanted = installed_version(BY_NAME[engine].distribution), BY_NAME[engine].pinned
    if found != wanted:
        state = "is not installed" if found is None else f"is {found}"
        raise AuditError(f"serving engine {engine} {state}; the serving check reads {engine}=={wanted}: "
                         f"pip install --no-deps {engine}=={wanted} (or `make setup`)")
    return found


def resolve(engine: str, path: str | Path, target: TargetFacts, trained_block_size: int | None,
            num_target_layers: int | None = None) -> Served:
    """How `engine` reads the drafter directory `path`. `num_target_layers` stands in for the target's depth when
    no target is given (the drafter's own record of it)."""
    check_engine(engine)
    if engine == "vllm":
        from held.serving import vllm_engine as module
    elif engine == "sglang":
        from held.serving import sglang_engine as module
    else:
        raise ValueError(f"unknown engine {engine!r}; expected one of {list(ENGINES)}")
    return module.resolve(Path(path), target, trained_block_size, num_target_layers)
