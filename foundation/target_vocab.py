"""The target's vocabulary as a drafter meets it: config vocab_size, tokenizer length, input-embedding rows and
the special ids (eos, pad, bos), each read from the target directory and left unknown (None, empty) when the
directory does not say. Nothing is guessed and no weights are loaded: embedding rows come from the safetensors
header, and an embedding row's norm is read by streaming that one tensor in slices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from foundation.token_ids import is_token_id
EMBEDDING_SUFFIX = "embed_tokens.weight"
ROWS_PER_SLICE = 4096  # 4096 rows of an 8192-wide embedding: 128 MiB at a time in float32
# A row whose norm lies within this factor of the vocabulary's median row norm looks like the trained rows;
# a padding row or a never-seen special token keeps its initialization (often zero or much smaller).
TRAINED_NORM_RANGE = (0.5, 2.0)


@dataclass(frozen=True)
class EmbeddingTensor:
    file: str
    name: str
    rows: int


@dataclass
class TargetVocabulary:
    path: str
    config_vocab_size: int | None = None
    tokenizer_length: int | None = None
    embedding: EmbeddingTensor | None = None
    special_ids: dict[str, list[int]] = field(default_factory=dict)  # "eos" | "pad" | "bos" -> ids (empty: none)
    sources: dict[str, str] = field(default_factory=dict)  # what -> where it was read, or why it is unknown

    @property
    def embedding_rows(self) -> int | None:
        return self.embedding.rows if self.embedding is not None else None

    @property
    def padded_size(self) -> int | None:
        """The vocabulary the target's logits span: its embedding rows, else its config's vocab_size."""
        return self.embedding_rows if self.embedding_rows is not None else self.config_vocab_size

    @property
    def padding(self) -> int | None:
        """Rows past the tokenizer's last id (ids the tokenizer never produces); None when either is unknown."""
        if self.padded_size is None or self.tokenizer_length is None:
            return None
        return self.padded_size - self.tokenizer_length

    def to_dict(self) -> dict[str, Any]:
        return {"config_vocab_size": self.config_vocab_size, "tokenizer_length": self.tokenizer_length,
                "embedding_rows": self.embedding_rows, "special_ids": self.special_ids, "sources": self.sources}

    @classmethod
    def read(cls, target_dir: str | Path, tokenizer=None) -> TargetVocabulary:
        """From the target's config.json, generation_config.json, tokenizer (`tokenizer`, or none) and
        safetensors headers."""
        path = Path(target_dir)
        config = _json_object(path / "config.json")
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        generation = _json_object(path / "generation_config.json")
        vocab = cls(str(path))
        vocab.config_vocab_size = _int_or_none(text.get("vocab_size"))
        vocab.sources["config_vocab_size"] = "config.json vocab_size" if vocab.config_vocab_size else "not declared"
        if tokenizer is not None:
            vocab.tokenizer_length = len(tokenizer)
            vocab.sources["tokenizer_length"] = "len(tokenizer)"
        else:
            vocab.sources["tokenizer_length"] = "no tokenizer read"
        vocab.embedding = embedding_tensor(path)
        vocab.sources["embedding_rows"] = (f"{Path(vocab.embedding.file).name}: {vocab.embedding.name}"
                                           if vocab.embedding else f"no *{EMBEDDING_SUFFIX} in a safetensors file")
        for role in ("eos", "pad", "bos"):
            found: dict[int, list[str]] = {}
            for where, source in (("config.json", text), ("generation_config.json", generation),
                                  ("tokenizer", _tokenizer_ids(tokenizer))):
                for token_id in _ids(source.get(f"{role}_token_id")):
                    found.setdefault(token_id, []).append(where)
            vocab.special_ids[role] = sorted(found)
            vocab.sources[role] = "; ".join(f"{i} ({', '.join(w)})" for i, w in sorted(found.items())) or \
                "declared nowhere"
        return vocab


def embedding_tensor(target_dir: str | Path) -> EmbeddingTensor | None:
    """The target's input embedding, located by name in the safetensors headers (nothing is loaded)."""
    from safetensors import safe_open

    for file in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                if name.endswith(EMBEDDING_SUFFIX):
                    return EmbeddingTensor(str(file), name, int(handle.get_slice(name).get_shape()[0]))
    return None


def embedding_rows(target_dir: str | Path) -> int | None:
    found = embedding_tensor(target_dir)
    return found.rows if found is not None else None


@dataclass(frozen=True)
class RowNorm:
    token_id: int
    norm: float
    median: float  # the median row norm of the whole embedding

    @property
    def ratio(self) -> float:
        return self.norm / self.median if self.median > 0 else float("inf")

    @property
    def looks_trained(self) -> bool:
        low, high = TRAINED_NORM_RANGE
        return low <= self.ratio <= high

    def describe(self) -> str:
        verdict = "looks trained" if self.looks_trained else "looks untrained"
        return (f"its embedding row has norm {self.norm:.4g}, {self.ratio:.2f}x the vocabulary's median row norm "
                f"{self.median:.4g}: it {verdict} (trained rows lie within {TRAINED_NORM_RANGE[0]:g}-"
                f"{TRAINED_NORM_RANGE[1]:g}x the median)")


def row_norms(embedding: EmbeddingTensor, token_ids: list[int]) -> dict[int, RowNorm]:
    """The norms of some embedding rows against the median of all rows, streaming the tensor slice by slice
    (ids outside the embedding are left out)."""
    from safetensors import safe_open

    with safe_open(embedding.file, "pt") as handle:
        tensor = handle.get_slice(embedding.name)
        norms = torch.cat([tensor[start:start + ROWS_PER_SLICE].float().norm(dim=-1)
                           for start in range(0, embedding.rows, ROWS_PER_SLICE)])
    median = float(norms.median())
    return {i: RowNorm(i, float(norms[i]), median) for i in token_ids if is_token_id(i, embedding.rows)}


def _json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return {}  # the target checks (foundation.inputs) name a broken config.json; here it only means "not said"
    return value if isinstance(value, dict) else {}


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if _int_or_none(v) is not None]


def _tokenizer_ids(tokenizer) -> dict[str, Any]:
    if tokenizer is None:
        return {}
    return {f"{role}_token_id": getattr(tokenizer, f"{role}_token_id", None) for role in ("eos", "pad", "bos")}


def mask_token_problems(token_id: int, limits: dict[str, int | None],
                        special_ids: dict[str, list[int]]) -> list[tuple[str, str]]:
    """Why `token_id` cannot serve as the mask token: [(kind, phrase)], kind "outside" (at or past one of
    `limits`, e.g. {"vocabulary": 151936, "embedding": 151936}; None = unknown, not checked) or "special" (it is
    one of the target's eos/pad/bos ids). The one rule the static audit (mask_token_validity) and the serving
    verdict (serving_engines) both apply."""
    past: dict[int, list[str]] = {}  # size -> the limits of that size the id is past (one phrase per size)
    for what, size in limits.items():
        if size is not None and token_id >= size:
            past.setdefault(size, []).append(what)
    found = [("outside", f"outside the target's {' and '.join(whats)} of {size} rows") for size, whats in past.items()]
    roles = [role for role, ids in special_ids.items() if token_id in ids]
    if roles:
        found.append(("special", f"the target's {' and '.join(roles)} token"))
    return found
