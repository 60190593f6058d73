"""The fuzz of every reader: a mutation (plain JSON data, so that a finding can be kept as a regression case
in fuzz_regressions.json) applied to a copy of a sound input, then the real CLI run in-process on it.

Readers: safetensors headers, config.json values and types, `.pt` pickles within the allowed classes, YAML run
configs and JSON declaration files, index files, prompts files, key maps; and what a drafter means to the engines
(`serving`: its ids, layer types, block size and mask id, the target's tokenizer files) for serve-check and
compare --serve. Every outcome must be exit 0, 1 or
2, with no traceback, no exception class name and no unforeseen-fault line, every input unmodified, no temp
entry left, within TIME_BOUND seconds.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
import time
from pathlib import Path

import torch
from hypothesis import strategies as st

from dflash_audit import cli
from foundation.atomic import TMP_DIR
from tests.bad_inputs.cli_run import tree_digest
from tests.refusal_scan import offences, recorded_refusals

TIME_BOUND = 60.0  # seconds per example: a refusal or a small audit, never a walk over a bomb

SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.sampled_from([0, 1, -1, 2, 4, 64, 2**31, 2**63, 10**21])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
SPEC_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "num_target_layers", "block_size", "mask_token_id", "target_layer_ids",
             "layer_types", "sliding_window", "rope_theta", "rms_norm_eps", "max_position_embeddings",
             "hidden_act", "gamma", "loss_fn", "max_anchors", "dtype", "architectures", "rope_parameters"]
KEYS = st.sampled_from(SPEC_KEYS) | st.text(max_size=10)
TENSOR_DTYPES = ["float32", "float16", "bfloat16", "int32", "int64", "uint8", "bool", "float64"]
TENSORS = st.fixed_dictionaries({"tensor": st.sampled_from(TENSOR_DTYPES),
                                 "shape": st.lists(st.integers(0, 5), max_size=3)})
PLAIN = st.recursive(SCALARS | TENSORS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(KEYS, inner, max_size=4), max_leaves=8)


# The serving reader mutates what a drafter means, not its bytes: the fields an engine reads (ids present, absent or
# of another count; layer types of other lengths; block sizes; mask ids at the vocabulary's edges and its specials)
# and the target's tokenizer files, for `serve-check` and `compare --serve`. "vocab-1" etc. name ids by the
# target's vocabulary size; "eos" its eos id.
ABSENT, KEEP = "absent", "keep"


def _mostly_kept(values) -> st.SearchStrategy:
    """The sound value half the time, so that examples reach the engines and not only the loader's refusals."""
    return st.just(KEEP) | (values if isinstance(values, st.SearchStrategy) else st.sampled_from(values))


MASK_IDS = _mostly_kept([ABSENT, None, 0, 1, 2, -1, "vocab-1", "vocab", "vocab+1", "eos", 2**31, "1", 1.5])
LAYER_IDS = _mostly_kept(st.sampled_from([ABSENT, None, [0], [1], [0, 1, 1], [1, 0], [-1, 1], [0, 1, 2]])
                         | st.lists(st.integers(-2, 4), max_size=5))
LAYER_TYPES = _mostly_kept(st.sampled_from([ABSENT, None, "full_attention", ["sliding_attention"]]) | st.lists(
    st.sampled_from(["full_attention", "sliding_attention", "linear_attention", ""]), max_size=3))
BLOCK_SIZES = _mostly_kept([ABSENT, None, -1, 0, 1, 2, 16, 2**31, "4", 4.0])
WINDOWS = _mostly_kept([ABSENT, 0, 1, 3, 64, -1])
TARGET_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]
SERVING = st.fixed_dictionaries({
    "verb": st.sampled_from(["serve-check", "compare --serve"]), "target": st.booleans(),
    "where": st.sampled_from(["dflash_config", "", "both"]), "target_layer_ids": LAYER_IDS,
    "layer_types": LAYER_TYPES, "sliding_window": WINDOWS, "block_size": BLOCK_SIZES, "mask_token_id": MASK_IDS,
    "num_target_layers": _mostly_kept([ABSENT, 1, 12]),
    "spec_ids": st.sampled_from([None, None, "0,1", "1", "0,1,1", "0,1,2,3,4"]),
    "removed": st.lists(st.sampled_from(TARGET_FILES), max_size=4, unique=True),
    "eos_only_in_tokenizer": st.booleans()})


