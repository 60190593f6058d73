"""vllm-project `speculators` behind the shared interface: its DFlash model, masks, anchors and losses.

Every operation calls `speculators` 0.9.0 (private helpers included). Two things are
set up for CPU: eager attention (speculators defaults to flex attention, whose eager
path materializes the mask with its own `create_float_mask`) and eager losses (the
fused ones need Triton). speculators has no inference loop and no inference mask.

Layer ids: the interface speaks z-lab ids; speculators' `aux_hidden_state_layer_ids`
are the same layers shifted by one (`hidden_states[j]`, j = id + 1).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
from torch import nn

from foundation.atomic import atomic_directory
from foundation.errors import CheckpointError
from foundation.transformers_compat import from_pretrained
from foundation.weights_dir import read_config
from impl.dflash2 import SelectorTraining
from impl.extract import HiddenStateExtractor, final_norm, output_head
from impl.families import config_family
from impl.interface import INTERFACE_VERSION, TrainingOutputs, Unsupported
from impl.layers import hidden_state_index, speculators_to_zlab
from foundation.param_names import VERIFIER_OWNED_KEYS, strip_wrapper_prefixes
from impl.recipe import DEFAULTS, Recipe, train_recipe
from impl.spec import FAMILY_FIELDS, DraftSpec
from impl.vocab_mapping import t2d_from_d2t
from reference_adapters import speculators_family_train as family_train
from reference_adapters.version_guard import check_reference, refuse_rotary

check_reference("speculators")

# After the version guard on purpose: the names below are 0.9.0's.
import speculators.models.dflash.core as spec_core  # noqa: E402
import speculators.models.dflash.model_definitions as spec_definitions  # noqa: E402
import speculators.models.utils as spec_utils  # noqa: E402
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.losses import (  # noqa: E402
    dflash_loss_decay,
    dpace_loss_decay,
    resolve_loss_config,
)
from speculators.models.attention import create_float_mask  # noqa: E402
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig  # noqa: E402
from speculators.models.dflash.attention import create_anchor_block_mask_mod  # noqa: E402
from speculators.models.dflash.metrics import compute_metrics  # noqa: E402
from speculators.models.dflash.utils import select_anchors  # noqa: E402
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig  # noqa: E402
from speculators.models.dflash2 import core as dflash2_core  # noqa: E402
from speculators.models.dflash2.metrics import (  # noqa: E402
    compute_selector_loss,
    selector_training_candidates,
)
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig  # noqa: E402
from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution  # noqa: E402

CPU_ATTENTION = "eager"


def native_layer_ids(zlab_ids) -> list[int]:
    """z-lab id i -> speculators aux id i + 1 (the same layer; the final layer is kept)."""
    return [hidden_state_index(int(i)) for i in zlab_ids]


def verifier_config(verifier_dir: str | Path | None) -> VerifierConfig:
    """speculators' record of the verifier; its path is where `load_verifier_weights` reads from."""
    if verifier_dir is None:
        return VerifierConfig(name_or_path=None, architectures=[])
    return VerifierConfig.from_pretrained(str(verifier_dir))


# speculators' model and config class of each family (`speculators_model_type`): the one table the adapter, the
# format reader and writer (dflash_audit/formats/speculators.py) and the reference recipe read.
MODEL_CLASSES = {"dflash": DFlashDraftModel, "dflash2": DFlash2DraftModel, "dspark": DSparkDraftModel,
                 "xpress": XPressDraftModel}
CONFIG_CLASSES = {"dflash": DFlashSpeculatorConfig, "dflash2": DFlash2SpeculatorConfig,
                  "dspark": DSparkSpeculatorConfig, "xpress": XPressSpeculatorConfig}


