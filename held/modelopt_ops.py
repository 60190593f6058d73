"""NVIDIA Model-Optimizer 0.47.0's DFlash behind the interface's operations, run inside its own environment.

Imported only by the worker (held/modelopt_worker.py) under transformers 5.14.1: Model-Optimizer's DFlash
drafter cannot run on the suite's transformers 5.19 (held/modelopt.py says why). Every operation calls
Model-Optimizer's own code: `modelopt.torch.speculative.convert` turns a copy of the target into its
`HFDFlashModel` (the drafter lives on the converted target, as in its trainer), whose methods draw the anchors
(`_sample_anchor_positions`), build the masks (`_build_draft_attention_mask`, `_build_generate_swa_mask`), run
the training forward (`forward`, `_compute_loss`) and the drafter (`DFlashModule`). The glue only translates
the interface: shapes, the interface's [1, A*B] slot layout into its (input ids, anchors, teacher logits).
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import modelopt
import torch
import yaml
from modelopt.torch import speculative as mtsp
from modelopt.torch.speculative.config import DFlashConfig
from modelopt.torch.speculative.plugins import hf_dflash, modeling_dflash
from torch import nn

from dflash_world.target_training import random_qwen3
from impl.interface import TrainingOutputs, Unsupported
from foundation.param_names import strip_wrapper_prefixes
from impl.recipe import DEFAULTS
from impl.spec import DraftSpec

RECIPE = Path(modelopt.__file__).parents[1] / "modelopt_recipes" / "general" / "speculative_decoding" / "dflash.yaml"
# Drafter settings passed through `dflash_architecture_config` (Model-Optimizer builds a Qwen3Config from them).
ARCHITECTURE_FIELDS = ("num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "rms_norm_eps", "max_position_embeddings", "attention_bias", "hidden_act",
                       "rope_theta")
HFDFlashModel = hf_dflash.HFDFlashModel


def recipe_config() -> DFlashConfig:
    """Its shipped DFlash recipe (`dflash.yaml`'s `dflash:` section) resolved by its own `DFlashConfig`."""
    return DFlashConfig(**yaml.safe_load(RECIPE.read_text())["dflash"])


def recipe() -> dict:
    """The recipe in speculators' names. It distills from the target's logits (`dflash_self_logit_distillation`,
    a soft-target cross-entropy: KL up to the target's entropy), weighted by D-PACE (`dflash_loss_objective`)."""
    config = recipe_config()
    return {"loss_fn": "kl_div" if config.dflash_self_logit_distillation else "ce",
            "per_position_loss_weight": "dpace" if config.dflash_loss_objective == "dpace" else "fixed-exp-decay",
            "dpace_alpha": config.dflash_dpace_alpha, "gamma": config.dflash_loss_decay_factor,
            "max_anchors": config.dflash_num_anchors, "sample_from_anchor": False,
            "block_size": config.dflash_block_size}


def _objective(block_size: int, **settings) -> SimpleNamespace:
    """The attributes `HFDFlashModel`'s mask, anchor and loss methods read, for calling them unbound."""
    return SimpleNamespace(dflash_block_size=block_size, _num_anchors=settings.pop("num_anchors", 512),
                           dflash_draft_attention=settings.pop("draft_attention", "bidirectional"),
                           dflash_swa_window_size=settings.pop("window", None),
                           dflash_loss_objective=settings.pop("objective", "decay"),
                           dflash_loss_decay_factor=settings.pop("gamma", 0.0),
                           dflash_dpace_alpha=settings.pop("dpace_alpha", 0.5), **settings)


def _padded(anchors: torch.Tensor, keep: torch.Tensor, max_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """It draws only min(num_anchors, eligible - 1) blocks; the interface has max_anchors slots, the rest invalid."""
    anchors, keep = anchors.reshape(-1)[:max_anchors], keep.reshape(-1)[:max_anchors]
    pad = max_anchors - anchors.numel()
    return torch.nn.functional.pad(anchors, (0, pad)), torch.nn.functional.pad(keep, (0, pad), value=False)


def _convert(base: nn.Module, spec: DraftSpec, num_anchors: int = 512) -> nn.Module:
    if spec.family not in ("dflash", "dspark"):
        raise Unsupported(f"modelopt: Model-Optimizer 0.47.0 has no {spec.family} drafter (its projector types are "
                          "dflash, domino and dspark: dflash/conversion.py:51)")
    if spec.family == "dflash" and spec.sample_from_anchor:
        raise Unsupported("modelopt: Model-Optimizer's DFlash has no sample-from-anchor layout (slot 0 is the anchor)")
    if spec.draft_vocab_size is not None:
        raise Unsupported("modelopt: Model-Optimizer's DFlash drafter has no reduced draft vocabulary (its head is "
                          "the target's lm_head)")
    if spec.partial_rotary_factor != 1.0 or spec.rope_style != "neox" or spec.rope_scaling is not None:
        raise Unsupported("modelopt: Model-Optimizer's drafter builds transformers' Qwen3RotaryEmbedding from "
                          "rope_theta alone (rope_scaling is added only at export)")
    if spec.sliding_window_non_causal and "sliding_attention" in spec.layer_types:
        raise Unsupported("modelopt: Model-Optimizer has no sliding_window_non_causal setting")
    if len(spec.target_layer_ids) != spec.num_hidden_layers:
        raise Unsupported("modelopt: Model-Optimizer requires one target layer per draft layer (hf_dflash.py:457: "
                          f"{len(spec.target_layer_ids)} target layers, {spec.num_hidden_layers} draft layers)")
    architecture = {name: getattr(spec, name) for name in ARCHITECTURE_FIELDS}
    architecture["target_layer_ids"] = list(spec.target_layer_ids)
    if spec.layer_types:
        architecture.update(layer_types=list(spec.layer_types), sliding_window=spec.sliding_window)
    if spec.family == "dspark":  # routed to HFDSparkModel / DSparkModule (dflash/conversion.py:54)
        architecture.update(projector_type="dspark", markov_rank=spec.markov_rank,
                            markov_head_type=spec.markov_head_type, use_confidence_head=_confidence_head(spec))
    config = {"dflash_block_size": spec.block_size, "dflash_mask_token_id": spec.mask_token_id,
              "dflash_num_anchors": num_anchors, "dflash_use_torch_compile": False,
              "dflash_self_logit_distillation": recipe_config().dflash_self_logit_distillation,
              "dflash_architecture_config": architecture}
    model = mtsp.convert(base, [("dflash", config)])
    model.dflash_config._attn_implementation = "eager"
    return model


def _confidence_head(spec: DraftSpec) -> bool:
    """Its confidence head always reads [hidden ; Markov embedding] (modeling_dspark.py:122): a head reading the
    hidden state alone (confidence_head_with_markov false) is not one it can hold, so its drafter is built without
    it (the Markov head is still held) and `confidence_logits` answers n/a."""
    return spec.enable_confidence_head and spec.confidence_head_with_markov


def dspark_names(spec: DraftSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' DSpark tensor names for its `DSparkModule`: the Markov head's nested `markov_head.` keys its own
    load hook flattens (modeling_draft_checkpoint_compat.py:38); the confidence head's `confidence_head.proj` is
    its `confidence_proj` (modeling_dspark.py:122), left out where it builds none."""
    renamed = {}
    for name, tensor in state.items():
        if name.startswith("confidence_head."):
            if not _confidence_head(spec):
                continue
            name = name.replace("confidence_head.proj.", "confidence_proj.", 1)
        renamed[name] = tensor
    return renamed


def stand_in_target(spec: DraftSpec) -> nn.Module:
    """Its drafter is built on a target (`mtsp.convert`); a drafter asked for alone gets a random one of the
    spec's shape (the target's own settings, rope included, then play no part)."""
    return random_qwen3(spec.num_target_layers, spec.hidden_size, spec.target_vocab_size, 0,
                        head_dim=spec.head_dim, heads=spec.num_attention_heads, kv_heads=spec.num_key_value_heads)


def _with_gradient(loss_of, logits: torch.Tensor) -> dict:
    """`{"loss", "grad"}`: the loss and its gradient w.r.t. the logits, by its own autograd (the plug hands the
    gradient back through the process boundary)."""
    leaf = logits.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss = loss_of(leaf)
        grad = (torch.autograd.grad(loss, leaf, allow_unused=True)[0] if loss.requires_grad else None)
    return {"loss": loss.detach(), "grad": torch.zeros_like(leaf) if grad is None else grad}


class ModelOptOperations:
    def default_target_layer_ids(self, num_target_layers, num_draft_layers):
        return list(modeling_dflash.build_target_layer_ids(num_target_layers, num_draft_layers))

    def select_anchors(self, loss_mask, max_anchors, block_size, seed):
        torch.manual_seed(seed)
        anchors, keep = HFDFlashModel._sample_anchor_positions(
            _objective(block_size, num_anchors=max_anchors), loss_mask.shape[1], loss_mask, loss_mask.device)
        return _padded(anchors, keep, max_anchors)

    def training_mask(self, document_ids, anchors, block_size, sliding_window, causal_block):
        # No document ids: it packs nothing; every block is kept (`block_keep_mask` all True).
        anchors = anchors.reshape(1, -1)
        mask = HFDFlashModel._build_draft_attention_mask(
            _objective(block_size, draft_attention="causal" if causal_block else "bidirectional"),
            document_ids.shape[-1], anchors, torch.ones_like(anchors, dtype=torch.bool), anchors.shape[1],
            torch.float32, anchors.device, window=sliding_window)
        return mask[0, 0] == 0  # its additive mask: 0 where a key is seen

    def inference_mask(self, context_len, block_len, sliding_window, causal):
        mask = HFDFlashModel._build_generate_swa_mask(
            _objective(block_len, window=sliding_window, draft_attention="causal" if causal else "bidirectional"),
            context_len, 1, torch.float32, torch.device("cpu"))
        if mask is None:  # "nothing to mask": every key seen
            return torch.ones(block_len, context_len + block_len, dtype=torch.bool)
        return mask[0, 0] == 0

    def build_drafter(self, spec, state_dict, target=None):
        model = _convert(copy.deepcopy(target) if target is not None else stand_in_target(spec), spec)
        model.dflash_module.load_state_dict(dspark_names(spec, strip_wrapper_prefixes(state_dict)), strict=True)
        model.spec = spec
        return model.float().eval()

    def project_context(self, drafter, context_features):
        return drafter.dflash_module.hidden_norm(drafter.dflash_module.fc(context_features))

    def apply_rotary(self, drafter, x, position_ids):
        module = drafter.dflash_module
        module._maybe_init_rotary_emb(device=x.device)
        cos, sin = module.rotary_emb(x, position_ids)
        return modeling_dflash.apply_rotary_pos_emb(x, x, cos, sin)[1]  # as to its keys

    @torch.no_grad()
    def draft_forward(self, drafter, noise_embedding, target_hidden, position_ids):
        # As `pseudo_speculative_generate` runs it: its generation-time mask (None without a window or causal block).
        mask = drafter._build_generate_swa_mask(target_hidden.shape[1], 1, target_hidden.dtype, target_hidden.device)
        return drafter.dflash_module(noise_embedding=noise_embedding, target_hidden=target_hidden,
                                     position_ids=position_ids, attention_mask=mask)

    def training_outputs(self, drafter, target, input_ids, loss_mask, document_ids, max_anchors, seed, anchors=None):
        """Its training `forward` on the packed row; the inputs of `_compute_loss` captured."""
        drafter._num_anchors = max_anchors
        captured = {}
        draw, compute = drafter._sample_anchor_positions, drafter._compute_loss

        def sample(seq_len, mask, device):
            captured["anchors"] = ((anchors[0].reshape(1, -1), anchors[1].reshape(1, -1).bool())
                                   if anchors is not None else draw(seq_len, mask, device))
            return captured["anchors"]

        def loss(logits, ids, anchor_positions, keep, mask, base_logits=None):
            captured.update(logits=logits, base_logits=base_logits, loss_mask=mask)
            return compute(logits, ids, anchor_positions, keep, mask, base_logits)

        def keep_hidden(module, inputs, output):
            captured["hidden"] = output

        # Its forward refuses a row whose length is not a multiple of the block (hf_dflash.py:930); its trainer's
        # collator pads every sample to `training_seq_len` (a multiple of it), padding masked out. So here.
        pad = -input_ids.shape[1] % drafter.dflash_block_size
        attention = torch.nn.functional.pad(torch.ones_like(input_ids), (0, pad))
        padded_ids = torch.nn.functional.pad(input_ids, (0, pad), value=drafter.mask_token_id)
        padded_mask = torch.nn.functional.pad(loss_mask.float(), (0, pad))
        torch.manual_seed(seed)
        hook = drafter.dflash_module.register_forward_hook(keep_hidden)
        drafter.train()
        try:
            with torch.no_grad(), mock.patch.object(drafter, "_sample_anchor_positions", sample), \
                    mock.patch.object(drafter, "_compute_loss", loss):
                drafter(input_ids=padded_ids, attention_mask=attention, loss_mask=padded_mask)
        finally:
            hook.remove()
            drafter.eval()
        return self._outputs(drafter, captured, padded_ids.shape[1], max_anchors)

    def _outputs(self, drafter, captured, seq_len, max_anchors) -> TrainingOutputs:
        """The interface's fields from what `_compute_loss` received, gathered as it gathers them (hf_dflash.py:797)."""
        anchors, keep = captured["anchors"]
        block = drafter.dflash_block_size
        label = anchors.unsqueeze(-1) + torch.arange(block).view(1, 1, -1)  # slot k of a block predicts anchor + k
        in_bounds = label < seq_len
        safe = label.clamp(max=seq_len - 1)
        weight = (keep.unsqueeze(-1) & in_bounds).float() * (torch.arange(block) > 0).float()
        weight = weight * captured["loss_mask"][0][safe]
        teacher = captured["base_logits"][0][(safe - 1).clamp(min=0)]  # its KD teacher for slot k: anchor + k - 1
        slots = max_anchors * block
        pad = slots - weight.numel()
        flat = lambda t: t.reshape(1, -1, *t.shape[3:])  # noqa: E731 - [1, A, B, ...] -> [1, A*B, ...]
        padded_anchors, padded_keep = _padded(anchors, keep, max_anchors)
        return TrainingOutputs(
            anchors=padded_anchors, anchor_valid=padded_keep,
            logits=torch.nn.functional.pad(captured["logits"], (0, 0, 0, pad)),
            targets=torch.nn.functional.pad(flat(teacher), (0, 0, 0, pad)),
            loss_mask=torch.nn.functional.pad(flat(weight), (0, pad)),
            hidden=torch.nn.functional.pad(captured["hidden"], (0, 0, 0, pad)))

    def loss_weights(self, block_size, gamma, sample_from_anchor):
        raise Unsupported("Model-Optimizer weights the slots inside `_compute_loss` (hf_dflash.py:861, no per-slot "
                          "weights to read alone); its weighted reduction is held by the loss component")

    def _reduced(self, logits, targets, loss_mask, block_size, *, gamma=0.0, loss_fn="ce", objective="decay",
                 dpace_alpha=DEFAULTS["dpace_alpha"]):  # alpha only matters to the dpace objective
        """`_compute_loss` on the interface's [1, A*B] slots: block a's anchor at a*B in a row of A*B tokens whose
        ids are the targets' argmax (CE) and whose logits shifted one place are the teacher (KD)."""
        slots = logits.shape[1]
        anchors = (torch.arange(slots // block_size) * block_size).view(1, -1)
        input_ids = targets.argmax(-1)
        base_logits = torch.cat([targets[:, 1:], targets[:, -1:]], dim=1) if loss_fn == "kl_div" else None
        model = _objective(block_size, objective=objective, gamma=gamma if gamma is not None else 0.0,
                           dpace_alpha=dpace_alpha)
        loss, _ = HFDFlashModel._compute_loss(model, logits, input_ids, anchors, torch.ones_like(anchors).bool(),
                                              loss_mask.float(), base_logits)
        return loss

    def loss(self, logits, targets, loss_mask, block_size, gamma, loss_fn, sample_from_anchor):
        if sample_from_anchor:
            raise Unsupported("Model-Optimizer's DFlash objective has no sample-from-anchor layout")
        return _with_gradient(lambda leaf: self._reduced(leaf, targets, loss_mask, block_size, gamma=gamma,
                                                         loss_fn=loss_fn), logits)

    def dpace_weights(self, per_slot_loss, loss_mask, block_size, dpace_alpha):
        """Its `_dpace_position_weights` on slots 1..B-1 of each block; slot 0 (the anchor) weighs 1 (hf_dflash.py:856)."""
        loss = per_slot_loss.reshape(1, -1, block_size)
        mask = loss_mask.reshape(1, -1, block_size).float()  # its weight mask is float32
        weights = torch.ones_like(mask)
        weights[..., 1:] = hf_dflash._dpace_position_weights(torch.exp(-loss[..., 1:].float()), dpace_alpha,
                                                              valid_mask=mask[..., 1:])
        return (weights * mask).reshape(loss_mask.shape)

    def dpace_loss(self, logits, targets, loss_mask, block_size, dpace_alpha):
        return _with_gradient(lambda leaf: self._reduced(leaf, targets, loss_mask, block_size, loss_fn="ce",
                                                         objective="dpace", dpace_alpha=dpace_alpha), logits)

    # -- DSpark: HFDSparkModel (hf_dspark.py) and its DSparkModule (modeling_dspark.py) ----------------------
    def _teacher_forced_heads(self, drafter, prev_ids, hidden):
        """Its `_apply_markov_head` (hf_dspark.py:144) on N teacher-forced blocks: a row of the blocks' previous
        tokens with an anchor at each block start, so its gather at anchor + k (hf_dspark.py:159) reads slot k's
        previous token; base logits zero, so the final logits it returns are the bias alone."""
        blocks, block = prev_ids.shape
        if block != drafter.dflash_block_size:
            raise ValueError(f"blocks of {block} slots for a drafter of block size {drafter.dflash_block_size}")
        anchors = (torch.arange(blocks) * block).view(1, -1)
        zeros = hidden.new_zeros(1, blocks, block, drafter.dflash_config.vocab_size)
        final, confidence = drafter._apply_markov_head(hidden.reshape(1, blocks * block, -1), zeros,
                                                       prev_ids.reshape(1, -1), anchors, blocks)
        return final[0], None if confidence is None else confidence[0]

    def markov_bias(self, drafter, prev_ids, hidden):
        return self._teacher_forced_heads(drafter, prev_ids, hidden)[0]

    def confidence_logits(self, drafter, prev_ids, hidden):
        if not _confidence_head(drafter.spec):
            raise Unsupported("modelopt: Model-Optimizer's confidence head always reads [hidden ; Markov embedding] "
                              "(confidence_proj over hidden_size + rank, modeling_dspark.py:122, :226); it has no "
                              "confidence_head_with_markov false")
        return self._teacher_forced_heads(drafter, prev_ids, hidden)[1]

    def markov_path(self, drafter, hidden, base_logits, anchor):
        """Its own AR-validation loop, `pseudo_speculative_generate` (hf_dspark.py:420), on one block: the target's
        forward answers with a next token of `anchor` and the backbone with the case's hidden states and base
        logits, so what runs of it is the block input and its left-to-right Markov loop (hf_dspark.py:473-482)."""
        if not drafter.spec.sample_from_anchor:
            raise Unsupported("modelopt: Model-Optimizer's DSpark has no anchor-as-bonus layout: the anchor is block "
                              "position 0 and predicts the first draft token (shift_label, modeling_dspark.py:95)")
        block = hidden.shape[1]
        context = SimpleNamespace(last_hidden_state=torch.zeros(1, 1, 1),
                                  hidden_states=[torch.zeros(1, 1, 1)] * (max(drafter.target_layer_ids) + 2))
        anchor_logits = torch.zeros(1, 1, base_logits.shape[-1])
        anchor_logits[..., anchor] = 1.0

        def lm_head(states):  # the target's next token after the context, then the backbone's block logits
            return base_logits if states is hidden else anchor_logits

        module, owner = drafter.dflash_module, type(drafter)
        with mock.patch.object(owner, "_base_model", property(lambda self: lambda **kwargs: context)), \
                mock.patch.object(owner, "_base_model_lm_head", property(lambda self: lm_head)), \
                mock.patch.object(module, "forward", lambda **kwargs: hidden):
            anchor_token, tokens = drafter.pseudo_speculative_generate(torch.tensor([[anchor]]), steps=block)
        if int(anchor_token) != anchor:
            raise RuntimeError(f"the stand-in target answered {int(anchor_token)}, not the anchor {anchor}")
        return tokens[0]

    def block_metrics(self, logits, targets, loss_mask, block_size):
        raise Unsupported("Model-Optimizer's DFlash objective reports one overall accuracy (train_acc), no "
                          "per-position accuracy or EAL")