# The gguf reader mutates a real GGUF, the test drafter as llama.cpp's own converter writes it (`convert --for
# llamacpp`): its bytes where a count, a type, a length or an offset lies (header counts, a key's value type, a
# string's length, a tensor's dimensions, type and data offset; a truncation), and what it says, rewritten by the
# gguf package's GGUFWriter (the converter's writer): a key's value and type, a key removed, another architecture's
# name, a tensor removed, renamed or of another shape or type. Through every verb that reads a GGUF.
GGUF_VERBS = ["compare", "serve-check", "serve-check", "serve-check all", "eval", "convert"]
FIELD_INTS = (st.sampled_from([0, 1, 2, 3, 7, 8, 9, 13, 31, 2**31, 2**32 - 1, 2**40, 2**60, 2**63, 2**64 - 1])
              | st.integers(0, 2**64 - 1))
GGUF_KEYS = ["general.architecture", "dflash.block_count", "dflash.block_size", "dflash.target_layers",
             "dflash.embedding_length", "dflash.feed_forward_length", "dflash.attention.head_count",
             "dflash.attention.head_count_kv", "dflash.attention.key_length", "dflash.rope.freq_base",
             "dflash.attention.layer_norm_rms_epsilon", "dflash.attention.sliding_window",
             "dflash.attention.sliding_window_pattern", "dflash.attention.causal", "dflash.conv_kernel_size",
             "dflash.conv_group_size", "dflash.selector_rank", "dflash.selector_top_k", "dflash.sample_from_anchor",
             "dflash.rope.dimension_count", "dflash.context_length", "dflash.logit_scale",
             "tokenizer.ggml.mask_token_id", "tokenizer.ggml.tokens", "tokenizer.ggml.eos_token_id"]
GGUF_SCALARS = (st.sampled_from([0, 1, 2, 3, 4, 8, 12, -1, 2**31, 2**32, 2**63, 2**64 - 1, 0.5, -1.0, float("nan"),
                                 True, False, "", "dflash", "1"])
                | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True, width=32) | st.text(max_size=8))
GGUF_VALUES = (st.just(ABSENT) | GGUF_SCALARS | st.lists(st.integers(-2, 5), min_size=1, max_size=6)  # (the writer
               | st.lists(st.booleans(), min_size=1, max_size=6)  # writes no empty array)
               | st.lists(st.text(max_size=4), min_size=1, max_size=3))
GGUF = st.one_of(
    st.fixed_dictionaries({"verb": st.sampled_from(GGUF_VERBS), "header": st.sampled_from(["tensors", "keys", "version"]),
                           "value": FIELD_INTS}),
    st.fixed_dictionaries({"verb": st.sampled_from(GGUF_VERBS), "key": st.integers(0, 40),
                           "part": st.sampled_from(["type", "name_length", "string_length", "array_type",
                                                    "array_count"]), "value": FIELD_INTS}),
    st.fixed_dictionaries({"verb": st.sampled_from(GGUF_VERBS), "tensor": st.integers(0, 40),
                           "part": st.sampled_from(["n_dims", "dim", "type", "offset", "name_length"]),
                           "value": FIELD_INTS}),
    st.fixed_dictionaries({"verb": st.sampled_from(GGUF_VERBS), "truncate": st.integers(0, 2_000_000)}),
    st.fixed_dictionaries({"verb": st.sampled_from(GGUF_VERBS), "set": st.sampled_from(GGUF_KEYS) | st.text(max_size=12),
                           "value": GGUF_VALUES}),
    st.fixed_dictionaries({"verb": st.sampled_from(GGUF_VERBS),
                           "architecture": st.sampled_from(["qwen3", "llama", "dflash2", "dspark", "", "DFLASH",
                                                            "eagle3"]) | st.text(max_size=8),
                           "rename_keys": st.booleans()}),
    st.fixed_dictionaries({"verb": st.sampled_from(GGUF_VERBS), "tensor": st.integers(0, 40),
                           "edit": st.sampled_from(["drop", "rename", "shape", "type"]),
                           "shape": st.lists(st.integers(0, 5), min_size=1, max_size=3),
                           "name": st.sampled_from(["blk.9.attn_q.weight", "token_embd.weight", "d2t", "x", ""])}))


