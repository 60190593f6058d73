"""Localize a parting round by value: what the source fed the drafter (`DrafterFeed`), and what the drafter computed.

Inputs, held to training: each declared target layer's captured hidden state against the target's own
`hidden_states[id + 1]` (transformers, as z-lab and our trainer read it) on the same tokens; the block's tokens
and positions against `[last token, mask x (B - 1)]` at `start..start + B - 1`. A captured layer that is another
tensor is named by the one it equals: the layer below or above, or the last layer before the final norm.
Modules: the trained drafter replayed here on the engine's own captured inputs; the first module whose output
is not the engine's is named, with its size. A difference neither explains is reported as such.

"Equal" means a relative difference within float32 kernel noise (`SAME`); every size is reported as measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from catalogue.findings import Finding
from dflash_audit.rounds.source import DrafterFeed, Localized, PromptRounds
# "Equal", a relative difference, and the target's replay: the by-value core's.
from dflash_audit.target_values import SAME, TargetReplay, relative
from impl.extract import output_head
from impl.layers import final_layer, hidden_state_index
from impl.masks import inference_mask
from impl.model import rms_norm
from impl.near_tie import KERNEL_MARGIN, near_tie, ulps_apart

localized = Finding.localization  # each finding below: (kind, what, message, size, source file:line, prompt, round)
# What a source cites, per kind of input or module: where it makes it (its file:line), from `cite(kind)`.
CITED = ("captured_layer", "aux_layer_ids", "mask_token", "block_length", "positions", "fc", "layers", "causal",
         "context_keys", "context_k_norm", "norm", "drafts")


def input_findings(inputs: DrafterFeed, states: TargetReplay, spec, tokens: list[int], cite, prompt: str,
                   round_no: int) -> list[Finding]:
    findings = []
    hidden = spec.hidden_size
    positions = torch.tensor(inputs.context_positions)
    for j, layer_id in enumerate(spec.target_layer_ids):
        engine = inputs.features[:, j * hidden:(j + 1) * hidden]
        trained = states.hidden[hidden_state_index(layer_id)][positions]
        size = relative(engine, trained)
        if size <= SAME:
            continue
        named = [name for name, tensor in states.candidates(layer_id).items() if relative(engine, tensor[positions])
                 <= SAME]
        what = named[0] if named else "no tensor of the target's forward"
        findings.append(localized("input", f"target_layer:{layer_id}",
                                  f"target layer {layer_id}: the engine feeds the drafter {what}; trained on "
                                  f"hidden_states[{hidden_state_index(layer_id)}] (the output of layer {layer_id}"
                                  f"{', after the final norm' if layer_id == final_layer(states.layers) else ''}); "
                                  f"relative "
                                  f"difference {size:.3g}", size,
                                  cite("captured_layer" if named else "aux_layer_ids"), prompt, round_no))
    block = inputs.block_tokens
    if len(block) != spec.block_size:
        findings.append(localized("input", "block_length",
                                  f"the engine drafts a block of {len(block)} tokens ({len(block) - 1} drafts); "
                                  f"trained with block size {spec.block_size} ({spec.block_size - 1} drafts)",
                                  float(len(block) - spec.block_size), cite("block_length"), prompt, round_no))
    wrong = sorted({t for t in block[1:] if t != spec.mask_token_id})
    if wrong:
        findings.append(localized("input", "block_tokens",
                                  f"the block's masked slots hold token {wrong[0]}; trained with mask token id "
                                  f"{spec.mask_token_id}", None, cite("mask_token"), prompt, round_no))
    if block and block[0] != tokens[inputs.start]:
        findings.append(localized("input", "block_tokens", f"the block starts with token {block[0]}, not the last "
                                  f"known token {tokens[inputs.start]}", None, cite("positions"), prompt, round_no))
    expected = list(range(inputs.start, inputs.start + len(block)))
    if inputs.block_positions != expected or inputs.context_positions != list(range(inputs.start)):
        findings.append(localized("input", "positions", f"the block sits at positions {inputs.block_positions[:3]}...,"
                                  f" expected {expected[:3]}... after {inputs.start} context positions", None,
                                  cite("positions"), prompt, round_no))
    return findings


def replay(drafter, target, inputs: DrafterFeed, causal: bool | None = None) -> dict[str, torch.Tensor]:
    """The trained drafter's module outputs on the engine's own inputs (context features, block, positions);
    `causal` forces every layer's attention within the block causal (True) or bidirectional (False)."""
    outputs, handles = {}, []

    def keep(name):
        def hook(module, args, out):
            outputs[name] = out[0]  # returns None: a forward hook's return value would replace the output
        return hook

    handles.append(drafter.fc.register_forward_hook(keep("fc")))
    for i, layer in enumerate(drafter.layers):
        handles.append(layer.register_forward_hook(keep(f"layers.{i}")))
    block = torch.tensor([inputs.block_tokens])
    positions = torch.tensor([inputs.context_positions + inputs.block_positions])
    masks = None
    if causal is not None:
        masks = [inference_mask(len(inputs.context_positions), len(inputs.block_tokens), drafter.spec.window_of(i),
                                causal) for i in range(len(drafter.layers))]
    try:
        with torch.inference_mode():
            # The captured features in the drafter's dtype, as the engine's drafter read them.
            features = inputs.features[None].to(block.device, next(drafter.parameters()).dtype)
            hidden = drafter(drafter.embed(target, block), features, positions, masks)
            outputs["norm"] = hidden[0]
            logits = drafter.compute_logits(hidden[0, drafter.spec.first_proposing_slot:], output_head(target))
    finally:
        for handle in handles:
            handle.remove()
    outputs["logits"] = logits
    # The engine's fc ran on this step's context rows only.
    rows = [inputs.context_positions.index(p) for p in inputs.step_positions if p in inputs.context_positions]
    outputs["fc"] = outputs["fc"][rows]
    return outputs


