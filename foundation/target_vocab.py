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

from foundation.inputs import openable
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
    id_sources: dict[str, dict[int, list[str]]] = field(default_factory=dict)  # role -> id -> the files saying it

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
        for role, found in special_token_ids(path, text, generation, tokenizer).items():
            vocab.special_ids[role] = sorted(found)
            vocab.id_sources[role] = {i: found[i] for i in sorted(found)}
            vocab.sources[role] = "; ".join(f"{i} ({', '.join(w)})" for i, w in sorted(found.items())) or \
                "declared nowhere"
        return vocab


def embedding_tensor(target_dir: str | Path) -> EmbeddingTensor | None:
    """The target's input embedding, located by name in the safetensors headers (nothing is loaded)."""
    from safetensors import safe_open

    for file in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(openable(file), "pt") as handle:
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

    with safe_open(openable(embedding.file), "pt") as handle:
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


SPECIAL_ROLES = ("eos", "pad", "bos")
TOKENIZER_JSON_LIMIT = 64 << 20  # a real tokenizer.json is a few MiB (Qwen3's 11); past this, its ids stay unread


def special_token_ids(path: Path, config: dict[str, Any], generation: dict[str, Any],
                      tokenizer=None) -> dict[str, dict[int, list[str]]]:
    """role (eos, pad, bos) -> id -> every place the target declares it: config.json and generation_config.json
    (`<role>_token_id`), tokenizer_config.json and special_tokens_map.json (`<role>_token`, a token string or an
    AddedToken dict, resolved to its id through the tokenizer's added tokens and vocabulary), and a loaded
    `tokenizer`'s own ids. Read from the files, no tokenizer code run: a target whose eos is declared only in its
    tokenizer_config.json has that eos (what the engines' tokenizers stop at)."""
    strings = {where: _json_object(path / where) for where in ("tokenizer_config.json", "special_tokens_map.json")}
    token_ids = _token_string_ids(path, strings["tokenizer_config.json"])
    found: dict[str, dict[int, list[str]]] = {role: {} for role in SPECIAL_ROLES}
    for role in SPECIAL_ROLES:
        declared = [(where, token_id) for where, source in (("config.json", config),
                                                            ("generation_config.json", generation))
                    for token_id in _ids(source.get(f"{role}_token_id"))]
        for where, source in strings.items():
            for token in _token_strings(source.get(f"{role}_token")):
                if token in token_ids:
                    declared.append((f"{where} {role}_token {token!r}", token_ids[token]))
        if tokenizer is not None:
            declared += [("tokenizer", token_id) for token_id in _ids(getattr(tokenizer, f"{role}_token_id", None))]
        for where, token_id in declared:
            found[role].setdefault(token_id, []).append(where)
    return found


@dataclass(frozen=True)
class StopIds:
    """The ids a decoding loop stops at, each with where it was read."""

    ids: list[int]
    sources: dict[int, str]  # id -> where it was read

    def describe(self) -> str:
        by_source: dict[str, list[int]] = {}
        for token_id in self.ids:
            by_source.setdefault(self.sources[token_id], []).append(token_id)
        return "; ".join(f"{', '.join(map(str, ids))} ({where})" for where, ids in by_source.items()) or \
            "none (no eos in the generation config, config.json or the tokenizer)"

    def report(self) -> dict[str, Any]:
        """The two report keys: `stop_ids` and `stop_id_sources` (id -> where)."""
        return {"stop_ids": list(self.ids), "stop_id_sources": {str(i): self.sources[i] for i in self.ids}}

    @classmethod
    def from_report(cls, data: dict[str, Any]) -> StopIds:
        ids = list(data.get("stop_ids") or [])
        sources = data.get("stop_id_sources") or {}
        return cls(ids, {i: sources.get(str(i), "source not recorded") for i in ids})