# The trace reader mutates a real recording (`dflash-audit trace` of examples/own_trainer.py, one step): one field of
# its manifest set to another value or removed; one tensor of its tensor file removed, reshaped, retyped or filled
# with NaN, the manifest's size and hash updated (a consistent edit, so the audit reads it); or a `--ref` config
# whose ids, block size and mask id are of other counts and kinds. Through `trace --from`.
REF_VALUES = _mostly_kept(st.sampled_from([ABSENT, None, [], [1], [1, 3, 5, 7, 9], [1, 3, 5, 7], [0, 11], [-1, 99],
                                           "1,3", 5, 0, -1, 2**63, 1.5, "x", [None], ["a"], True]))
TRACE = st.one_of(
    st.fixed_dictionaries({"manifest": st.integers(0, 10**6), "value": JSON_VALUES, "delete": st.booleans()}),
    st.fixed_dictionaries({"tensor": st.integers(0, 10**6), "edit": st.sampled_from(["drop", "shape", "dtype", "nan", "huge", "negative"]),
                           "shape": st.lists(st.integers(0, 4), max_size=3),
                           "dtype": st.sampled_from(["float16", "int64", "bool", "float64"]),
                           "entry_too": st.booleans()}),
    st.fixed_dictionaries({"ref": st.fixed_dictionaries({"target_layer_ids": REF_VALUES, "block_size": REF_VALUES,
                                                         "mask_token_id": REF_VALUES}),
                           "nested": st.booleans()}))


# The recipe reader mutates what two drafters say of their training and family, for `compare`: each side's family
# (DFlash, DFlash2, DSpark, XPress), ours' spec (another layer count, block size, target layer count, a reduced
# vocabulary, the other slot layout), ours' recipe (fields set to other values and kinds, dropped as an older
# checkpoint lacks them, or listed unknown), and the reference as a z-lab folder (no recipe) or a checkpoint
# (its own recipe, also mutated).
FAMILIES = st.sampled_from(["dflash", "dflash2", "dspark", "xpress"])
RECIPE_FIELDS = ["gamma", "loss_fn", "per_position_loss_weight", "dpace_alpha", "verifier_source_layer",
                 "sample_from_anchor", "noise_std", "max_anchors", "selector_loss_alpha", "confidence_head_alpha",
                 "consistency_weight", "consistency_passes", "base_anchor_weight", "base_anchor_full_weight",
                 "ce_from_data", "data_hash", "extra"]
RECIPE_VALUES = (st.sampled_from([0.0, 0.5, 1.0, 7.0, -1.0, 0, 1, 3, 99, -1, True, False, None, "ce", "kl_div", "tv",
                                  '{"ce": 0.1, "tv": 0.9}', "dpace", "fixed-exp-decay", "none", "x", float("nan")])
                 | JSON_VALUES)
OURS_SPEC = st.dictionaries(st.sampled_from(["num_hidden_layers", "block_size", "target_layer_ids", "draft_vocab_size",
                                             "sample_from_anchor"]),
                            st.sampled_from([1, 2, 3, 8, 16, 32, (0,), (1,), (0, 1), True, False]), max_size=2)
RECIPE = st.fixed_dictionaries({
    "families": st.tuples(FAMILIES, FAMILIES), "ref_format": st.sampled_from(["zlab", "ckpt"]),
    "set": st.dictionaries(st.sampled_from(RECIPE_FIELDS), RECIPE_VALUES, max_size=3),
    "drop": st.lists(st.sampled_from(RECIPE_FIELDS), max_size=3, unique=True),
    "unknown": st.lists(st.sampled_from(RECIPE_FIELDS) | st.text(max_size=6), max_size=2, unique=True),
    "ref_set": st.dictionaries(st.sampled_from(RECIPE_FIELDS), RECIPE_VALUES, max_size=2),
    "spec": OURS_SPEC, "target": st.booleans()})


