"""Hypothesis strategies: every configuration the suite generates comes from here.

Ranges follow the issue: block sizes 1-16, 1-6 draft layers, heads / kv heads / head
dims, sequence lengths, anchor counts, document boundaries, sliding windows smaller and
larger than the context, fp32 and bf16. Sizes stay tiny so a CPU runs hundreds of cases.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from conformance.world import VOCAB
from impl.defaults import QWEN3_DEFAULTS
from impl.layers import final_layer
from impl.recipe import XPRESS_LOSS, Recipe
from impl.spec import DraftSpec

# Modest example counts: the full suite must run on 2 CPU cores in < 10 minutes.
settings.register_profile("conformance", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
# CONFORMANCE_NO_SHRINK=1 in the environment: for a run that needs only which components fail, not their minimal
# examples (a golden record's run). Derandomized, the examples generated are the same, so the same ones fail.
settings.register_profile("conformance-no-shrink", parent=settings.get_profile("conformance"),
                          phases=tuple(phase for phase in Phase if phase is not Phase.shrink))
settings.load_profile("conformance-no-shrink" if os.environ.get("CONFORMANCE_NO_SHRINK") else "conformance")
FAST = settings(max_examples=40)  # pure index/mask operations
MODEL = settings(max_examples=6)  # anything that runs a drafter

dtypes = st.sampled_from([torch.float32, torch.bfloat16])
# DFlash2 forward checks run in fp64 (implementations of one function agree to 1e-10) and fp32, not
# bf16: there its quadratic convolutions amplify rounding to the size of a real bug (conformance/tolerances.py).
dflash2_dtypes = st.sampled_from([torch.float64, torch.float32])
block_sizes = st.integers(1, 16)


@st.composite
def draft_specs(draw, max_layers: int = 6, sliding: bool | None = None, min_block: int = 2) -> DraftSpec:
    """A tiny drafter for a tiny target: hidden 32 or 64, 1-6 layers, GQA heads, mixed layer types.

    Block size starts at 2: speculators rejects a drafter with no speculative token (B = 1).
    """
    hidden = draw(st.sampled_from([32, 64]))
    num_target_layers = draw(st.integers(3, 7))
    layers = draw(st.integers(1, max_layers))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    ids = draw(st.lists(st.integers(0, final_layer(num_target_layers)), min_size=1, max_size=min(6, num_target_layers),
                        unique=True))
    use_sliding = draw(st.booleans()) if sliding is None else sliding
    types = tuple(draw(st.sampled_from(["sliding_attention", "full_attention"])) if use_sliding
                  else "full_attention" for _ in range(layers))
    if use_sliding and "sliding_attention" not in types:
        types = ("sliding_attention",) + types[1:]
    return DraftSpec(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, head_dim=draw(st.sampled_from([8, 16])), num_hidden_layers=layers,
                     target_vocab_size=VOCAB, target_layer_ids=tuple(sorted(ids)), num_target_layers=num_target_layers,
                     mask_token_id=draw(st.integers(0, VOCAB - 1)), block_size=draw(st.integers(min_block, 16)),
                     layer_types=types, sliding_window=draw(st.integers(1, 24)) if use_sliding else None)


@dataclass(frozen=True)
class MaskCase:
    document_ids: torch.Tensor  # [1, T], -1 = padding
    anchors: torch.Tensor  # [A]
    block_size: int
    sliding_window: int | None
    causal_block: bool

    def __repr__(self) -> str:
        return (f"MaskCase(document_ids={self.document_ids.tolist()}, anchors={self.anchors.tolist()}, "
                f"block_size={self.block_size}, sliding_window={self.sliding_window}, "
                f"causal_block={self.causal_block})")


@st.composite
def document_layouts(draw, min_len: int = 1, max_len: int = 40) -> tuple[list[int], int]:
    """Document lengths of a packed sequence (1-4 documents) and trailing padding."""
    lengths = draw(st.lists(st.integers(1, 14), min_size=1, max_size=4))
    padding = draw(st.integers(0, 4))
    total = sum(lengths) + padding
    if total < min_len:
        lengths[-1] += min_len - total
    return lengths, padding


@st.composite
def training_mask_cases(draw, sliding: bool | None = None) -> MaskCase:
    lengths, padding = draw(document_layouts())
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((padding,), -1)])
    total = document_ids.numel()
    # Anchors anywhere, the two edges included; sorted and distinct as select_anchors makes them.
    anchors = draw(st.lists(st.sampled_from([0, total - 1, *range(total)]), min_size=1, max_size=6, unique=True))
    use_sliding = draw(st.booleans()) if sliding is None else sliding
    # Windows both smaller and larger than the context.
    window = draw(st.integers(1, total + 8)) if use_sliding else None
    return MaskCase(document_ids[None].long(), torch.tensor(sorted(anchors)), draw(block_sizes), window,
                    causal_block=use_sliding and draw(st.booleans()))


@dataclass(frozen=True)
class InferenceMaskCase:
    context_len: int
    block_len: int
    sliding_window: int | None
    causal: bool


@st.composite
def inference_mask_cases(draw) -> InferenceMaskCase:
    context = draw(st.integers(0, 40))
    block = draw(block_sizes)
    window = draw(st.one_of(st.none(), st.integers(1, context + block + 8)))
    return InferenceMaskCase(context, block, window, causal=window is not None and draw(st.booleans()))


@dataclass(frozen=True)
class LossCase:
    num_anchors: int
    block_size: int
    vocab: int
    gamma: float
    kind: str
    sample_from_anchor: bool
    dtype: torch.dtype
    seed: int
    first_slot_only: bool = False  # train only the first predicted slot of each block (every weighting gives it 1)

    def tensors(self):
        gen = torch.Generator().manual_seed(self.seed)
        n = self.num_anchors * self.block_size
        logits = (torch.randn(1, n, self.vocab, generator=gen) * 3).to(self.dtype)
        targets = (torch.randn(1, n, self.vocab, generator=gen) * 3).to(self.dtype)
        # Targets partly agree with the drafter so accuracies and accepted runs are not all zero.
        agree = torch.rand(1, n, generator=gen) < 0.6
        targets = torch.where(agree[..., None], logits * 2, targets)
        loss_mask = (torch.rand(1, n, generator=gen) < 0.8).float()
        if not self.sample_from_anchor:
            loss_mask[:, :: self.block_size] = 0
        if self.first_slot_only:
            first = 0 if self.sample_from_anchor else min(1, self.block_size - 1)
            keep = torch.zeros(self.block_size)
            keep[first] = 1
            loss_mask = loss_mask * keep.repeat(self.num_anchors)[None]
        first = 0 if self.sample_from_anchor else 1
        if first < self.block_size and not loss_mask.any():  # a training step always trains some slot
            loss_mask[0, first] = 1
        return logits, targets, loss_mask


@st.composite
def loss_cases(draw, kinds=("kl_div", "ce"), min_block: int = 1, first_slot_only: bool = False) -> LossCase:
    """`first_slot_only` for checks of the loss kind alone: with one trained slot per block every
    per-slot weighting gives it weight 1, so the reductions (#6) cannot differ."""
    return LossCase(first_slot_only=first_slot_only, num_anchors=draw(st.integers(1, 6)),
                    block_size=draw(st.integers(min_block, 16)), vocab=draw(st.integers(4, 40)),
                    gamma=draw(st.sampled_from([1.0, 2.5, 4.0, 7.0])), kind=draw(st.sampled_from(kinds)),
                    sample_from_anchor=draw(st.booleans()), dtype=draw(dtypes), seed=draw(st.integers(0, 2**16)))


@dataclass(frozen=True)
class AnchorCase:
    loss_mask: torch.Tensor  # [1, T]
    max_anchors: int
    block_size: int
    seed: int

    def __repr__(self) -> str:
        return (f"AnchorCase(loss_mask={self.loss_mask.tolist()}, max_anchors={self.max_anchors}, "
                f"block_size={self.block_size}, seed={self.seed})")


@st.composite
def anchor_cases(draw) -> AnchorCase:
    total = draw(st.integers(1, 48))
    mask = draw(st.lists(st.sampled_from([0, 1, 1, 1]), min_size=total, max_size=total))
    return AnchorCase(torch.tensor([mask]), draw(st.integers(1, 24)), draw(block_sizes), draw(st.integers(0, 2**16)))


@dataclass(frozen=True)
class TrainingCase:
    spec: DraftSpec
    lengths: tuple[int, ...]
    padding: int
    max_anchors: int
    seed: int


@st.composite
def training_cases(draw, sliding: bool | None = None, single_document: bool = False) -> TrainingCase:
    """`single_document` for checks that are not about packing (positions, embeddings, the mask token)."""
    spec = draw(draft_specs(max_layers=3, sliding=sliding, min_block=2))
    lengths = tuple(draw(st.lists(st.integers(2, 16), min_size=1, max_size=1 if single_document else 3)))
    padding = draw(st.integers(0, 3))
    if sum(lengths) + padding <= spec.block_size:  # at least one anchor must fit before the last block
        lengths = lengths[:-1] + (lengths[-1] + spec.block_size + 1,)
    return TrainingCase(spec, lengths, padding, draw(st.integers(1, 8)), draw(st.integers(0, 2**16)))


@dataclass(frozen=True)
class DPaceCase:
    """D-PACE weights input: a per-slot CE loss [1, A*B] and the aligned loss mask it is weighted under."""

    per_slot_loss: torch.Tensor  # [1, A*B], -log(confidence), in `dtype`
    loss_mask: torch.Tensor  # [1, A*B] float: slot 0, padding, prompts and document starts zeroed
    block_size: int
    alpha: float

    def __repr__(self) -> str:
        return (f"DPaceCase(per_slot_loss={self.per_slot_loss.float().tolist()}, dtype={self.per_slot_loss.dtype}, "
                f"loss_mask={self.loss_mask.tolist()}, block_size={self.block_size}, alpha={self.alpha})")


# Confidences from certain (CE 0) to hopeless (CE ~ 14), plus anything in between.
confidences = st.one_of(st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.1, 1e-3, 1e-6]), st.floats(1e-6, 1.0))
# alpha in (0, 1]: 1 (every trained slot one token), tiny (raw confidences), anything between.
dpace_alphas = st.one_of(st.sampled_from([1.0, 0.5, 1e-3]), st.floats(1e-3, 1.0))


