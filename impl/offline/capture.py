"""The target's greedy continuation of several prompts at once, with the hidden states the cache
keeps captured while it is generated: one prefill, then one KV-cached forward per new token.

Prompts of a batch are left-padded, with an attention mask and position ids that count only
real tokens, so each prompt sees exactly what it would see alone. The token fed at step s has
its states captured at step s, so the last token needs one more (one-token) forward; no
position is ever computed twice. `forced` continuations replay known tokens instead of
choosing them: how a cache gains layers it did not keep, through the very same forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from foundation.transformers_compat import cache_argument
from foundation.placement import target_device
from impl.decoding import make_target_cache
from impl.extract import decoder_layers, output_head
from impl.layers import final_layer

DEFAULT_BATCH = 8  # prompts per target forward
HEAD_ROWS = 256  # prompt positions per LM-head chunk when measuring the margin


@dataclass
class Captured:
    token_ids: torch.Tensor  # [T] prompt + continuation, on the CPU
    prompt_len: int
    layers: dict[int, torch.Tensor]  # layer id -> [T, H] in the target's dtype, on the CPU
    margin: torch.Tensor | None  # [T] float32 top-1 minus top-2 target logit (None when forced)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    top2 = logits.float().topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


class LayerTaps:
    """The outputs of the chosen decoder layers during each forward, as `output_hidden_states`
    gives them (`context_features` reads those): a layer's raw output, except the last layer,
    whose entry there is after the final norm (transformers 5) — the body's `last_hidden_state`."""

    def __init__(self, target: nn.Module, layer_ids: list[int]):
        layers = decoder_layers(target)
        self.last = final_layer(len(layers))
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_hook(self._keep(i)) for i in self.layer_ids if i != self.last]

    def _keep(self, layer_id: int):
        def hook(_module, _inputs, output):
            self.outputs[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    def take(self, normed: torch.Tensor) -> dict[int, torch.Tensor]:
        taken = {i: (normed if i == self.last else self.outputs[i]) for i in self.layer_ids}
        self.outputs = {}
        return taken

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _stopped(tokens: list[int], prompt_len: int, max_new_tokens: int, stops: set[int]) -> bool:
    new = len(tokens) - prompt_len
    return new >= max_new_tokens or (new > 0 and tokens[-1] in stops)


@torch.inference_mode()
def capture_batch(target: nn.Module, prompts: list[torch.Tensor], layer_ids: list[int], max_new_tokens: int,
                  stop_token_ids: list[int], forced: list[torch.Tensor] | None = None) -> list[Captured]:
    """Greedy continuations of `prompts` ([T_b] token ids each), decoded together, with the states of
    `layer_ids` at every position and the target's top-2 margin there.

    With `forced` ([T_b] full token ids each, prompt included), those tokens are fed instead of
    the target's choices and no margin is measured.
    """
    device = target_device(target)
    body, head = target.get_decoder(), output_head(target)
    stops = set(stop_token_ids)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    padded = any(n != width for n in lengths)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):  # left padding: every prompt's last token in the last column
        input_ids[b, width - len(p):], mask[b, width - len(p):] = p.to(device), 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens = [p.tolist() for p in prompts]
    ends = [len(f) for f in forced] if forced is not None else [None] * len(prompts)
    steps: list[dict[int, torch.Tensor]] = []
    margins: list[torch.Tensor] = []
    cache = make_target_cache(target)
    taps = LayerTaps(target, layer_ids)
    try:
        step_ids = input_ids
        while True:
            out = body(input_ids=step_ids, attention_mask=mask if padded else None,
                       position_ids=positions if padded else None, **cache_argument(body, cache), use_cache=True)
            normed = out.last_hidden_state
            steps.append({i: s.to("cpu") for i, s in taps.take(normed).items()})
            logits = head(normed[:, -1:])[:, -1]  # as the causal LM's logits_to_keep=1
            if forced is None:
                if step_ids.shape[1] > 1:  # the prompt's own positions, a chunk of rows at a time
                    margins.append(torch.cat([top2_margin(head(normed[:, i:i + HEAD_ROWS])).cpu()
                                              for i in range(0, normed.shape[1], HEAD_ROWS)], dim=1))
                else:
                    margins.append(top2_margin(logits)[:, None].cpu())
            fed = len(steps) - 1  # new tokens fed so far (the prefill feeds none)
            done = [(ends[b] is not None and len(tokens[b]) >= ends[b]) or
                    (ends[b] is None and _stopped(tokens[b], lengths[b], max_new_tokens, stops))
                    for b in range(len(prompts))]
            if all(done) and all(len(tokens[b]) - lengths[b] <= fed for b in range(len(prompts))):
                break  # every prompt's last token has been fed: its states are captured
            choice = logits.argmax(-1).tolist()
            for b in range(len(prompts)):
                if not done[b]:
                    tokens[b].append(int(forced[b][len(tokens[b])]) if forced is not None else choice[b])
            # A finished prompt is fed its own last token again; what comes of it is never read.
            step_ids = torch.tensor([[t[min(lengths[b] + fed, len(t) - 1)]] for b, t in enumerate(tokens)],
                                    device=device)
            if padded:
                mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
                positions = positions[:, -1:] + 1
    finally:
        taps.remove()
    return [_per_prompt(steps, margins, tokens[b], lengths[b], width, b) for b in range(len(prompts))]


def _per_prompt(steps, margins, tokens: list[int], prompt_len: int, width: int, b: int) -> Captured:
    total = len(tokens)

    def gather(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([parts[0][b, width - prompt_len:], *(part[b] for part in parts[1:])])[:total]

    layers = {i: gather([step[i] for step in steps]).contiguous() for i in steps[0]}
    # The cache lives on the host, beside the states (moved there as they were captured).
    return Captured(torch.tensor(tokens, device="cpu"), prompt_len, layers, gather(margins) if margins else None)


def capture(target: nn.Module, prompts: list[torch.Tensor], layer_ids: list[int], max_new_tokens: int,
            stop_token_ids: list[int], forced: list[torch.Tensor] | None = None, batch: int = DEFAULT_BATCH,
            on_prompt=None) -> list[Captured]:
    """`capture_batch` over `batch` prompts at a time, in input order (the grouping decides the
    padding; the same prompts always meet the same companions, so a later extension reproduces
    a build's forwards exactly)."""
    results: list[Captured] = []
    for start in range(0, len(prompts), batch):
        part = capture_batch(target, prompts[start:start + batch], layer_ids, max_new_tokens, stop_token_ids,
                             None if forced is None else forced[start:start + batch])
        results += part
        for captured in part:
            if on_prompt is not None:  # the tokens this prompt's continuation took (a progress bar counts them)
                on_prompt(len(captured.token_ids) - captured.prompt_len)
    return results
