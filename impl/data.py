"""Training data: JSON lines -> token documents -> packed fixed-length [T] rows.

One line is one document, in one of three shapes:
- `{"text": "..."}`: tokenized with the target's tokenizer, EOS appended, every token trained;
- `{"input_ids": [...], "loss_mask": [...]?}`: used as given (mask defaults to all ones);
- `{"messages": [{"role", "content"}, ...]}`: rendered with the tokenizer's chat template,
  only the assistant turns trained.

Packing follows speculators' collate: documents are laid end to end, rows are cut every
T tokens, `document_ids` number the pieces of a row (-1 for padding) and `position_ids`
restart at every piece, so neither the target nor the drafter attends across documents.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from foundation.chat_template import template_failures
from foundation.jsonl import check_text, json_lines
from foundation.token_ids import is_token_id


class DataError(ValueError):
    """A data file that cannot be used; the message names file:line."""


@dataclass
class Document:
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class PackedData:
    input_ids: torch.Tensor  # [N, T] long
    loss_mask: torch.Tensor  # [N, T] long (0/1)
    document_ids: torch.Tensor  # [N, T] long, -1 for padding
    position_ids: torch.Tensor  # [N, T] long, restarting at each document piece
    data_hash: str

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index) -> PackedData:
        return PackedData(self.input_ids[index], self.loss_mask[index], self.document_ids[index],
                          self.position_ids[index], self.data_hash)


def data_hash(raw: bytes, vocab_size: int, seq_len: int) -> str:
    """sha256 over the data bytes, the tokenizer's vocabulary size and the row length."""
    digest = hashlib.sha256(raw)
    digest.update(f"|vocab={vocab_size}|seq_len={seq_len}".encode())
    return "sha256:" + digest.hexdigest()


# -- one record -> one document ------------------------------------------------------------
def _token_ids(value, name: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DataError(f"{where}: {name!r} must be a list of integers")
    return value


def _text_document(text, tokenizer, where: str) -> Document:
    if not isinstance(text, str):
        raise DataError(f"{where}: 'text' must be a string, got {type(text).__name__}")
    check_text(text, f"{where}: 'text'", DataError)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)  # documents end the way the target saw them end
    return Document(ids, [1] * len(ids))


def _chat_document(messages, tokenizer, where: str) -> Document:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: 'messages' need a tokenizer with a chat template; this one has none")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for message in messages:
        check_text(message["content"], f"{where}: 'messages'", DataError)
    # Assistant turns as character spans of the rendered text: from the end of the prompt that
    # asks for the turn to the end of the conversation that includes it.
    spans = []
    with template_failures(f"{where}: the target tokenizer's chat template", DataError):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)) \
                if i else 0
            end = len(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
            spans.append((start, end))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= lo and hi <= e and hi > lo for s, e in spans)) for lo, hi in encoded["offset_mapping"]]
    return Document(list(encoded["input_ids"]), mask)


def parse_record(record, tokenizer, vocab_size: int, where: str) -> Document:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "input_ids" in record:
        ids = _token_ids(record["input_ids"], "input_ids", where)
        mask = _token_ids(record.get("loss_mask", [1] * len(ids)), "loss_mask", where)
        if len(mask) != len(ids):
            raise DataError(f"{where}: loss_mask has {len(mask)} entries for {len(ids)} input_ids")
        doc = Document(list(ids), [int(bool(m)) for m in mask])
    elif "text" in record:
        if tokenizer is None:
            raise DataError(f"{where}: 'text' needs the target's tokenizer")
        doc = _text_document(record["text"], tokenizer, where)
    elif "messages" in record:
        if tokenizer is None:
            raise DataError(f"{where}: 'messages' need the target's tokenizer")
        doc = _chat_document(record["messages"], tokenizer, where)
    else:
        raise DataError(f"{where}: expected one of the keys 'text', 'input_ids', 'messages'")
    if not doc.input_ids:
        raise DataError(f"{where}: empty document")
    bad = [i for i in doc.input_ids if not is_token_id(i, vocab_size)]
    if bad:
        raise DataError(f"{where}: token id {bad[0]} outside the vocabulary of {vocab_size}")
    return doc


def read_jsonl(path: str | Path, tokenizer, vocab_size: int) -> tuple[list[Document], bytes]:
    """All documents of a JSON-lines file (blank lines skipped) and the file's bytes."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:  # never train on replacement characters silently
        line = raw[:exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x})") from exc
    documents = [parse_record(record, tokenizer, vocab_size, where)
                 for _, where, record in json_lines(text, path, DataError)]
    if not documents:
        raise DataError(f"{path}: no documents")
    return documents, raw


def records_to_jsonl(records: Iterable[dict]) -> bytes:
    """The JSON-lines bytes of in-memory records (hashed like a file)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


# -- packing -------------------------------------------------------------------------------
def pack_documents(documents: Sequence[Document], seq_len: int, pad_id: int, digest: str) -> PackedData:
    """Documents end to end, cut into rows of `seq_len`; the last row is padded."""
    if seq_len <= 0:
        raise DataError(f"seq_len must be positive, got {seq_len}")
    ids, mask, doc = [], [], []
    for index, document in enumerate(documents):
        ids.extend(document.input_ids)
        mask.extend(document.loss_mask)
        doc.extend([index] * len(document.input_ids))
    rows = -(-len(ids) // seq_len)
    pad = rows * seq_len - len(ids)
    input_ids = torch.tensor(ids + [pad_id] * pad).view(rows, seq_len)
    loss_mask = torch.tensor(mask + [0] * pad).view(rows, seq_len)
    document_ids = torch.tensor(doc + [-1] * pad).view(rows, seq_len)
    # A piece starts where the document changes or a row begins; ids renumber per row.
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    piece = starts.long().cumsum(1) - 1
    document_ids = torch.where(document_ids == -1, -1, piece)
    index = torch.arange(seq_len).expand(rows, -1)
    piece_start = torch.where(starts, index, 0).cummax(1).values
    position_ids = index - piece_start
    return PackedData(input_ids, loss_mask, document_ids, position_ids, digest)


def load_packed(path: str | Path, tokenizer, vocab_size: int, seq_len: int, pad_id: int) -> PackedData:
    documents, raw = read_jsonl(path, tokenizer, vocab_size)
    return pack_documents(documents, seq_len, pad_id, data_hash(raw, vocab_size, seq_len))


def pack_records(records: Sequence[dict], tokenizer, vocab_size: int, seq_len: int, pad_id: int,
                 source: str = "<records>") -> PackedData:
    documents = [parse_record(r, tokenizer, vocab_size, f"{source}:{i}") for i, r in enumerate(records, start=1)]
    if not documents:
        raise DataError(f"{source}: no documents")
    return pack_documents(documents, seq_len, pad_id, data_hash(records_to_jsonl(records), vocab_size, seq_len))
