"""GGUF, llama.cpp's format: a `.gguf` file (detected by its magic, `GGUF`) that llama.cpp's converter writes for a
DFlash drafter (architecture `dflash`, `conversion/qwen.py` `DFlashModel` / `DSparkModel` in b11434).

Read through the `gguf` package's `GGUFReader`, after a bounded walk of the header (a truncated file, a wrong magic,
a tensor or key count the file cannot hold, a string longer than the file: one line, never a read past the end).
What the converter writes, and how it is read back:
- `dflash.target_layers`: z-lab ids + 1 (`extract_layer_ids = [i + 1 ...]`), translated back here;
- `dflash.block_size`, `tokenizer.ggml.mask_token_id` (the converter reads it only from `dflash_config`);
- `dflash.attention.sliding_window` and `..._pattern` (written only when `use_sliding_window`/`use_swa` is set),
  `dflash.attention.causal` (`is_causal`, else `dflash_config.causal`; absent when neither is set);
- `dflash.rope.freq_base` (rope theta; the engine's rope is NeoX style), `dflash.conv_*`/`selector_*` (DFlash2),
  `dflash.sample_from_anchor`/`has_confidence_head` (DSpark);
- tensors under llama.cpp's names (`blk.N.attn_q.weight`, `enc.output_norm.weight` = our `hidden_norm`, ...),
  stored with the shape reversed (ggml's `ne` order); quantized ones (Q8_0, Q4_K, ...) are dequantized to float32
  for comparison and keep their type in `foreign["gguf"]["tensor_types"]`.

The target's depth is not in a drafter's GGUF: it comes from `--target` (its config.json, or its own GGUF's
`block_count`). Writing a GGUF is llama.cpp's own converter's job (`convert --for llamacpp`,
serving_engines/live/llamacpp_convert.py); this module only reads.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_audit.formats.shape_inference import Provenance
from dflash_audit.formats.loaded import LoadedCheckpoint, RawRecord, declared_provenance
from foundation.errors import AuditError
from impl.families import ZLAB_ARCHITECTURES, spec_family
from impl.spec import SPEC_FIELDS

MAGIC = b"GGUF"
ARCHITECTURE = "dflash"
# Per tensor: llama.cpp's name (as the converter's tensor map writes it) -> ours.
TOP_NAMES = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight", "output_norm.weight": "norm.weight",
             "selector_hidden.weight": "candidate_selector.hidden_projection.weight",
             "selector_predecessor.weight": "candidate_selector.predecessor_codebook",
             "selector_successor.weight": "candidate_selector.successor_codebook", "d2t": "d2t",
             "markov_w1.weight": "markov_head.markov_w1.weight", "markov_w2.weight": "markov_head.markov_w2.weight",
             "conf_proj.weight": "confidence_head.proj.weight", "conf_proj.bias": "confidence_head.proj.bias"}
BLOCK_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
               "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
               "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
               "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
               "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
               "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
               "ffn_down.weight": "mlp.down_proj.weight",
               "attn_conv_base": "attention_conv.base_kernel", "attn_conv_proj.weight": "attention_conv.kernel_projection.weight",
               "ffn_conv_base": "mlp_conv.base_kernel", "ffn_conv_proj.weight": "mlp_conv.kernel_projection.weight"}
VERIFIER_NAMES = {"token_embd.weight": "embed_tokens.weight", "output.weight": "lm_head.weight"}
UNQUANTIZED = ("F32", "F64", "I8", "I16", "I32", "I64")  # stored exactly (F16/BF16 round: they are reported)
# GGUF value types (gguf-py's GGUFValueType) and the byte size of the fixed-size ones.
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
MAX_ARRAY_NESTING = 16  # GGUF allows arrays of arrays; no key llama.cpp writes nests past two


def detect(path: Path) -> bool:
    """A file starting with GGUF's magic (whatever its name)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == MAGIC
    except OSError:
        return False


