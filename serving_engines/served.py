"""What an engine will run a drafter with (`Served`), and what it needs to know of the target (`TargetFacts`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from foundation.target_vocab import TargetVocabulary

ENGINES = ("vllm", "sglang")  # read through their Python; the demo and the README hold every drafter against these
# llama.cpp b11434 (serving_engines/llamacpp_engine.py): its rules restated from its C++ tree, a GGUF drafter.
ALL_ENGINES = (*ENGINES, "llamacpp")

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
        """From the target's config.json, generation_config.json and safetensors headers (`foundation.target_vocab`, the
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
    covered: list[str] = field(default_factory=list)  # served fields that refusal's finding already reports
    config_refused: bool = False  # refused at its config, whatever its tensors: a `loads` finding of its own
    values: dict[str, Any] = field(default_factory=dict)  # field -> value the engine runs with (None: unknown)
    sources: dict[str, str] = field(default_factory=dict)  # field -> engine file:line
    notes: list[str] = field(default_factory=list)
    command: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