def strategies() -> dict:
    """Mutation strategies, one per reader."""
    return {
        "serving": SERVING,
        "gguf": GGUF,
        "trace": TRACE,
        "recipe": RECIPE,
        "config": st.fixed_dictionaries({"section": st.sampled_from(["", "dflash_config"]), "key": KEYS,
                                         "value": JSON_VALUES, "delete": st.booleans()}),
        "safetensors": st.one_of(
            st.fixed_dictionaries({"tensor": st.integers(0, 50),
                                   "field": st.sampled_from(["dtype", "shape", "data_offsets"]),
                                   "value": JSON_VALUES}),
            st.fixed_dictionaries({"length_delta": st.integers(-64, 64)}),
            st.fixed_dictionaries({"flip": st.integers(0, 4096), "byte": st.integers(0, 255)}),
            st.fixed_dictionaries({"header": JSON_VALUES})),
        "pickle": st.fixed_dictionaries({"entry": st.sampled_from(["spec", "recipe", "step", "model", "training_state",
                                                                   "recipe_unknown", "extra"]),
                                         "field": st.none() | KEYS, "value": PLAIN}),
        "yaml": st.one_of(st.fixed_dictionaries({"data": st.dictionaries(KEYS, JSON_VALUES, max_size=5)}),
                          st.fixed_dictionaries({"text": st.text(alphabet="ab01:-&*[]{}!$\n .,'\"#|>", max_size=80)})),
        "declaration": st.fixed_dictionaries({"data": JSON_VALUES | st.dictionaries(KEYS, JSON_VALUES, max_size=5)}),
        "index": st.one_of(st.fixed_dictionaries({"weight_map": st.dictionaries(st.text(max_size=30), JSON_VALUES
                                                                                | st.sampled_from(["shard.safetensors",
                                                                                                   "../x", "/etc/passwd",
                                                                                                   ""]),
                                                                                max_size=4)}),
                           st.fixed_dictionaries({"whole": JSON_VALUES})),
        "prompts": st.fixed_dictionaries({"lines": st.lists(
            JSON_VALUES.map(json.dumps) | st.dictionaries(st.sampled_from(["id", "prompt", "turns"]), JSON_VALUES,
                                                          max_size=3).map(json.dumps) | st.text(max_size=20),
            max_size=4)}),
        "key_map": st.fixed_dictionaries({"lines": st.lists(
            st.tuples(st.text(alphabet="abflyrs._\\d()[]^$+?|0129", max_size=16),
                      st.text(alphabet="abflyrs._\\12", max_size=12)).map(lambda pair: " => ".join(pair))
            | st.text(max_size=20), max_size=4)}),
    }


def _tensor(spec: dict) -> torch.Tensor:
    dtype = getattr(torch, spec["tensor"])
    return torch.zeros(spec["shape"], dtype=dtype)


def _plain(value):
    """A PLAIN example as pickled data: {"tensor", "shape"} dicts become tensors."""
    if isinstance(value, dict) and set(value) == {"tensor", "shape"}:
        return _tensor(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _rewrite_header(path: Path, mutation: dict) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8:8 + length]), data[8 + length:]
    if "length_delta" in mutation:
        path.write_bytes(struct.pack("<Q", max(0, length + mutation["length_delta"])) + data[8:])
        return
    if "flip" in mutation:
        raw = bytearray(data)
        raw[min(mutation["flip"], len(raw) - 1)] = mutation["byte"]
        path.write_bytes(bytes(raw))
        return
    if "header" in mutation:
        header = mutation["header"]
    else:
        names = sorted(k for k in header if k != "__metadata__")
        header[names[mutation["tensor"] % len(names)]][mutation["field"]] = mutation["value"]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def _serving_value(value, vocab: int, eos: int):
    symbols = {"vocab-1": vocab - 1, "vocab": vocab, "vocab+1": vocab + 1, "eos": eos}
    return symbols.get(value, value) if isinstance(value, str) else value


def build_serving(mutation: dict, world: Path, work: Path) -> list:
    """A z-lab drafter whose serving fields are `mutation`'s, and a target copy without some tokenizer files."""
    shutil.copytree(world / "zref", work / "z")
    shutil.copytree(world / "target", work / "target")
    target_config = json.loads((work / "target" / "config.json").read_text())
    vocab, eos = target_config["vocab_size"], target_config.get("eos_token_id") or 0
    config = json.loads((work / "z" / "config.json").read_text())
    for key in ("target_layer_ids", "layer_types", "sliding_window", "block_size", "mask_token_id",
                "num_target_layers"):
        value = _serving_value(mutation[key], vocab, eos)
        if value == KEEP:
            continue
        places = {"dflash_config": [config["dflash_config"]], "": [config],
                  "both": [config, config["dflash_config"]]}[mutation["where"]]
        if key in ("layer_types", "sliding_window", "num_target_layers"):
            places = [config]  # top-level fields of a z-lab config
        for place in places:
            if value == ABSENT:
                place.pop(key, None)
            else:
                place[key] = value
    (work / "z" / "config.json").write_text(json.dumps(config))
    for name in mutation["removed"]:
        (work / "target" / name).unlink(missing_ok=True)
    if mutation["eos_only_in_tokenizer"]:
        for name in ("config.json", "generation_config.json"):
            if (work / "target" / name).is_file():
                data = json.loads((work / "target" / name).read_text())
                data.pop("eos_token_id", None)
                (work / "target" / name).write_text(json.dumps(data))
    spec = ["--spec", f"target_layer_ids={mutation['spec_ids']}"] if mutation["spec_ids"] else []
    target = ["--target", work / "target"] if mutation["target"] else []
    if mutation["verb"] == "serve-check":
        return ["serve-check", "--drafter", work / "z", "--engine", "vllm,sglang", *target, *spec,
                "--json", work / "report.json"]
    specs = [flag if flag != "--spec" else side for side in ("--ours-spec", "--ref-spec") for flag in spec]
    return ["compare", "--ours", work / "z", "--ref", world / "zref", "--serve", "vllm,sglang", *target, *specs,
            "--max-new-tokens", "2", "--out", work / "report"]


