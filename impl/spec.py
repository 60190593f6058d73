"""The normalized description of a DFlash drafter (`DraftSpec`); how it was trained is `impl/recipe.py`.

Every format (ours, z-lab, speculators) is translated into a `DraftSpec` by its loader.
Target layer ids are always in the z-lab convention: the 0-based decoder layer whose
*output* is used, read from a Hugging Face `hidden_states` tuple as `hs[id + 1]`.
"""

from __future__ import annotations

import numbers
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from foundation.errors import SpecError  # the spec's error; foundation's so config readers below impl raise it
from foundation.token_ids import is_token_id
from impl import slot_layout
from impl.defaults import BLOCK_SIZE_DEFAULTS, QWEN3_DEFAULTS, ROTARY_DEFAULTS, ZLAB_EXTRAS
from impl.families import TITLES, spec_family
from impl.layers import layers_outside

LAYER_TYPES = ("full_attention", "sliding_attention")
# The DFlash2-only architecture fields, in speculators' names (set together or not at all).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# DSpark's head settings (speculators' DSparkSpeculatorConfig), set together or not at all.
DSPARK_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# XPress's refiner settings (speculators' XPressSpeculatorConfig), set together or not at all.
XPRESS_FIELDS = ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes")
# Each family's own fields (DFlash has none).
FAMILY_FIELDS = {"dflash": (), "dflash2": DFLASH2_FIELDS, "dspark": DSPARK_FIELDS, "xpress": XPRESS_FIELDS}
# The key a z-lab or speculators config.json writes a field under, where it is not the field's own name.
CONFIG_KEYS = {"target_vocab_size": "vocab_size"}
# Rotary styles, in vLLM's terms (`is_neox_style`): neox rotates the two halves of the head (transformers'
# `rotate_half`, what Qwen3 and both references do); gptj rotates interleaved pairs (even, odd dims).
ROPE_STYLES = ("neox", "gptj")
# The rotary settings of a spec, as `rotary` findings and the conformance component name them.
ROTARY_FIELDS = ("rope_theta", "rope_scaling", "partial_rotary_factor", "rope_style")


# Sizes past these are no model's: a typo or a hostile config, refused before any tensor is sized by them.
MAX_DIMENSION = 1 << 24
MAX_POSITIONS = 1 << 30