def shown_name(raw: bytes) -> str:
    """A key's name as a message shows it: escaped, and cut short (a corrupt length can make it the whole file)."""
    name = raw.decode("utf-8", "replace")
    return repr(name[:60]) + (f" ({len(raw)} bytes)" if len(name) > 60 else "")


def check_header(path: Path) -> None:
    """Walk the header with every count and length bounded by the file's size, so that a hostile or truncated file
    is one line naming what is wrong, before any reader allocates for it."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        data = handle.read(min(size, 64 << 20))  # keys and tensor infos live at the front

    def need(offset: int, count: int, what: str) -> None:
        if count < 0 or offset + count > len(data):
            raise AuditError(f"{path}: truncated or corrupt GGUF: {what} runs past the end of the file "
                             f"(needs {offset + count} bytes, the header part read has {len(data)})")

    need(0, 24, "the header")
    if data[:4] != MAGIC:
        raise AuditError(f"{path}: not a GGUF file (magic {data[:4]!r}, expected {MAGIC!r})")
    version, tensors, keys = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise AuditError(f"{path}: GGUF version {version} (this reader knows 2 and 3)")
    if keys > size // 13 or tensors > size // 28:  # the smallest key and tensor info take 13 and 28 bytes
        raise AuditError(f"{path}: corrupt GGUF: it declares {tensors} tensors and {keys} keys, more than its "
                         f"{size} bytes can hold")
    offset = 24

    def string(offset: int, what: str) -> int:
        need(offset, 8, what)
        (length,) = struct.unpack_from("<Q", data, offset)
        need(offset + 8, length, f"{what} (a string of {length} bytes)")
        return offset + 8 + length

    def value(offset: int, kind: int, what: str, nesting: int = 0) -> int:
        if kind == STRING:
            return string(offset, what)
        if kind == ARRAY:
            if nesting >= MAX_ARRAY_NESTING:  # the reader recurses per level: refused before it runs out of stack
                raise AuditError(f"{path}: corrupt GGUF: {what} holds arrays nested deeper than {MAX_ARRAY_NESTING} "
                                 "levels")
            need(offset, 12, what)
            item, count = struct.unpack_from("<IQ", data, offset)
            offset += 12
            if item in FIXED_SIZES:
                need(offset, count * FIXED_SIZES[item], f"{what} (an array of {count})")
                return offset + count * FIXED_SIZES[item]
            if item not in (STRING, ARRAY):
                raise AuditError(f"{path}: corrupt GGUF: {what} is an array of items of type {item}")
            need(offset, count * 8, f"{what} (an array of {count})")  # every item takes 8 bytes at least
            for _ in range(count):
                offset = value(offset, item, what, nesting + 1)
            return offset
        if kind not in FIXED_SIZES:
            raise AuditError(f"{path}: corrupt GGUF: {what} has value type {kind}")
        need(offset, FIXED_SIZES[kind], what)
        return offset + FIXED_SIZES[kind]

    for index in range(keys):
        end = string(offset, f"key {index}'s name")
        name = shown_name(data[offset + 8:end])
        need(end, 4, f"key {name}")
        (kind,) = struct.unpack_from("<I", data, end)
        offset = value(end + 4, kind, f"key {name}")
    for index in range(tensors):
        offset = string(offset, f"tensor {index}'s name")
        need(offset, 4, f"tensor {index}")
        (dims,) = struct.unpack_from("<I", data, offset)
        if dims > 8:
            raise AuditError(f"{path}: corrupt GGUF: tensor {index} has {dims} dimensions")
        need(offset + 4, 8 * dims + 12, f"tensor {index}")
        offset += 4 + 8 * dims + 12


def read_gguf(path: Path):
    """The file's `GGUFReader` (header checked first); every tensor's data must lie inside the file."""
    from gguf import GGUFReader

    check_header(path)
    try:
        reader = GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, OverflowError, struct.error) as exc:
        raise AuditError(f"{path}: corrupt GGUF: {exc}") from None
    return reader


# GGUF value types (gguf-py's GGUFValueType) by what they hold.
INTEGERS, FLOATS, BOOL = frozenset({0, 1, 2, 3, 4, 5, 10, 11}), frozenset({6, 12}), 7
TYPE_WORDS = {**{t: "an integer" for t in INTEGERS}, **{t: "a float" for t in FLOATS}, BOOL: "true/false",
              STRING: "a string", ARRAY: "an array"}
ITEM_WORDS = {**{t: "integers" for t in INTEGERS}, **{t: "floats" for t in FLOATS}, BOOL: "true/false values",
              STRING: "strings", ARRAY: "arrays", None: "items"}


@dataclass(frozen=True)
class Kind:
    """What a key must hold: `types` are the GGUF value types that hold it (an array's: its items' types)."""
    words: str
    types: frozenset
    array: bool = False
    positive: bool = False


TEXT = Kind("a string", frozenset({STRING}))
COUNT = Kind("a positive integer", INTEGERS, positive=True)
INTEGER = Kind("an integer", INTEGERS)
NUMBER = Kind("a number", INTEGERS | FLOATS)
FLAG = Kind("true or false", frozenset({BOOL}))
LAYER_IDS = Kind("an array of integers (layer ids)", INTEGERS, array=True)
PER_LAYER_FLAGS = Kind("an array of true/false (one per layer)", frozenset({BOOL}), array=True)
STRINGS = Kind("an array of strings", frozenset({STRING}), array=True)
TABLE = Kind("an array", frozenset(FIXED_SIZES) | {STRING, ARRAY}, array=True)
# Every key this reader uses, and its kind as llama.cpp's converter writes it (gguf_writer.add_*); `{arch}`: the
# file's architecture. A key of another kind is refused naming the file and the key, before its value is used.
KEY_KINDS = {
    "general.architecture": TEXT, "general.file_type": INTEGER, "general.quantization_version": INTEGER,
    "{arch}.block_count": COUNT, "{arch}.embedding_length": COUNT, "{arch}.feed_forward_length": COUNT,
    "{arch}.attention.head_count": COUNT, "{arch}.attention.head_count_kv": COUNT,
    "{arch}.attention.key_length": COUNT, "{arch}.context_length": COUNT, "{arch}.block_size": COUNT,
    "{arch}.rope.dimension_count": COUNT, "{arch}.conv_kernel_size": COUNT, "{arch}.conv_group_size": COUNT,
    "{arch}.selector_rank": COUNT, "{arch}.selector_top_k": COUNT,
    "{arch}.rope.freq_base": NUMBER, "{arch}.attention.layer_norm_rms_epsilon": NUMBER, "{arch}.logit_scale": NUMBER,
    "{arch}.final_logit_softcapping": NUMBER, "{arch}.embedding_scale": NUMBER,
    "{arch}.attention.sliding_window": INTEGER, "{arch}.attention.sliding_window_pattern": PER_LAYER_FLAGS,
    "{arch}.attention.causal": FLAG, "{arch}.sample_from_anchor": FLAG, "{arch}.has_confidence_head": FLAG,
    "{arch}.target_layers": LAYER_IDS, "tokenizer.ggml.mask_token_id": INTEGER, "tokenizer.ggml.tokens": STRINGS,
    "tokenizer.ggml.merges": TABLE, "tokenizer.ggml.token_type": TABLE, "tokenizer.ggml.scores": TABLE,
}
TABLES = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
# What a drafter's settings cannot be read without (each becomes a field z-lab's config.json requires).
REQUIRED = ("{arch}.block_count", "{arch}.embedding_length", "{arch}.feed_forward_length",
            "{arch}.attention.head_count", "tokenizer.ggml.tokens", "tokenizer.ggml.mask_token_id")


def array_item(found) -> int | None:
    """An array key's item type (None for an empty array: it holds nothing of any type)."""
    return int(found.types[1]) if len(found.types) > 1 else None