def _gguf_value_type(value):
    """The GGUF value type a Python value is written as (a list: an array of its first item's type)."""
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return (GGUFValueType.INT32 if -(2**31) <= value < 2**31 else GGUFValueType.UINT64 if value >= 0
                else GGUFValueType.INT64)
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    return GGUFValueType.ARRAY


def _rewrite_gguf(source: Path, destination: Path, mutation: dict) -> None:
    """`source` read by GGUFReader and written again by GGUFWriter, with one key, the architecture or one tensor
    changed as `mutation` says."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    keys = {name: (field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
            for name, field in reader.fields.items() if not name.startswith("GGUF.") and name != "general.architecture"}
    if "architecture" in mutation:
        arch = mutation["architecture"]
        if mutation["rename_keys"]:
            keys = {(f"{arch}.{name.split('.', 1)[1]}" if name.startswith("dflash.") else name): value
                    for name, value in keys.items()}
    if "set" in mutation:
        value = mutation["value"]
        if value == ABSENT:
            keys.pop(mutation["set"], None)
        elif mutation["set"] == "general.architecture":
            arch = str(value)
        else:
            kind = _gguf_value_type(value)
            item = _gguf_value_type(value[0]) if kind == GGUFValueType.ARRAY and value else GGUFValueType.INT32
            keys[mutation["set"]] = (value, kind, item if kind == GGUFValueType.ARRAY else None)
    tensors = [(t.name, np.array(t.data), t.tensor_type) for t in reader.tensors]
    if "edit" in mutation and tensors:
        index = mutation["tensor"] % len(tensors)
        name, data, kind = tensors[index]
        if mutation["edit"] == "drop":
            del tensors[index]
        elif mutation["edit"] == "rename":
            tensors[index] = (mutation["name"] or name + "x", data, kind)
        elif mutation["edit"] == "shape":
            tensors[index] = (name, np.zeros(mutation["shape"], dtype=np.float32), GGMLQuantizationType.F32)
        else:
            tensors[index] = (name, data.astype(np.float16), GGMLQuantizationType.F16)
    writer = GGUFWriter(str(destination), arch)
    for name, (value, kind, item) in keys.items():
        writer.add_key_value(name, value, kind, sub_type=item)
    for name, data, kind in tensors:
        writer.add_tensor(name, data, raw_dtype=kind if kind not in (GGMLQuantizationType.F32,
                                                                    GGMLQuantizationType.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _patch_gguf(source: Path, destination: Path, mutation: dict) -> None:
    """`source`'s bytes with one count, type, length or offset overwritten (found through GGUFReader's field
    offsets), or cut short."""
    from gguf import GGUFReader

    data = bytearray(source.read_bytes())
    if "truncate" in mutation:
        destination.write_bytes(bytes(data[:mutation["truncate"] % len(data)]))
        return
    value = mutation["value"]

    def put(offset: int, width: int) -> None:
        data[offset:offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")

    reader = GGUFReader(str(source))
    if "header" in mutation:
        put({"version": 4, "tensors": 8, "keys": 16}[mutation["header"]], 4 if mutation["header"] == "version" else 8)
    elif "key" in mutation:
        fields = [f for name, f in reader.fields.items() if not name.startswith("GGUF.")]
        field = fields[mutation["key"] % len(fields)]
        name_end = field.offset + 8 + int(field.parts[0][0])
        part = mutation["part"]
        if part == "name_length":
            put(field.offset, 8)
        elif part == "type":
            put(name_end, 4)
        elif part == "string_length" and len(field.types) == 1 and int(field.types[0]) == STRING_TYPE:
            put(name_end + 4, 8)
        elif part in ("array_type", "array_count") and int(field.types[0]) == ARRAY_TYPE:
            put(name_end + 4, 4) if part == "array_type" else put(name_end + 8, 8)
        else:
            put(name_end, 4)  # a key with no such part: its type instead
    else:
        tensor = reader.tensors[mutation["tensor"] % len(reader.tensors)]
        start = tensor.field.offset
        name_end = start + 8 + int(tensor.field.parts[0][0])
        dims = len(tensor.shape)
        offset = {"name_length": start, "n_dims": name_end, "dim": name_end + 4,
                  "type": name_end + 4 + 8 * dims, "offset": name_end + 8 + 8 * dims}[mutation["part"]]
        put(offset, 4 if mutation["part"] in ("n_dims", "type") else 8)
    destination.write_bytes(bytes(data))


STRING_TYPE, ARRAY_TYPE = 8, 9


def build_gguf(mutation: dict, world: Path, work: Path) -> list:
    """The mutated GGUF under `work`, and the verb that reads it (`world`: tests/bad_inputs/conftest.py's
    gguf_world: drafter.gguf, ref.pt its source, target, prompts.jsonl)."""
    drafter = work / "drafter.gguf"
    if any(key in mutation for key in ("set", "architecture", "edit")):
        _rewrite_gguf(world / "drafter.gguf", drafter, mutation)
    else:
        _patch_gguf(world / "drafter.gguf", drafter, mutation)
    target = world / "target"
    verb = mutation["verb"]
    if verb == "compare":
        return ["compare", "--ours", drafter, "--ref", world / "ref.pt", "--target", target, "--static-only",
                "--out", work / "report"]
    if verb == "serve-check":
        return ["serve-check", "--drafter", drafter, "--engine", "llamacpp", "--target", target,
                "--json", work / "report.json"]
    if verb == "serve-check all":  # vLLM and SGLang judge its conversion
        return ["serve-check", "--drafter", drafter, "--engine", "vllm,sglang,llamacpp", "--target", target,
                "--json", work / "report.json"]
    if verb == "eval":
        return ["eval", "--drafter", drafter, "--target", target, "--prompts", world / "prompts.jsonl",
                "--max-new-tokens", "2"]
    return ["convert", "--from", drafter, "--to", work / "report-converted", "--format", "zlab", "--target", target]


def _manifest_paths(value, path=()) -> list:
    """Every place in a manifest (dict keys, the first items of lists), as key paths, in a fixed order."""
    places = [path] if path else []
    if isinstance(value, dict):
        for key in sorted(value):
            places += _manifest_paths(value[key], (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:3]):
            places += _manifest_paths(item, (*path, index))
    return places


def build_trace(mutation: dict, world: Path, work: Path) -> list:
    """The mutated recording under `work` (`world`: tests/bad_inputs/conftest.py's trace_world, a recording in
    `rec`), and `trace --from` on it."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(world / "rec", work / "rec")
    manifest_path, tensors_path = work / "rec" / "manifest.json", work / "rec" / "recording.safetensors"
    manifest = json.loads(manifest_path.read_text())
    extra = []
    if "manifest" in mutation:
        paths = _manifest_paths(manifest)
        *parents, last = paths[mutation["manifest"] % len(paths)]
        place = manifest
        for key in parents:
            place = place[key]
        if mutation["delete"] and isinstance(place, dict):
            del place[last]
        else:
            place[last] = mutation["value"]
    elif "tensor" in mutation:
        with safe_open(str(tensors_path), "pt") as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        name = sorted(tensors)[mutation["tensor"] % len(tensors)]
        if mutation["edit"] == "drop":
            del tensors[name]
        elif mutation["edit"] == "shape":
            tensors[name] = torch.zeros(mutation["shape"], dtype=tensors[name].dtype)
        elif mutation["edit"] == "dtype":
            tensors[name] = tensors[name].to(getattr(torch, mutation["dtype"]))
        elif mutation["edit"] == "nan":
            tensors[name] = torch.full_like(tensors[name], float("nan")) if tensors[name].is_floating_point() \
                else tensors[name]
        else:  # values far out of range: token ids past the vocabulary, activations past any tolerance
            big = 2**31 - 1 if not tensors[name].is_floating_point() else 1e30
            tensors[name] = torch.full_like(tensors[name], -big if mutation["edit"] == "negative" else big) \
                if tensors[name].dtype != torch.bool else tensors[name]
        save_file(tensors, str(tensors_path), metadata=metadata)
        step, entry = name.split("/", 1)
        if mutation["entry_too"] and entry in manifest["steps"][int(step[4:])]["entries"]:
            # the manifest edited with it: its entry says the new shape and dtype
            recorded = manifest["steps"][int(step[4:])]["entries"][entry]
            if name in tensors:
                recorded.update(shape=list(tensors[name].shape), dtype=str(tensors[name].dtype).replace("torch.", ""))
            else:
                del manifest["steps"][int(step[4:])]["entries"][entry]
        manifest["tensors_bytes"] = tensors_path.stat().st_size
        manifest["tensors_sha256"] = hashlib.sha256(tensors_path.read_bytes()).hexdigest()
    else:
        config = {}
        for key, value in mutation["ref"].items():
            if value not in (KEEP, ABSENT):
                config[key] = value
        (work / "ref.json").write_text(json.dumps({"dflash_config": config} if mutation["nested"] else config))
        extra = ["--ref", work / "ref.json"]
    manifest_path.write_text(json.dumps(manifest))
    return ["trace", "--from", work / "rec", "--out", work / "report", *extra]