def speculators_config(spec: DraftSpec, verifier_dir: str | Path | None = None,
                       aux_layer_ids=None) -> DFlashSpeculatorConfig:
    """The `DFlashSpeculatorConfig` (`DFlash2SpeculatorConfig`) of a spec, laid out as speculators' own
    `_build_base_config_kwargs` lays out a DFlash one (the slot layout as `sample_from_anchor` and the
    greedy proposal's `speculative_tokens`)."""
    own = {name: getattr(spec, name) for name in FAMILY_FIELDS[spec.family]}
    return CONFIG_CLASSES[spec.family](
        **own,
        transformer_layer_config=spec.qwen3_config(),
        draft_vocab_size=spec.head_size,
        block_size=spec.block_size,
        aux_hidden_state_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None
        else native_layer_ids(spec.target_layer_ids),
        mask_token_id=spec.mask_token_id,
        sample_from_anchor=spec.sample_from_anchor,
        sliding_window_non_causal=spec.sliding_window_non_causal,
        speculators_config=SpeculatorsConfig(
            algorithm=spec.family,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=spec.speculative_tokens)],
            default_proposal_method="greedy",
            verifier=verifier_config(verifier_dir),
        ),
    )


def on_cpu_attention(config: DFlashSpeculatorConfig) -> DFlashSpeculatorConfig:
    config.transformer_layer_config._attn_implementation = CPU_ATTENTION
    return config


def load_body(model: DFlashDraftModel, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """The draft body into speculators' model; a reduced draft vocabulary's map through its own
    `load_vocab_mappings` (which checks the shapes), t2d rebuilt from d2t as its mapping builder does."""
    body = strip_wrapper_prefixes(state_dict)
    missing, unexpected = model.load_state_dict(body, strict=False)
    missing = [k for k in missing if k not in VERIFIER_OWNED_KEYS]
    if missing or unexpected:
        raise CheckpointError(f"{source}: the draft body does not fit speculators' {type(model).__name__} "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if model.use_draft_vocab:
        d2t = body["d2t"].long()
        model.load_vocab_mappings(t2d_from_d2t(d2t, model.verifier_vocab_size), d2t)


def fill_verifier_tensors(model: DFlashDraftModel, target: nn.Module | None) -> None:
    """Verifier-owned tensors: speculators' own loader when it knows a verifier dir, else copied from `target`
    (a reduced draft vocabulary's `verifier_lm_head` is the head's `t2d` rows, as that loader takes them)."""
    if model.config.speculators_config.verifier.name_or_path:
        model.load_verifier_weights()
        return
    if target is None:
        return  # left NaN, as speculators leaves them: any use shows up at once
    head = output_head(target).weight.detach()
    if model.use_draft_vocab:
        head = head[model.t2d.to(head.device)]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight.detach())
        if not model.use_draft_vocab:  # a reduced head is the drafter's own, loaded with its body
            model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head)
        model.verifier_norm.weight.copy_(final_norm(target).weight.detach())


def load_speculators_model(path: str | Path, verifier_dir: str | Path | None = None) -> DFlashDraftModel:
    """A speculators directory through its own `from_pretrained` (eager attention, fp32, eval).

    `verifier_dir` replaces the verifier path recorded in the config (it is where the
    verifier-owned tensors are read from).
    """
    try:
        family = config_family(read_config(Path(path)))
        config = on_cpu_attention(CONFIG_CLASSES[family].from_pretrained(str(path)))
        if verifier_dir is not None:
            config.speculators_config.verifier = verifier_config(verifier_dir)
        elif not _is_local_dir(config.speculators_config.verifier.name_or_path):
            config.speculators_config.verifier = verifier_config(None)  # never reach for the network
        model = from_pretrained(MODEL_CLASSES[family], str(path), config=config, dtype=torch.float32)
        if family == "xpress":
            model = rebuilt_with_buffers(model)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: speculators' DFlashDraftModel cannot load it "
                              f"({' '.join(str(exc).split())[:200]})") from exc
    return model.eval()