def held(found) -> str:
    """What a key holds, as a refusal says it: its GGUF type and (for a scalar) its value, cut short."""
    kind = int(found.types[0]) if found.types else -1
    if kind == ARRAY:
        item = array_item(found)
        return f"an array of {len(found.data)} " + ITEM_WORDS.get(item, f"items of value type {item}")
    try:
        value = found.contents()
    except (ValueError, IndexError, UnicodeDecodeError):
        return TYPE_WORDS.get(kind, f"value type {kind}")
    return f"{TYPE_WORDS.get(kind, f'value type {kind}')} {repr(value)[:40]}"


def checked_value(reader, path: Path, key: str, kind: Kind, read: bool = True) -> Any:
    """`key`'s value if it holds `kind` (None when absent; not read unless `read`: a token table is thousands of
    entries); one line naming the file and the key otherwise."""
    found = reader.fields.get(key)
    if found is None:
        return None
    main = int(found.types[0]) if found.types else -1
    item = array_item(found) if main == ARRAY else None
    if kind.array:
        fits = main == ARRAY and (item in kind.types or not found.data)
    else:
        fits = main in kind.types
    value = found.contents() if fits and read else None
    if fits and kind.positive and not value > 0:
        fits = False
    if not fits:
        raise AuditError(f"{path}: GGUF key {key!r} holds {held(found)}; expected {kind.words}")
    if isinstance(value, (float, np.floating)):
        return float(str(np.float32(value)))  # float32 on disk: its shortest decimal (1e-06, not 9.99999997e-07)
    return value