@st.composite
def dpace_cases(draw) -> DPaceCase:
    """Aligned masks as the trainer makes them: packed documents (each starting with an untrained
    token), prompt tokens, trailing padding, anchors anywhere, padded anchors, slot 0 never trained."""
    block = draw(block_sizes)
    lengths, padding = draw(document_layouts(min_len=2))
    trained = []
    for n in lengths:
        trained += [0] + [draw(st.sampled_from([0, 1, 1, 1])) for _ in range(n - 1)]
    trained += [0] * padding
    total = len(trained)
    num_anchors = draw(st.integers(1, 6))
    anchors = draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=num_anchors, unique=True))
    padded = num_anchors - len(anchors)  # anchor slots select_anchors leaves invalid
    mask = []
    for a in sorted(anchors):
        mask += [0] + [trained[a + k] if a + k < total else 0 for k in range(1, block)]
    mask += [0] * (padded * block)
    n = len(mask)
    q = torch.tensor(draw(st.lists(confidences, min_size=n, max_size=n)), dtype=torch.float64)
    per_slot_loss = (-q.log()).float().to(draw(dtypes))[None]
    return DPaceCase(per_slot_loss, torch.tensor([mask], dtype=torch.float32), block, draw(dpace_alphas))


# -- DFlash2 ------------------------------------------------------------------------------
@st.composite
def dflash2_specs(draw, max_layers: int = 3, sliding: bool | None = None, min_block: int = 2) -> DraftSpec:
    """A tiny DFlash2 drafter: convolution taps up to the block, groups that divide the hidden size
    (one group per channel up to one for all), any selector rank and top-k up to the vocabulary,
    sliding windows bidirectional or causal."""
    spec = draw(draft_specs(max_layers=max_layers, sliding=sliding, min_block=min_block))
    return dataclasses.replace(
        spec, conv_kernel_size=draw(st.integers(1, min(4, spec.block_size))),
        conv_group_size=draw(st.sampled_from([d for d in (1, 4, 8, 16, 32) if spec.hidden_size % d == 0])),
        selector_rank=draw(st.integers(1, 16)), selector_top_k=draw(st.integers(1, 12)),
        sliding_window_non_causal=draw(st.booleans()))