FAMILY_FIELDS = {"dflash2": dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=2),
                 "dspark": dict(markov_rank=16, markov_head_type="vanilla", enable_confidence_head=True,
                                confidence_head_with_markov=True, sample_from_anchor=True),
                 "xpress": dict(xpress_rank=16, xpress_mlp_ratio=2, num_jacobi_passes=3)}


def _family_drafter(base, family: str, changes: dict):
    """The world's drafter spec as a drafter of `family` with `changes` (each kept only where the spec takes it),
    random weights from a fixed seed."""
    from impl.model import DFlashDrafter
    from impl.spec import SpecError

    spec = base.replace(**FAMILY_FIELDS.get(family, {}))
    for name, value in changes.items():
        change = {name: value}
        if name == "num_hidden_layers" and type(value) is int:  # another depth, all full attention as the world's
            change["layer_types"] = ("full_attention",) * value
        try:
            spec = spec.replace(**change)
        except (SpecError, ValueError, TypeError):
            pass  # a change this drafter cannot take is no drafter: the example keeps the rest
    torch.manual_seed(0)
    return DFlashDrafter(spec)


def _edited_recipe(recipe: dict, values: dict, dropped: list) -> dict:
    edited = {**recipe, **values}
    for name in dropped:
        edited.pop(name, None)
    return edited