def context_key_finding(drafter, inputs: DrafterFeed, i: int, cite, prompt: str, round_no: int) -> Finding | None:
    """Draft layer i's context keys (the engine projects and norms them for all layers at once, apart from the
    layer's forward): before their k_norm, then after; keys normed with another layer's weight are named."""
    engine_in, engine_out = inputs.modules.get("context_k_in"), inputs.modules.get("context_k")
    context = inputs.modules.get("context")
    if engine_in is None or engine_out is None or context is None:
        return None
    attn = drafter.layers[i].self_attn
    with torch.inference_mode():
        normed = rms_norm(drafter.hidden_norm, context)
        keys = attn.k_proj(normed).view(normed.shape[0], attn.kv_heads, attn.head_dim)
        size = relative(engine_in[i], keys)
        if size > SAME:
            return localized("module", f"layers.{i}.self_attn.k_proj", f"same inputs, different output: the engine's "
                             f"context keys of draft layer {i} (before k_norm) differ from the trained drafter's k_proj "
                             f"by {size:.3g} (relative)", size, cite("context_keys"), prompt, round_no)
        size = relative(engine_out[i], rms_norm(attn.k_norm, keys))
        if size <= SAME:
            return None
        other = [j for j, o in enumerate(drafter.layers) if j != i
                 and relative(engine_out[i], rms_norm(o.self_attn.k_norm, keys)) <= SAME]
    why = f"normed with draft layer {other[0]}'s k_norm weight, not its own" if other else "not the trained ones"
    return localized("module", f"layers.{i}.self_attn.k_norm", f"same inputs, different output: the engine's context "
                     f"keys of draft layer {i} are {why} (relative difference {size:.3g})", size,
                     cite("context_k_norm"), prompt, round_no)


def causality_finding(drafter, target, inputs: DrafterFeed, i: int, engine: torch.Tensor, size: float, cite,
                      prompt: str, round_no: int) -> Finding | None:
    """Draft layer i's output equals the trained drafter's run with the other block causality: named."""
    flipped = not drafter.spec.block_is_causal(i)
    other = replay(drafter, target, inputs, causal=flipped)
    if relative(engine, other[f"layers.{i}"].float()) > SAME:
        return None
    trained, served = ("bidirectional", "causally") if flipped else ("causal", "bidirectionally")
    return localized("module", f"layers.{i}.self_attn", f"same inputs, different output: the engine's draft layer {i} "
                     f"attends {served} within the block; trained {trained} (relative difference as served "
                     f"{size:.3g}; run {served}, the trained drafter gives the engine's output)", size, cite("causal"),
                     prompt, round_no)