def kind_of(key: str, arch: str | None) -> Kind | None:
    if arch is not None and key.startswith(f"{arch}."):
        return KEY_KINDS.get("{arch}." + key[len(arch) + 1:])
    return KEY_KINDS.get(key)


def field_value(reader, key: str) -> Any:
    """A key's value as the file holds it, its kind unchecked: for keys this reader does not interpret."""
    found = reader.fields.get(key)
    if found is None:
        return None
    value = found.contents()
    if isinstance(value, (float, np.floating)):
        return float(str(np.float32(value)))
    return value


def metadata(reader, path: Path) -> dict[str, Any]:
    """Every key, each this reader uses checked for its kind (`KEY_KINDS`); the tokenizer's tables (thousands of
    entries) by their lengths."""
    arch = checked_value(reader, path, "general.architecture", TEXT)
    out = {}
    for key in reader.fields:
        if key.startswith("GGUF."):
            continue
        kind = kind_of(key, arch)
        if key in TABLES:
            checked_value(reader, path, key, kind, read=False)
            out[key] = f"<{len(reader.fields[key].data)} entries>"
        else:
            out[key] = checked_value(reader, path, key, kind) if kind is not None else field_value(reader, key)
    return out


def required_keys(keys: dict[str, Any], path: Path, arch: str) -> None:
    for template in REQUIRED:
        key = template.format(arch=arch)
        if key not in keys:
            raise AuditError(f"{path}: GGUF key {key!r} is missing (llama.cpp's converter writes it for every "
                             "DFlash drafter)")