def rebuilt_with_buffers(model: DFlashDraftModel) -> DFlashDraftModel:
    """The same weights in a model its own constructor built. speculators 0.9.0's `XPressRefinerHead` keeps its
    causal mask `causal_tril` as a non-persistent buffer; under transformers 5.19 `from_pretrained` builds the
    model on the meta device and leaves that buffer as uninitialized memory (its refiner then mixes garbage,
    often NaN). The class's own `__init__` fills it; its own `load_state_dict` takes the loaded weights."""
    built = type(model)(model.config)
    built.load_state_dict(model.state_dict())
    return built.to(next(model.parameters()).dtype)


def save_speculators_model(model: DFlashDraftModel, path: str | Path) -> None:
    """speculators' own `save_pretrained`, into a temp dir renamed into place."""
    atomic_directory(Path(path), lambda tmp: model.save_pretrained(str(tmp)))


def family_recipe(drafter: DFlashDraftModel, max_anchors: int) -> Recipe:
    """A DSpark or XPress drafter's training forward without a recipe given: its family's trainer defaults."""
    family = drafter.config.speculators_model_type
    return train_recipe(family).replace(max_anchors=max_anchors, sample_from_anchor=drafter.config.sample_from_anchor)


def _is_local_dir(name_or_path: str | None) -> bool:
    return bool(name_or_path) and (Path(name_or_path) / "config.json").is_file()


