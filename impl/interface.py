"""The one interface that `impl/` and both reference adapters implement.

A conformance test is written once against `DFlashImplementation` and parametrized over
`ours`, `speculators` and `zlab`. An implementation that lacks an operation raises
`Unsupported` (speculators has no inference loop; z-lab has no training loss), and the
test compares what exists.

Conventions shared by every operation:
- target layer ids are in the z-lab convention (0-based decoder layer whose output is
  used, read as `hidden_states[id + 1]`); adapters translate internally;
- masks are dense boolean tensors, True = may attend;
- training layout (speculators'): queries are `A` anchor blocks of `B` slots, keys are
  `[packed base sequence (T) | all blocks (A*B)]`;
- inference layout (z-lab's): queries are one block, keys are `[context | block]`.

The interface is versioned (`INTERFACE_VERSION`; what each version added: impl/interface_versions.py). A plug
declares the version it implements as a class attribute, `interface_version = N`; a call of a later version
that it cannot take is reported as a plug mismatch naming that change, never as a divergence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from impl.dflash2 import SelectorTraining
from impl.family_losses import FamilyTraining
from impl.interface_versions import CURRENT as INTERFACE_VERSION
from impl.spec import DraftSpec


class Unsupported(NotImplementedError):
    """This implementation has no such operation, or cannot express this case of it (a causal
    full-attention block, a KL loss in a CE-only trainer). Raised by a whole operation it is
    declared in `unsupported`; raised for one case, the comparator records that case n/a with
    the message as its reason, never a failure."""


@dataclass
class TrainingOutputs:
    """What one training forward produces, in the training layout."""

    anchors: torch.Tensor  # [A] long, sorted; padded slots are 0
    anchor_valid: torch.Tensor  # [A] bool
    logits: torch.Tensor  # [1, A*B, V] drafter logits
    targets: torch.Tensor  # [1, A*B, V] verifier logits aligned to the slots
    loss_mask: torch.Tensor  # [1, A*B] aligned loss mask (slot 0 and padded anchors zeroed)
    hidden: torch.Tensor | None = None  # [1, A*B, H] drafter hidden states after the final norm
    selector: SelectorTraining | None = None  # DFlash2: the selector's candidates, labels and scores
    # DSpark, XPress: what their heads add (confidence logits; the rounds' and the backbone's logits). `logits` are
    # then the ones the family trains: Markov-corrected (DSpark), teacher-forced refined (XPress).
    family: FamilyTraining | None = None
    # Hard-label trainers (CE on the data's next tokens) have no verifier logits: `targets` is
    # None, `target_ids` [1, A*B] the label of each slot, and `unsupported` says why.
    target_ids: torch.Tensor | None = None
    unsupported: dict[str, str] = field(default_factory=dict)  # field name -> why this implementation has none

    def get(self, name: str) -> Any:
        """A field's value; `Unsupported` (n/a in the comparator) for one this implementation has none of."""
        if name in self.unsupported:
            raise Unsupported(self.unsupported[name])
        return getattr(self, name)


