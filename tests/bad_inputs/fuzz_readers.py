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


def strategies() -> dict:
    """Mutation strategies, one per reader."""
    return {
        "serving": SERVING,
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


def build(reader: str, mutation: dict, world: Path, work: Path) -> list:
    """The hostile input for `mutation` under `work`, and the CLI arguments that read it."""
    static = ["--out", work / "report"]
    if reader == "serving":
        return build_serving(mutation, world, work)
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