def trained_features(states: TargetReplay, spec, inputs: DrafterFeed) -> torch.Tensor:
    """The context features as trained (each declared layer's hidden_states[id + 1]) at the source's context rows."""
    positions = torch.tensor(inputs.context_positions)
    return torch.cat([states.hidden[hidden_state_index(i)][positions] for i in spec.target_layer_ids], dim=-1)


def rounding_moved(drafter, target, inputs: DrafterFeed, states: TargetReplay, slot: int,
                   logits: torch.Tensor) -> tuple[float, float]:
    """(twice the most the source's features, against the trained ones, move the drafter's scores at draft `slot`;
    how many ulps of the drafter's dtype they are apart): what the one near-tie rule reads below float32."""
    spec = drafter.spec
    trained = trained_features(states, spec, inputs)
    as_trained = replay(drafter, target, replace(inputs, features=trained.to(inputs.features.dtype), modules={}))
    moved = 2 * float((logits[slot] - as_trained["logits"].float()[slot]).abs().max())
    width = spec.hidden_size
    dtype = next(drafter.parameters()).dtype
    # One layer's width at a time: each layer's features have their own scale, so their own ulp.
    ulps = max(ulps_apart(ours, theirs, dtype)
               for ours, theirs in zip(inputs.features.split(width, dim=-1), trained.split(width, dim=-1)))
    return moved, ulps


def module_findings(drafter, target, inputs: DrafterFeed, cite, prompt: str, round_no: int,
                    states: TargetReplay | None = None) -> list[Finding]:
    """In data-flow order (fc; each layer's context keys, then its output; the final norm): every difference
    whose cause is named, until one that is not (reported, then stop: what follows it is downstream). Drafts that
    part at the end are judged by the one near-tie rule (`impl/near_tie.py`); below float32 it measures what the
    source's features move the scores against the trained ones (`states`, the target's own forward)."""
    ours = replay(drafter, target, inputs)
    found: list[Finding] = []
    engine_fc = inputs.modules.get("fc")
    if engine_fc is not None:
        size = relative(engine_fc[: ours["fc"].shape[0]], ours["fc"].float())
        if size > SAME:
            return [localized("module", "fc", f"same inputs, different output: the engine's fc differs from the "
                              f"trained drafter's by {size:.3g} (relative)", size, cite("fc"), prompt, round_no)]
    for i in range(len(drafter.layers)):
        keys = context_key_finding(drafter, inputs, i, cite, prompt, round_no)
        if keys is not None:
            found.append(keys)
            if keys.key.endswith("k_proj"):
                return found
        name = f"layers.{i}"
        engine, mine = inputs.modules.get(name), ours[name].float()
        if engine is None or engine.shape != mine.shape:
            continue  # a block of another length: its input finding says so
        size = relative(engine, mine)
        if size <= SAME or found:  # a named cause upstream explains it
            continue
        named = causality_finding(drafter, target, inputs, i, engine, size, cite, prompt, round_no)
        if named is not None:
            found.append(named)
            continue
        return [localized("module", name, f"same inputs, different output: the engine's {name} differs from the "
                                        f"trained drafter's by {size:.3g} (relative)", size, cite("layers"), prompt,
                        round_no)]
    engine = inputs.modules.get("norm")
    if not found and engine is not None and engine.shape == ours["norm"].shape:
        size = relative(engine, ours["norm"].float())
        if size > SAME:
            return [localized("module", "norm", f"same inputs, different output: the engine's final norm differs from "
                                              f"the trained drafter's by {size:.3g} (relative)", size, cite("norm"),
                            prompt, round_no)]
    if found:
        return found
    drafts = ours["logits"].argmax(-1).tolist()
    engine_drafts = inputs.drafts
    if drafts != engine_drafts[: len(drafts)]:
        logits = ours["logits"].float()
        top2 = logits.topk(2, dim=-1)
        gaps = top2.values[:, 0] - top2.values[:, 1]
        slot = next((j for j, (a, b) in enumerate(zip(drafts, engine_drafts)) if a != b), None)
        dtype = next(drafter.parameters()).dtype
        moved = ulps = None
        if slot is not None and dtype != torch.float32 and states is not None:
            moved, ulps = rounding_moved(drafter, target, inputs, states, slot, logits)
        if slot is not None and engine_drafts[slot] == int(top2.indices[slot, 1]) \
                and near_tie(float(gaps[slot]), dtype, moved, ulps):
            # The near-tie rule, by value: the source's argmax took the runner-up of a near-tie.
            within = (f"within {KERNEL_MARGIN:g}" if dtype == torch.float32 else
                      f"within {moved:.3g}, what the source's features, {ulps:.3g} ulps of {str(dtype)[6:]} from the "
                      f"trained ones, move them")
            return [localized("tie", "argmax_tie", f"same inputs and module outputs (within {SAME:g}); at draft slot "
                              f"{slot + 1} the drafter's top two logits are {float(gaps[slot]):.3g} apart ({within}) "
                              f"and the source drafted the runner-up: an argmax near-tie broken the other way",
                              float(gaps[slot]), cite("drafts"), prompt, round_no)]
        margin = float(gaps.min())
        return [localized("unlocalized", "drafts", f"same inputs and module outputs (within {SAME:g}), different "
                                                  f"drafts {engine_drafts} vs {drafts}; smallest top-2 logit margin "
                                                  f"{margin:.3g}", margin, cite("drafts"), prompt, round_no)]
    return []