@dataclass
class GenerationResult:
    output_ids: torch.Tensor  # [1, prompt + generated]
    acceptance_lengths: list[int]  # per round, bonus token included
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class DFlashImplementation(Protocol):
    name: str
    interface_version: int  # the INTERFACE_VERSION the plug was written against

    def default_target_layer_ids(self, num_target_layers: int, num_draft_layers: int) -> list[int]:
        """Layer ids (z-lab convention) used when a drafter names none."""

    def context_features(self, hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
        """Concatenated context features from a Hugging Face `hidden_states` tuple."""

    def select_anchors(self, loss_mask: torch.Tensor, max_anchors: int, block_size: int,
                       seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(anchors [max_anchors], valid [max_anchors])` for a [1, T] loss mask, drawn after `torch.manual_seed(seed)`."""

    def training_mask(self, document_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                      sliding_window: int | None, causal_block: bool) -> torch.Tensor:
        """bool [A*B, T + A*B]."""

    def inference_mask(self, context_len: int, block_len: int, sliding_window: int | None,
                       causal: bool) -> torch.Tensor:
        """bool [block_len, context_len + block_len]."""

    def build_drafter(self, spec: DraftSpec, state_dict: dict[str, torch.Tensor],
                      target: nn.Module | None = None) -> Any:
        """An opaque drafter handle with exactly these draft-body weights (fp32, eval mode).

        `target` supplies verifier-owned tensors (embeddings, LM head, final norm) when the
        implementation stores them.
        """

    def project_context(self, drafter: Any, context_features: torch.Tensor) -> torch.Tensor:
        """`hidden_norm(fc(context_features))`."""

    def apply_rotary(self, drafter: Any, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The drafter's rotary embedding applied to `x` [1, heads, n, head_dim] (as to its keys) at `position_ids`
        [1, n]. Optional: a codebase without it is n/a in the rotary component."""

    def draft_forward(self, drafter: Any, noise_embedding: torch.Tensor, target_hidden: torch.Tensor,
                      position_ids: torch.Tensor) -> torch.Tensor:
        """Draft hidden states [1, q, H] for one block after a context (inference layout, no cache)."""

    def training_outputs(self, drafter: Any, target: nn.Module, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                         document_ids: torch.Tensor, max_anchors: int, seed: int,
                         anchors: tuple[torch.Tensor, torch.Tensor] | None = None) -> TrainingOutputs:
        """One training forward on a packed [1, T] sequence: the target is run for its states, anchors drawn after
        `torch.manual_seed(seed)`, or `anchors = (positions [A], valid [A])` used as given (the reference's own,
        so that a check downstream of the anchors compares only its own component)."""

    def loss_weights(self, block_size: int, gamma: float, sample_from_anchor: bool) -> torch.Tensor:
        """Per-slot weights [B]."""

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
             gamma: float, loss_fn: str, sample_from_anchor: bool) -> torch.Tensor:
        """The scalar training loss with the implementation's reduction."""

    def dpace_weights(self, per_slot_loss: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                      dpace_alpha: float) -> torch.Tensor:
        """[1, A*B] D-PACE per-slot weights from a per-slot CE loss [1, A*B] and the aligned loss mask."""

    def dpace_loss(self, logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                   dpace_alpha: float) -> torch.Tensor:
        """The scalar CE training loss weighted by D-PACE, with the implementation's reduction (differentiable)."""

    def block_metrics(self, logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor,
                      block_size: int) -> dict[str, torch.Tensor]:
        """`{"position_acc": [B-1] accuracy of slots 1..B-1, "eal": scalar}`."""

    def generate(self, drafter: Any, target: nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                 stop_token_ids: list[int] | None, temperature: float = 0.0, seed: int = 0) -> GenerationResult:
        """Live DFlash decoding with per-round acceptance lengths: greedy, or rejection sampling at
        `temperature` > 0 with the global torch generator seeded with `seed` (z-lab's draw order)."""


# The operations beyond DFlash, each group one Protocol: conformance/plug.py reads the current signatures of every
# operation from these (to name the interface change behind a call a plug cannot take).
class DraftVocabOperations(Protocol):
    """A reduced draft vocabulary (catalogue #32); an implementation without one declares them `unsupported`."""

    def vocab_mapping(self, token_freq: dict[int, int], draft_vocab_size: int,
                      target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(d2t [draft] offsets, t2d [target] bool)` built from token frequencies."""

    def proposed_ids(self, drafter: Any, hidden: torch.Tensor, target: nn.Module) -> torch.Tensor:
        """The target token ids a drafter proposes (greedy) from draft hidden states [..., H], through its own
        head and draft-to-target map."""


class SlotLayoutOperations(Protocol):
    """The slot layout (`DraftSpec.sample_from_anchor`, impl/slot_layout.py): how many tokens a block proposes
    and which slots' logits propose them. An implementation without the layout raises `Unsupported`."""

    def speculative_tokens(self, block_size: int, sample_from_anchor: bool) -> int:
        """Tokens one block of `block_size` slots proposes under the layout."""

    def proposal_logits(self, drafter: Any, target: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """[n, V]: the logits each proposal of one block is drawn from, in proposal order: the block
        `[input_ids[-1], mask x (B-1)]` drafted after the target's features of `input_ids[:-1]` [1, T]."""


class DFlash2Operations(Protocol):
    """What a DFlash2 implementation adds; a DFlash-only one declares them `unsupported`."""

    def dynamic_conv(self, drafter: Any, layer_idx: int, sublayer: str, x: torch.Tensor, y: torch.Tensor,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(prepare(x), finish(y, delta))` of layer `layer_idx`'s `attention` or `mlp` convolution pair, the delta
        being the output-side kernel `prepare(x)` projected; x, y [1, A*B, H] hold blocks of `block_size` slots."""

    def selector_path(self, drafter: Any, hidden: torch.Tensor, unary_logits: torch.Tensor, first_token: int,
                      temperature: float = 0.0, seed: int = 0):
        """`(tokens [n], candidates [n, k], probs [n, k] or None)`: the selector's path through one block's
        slots (hidden [1, n, H], unary logits [1, n, V]) from `first_token`; sampled after `manual_seed(seed)`."""

    def selector_scores(self, drafter: Any, unary_logits: torch.Tensor, hidden: torch.Tensor,
                        predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[..., k] scores of `candidates` given each slot's predecessor (unary + transition)."""

    def selector_training_candidates(self, candidate_ids: torch.Tensor, target_ids: torch.Tensor):
        """`(candidates, label positions, contains target)` from the unary top-k (best first) and hard targets."""

    def selector_loss(self, candidate_scores: torch.Tensor, label_positions: torch.Tensor, loss_mask: torch.Tensor,
                      block_size: int, gamma: float, per_position_loss_weight: str,
                      dpace_alpha: float) -> torch.Tensor:
        """The scalar K-way selector loss, weighted and reduced as the implementation trains."""


class FamilyHeadOperations(Protocol):
    """What DSpark (a Markov logit bias and a confidence head, #37) and XPress (a causal refiner resolved by Jacobi
    passes, #38) add to a DFlash drafter; a codebase without a family declares its operations `unsupported`, and a
    case it cannot express (a head setting it lacks) raises `Unsupported`."""

    def markov_bias(self, drafter: Any, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[N, B, V] the Markov head's logit bias of teacher-forced blocks: previous tokens [N, B], hidden [N, B, H]."""

    def confidence_logits(self, drafter: Any, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[N, B] the confidence head's logit per slot of teacher-forced blocks (inputs as `markov_bias`)."""

    def markov_path(self, drafter: Any, hidden: torch.Tensor, base_logits: torch.Tensor, anchor: int) -> torch.Tensor:
        """[n] the greedy proposals of one block (hidden [1, B, H], the drafter's own logits [1, B, V]) drafted left
        to right through the Markov chain, its first slot following `anchor`."""

    def refiner_bias(self, drafter: Any, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[N, B, V] the XPress refiner's logit bias of teacher-forced blocks (inputs as `markov_bias`)."""

    def jacobi_tokens(self, drafter: Any, hidden: torch.Tensor, base_logits: torch.Tensor, anchor: int,
                      before_anchor: int) -> torch.Tensor:
        """[n] the greedy proposals of one block after the drafter's Jacobi passes; `before_anchor` is the token
        before the anchor (the anchor-as-bonus layout's slot 0 follows it)."""


class FamilyTrainingOperations(Protocol):
    """DSpark's and XPress's training losses (#37, #38); a codebase that does not train them lacks the operation
    (n/a) or declares it `unsupported`."""

    def family_loss(self, drafter: Any, target: nn.Module, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                    document_ids: torch.Tensor, recipe: Any, seed: int,
                    anchors: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Every loss term of one training forward of a DSpark or XPress drafter on a packed [1, T] sequence, under
        speculators' metric names ("loss" the total; "confidence_loss"; "tf_loss", "consistency_loss",
        "consistency_round{j}_loss", "base_anchor_loss"; "<name>_loss" of a weighted loss_fn), trained with
        `recipe` (an `impl.recipe.Recipe`: every knob in speculators' names), anchors as `training_outputs`."""


def supports(implementation: Any, operation: str) -> bool:
    """Whether `operation` is implemented: not declared in `implementation.unsupported`, and there at all
    (an implementation written before DFlash2 has none of its operations)."""
    return (operation not in getattr(implementation, "unsupported", frozenset())
            and callable(getattr(implementation, operation, None)))
