"""The normalized description of a DFlash drafter (`DraftSpec`): every setting declared once, as a pydantic field;
how it was trained is `impl/recipe.py`.

Every format (ours, z-lab, speculators) is translated into a `DraftSpec` by its loader.
Target layer ids are always in the z-lab convention: the 0-based decoder layer whose
*output* is used, read from a Hugging Face `hidden_states` tuple as `hs[id + 1]`.

Each field carries its type, its default, its bounds and its description, and in `json_schema_extra`:
- `speculators`: where speculators 0.9.0 keeps it (None: speculators has no such setting);
- `zlab`: where z-lab's dflash 0.1.0 config.json keeps it (None: z-lab has none);
- `default_of`: whose default the field's default is (REQUIRED: a drafter always states it, or it is read from
  its weights or its target);
- `names`: the other keys a config, a checkpoint or training args declare it under (None: it is never read from
  a declaration by name; its reader reads it);
- `family`: the family whose own setting it is (set together with the family's others, or all None);
- `flags`, `train_default`, `train_default_of`, `train_field`: for a setting `dflash-audit train` takes, its
  option, what `train` uses without it, whose that is, and the run field it fills (when not the setting's name).

Derived from these declarations, never written again: each setting's own range check (pydantic's) and its message
(impl/settings.py, `problem_with` for one value), the family tables (`FAMILY_FIELDS`), the config keys the readers
recognize (dflash_audit/formats/setting_names.py), the `train` options of the spec settings and their help
(dflash_audit/commands/train.py), `RunSettings`' spec fields (impl/run_settings.py), and the spec table of
docs/training.md (`python -m impl.spec`; tests/test_spec_settings.py keeps the page equal to it). The rules between
settings (heads divisible, layer ids inside the target, one family at a time, ...) are `DraftSpec.validate`'s.
"""

from __future__ import annotations

import numbers
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic.fields import FieldInfo

from foundation.errors import SpecError  # the spec's error; foundation's so config readers below impl raise it
from foundation.token_ids import is_token_id
from impl import settings, slot_layout
from impl.settings import Declared
from impl.defaults import BLOCK_SIZE_DEFAULTS, QWEN3_DEFAULTS, ROTARY_DEFAULTS, ZLAB_EXTRAS
from impl.families import TITLES, spec_family
from impl.layers import layers_outside

LAYER_TYPES = ("full_attention", "sliding_attention")
MarkovHeadType = Literal["vanilla", "gated", "rnn"]  # speculators' DSparkSpeculatorConfig.markov_head_type
# Rotary styles, in vLLM's terms (`is_neox_style`): neox rotates the two halves of the head (transformers'
# `rotate_half`, what Qwen3 and both references do); gptj rotates interleaved pairs (even, odd dims).
RopeStyle = Literal["neox", "gptj"]
# Sizes past these are no model's: a typo or a hostile config, refused before any tensor is sized by them.
MAX_DIMENSION = 1 << 24
MAX_POSITIONS = 1 << 30

REQUIRED = "none: every drafter states it, or it is read from its weights or its target"
QWEN3 = "transformers' Qwen3Config(), which both references build their layers from"
ZLAB_EXTRA = "z-lab's dflash_config (a no-op; speculators has none)"


def setting(default: Any, description: str, *, speculators: str | None, zlab: str | None, default_of: str,
            names: tuple[str, ...] | None = (), family: str | None = None, flags: tuple[str, ...] = (),
            train_default: Any = None, train_default_of: str | None = None, train_field: str | None = None,
            **bounds: Any) -> Any:
    """A spec field with everything the rest of the tool derives from it."""
    extra = {"speculators": speculators, "zlab": zlab, "default_of": default_of, "family": family,
             "names": None if names is None else list(names), "flags": list(flags)}
    if flags:
        extra.update(train_default=train_default, train_default_of=train_default_of or default_of,
                     train_field=train_field)
    return Field(default, description=description, json_schema_extra=extra, **bounds)


def size(description: str, *, speculators: str | None, zlab: str | None, top: int = MAX_DIMENSION, **extra: Any):
    """A required size: a positive integer no real model exceeds."""
    return setting(..., description, speculators=speculators, zlab=zlab, default_of=REQUIRED, gt=0, le=top, **extra)