@dataclass(frozen=True)
class ConvCase:
    spec: DraftSpec
    layer: int
    sublayer: str  # "attention" | "mlp"
    num_blocks: int
    seed: int


@st.composite
def conv_cases(draw) -> ConvCase:
    spec = draw(dflash2_specs(max_layers=2))
    return ConvCase(spec, draw(st.integers(0, spec.num_hidden_layers - 1)), draw(st.sampled_from(["attention", "mlp"])),
                    draw(st.integers(1, 4)), draw(st.integers(0, 2**16)))


@dataclass(frozen=True)
class SelectorCase:
    spec: DraftSpec
    slots: int  # drafted slots of one block (B - 1, or fewer near the end of generation)
    first_token: int
    temperature: float
    seed: int


@st.composite
def selector_cases(draw, sampled: bool | None = None) -> SelectorCase:
    spec = draw(dflash2_specs(max_layers=1))
    use_sampling = draw(st.booleans()) if sampled is None else sampled
    return SelectorCase(spec, draw(st.integers(1, 15)), draw(st.integers(0, VOCAB - 1)),
                        draw(st.sampled_from([0.5, 1.0, 2.0])) if use_sampling else 0.0, draw(st.integers(0, 2**16)))


@dataclass(frozen=True)
class SelectorLossCase:
    num_anchors: int
    block_size: int
    top_k: int
    gamma: float
    weighting: str
    alpha: float
    seed: int