def tensor_of(tensor) -> torch.Tensor:
    """A GGUF tensor as float32 (or its integer type) in our shape (ggml's `ne` reversed)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))
    kind = tensor.tensor_type
    if kind in (GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32, GGMLQuantizationType.I64):
        return torch.from_numpy(np.array(tensor.data).reshape(shape).copy())
    values = np.asarray(dequantize(np.asarray(tensor.data), kind), dtype=np.float32)
    return torch.from_numpy(values.reshape(shape).copy())


def our_name(name: str) -> str | None:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in BLOCK_NAMES:
        return f"layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}"
    return None


def target_depth(target_dir: str | Path | None) -> tuple[int | None, str]:
    """The target's layer count: its config.json, or its GGUF's block_count."""
    if target_dir is None:
        return None, ""
    target = Path(target_dir)
    if target.is_file() and detect(target):
        reader = read_gguf(target)
        arch = checked_value(reader, target, "general.architecture", TEXT)
        where = f"{target}: GGUF key '{arch}.block_count'"
        return checked_value(reader, target, f"{arch}.block_count", COUNT), where
    from foundation.weights_dir import read_config

    config = read_config(target)
    config = config.get("text_config", config)
    depth, where = config.get("num_hidden_layers"), f"{target}/config.json: field 'num_hidden_layers'"
    if depth is not None and not (type(depth) is int and depth > 0):
        raise AuditError(f"{where} is {repr(depth)[:40]}; expected a positive integer")
    return depth, where


def zlab_shaped_config(keys: dict[str, Any], tensors: dict[str, torch.Tensor], depth: int | None) -> dict[str, Any]:
    """The drafter's settings as a z-lab config.json says them (what the converter read them from)."""
    arch = ARCHITECTURE

    def key(name: str) -> Any:
        return keys.get(f"{arch}.{name}")

    layers = key("block_count")
    dflash: dict[str, Any] = {"block_size": key("block_size"), "mask_token_id": keys.get("tokenizer.ggml.mask_token_id")}
    written = key("target_layers")
    if written is not None:
        dflash["target_layer_ids"] = [int(i) - 1 for i in written]  # the converter's +1 undone
    family = spec_family(key("conv_kernel_size"))
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if key(name) is not None:
            dflash[name] = key(name)
    if key("sample_from_anchor"):
        dflash["sample_from_anchor"] = True
    window, pattern = key("attention.sliding_window"), key("attention.sliding_window_pattern")
    layer_types = (["sliding_attention" if swa else "full_attention" for swa in pattern] if window and pattern
                   else ["full_attention"] * (layers or 0))
    vocab = keys.get("tokenizer.ggml.tokens")
    config = {
        "architectures": [ZLAB_ARCHITECTURES[family]], "model_type": "qwen3",
        "hidden_size": key("embedding_length"), "num_hidden_layers": layers,
        "intermediate_size": key("feed_forward_length"), "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"), "head_dim": key("attention.key_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "max_position_embeddings": key("context_length"),
        "rope_theta": key("rope.freq_base"),
        "vocab_size": int(vocab.strip("<> entries")) if isinstance(vocab, str) else None,
        "layer_types": layer_types, "use_sliding_window": bool(window), "sliding_window": window,
        "dflash_config": {k: v for k, v in dflash.items() if v is not None},
    }
    if depth is not None:
        config["num_target_layers"] = int(depth)
    if key("attention.causal") is not None:
        config["is_causal"] = bool(key("attention.causal"))
    if key("rope.dimension_count") is not None and config["head_dim"]:
        config["partial_rotary_factor"] = key("rope.dimension_count") / config["head_dim"]
    for ours_name, gguf_key in (("output_multiplier", "logit_scale"), ("final_logit_softcapping", "final_logit_softcapping"),
                                ("input_embedding_scale", "embedding_scale")):
        if key(gguf_key) is not None:
            dflash[ours_name] = key(gguf_key)
    return {k: v for k, v in config.items() if v is not None}