def build_recipe(mutation: dict, world: Path, work: Path) -> list:
    """Two drafters of the mutated families, specs and recipes under `work`, and `compare` on them."""
    from drafter_files.checkpoint import load_checkpoint
    from drafter_files.zlab_format import save_zlab_dir
    from foundation.ckpt_file import write_ckpt
    from impl.recipe import Recipe

    base = load_checkpoint(world / "ours.pt")
    recipe = (base.recipe or Recipe()).to_dict()
    ours = _family_drafter(base.spec, mutation["families"][0], mutation["spec"])
    write_ckpt(work / "ours.pt", ours.spec.to_dict(), ours.state_dict(),
               _edited_recipe(recipe, mutation["set"], mutation["drop"]), recipe_unknown=mutation["unknown"])
    ref = _family_drafter(base.spec, mutation["families"][1], {})
    if mutation["ref_format"] == "zlab" and ref.spec.family in ("dflash", "dflash2"):
        save_zlab_dir(work / "ref", ref.spec, ref.state_dict())
    else:
        write_ckpt(work / "ref.pt", ref.spec.to_dict(), ref.state_dict(), _edited_recipe(recipe, mutation["ref_set"], []))
    reference = work / "ref" if (work / "ref").is_dir() else work / "ref.pt"
    target = ["--target", world / "target"] if mutation["target"] else []
    return ["compare", "--ours", work / "ours.pt", "--ref", reference, "--static-only", *target,
            "--out", work / "report"]