@st.composite
def selector_loss_cases(draw) -> SelectorLossCase:
    return SelectorLossCase(draw(st.integers(1, 6)), draw(st.integers(2, 16)), draw(st.integers(1, 12)),
                            draw(st.sampled_from([1.0, 4.0, 7.0])),
                            draw(st.sampled_from(["fixed-exp-decay", "dpace"])), draw(dpace_alphas),
                            draw(st.integers(0, 2**16)))


@st.composite
def dflash2_training_cases(draw, sliding: bool | None = None) -> TrainingCase:
    case = draw(training_cases(sliding=sliding))
    spec = draw(dflash2_specs(max_layers=3, sliding=sliding))
    spec = dataclasses.replace(spec, block_size=case.spec.block_size,
                               conv_kernel_size=min(spec.conv_kernel_size, case.spec.block_size))
    return dataclasses.replace(case, spec=spec)


# Rotary settings (#35): transformers' scaled rope types with their parameters relative to the spec's context
# limit (longrope needs per-dim factor lists; proportional is a partial factor by another name: not drawn).
def rope_scalings(max_positions: int) -> st.SearchStrategy:
    return st.sampled_from([
        None,
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": max_positions // 4},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": max_positions // 8},
    ])


@dataclass(frozen=True)
class RotaryCase:
    spec: DraftSpec
    length: int  # positions rotated
    position_offset: int
    seed: int


@st.composite
def rotary_specs(draw, partial: bool | None = None, interleaved: bool | None = False) -> DraftSpec:
    """A full-attention drafter with drawn rotary settings: theta, a scaling, a partial factor (rotating at
    least 2 dims), the style (neox unless `interleaved`; drawn when None). The context limit is drawn small
    too, so dynamic scaling's update is reached."""
    spec = draw(draft_specs(max_layers=2, sliding=False))
    max_positions = draw(st.sampled_from([64, QWEN3_DEFAULTS["max_position_embeddings"]]))
    factors = [f for f in (0.25, 0.5, 0.75) if int(spec.head_dim * f) % 2 == 0 and int(spec.head_dim * f) >= 2]
    use_partial = draw(st.booleans()) if partial is None else partial
    return dataclasses.replace(spec, rope_theta=draw(st.sampled_from([QWEN3_DEFAULTS["rope_theta"], 500_000.0, 1_000_000.0])),
                               max_position_embeddings=max_positions, rope_scaling=draw(rope_scalings(max_positions)),
                               partial_rotary_factor=draw(st.sampled_from(factors)) if use_partial else 1.0,
                               rope_style="gptj" if (draw(st.booleans()) if interleaved is None else interleaved)
                               else "neox")


@st.composite
def rotary_cases(draw, partial: bool | None = None, interleaved: bool | None = False) -> RotaryCase:
    return RotaryCase(draw(rotary_specs(partial, interleaved)), draw(st.integers(1, 24)),
                      draw(st.integers(0, 300)), draw(st.integers(0, 2**16)))