def load(path: Path, target_dir: str | Path | None = None) -> LoadedCheckpoint:
    from drafter_files.zlab_format import spec_from_zlab_config

    reader = read_gguf(path)
    keys = metadata(reader, path)
    arch = keys.get("general.architecture")
    if arch != ARCHITECTURE:
        raise AuditError(f"{path}: a GGUF of architecture {str(arch)[:60]!r}, not a DFlash drafter (llama.cpp writes "
                         f"drafters as {ARCHITECTURE!r})")
    required_keys(keys, path, arch)
    state: dict[str, torch.Tensor] = {}
    verifier: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    unmapped = []
    for tensor in reader.tensors:
        name = our_name(tensor.name) or VERIFIER_NAMES.get(tensor.name)
        if name is None:
            unmapped.append(tensor.name)
            continue
        try:
            value = tensor_of(tensor)
        except (ValueError, NotImplementedError) as exc:
            raise AuditError(f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}): cannot be read: {exc}") from None
        types[name] = tensor.tensor_type.name
        (verifier if tensor.name in VERIFIER_NAMES else state)[name] = value
    if unmapped:  # every tensor read is accounted for: an unknown one is refused, never dropped
        raise AuditError(f"{path}: GGUF tensor(s) with no DFlash drafter counterpart: {', '.join(unmapped[:5])}")
    if "d2t" in state and keys.get(f"{arch}.sample_from_anchor") is not None:
        # DSparkModel writes d2t as absolute target ids (d2t + arange); ours stores the offsets.
        state["d2t"] = state["d2t"] - torch.arange(state["d2t"].numel(), dtype=state["d2t"].dtype)
    depth, depth_where = target_depth(target_dir)
    if depth is None:  # the one setting a GGUF drafter cannot hold: asked for before any other is judged
        raise AuditError(f"{path}: a GGUF drafter does not record its target's depth; give the target (--target DIR "
                         "or the target's GGUF)" if target_dir is None else f"{depth_where} is absent: the GGUF "
                         "drafter's target depth is read there")
    config = zlab_shaped_config(keys, state, depth)
    spec = spec_from_zlab_config(config, source=str(path), family_fields=dspark_fields(keys, state))
    provenance = declared_provenance(spec, f"{path.name} (GGUF metadata)")
    provenance["num_target_layers"] = Provenance("inferred", depth_where)
    written = config["dflash_config"].get("target_layer_ids")
    info = {"version": int(reader.fields["GGUF.version"].contents()), "tensor_types": types,
            "type_counts": dict(sorted(Counter(types.values()).items())),
            "quantized": {name: kind for name, kind in types.items() if kind not in UNQUANTIZED},
            "file_type": keys.get("general.file_type"), "quantization_version": keys.get("general.quantization_version"),
            "converter": converter_of(keys), "target_layers_written": keys.get(f"{arch}.target_layers"),
            "metadata": {k: v for k, v in keys.items() if not str(v).startswith("<")}}
    return LoadedCheckpoint(spec=spec, state_dict=state, path=str(path), format="gguf",
                            raw=RawRecord(config=config, layer_ids=written, layer_ids_defaulted=written is None),
                            verifier_tensors=verifier, provenance=provenance, gguf=info)


def dspark_fields(keys: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """A DSpark drafter's head settings, from the head tensors the file holds (`DSparkModel` writes only 'vanilla')."""
    w1 = state.get("markov_head.markov_w1.weight")
    if w1 is None:
        return None
    conf = state.get("confidence_head.proj.weight")
    hidden = keys.get(f"{ARCHITECTURE}.embedding_length")
    return {"markov_rank": int(w1.shape[1]), "markov_head_type": "vanilla", "enable_confidence_head": conf is not None,
            "confidence_head_with_markov": conf is not None and int(conf.shape[1]) > int(hidden or 0)}


def converter_of(keys: dict[str, Any]) -> str:
    """What the file says of the program that wrote it (GGUF has no converter-version key; llama.cpp's converter
    writes none): the writer's named fields, else that it is unrecorded."""
    named = {k: v for k, v in keys.items() if k in ("general.converter", "general.source.url", "general.name",
                                                     "dflash_audit.converter")}
    if named.get("dflash_audit.converter"):
        return str(named["dflash_audit.converter"])
    return ("llama.cpp convert_hf_to_gguf.py (version not recorded in the file; quantization version "
            f"{keys.get('general.quantization_version')}, file type {keys.get('general.file_type')})")


def quantized_tensors(loaded: LoadedCheckpoint) -> dict[str, str]:
    """Our tensor name -> GGUF type, for the tensors a GGUF drafter stores rounded or quantized."""
    return dict(loaded.gguf.get("quantized", {}))


__all__ = ["MAGIC", "SPEC_FIELDS", "detect", "load", "quantized_tensors", "read_gguf"]