def stop_token_ids(target_dir: str | Path, tokenizer) -> StopIds:
    """The stop ids of z-lab's loop (dflash 0.1.0 benchmark.py:126 `stop_token_ids`:
    `model.generation_config.eos_token_id or tokenizer.eos_token_id`, an int or a list), read from the files as
    transformers 5.x builds the generation config (`GenerationMixin.adjust_generation_fn`): generation_config.json
    as written, nothing merged into it; when it is absent or not JSON, config.json's eos_token_id, else its
    decoder's/generator's/text_config's (`GenerationConfig.from_model_config`). An unset or falsy eos (None, [], and 0
    too under z-lab's `or`) falls back to the loaded `tokenizer`'s eos, the only tokenizer code run. The one reader
    every verb and live check uses."""
    path = Path(target_dir)
    where, value = _generation_eos(path)
    if value:  # z-lab's `or`, falsy values included
        ids = list(dict.fromkeys(_ids(value)))
        return StopIds(ids, {i: where for i in ids})
    unset = "unset" if value is None else f"{json.dumps(value)}, falsy in z-lab's `or`"
    fallback = tokenizer.eos_token_id if tokenizer is not None else None
    if _int_or_none(fallback) is None:
        return StopIds([], {})
    declared = special_token_ids(path, {}, {})["eos"].get(fallback, [])
    said = f" ({', '.join(declared)})" if declared else ""
    return StopIds([fallback], {fallback: f"the tokenizer's eos_token_id{said}: the generation config's "
                                          f"eos_token_id ({where}) is {unset}"})


def _generation_eos(path: Path) -> tuple[str, Any]:
    """(where, value) of the eos_token_id transformers puts in `model.generation_config` (None: unset)."""
    file = path / "generation_config.json"
    generation, why = None, "no generation_config.json"
    if file.is_file():
        try:
            generation = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            # transformers reads one that is no JSON as absent (an OSError), and so falls back to config.json
            why = "generation_config.json is not JSON"
    if isinstance(generation, dict):
        return "generation_config.json eos_token_id", generation.get("eos_token_id")
    if generation is not None:
        why = "generation_config.json is not a JSON object"
    config = _json_object(path / "config.json")
    if config.get("eos_token_id") is not None:
        return f"config.json eos_token_id, {why}", config["eos_token_id"]
    for name in ("decoder", "generator", "text_config"):
        inner = config.get(name)
        if inner:
            found = inner.get("eos_token_id") if isinstance(inner, dict) else None
            return f"config.json {name}.eos_token_id, {why}", found
    return f"config.json, {why}", None


def _token_strings(value: Any) -> list[str]:
    """A `<role>_token` entry: a string, an AddedToken dict ({"content": ...}) or a list of them."""
    values = value if isinstance(value, list) else [value]
    strings = [v.get("content") if isinstance(v, dict) else v for v in values]
    return [v for v in strings if isinstance(v, str)]


def _token_string_ids(path: Path, tokenizer_config: dict[str, Any]) -> dict[str, int]:
    """token string -> id from tokenizer_config.json's added_tokens_decoder and tokenizer.json's added tokens and
    vocabulary (the files a tokenizer is built from)."""
    ids: dict[str, int] = {}
    decoder = tokenizer_config.get("added_tokens_decoder")
    for key, token in (decoder.items() if isinstance(decoder, dict) else ()):
        if isinstance(token, dict) and isinstance(token.get("content"), str) and str(key).isdigit():
            ids.setdefault(token["content"], int(key))
    file = path / "tokenizer.json"
    try:
        if not file.is_file() or file.stat().st_size > TOKENIZER_JSON_LIMIT:
            return ids
    except OSError:
        return ids
    data = _json_object(file)
    added = data.get("added_tokens")
    for token in added if isinstance(added, list) else ():
        if isinstance(token, dict) and isinstance(token.get("content"), str) and _int_or_none(token.get("id")) \
                is not None:
            ids.setdefault(token["content"], token["id"])
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    for token, token_id in vocab.items() if isinstance(vocab, dict) else ():
        if _int_or_none(token_id) is not None:
            ids.setdefault(token, token_id)
    return ids


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