# DSpark (#37) and XPress (#38): tiny drafters of each family and the cases their heads run on.
@st.composite
def dspark_specs(draw) -> DraftSpec:
    spec = draw(draft_specs(max_layers=1, sliding=False))
    rank = draw(st.integers(1, 12))
    return dataclasses.replace(spec, markov_rank=rank, markov_head_type=draw(st.sampled_from(["vanilla", "gated", "rnn"])),
                               enable_confidence_head=True, confidence_head_with_markov=draw(st.booleans()),
                               sample_from_anchor=draw(st.booleans()))


@st.composite
def xpress_specs(draw) -> DraftSpec:
    spec = draw(draft_specs(max_layers=1, sliding=False))
    return dataclasses.replace(spec, xpress_rank=draw(st.integers(1, 12)), xpress_mlp_ratio=draw(st.integers(1, 3)),
                               num_jacobi_passes=draw(st.integers(0, 6)), sample_from_anchor=draw(st.booleans()))


@dataclass(frozen=True)
class HeadCase:
    spec: DraftSpec
    num_blocks: int
    anchor: int
    before_anchor: int
    seed: int


@st.composite
def head_cases(draw, specs) -> HeadCase:
    # The head checks never run the backbone: one target layer for the one draft layer lets every codebase build
    # the drafter (Model-Optimizer requires one per draft layer) at no cost to what the heads are held to.
    spec = draw(specs)
    spec = dataclasses.replace(spec, target_layer_ids=spec.target_layer_ids[-1:])
    return HeadCase(spec, draw(st.integers(1, 4)), draw(st.integers(0, VOCAB - 1)),
                    draw(st.integers(0, VOCAB - 1)), draw(st.integers(0, 2**16)))


# DSpark's and XPress's training losses (#37, #38): a family drafter's training case and a recipe of every knob its
# loss reads, drawn across speculators' ranges (a compound loss_fn, D-PACE only with ce as speculators requires).
@dataclass(frozen=True)
class FamilyLossCase:
    training: TrainingCase
    recipe: Recipe

    def __repr__(self) -> str:
        knobs = {name: getattr(self.recipe, name) for name in FAMILY_LOSS_KNOBS}
        return f"FamilyLossCase(training={self.training!r}, recipe={knobs})"


FAMILY_LOSS_KNOBS = ("loss_fn", "per_position_loss_weight", "gamma", "dpace_alpha", "max_anchors",
                     "sample_from_anchor", "confidence_head_alpha", "consistency_weight", "consistency_passes",
                     "base_anchor_weight", "base_anchor_full_weight", "ce_from_data")
weights = st.one_of(st.just(0.0), st.floats(0.05, 2.0))


@st.composite
def loss_fns(draw) -> str:
    named = st.sampled_from(["kl_div", "ce", "tv", XPRESS_LOSS])
    terms = st.dictionaries(st.sampled_from(["kl_div", "ce", "tv"]), st.floats(0.05, 2.0), min_size=2, max_size=3)
    return draw(st.one_of(named, terms.map(json.dumps)))


@st.composite
def family_loss_cases(draw, specs) -> FamilyLossCase:
    spec = draw(specs)
    lengths = tuple(draw(st.lists(st.integers(2, 12), min_size=1, max_size=2)))
    padding = draw(st.integers(0, 2))
    if sum(lengths) + padding <= spec.block_size:  # at least one anchor must fit before the last block
        lengths = lengths[:-1] + (lengths[-1] + spec.block_size + 1,)
    training = TrainingCase(spec, lengths, padding, draw(st.integers(1, 6)), draw(st.integers(0, 2**16)))
    loss_fn = draw(loss_fns())
    weighting = draw(st.sampled_from(["fixed-exp-decay", "dpace"])) if loss_fn == "ce" else "fixed-exp-decay"
    recipe = Recipe(loss_fn=loss_fn, per_position_loss_weight=weighting, gamma=draw(st.floats(0.5, 8.0)),
                    dpace_alpha=draw(st.floats(0.05, 1.0)), max_anchors=training.max_anchors,
                    sample_from_anchor=spec.sample_from_anchor, confidence_head_alpha=draw(weights),
                    consistency_weight=draw(weights), consistency_passes=draw(st.integers(0, 3)),
                    base_anchor_weight=draw(weights), base_anchor_full_weight=draw(st.booleans()),
                    ce_from_data=draw(st.booleans()))
    return FamilyLossCase(training, recipe)