def _is_number(value: Any) -> bool:
    """An int or float (numpy's too), not a bool: `true` is no gamma."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise SpecError(field_name, message)


def _count(value: Any, field_name: str, least: int) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= least, field_name,
             f"must be an integer >= {least}, got {value!r}")


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


@dataclass(frozen=True)
class DraftSpec:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int  # draft layers
    target_vocab_size: int  # the TARGET's vocabulary: token ids, embeddings and the verifier's head
    target_layer_ids: tuple[int, ...]  # z-lab convention; every one feeds fc
    num_target_layers: int  # decoder layers of the target (verifier)
    mask_token_id: int
    block_size: int = BLOCK_SIZE_DEFAULTS["zlab"]
    layer_types: tuple[str, ...] = ()  # empty means all full attention
    sliding_window: int | None = None
    rope_theta: float = QWEN3_DEFAULTS["rope_theta"]
    # transformers' `rope_parameters` less rope_theta and partial_rotary_factor: {"rope_type": "yarn", "factor": ...};
    # None is the unscaled "default" rope. Not hashed (a dict); compared by value.
    rope_scaling: dict[str, Any] | None = field(default=ROTARY_DEFAULTS["rope_scaling"], hash=False)
    # The share of each head's dims that is rotated (the first ones; the rest pass through), as transformers'
    # partial-rotary models and vLLM apply `rope_parameters.partial_rotary_factor`.
    partial_rotary_factor: float = ROTARY_DEFAULTS["partial_rotary_factor"]
    rope_style: str = ROTARY_DEFAULTS["rope_style"]  # one of ROPE_STYLES
    rms_norm_eps: float = QWEN3_DEFAULTS["rms_norm_eps"]
    max_position_embeddings: int = QWEN3_DEFAULTS["max_position_embeddings"]
    attention_bias: bool = QWEN3_DEFAULTS["attention_bias"]
    hidden_act: str = QWEN3_DEFAULTS["hidden_act"]
    # z-lab dflash_config extras: embedding scale, logit multiplier and soft-capping.
    input_embedding_scale: float = ZLAB_EXTRAS["input_embedding_scale"]
    output_multiplier: float = ZLAB_EXTRAS["output_multiplier"]
    final_logit_softcapping: float | None = ZLAB_EXTRAS["final_logit_softcapping"]
    # Sliding-window layers see their whole block (bidirectional) instead of a causal block:
    # speculators' `sliding_window_non_causal`, z-lab's `is_causal: false`. DFlash2 defaults to it.
    sliding_window_non_causal: bool = False
    # The slot layout (impl/slot_layout.py): True = every slot proposes the next token (DSpark,
    # speculators' `sample_from_anchor`), B proposals per block; False = the anchor slot proposes
    # nothing, B - 1 proposals. A property of the drafter: training, decoding and serving follow it.
    sample_from_anchor: bool = False
    # DFlash2 (both references' second generation): a grouped dynamic causal convolution around
    # each layer's attention and MLP, and a candidate selector that reranks the unary top-k.
    # All four are set for a DFlash2 drafter and all None for a DFlash one.
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    # A reduced draft vocabulary (speculators' `draft_vocab_size`): the drafter's own head has this many rows
    # and its `d2t` maps draft id k to target id k + d2t[k]. None: the head is the target's whole vocabulary.
    draft_vocab_size: int | None = None
    # DSpark (speculators' models/dspark): a Markov logit-bias head of rank `markov_rank` (0: none) over the
    # previous block token, of type vanilla / gated / rnn, and a per-slot confidence head (its input the slot's
    # hidden state, plus the Markov embedding with `confidence_head_with_markov`). All four set, or all None.
    markov_rank: int | None = None
    markov_head_type: str | None = None
    enable_confidence_head: bool | None = None
    confidence_head_with_markov: bool | None = None
    # XPress (speculators' models/xpress): a causal refiner head of rank `xpress_rank` (MLP `xpress_mlp_ratio`
    # times wider) resolved at inference by `num_jacobi_passes` parallel Jacobi passes. All three, or all None.
    xpress_rank: int | None = None
    xpress_mlp_ratio: int | None = None
    num_jacobi_passes: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        # Normalize list-valued fields so specs compare and hash by value.
        ids = tuple(self.target_layer_ids)
        fractional = [i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral) and not
                      (isinstance(i, float) and i.is_integer())]
        _require(not fractional, "target_layer_ids", f"{fractional} are not integer layer ids")
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in ids))
        types = tuple(self.layer_types) or ("full_attention",) * self.num_hidden_layers
        object.__setattr__(self, "layer_types", types)
        if self.draft_vocab_size == self.target_vocab_size:  # speculators' own rule: equal sizes map nothing
            object.__setattr__(self, "draft_vocab_size", None)
        if isinstance(self.partial_rotary_factor, numbers.Real) and not isinstance(self.partial_rotary_factor, bool):
            object.__setattr__(self, "partial_rotary_factor", float(self.partial_rotary_factor))
        self.validate()

    def _check_types(self) -> None:
        """Each field's kind, before any rule compares or hashes it (a list where a number belongs)."""
        for name in ("target_layer_ids", "layer_types"):
            value = getattr(self, name)
            _require(isinstance(value, (list, tuple)), name, f"must be a list, got {value!r}")
        _require(all(isinstance(t, str) for t in self.layer_types), "layer_types",
                 f"must be a list of layer type names, got {list(self.layer_types)!r}")
        for name in ("rope_theta", "rms_norm_eps", "input_embedding_scale", "output_multiplier"):
            _require(_is_number(getattr(self, name)), name, f"must be a number, got {getattr(self, name)!r}")
        for name in ("final_logit_softcapping",):
            value = getattr(self, name)
            _require(value is None or _is_number(value), name, f"must be a number or null, got {value!r}")
        for name in ("sliding_window", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                     "draft_vocab_size"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and not isinstance(value, bool)), name,
                     f"must be an integer or null, got {value!r}")
        for name in ("attention_bias", "sliding_window_non_causal", "sample_from_anchor"):
            _require(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        _require(self.rope_scaling is None or isinstance(self.rope_scaling, dict), "rope_scaling",
                 f"must be a mapping or null, got {self.rope_scaling!r}")
        _require(isinstance(self.rope_style, str), "rope_style", f"must be a name, got {self.rope_style!r}")

    def validate(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "num_hidden_layers", "target_vocab_size", "num_target_layers", "block_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                     f"must be a positive integer, got {value!r}")
            top = MAX_POSITIONS if name == "max_position_embeddings" else MAX_DIMENSION
            _require(value <= top, name, f"{value} is past any real model's (at most {top:,})")
        _require(isinstance(self.mask_token_id, int) and not isinstance(self.mask_token_id, bool), "mask_token_id",
                 f"must be a token id, got {self.mask_token_id!r}")
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
        _require(self.rope_theta > 0, "rope_theta", f"must be positive, got {self.rope_theta}")
        self._validate_rotary()
        _require(is_known_activation(self.hidden_act), "hidden_act",
                 f"{self.hidden_act!r} is not an activation transformers knows")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", f"must be positive, got {self.rms_norm_eps}")
        _require(isinstance(self.sample_from_anchor, bool), "sample_from_anchor",
                 f"must be true or false, got {self.sample_from_anchor!r}")
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
        _require(isinstance(factor, numbers.Real) and not isinstance(factor, bool) and 0 < factor <= 1,
                 "partial_rotary_factor", f"must be in (0, 1], got {factor!r}")
        _require(self.rotary_dim >= 2 and self.rotary_dim % 2 == 0, "partial_rotary_factor",
                 f"{factor} of head_dim {self.head_dim} rotates {self.rotary_dim} dims; rotary needs an even number")
        _require(self.rope_style in ROPE_STYLES, "rope_style", f"{self.rope_style!r} not in {list(ROPE_STYLES)}")
        scaling = self.rope_scaling
        if scaling is None:
            return
        _require(isinstance(scaling, dict), "rope_scaling", f"{scaling!r} is not a mapping")
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
        for name, value in values.items():
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                     f"must be a positive integer, got {value!r}")
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
            _count(self.markov_rank, "markov_rank", 0)
            _require(self.markov_head_type in MARKOV_HEAD_TYPES, "markov_head_type",
                     f"{self.markov_head_type!r} not in {list(MARKOV_HEAD_TYPES)}")
            for name in ("enable_confidence_head", "confidence_head_with_markov"):
                _require(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
            _require(not (self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0),
                     "confidence_head_with_markov", "needs a Markov head (markov_rank > 0), as speculators requires")
        if given["xpress"]:
            _count(self.xpress_rank, "xpress_rank", 1)
            _count(self.xpress_mlp_ratio, "xpress_mlp_ratio", 1)
            _count(self.num_jacobi_passes, "num_jacobi_passes", 0)

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
        data = asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        data["layer_types"] = list(self.layer_types)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftSpec:
        _require(isinstance(data, dict), "spec", f"expected a mapping of fields, got {type(data).__name__} "
                                                 f"{str(data)[:60]!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        _require(not unknown, "spec", f"unknown fields {unknown}")
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING)
        _require(not missing, "spec", f"missing fields {missing}")
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