def build(reader: str, mutation: dict, world: Path, work: Path) -> list:
    """The hostile input for `mutation` under `work`, and the CLI arguments that read it."""
    static = ["--out", work / "report"]
    if reader == "serving":
        return build_serving(mutation, world, work)
    if reader == "gguf":
        return build_gguf(mutation, world, work)
    if reader == "trace":
        return build_trace(mutation, world, work)
    if reader == "recipe":
        return build_recipe(mutation, world, work)
    if reader == "config":
        shutil.copytree(world / "zref", work / "z")
        config = json.loads((work / "z" / "config.json").read_text())
        where = config.setdefault(mutation["section"], {}) if mutation["section"] else config
        if not isinstance(where, dict):
            where = config
        if mutation["delete"]:
            where.pop(mutation["key"], None)
        else:
            where[mutation["key"]] = mutation["value"]
        (work / "z" / "config.json").write_text(json.dumps(config))
        return ["compare", "--ours", world / "ours.pt", "--ref", work / "z", *static]
    if reader == "safetensors":
        shutil.copytree(world / "zref", work / "z")
        _rewrite_header(work / "z" / "model.safetensors", mutation)
        return ["compare", "--ours", world / "ours.pt", "--ref", work / "z", *static]
    if reader == "pickle":
        payload = torch.load(world / "ours.pt", weights_only=True)
        value = _plain(mutation["value"])
        if mutation["field"] is not None and isinstance(payload.get(mutation["entry"]), dict):
            payload[mutation["entry"]] = dict(payload[mutation["entry"]], **{mutation["field"]: value})
        else:
            payload[mutation["entry"]] = value
        torch.save(payload, work / "fuzzed.pt")
        return ["compare", "--ours", work / "fuzzed.pt", "--ref", world / "zref", *static]
    if reader == "yaml":
        import yaml

        folder = work / "lightning_logs" / "version_0"
        (folder / "checkpoints").mkdir(parents=True)
        shutil.copy(world / "plain.pt", folder / "checkpoints" / "last.ckpt")
        text = mutation["text"] if "text" in mutation else yaml.safe_dump(mutation["data"], allow_unicode=True)
        (folder / "hparams.yaml").write_text(text)
        return ["compare", "--ours", folder / "checkpoints" / "last.ckpt", "--ref", world / "zref", *static]
    if reader == "declaration":
        (work / "run").mkdir()
        shutil.copy(world / "plain.pt", work / "run" / "model.pt")
        (work / "run" / "args.json").write_text(json.dumps(mutation["data"]))
        return ["compare", "--ours", work / "run" / "model.pt", "--ref", world / "zref", *static]
    if reader == "index":
        shutil.copytree(world / "zref", work / "z")
        (work / "z" / "model.safetensors").rename(work / "z" / "shard.safetensors")
        (work / "z" / "model.safetensors.index.json").write_text(
            json.dumps(mutation["whole"] if "whole" in mutation else {"weight_map": mutation["weight_map"]}))
        return ["compare", "--ours", world / "ours.pt", "--ref", work / "z", *static]
    if reader == "prompts":
        (work / "prompts.jsonl").write_text("".join(line + "\n" for line in mutation["lines"]))
        return ["eval", "--drafter", world / "ours.pt", "--target", world / "target", "--prompts",
                work / "prompts.jsonl", "--max-new-tokens", "2", "--truncate"]
    if reader == "key_map":
        (work / "keys.map").write_text("".join(line + "\n" for line in mutation["lines"]))
        return ["compare", "--ours", world / "plain.pt", "--ref", world / "zref", "--key-map", work / "keys.map",
                *static]
    raise ValueError(reader)


def check_example(reader: str, mutation: dict, world: Path) -> None:
    """Build, run the CLI in-process, and hold the outcome to the rules; AssertionError naming the breach."""
    import contextlib
    import io

    with tempfile.TemporaryDirectory(prefix="dflash-fuzz-") as scratch:
        work = Path(scratch)
        argv = [str(a) for a in build(reader, mutation, world, work)]
        inputs = {p: tree_digest(p) for p in (work, world)}
        inputs = {p: {k: v for k, v in d.items() if not k.startswith("report")} for p, d in inputs.items()}
        err, out = io.StringIO(), io.StringIO()
        started = time.monotonic()
        with recorded_refusals() as seen, contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = cli.main(argv)
        elapsed = time.monotonic() - started
        text = err.getvalue()
        breach = f"{reader} {json.dumps(mutation, default=str)[:400]}"
        assert code in (0, 1, 2), (breach, code, text[-500:])
        assert "Traceback" not in text, (breach, text[-500:])
        assert not offences(seen), (breach, offences(seen))
        assert elapsed < TIME_BOUND, (breach, elapsed)
        for path, digest in inputs.items():
            now = {k: v for k, v in tree_digest(path).items() if not k.startswith("report")}
            assert now == digest, (breach, "an input changed", path)
        left = [p for p in work.rglob(TMP_DIR)]
        assert not left, (breach, "temp left", left)