class FedLocalizer:
    """A source's parting round localized by value, on what the source fed its drafter there (`PromptRounds.feed`):
    its inputs held to training (`input_findings`), then the drafter as the audit has it replayed on those very
    inputs, module by module, against what the source captured (`module_findings`). `cite(kind)`: where, in the
    source, each kind (`CITED`) is made. A round the source fed as trained, computed as trained, and still parted is
    `unlocalized`, never guessed. (An evaluator, whose recording holds neither every context row nor its modules'
    outputs, is localized under the same contract by its own checks: trace/evaluation/why.py's
    `EvaluatorLocalizer`.)"""

    def __init__(self, drafter, target, cite: Callable[[str], str]):
        self.drafter, self.target, self.cite = drafter, target, cite
        self._replayed: tuple[tuple[int, ...], TargetReplay] | None = None  # one replay a prompt, not one a round

    def states(self, tokens: list[int]) -> TargetReplay:
        if self._replayed is None or self._replayed[0] != tuple(tokens):
            self._replayed = None  # the last prompt's states go first
            self._replayed = (tuple(tokens), TargetReplay(self.target, tokens))
        return self._replayed[1]

    def __call__(self, index: int, prompt: PromptRounds, audited, round_no: int) -> Localized:
        spec = self.drafter.spec
        feed = prompt.feed(round_no) if prompt.feed is not None else None
        if feed is None:
            return Localized([localized("unlocalized", "capture", "what the drafter was fed at this round was not "
                                        "captured", None, "", prompt.id, round_no)], {"explained_by": ["capture"]})
        tokens = list(prompt.prompt_ids) + list(prompt.output or [])
        states = self.states(tokens)
        found = input_findings(feed, states, spec, tokens, self.cite, prompt.id, round_no)
        if len(feed.block_tokens) == spec.block_size:  # replayed on the source's own inputs, whatever they are
            found += module_findings(self.drafter, self.target, feed, self.cite, prompt.id, round_no, states)
        if not found:
            found = [localized("unlocalized", "round", "the drafter was fed the trained inputs and its modules "
                               "computed what the trained drafter computes on them, yet the round differs from the "
                               "audit's (the target's verification, or the audit's own earlier rounds)", None, "",
                               prompt.id, round_no)]
        return Localized(found, {"explained_by": [f.key for f in found]})
