"""vLLM 0.33.0 and the two families speculators writes beside DFlash: what its DSpark and XPress model files
(`qwen3_dspark.py`, `qwen3_xpress.py`) and runners (`v1/worker/gpu/spec_decode/dspark/`, `xpress/`) read from a
drafter directory, what they drop and what they default. `vllm_engine.resolve` calls these after vLLM's own config
translation (`update_dspark`, called through `SpeculatorsConfig`); the rules' engine lines are in `rules.py`.

- DSpark: the DFlash backbone (the same executed attention and capture rules) plus `DSparkMarkovHead`, which has
  the vanilla head's two tensors only, whatever `markov_head_type` says; the runner's slot layout from the
  translated `sample_from_anchor`.
- XPress: vLLM's speculators translation has no `xpress`, so a speculators directory is refused before any model
  file runs; `xpress_values` says what the XPress files would read from its keys and tensors all the same.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from impl.families import HEAD_PREFIXES
from serving_engines import rules
from serving_engines.source_exec import compile_definitions

# qwen3_dspark.py DSparkMarkovHead: the parameters it builds (markov_w1, markov_w2): the vanilla head only.
DSPARK_MARKOV_PARAMS = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
# The XPress files' defaults for the config keys they read (qwen3_xpress.py Qwen3XPressModel, xpress/speculator.py);
# the refiner's block defaults to `num_speculative_steps` (15, a key no vLLM file sets) + 1.
XPRESS_DEFAULTS = {"xpress_num_passes": 6, "xpress_rank": 256, "xpress_mlp_hidden": 512, "xpress_block_size": 16,
                   "xpress_topc": 512}
# Slot 0's predecessor in the refiner's latent pass: vLLM passes the anchor (`tok_am1 = anchor_ids`).
SLOT0_SERVED = "the anchor"


@lru_cache(maxsize=1)
def _mask_token_rule():
    return compile_definitions(rules.VLLM_SPEC_UTILS, ["get_parallel_drafting_token_id"])[
        "get_parallel_drafting_token_id"]


@lru_cache(maxsize=1)
def xpress_architectures() -> frozenset[str]:
    """The architectures vLLM serves as XPress (config/speculative.py, executed: its import takes seconds)."""
    return compile_definitions(rules.VLLM_SPEC_CONFIG, ["XPRESS_ARCHITECTURES"])["XPRESS_ARCHITECTURES"]


def translated_types() -> list[str]:
    """The `speculators_model_type`s vLLM's speculators config code translates (called)."""
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES

    return list(SUPPORTED_SPECULATORS_TYPES)


def untranslated(kind: str | None) -> str | None:
    """vLLM's refusal of a speculators type it has no translation for, in one line (its own message lists
    function objects); None when it translates `kind`."""
    known = translated_types()
    if kind in known:
        return None
    return (f"ValueError: vLLM's speculators config translation has no {kind!r} (it translates {', '.join(known)}): "
            "it refuses the directory before any model file runs")


def dspark_values(hf, k: int | None, names: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(served values, refused tensor names) of a DSpark drafter as `update_dspark` translated it (`hf`), served
    with `k` speculative tokens."""
    anchor_sampled = bool(getattr(hf, "sample_from_anchor", True))  # the DSpark runner's default
    refused = sorted(n for n in names if n.startswith("markov_head.") and n not in DSPARK_MARKOV_PARAMS)
    values = {
        "sample_from_anchor": anchor_sampled,
        # The runner's query block: K predictions from the anchor on, or the anchor as bonus token plus K masks.
        "block_size": None if k is None else (k if anchor_sampled else 1 + k),
        "mask_token_id": _mask_token_rule()(hf),
        "markov_head_type": "vanilla",  # Qwen3DSparkModel builds DSparkMarkovHead whatever the config says
        "markov_rank": getattr(hf, "markov_rank", None),
        "enable_confidence_head": bool(getattr(hf, "enable_confidence_head", False)),
        "confidence_head_with_markov": bool(getattr(hf, "confidence_head_with_markov", False)),
    }
    return values, refused


def dspark_refusal(refused: list[str]) -> str:
    return (f"ValueError: its Qwen3DSparkModel builds the vanilla Markov head only ({', '.join(DSPARK_MARKOV_PARAMS)}):"
            f" AutoWeightsLoader finds no parameter for {', '.join(refused)}")


def xpress_values(config: dict[str, Any], names: list[str], vocab_size: int | None) -> dict[str, Any]:
    """What the XPress model file and runner read from the drafter's keys (top level, where `getattr(config, ...)`
    finds them) and tensors: speculators writes `num_jacobi_passes`, `xpress_mlp_ratio` and `refiner_head.*`,
    names no vLLM file reads, so their defaults run and its tensors have no parameter."""
    def key(name):
        return config.get(name, XPRESS_DEFAULTS[name])

    topc = key("xpress_topc")
    return {
        "num_jacobi_passes": int(key("xpress_num_passes")),
        "xpress_rank": int(key("xpress_rank")),
        "xpress_mlp_hidden": int(key("xpress_mlp_hidden")),
        "refiner_block_size": int(config.get("xpress_block_size") or XPRESS_DEFAULTS["xpress_block_size"]),
        # Top-C narrowing: the refiner scores the base logits' top C candidates only (0: the whole vocabulary).
        "refiner_candidates": min(topc, vocab_size) if topc and vocab_size else vocab_size,
        "refiner_slot0": SLOT0_SERVED,
        "sample_from_anchor": False,  # the XPress runner refuses true
        # speculators' refiner module: vLLM's XPress model has no `refiner_head` (load_weights reads xpress_head.*).
        "tensors_refused": sorted(n for n in names if n.startswith(HEAD_PREFIXES["xpress"])),
    }


def xpress_notes(config: dict[str, Any]) -> list[str]:
    archs = sorted(xpress_architectures())
    found = config.get("architectures") or []
    notes = [f"what qwen3_xpress.py and the XPress runner would read from this directory's keys and tensors, had "
             f"the config been translated: they read xpress_head.*, xpress_num_passes and xpress_mlp_hidden, "
             f"names speculators does not write"]
    if not set(found) & set(archs):
        notes.append(f"vLLM serves XPress only for the architectures {', '.join(archs)} (under method \"dflash\"); "
                     f"this directory names {', '.join(found) or 'none'}")
    return notes


V2_ONLY = ("vLLM serves {family} only on its V2 model runner (its V1 runner refuses \"{family_lower} speculative "
           "decoding\"), which needs Triton: a GPU")


def v2_note(family_title: str) -> str:
    return V2_ONLY.format(family=family_title, family_lower=family_title.lower())