def _materialize(mask_mod, q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """speculators' eager mask creation (0 / -inf floats) read back as booleans [q_len, kv_len]."""
    floats = create_float_mask(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device,
                               dtype=torch.float32)
    return torch.isfinite(floats)[0, 0]


class SpeculatorsImplementation:
    name = "speculators"
    interface_version = INTERFACE_VERSION  # kept current with the interface
    unsupported: frozenset[str] = frozenset({"inference_mask", "generate", "selector_path"})

    def __init__(self, verifier_dir: str | Path | None = None):
        self.verifier_dir = verifier_dir

    def default_target_layer_ids(self, num_target_layers, num_draft_layers):
        """speculators' default (`[2, N//2, N-3]`, whatever the draft depth) in z-lab ids."""
        # `resolve_target_layer_ids` reads only num_hidden_layers from the verifier config.
        verifier = SimpleNamespace(num_hidden_layers=num_target_layers)
        with mock.patch.object(spec_utils, "get_verifier_config", lambda *_a, **_k: verifier), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            aux_ids = spec_utils.resolve_target_layer_ids(None, "<verifier>")
        return speculators_to_zlab(aux_ids)

    def context_features(self, hidden_states, layer_ids):
        return torch.cat([hidden_states[j] for j in native_layer_ids(layer_ids)], dim=-1)

    def select_anchors(self, loss_mask, max_anchors, block_size, seed):
        torch.manual_seed(seed)
        return select_anchors(loss_mask, max_anchors, block_size)

    def training_mask(self, document_ids, anchors, block_size, sliding_window, causal_block):
        if sliding_window is None and causal_block:
            raise Unsupported("speculators: full-attention blocks are always bidirectional")
        document_ids = document_ids.reshape(-1)
        mask_mod, q_len, kv_len = create_anchor_block_mask_mod(
            document_ids=document_ids, total_seq_len=document_ids.numel(), anchor_positions=anchors.reshape(-1),
            block_size=block_size, sliding_window=sliding_window, sliding_window_non_causal=not causal_block)
        return _materialize(mask_mod, q_len, kv_len, device=document_ids.device)

    def inference_mask(self, context_len, block_len, sliding_window, causal):
        raise Unsupported("speculators: no inference loop, hence no inference mask")

    def build_drafter(self, spec: DraftSpec, state_dict, target: nn.Module | None = None) -> DFlashDraftModel:
        refuse_rotary(spec, "speculators: 0.9.0", "model_definitions.py")
        verifier_dir = self.verifier_dir
        if verifier_dir is None and target is not None and _is_local_dir(getattr(target, "name_or_path", None)):
            verifier_dir = target.name_or_path
        model = MODEL_CLASSES[spec.family](on_cpu_attention(speculators_config(spec, verifier_dir)))
        load_body(model, state_dict, "speculators drafter")
        fill_verifier_tensors(model, target)
        return model.float().eval()

    def vocab_mapping(self, token_freq, draft_vocab_size, target_vocab_size):
        return build_vocab_mappings_from_distribution(token_freq, draft_vocab_size, target_vocab_size)

    def proposed_ids(self, drafter: DFlashDraftModel, hidden, target):
        """Its own `lm_head` (the draft vocabulary's), then its `d2t` offsets: the id vLLM serves."""
        draft = drafter.lm_head(hidden).argmax(-1)
        return draft + drafter.d2t[draft] if drafter.use_draft_vocab else draft

    def project_context(self, drafter, context_features):
        return drafter.hidden_norm(drafter.fc(context_features))

    @torch.no_grad()
    def apply_rotary(self, drafter: DFlashDraftModel, x, position_ids):
        """speculators' own rotary (`rotary_emb`, then model_definitions' `apply_rotary_pos_emb`, keys' side)."""
        cos, sin = drafter.rotary_emb(x, position_ids)
        return spec_definitions.apply_rotary_pos_emb(x, x, cos, sin)[1]

    def _block_masks(self, drafter: DFlashDraftModel, context_len: int, block_len: int, device) -> dict:
        """Per-window masks of one anchor block after the context: speculators' training masks, one anchor."""
        # The anchor (the block's first token) sits at position `context_len`, one past the
        # context, so its document id is one entry past the context's.
        masks = {}
        for window in {drafter.sliding_window if i in drafter.sliding_window_indices else None
                       for i in range(len(drafter.layers))}:
            mask_mod, q_len, kv_len = create_anchor_block_mask_mod(
                document_ids=torch.zeros(context_len + 1, dtype=torch.long, device=device), total_seq_len=context_len,
                anchor_positions=torch.tensor([context_len], device=device), block_size=block_len,
                sliding_window=window, sliding_window_non_causal=drafter.sliding_window_non_causal)
            masks[window] = drafter._create_mask_fn(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len,
                                                    device=device)
        return masks

    @torch.no_grad()
    def draft_forward(self, drafter: DFlashDraftModel, noise_embedding, target_hidden, position_ids):
        """speculators' decoder layers, fed as `_backbone_forward` feeds them, on one block after a context."""
        context = drafter.hidden_norm(drafter.fc(target_hidden))
        masks = self._block_masks(drafter, context.shape[1], noise_embedding.shape[1], noise_embedding.device)
        position_embeddings = drafter.rotary_emb(noise_embedding, position_ids)
        hidden = noise_embedding
        for index, layer in enumerate(drafter.layers):
            window = drafter.sliding_window if index in drafter.sliding_window_indices else None
            hidden = layer(hidden_states=hidden, target_hidden=context, attention_mask=masks[window],
                           position_ids=position_ids, use_cache=False, position_embeddings=position_embeddings)
        return drafter.norm(hidden)

    @contextlib.contextmanager
    def _training_forward(self, drafter: DFlashDraftModel, target, input_ids, seed, anchors):
        """`(the target's states, what the forward drew)` for one training forward of speculators' model: anchors
        drawn after `manual_seed(seed)` (or `anchors` handed to it in place of its `select_anchors`)."""
        # Its aux ids index `hidden_states` directly; the extractor reads the same entries
        # through the z-lab ids, and captures the raw final-layer output speculators trains on.
        states = HiddenStateExtractor(target, speculators_to_zlab(drafter.target_layer_ids))(input_ids)
        captured = {}
        build_masks = drafter._build_attention_mask

        def keep_anchors(*args, **kwargs):
            result = build_masks(*args, **kwargs)
            captured["anchors"], captured["valid"] = result[2], result[3]
            return result

        torch.manual_seed(seed)
        given = mock.patch.object(spec_core, "select_anchors", lambda *_a, **_k: anchors) if anchors is not None \
            else contextlib.nullcontext()
        with given, mock.patch.object(drafter, "_build_attention_mask", keep_anchors):
            yield states, captured

    def training_outputs(self, drafter: DFlashDraftModel, target, input_ids, loss_mask, document_ids,
                         max_anchors, seed, anchors=None):
        """speculators' `_backbone_forward` on the target's states (DFlash2, DSpark, XPress: the model's own
        forward), anchors drawn after `manual_seed(seed)` (or `anchors` handed to it in place of its
        `select_anchors`)."""
        family = drafter.config.speculators_model_type
        if family in family_train.CORES:
            recipe = family_recipe(drafter, max_anchors)
            with torch.no_grad():
                forward, captured = self._family_forward(drafter, target, input_ids, loss_mask, document_ids,
                                                         recipe, seed, anchors)
            hidden, _, targets, aligned_mask, _ = forward.backbone
            logits, heads = forward.training(family)
            return TrainingOutputs(anchors=captured["anchors"], anchor_valid=captured["valid"], logits=logits,
                                   targets=targets, loss_mask=aligned_mask.float(), hidden=hidden, family=heads)
        with torch.no_grad(), self._training_forward(drafter, target, input_ids, seed, anchors) as (states, captured):
            if isinstance(drafter, DFlash2DraftModel):
                return self._dflash2_training_outputs(drafter, states, input_ids, loss_mask, document_ids,
                                                      max_anchors, captured)
            hidden, logits, targets, aligned_mask, _ = drafter._backbone_forward(
                states.context, input_ids, loss_mask, states.final_raw, document_ids, max_anchors=max_anchors)
        return TrainingOutputs(anchors=captured["anchors"], anchor_valid=captured["valid"], logits=logits,
                               targets=targets, loss_mask=aligned_mask.float(), hidden=hidden)

    def _family_forward(self, drafter, target, input_ids, loss_mask, document_ids, recipe, seed, anchors):
        with self._training_forward(drafter, target, input_ids, seed, anchors) as (states, captured):
            forward = family_train.family_forward(drafter, drafter.config.speculators_model_type, states, input_ids,
                                                  loss_mask, document_ids, family_train.trainer_kwargs(drafter, recipe))
        return forward, captured

    def family_loss(self, drafter, target, input_ids, loss_mask, document_ids, recipe: Recipe, seed, anchors=None):
        """Every loss term of one DSpark or XPress training forward (speculators' metric names, the total under
        "loss"), from the model's own forward with the knobs its own `get_trainer_kwargs` resolves from `recipe`."""
        if drafter.config.speculators_model_type not in family_train.CORES:
            raise Unsupported("speculators: family_loss is DSpark's and XPress's")
        forward, _ = self._family_forward(drafter, target, input_ids, loss_mask, document_ids, recipe, seed, anchors)
        return forward.terms()

    def _dflash2_training_outputs(self, drafter, states, input_ids, loss_mask, document_ids, max_anchors, captured):
        """DFlash2's own `forward`, read where it hands everything to `compute_metrics` (and its backbone)."""
        backbone, metrics = drafter._backbone_forward, dflash2_core.compute_metrics

        def keep_backbone(*args, **kwargs):
            captured["backbone"] = backbone(*args, **kwargs)
            return captured["backbone"]

        def keep_metrics(**kwargs):
            captured["metrics"] = kwargs
            return metrics(**kwargs)

        with mock.patch.object(drafter, "_backbone_forward", keep_backbone), \
                mock.patch.object(dflash2_core, "compute_metrics", keep_metrics):
            # Eager losses: the fused ones need Triton. The loss itself is not read here.
            drafter(states.context, input_ids, loss_mask, states.final_raw, document_ids, max_anchors=max_anchors,
                    loss_config=resolve_loss_config("kl_div", "eager"),
                    tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0])
        hidden, logits, targets, aligned_mask, block_indices = captured["backbone"]
        seen = captured["metrics"]
        selector = SelectorTraining(
            predecessors=drafter._predecessor_ids(input_ids, block_indices).reshape(1, -1),
            candidates=seen["training_candidate_ids"], label_positions=seen["target_positions"],
            contains_target=seen["contains_target"], scores=seen["candidate_logits"])
        return TrainingOutputs(anchors=captured["anchors"], anchor_valid=captured["valid"], logits=logits,
                               targets=targets, loss_mask=aligned_mask.float(), hidden=hidden, selector=selector)

    def loss_weights(self, block_size, gamma, sample_from_anchor):
        return dflash_loss_decay(torch.arange(block_size), gamma=gamma, sample_from_anchor=sample_from_anchor)

    def _metrics(self, logits, targets, loss_mask, block_size, gamma=DEFAULTS["gamma"], loss_fn=DEFAULTS["loss_fn"],
                 sample_from_anchor=False):
        return compute_metrics(logits, targets, loss_mask, block_size, gamma=gamma,
                               loss_config=resolve_loss_config(loss_fn, "eager"), sample_from_anchor=sample_from_anchor)

    def loss(self, logits, targets, loss_mask, block_size, gamma, loss_fn, sample_from_anchor):
        return self._metrics(logits, targets, loss_mask, block_size, gamma, loss_fn, sample_from_anchor)[0]

    def dpace_weights(self, per_slot_loss, loss_mask, block_size, dpace_alpha):
        # As speculators' loss_function hands it over: the per-slot loss already multiplied by the mask.
        masked = per_slot_loss * loss_mask.to(per_slot_loss.dtype)
        pos_idx = (torch.arange(per_slot_loss.shape[1]) % block_size)[None]
        return dpace_loss_decay(pos_idx.to(masked.dtype), loss_mask=loss_mask, block_size=block_size,
                                dpace_alpha=dpace_alpha, elementwise_loss=masked)

    def dpace_loss(self, logits, targets, loss_mask, block_size, dpace_alpha):
        loss, _ = compute_metrics(logits, targets, loss_mask, block_size, loss_config=resolve_loss_config("ce", "eager"),
                                  per_position_loss_weight="dpace", dpace_alpha=dpace_alpha)
        return loss

    def block_metrics(self, logits, targets, loss_mask, block_size):
        _, metrics = self._metrics(logits, targets, loss_mask, block_size)
        position_acc = torch.stack([
            metrics[f"position_{k}_acc_sum"].float() / metrics[f"position_{k}_acc_total"].float().clamp(min=1)
            for k in range(1, block_size)])
        eal = metrics["eal_sum"].float() / metrics["eal_total"].float().clamp(min=1)
        return {"position_acc": position_acc, "eal": eal}

    def generate(self, drafter, target, input_ids, max_new_tokens, stop_token_ids, temperature=0.0, seed=0):
        raise Unsupported("speculators: no inference loop (it trains drafters; vLLM serves them)")

    # -- slot layout -------------------------------------------------------------------------
    def speculative_tokens(self, block_size, sample_from_anchor):
        """The greedy proposal's `speculative_tokens` that `DFlashDraftModel._build_base_config_kwargs` (what
        `from_training_args` writes) gives; the verifier lookups it makes are answered offline."""
        from transformers import Qwen3Config

        verifier = SimpleNamespace(num_hidden_layers=4)
        with mock.patch.object(spec_utils, "get_verifier_config", lambda *_a, **_k: verifier), \
                mock.patch.object(VerifierConfig, "from_pretrained", lambda *_a, **_k: verifier_config(None)):
            kwargs = DFlashDraftModel._build_base_config_kwargs(
                "dflash", Qwen3Config(), verifier_name_or_path="<verifier>", draft_vocab_size=None,
                block_size=block_size, target_layer_ids=[1, 2], sample_from_anchor=sample_from_anchor)
        return int(kwargs["speculators_config"].proposal_methods[0].speculative_tokens)

    @torch.no_grad()
    def proposal_logits(self, drafter: DFlashDraftModel, target, input_ids):
        """speculators has no decoding loop: the slots that propose are the ones its training trains, by its own
        `dflash_loss_decay` under the drafter's `sample_from_anchor` (weight > 0), read in slot order; the
        block runs through its decoder layers as `draft_forward` runs it."""
        start, block_size = input_ids.shape[1] - 1, drafter.block_size
        states = target(input_ids[:, :start], output_hidden_states=True).hidden_states
        features = self.context_features(states, speculators_to_zlab(drafter.target_layer_ids))
        block = torch.full((1, block_size), drafter.mask_token_id, dtype=torch.long)
        block[0, 0] = input_ids[0, -1]
        positions = torch.arange(start + block_size)[None]
        hidden = self.draft_forward(drafter, drafter.embed_tokens(block), features, positions)
        trained = dflash_loss_decay(torch.arange(block_size), gamma=DEFAULTS["gamma"],
                                    sample_from_anchor=drafter.config.sample_from_anchor) > 0
        return drafter.lm_head(hidden)[0][trained]

    # -- DSpark and XPress: its own heads -----------------------------------------------------
    def markov_bias(self, drafter, prev_ids, hidden):
        return drafter.markov_head.block_bias(prev_token_ids=prev_ids, hidden_states=hidden)

    def confidence_logits(self, drafter, prev_ids, hidden):
        """As `DSparkDraftModel.forward` builds the head's input: [hidden ; markov embedding] when configured."""
        features = hidden
        if drafter.config.confidence_head_with_markov:
            features = torch.cat([hidden, drafter.markov_head.prev_embeddings(prev_ids).to(hidden.dtype)], dim=-1)
        return drafter.confidence_head(features)

    def markov_path(self, drafter, hidden, base_logits, anchor):
        """No inference loop in speculators: its own `block_bias` over the chain so far, slot by slot, as vLLM's
        runner chains the head (reference_adapters/speculators_family_heads.py)."""
        from reference_adapters.speculators_family_heads import markov_tokens

        first = 0 if drafter.config.sample_from_anchor else 1
        return torch.tensor(markov_tokens(drafter, hidden, base_logits, anchor, first))

    def refiner_bias(self, drafter, prev_ids, hidden):
        return drafter.refiner_head.block_bias(prev_ids, hidden_states=hidden)

    def jacobi_tokens(self, drafter, hidden, base_logits, anchor, before_anchor):
        from reference_adapters.speculators_family_heads import jacobi_tokens

        return torch.tensor(jacobi_tokens(drafter, hidden, base_logits.clone(), anchor, before_anchor))

    # -- DFlash2 ----------------------------------------------------------------------------
    def dynamic_conv(self, drafter: DFlash2DraftModel, layer_idx, sublayer, x, y, block_size):
        conv = getattr(drafter.layers[layer_idx], f"{sublayer}_conv")
        prepared, delta = conv.prepare(x)
        return prepared, conv.finish(y, delta)

    def selector_path(self, drafter, hidden, unary_logits, first_token, temperature=0.0, seed=0):
        raise Unsupported("speculators: no inference loop, so no selector path (it scores teacher-forced "
                          "predecessors only)")

    def selector_scores(self, drafter: DFlash2DraftModel, unary_logits, hidden, predecessors, candidates):
        return drafter.candidate_selector.score_candidates(unary_logits, hidden, predecessors, candidates)

    def selector_training_candidates(self, candidate_ids, target_ids):
        return selector_training_candidates(candidate_ids, target_ids)

    def selector_loss(self, candidate_scores, label_positions, loss_mask, block_size, gamma, per_position_loss_weight,
                      dpace_alpha):
        return compute_selector_loss(candidate_scores, label_positions, loss_mask, block_size, gamma=gamma,
                                     per_position_loss_weight=per_position_loss_weight, dpace_alpha=dpace_alpha)