# Activations transformers' ACT2FN holds (tests/test_spec.py checks each): these are accepted without importing
# transformers.activations, which takes seconds (it pulls the hub kernels) that a static audit never needs; any
# other name is looked up there.
COMMON_ACTIVATIONS = frozenset({"silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu"})


def is_known_activation(name: object) -> bool:
    """Whether a Qwen3 layer can be built with this `hidden_act` (a key of transformers' ACT2FN)."""
    if not isinstance(name, str):
        return False
    if name in COMMON_ACTIVATIONS:
        return True
    from transformers.activations import ACT2FN

    return name in ACT2FN


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise SpecError(field_name, message)




class DraftSpec(Declared):
    """A drafter's architecture, in the z-lab layer-id convention. Built only through its checks: a bad value is a
    SpecError naming the field (never a pydantic error); list-valued settings are tuples, so specs compare and
    hash by value."""

    SUBJECT = "spec"
    INTEGER_WORDS = True

    hidden_size: int = size("the drafter's hidden size (the target's: fc maps the target's features into it)",
                            names=("hidden_dim", "d_model", "n_embd", "dim"),
        speculators="transformer_layer_config.hidden_size", zlab="hidden_size")
    intermediate_size: int = size("the width of each draft layer's MLP",
                                  names=("ffn_dim", "ffn_hidden_size", "mlp_dim"),
        speculators="transformer_layer_config.intermediate_size", zlab="intermediate_size")
    num_attention_heads: int = size("attention heads per draft layer",
                                    names=("num_heads", "n_heads", "n_head"),
        speculators="transformer_layer_config.num_attention_heads",
                                    zlab="num_attention_heads")
    num_key_value_heads: int = size("key/value heads per draft layer (grouped-query attention)",
                                    names=("num_kv_heads", "n_kv_heads"),
        speculators="transformer_layer_config.num_key_value_heads",
                                    zlab="num_key_value_heads")
    head_dim: int = size("dims per attention head", speculators="transformer_layer_config.head_dim", zlab="head_dim")
    num_hidden_layers: int = size(
        "draft decoder layers", names=("num_draft_layers", "draft_layers", "n_draft_layers", "num_layers", "n_layers", "draft_num_layers"),
        speculators="transformer_layer_config.num_hidden_layers", zlab="num_hidden_layers",
        flags=("--draft-layers",), train_default=1, train_default_of="ours (one layer: the smallest drafter)",
        train_field="draft_layers")
    target_vocab_size: int = size(
        "the TARGET's vocabulary: token ids, embeddings and the verifier's head (read from the target in `train`)",
        names=("vocab_size",),
        speculators="transformer_layer_config.vocab_size", zlab="vocab_size")
    target_layer_ids: tuple[int, ...] = setting(
        ..., "target decoder layers whose outputs feed fc (0-based, z-lab's convention: hidden state id + 1)",
        names=("target_layers", "fc_layers", "fc_layer_ids", "layer_ids", "feature_layers", "context_layers", "aux_hidden_state_layer_ids"),
        speculators="aux_hidden_state_layer_ids (id + 1)", zlab="dflash_config.target_layer_ids",
        default_of=REQUIRED, flags=("--target-layer-ids", "--fc-layers"),
        train_default_of="z-lab's build_target_layer_ids", strict=False)  # a list too; each id checked below
    num_target_layers: int = size("decoder layers of the target (verifier)",
                                  names=("target_num_layers", "num_target_hidden_layers", "target_num_hidden_layers", "verifier_num_layers"),
        speculators="the verifier's num_hidden_layers", zlab="num_target_layers")
    mask_token_id: int = setting(
        ..., "the token filling a block's empty slots (a row of the target's vocabulary)",
        names=("mask_id", "mask_token"),
        speculators="mask_token_id", zlab="dflash_config.mask_token_id", default_of=REQUIRED,
        flags=("--mask-token-id",), train_default_of="the tokenizer's <|mask|> token")
    block_size: int = setting(
        BLOCK_SIZE_DEFAULTS["zlab"], "tokens per draft block B (the anchor and B - 1 mask slots)",
        names=("draft_block_size", "block_len"),
        speculators="block_size", zlab="dflash_config.block_size",
        default_of=f"z-lab's dflash (speculators' DFlashSpeculatorConfig says {BLOCK_SIZE_DEFAULTS['speculators']})",
        gt=0, le=MAX_DIMENSION, flags=("--block-size",), train_default=BLOCK_SIZE_DEFAULTS["zlab"])
    layer_types: tuple[str, ...] = setting(
        (), "per draft layer: full_attention or sliding_attention, comma-separated (empty: all full attention)",
        speculators="transformer_layer_config.layer_types", zlab="layer_types", default_of=QWEN3,
        flags=("--layer-types",), train_default_of="every layer full attention (Qwen3's default)",
        strict=False, validate_default=True)  # a list too, each name checked below; empty: all full attention
    sliding_window: int | None = setting(
        None, "the window of the sliding_attention layers", speculators="transformer_layer_config.sliding_window",
        zlab="sliding_window", default_of=QWEN3, flags=("--sliding-window",),
        train_default_of="no window (Qwen3's default)", gt=0, le=MAX_DIMENSION)  # a window of 0 sees nothing
    rope_theta: float = setting(
        QWEN3_DEFAULTS["rope_theta"], "the rotary base frequency", gt=0,
        speculators="transformer_layer_config.rope_parameters.rope_theta", zlab="rope_parameters.rope_theta",
        default_of=QWEN3)
    # transformers' `rope_parameters` less rope_theta and partial_rotary_factor: {"rope_type": "yarn", "factor": ...};
    # None is the unscaled "default" rope. Not hashed (a dict); compared by value.
    rope_scaling: dict[str, Any] | None = setting(
        ROTARY_DEFAULTS["rope_scaling"], "the rotary scaling as transformers' rope_parameters (none: unscaled)",
        names=None, speculators="transformer_layer_config.rope_parameters", zlab="rope_parameters", default_of=QWEN3)
    # The share of each head's dims that is rotated (the first ones; the rest pass through), as transformers'
    # partial-rotary models and vLLM apply `rope_parameters.partial_rotary_factor`.
    partial_rotary_factor: float = setting(
        ROTARY_DEFAULTS["partial_rotary_factor"], "the share of each head's dims that is rotated (the first ones)",
        gt=0, le=1, speculators="transformer_layer_config.rope_parameters.partial_rotary_factor",
        zlab="rope_parameters.partial_rotary_factor", default_of=QWEN3)
    rope_style: RopeStyle = setting(
        ROTARY_DEFAULTS["rope_style"], "neox rotates the head's two halves (rotate_half), gptj interleaved pairs "
        "(the engines' is_neox_style)", names=None, speculators=None, zlab=None,
        default_of="both references (neox only) and the engines' is_neox_style default")
    rms_norm_eps: float = setting(
        QWEN3_DEFAULTS["rms_norm_eps"], "the RMS norms' epsilon", gt=0,
        speculators="transformer_layer_config.rms_norm_eps", zlab="rms_norm_eps", default_of=QWEN3)
    max_position_embeddings: int = setting(
        QWEN3_DEFAULTS["max_position_embeddings"], "the longest context the rotary tables cover", gt=0,
        le=MAX_POSITIONS, speculators="transformer_layer_config.max_position_embeddings",
        zlab="max_position_embeddings", default_of=QWEN3)
    attention_bias: bool = setting(
        QWEN3_DEFAULTS["attention_bias"], "bias on the attention projections",
        speculators="transformer_layer_config.attention_bias", zlab="attention_bias", default_of=QWEN3)
    hidden_act: str = setting(
        QWEN3_DEFAULTS["hidden_act"], "the MLP's activation (a name transformers' ACT2FN holds)",
        speculators="transformer_layer_config.hidden_act", zlab="hidden_act", default_of=QWEN3)
    # z-lab dflash_config extras: embedding scale, logit multiplier and soft-capping.
    input_embedding_scale: float = setting(
        ZLAB_EXTRAS["input_embedding_scale"], "scale on the borrowed token embeddings", speculators=None,
        zlab="dflash_config.input_embedding_scale", default_of=ZLAB_EXTRA)
    output_multiplier: float = setting(
        ZLAB_EXTRAS["output_multiplier"], "multiplier on the logits", speculators=None,
        zlab="dflash_config.output_multiplier", default_of=ZLAB_EXTRA)
    final_logit_softcapping: float | None = setting(
        ZLAB_EXTRAS["final_logit_softcapping"], "soft-capping of the logits (none: not capped)", speculators=None,
        zlab="dflash_config.final_logit_softcapping", default_of=ZLAB_EXTRA)
    # Sliding-window layers see their whole block (bidirectional) instead of a causal block:
    # speculators' `sliding_window_non_causal`, z-lab's `is_causal: false`. DFlash2 defaults to it.
    sliding_window_non_causal: bool = setting(
        False, "sliding layers see their whole block (bidirectional) instead of a causal block",
        speculators="sliding_window_non_causal", zlab="is_causal (negated)",
        default_of="both references' DFlash (speculators' DFlash2 says true)",
        flags=("--sliding-window-non-causal/--sliding-window-causal",),
        train_default_of="the family's: dflash2 bidirectional (speculators' DFlash2), dflash causal")
    # The slot layout (impl/slot_layout.py): True = every slot proposes the next token (DSpark,
    # speculators' `sample_from_anchor`), B proposals per block; False = the anchor slot proposes
    # nothing, B - 1 proposals. A property of the drafter: training, decoding and serving follow it.
    # (`train` sets it with the recipe knob of the same name.)
    sample_from_anchor: bool = setting(
        False, "every slot proposes the next token (B per block) instead of the anchor slot proposing nothing",
        speculators="sample_from_anchor", zlab="dflash_config.sample_from_anchor (vLLM's)",
        default_of="speculators (DFlashSpeculatorConfig.sample_from_anchor); z-lab has only this layout")
    # DFlash2 (both references' second generation): a grouped dynamic causal convolution around
    # each layer's attention and MLP, and a candidate selector that reranks the unary top-k.
    # All four are set for a DFlash2 drafter and all None for a DFlash one.
    conv_kernel_size: int | None = setting(
        None, "DFlash2: causal taps per convolution", gt=0, speculators="conv_kernel_size",
        zlab="dflash_config.conv_kernel_size", default_of="none: only a DFlash2 drafter has it", family="dflash2",
        flags=("--conv-kernel-size",), train_default=2,
        train_default_of="speculators (DFlash2SpeculatorConfig.conv_kernel_size)")
    conv_group_size: int | None = setting(
        None, "DFlash2: channels sharing one dynamic kernel", gt=0, speculators="conv_group_size",
        zlab="dflash_config.conv_group_size", default_of="none: only a DFlash2 drafter has it", family="dflash2",
        flags=("--conv-group-size",), train_default=16,
        train_default_of="speculators (DFlash2SpeculatorConfig.conv_group_size)")
    selector_rank: int | None = setting(
        None, "DFlash2: rank of the candidate selector's bilinear term", gt=0, speculators="selector_rank",
        zlab="dflash_config.selector_rank", default_of="none: only a DFlash2 drafter has it", family="dflash2",
        flags=("--selector-rank",), train_default=256,
        train_default_of="speculators (DFlash2SpeculatorConfig.selector_rank)")
    selector_top_k: int | None = setting(
        None, "DFlash2: unary candidates the selector reranks", gt=0, speculators="selector_top_k",
        zlab="dflash_config.selector_top_k", default_of="none: only a DFlash2 drafter has it", family="dflash2",
        flags=("--selector-top-k",), train_default=16,
        train_default_of="speculators (DFlash2SpeculatorConfig.selector_top_k)")
    # A reduced draft vocabulary (speculators' `draft_vocab_size`): the drafter's own head has this many rows
    # and its `d2t` maps draft id k to target id k + d2t[k]. None: the head is the target's whole vocabulary.
    draft_vocab_size: int | None = setting(
        None, "a reduced draft vocabulary: the head proposes only the N most frequent loss-masked tokens of the "
        "training data (speculators' rule), mapped to target ids by d2t", speculators="draft_vocab_size",
        zlab="draft_vocab_size (vLLM's)", default_of="both references (the head is the target's whole vocabulary)",
        gt=0, flags=("--draft-vocab-size",), train_default_of="the whole vocabulary")
    # DSpark (speculators' models/dspark): a Markov logit-bias head of rank `markov_rank` (0: none) over the
    # previous block token, of type vanilla / gated / rnn, and a per-slot confidence head (its input the slot's
    # hidden state, plus the Markov embedding with `confidence_head_with_markov`). All four set, or all None.
    markov_rank: int | None = setting(
        None, "DSpark: rank of the Markov logit-bias head over the previous block token (0: none)", ge=0,
        names=None, speculators="markov_rank", zlab=None, default_of="none: only a DSpark drafter has it", family="dspark",
        flags=("--markov-rank",), train_default=256, train_default_of="speculators (DSparkArgs.markov_rank)")
    markov_head_type: MarkovHeadType | None = setting(
        None, "DSpark: the Markov head's type", names=None, speculators="markov_head_type", zlab=None,
        default_of="none: only a DSpark drafter has it", family="dspark",
        flags=("--markov-head-type",), train_default="vanilla", train_default_of="speculators (DSparkArgs.markov_head_type)")
    enable_confidence_head: bool | None = setting(
        None, "DSpark: a per-slot confidence head", names=None, speculators="enable_confidence_head", zlab=None,
        default_of="none: only a DSpark drafter has it", family="dspark",
        flags=("--confidence-head/--no-confidence-head",), train_default=True, train_default_of="speculators (DSparkArgs.enable_confidence_head)")
    confidence_head_with_markov: bool | None = setting(
        None, "DSpark: the confidence head also reads the Markov embedding", names=None, speculators="confidence_head_with_markov",
        zlab=None, default_of="none: only a DSpark drafter has it", family="dspark",
        flags=("--confidence-head-with-markov/--confidence-head-without-markov",), train_default=True, train_default_of="speculators (DSparkArgs.confidence_head_with_markov)")
    # XPress (speculators' models/xpress): a causal refiner head of rank `xpress_rank` (MLP `xpress_mlp_ratio`
    # times wider) resolved at inference by `num_jacobi_passes` parallel Jacobi passes. All three, or all None.
    xpress_rank: int | None = setting(
        None, "XPress: rank of the causal refiner head", ge=1, names=None, speculators="xpress_rank", zlab=None,
        default_of="none: only an XPress drafter has it", family="xpress",
        flags=("--xpress-rank",), train_default=256, train_default_of="speculators (XPressArgs.xpress_rank)")
    xpress_mlp_ratio: int | None = setting(
        None, "XPress: how many times wider the refiner's MLP is", ge=1, names=None, speculators="xpress_mlp_ratio", zlab=None,
        default_of="none: only an XPress drafter has it", family="xpress",
        flags=("--xpress-mlp-ratio",), train_default=2, train_default_of="speculators (XPressArgs.xpress_mlp_ratio)")
    num_jacobi_passes: int | None = setting(
        None, "XPress: parallel Jacobi passes resolving the refiner at inference", ge=0,
        names=None, speculators="num_jacobi_passes", zlab=None, default_of="none: only an XPress drafter has it", family="xpress",
        flags=("--num-jacobi-passes",), train_default=6, train_default_of="speculators (XPressArgs.num_jacobi_passes)")

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)  # every setting's own kind, choices and bounds: pydantic's, by its declaration
        self.validate()

    @field_validator("target_layer_ids", mode="before")
    @classmethod
    def _integer_ids(cls, ids: Any) -> Any:
        """Layer ids as integers (a JSON `2.0` is layer 2); a fractional one is refused by name."""
        if not isinstance(ids, (list, tuple)):
            return ids  # pydantic refuses it: not a list
        fractional = [i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral) and not
                      (isinstance(i, float) and i.is_integer())]
        _require(not fractional, "target_layer_ids", f"{fractional} are not integer layer ids")
        return tuple(int(i) for i in ids)

    @field_validator("layer_types", mode="before")
    @classmethod
    def _every_layer_typed(cls, types: Any, info: ValidationInfo) -> Any:
        """Empty layer types: every layer full attention."""
        if not isinstance(types, (list, tuple)):
            return types
        _require(all(isinstance(t, str) for t in types), "layer_types",
                 f"must be a list of layer type names, got {list(types)!r}")
        return tuple(types) or ("full_attention",) * info.data.get("num_hidden_layers", 0)

    @field_validator("draft_vocab_size")
    @classmethod
    def _reduced_only(cls, size: int | None, info: ValidationInfo) -> int | None:
        """A draft vocabulary the size of the target's is none (speculators' own rule: equal sizes map nothing)."""
        return None if size == info.data.get("target_vocab_size") else size

    def __hash__(self) -> int:
        # rope_scaling is a dict: compared by value, not hashed
        return hash(tuple(value for name, value in self.__dict__.items() if name != "rope_scaling"))

    def replace(self, **changes: Any) -> DraftSpec:
        """A copy with `changes`, checked like any new spec."""
        return DraftSpec(**{**dict(self), **changes})

    def validate(self) -> None:
        """The rules between settings (each setting's own range is its declaration's, checked on construction)."""
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 f"{self.num_attention_heads} attention heads are not divisible by "
                 f"{self.num_key_value_heads} key/value heads")
        _require(self.head_dim % 2 == 0, "head_dim", f"rotary embeddings need an even head_dim, got {self.head_dim}")
        _require(len(self.target_layer_ids) > 0, "target_layer_ids", "is empty: fc needs at least one target layer")
        _require(len(set(self.target_layer_ids)) == len(self.target_layer_ids), "target_layer_ids",
                 f"has duplicates: {list(self.target_layer_ids)}")
        outside = layers_outside(self.target_layer_ids, self.num_target_layers)
        _require(not outside, "target_layer_ids", outside)
        _require(is_token_id(self.mask_token_id, self.target_vocab_size), "mask_token_id",
                 f"{self.mask_token_id} is not a token id of a vocabulary of {self.target_vocab_size}")
        _require(len(self.layer_types) == self.num_hidden_layers, "layer_types",
                 f"has {len(self.layer_types)} entries for {self.num_hidden_layers} draft layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        _require(not unknown, "layer_types", f"unknown layer types {unknown}; expected {list(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types:
            _require(isinstance(self.sliding_window, int) and self.sliding_window > 0, "sliding_window",
                     f"sliding_attention layers need a positive sliding_window, got {self.sliding_window!r}")
        self._validate_rotary()
        _require(is_known_activation(self.hidden_act), "hidden_act",
                 f"{self.hidden_act!r} is not an activation transformers knows")
        self._validate_draft_vocab()
        self._validate_dflash2()
        self._validate_family_fields()

    def _validate_draft_vocab(self) -> None:
        size = self.draft_vocab_size
        if size is None:
            return
        _require(isinstance(size, int) and not isinstance(size, bool) and 0 < size <= self.target_vocab_size,
                 "draft_vocab_size", f"must be an integer in 1..{self.target_vocab_size} (the target vocabulary), got {size!r}")
        # speculators' DFlash2DraftModel refuses a reduced vocabulary too ("requires the full verifier vocabulary").
        _require(self.family == "dflash", "draft_vocab_size",
                 f"{size} of {self.target_vocab_size}: a {TITLES[self.family]} drafter is audited over the full target "
                 "vocabulary only" if self.family != "dflash2" else
                 f"{size} of {self.target_vocab_size}: a DFlash2 drafter drafts over the full target vocabulary")

    @property
    def head_size(self) -> int:
        """Rows of the drafter's head: the draft vocabulary when reduced, else the target's."""
        return self.draft_vocab_size or self.target_vocab_size
    def _validate_rotary(self) -> None:
        factor = self.partial_rotary_factor
        _require(self.rotary_dim >= 2 and self.rotary_dim % 2 == 0, "partial_rotary_factor",
                 f"{factor} of head_dim {self.head_dim} rotates {self.rotary_dim} dims; rotary needs an even number")
        scaling = self.rope_scaling
        if scaling is None:
            return
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # the scalings transformers computes

        kind = scaling.get("rope_type")
        _require(kind in ROPE_INIT_FUNCTIONS, "rope_scaling",
                 f"rope_type {kind!r} is not a scaling transformers computes ({sorted(ROPE_INIT_FUNCTIONS)})")
        overlap = sorted({"rope_theta", "partial_rotary_factor"} & set(scaling))
        _require(not overlap, "rope_scaling", f"holds {overlap}, which are fields of their own")

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims are rotated (the first ones), as transformers computes it."""
        return int(self.head_dim * self.partial_rotary_factor)

    def rope_parameters(self) -> dict[str, Any]:
        """transformers' `rope_parameters` of this spec (partial_rotary_factor only where it is not 1)."""
        params = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        if self.partial_rotary_factor != 1.0:
            params["partial_rotary_factor"] = self.partial_rotary_factor
        return params

    def _validate_dflash2(self) -> None:
        values = {name: getattr(self, name) for name in DFLASH2_FIELDS}
        given = [name for name, value in values.items() if value is not None]
        if not given:
            return
        missing = [name for name in DFLASH2_FIELDS if name not in given]
        _require(not missing, missing[0] if missing else "", f"a DFlash2 drafter needs all of "
                 f"{list(DFLASH2_FIELDS)}; only {given} are set")
        _require(self.hidden_size % self.conv_group_size == 0, "conv_group_size",
                 f"hidden_size {self.hidden_size} is not divisible by conv_group_size {self.conv_group_size}")
        _require(self.conv_kernel_size <= self.block_size, "conv_kernel_size",
                 f"{self.conv_kernel_size} taps exceed the block of {self.block_size}")
        _require(self.selector_top_k <= self.target_vocab_size, "selector_top_k",
                 f"{self.selector_top_k} candidates exceed the vocabulary of {self.target_vocab_size}")

    def _validate_family_fields(self) -> None:
        """DSpark's and XPress's fields: all of a family's or none, one family at a time, in speculators' ranges."""
        given = {family: [n for n in names if getattr(self, n) is not None] for family, names in FAMILY_FIELDS.items()}
        families = [family for family, names in given.items() if names]
        _require(len(families) <= 1, given[families[-1]][0] if families else "",
                 f"settings of {' and '.join(TITLES[f] for f in families)} at once; a drafter is of one family")
        for family in ("dspark", "xpress"):
            if given[family]:
                missing = [n for n in FAMILY_FIELDS[family] if n not in given[family]]
                _require(not missing, missing[0] if missing else "",
                         f"a {TITLES[family]} drafter needs all of {list(FAMILY_FIELDS[family])}; only "
                         f"{given[family]} are set")
        if given["dspark"]:
            _require(not (self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0),
                     "confidence_head_with_markov", "needs a Markov head (markov_rank > 0), as speculators requires")

    @property
    def family(self) -> str:
        """`dflash2` with convolutions and a selector, `dspark` with Markov/confidence heads, `xpress` with a
        refiner head, else `dflash`."""
        return spec_family(self.conv_kernel_size, self.markov_rank, self.xpress_rank)

    @property
    def has_markov_head(self) -> bool:
        return bool(self.markov_rank)

    @property
    def has_confidence_head(self) -> bool:
        return bool(self.enable_confidence_head)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None

    def block_is_causal(self, layer_idx: int) -> bool:
        """Whether a layer's block slots see only earlier slots: sliding layers unless non-causal."""
        return self.layer_types[layer_idx] == "sliding_attention" and not self.sliding_window_non_causal

    @property
    def speculative_tokens(self) -> int:
        """Tokens one block proposes under the drafter's slot layout (B or B - 1)."""
        return slot_layout.speculative_tokens(self.block_size, self.sample_from_anchor)

    @property
    def longest_round(self) -> int:
        """Tokens the longest round accepts: every proposal and the target's bonus."""
        return slot_layout.longest_round(self.block_size, self.sample_from_anchor)

    @property
    def first_proposing_slot(self) -> int:
        return slot_layout.first_proposing_slot(self.sample_from_anchor)

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def window_of(self, layer_idx: int) -> int | None:
        """The sliding window of a draft layer, None for full attention."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None


    def to_dict(self) -> dict[str, Any]:
        data = dict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        data["layer_types"] = list(self.layer_types)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftSpec:
        _require(isinstance(data, dict), "spec", f"expected a mapping of fields, got {type(data).__name__} "
                                                 f"{str(data)[:60]!r}")
        return cls(**data)

    def qwen3_config(self):
        """The equivalent transformers `Qwen3Config` (used for rotary embeddings and norms)."""
        from transformers import Qwen3Config

        has_sliding = "sliding_attention" in self.layer_types
        # Interleaved rotary in the engines' name (vLLM, SGLang); kept as an extra field of the config.
        style = {} if self.rope_style == ROTARY_DEFAULTS["rope_style"] else {"is_neox_style": False}
        return Qwen3Config(
            **style,
            vocab_size=self.target_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=self.rope_parameters(),
            attention_bias=self.attention_bias,
            # Qwen3Config drops sliding_window unless use_sliding_window is set.
            use_sliding_window=has_sliding,
            sliding_window=self.sliding_window if has_sliding else None,
            layer_types=list(self.layer_types),
            tie_word_embeddings=False,
        )


# -- derived from the declarations above, never written again ------------------------------------------------------
SETTINGS: dict[str, FieldInfo] = DraftSpec.model_fields
SPEC_FIELDS = tuple(SETTINGS)


def extra(name: str) -> dict[str, Any]:
    """A setting's declared metadata (speculators and z-lab names, whose default, family, `train` option)."""
    return SETTINGS[name].json_schema_extra


# Each family's own settings, set together or not at all (DFlash has none).
FAMILY_FIELDS = {family: tuple(name for name in SPEC_FIELDS if extra(name)["family"] == family)
                 for family in ("dflash", "dflash2", "dspark", "xpress")}
DFLASH2_FIELDS, DSPARK_FIELDS, XPRESS_FIELDS = (FAMILY_FIELDS[f] for f in ("dflash2", "dspark", "xpress"))
ROPE_STYLES = settings.choices(SETTINGS["rope_style"])
# The rotary settings of a spec, as `rotary` findings and the conformance component name them.
ROTARY_FIELDS = ("rope_theta", "rope_scaling", "partial_rotary_factor", "rope_style")
# The key z-lab's config.json states a setting under, where it is not the setting's own name (`vocab_size`).
CONFIG_KEYS = {name: key for name in SPEC_FIELDS
               if (key := (extra(name)["zlab"] or name).split(" ")[0].rsplit(".", 1)[-1]) != name}
# Every name a config, a checkpoint or training args declare a setting under (dflash_audit/formats/setting_names.py);
# a setting declared with `names=None` is read by its format's reader only, never by name.
SPEC_NAMES = {name: (name, *extra(name)["names"]) for name in SPEC_FIELDS if extra(name)["names"] is not None}
# The settings `dflash-audit train` takes (dflash_audit/commands/train.py), the run field each fills and
# what `train` uses without its option.
TRAIN_SETTINGS = tuple(name for name in SPEC_FIELDS if extra(name)["flags"])
RUN_FIELDS = {name: extra(name)["train_field"] or name for name in TRAIN_SETTINGS}
TRAIN_DEFAULTS = {name: extra(name)["train_default"] for name in TRAIN_SETTINGS}


def spec_misfit(spec: DraftSpec, hidden_size: int | None, depth: int | None,
                vocab_size: int | None = None) -> str | None:
    """Why a drafter of `spec` cannot run against a target of this hidden size, decoder depth and vocabulary
    (None: not checked), or None: the one fit check `eval`, `compare` and `convert --format speculators` apply
    (dflash_audit/audit/drafter_fit.py adds a reduced draft vocabulary's map)."""
    if spec.hidden_size != hidden_size:
        return f"hidden size {spec.hidden_size} but the target's is {hidden_size}"
    if spec.num_target_layers != depth:
        return f"built for a target of {spec.num_target_layers} layers, this one has {depth}"
    if vocab_size is not None and spec.target_vocab_size != vocab_size:
        return f"vocabulary of {spec.target_vocab_size} but the target's is {vocab_size}"
    return None


def settings_table() -> str:
    """Every drafter setting, generated for docs/training.md (`python -m impl.spec`)."""
    lines = ["| setting | type | default | range | speculators | z-lab | whose default | `train` |",
             "|---|---|---|---|---|---|---|---|"]
    for name, info in SETTINGS.items():
        meta = extra(name)
        default = "—" if info.is_required() else f"`{info.default!r}`"
        option = "—"
        if meta["flags"]:
            given = TRAIN_DEFAULTS[name]
            option = (", ".join(f"`{flag}`" for flag in meta["flags"]) + ": "
                      + (f"`{given!r}`" if given is not None else meta["train_default_of"]))
        bound = settings.range_text(DraftSpec, name) or "—"
        lines.append(_cells(f"`{name}`: {info.description}", settings.type_name(info), default, bound,
                            _code(meta["speculators"]), _code(meta["zlab"]), meta["default_of"], option))
    return "\n".join(lines)


def _code(name: str | None) -> str:
    return f"`{name}`" if name else "—"


def _cells(*cells: str) -> str:
    """A table row; a `|` inside a cell (`<|mask|>`) escaped, the choices' own separators kept."""
    return "| " + " | ".join(cell.replace(" \\| ", "\0").replace("|", "\\|").replace("\0", " \\| ")
                             for cell in cells) + " |"


if __name__ == "__main__":
    print(settings_table())
